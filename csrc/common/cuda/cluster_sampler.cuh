// min_p's floor (common/sampler.h) in the cluster kernel (cluster_kernel.cuh): where min_p is the only filter of a
// fused call (RowPassArgs::min_p_in_pass; per-row values from v.sampler_params), no selection kernel runs before the
// pass (sampler_cuda.cu: a read of the logits of its own) and the pass is not split into a statistics launch and a
// gradient launch (two more reads): the cluster computes each row's floor from the slices it already holds in shared
// memory, in three exchanges between its CTAs instead of one:
//   1. the max of each slice (no exponentials; NaN where the slice holds a NaN, as the floor kernel's), exchanged:
//      the row's raw max m;
//   2. over the slice in shared memory, the least logit min_p keeps (e^(s·z − s·m) ≥ min_p, ExpShifted: the same
//      test, on the same values, as the floor kernel's, so the same tokens are kept), lowered to the label's logit
//      where the slice holds the label (sampler.h's floor_with_label: the floor is the least of the kept logits and
//      the label's); exchanged as a min: the floor, or −inf where nothing is filtered (m NaN or −inf, min_p = 0),
//      exactly as the floor kernel's;
//   3. the statistics over the logits at or above the floor (the plain kernel's loop, with add_vecs<…, kFloor> as
//      row_pass_kernel applies a floor, from shared memory), exchanged as the plain kernel's, then its epilogue and
//      gradient (GradOf<…, kFloor>: zero below the floor). Most of a row lies below the floor of a filter that keeps
//      few tokens: those helpers skip a chunk wholly below it in the statistics and write its zero gradient without
//      exponentials.
// The other filters' floors (top_k, top_p) come from the selection kernel, and their pass runs split with
// row_pass_kernel: applied in this kernel they measured slower (docs/design.md).
// Vectors whose max min_p cannot keep are skipped in step 2 with the floor kernel's margin (SamplerRow::
// min_p_may_keep). Each exchange has its own slots and mbarrier per row parity, used as the plain kernel's (a slot
// is rewritten two rows later, which a peer reaches only after this CTA's last exchange of the row between).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cuda/vectors.cuh"
#include "common/sampler.h"

namespace rl_losses {
namespace cuda {

constexpr int kMaxClusterSize = 16;  // 8 is portable; H100/H200 allow 16 (NonPortableClusterSizeAllowed)

// Writes `value` into `dst` of the cluster's CTA `rank` (dst: this CTA's address of the same variable) and
// counts its bytes on that CTA's mbarrier `bar` (st.async, sm_90): no fence, no cluster barrier.
template <typename T>
__device__ inline void send_to_rank(T* dst, const T& value, uint64_t* bar, unsigned rank) {
  static_assert(sizeof(T) % 4 == 0, "sent as 32-bit words");
  unsigned words[sizeof(T) / 4];
  memcpy(words, &value, sizeof(T));
  unsigned remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_dst) : "r"(smem_addr(dst)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_bar) : "r"(smem_addr(bar)), "r"(rank));
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T) / 4); ++k) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                     remote_dst + 4 * k),
                 "r"(words[k]), "r"(remote_bar)
                 : "memory");
  }
}

// The least of a and b where neither is NaN, else NaN (step 1's max, negated: a NaN in a row reaches the row's max).
template <typename acc_t>
__device__ inline acc_t nan_min(acc_t a, acc_t b) {
  return a != a ? a : (b != b ? b : ::fmin(a, b));
}

// The shared state of the kMinP exchanges 1 and 2 (the third is the plain kernel's), by row parity; nothing for the
// plain kernel.
template <bool kMinP, typename acc_t>
struct ClusterMinPShared {
  __device__ void init() {}
};
template <typename acc_t>
struct ClusterMinPShared<true, acc_t> {
  acc_t maxes[2][kMaxClusterSize];            // step 1: each CTA's raw max
  acc_t lowest[2][kMaxClusterSize];           // step 2: each CTA's least kept logit (or the label's, or NaN)
  uint64_t maxes_full[2], lowest_full[2];
  acc_t scratch[32];
  acc_t row_max, floor;  // the row's raw max, its floor
  __device__ void init() {
    for (int q = 0; q < 2; ++q) {
      mbarrier_init(&maxes_full[q]);
      mbarrier_init(&lowest_full[q]);
    }
  }
};

// One value of every CTA of the cluster, in warp 0: the block's `mine` (the same in each thread of warp 0) is sent to
// every CTA's slot `rank` of `slots` (counted on `full`), and lane l < n_ctas returns rank l's, the others `none`.
// Thread 0 announces the bytes; warp 0 waits for the barrier's `phase`.
template <typename T>
__device__ inline T cluster_gather(const T& mine, T* slots, uint64_t* full, int rank, int n_ctas, unsigned phase,
                                   const T& none) {
  if (threadIdx.x == 0) mbarrier_arrive_expect(full, n_ctas * static_cast<unsigned>(sizeof(T)));
  if (threadIdx.x < n_ctas) send_to_rank(&slots[rank], mine, full, threadIdx.x);
  mbarrier_wait(full, phase);
  return static_cast<int>(threadIdx.x) < n_ctas ? slots[threadIdx.x] : none;
}

// Step 1 for one thread: the raw max of its vectors of the slice (n_full from `slice`, each read once wait_piece(i)
// says it has landed) and, where owns_rem, of the rem elements of the row's end, read from `x` (global) and stored at
// slice[n_full] (as the statistics loop does).
template <int kThreads, typename acc_t, typename VecT, typename scalar_t, typename WaitPiece>
__device__ inline acc_t slice_max(VecT* slice, const scalar_t* x, int n_full, int rem, bool owns_rem,
                                  WaitPiece&& wait_piece) {
  constexpr int kVec = sizeof(VecT::v) / sizeof(VecT::v[0]);
  acc_t m = neg_inf<acc_t>();
  if (owns_rem) {
    VecT part;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < rem) {
        part.v[k] = x[n_full * kVec + k];
        m = max_nan(m, static_cast<acc_t>(part.v[k]));
      }
    }
    store_vec(&slice[n_full], part);
  }
  int i = threadIdx.x;
  for (; i + 3 * kThreads < n_full; i += 4 * kThreads) {  // chunks of 4 vectors, within a piece
    wait_piece(i);
    VecT chunk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) chunk[c] = load_vec(&slice[i + c * kThreads]);
#pragma unroll
    for (int c = 0; c < 4; ++c) m = max_nan(m, static_cast<acc_t>(vec_max_nan(chunk[c])));
  }
  for (; i < n_full; i += kThreads) {
    wait_piece(i);
    m = max_nan(m, static_cast<acc_t>(vec_max_nan(load_vec(&slice[i]))));
  }
  return m;
}

// Step 2 for one thread: its least logit of the slice (n_full vectors from `slice`, the rem elements of the vector at
// n_full where owns_rem) that min_p keeps (a row without NaN: step 1 leaves a row with one unfiltered).
template <int kThreads, typename acc_t, typename VecT>
__device__ inline acc_t min_p_lowest(const VecT* slice, int n_full, int rem, bool owns_rem,
                                     const ExpShifted<acc_t>& e_of, const SamplerRow<acc_t>& o) {
  constexpr int kVec = sizeof(VecT::v) / sizeof(VecT::v[0]);
  acc_t lowest = -neg_inf<acc_t>();
  auto take = [&](acc_t x) {
    if (o.min_p_keeps(e_of(x))) lowest = ::fmin(lowest, x);
  };
  for (int i = threadIdx.x; i < n_full; i += kThreads) {
    const VecT z = load_vec(&slice[i]);
    if (o.min_p_may_keep(e_of(static_cast<acc_t>(vec_max_nan(z))))) {
      acc_t x[kVec];
      unpack(z, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) take(x[k]);
    }
  }
  if (owns_rem) {
    const VecT part = load_vec(&slice[n_full]);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < rem) take(static_cast<acc_t>(part.v[k]));
    }
  }
  return lowest;
}

// The NaN-propagating min of the block's values, in every thread of warp 0 (scratch: 32 values).
template <int kThreads, typename acc_t>
__device__ inline acc_t block_nan_min(acc_t x, acc_t* scratch) {
  constexpr int kWarps = kThreads / 32;
  for (int m = 16; m > 0; m >>= 1) x = nan_min(x, __shfl_xor_sync(0xffffffffu, x, m));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[threadIdx.x % kWarps];
  for (int m = kWarps / 2; m > 0; m >>= 1) x = nan_min(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

}  // namespace cuda
}  // namespace rl_losses
