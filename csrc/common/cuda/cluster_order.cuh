// The statistics-only pass where the fused pass runs the cluster kernel, in either mode (docs/consistency.md,
// "Batch invariance"; faster than row_pass_kernel's too): each row reduced in the cluster kernel's order, so that the
// no-gradient pass (token_log_probs, any op under torch.no_grad(), a split pass's statistics) gives the fused
// pass's bits while that pass keeps its one read of the logits. One block per row (persistent, as row_pass_kernel)
// of the cluster's kClusterThreads threads walks the row's C slices in rank order; in each it folds the vectors
// and the partial last one exactly as CTA r of row_cluster_kernel does (the same thread for each vector, the same
// online-softmax chunks, the remainder first, then block_combine), and the C states are then combined by the
// cluster kernel's butterfly in warp 0. It reads the slices from global memory instead of shared memory: the
// values and the order of their additions are the same.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include "common/cuda/cluster_launch.cuh"
#include "common/cuda/vectors.cuh"
#include "common/dependent_launch.cuh"

namespace rl_losses {
namespace cuda {

// kFloor: the sampler's floor of each row in v.floor (the cluster kernel's kMinP floor is the same value). kChunk:
// the online-softmax chunk of the fused pass whose order this pass follows (launch_cluster_order_stats).
template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue,
          bool kFloor, int kChunk>
__global__ void __launch_bounds__(kClusterThreads)
    cluster_order_stats_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi, int n_ctas, int slice_vecs) {
  constexpr int kThreads = kClusterThreads, kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  __shared__ RowStats<acc_t> scratch[32];
  __shared__ RowStats<acc_t> slices[kMaxClusterSize];
  wait_previous_grid();
  int ctas_pow2 = 1;
  while (ctas_pow2 < n_ctas) ctas_pow2 *= 2;

  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const int64_t label = static_cast<int64_t>(v.target[row]);
    if (Epilogue::kSkipsUnlabelled && label < 0) {  // the cluster kernel neither reads nor exchanges such a row
      if (threadIdx.x == 0) {
        epi(v.epilogue_row(row), label, RowStats<acc_t>::empty());
        if (v.stats_out != nullptr) store_stats(v.stats_out, row, RowStats<acc_t>::empty());
      }
      continue;
    }
    const acc_t floor = kFloor ? v.floor[row] : acc_t(0);
    for (int rank = 0; rank < n_ctas; ++rank) {
      const int64_t begin = static_cast<int64_t>(rank) * slice_vecs * kVec;
      const int n_elems = static_cast<int>(
          std::max<int64_t>(0, std::min<int64_t>(v.vocab - begin, static_cast<int64_t>(slice_vecs) * kVec)));
      const int n_full = n_elems / kVec, rem = n_elems % kVec;
      const bool owns_rem = rem != 0 && static_cast<int>(threadIdx.x) == n_full % kThreads;
      const scalar_t* x = v.logits + row * v.row_stride + begin;
      const VecT* xv = reinterpret_cast<const VecT*>(x);
      RowStats<acc_t> st = RowStats<acc_t>::empty();
      if (owns_rem) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (k < rem) {
            const acc_t z = static_cast<acc_t>(x[n_full * kVec + k]);
            st.template add<kEntropy, kSmoothing>(kFloor && z < floor ? neg_inf<acc_t>() : z, v.scale);
          }
        }
      }
      int i = threadIdx.x;
      for (; i + (kChunk - 1) * kThreads < n_full; i += kChunk * kThreads) {
        VecT chunk[kChunk];
#pragma unroll
        for (int c = 0; c < kChunk; ++c) chunk[c] = load_vec(&xv[i + c * kThreads]);
        add_vecs<kEntropy, kSmoothing, kFloor>(st, chunk, v.scale, floor);
      }
      for (; i < n_full; i += kThreads) {
        const VecT one[1] = {load_vec(&xv[i])};
        add_vecs<kEntropy, kSmoothing, kFloor>(st, one, v.scale, floor);
      }
      st = block_combine<kThreads>(st, scratch);
      if (threadIdx.x == 0) {
        const int64_t local = label - v.vocab_start - begin;
        st.label = label >= 0 && local >= 0 && local < n_elems ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
        slices[rank] = st;
      }
      __syncthreads();  // scratch is rewritten by the next slice's block_combine
    }
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      RowStats<acc_t> all = lane < n_ctas ? slices[lane] : RowStats<acc_t>::empty();
      for (int m = ctas_pow2 / 2; m > 0; m >>= 1) all = RowStats<acc_t>::combine(all, shfl_xor(all, m));
      if (lane == 0) {
        CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
        epi(v.epilogue_row(row), label, all);
        if (v.stats_out != nullptr) store_stats(v.stats_out, row, all);
      }
    }
    __syncthreads();  // slices are rewritten by the next row
  }
}

// The shape the fused pass of the batch-invariant mode gives these rows (row_cluster_shape with a gradient of
// the same rows: contiguous rows of V elements, 16-byte aligned where V·elem is a multiple of 16), or ctas = 0.
inline ClusterShape cluster_order_shape(const RowPassArgs& args) {
  if (args.logits.size(1) * args.logits.element_size() % 16 != 0) return {};
  return cluster_shape_of_rows(args);
}

// Runs the statistics-only pass in the cluster kernel's order where the mode's fused pass would take the cluster
// kernel; false otherwise, having launched nothing.
template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue>
bool launch_cluster_order_stats(const RowPassArgs& args, const Epilogue& epi) {
  const ClusterShape shape = cluster_order_shape(args);
  if (shape.ctas == 0) return false;
  auto run = [&](auto* kernel) {
    const int per_sm = occupancy_once(reinterpret_cast<const void*>(kernel), kClusterThreads, 0, [&] {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kClusterThreads, 0));
      return blocks;
    });
    const auto v = make_view<scalar_t, label_t, acc_t>(args);
    const int64_t max_blocks =
        static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * std::max(per_sm, 1);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, max_blocks)));
    DependentLaunch(grid, kClusterThreads, 0)(kernel, v, epi, shape.ctas, shape.slice_vecs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // The chunk: the fused pass's own (that of this pass's sums) in the default mode; in the batch-invariant mode
  // that of the sums the epilogue may use (the entropy's, else the smoothing's), which the mode's fused pass takes
  // too (launch_row_cluster), so that a row folds in one order while this pass computes only the sums the call asks
  // for (the entropy's cost the order kernel 27% at V = 128256 bf16: h200-2026-11-27-order-stats.txt).
  constexpr int kOwnChunk = kClusterChunkVecs<kEntropy, kSmoothing>;
  constexpr int kModeChunk = kClusterChunkVecs<Epilogue::kMayUseEntropy, Epilogue::kMayUseSmoothing>;
  auto run_chunk = [&](auto floor) {
    constexpr bool kF = decltype(floor)::value;
    if constexpr (kModeChunk != kOwnChunk) {
      if (args.batch_invariant) {
        return run(&cluster_order_stats_kernel<scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue, kF,
                                               kModeChunk>);
      }
    }
    run(&cluster_order_stats_kernel<scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue, kF, kOwnChunk>);
  };
  if constexpr (MaySample<Epilogue>::value) {
    if (args.logit_floor.defined()) {
      run_chunk(std::true_type{});
      return true;
    }
  }
  TORCH_CHECK(!args.logit_floor.defined(), "rl_losses: internal error: a sampler floor this pass cannot read");
  run_chunk(std::false_type{});
  return true;
}

}  // namespace cuda
}  // namespace rl_losses
