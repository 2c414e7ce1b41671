// The batch-invariant mode's `row_stats` over rows of up to kWarpStatsMaxCols columns: one warp per row.
//
// Under a tensor-parallel group the mode cuts the vocabulary into blocks of V / 8 columns that every degree reduces
// alike, each a row of its own for `row_stats` (python/rl_losses/batch_invariance.py). Those rows are short (16032
// columns at V = 128256), and cluster_order_stats_kernel, one block per row, then spends a larger part of each row
// in its per-row steps (a block combine, a butterfly, three barriers) with no loads in flight: 16384 rows of a
// 64128-column bf16 shard took an H200 0.51 ms whole and 0.59 ms as 4 blocks each. Here a warp folds its row alone
// (no barrier; 8 vectors in flight per lane) and combines its lanes by a butterfly. A row's bits depend on its
// values and its width only: lane l takes the vectors l, l + 32, ... in online-softmax chunks of kWarpStatsChunk
// (two chunks loaded at a time, folded in order), the partial last vector first (on the lane it falls to), then
// RowStats::combine's butterfly, symmetric bit for bit. These bits differ from the fused pass's order, which the
// tensor-parallel ops never take: their statistics all come from `row_stats`.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "common/cuda/cluster_launch.cuh"
#include "common/cuda/vectors.cuh"
#include "common/dependent_launch.cuh"
#include "common/row_pass.h"

namespace rl_losses {
namespace cuda {

constexpr int64_t kWarpStatsMaxCols = 32768;
constexpr int kWarpStatsThreads = 256;
constexpr int kWarpStatsChunk = 4;  // vectors per online-softmax chunk

template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue>
__global__ void __launch_bounds__(kWarpStatsThreads)
    warp_row_stats_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi) {
  static_assert(!Epilogue::kSkipsUnlabelled, "row_stats' blocks without the label still need their statistics");
  constexpr int kVec = 16 / sizeof(scalar_t), kC = kWarpStatsChunk;
  using VecT = Pack<scalar_t, kVec>;
  wait_previous_grid();
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kWarpStatsThreads / 32);
  const int64_t n_full = v.vocab / kVec;
  const int rem = static_cast<int>(v.vocab % kVec);
  for (int64_t row = blockIdx.x * int64_t(kWarpStatsThreads / 32) + threadIdx.x / 32; row < v.n_rows; row += warps) {
    const int64_t label = static_cast<int64_t>(v.target[row]);
    const scalar_t* x = v.logits + row * v.row_stride;
    const VecT* xv = reinterpret_cast<const VecT*>(x);
    RowStats<acc_t> st = RowStats<acc_t>::empty();
    if (rem != 0 && lane == n_full % 32) {
      for (int k = 0; k < rem; ++k) {
        st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(x[n_full * kVec + k]), v.scale);
      }
    }
    int64_t i = lane;
    for (; i + (2 * kC - 1) * 32 < n_full; i += 2 * kC * 32) {
      VecT a[kC], b[kC];
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        a[c] = load_vec(&xv[i + c * 32]);
        b[c] = load_vec(&xv[i + (kC + c) * 32]);
      }
      add_vecs<kEntropy, kSmoothing>(st, a, v.scale);
      add_vecs<kEntropy, kSmoothing>(st, b, v.scale);
    }
    for (; i + (kC - 1) * 32 < n_full; i += kC * 32) {
      VecT a[kC];
#pragma unroll
      for (int c = 0; c < kC; ++c) a[c] = load_vec(&xv[i + c * 32]);
      add_vecs<kEntropy, kSmoothing>(st, a, v.scale);
    }
    for (; i < n_full; i += 32) {
      const VecT one[1] = {load_vec(&xv[i])};
      add_vecs<kEntropy, kSmoothing>(st, one, v.scale);
    }
    for (int m = 16; m > 0; m >>= 1) st = RowStats<acc_t>::combine(st, shfl_xor(st, m));
    if (lane == 0) {
      CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
      const int64_t local = label - v.vocab_start;
      st.label = label >= 0 && local >= 0 && local < v.vocab ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
      epi(v.epilogue_row(row), label, st);  // (row_stats' epilogue stores the statistics)
    }
  }
}

// Launches the pass over `args` (a statistics-only pass without sampler floors, rows 16-byte aligned: the caller
// copies them otherwise) as resident blocks of warps looping over the rows.
template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue>
void launch_warp_row_stats(const RowPassArgs& args, const Epilogue& epi) {
  auto* kernel = &warp_row_stats_kernel<scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue>;
  const int per_sm = occupancy_once(reinterpret_cast<const void*>(kernel), kWarpStatsThreads, 0, [&] {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kWarpStatsThreads, 0));
    return blocks;
  });
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const int64_t rows_per_block = kWarpStatsThreads / 32;
  const int64_t max_blocks =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * std::max(per_sm, 1);
  const int64_t blocks = std::min<int64_t>((v.n_rows + rows_per_block - 1) / rows_per_block, max_blocks);
  const dim3 grid(static_cast<unsigned>(blocks));
  DependentLaunch(grid, kWarpStatsThreads, 0)(kernel, v, epi);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace rl_losses
