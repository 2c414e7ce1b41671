// What one block does of the O(N + S) steps between and after the row passes (row_pass.h: ForEachStep,
// SumByIndexStep, SumThenStep), shared by the kernels that run one step each (row_pass_cuda.cuh) and by
// chain_kernel, which runs a call's short chain of steps in one single-block launch: at small shapes each launch
// costs the host more than its step costs the device (docs/host_time.md), and a chain of six steps is one launch.
#pragma once

#include <cstdint>

#include "common/dependent_launch.cuh"
#include "common/row_pass.h"

namespace rl_losses {
namespace cuda {

// out[index[i], :] += values[i, :] for the i in [first + k·stride, +32) of each k, first a multiple of 32 (K
// columns). A warp whose 32 rows share one index (the common case: packed documents are runs of tokens) adds their
// sum with one atomic per column; any other warp adds row by row. Atomic, so the order of the additions varies
// between runs (the batch-invariant mode takes sum_segments_in_order_kernel instead).
template <int K, typename acc_t>
__device__ __forceinline__ void add_rows_by_index(int64_t first, int64_t stride, int64_t n, const acc_t* values,
                                                  const int64_t* index, acc_t* out) {
  const int lane = threadIdx.x % 32;
  // The loop bound is warp-uniform (base is a multiple of 32), so every lane reaches the warp votes.
  for (int64_t base = first; base < n; base += stride) {
    const int64_t i = base + lane;
    const bool in = i < n;
    const int64_t s = in ? index[i] : -1;
    const int64_t s0 = __shfl_sync(0xffffffffu, s, 0);
    if (__all_sync(0xffffffffu, in && s == s0)) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        acc_t v = values[i * K + k];
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (lane == 0) atomicAdd(out + s0 * K + k, v);
      }
    } else if (in) {
#pragma unroll
      for (int k = 0; k < K; ++k) atomicAdd(out + s * K + k, values[i * K + k]);
    }
  }
}

// One block's sum_then: each thread sums the terms of its indices i ≡ threadIdx.x (mod kThreads) in order, a fixed
// tree combines the threads, thread 0 finishes. Deterministic.
template <int kThreads, typename R>
__device__ __forceinline__ void block_sum_then(int64_t n, const R& r) {
  using acc_t = typename R::acc_t;
  constexpr int K = R::kTerms;
  acc_t s[K];
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = acc_t(0);
  // Unrolled so that a thread's loads of several indices are in flight together: at small N this is a few
  // dependent L2 round trips per thread, on the critical path right after the row pass.
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    acc_t v[K];
    r.terms(i, v);
#pragma unroll
    for (int k = 0; k < K; ++k) s[k] += v[k];
  }
  auto warp_sum = [](acc_t x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
  };
  __shared__ acc_t partial[kThreads / 32][K];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    s[k] = warp_sum(s[k]);
    if (lane == 0) partial[warp][k] = s[k];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = warp_sum(lane < kThreads / 32 ? partial[lane][k] : acc_t(0));
  if (lane == 0) r.finish(s);
}

// SumByIndexStep as a kernel takes it: (n, K) values, n indices, (segments, K) sums.
template <int K, typename T>
struct SumByIndexArgs {
  int64_t n;
  const T* values;
  const int64_t* index;
  T* out;
  int64_t segments;
};

template <int kThreads, typename F>
__device__ __forceinline__ void block_step(const ForEachStep<F>& s) {
  for (int64_t i = threadIdx.x; i < s.n; i += kThreads) s.f(i);
}
template <int kThreads, int K, typename T>
__device__ __forceinline__ void block_step(const SumByIndexArgs<K, T>& s) {
  if (s.segments == 0) return;  // no sums (the runner's sum_rows_by_index returns at once too)
  for (int64_t j = threadIdx.x; j < s.segments * K; j += kThreads) s.out[j] = T(0);
  __syncthreads();
  add_rows_by_index<K>(threadIdx.x / 32 * 32, kThreads, s.n, s.values, s.index, s.out);
}
template <int kThreads, typename R>
__device__ __forceinline__ void block_step(const SumThenStep<R>& s) {
  block_sum_then<kThreads>(s.n, s.r);
}

// The steps in order, one block; a barrier after each step makes its writes (atomics included) visible to the next
// (block_sum_then's other warps return early and wait there for warp 0's finish).
template <int kThreads, typename... S>
__global__ void __launch_bounds__(kThreads) chain_kernel(S... steps) {
  wait_previous_grid();
  ((block_step<kThreads>(steps), __syncthreads()), ...);
}

}  // namespace cuda
}  // namespace rl_losses
