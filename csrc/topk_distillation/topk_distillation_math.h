// The per-row math of distillation from a sparse teacher (docs/distillation_dpo.md), written once for the CPU
// loops and the CUDA kernels. Per row, the student's scaled logits x = s·z (q = softmax(x) over the whole
// vocabulary, lse = log Σ_j e^{x_j}) and the teacher's K (id, log-prob) pairs (k_i, log p_i) give
//   P = Σ_i p_i (teacher mass),  Q = Σ_i q_{k_i} (student mass),  G = log Σ_i e^{x_{k_i}}  (so Q = e^{G − lse})
// and the forward KL over the K ids with the teacher's remaining mass treated by `tail`:
//   none         Σ_i p_i (log p_i − log q_i)                      = A − B + P·lse
//   renormalize  Σ_i (p_i/P)(log(p_i/P) − log(q_i/Q))             = (A − B)/P − log P + G
//   tail         none + (1−P)·log((1−P)/(1−Q)),  1 − Q = −expm1(G − lse)
// with A = Σ p_i log p_i and B = Σ p_i x_{k_i}: every K-wide sum is taken before the row pass (TopkPartial),
// which then needs only lse. The gradient w.r.t. x_j is
//   none         P·q_j − [j ∈ K] p_j
//   renormalize  [j ∈ K] (q_j/Q − p_j/P)
//   tail         (P − r·Q)·q_j + [j ∈ K] (r·q_j − p_j),  r = (1−P)/(1−Q)
// i.e. a row coefficient times q (the row pass's gradient) and, at the K ids, c1·e^{x_j − norm} − c2·p_j written
// whole (one rounding) over the row pass's value by a K-wide scatter (TopkGradField).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "common/math.h"

namespace rl_losses {

enum class TopkTail : int { kNone = 0, kRenormalize = 1, kTail = 2 };

// The sums over one row's K entries (before the row pass), one row of an (N, kTopkPrepFields) table.
enum TopkPrepField : int { kTopkP = 0, kTopkA, kTopkB, kTopkG, kTopkPrepFields };

// The K-wide sums of a row, or of a part of its entries (the CUDA kernel's threads): an online max and
// Σ e^{x−max} for G, and P, A, B. An entry with p_i = 0 (log p = −inf) adds nothing to A and B.
template <typename T>
struct TopkPartial {
  T m, e, p, a, b;
  C10_HOST_DEVICE static TopkPartial empty() { return {neg_inf<T>(), T(0), T(0), T(0), T(0)}; }
  C10_HOST_DEVICE void add(T x, T lp) {
    const T p_i = T(::exp(lp));
    p += p_i;
    if (p_i > T(0)) {
      a += p_i * lp;
      b += p_i * x;
    }
    if (x > m) {
      e = (m == neg_inf<T>() ? T(0) : e * exp_nonpos(m - x)) + T(1);
      m = x;
    } else if (x != neg_inf<T>()) {
      e += exp_nonpos(x - m);
    }
  }
  C10_HOST_DEVICE static TopkPartial combine(const TopkPartial& u, const TopkPartial& v) {
    const T m = u.m > v.m ? u.m : v.m;
    const T fu = u.m == neg_inf<T>() ? T(0) : exp_nonpos(u.m - m), fv = v.m == neg_inf<T>() ? T(0) : exp_nonpos(v.m - m);
    return {m, u.e * fu + v.e * fv, u.p + v.p, u.a + v.a, u.b + v.b};
  }
  C10_HOST_DEVICE void store(T* out) const {
    out[kTopkP] = p;
    out[kTopkA] = a;
    out[kTopkB] = b;
    out[kTopkG] = m == neg_inf<T>() ? m : m + T(::log(e));
  }
};

// What the scatter needs of a row, written by the epilogue: the value at a K id, before the factor s,
//   w·(c1·e^{x_j − norm} − c2·p_j),
// w = 1/D for a labelled row, 0 otherwise (then the scatter leaves the row alone).
enum TopkGradField : int { kTopkNorm = 0, kTopkC1, kTopkC2, kTopkW, kTopkGradFields };

template <typename T>
C10_HOST_DEVICE inline T topk_grad_at(const T* g, T x, T lp) {
  return g[kTopkW] * (g[kTopkC1] * exp_nonpos(x - g[kTopkNorm]) - g[kTopkC2] * T(::exp(lp)));
}

// One labelled row's loss, masses and gradient coefficients, given lse. `a` is the coefficient of q_j on the
// whole row; g receives the TopkGradField fields (w set by the caller); `bound` bounds |c1·q − c2·p| (c1 and c2·P bound it),
// for the fp16 gradient's pre-scaling.
template <typename T>
struct TopkRowResult {
  T loss, q_mass, a, bound;
};

template <typename T>
C10_HOST_DEVICE inline TopkRowResult<T> topk_row(TopkTail tail, const T* prep, T lse, T* g) {
  const T p = prep[kTopkP], a_sum = prep[kTopkA], b_sum = prep[kTopkB], lse_k = prep[kTopkG];
  const T log_q = lse_k - lse;  // log Q (≤ 0 up to rounding)
  const T q = exp_nonpos(log_q < T(0) ? log_q : T(0));
  if (tail == TopkTail::kRenormalize) {
    g[kTopkNorm] = lse_k;
    g[kTopkC1] = T(1);
    g[kTopkC2] = T(1) / p;
    return {(a_sum - b_sum) / p - T(::log(p)) + lse_k, q, T(0), T(1)};
  }
  T loss = a_sum - b_sum + p * lse, a = p, c1 = p;
  if (tail == TopkTail::kTail) {
    // The teacher's tail mass 1 − P (≥ 0: a mass above 1 within the checked tolerance counts as 1) and the
    // student's, 1 − Q = −expm1(log Q): no cancellation of Q against 1 where Q is small.
    const T rest_p = p < T(1) ? T(1) - p : T(0);
    const T rest_q = log_q < T(0) ? -T(::expm1(log_q)) : T(0);
    const T r = rest_p > T(0) ? rest_p / rest_q : T(0);
    if (rest_p > T(0)) loss += rest_p * T(::log(rest_p) - ::log(rest_q));
    a = p - r * q;
    c1 = p + r * rest_q;  // a + r
  }
  g[kTopkNorm] = lse;
  g[kTopkC1] = c1;
  g[kTopkC2] = T(1);
  return {loss, q, a, (c1 > p ? c1 : p)};
}

}  // namespace rl_losses
