// Device pieces both CUDA kernels of distillation share (distillation_cuda.cu's one-block-per-row passes and
// the cluster kernel, distillation_cluster.cuh): aligned loads of a few elements, a group of columns folded
// into the statistics, and the block reductions of DistillStats and of a sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cuda/vectors.cuh"
#include "distillation/distillation_math.h"

namespace rl_losses {
namespace distill_cuda {

// K elements of T from p in as few aligned loads as their bytes allow (16, 8 or 4 bytes each).
template <typename T, int K>
__device__ inline void load_elems(const T* p, T (&out)[K]) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    uint4 raw[kBytes / 16];
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
    memcpy(out, raw, kBytes);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    memcpy(out, &raw, kBytes);
  } else {
    static_assert(kBytes == 4, "4, 8 or a multiple of 16 bytes");
    const unsigned raw = *reinterpret_cast<const unsigned*>(p);
    memcpy(out, &raw, kBytes);
  }
}

// K elements of T from shared memory at the 32-bit shared address `addr` (aligned as load_elems'). The cluster
// kernel's slices are read this way: through generic pointers ptxas recomputed the shared window's base for every
// group (~14 instructions per 16 bytes: S2UR of the CTA id, the alignment's arithmetic, 64-bit address math), about
// a tenth of the statistics loop's instructions (Nsight Compute's source view, H200, 2026-11-27).
template <typename T, int K>
__device__ inline void load_shared_elems(unsigned addr, T (&out)[K]) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  unsigned w[kBytes / 4];
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[4 * i]), "=r"(w[4 * i + 1]), "=r"(w[4 * i + 2]), "=r"(w[4 * i + 3])
                   : "r"(addr + 16 * i));
    }
  } else if constexpr (kBytes == 8) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
  } else {
    static_assert(kBytes == 4, "4, 8 or a multiple of 16 bytes");
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w[0]) : "r"(addr));
  }
  memcpy(out, w, kBytes);
}

// K values rounded to student_t and stored as one 16-byte vector at p (16-byte aligned, global memory): pairs of
// bf16 / fp16 by one cvt.rn.*x2.f32 each (the element-wise conversion takes one per value). The store is written
// out: a uint4 assembled by memcpy from the rounded array and stored through a uint4 pointer compiled to four
// 4-byte stores (Nsight Compute: 75% of the kernel's L2 sectors excess, four store instructions for one).
template <typename student_t, typename acc_t, int K>
__device__ inline void store_rounded(student_t* p, const acc_t (&g)[K]) {
  static_assert(K * sizeof(student_t) == 16, "one 16-byte vector");
  unsigned w[4];
  if constexpr (std::is_same_v<student_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
#pragma unroll
    for (int k = 0; k < K; k += 2) {
      const __nv_bfloat162 two = __floats2bfloat162_rn(g[k], g[k + 1]);
      memcpy(&w[k / 2], &two, sizeof(two));
    }
  } else if constexpr (std::is_same_v<student_t, c10::Half> && std::is_same_v<acc_t, float>) {
#pragma unroll
    for (int k = 0; k < K; k += 2) {
      const __half2 two = __floats2half2_rn(g[k], g[k + 1]);
      memcpy(&w[k / 2], &two, sizeof(two));
    }
  } else {
    student_t out[K];
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = static_cast<student_t>(g[k]);
    memcpy(w, out, sizeof(w));
  }
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
}

// n pairs (x, y) folded into the state, given their maxima: one rescale and one −inf test per group rather
// than per element (kSums: DistillStats::add_at_max's). The rescale's tests are predicated and the −inf test is
// uniform across a warp after a row's first group. A branch on "no new maximum" instead (7 instructions a group
// where these take 13) made the KLs' cluster kernel 26% slower on an H200 (docs/distillation_dpo.md): a new
// maximum is frequent somewhere among a warp's 32 lanes, so the warp runs both paths. The cluster kernel's;
// add_group below, the separate statistics pass's, takes the maxima itself and tests per element (the group's code
// twice, as here, made its fp64 instantiations spill).
template <int kSums = kAllSums, int n, typename acc_t>
__device__ inline void add_group_at(DistillStats<acc_t>& st, const acc_t (&x)[n], const acc_t (&y)[n], acc_t mx,
                                    acc_t my) {
  st.rescale(mx, my);
  if (st.ms != neg_inf<acc_t>() && st.mt != neg_inf<acc_t>()) {
#pragma unroll
    for (int k = 0; k < n; ++k) st.template add_at_max<kSums, true>(x[k], y[k]);
  } else {
#pragma unroll
    for (int k = 0; k < n; ++k) st.template add_at_max<kSums>(x[k], y[k]);
  }
}

template <int kSums = kAllSums, int n, typename acc_t>
__device__ inline void add_group(DistillStats<acc_t>& st, const acc_t (&x)[n], const acc_t (&y)[n]) {
  acc_t mx = x[0], my = y[0];
#pragma unroll
  for (int k = 1; k < n; ++k) {
    mx = ::fmax(mx, x[k]);
    my = ::fmax(my, y[k]);
  }
  st.rescale(mx, my);
#pragma unroll
  for (int k = 0; k < n; ++k) st.template add_at_max<kSums>(x[k], y[k]);
}

// max_k x_k of x_k = z_k·scale (scale > 0, so that the rounded products keep the order of z): over packed bf16
// pairs (one instruction per pair; __hmax2, like fmax, returns the other input where one is NaN), else fmax.
// The last pair's two halves are compared packed as well, against the pair with its halves swapped, and the high
// half read as fp32 by a mask: 2 instructions where converting both halves and an fmaxf took 4 to 5.
template <typename T, int K>
__device__ inline float scaled_max(const cuda::Pack<T, K>& z, const float (&x)[K], float scale) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && K % 2 == 0) {
    __nv_bfloat162 pairs[K / 2];
    memcpy(pairs, &z, sizeof(pairs));
    const __nv_bfloat162 m2 = tree_reduce(pairs, [](__nv_bfloat162 a, __nv_bfloat162 b) { return __hmax2(a, b); });
    const __nv_bfloat162 both = __hmax2(m2, __lowhigh2highlow(m2));
    unsigned w;
    memcpy(&w, &both, sizeof(w));
    return __uint_as_float(w & 0xffff0000u) * scale;
  } else {
    float m = x[0];
#pragma unroll
    for (int k = 1; k < K; ++k) m = ::fmaxf(m, x[k]);
    return m;
  }
}

// kSums: the weighted sums to exchange (DistillStats::combine's; the others are 0, and not shuffled).
template <int kSums = kAllSums, typename acc_t>
__device__ inline DistillStats<acc_t> shfl_xor(const DistillStats<acc_t>& s, int m) {
  auto shfl = [&](acc_t x, int bit) { return (kSums & bit) != 0 ? __shfl_xor_sync(0xffffffffu, x, m) : acc_t(0); };
  return {__shfl_xor_sync(0xffffffffu, s.ms, m), __shfl_xor_sync(0xffffffffu, s.ss, m),
          __shfl_xor_sync(0xffffffffu, s.mt, m), __shfl_xor_sync(0xffffffffu, s.st, m),
          shfl(s.wt, kSumWt), shfl(s.ws, kSumWs), shfl(s.hx, kSumHx)};
}

// The block's combined state, in every lane of warp 0 (the same bits: combine is commutative, and each
// butterfly step combines the same two values in both lanes): warps by shuffles, then warp 0 over the warps'.
// kSums: the weighted sums the states hold (the cluster kernel's kind's: a step of the forward KL's takes 2 shuffles
// and 6 instructions of products fewer than one of all of them).
template <int kThreads, int kSums = kAllSums, typename acc_t>
__device__ inline DistillStats<acc_t> block_combine(DistillStats<acc_t> s, DistillStats<acc_t>* scratch) {
  using Stats = DistillStats<acc_t>;
  constexpr int kWarps = kThreads / 32;
  for (int m = 16; m > 0; m >>= 1) s = Stats::template combine<kSums>(s, shfl_xor<kSums>(s, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? scratch[lane] : Stats::empty();
    for (int m = 16; m > 0; m >>= 1) s = Stats::template combine<kSums>(s, shfl_xor<kSums>(s, m));
  }
  return s;
}

// The block's sum, in every lane of warp 0.
template <int kThreads, typename acc_t>
__device__ inline acc_t block_sum(acc_t x, acc_t* scratch) {
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : acc_t(0);
  if (warp == 0) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  }
  return x;
}

}  // namespace distill_cuda
}  // namespace rl_losses
