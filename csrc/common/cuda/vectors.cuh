// The 16-byte vectors the CUDA row-pass kernels move, and the per-thread and per-block pieces they share:
// Pack (one 16-byte vector of kVec values), load_vec / store_vec (one 16-byte access each), unpack (a vector
// in the accumulation type), add_vecs (vectors folded into an online softmax state, math.h's RowStats),
// block_combine (a block's states reduced to one, the same bits in every thread), GradOf (the gradient of an
// element or a vector from a row's coefficients), block_zero_fill (a zero gradient row without reading the
// logits), and the alignment tests the kernels' vector paths need. Device code only, but for
// rows_16_byte_aligned, a host test on the call's tensors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/row_pass.h"

namespace rl_losses {
namespace cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// One 16-byte access per vector. A plain copy of a Pack of c10::BFloat16 (a class) may be split into one
// access per element: the statistics loop read shared memory as 8 ld.shared.u16 per vector, 4-way bank
// conflicted, which with the extra instructions held the cluster kernel to ~64% of the copy bandwidth
// (Nsight Compute: 68% excess shared wavefronts, issue slots 67% busy). Going through uint4 cannot split.
template <typename VecT>
__device__ inline VecT load_vec(const VecT* p) {
  static_assert(sizeof(VecT) == sizeof(uint4), "16-byte vectors only");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  VecT v;
  memcpy(&v, &raw, sizeof(raw));
  return v;
}
template <typename VecT>
__device__ inline void store_vec(VecT* p, const VecT& v) {
  static_assert(sizeof(VecT) == sizeof(uint4), "16-byte vectors only");
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  *reinterpret_cast<uint4*>(p) = raw;
}

template <typename acc_t>
__device__ inline RowStats<acc_t> shfl_xor(const RowStats<acc_t>& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, mask), __shfl_xor_sync(0xffffffffu, s.sumexp, mask),
          __shfl_xor_sync(0xffffffffu, s.sum_px, mask), __shfl_xor_sync(0xffffffffu, s.sum_x, mask),
          __shfl_xor_sync(0xffffffffu, s.label, mask)};
}

// Every thread of the block gets the combined state (the same bits: combine is commutative bit for bit, its
// products rounded apart (sum_of_products), and each butterfly step combines the same two values in both lanes). `scratch` holds one state per warp. The
// second round takes log2(warps) steps, lane l holding warp l mod warps: this reduction is on every row's
// critical path, while the CTA has no memory traffic of its own.
template <int kThreads, typename acc_t>
__device__ inline RowStats<acc_t> block_combine(RowStats<acc_t> s, RowStats<acc_t>* scratch) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && (kWarps & (kWarps - 1)) == 0, "a power of two of whole warps");
  for (int m = 16; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = scratch[lane % kWarps];
  for (int m = kWarps / 2; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  return s;
}

// The kVec values of a 16-byte vector in acc_t. bf16 to fp32 is a shift of the low half of each 32-bit word
// and a mask of the high half, one instruction per value (the generic conversion took two for a high half).
template <typename acc_t, typename scalar_t, int kVec>
__device__ inline void unpack(const Pack<scalar_t, kVec>& z, acc_t (&out)[kVec]) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    unsigned w[kVec / 2];
    memcpy(w, &z, sizeof(w));
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      out[2 * k] = __uint_as_float(w[k] << 16);
      out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = static_cast<acc_t>(z.v[k]);
  }
}

// max with NaN propagating (the sampler's selection leaves a row with a NaN unfiltered), and a vector's max so: one
// instruction per pair of 16-bit values, with no conversion (max.NaN of bf16x2 / f16x2, sm_80).
__device__ inline float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ inline double max_nan(double a, double b) { return a != a || b != b ? a + b : ::fmax(a, b); }
template <typename scalar_t, int kVec>
__device__ inline auto vec_max_nan(const Pack<scalar_t, kVec>& p) {
  if constexpr (sizeof(scalar_t) == 2) {
    unsigned w[4];
    memcpy(w, &p, sizeof(w));
    unsigned a, b;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(w[0]), "r"(w[1]));
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(w[2]), "r"(w[3]));
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(b));
    } else {
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(a) : "r"(w[0]), "r"(w[1]));
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(b) : "r"(w[2]), "r"(w[3]));
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(a) : "r"(a), "r"(b));
    }
    scalar_t lo, hi;
    const uint16_t l = static_cast<uint16_t>(a), h = static_cast<uint16_t>(a >> 16);
    memcpy(&lo, &l, 2);
    memcpy(&hi, &h, 2);
    return max_nan(static_cast<float>(lo), static_cast<float>(hi));
  } else {
    auto m = p.v[0];
#pragma unroll
    for (int k = 1; k < kVec; ++k) m = max_nan(m, p.v[k]);
    return m;
  }
}

// The raw max of N 16-byte vectors (a NaN skipped, as RowStats' max does): over packed pairs for bf16 (exact).
template <typename acc_t, typename scalar_t, int kVec, int N>
__device__ inline acc_t vecs_max(const Pack<scalar_t, kVec> (&z)[N]) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    __nv_bfloat162 pairs[N * kVec / 2];
    memcpy(pairs, z, sizeof(pairs));
    const __nv_bfloat162 m2 = tree_reduce(pairs, [](__nv_bfloat162 a, __nv_bfloat162 b) { return __hmax2(a, b); });
    return ::fmaxf(__low2float(m2), __high2float(m2));
  } else {
    acc_t m[N * kVec];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      acc_t one[kVec];
      unpack(z[n], one);
#pragma unroll
      for (int k = 0; k < kVec; ++k) m[n * kVec + k] = one[k];
    }
    return tree_reduce(m, [](acc_t a, acc_t b) { return ::fmax(a, b); });
  }
}

// Folds N 16-byte vectors of raw logits (x = s·z) into the state as one chunk: one max and one rescale test
// per N·kVec logits. bf16 takes the chunk's max over packed pairs first (one instruction per two values,
// exact: the max of bf16 values is one of them). kFloor: a logit below `floor` (the sampler's) counts as −inf;
// the chunk's max may still be such a logit's, which only shifts the state's sums (never the row's max: the
// most probable token is always kept). A chunk wholly below the floor adds nothing but −inf to Σx, and is skipped
// where that sum is not taken (most of a row, for a filter that keeps few tokens; a finite floor means a row
// without NaN: the selection leaves such rows at −inf).
template <bool kEntropy, bool kSmoothing, bool kFloor = false, typename acc_t, typename scalar_t, int kVec, int N>
__device__ inline void add_vecs(RowStats<acc_t>& st, const Pack<scalar_t, kVec> (&z)[N], acc_t scale,
                                acc_t floor = acc_t(0)) {
  if constexpr (kFloor && !kSmoothing) {
    if (vecs_max<acc_t>(z) < floor) return;
  }
  acc_t chunk[N * kVec];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    acc_t one[kVec];
    unpack(z[n], one);
#pragma unroll
    for (int k = 0; k < kVec; ++k) chunk[n * kVec + k] = kFloor && one[k] < floor ? neg_inf<acc_t>() : one[k];
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    // The max over packed pairs skips a NaN (__hmax2 returns the other input, as fmax does); it still reaches the sums.
    st.template add_chunk_with_max<kEntropy, kSmoothing, N * kVec>(chunk, vecs_max<acc_t>(z), scale);
  } else {
    st.template add_chunk<kEntropy, kSmoothing, N * kVec>(chunk, scale);
  }
}

// The factor of p_j in the gradient, s·(a + h·log p_j), from s·a and the exponent of p_j (ExpShifted::arg,
// whose unit the constructor folds into s·h): one FMA per element where the epilogue may use the entropy
// term h, nothing otherwise (the specialisation below holds no field and returns s·a).
template <typename acc_t, bool kEntropyGrad>
struct ProbFactor {
  acc_t sh;  // s·h·(natural log of the exponent's unit)
  __device__ explicit ProbFactor(acc_t scaled_h) : sh(scaled_h * exp_shifted_log_unit<acc_t>()) {}
  __device__ acc_t operator()(acc_t sa, acc_t arg) const { return sh * arg + sa; }
};
template <typename acc_t>
struct ProbFactor<acc_t, false> {
  __device__ explicit ProbFactor(acc_t) {}
  __device__ acc_t operator()(acc_t sa, acc_t) const { return sa; }
};

// dL/dz_j = s·(a·p_j + c + b·[j = label] + h·p_j·log p_j), p_j = exp((s·z_j − max) − log Σ) (ExpShifted),
// given the row's coefficients, max and log(sumexp): of one element, or of a 16-byte vector without the label
// term. The kernels rewrite the label's element afterwards (the thread that wrote its vector, so in order): a
// test per row instead of one per element. h is read only with kEntropyGrad (the epilogue's
// kMayUseEntropyGrad). kFloor: a logit below `floor` (the sampler's) gets a zero gradient.
template <typename scalar_t, typename acc_t, bool kEntropyGrad = false, bool kFloor = false>
struct GradOf {
  acc_t sa, sb, sc;
  acc_t floor = acc_t(0);
  ExpShifted<acc_t> p_of;
  int64_t label;  // the label's column in the caller's indexing; out of range when the row has none here
  bool zero;      // a = b = c (= h) = 0 (a masked row): exact zeros, never exp of a -inf lse
  ProbFactor<acc_t, kEntropyGrad> factor;

  __device__ GradOf(const GradCoef<acc_t>& coef, acc_t max, acc_t log_sumexp, acc_t scale, int64_t label_,
                    acc_t floor_ = acc_t(0))
      : sa(scale * coef.a),
        sb(scale * coef.b),
        sc(scale * coef.c),
        floor(floor_),
        p_of(scale, max, log_sumexp),
        label(label_),
        zero(coef.a == acc_t(0) && coef.b == acc_t(0) && coef.c == acc_t(0) && (!kEntropyGrad || coef.h == acc_t(0))),
        factor(scale * coef.h) {}

  // s·(a·p + c) (+ s·h·p·log p) of one raw logit z.
  __device__ acc_t no_label_term(acc_t z) const {
    const acc_t arg = p_of.arg(z);
    return factor(sa, arg) * ExpShifted<acc_t>::exp_of_arg(arg) + sc;
  }

  __device__ scalar_t operator()(scalar_t z, int64_t j) const {
    if (zero || (kFloor && static_cast<acc_t>(z) < floor)) return scalar_t(0);
    return static_cast<scalar_t>(no_label_term(static_cast<acc_t>(z)) + (j == label ? sb : acc_t(0)));
  }

  template <int kVec>
  __device__ Pack<scalar_t, kVec> operator()(const Pack<scalar_t, kVec>& z) const {
    Pack<scalar_t, kVec> out;
    if (zero) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = scalar_t(0);
      return out;
    }
    if constexpr (kFloor) {  // a vector wholly below the floor: zeros, without its exponentials
      const Pack<scalar_t, kVec> one[1] = {z};
      if (vecs_max<acc_t>(one) < floor) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) out.v[k] = scalar_t(0);
        return out;
      }
    }
    acc_t g[kVec];
    unpack(z, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = kFloor && g[k] < floor ? acc_t(0) : no_label_term(g[k]);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {  // one cvt.rn.bf16x2.f32 per pair
        const __nv_bfloat162 two = __floats2bfloat162_rn(g[k], g[k + 1]);
        memcpy(&out.v[k], &two, sizeof(two));
      }
    } else if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {
        const __half2 two = __floats2half2_rn(g[k], g[k + 1]);
        memcpy(&out.v[k], &two, sizeof(two));
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = static_cast<scalar_t>(g[k]);
    }
    return out;
  }
};

// The elements of a row of n at p before its first 16-byte boundary: those accessed one by one.
template <typename scalar_t>
__device__ inline int64_t unaligned_head(const scalar_t* p, int64_t n) {
  return std::min<int64_t>((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16 / sizeof(scalar_t), n);
}

// Zeros over g[0, n) by the block's threads, 16-byte stores between an element-wise head and tail. A row
// with a zero gradient (a masked token, a clipped document) is written this way without reading its
// logits, which also saves the read. (When the row was read, stores that did not depend on the loads went,
// in place, to addresses with loads in flight: such rows measured 2x slower in place; docs/design.md
// v15.)
template <int kThreads, typename scalar_t>
__device__ inline void block_zero_fill(scalar_t* g, int64_t n) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  const int64_t head = unaligned_head(g, n);
  const int64_t n_vec = (n - head) / kVec;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) g[j] = scalar_t(0);
  VecT zeros;
#pragma unroll
  for (int k = 0; k < kVec; ++k) zeros.v[k] = scalar_t(0);
  VecT* gz = reinterpret_cast<VecT*>(g + head);
  for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) store_vec(&gz[i], zeros);
  for (int64_t j = head + n_vec * kVec + threadIdx.x; j < n; j += kThreads) g[j] = scalar_t(0);
}

// Whether every row of the logits and of the gradient (where the pass has one) starts on a 16-byte boundary.
inline bool rows_16_byte_aligned(const RowPassArgs& args) {
  const int64_t elem = args.logits.element_size();
  auto aligned = [&](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.stride(0) * elem) % 16 == 0;
  };
  return aligned(args.logits) && (!args.write_grad() || aligned(args.grad));
}

}  // namespace cuda
}  // namespace rl_losses
