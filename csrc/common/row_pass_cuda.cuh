// CUDA back-end of the row pass (row_pass.h): the dispatch over dtypes, statistics flags and block size
// (row_pass_cuda), the choice of kernel for the pass's shape (launch_row_pass), and the CUDA runner with its
// small reductions (CudaRunner).
//
// Three kernels, all persistent (each block or cluster loops over rows), with 16-byte global accesses; the
// two that compute statistics keep an online softmax state per thread (math.h) and reduce it per block:
// - row_cluster_kernel (cuda/cluster_kernel.cuh), for the fused shape (statistics and gradient in one launch:
//   CE, GRPO): a cluster of C CTAs per row, each holding its slice of the row in shared memory, so that the
//   logits are read from DRAM once and the gradient is written once (2 passes of memory traffic). The CTAs'
//   statistics are combined over distributed shared memory (sm_90). It applies when a row fits in C <= 16
//   slices of at most kClusterCtaBytes and the rows are 16-byte aligned (row_cluster_shape);
//   split_stats_pass_on_cuda (row_pass.h) gives every other fused call a statistics launch of its own first.
// - row_pass_kernel (cuda/row_kernel.cuh), one block per row, for the statistics-only shape and the
//   gradient-only one where rows are not aligned vectors (tensor parallelism, GSPO, the split path): each
//   reads the row once, and the gradient pass writes it once. A fused call that reaches it anyway (no
//   resident cluster fits) re-reads the row for its gradient: correct, but the re-read misses L2
//   (docs/design.md).
// - grad_rows_kernel (cuda/row_kernel.cuh), the gradient-only shape where rows are 16-byte aligned vectors
//   (as row_pass_kernel, without a barrier per row).
// Their shared vector and block pieces are in cuda/vectors.cuh. Row offsets are 64-bit. Labels >= vocab_total
// trip a device-side assert (as PyTorch's own losses do); the opt-in host check in Python reports them as a
// Python error instead.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "common/batch_invariant.h"
#include "common/cuda/block_steps.cuh"
#include "common/cuda/cluster_launch.cuh"
#include "common/cuda/cluster_order.cuh"
#include "common/cuda/row_kernel.cuh"
#include "common/dependent_launch.cuh"
#include "common/row_pass.h"
#include "common/sampler.h"

namespace rl_losses {
namespace cuda {

// Runs the pass with the kernel its shape takes: the cluster kernel for the fused shape where it applies, else
// row_pass_kernel; grad_rows_kernel for the gradient-only shape over aligned rows.
template <int kThreads, typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing,
          typename Epilogue>
void launch_row_pass(const RowPassArgs& args, const Epilogue& epi) {
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const bool stats = args.compute_stats(), grad = args.write_grad();
  // Grid: as many blocks as can be resident, each looping over rows (rows are dealt out statically, so a
  // block of a second wave would start its rows late). (One resident 1024-thread block per SM measured 1.7x
  // slower on an H100.)
  auto launch_resident = [&](auto* kernel) {
    const int per_sm = occupancy_once(reinterpret_cast<const void*>(kernel), kThreads, 0, [&] {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
      return blocks;
    });
    const int64_t max_blocks = static_cast<int64_t>(props->multiProcessorCount) * std::max(per_sm, 1);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, max_blocks)));
    DependentLaunch(grid, kThreads, 0)(kernel, v, epi);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread
  auto launch = [&](auto s, auto g) {
    constexpr bool kS = decltype(s)::value, kG = decltype(g)::value;
    // A pass with the sampler's floors always comes split (split_stats_pass_on_cuda, or the fused shape's fallback
    // below): the statistics alone, then the gradient from them; the fused and the statistics-given forward shapes
    // never read floors (min_p's computed in the cluster kernel aside).
    if constexpr (MaySample<Epilogue>::value && kS != kG) {
      if (args.logit_floor.defined()) {
        return launch_resident(&row_pass_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, kS, kG, kEntropy,
                                                kSmoothing, Epilogue, true>);
      }
    }
    TORCH_CHECK(!args.logit_floor.defined(), "rl_losses: internal error: a sampler floor this pass cannot read");
    launch_resident(
        &row_pass_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, kS, kG, kEntropy, kSmoothing, Epilogue>);
  };
  using T = std::true_type;
  using F = std::false_type;
  // Only the pass shapes the epilogue can be used in are compiled (see row_pass.h).
  TORCH_CHECK((stats || Epilogue::kMayReadStats) && (!grad || Epilogue::kMayWriteGrad),
              "rl_losses: internal error: unsupported row-pass shape");
  if constexpr (Epilogue::kMayWriteGrad) {
    if (stats && grad) {
      if (launch_row_cluster<scalar_t, label_t, acc_t, kEntropy, kSmoothing>(args, epi)) return;
      if (args.min_p_in_pass || args.batch_invariant) {
        // The cluster kernel does not apply or the device cannot make it resident. min_p's floor was to be computed
        // in it: the selection kernel's floor instead. The batch-invariant mode: the statistics in the order of its
        // statistics-only passes (batch_invariant_pass). Either way the pass split, as split_stats_pass_on_cuda
        // splits the others.
        RowPassArgs a = args;
        if (a.min_p_in_pass) {
          a.min_p_in_pass = false;
          a.logit_floor = sampler_floor("rl_losses", a, a.sampler_params);
        }
        floor_stats_pass_first(a);
        return launch_row_pass<kThreads, scalar_t, label_t, acc_t, kEntropy, kSmoothing>(a, epi);
      }
      return launch(T{}, T{});
    }
    if constexpr (Epilogue::kMayReadStats) {
      if (grad && grad_rows_aligned(args)) {
        return launch_resident(&grad_rows_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, Epilogue>);
      }
      if (grad) return launch(F{}, T{});
    }
  }
  // A statistics-only pass in the cluster kernel's order wherever the fused pass would take the cluster kernel, in
  // either mode: 3-14% faster than row_pass_kernel's on an H200 at V = 32000-256000 (bf16 and fp32;
  // benchmarks/results/h200-2026-11-27-order-stats.txt), and the no-gradient log-probs then equal the fused
  // pass's (617 rows of 16384 differed at V = 128256 with row_pass_kernel; 1, a tail row, with it).
  if (stats && !grad && launch_cluster_order_stats<scalar_t, label_t, acc_t, kEntropy, kSmoothing>(args, epi)) {
    return;
  }
  if (stats) return launch(T{}, F{});
  if constexpr (Epilogue::kMayReadStats) launch(F{}, F{});
}

// The pass the batch-invariant mode runs for `args` (RowPassArgs::batch_invariant). A row's statistics are
// reduced in one order whatever the pass: where the fused pass takes the cluster kernel (V·elem a multiple of 16
// on sm_90: row_cluster_shape), in its order, the statistics-only passes by cluster_order_stats_kernel (and the
// cluster kernel without its tail launch); elsewhere, and where the device cannot make the cluster resident, the
// fused passes split (launch_row_pass), their statistics pass the statistics-only passes' kernel. Here: the
// statistics computed with the entropy sums wherever the epilogue may use them, else with the smoothing sums, since
// either sets the kernels' online-softmax chunk (so a row reduces in one order with or without its entropy, in the
// no-gradient pass as in the gradient's; the sums' other uses are off where the op's options leave them unused),
// but for the passes on the cluster kernels, which take that chunk without the sums; and logits whose rows do not
// all start on 16-byte boundaries read from an aligned copy (row_pass_kernel reads a row's unaligned head element by
// element, so the order would follow the row's address). The gradient is written where `args` says: it is
// element-wise, the same from either copy.
// `a`'s logits read from a copy whose rows start on 16-byte boundaries, where some do not.
inline void align_rows(RowPassArgs& a) {
  const int64_t elem = a.logits.element_size(), vocab = a.logits.size(1);
  if (reinterpret_cast<uintptr_t>(a.logits.const_data_ptr()) % 16 != 0 || a.logits.stride(0) * elem % 16 != 0) {
    const int64_t per_vec = 16 / elem, cols = (vocab + per_vec - 1) / per_vec * per_vec;
    at::Tensor aligned = at::empty({a.logits.size(0), cols}, a.logits.options()).narrow(1, 0, vocab);
    a.logits = aligned.copy_(a.logits);
  }
}

template <typename Epi>
RowPassArgs batch_invariant_pass(const RowPassArgs& args) {
  RowPassArgs a = args;
  if (!a.compute_stats()) return a;
  align_rows(a);
  // The cluster kernel (a fused pass) and cluster_order_stats_kernel (a statistics-only pass) take the sums' chunk
  // from the epilogue in this mode (launch_row_cluster, launch_cluster_order_stats) and compute only the sums the
  // call asks for.
  if ((a.write_grad() ? row_cluster_shape(a) : cluster_order_shape(a)).ctas != 0) return a;
  if constexpr (Epi::kMayUseEntropy) {
    a.entropy = true;
  } else if constexpr (Epi::kMayUseSmoothing) {
    a.smoothing = true;
  }
  return a;
}

// Entry point: dispatch on dtypes, statistics flags and block size (by the shard width).
template <typename Epilogue_for>
void row_pass_cuda(const RowPassArgs& args, const char* name, Epilogue_for&& make_epilogue) {
  if (args.logits.size(0) == 0) return;
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), name, [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto epi = prescaled_epilogue<scalar_t>(args, make_epilogue(static_cast<acc_t*>(nullptr)));
    using Epi = std::decay_t<decltype(epi)>;
    std::optional<RowPassArgs> invariant;
    if (args.batch_invariant) invariant = batch_invariant_pass<Epi>(args);
    const RowPassArgs& a = invariant ? *invariant : args;
    // Rows of up to 64K elements get 256-thread blocks, several rows per SM at once: a 1024-thread block
    // covers a bf16 row of 32000 in one round of loads, and its per-row reductions then dominate (GSPO at
    // V = 32000 ran at 72% of the copy bandwidth, 90% at V = 128256). Longer rows: 1024.
    const bool small = a.logits.size(1) <= 65536;
    dispatch_stat_flags<Epi>(a, [&](auto entropy, auto smoothing) {
      constexpr bool kE = decltype(entropy)::value, kS = decltype(smoothing)::value;
      if (small) {
        launch_row_pass<256, scalar_t, int64_t, acc_t, kE, kS, Epi>(a, epi);
      } else {
        launch_row_pass<1024, scalar_t, int64_t, acc_t, kE, kS, Epi>(a, epi);
      }
    });
  });
}

}  // namespace cuda
}  // namespace rl_losses

namespace rl_losses {
namespace cuda {

template <typename F>
__global__ void for_each_kernel(int64_t n, F f) {
  wait_previous_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) f(i);
}

// sum_then in one block (block_sum_then): one launch where a column sum and the divisions after it took one each.
template <int kThreads, typename R>
__global__ void __launch_bounds__(kThreads) sum_then_kernel(int64_t n, R r) {
  wait_previous_grid();
  block_sum_then<kThreads>(n, r);
}

// (bk, bi) becomes the lesser of itself and (k, i) in the order of keys, then indices.
__device__ inline void keep_least(double& bk, int64_t& bi, double k, int64_t i) {
  if (k < bk || (k == bk && i < bi)) {
    bk = k;
    bi = i;
  }
}

// Every lane of the warp ends with the warp's least (bk, bi).
__device__ inline void warp_least(double& bk, int64_t& bi) {
  for (int m = 16; m > 0; m >>= 1) {
    const double k = __shfl_xor_sync(0xffffffffu, bk, m);
    const int64_t i = __shfl_xor_sync(0xffffffffu, bi, m);
    keep_least(bk, bi, k, i);
  }
}

// first[b], b < count: the indices i < n of smallest key.key(i), in that order, ties by index (a stable sort's
// first `count`). One block, one sweep of the keys per index taken, each sweep the least (key, i) after the last
// taken: for a few indices of a few thousand keys (clip_cov's and kl_cov's subsets), where a sort is several
// launches. Keys are never NaN (the key functor orders them).
template <int kThreads, typename K>
__global__ void __launch_bounds__(kThreads) select_first_kernel(int64_t n, int64_t count, K key, int64_t* first) {
  wait_previous_grid();
  __shared__ double warp_key[kThreads / 32];
  __shared__ int64_t warp_index[kThreads / 32];
  __shared__ double last_key;
  __shared__ int64_t last_index;
  if (threadIdx.x == 0) {
    last_key = -INFINITY;
    last_index = -1;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t b = 0; b < count; ++b) {
    const double lk = last_key;
    const int64_t li = last_index;
    double bk = INFINITY;
    int64_t bi = n;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const double k = key.key(i);
      if (k > lk || (k == lk && i > li)) keep_least(bk, bi, k, i);  // after the last taken
    }
    warp_least(bk, bi);
    if (lane == 0) {
      warp_key[warp] = bk;
      warp_index[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
      bk = lane < kThreads / 32 ? warp_key[lane] : INFINITY;
      bi = lane < kThreads / 32 ? warp_index[lane] : n;
      warp_least(bk, bi);
      if (lane == 0) {
        first[b] = bi;
        last_key = bk;
        last_index = bi;
      }
    }
    __syncthreads();
  }
}

// out[index[i], :] += values[i, :] for i < n (K columns, out zeroed before): add_rows_by_index over the grid. It
// replaces ATen's fill and index_add_ (a slow generic kernel: 9 us at N = 4096, 23 us at N = 16384 on an H100,
// contended by the few documents of a long-document batch).
template <int K, typename acc_t>
__global__ void sum_rows_by_index_kernel(int64_t n, const acc_t* values, const int64_t* index, acc_t* out) {
  wait_previous_grid();
  add_rows_by_index<K>((blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32 * 32, int64_t(gridDim.x) * blockDim.x, n,
                       values, index, out);
}

// The batch-invariant mode's sum_rows_by_index: out[s, :] = Σ values[order[j], :] over j in [ends[s - 1], ends[s])
// (order: the rows stably sorted by index; ends: the segments' cumulative lengths). A warp per segment, lane l
// summing its rows begin + l, begin + l + 32, ... in order, then a fixed butterfly: the same bits every run and
// for every position of the segment's rows in the batch, whatever the other segments.
template <int K, typename acc_t>
__global__ void sum_segments_in_order_kernel(int64_t n_segments, const acc_t* values, const int64_t* order,
                                             const int64_t* ends, acc_t* out) {
  wait_previous_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t s = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; s < n_segments; s += warps) {
    const int64_t begin = s == 0 ? 0 : ends[s - 1], end = ends[s];
    acc_t sum[K];
#pragma unroll
    for (int k = 0; k < K; ++k) sum[k] = acc_t(0);
    for (int64_t j = begin + lane; j < end; j += 32) {
      const int64_t i = order[j];
#pragma unroll
      for (int k = 0; k < K; ++k) sum[k] += values[i * K + k];
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      for (int m = 16; m > 0; m >>= 1) sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], m);
      if (lane == 0) out[s * K + k] = sum[k];
    }
  }
}

// sum_segments_in_order_kernel's sums without the sort: a warp per segment scans the whole index in chunks of 32
// rows, and the chunk's k-th row of the segment goes to the lane its rank in the segment falls to (rank mod 32), so
// that each lane adds the same rows in the same order as there: the same bits. One launch instead of a sort, an
// arange and a search, for N·S index reads (sum_rows_by_index_in_order picks it while those stay few). The loads of
// kScanAhead chunks (index, then the matching rows' values) are issued together before their chunks are added in
// order: one chunk at a time, the scan was a chain of dependent loads (GSPO's 16 documents of 1024 tokens in the
// batch-invariant mode: 124 µs on an H200, h200x2-2026-11-28-gspo-profile-7e3e046.txt).
constexpr int kScanAhead = 8;
template <int K, typename acc_t>
__global__ void sum_segments_by_scan_kernel(int64_t n, int64_t n_segments, const acc_t* values, const int64_t* index,
                                            acc_t* out) {
  wait_previous_grid();
  const unsigned lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t s = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; s < n_segments; s += warps) {
    acc_t sum[K];
#pragma unroll
    for (int k = 0; k < K; ++k) sum[k] = acc_t(0);
    unsigned rank = 0;  // the segment's rows in the chunks before (mod 32 is what counts)
    for (int64_t base = 0; base < n; base += 32 * kScanAhead) {  // warp-uniform bound: every lane reaches the votes
      bool match[kScanAhead];
      acc_t v[kScanAhead][K];
#pragma unroll
      for (int u = 0; u < kScanAhead; ++u) {
        const int64_t i = base + u * 32 + lane;
        match[u] = i < n && index[i] == s;
      }
#pragma unroll
      for (int u = 0; u < kScanAhead; ++u) {
        const int64_t i = base + u * 32 + lane;
#pragma unroll
        for (int c = 0; c < K; ++c) v[u][c] = match[u] ? values[i * K + c] : acc_t(0);
      }
#pragma unroll
      for (int u = 0; u < kScanAhead; ++u) {
        const unsigned mask = __ballot_sync(0xffffffffu, match[u]);
        if (mask == 0) continue;
        const unsigned m = __popc(mask);
        const unsigned k = (lane - rank) & 31u;  // this lane takes the chunk's k-th row of the segment, if k < m
        const int src = k < m ? static_cast<int>(__fns(mask, 0, static_cast<int>(k) + 1)) : static_cast<int>(lane);
#pragma unroll
        for (int c = 0; c < K; ++c) {
          const acc_t x = __shfl_sync(0xffffffffu, v[u][c], src);
          if (k < m) sum[c] += x;
        }
        rank += m;
      }
    }
#pragma unroll
    for (int c = 0; c < K; ++c) {
      for (int m = 16; m > 0; m >>= 1) sum[c] += __shfl_xor_sync(0xffffffffu, sum[c], m);
      if (lane == 0) out[s * K + c] = sum[c];
    }
  }
}

}  // namespace cuda

// The CUDA runner: what an op's back-end-independent code needs from a device (see gspo.h).
struct CudaRunner {
  template <typename MakeEpilogue>
  static void row_pass(const RowPassArgs& args, const char* name, MakeEpilogue&& make) {
    cuda::row_pass_cuda(args, name, std::forward<MakeEpilogue>(make));
  }
  template <typename F>
  static void for_each(int64_t n, const F& f) {
    if (n == 0) return;
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
    cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(cuda::for_each_kernel<F>, n, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // out[index[i], :] = Σ values[i, :] over the i with that index (out: (S, K), values: (N, K), contiguous):
  // a memset and one launch.
  template <int K>
  static void sum_rows_by_index(const at::Tensor& values, const at::Tensor& index, const at::Tensor& out) {
    if (out.numel() == 0) return;
    if (batch_invariant()) return sum_rows_by_index_in_order<K>(values, index, out);
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), at::cuda::getCurrentCUDAStream()));
    const int64_t n = values.size(0);
    if (n == 0) return;
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sum_rows_by_index", [&] {
      cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(
          cuda::sum_rows_by_index_kernel<K, scalar_t>, n, values.const_data_ptr<scalar_t>(),
          index.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // sum_rows_by_index with a fixed order of additions (the atomics' varies from run to run): a warp per segment
  // scanning the index where N·S stays within kScanReads, else a stable sort of the rows by index, each segment's end
  // in it (searchsorted: no host synchronisation) and a warp per segment; the same bits either way.
  static constexpr int64_t kScanReads = int64_t(1) << 24;
  template <int K>
  static void sum_rows_by_index_in_order(const at::Tensor& values, const at::Tensor& index, const at::Tensor& out) {
    const int64_t segments = out.size(0);
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((segments * 32 + kThreads - 1) / kThreads, 65535);
    if (values.size(0) * segments <= kScanReads) {
      AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sum_rows_by_index", [&] {
        cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(
            cuda::sum_segments_by_scan_kernel<K, scalar_t>, values.size(0), segments, values.const_data_ptr<scalar_t>(),
            index.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>());
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const auto [sorted, order] = index.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor ends = at::searchsorted(sorted, at::arange(segments, index.options()), /*out_int32=*/false,
                                             /*right=*/true);
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sum_rows_by_index", [&] {
      cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(
          cuda::sum_segments_in_order_kernel<K, scalar_t>, segments, values.const_data_ptr<scalar_t>(),
          order.const_data_ptr<int64_t>(), ends.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // first[b], b < count <= n: the indices of the `count` smallest key.key(i), in order, ties by index, in one
  // single-block launch (select_first_kernel).
  template <typename K>
  static void select_first(int64_t n, int64_t count, const K& key, int64_t* first) {
    if (count == 0) return;
    cuda::DependentLaunch(1, 1024, 0)(cuda::select_first_kernel<1024, K>, n, count, key, first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // r.finish(s) once, with s[k] = Σ_{i < n} of r.terms(i)[k] (see row_pass.h), in one single-block launch (the
  // sums here are over tokens or documents, read from L2 right after they were written).
  template <typename R>
  static void sum_then(int64_t n, const R& r) {
    cuda::DependentLaunch(1, 1024, 0)(cuda::sum_then_kernel<1024, R>, n, r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // The steps in order (row_pass.h): one single-block launch (cuda::chain_kernel) where each step has at most
  // kChainItems items, else a launch (or two) per step. The same bits either way, but for the atomics' order of a
  // sum by index, which the batch-invariant mode fixes by the step's own kernels.
  static constexpr int64_t kChainItems = 1024;
  template <typename... S>
  static void chain(const S&... steps) {
    static_assert((sizeof(decltype(on_device(steps))) + ...) <= 4096, "a chain's steps exceed a kernel's parameters");
    if ((batch_invariant() && (is_sum_by_index(steps) || ...)) || std::max({items(steps)...}) > kChainItems) {
      (run_step<CudaRunner>(steps), ...);
      return;
    }
    cuda::DependentLaunch(1, 1024, 0)(cuda::chain_kernel<1024, std::decay_t<decltype(on_device(steps))>...>,
                                      on_device(steps)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  template <typename F>
  static int64_t items(const ForEachStep<F>& s) { return s.n; }
  template <int K, typename T>
  static int64_t items(const SumByIndexStep<K, T>& s) { return std::max(s.values.size(0), s.out.size(0)); }
  template <typename R>
  static int64_t items(const SumThenStep<R>& s) { return s.n; }
  template <typename S>
  static constexpr bool is_sum_by_index(const S&) { return false; }
  template <int K, typename T>
  static constexpr bool is_sum_by_index(const SumByIndexStep<K, T>&) { return true; }
  template <typename S>
  static const S& on_device(const S& s) { return s; }
  template <int K, typename T>
  static cuda::SumByIndexArgs<K, T> on_device(const SumByIndexStep<K, T>& s) {
    return {s.values.size(0), s.values.template const_data_ptr<T>(), s.index.template const_data_ptr<int64_t>(),
            s.out.template data_ptr<T>(), s.out.size(0)};
  }
};

}  // namespace rl_losses
