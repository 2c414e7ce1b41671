// clip_cov's and kl_cov's token subset (common/policy.h: cov_selection), written once for both devices over a
// runner's primitives (row_pass_cpu.h, row_pass_cuda.cuh). Per call, with no host synchronisation (k stays on the
// device; only its host-side bound `count` sizes anything), in 4 launches on a GPU (5 for clip_cov's draw):
//   1. the masked means of A and ℓ and k = max(⌊ratio·n⌋, 1) (CovMeans, one single-block sum);
//   2. the `count` tokens of smallest CovKey, in order, ties by index: Runner::select_first (one block, `count`
//      sweeps over the keys) where count <= kCovSelectSweeps, else one stable sort of the keys;
//   3. the first k of them that qualify flagged (CovMark), over the zeroed flags.
// Being first in that order is being of rank < k in the former ranks (a stable sort of every key), so the subset
// is the same; what took ~25 ATen launches (~35 for clip_cov) takes 4-5.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/macros/Macros.h>

#include <cmath>

#include "common/policy.h"

namespace rl_losses {

// Up to this many tokens the selection sweeps the keys once per token taken (`count` sweeps of N keys by one
// block); beyond, one sort of the N keys is cheaper. verl's ratio 2e-4 takes 3 tokens at N = 16384.
constexpr int64_t kCovSelectSweeps = 16;

// The masked-in count n, Σ m·A and Σ m·ℓ, then the means (over max(n, 1)) and k = max(⌊ratio·n⌋, 1), as the
// former ATen steps had them (n in float64 for k).
template <typename T>
struct CovMeans {
  using acc_t = T;
  static constexpr int kTerms = 3;
  const bool* mask;
  const T *adv, *lp;
  double ratio;
  T* out;  // mean A, mean ℓ, k
  C10_HOST_DEVICE void terms(int64_t i, T* v) const {
    const bool m = mask[i];  // where m = 0 nothing is read: the padding may hold NaN
    v[0] = m ? T(1) : T(0);
    v[1] = m ? adv[i] : T(0);
    v[2] = m ? lp[i] : T(0);
  }
  C10_HOST_DEVICE void finish(const T* s) const {
    const T count = s[0] > T(1) ? s[0] : T(1);
    out[0] = s[1] / count;
    out[1] = s[2] / count;
    const double k = ::floor(static_cast<double>(s[0]) * ratio);
    out[2] = static_cast<T>(k > 1.0 ? k : 1.0);
  }
};

// Each token's place in the subset's order (lower keys first): kl_cov the largest cov_t first (the key −cov_t,
// masked-out tokens +∞), clip_cov its candidates in the order of their uniform draws (the others at 2). A NaN
// key counts as +∞, so that every key is ordered. The bounds are rounded to T as ATen compared a T tensor with
// them.
template <typename T>
struct CovKey {
  const bool* mask;
  const T *adv, *lp, *old;
  const double* draws;  // clip_cov: U(0, 1) per token
  const T* means;       // CovMeans' out
  bool kl;
  T low, high;  // clip_cov: the clip's 1 − ε_low, 1 + ε_high
  T lb, ub;     // clip_cov's band on cov_t
  C10_HOST_DEVICE T cov(int64_t i) const { return (adv[i] - means[0]) * (lp[i] - means[1]); }
  // The token may be in the subset: masked in, and for clip_cov one the PPO clip leaves alone (verl's
  // ~clip_by_origin, in its own form) inside the covariance band.
  C10_HOST_DEVICE bool candidate(int64_t i) const {
    if (!mask[i]) return false;
    if (kl) return true;
    const T a = adv[i], ratio = ::exp(lp[i] - old[i]);
    const T clamped = ratio < low ? low : ratio > high ? high : ratio;
    const T c = cov(i);
    return !(-a * clamped > -a * ratio) && c > lb && c < ub;
  }
  C10_HOST_DEVICE double key(int64_t i) const {
    double k;
    if (kl) {
      k = mask[i] ? -static_cast<double>(cov(i)) : INFINITY;
    } else {
      k = candidate(i) ? draws[i] : 2.0;
    }
    return k == k ? k : INFINITY;
  }
};

// The first k of `first` (the `count` tokens of smallest key, in order) flagged where they qualify.
template <typename T>
struct CovMark {
  CovKey<T> key;
  const int64_t* first;
  bool* selected;
  C10_HOST_DEVICE void operator()(int64_t b) const {
    const int64_t i = first[b];
    if (static_cast<T>(b) < key.means[2] && key.candidate(i)) selected[i] = true;
  }
};

// Writes each token's key (the sort's input).
template <typename T>
struct CovKeys {
  CovKey<T> key;
  double* out;
  C10_HOST_DEVICE void operator()(int64_t i) const { out[i] = key.key(i); }
};

// What cov_selection hands a device: inputs (N,) contiguous, `selected` zeroed, `first` (count,).
struct CovSelectArgs {
  bool kl;
  double ratio, eps_low, eps_high, lb, ub;
  at::Tensor log_probs, old_log_probs, advantages, mask, draws;  // draws: clip_cov only
  at::Tensor means;                                              // (3,) scratch of the log-probs' dtype
  at::Tensor selected, first;
};

template <typename Runner>
void cov_select(const CovSelectArgs& s) {
  const int64_t n = s.mask.numel(), count = s.first.numel();
  AT_DISPATCH_FLOATING_TYPES(s.log_probs.scalar_type(), "cov_selection", [&] {
    using T = scalar_t;
    const CovKey<T> key{s.mask.const_data_ptr<bool>(),
                        s.advantages.const_data_ptr<T>(),
                        s.log_probs.const_data_ptr<T>(),
                        s.old_log_probs.const_data_ptr<T>(),
                        s.kl ? nullptr : s.draws.const_data_ptr<double>(),
                        s.means.const_data_ptr<T>(),
                        s.kl,
                        static_cast<T>(1.0 - s.eps_low),
                        static_cast<T>(1.0 + s.eps_high),
                        static_cast<T>(s.lb),
                        static_cast<T>(s.ub)};
    Runner::sum_then(n, CovMeans<T>{key.mask, key.adv, key.lp, s.ratio, s.means.data_ptr<T>()});
    if (count <= kCovSelectSweeps) {
      Runner::select_first(n, count, key, s.first.data_ptr<int64_t>());
    } else {
      const at::Tensor keys = at::empty({n}, s.mask.options().dtype(at::kDouble));
      Runner::for_each(n, CovKeys<T>{key, keys.data_ptr<double>()});
      s.first.copy_(std::get<1>(keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false)).narrow(0, 0, count));
    }
    Runner::for_each(count, CovMark<T>{key, s.first.const_data_ptr<int64_t>(), s.selected.data_ptr<bool>()});
  });
}

void cov_select_cpu(const CovSelectArgs& s);

}  // namespace rl_losses
