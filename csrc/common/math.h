// The per-token math of every loss, written once and called by the CPU loops and the CUDA kernels alike,
// so that CPU/CUDA parity comes from construction. Everything here is fp32 (fp64 for fp64 inputs on the CPU)
// and free of torch headers beyond the host/device macro. docs/math.md states every formula in the same notation.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

// Unrolling hint that both nvcc and the host compiler understand.
#if defined(__CUDACC__)
#define RL_LOSSES_UNROLL _Pragma("unroll")
#else
#define RL_LOSSES_UNROLL _Pragma("GCC unroll 16")
#endif

namespace rl_losses {

// Accumulation type: fp32 for fp32/bf16/fp16 logits, fp64 for fp64 logits (CPU reference-grade tests).
template <typename scalar_t>
struct acc_type {
  using type = float;
};
template <>
struct acc_type<double> {
  using type = double;
};

template <typename T>
C10_HOST_DEVICE inline T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// exp(x) for x <= 0 in float without libm: Cody-Waite reduction x = n·ln2 + r, |r| <= ln2/2, a degree-6
// polynomial for e^r (Cephes' expf coefficients, about 1 ulp) and 2^n built in the exponent bits. It has no
// branch and no call, so the CPU row loops vectorise; it is what makes them beat eager PyTorch.
inline float exp_nonpos_poly(float x) {
  const float xc = x < -87.0f ? -87.0f : x;  // keeps 2^n normal; the result is then flushed to 0 below
  const float magic = 12582912.0f;           // 1.5·2^23: adding it rounds to an integer in the low bits
  const float t = xc * 1.44269504088896341f + magic;
  const float n = t - magic;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// exp of a non-positive argument (x - max): the hardware 2^x on the GPU (2 ulp; the inputs are bounded
// above by 0, so no overflow, and results below 2^-126 flush to 0, which spares __expf's range fix-up on the
// per-row reductions' critical path), the vectorisable polynomial on the CPU; fp64 uses libm.
template <typename T>
C10_HOST_DEVICE inline T exp_nonpos(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
  } else {
    return ::exp(x);
  }
#else
  if constexpr (sizeof(T) == 4) {
    return exp_nonpos_poly(x);
  } else {
    return std::exp(x);
  }
#endif
}

// A loss's divisor D: the 0-dim tensor's value where the device counts it (`on_device`), else the number the host
// knew (given, or a row count: passed by value, with no launch to fill a tensor with it).
template <typename T>
C10_HOST_DEVICE inline T divisor_of(const T* on_device, T value) {
  return on_device != nullptr ? *on_device : value;
}

// a·x + b·y with both products rounded before the sum, so that swapping (a, x) with (b, y) gives the same bits.
// nvcc would contract it into fma(a, x, b·y), rounding one product only: the reductions' butterflies combine the
// same two states in both lanes in opposite orders, and every lane (and every CTA of a cluster, which writes the
// row's outputs from its own lane's state) must get the same bits. The host compiles ISO C++ (no contraction).
template <typename T>
C10_HOST_DEVICE inline T sum_of_products(T a, T x, T b, T y) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    return __fmul_rn(a, x) + __fmul_rn(b, y);
  } else {
    return __dmul_rn(a, x) + __dmul_rn(b, y);
  }
#else
  return a * x + b * y;
#endif
}

// log(1 + e) for e in [0, 1], a log-add-exp's correction term: the hardware log2 of 1 + e on the GPU in float
// (1 + e in [1, 2]: an absolute error of about 2^-22, besides the rounding of 1 + e, both below the ulp of the
// term it corrects unless that is < 1 in magnitude); libdevice's log1pf took ~25 instructions per element of
// JSD's two per-element passes. libm elsewhere.
template <typename T>
C10_HOST_DEVICE inline T log1p_unit(T e) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(1.0f + e));
    return y * 0.6931471805599453f;
  } else {
    return ::log1p(e);
  }
#else
  return ::log1p(e);
#endif
}

// log(x) for a positive normal x: the hardware log2 on the GPU in float (an absolute error of about 2^-22 for x in
// [0.5, 2], about 2 ulp of the result outside), libm elsewhere.
template <typename T>
C10_HOST_DEVICE inline T log_normal(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y * 0.6931471805599453f;
  } else {
    return ::log(x);
  }
#else
  return std::log(x);
#endif
}

// exp((s·z − m) − c) for s·z <= m, c >= 0: every exponential of the row loops has this form, exp(x − max) in
// the statistics (c = 0) and p = exp(x − max − log Σ) in the gradient (m = the row's max, c = log(sumexp)).
// The exponent is taken relative to the max first, d = s·z − m with one rounding (an FMA on the GPU), so that
// its error scales with |x − max|, not with |x|: folding s and m into one affine map a·z − b (a = s·log2(e),
// b = lse·log2(e)) rounded a and b, whose errors grow with the logits' magnitude (relative gradient errors of
// 5e-4 at logits near 1e4, 4e-3 near 1e5). On the GPU in fp32 the exponential is the hardware 2^x fed with
// d·log2(e) − c·log2(e); the accuracy costs one FFMA per logit (or one FMUL with c = 0) against the affine
// form's single FFMA.
template <typename T>
struct ExpShifted {
  T s, m, c;

  C10_HOST_DEVICE ExpShifted(T s_, T m_, T c_ = T(0)) : s(s_), m(m_), c(c_) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) c *= T(1.4426950408889634);
#endif
  }

  // The exponent (s·z − m) − c in the unit the exponential takes: log2 on the GPU in fp32, natural elsewhere.
  // For the gradient (c = log Σ) it is log p in that unit: log p = arg(z)·exp_shifted_log_unit<T>().
  C10_HOST_DEVICE T arg(T z) const {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) return fmaf(fmaf(z, s, -m), 1.4426950408889634f, -c);
#endif
    return (s * z - m) - c;
  }

  // exp of an exponent given by arg().
  C10_HOST_DEVICE static T exp_of_arg(T a) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) {
      float y;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
      return y;
    }
#endif
    return exp_nonpos(a);
  }

  C10_HOST_DEVICE T operator()(T z) const { return exp_of_arg(arg(z)); }
};

// The natural log of one unit of ExpShifted::arg: ln 2 where it is in log2 (the GPU in fp32), else 1.
template <typename T>
C10_HOST_DEVICE inline T exp_shifted_log_unit() {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return T(0.6931471805599453);
#endif
  return T(1);
}

// Reduces a[0..K) by `op` as a pairwise tree (a is overwritten): log2(K) dependent steps instead of K - 1.
template <int K, typename T, typename Op>
C10_HOST_DEVICE inline T tree_reduce(T (&a)[K], Op op) {
RL_LOSSES_UNROLL
  for (int stride = 1; stride < K; stride *= 2) {
RL_LOSSES_UNROLL
    for (int i = 0; i + stride < K; i += 2 * stride) a[i] = op(a[i], a[i + stride]);
  }
  return a[0];
}

// Online softmax statistics of one row (or one shard of a row) of scaled logits x = s*z.
// `max` and `sumexp` form the usual online log-sum-exp pair; `sum_px` is Σ exp(x-max)·x (for the entropy),
// `sum_x` is Σ x (for label smoothing), `label` the label's scaled logit (0 where this row/shard has none).
// Partial states combine associatively, which is what the CUDA block reduction and the tensor-parallel
// all-reduce both rely on.
template <typename T>
struct RowStats {
  T max;
  T sumexp;
  T sum_px;
  T sum_x;
  T label;

  static constexpr int kFields = 5;

  C10_HOST_DEVICE static RowStats empty() {
    return {neg_inf<T>(), T(0), T(0), T(0), T(0)};
  }

  // Fold a chunk of K raw logits z (x = s·z, s > 0) into the state: one max and one rescale per chunk, and
  // per value the exponential of ExpShifted, which takes s·z − max in one FMA, with no multiply by s of its
  // own. s > 0 (checked by every op) makes max(s·z) = s·max(z) exactly, rounding being monotonic.
  template <bool kEntropy, bool kSmoothing, int K>
  C10_HOST_DEVICE void add_chunk(const T (&z)[K], T s) {
    T m[K];
RL_LOSSES_UNROLL
    for (int i = 0; i < K; ++i) m[i] = z[i];
    // fmax is one instruction on the GPU (a compare and a select otherwise); a NaN it skips here still
    // reaches the sums below.
    add_chunk_with_max<kEntropy, kSmoothing>(z, tree_reduce(m, [](T a, T b) { return ::fmax(a, b); }), s);
  }

  // The same with z_max = max(z) given (the CUDA kernels take it over packed bf16 pairs). The chunk's sums
  // are pairwise trees: log2(K) dependent additions instead of K on the statistics loop's critical path.
  template <bool kEntropy, bool kSmoothing, int K>
  C10_HOST_DEVICE void add_chunk_with_max(const T (&z)[K], T z_max, T s) {
    const T chunk_max = s * z_max;
    // Not `chunk_max > max`: a chunk of NaNs alone (z_max = NaN) must make the state NaN, not be dropped by the
    // -inf test below when it comes first (a thread whose first logit is NaN).
    if (!(chunk_max <= max)) {
      // max == -inf only before the first finite value: then the old sums are 0 and the factor is moot.
      const T factor = max == neg_inf<T>() ? T(0) : exp_nonpos(max - chunk_max);
      sumexp *= factor;
      if (kEntropy) sum_px *= factor;
      max = chunk_max;
    }
    if (max == neg_inf<T>()) {
      // Every value so far is -inf: no exponential to add, but Σx (label smoothing) still counts them (-inf):
      // a thread whose values are all -inf must not drop them from the row's sum.
      if (kSmoothing) {
        T x[K];
RL_LOSSES_UNROLL
        for (int i = 0; i < K; ++i) x[i] = s * z[i];
        sum_x += tree_reduce(x, [](T a, T b) { return a + b; });
      }
      return;
    }
    const ExpShifted<T> exp_shifted(s, max);
    T e[K], px[K], x[K];
RL_LOSSES_UNROLL
    for (int i = 0; i < K; ++i) {
      e[i] = exp_shifted(z[i]);
      // e == 0 for x == -inf: skip so that 0 * -inf never makes a NaN.
      if (kEntropy) px[i] = e[i] > T(0) ? e[i] * (s * z[i]) : T(0);
      if (kSmoothing) x[i] = s * z[i];
    }
    const auto plus = [](T a, T b) { return a + b; };
    sumexp += tree_reduce(e, plus);
    if (kEntropy) sum_px += tree_reduce(px, plus);
    if (kSmoothing) sum_x += tree_reduce(x, plus);
  }

  // One raw logit z (x = s·z).
  template <bool kEntropy, bool kSmoothing>
  C10_HOST_DEVICE void add(T z, T s) {
    T one[1] = {z};
    add_chunk<kEntropy, kSmoothing, 1>(one, s);
  }

  // Without branches (the CUDA reductions run it on their critical path): the larger side's factor is
  // exactly 1, an empty side's (max -inf, sums 0) exactly 0 unless both are empty; a NaN max gives NaN sums.
  C10_HOST_DEVICE static RowStats combine(const RowStats& a, const RowStats& b) {
    const T m = a.max > b.max ? a.max : b.max;
    const T fa = a.max == m ? T(1) : exp_nonpos(a.max - m), fb = b.max == m ? T(1) : exp_nonpos(b.max - m);
    return {m, sum_of_products(a.sumexp, fa, b.sumexp, fb), sum_of_products(a.sum_px, fa, b.sum_px, fb),
            a.sum_x + b.sum_x, a.label + b.label};
  }

  C10_HOST_DEVICE T lse() const { return max + ::log(sumexp); }
  // log p of a scaled logit x of this row, (x − max) − log Σ: without the rounding of lse, which at large
  // logits (lse ~ 1e4) is larger than the log-prob's own precision.
  C10_HOST_DEVICE T log_prob(T x) const { return (x - max) - ::log(sumexp); }
  // H = lse - Σ p·x (docs/math.md).
  C10_HOST_DEVICE T entropy() const { return lse() - sum_px / sumexp; }
};

// w·x where w = 0 means "this term does not count" (a zero loss weight, a clipped gradient, a switched-off
// loss term): an exact 0 even when x is ±inf (a ratio beyond e^88 in fp32, a -inf logit), where the product
// would be NaN.
template <typename T>
C10_HOST_DEVICE inline T zero_or_product(T w, T x) {
  return w == T(0) ? T(0) : w * x;
}

// The gradient of every loss here w.r.t. the scaled logits of a row has the form
//     dL/dx_j = a·p_j + c + b·[j == y] + h·p_j·log p_j,    log p_j = x_j − lse,
// and the kernels write s·(that) as dL/dz_j. Each op only supplies (a, b, c, h) per row. The h term is that of
// an entropy term in the loss: ∂H/∂x_j = −p_j·(log p_j + H), so a loss term w·H adds h = −w and −w·H to a.
// It is compiled only for epilogues that declare kMayUseEntropyGrad (row_pass.h); the others return
// {a, b, c}: h is then 0, and unread.
// No default member initialiser: the CUDA kernels hold a GradCoef in shared memory, which allows no
// constructor; aggregate initialisation zeroes an omitted h.
template <typename T>
struct GradCoef {
  T a;
  T b;
  T c;
  T h;
};

// Cross-entropy and z-loss (docs/math.md), one labelled row with weight w = m_t·g/D:
//   ℓ = λ[(1−ε)(lse − x_y) + ε(lse − Σx/V)] + ζ·lse²
//   ∂ℓ/∂x_j = λ[p_j − (1−ε)[j=y] − ε/V] + 2ζ·lse·p_j
// λ = 1 for cross-entropy, λ = 0 for the z-loss alone.
template <typename T>
struct CrossEntropyOptions {
  T label_weight;     // λ
  T label_smoothing;  // ε
  T z_loss_factor;    // ζ
  T vocab_size;       // V of the whole (global) vocabulary
  template <typename U>
  C10_HOST_DEVICE CrossEntropyOptions<U> as() const {
    return {.label_weight = U(label_weight),
            .label_smoothing = U(label_smoothing),
            .z_loss_factor = U(z_loss_factor),
            .vocab_size = U(vocab_size)};
  }
};

// label_log_prob = x_y − lse, taken as RowStats::log_prob does.
template <typename T>
C10_HOST_DEVICE inline T cross_entropy_loss(const CrossEntropyOptions<T>& o, T lse, T label_log_prob, T sum_x) {
  const T nll = -label_log_prob;
  const T smooth = lse - sum_x / o.vocab_size;
  // λ = 0 (the z-loss alone) and ε = 0 switch their terms off exactly, also where a -inf logit makes the
  // switched-off term infinite (0·inf would be NaN).
  const T label_term = zero_or_product(T(1) - o.label_smoothing, nll) + zero_or_product(o.label_smoothing, smooth);
  return zero_or_product(o.label_weight, label_term) + zero_or_product(o.z_loss_factor, lse * lse);
}

template <typename T>
C10_HOST_DEVICE inline GradCoef<T> cross_entropy_grad(const CrossEntropyOptions<T>& o, T lse, T w) {
  return {w * (o.label_weight + T(2) * o.z_loss_factor * lse), -w * o.label_weight * (T(1) - o.label_smoothing),
          -w * o.label_weight * o.label_smoothing / o.vocab_size};
}

// Policy-gradient pieces shared by GRPO (per token) and GSPO (per document), docs/math.md.
template <typename T>
struct ClipOptions {
  T epsilon_low;
  T epsilon_high;
  T delta;  // two-sided clip; +inf when not used
};

// max(x, 1): a count used as a divisor, so that an empty set gives 0 / 1 = 0 rather than 0 / 0. A NaN count
// (a NaN label_counts) stays NaN rather than silently becoming 1.
template <typename T>
C10_HOST_DEVICE inline T at_least_one(T x) {
  return x < T(1) ? T(1) : x;
}

// min(r, δ): the ratio under the two-sided clip (NaN stays NaN).
template <typename T>
C10_HOST_DEVICE inline T capped_ratio(const ClipOptions<T>& o, T ratio) {
  return ratio > o.delta ? o.delta : ratio;
}

// −min( min(r, δ)·A , clip(r, 1−ε_l, 1+ε_h)·A ); 0 for A = 0 at any r, an overflowed r = inf included (a NaN r
// stays NaN: NaN in, NaN out).
template <typename T>
C10_HOST_DEVICE inline T clipped_surrogate_loss(const ClipOptions<T>& o, T ratio, T advantage) {
  if (advantage == T(0)) return ratio == ratio ? T(0) : ratio;
  const T lo = T(1) - o.epsilon_low, hi = T(1) + o.epsilon_high;
  const T clipped = ratio < lo ? lo : (ratio > hi ? hi : ratio);
  const T s1 = capped_ratio(o, ratio) * advantage, s2 = clipped * advantage;
  return -(s1 < s2 ? s1 : s2);
}

// c(r, A): the factor of A through which the surrogate still depends on r (0 where a clip or the cap is active).
// The surrogate is −A·min(r, 1+ε_h, δ) for A > 0 and −A·min(max(δ, 1+ε_h), max(r, 1−ε_l)) for A < 0: the cap δ
// binds where A > 0 only below 1+ε_h and where A < 0 only above it (dual-clip PPO), so any δ > 0 is well defined.
template <typename T>
C10_HOST_DEVICE inline T clip_coefficient(const ClipOptions<T>& o, T ratio, T advantage) {
  const T hi = T(1) + o.epsilon_high;
  if (advantage > T(0)) return ratio <= hi && ratio <= o.delta ? advantage : T(0);
  if (advantage < T(0)) return ratio >= T(1) - o.epsilon_low && (ratio <= hi || ratio <= o.delta) ? advantage : T(0);
  return T(0);
}

// c(r, A)·r: the factor of A in −∂surrogate/∂lp. Exactly 0 where a clip or the cap δ is active, also when r
// overflowed to inf (a clipped token must contribute a zero gradient, never 0·inf = NaN); NaN for a NaN r.
template <typename T>
C10_HOST_DEVICE inline T clip_gradient_factor(const ClipOptions<T>& o, T ratio, T advantage) {
  return ratio == ratio ? zero_or_product(clip_coefficient(o, ratio, advantage), ratio) : ratio;
}

// Clipped-fraction flags (docs/math.md, metrics), TRL's: on the capped ratio (its coef_1 after the two-sided
// clip), which is r itself wherever δ > 1+ε_h.
template <typename T>
C10_HOST_DEVICE inline bool clipped_low(const ClipOptions<T>& o, T ratio, T advantage) {
  return capped_ratio(o, ratio) < T(1) - o.epsilon_low && advantage < T(0);
}
template <typename T>
C10_HOST_DEVICE inline bool clipped_high(const ClipOptions<T>& o, T ratio, T advantage) {
  return capped_ratio(o, ratio) > T(1) + o.epsilon_high && advantage > T(0);
}

// k3 estimator of KL(π || q) from the log-ratio d = log q − log π: exp(d) − d − 1 (≥ 0, exact 0 at d = 0).
template <typename T>
C10_HOST_DEVICE inline T k3(T log_ratio) {
  // expm1 keeps the small-|d| case accurate: exp(d) − 1 − d without cancellation of the leading 1.
  return ::expm1(log_ratio) - log_ratio;
}

// Per-token log-prob and entropy with arbitrary upstream gradients g_lp, g_H (docs/token_log_probs.md):
//   lp = x_y − lse        ∂lp/∂x_j = [j = y] − p_j
//   H  = lse − Σ p·x      ∂H/∂x_j  = −p_j·(log p_j + H)
// so dL/dx_j = (−g_lp − g_H·H)·p_j + g_lp·[j = y] − g_H·p_j·log p_j. A row without a label has no lp (0, no
// gradient through it); its entropy is still defined and differentiated.
template <typename T>
C10_HOST_DEVICE inline GradCoef<T> token_log_prob_grad(T grad_log_prob, T grad_entropy, T entropy, bool has_label) {
  const T g_lp = has_label ? grad_log_prob : T(0);
  const T a = grad_entropy != T(0) ? -g_lp - grad_entropy * entropy : -g_lp;
  return {a, g_lp, T(0), -grad_entropy};
}

}  // namespace rl_losses

// The policy family's per-token math (loss types, rollout correction, KL estimators, VESPO, GSPO).
#include "common/policy_math.h"  // IWYU pragma: export
