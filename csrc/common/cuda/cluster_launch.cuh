// The cluster kernel's shapes and launches (cluster_kernel.cuh). row_cluster_shape says whether and with how many
// CTAs it applies (rows 16-byte aligned and no longer than kMaxClusterSize slices of kClusterCtaBytes);
// launch_row_cluster launches it, with a persistent grid and a tail launch for the rows of a last, part-empty round,
// or returns false where the device cannot make it resident (row_pass_cuda.cuh then runs row_pass_kernel).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <type_traits>

#include "common/cuda/cluster_kernel.cuh"

namespace rl_losses {
namespace cuda {

// 16-byte vectors in each CTA's slice when a row of `vocab` elements of `elem_bytes` is split over n_ctas:
// rounded up to a multiple of kClusterSliceAlign bytes where that still fits `cta_bytes`, so that in rows
// that start on such a boundary every slice does too (V = 128256: 64512-byte slices instead of 64128, whose
// starts alternate between 256- and 128-byte alignment; +0.3-0.7 points of the copy, docs/design.md v13).
constexpr int64_t kClusterSliceAlign = 512;
inline int64_t cluster_slice_vecs(int64_t vocab, int64_t elem_bytes, int n_ctas, int64_t cta_bytes) {
  const int64_t per_cta = (vocab + n_ctas - 1) / n_ctas;
  const int64_t vec = 16 / elem_bytes;
  const int64_t vecs = (per_cta + vec - 1) / vec;
  constexpr int64_t align_vecs = kClusterSliceAlign / 16;
  const int64_t rounded = (vecs + align_vecs - 1) / align_vecs * align_vecs;
  return n_ctas > 1 && rounded * 16 <= cta_bytes ? rounded : vecs;
}

struct ClusterShape {
  int ctas = 0;        // CTAs per row; 0: the cluster kernel does not apply
  int slice_vecs = 0;  // 16-byte vectors of each CTA's slice
};

// The shape with c CTAs per row, or ctas = 0 where the slices do not fit kClusterCtaBytes.
inline ClusterShape cluster_shape(const RowPassArgs& args, int c) {
  const int64_t slice_vecs =
      cluster_slice_vecs(args.logits.size(1), args.logits.element_size(), c, kClusterCtaBytes);
  if (slice_vecs * 16 > kClusterCtaBytes) return {};
  return {c, static_cast<int>(slice_vecs)};
}

// The shape row_cluster_kernel runs these arguments with: the fewest CTAs per row (1 to 16) whose slices fit
// (a power of two measured slower: 84.0% of the copy at V = 151936 bf16 with 8 CTAs, 88.1% with 5), 1 stage
// (launch_row_cluster falls back to row_pass_kernel where the device cannot make it resident). ctas = 0 where
// the kernel does not apply: not the fused shape, a device older than sm_90, rows of the logits or the
// gradient not 16-byte aligned, a row longer than kMaxClusterSize slices; a sampler floor computed before the pass
// (top_k, top_p: the split pass with row_pass_kernel measured faster, docs/design.md; min_p alone is computed in
// the kernel, cluster_sampler.cuh). cluster_shape_of_rows: the same but for the pass's shape and the floor (the
// batch-invariant mode's statistics in the kernel's order, cluster_order.cuh).
inline ClusterShape cluster_shape_of_rows(const RowPassArgs& args) {
  if (!args.logits.is_cuda() || !args.compute_stats() || !rows_16_byte_aligned(args)) return {};
  if (at::cuda::getDeviceProperties(args.logits.get_device())->major < 9) return {};
  for (int c = 1; c <= kMaxClusterSize; ++c) {
    const ClusterShape shape = cluster_shape(args, c);
    if (shape.ctas != 0) return shape;
  }
  return {};
}

inline ClusterShape row_cluster_shape(const RowPassArgs& args) {
  if (!args.write_grad() || args.logit_floor.defined()) return {};
  // The batch-invariant mode takes it only where its statistics-only passes can follow its order (cluster_order_shape:
  // V·element size a multiple of 16 bytes); rows of other sizes (a slice of padded logits) split.
  if (args.batch_invariant && args.logits.size(1) * args.logits.element_size() % 16 != 0) return {};
  return cluster_shape_of_rows(args);
}

// The cluster launch of `ctas` CTAs per cluster for `kernel` with `smem` bytes of dynamic shared memory (at most
// kClusterCtaBytes + kSliceSmemAlign): its attributes, and the clusters the current device can hold at once (0:
// none), asked of the occupancy calculator once per kernel, device and shape. row_cluster_kernel's launches take
// a ClusterShape; distillation's cluster kernel (distillation/distillation_cluster.cuh) gives its own bytes.
template <typename Kernel>
class ClusterLaunch {
 public:
  // The buffers of `shape`, and the most the kernel may skip to align them (the dynamic shared memory is
  // 16-byte aligned).
  ClusterLaunch(Kernel* kernel, const ClusterShape& shape)
      : ClusterLaunch(kernel, shape.ctas, static_cast<size_t>(shape.slice_vecs) * 16 + kSliceSmemAlign - 16) {
    slice_vecs_ = shape.slice_vecs;
  }
  ClusterLaunch(Kernel* kernel, int ctas, size_t smem) : kernel_(kernel), ctas_(ctas), smem_(smem) {
    TORCH_INTERNAL_ASSERT(smem <= static_cast<size_t>(kClusterCtaBytes + kSliceSmemAlign),
                          "rl_losses: a cluster CTA's shared memory beyond its bound");
    dim_.id = cudaLaunchAttributeClusterDimension;
    dim_.val.clusterDim.x = static_cast<unsigned>(ctas);
    dim_.val.clusterDim.y = 1;
    dim_.val.clusterDim.z = 1;
  }

  int resident_clusters() const {
    return occupancy_once(reinterpret_cast<const void*>(kernel_), ctas_, static_cast<int>(smem_), [&] {
      // Room for the largest buffers any shape takes, all of the SM's unified L1/shared memory as shared
      // memory so that 3 CTAs' buffers fit (the kernel's loads bypass L1 anyway), and clusters of 16 (beyond
      // the portable 8).
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kClusterCtaBytes + kSliceSmemAlign)));
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(static_cast<unsigned>(ctas_));
      cfg.blockDim = dim3(kClusterThreads);
      cfg.dynamicSmemBytes = smem_;
      cudaLaunchAttribute dim = dim_;
      cfg.attrs = &dim;
      cfg.numAttrs = 1;
      // A cluster cannot span GPCs, so this can be fewer than SMs x CTAs per SM / C. A shape the device
      // cannot make resident at all gives 0 or an error: the caller tries the next.
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel_, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();  // clear it
        clusters = 0;
      }
      return clusters;
    });
  }

  // row_cluster_kernel: `clusters` clusters over the view's rows.
  template <typename View, typename Epilogue>
  void operator()(const View& v, const Epilogue& epi, int64_t clusters, bool tail) const {
    launch(clusters, v, epi, slice_vecs_, /*stages=*/1, kClusterPieceBytes / 16, tail);
  }

  // `clusters` clusters of the kernel with these arguments.
  template <typename... Args>
  void launch(int64_t clusters, const Args&... args) const {
    DependentLaunch dl(dim3(static_cast<unsigned>(ctas_ * clusters)), kClusterThreads, smem_);
    dl.add(dim_);
    dl(kernel_, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  Kernel* kernel_;
  int ctas_;
  size_t smem_;
  int slice_vecs_ = 0;
  cudaLaunchAttribute dim_;
};

// Launches `kernel` (a row_cluster_kernel) over the rows of `args`; false where the device holds none of its
// clusters. The grid is persistent: as many clusters as can be resident at once, each taking every `clusters`-th
// row (any more would wait for a second wave). Rows dealt out that way leave the last round of a call part-empty
// when the clusters do not divide the rows (N = 4096, V = 32000: 396 clusters of 1 take 11 rounds for 10.3 rows
// each). Those rows go to a tail launch with more CTAs per row instead, each with a shorter slice, where slices of
// at least a piece fit and the device holds a cluster per tail row: its CTAs start on the SMs the main launch frees.
template <typename scalar_t, typename label_t, typename acc_t, typename Kernel, typename Epilogue>
bool run_row_cluster(Kernel* kernel, const RowPassArgs& args, const Epilogue& epi) {
  using Launch = ClusterLaunch<Kernel>;
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const ClusterShape shape = row_cluster_shape(args);
  if (shape.ctas == 0) return false;
  const Launch main_launch(kernel, shape);
  const int clusters = main_launch.resident_clusters();
  if (clusters == 0) return false;
  // No tail in the batch-invariant mode: its CTAs per row would reduce those rows in another order.
  const int64_t tail_rows = v.n_rows > clusters && !args.batch_invariant ? v.n_rows % clusters : 0;
  if (tail_rows != 0) {
    for (int c = kMaxClusterSize; c > shape.ctas; --c) {
      const ClusterShape tail = cluster_shape(args, c);
      if (tail.ctas == 0 || tail.slice_vecs * 16 < kClusterPieceBytes) continue;
      const Launch tail_launch(kernel, tail);
      if (tail_launch.resident_clusters() < tail_rows) continue;
      auto head = v, rest = v;
      head.n_rows = v.n_rows - tail_rows;
      rest.n_rows = tail_rows;
      rest.logits += head.n_rows * v.row_stride;
      rest.target += head.n_rows;
      rest.grad += head.n_rows * v.grad_row_stride;
      rest.row_offset += head.n_rows;
      if (v.row_index != nullptr) rest.row_index += head.n_rows;
      if (v.stats_out != nullptr) rest.stats_out += head.n_rows * RowStats<acc_t>::kFields;
      TORCH_INTERNAL_ASSERT(v.stats_in == nullptr, "rl_losses: the fused pass reads no statistics");
      main_launch(head, epi, clusters, false);
      tail_launch(rest, epi, tail_rows, true);
      return true;
    }
  }
  main_launch(v, epi, std::min<int64_t>(v.n_rows, clusters), false);
  return true;
}

// Launches row_cluster_kernel where it applies; returns false otherwise.
template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue,
          bool kMinP = false>
bool launch_row_cluster(const RowPassArgs& args, const Epilogue& epi) {
  // min_p's floor in the kernel: compiled only for the epilogues of ops that take the sampler's options.
  if constexpr (!kMinP && MaySample<Epilogue>::value) {
    if (args.min_p_in_pass) {
      return launch_row_cluster<scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue, true>(args, epi);
    }
  }
  TORCH_CHECK(!args.logit_floor.defined() && args.min_p_in_pass == kMinP,
              "rl_losses: internal error: a sampler floor this pass cannot read");
  // The chunk: the pass's own sums' in the default mode; in the batch-invariant mode that of the sums the mode's
  // order follows (the entropy's, else the smoothing's, wherever the epilogue may use them), without computing the
  // sums the call does not ask for (batch_invariant_pass, launch_cluster_order_stats).
  constexpr int kOwnChunk = kClusterChunkVecs<kEntropy, kSmoothing>;
  constexpr int kModeChunk = kClusterChunkVecs<Epilogue::kMayUseEntropy, Epilogue::kMayUseSmoothing>;
  if constexpr (kModeChunk != kOwnChunk) {
    if (args.batch_invariant) {
      return run_row_cluster<scalar_t, label_t, acc_t>(
          &row_cluster_kernel<kClusterThreads, scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue, kMinP,
                              kModeChunk>,
          args, epi);
    }
  }
  return run_row_cluster<scalar_t, label_t, acc_t>(
      &row_cluster_kernel<kClusterThreads, scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue, kMinP>, args,
      epi);
}

}  // namespace cuda
}  // namespace rl_losses
