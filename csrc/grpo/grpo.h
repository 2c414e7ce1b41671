// GRPO (SPEC §2.2): per-token clipped importance ratio, optional k3 penalty and two-sided clip, fused with
// the metrics of SPEC §2.4. The row-pass epilogue and the device-independent forward shared by the CPU and
// CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/row_pass.h"
#include "common/row_source.h"

namespace rl_losses {

// Columns of the per-token output the epilogue writes (zeros on unlabelled tokens); the log-probs, an output
// of their own, go to a separate array.
enum GrpoField : int { kGrpoLoss = 0, kGrpoRatio, kGrpoLow, kGrpoHigh, kGrpoKlOld, kGrpoEntropy, kGrpoFields };

template <typename acc_t>
struct GrpoEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = false;
  static constexpr bool kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = true;  // a masked token's outputs and gradient are zeros
  GrpoOptions<acc_t> opt;
  const acc_t* advantages;
  const acc_t* old_log_probs;
  const acc_t* ref_log_probs;  // null when beta == 0
  const acc_t* loss_weights;   // null: the label mask
  const acc_t* divisor;        // 0-dim D
  acc_t* out;                  // (N, kGrpoFields)
  acc_t* log_probs;            // (N,)
  bool entropy;

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    acc_t* o = out + row * kGrpoFields;
    if (label < 0) {
      for (int k = 0; k < kGrpoFields; ++k) o[k] = acc_t(0);
      log_probs[row] = acc_t(0);
      return {acc_t(0), acc_t(0), acc_t(0)};
    }
    const acc_t lp = st.log_prob(st.label);
    const acc_t adv = advantages[row], old = old_log_probs[row];
    const PolicyToken<acc_t> t = grpo_token(opt, lp, old, adv, ref_log_probs ? ref_log_probs[row] : acc_t(0));
    const acc_t w = (loss_weights ? loss_weights[row] : acc_t(1)) / *divisor;
    o[kGrpoLoss] = w * t.loss;
    log_probs[row] = lp;
    o[kGrpoRatio] = t.ratio;
    o[kGrpoLow] = clipped_low(opt.clip, t.ratio, adv) ? acc_t(1) : acc_t(0);
    o[kGrpoHigh] = clipped_high(opt.clip, t.ratio, adv) ? acc_t(1) : acc_t(0);
    o[kGrpoKlOld] = k3(old - lp);
    o[kGrpoEntropy] = entropy ? st.entropy() : acc_t(0);
    return {w * t.coef, -w * t.coef, acc_t(0)};
  }
};

// The scalar outputs from the per-token ones, in one reduction (a runner's sum_then): the loss sums the token
// shares, the other means divide by the labelled count; new_logprobs is the mean over documents of their
// mean log-prob (label_counts given) or the token mean.
template <typename T>
struct GrpoMetrics {
  using acc_t = T;
  enum : int { kLogProb = kGrpoFields, kDocLogProb, kDocWeight, kTerms };
  const acc_t* out;         // (N, kGrpoFields)
  const acc_t* log_probs;   // (N,)
  const int64_t* target;    // (N,)
  const acc_t* counts;      // (N,) label_counts, or null
  const acc_t* n_labelled;  // 0-dim, >= 1
  PolicyScalarPtrs<acc_t> dst;
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const {
    for (int k = 0; k < kGrpoFields; ++k) v[k] = out[i * kGrpoFields + k];
    v[kLogProb] = log_probs[i];
    // Each token weighs 1 / (its document's labelled tokens), so a document's weights sum to 1.
    const acc_t w = counts != nullptr && target[i] >= 0 ? acc_t(1) / at_least_one(counts[i]) : acc_t(0);
    v[kDocLogProb] = w * log_probs[i];
    v[kDocWeight] = w;
  }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    const acc_t n = *n_labelled;
    *dst.p[kPolicyLoss] = s[kGrpoLoss];
    *dst.p[kPolicyNewLogProbs] =
        counts != nullptr ? s[kDocLogProb] / (s[kDocWeight] > acc_t(1e-30) ? s[kDocWeight] : acc_t(1e-30))
                          : s[kLogProb] / n;
    *dst.p[kPolicyClipLow] = s[kGrpoLow] / n;
    *dst.p[kPolicyClipHigh] = s[kGrpoHigh] / n;
    *dst.p[kPolicyKlOld] = s[kGrpoKlOld] / n;
    *dst.p[kPolicyEntropy] = s[kGrpoEntropy] / n;
    *dst.p[kPolicyRatioMean] = s[kGrpoRatio] / n;
  }
};

struct GrpoRows {
  GrpoOptions<double> opt;
  at::Tensor advantages, old_log_probs, ref_log_probs, loss_weights;  // (N,) acc dtype; last two optional
  at::Tensor divisor;
  at::Tensor out;        // (N, kGrpoFields)
  at::Tensor log_probs;  // (N,)
  bool entropy;
};

template <typename acc_t>
GrpoEpilogue<acc_t> make_grpo_epilogue(const GrpoRows& r) {
  const auto& o = r.opt;
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
  return {{{acc_t(o.clip.epsilon_low), acc_t(o.clip.epsilon_high), acc_t(o.clip.delta)}, acc_t(o.beta)},
          ptr(r.advantages), ptr(r.old_log_probs), ptr(r.ref_log_probs), ptr(r.loss_weights),
          r.divisor.const_data_ptr<acc_t>(), r.out.data_ptr<acc_t>(), r.log_probs.data_ptr<acc_t>(), r.entropy};
}

// The back-end: the row pass and the metrics reduction, on one device.
struct GrpoBackend {
  void (*rows)(const RowPassArgs&, const GrpoRows&);
  void (*metrics)(const GrpoRows&, const at::Tensor& target1d, const at::Tensor& counts,
                  const at::Tensor& n_labelled, const PolicyScalarOutputs& dst);
};

template <typename Runner>
struct GrpoBackendImpl {
  static void rows(const RowPassArgs& args, const GrpoRows& r) {
    Runner::row_pass(args, "grpo", [&](auto* tag) {
      return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>>(r);
    });
  }
  static void metrics(const GrpoRows& r, const at::Tensor& target1d, const at::Tensor& counts,
                      const at::Tensor& n_labelled, const PolicyScalarOutputs& dst) {
    AT_DISPATCH_FLOATING_TYPES(r.out.scalar_type(), "grpo", [&] {
      const scalar_t* per_doc = counts.defined() ? counts.const_data_ptr<scalar_t>() : nullptr;
      Runner::sum_then(r.out.size(0), GrpoMetrics<scalar_t>{r.out.const_data_ptr<scalar_t>(),
                                                            r.log_probs.const_data_ptr<scalar_t>(),
                                                            target1d.const_data_ptr<int64_t>(), per_doc,
                                                            n_labelled.const_data_ptr<scalar_t>(),
                                                            dst.ptrs<scalar_t>()});
    });
  }
  static constexpr GrpoBackend backend() { return {&rows, &metrics}; }
};

// Returns the 8 outputs of the `grpo` schema; the gradient, when the source wants one, is the source's.
std::vector<at::Tensor> grpo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const at::Tensor& old_log_probs, const std::optional<at::Tensor>& ref_log_probs,
                                     const std::optional<at::Tensor>& loss_weights,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, std::optional<double> delta, double beta,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats, const GrpoBackend& backend);

using T8 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using T9 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                      at::Tensor>;

template <const GrpoBackend& (*kBackend)()>
struct GrpoOps {
  using Opt = std::optional<at::Tensor>;
  static T9 forward(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv, const at::Tensor& old,
                    const Opt& ref, const Opt& w, const Opt& counts, double el, double eh, std::optional<double> delta,
                    double beta, std::optional<double> d, double s, bool entropy, const Opt& stats, int64_t vs,
                    int64_t vn, bool compute_grad) {
    LogitsSource src("grpo", logits, target, vs, vn, compute_grad, false);
    auto o = grpo_forward(src, target, adv, old, ref, w, counts, el, eh, delta, beta, d, s, entropy, stats, kBackend());
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], src.grads()[0]};
  }
  static T8 forward_inplace(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv,
                            const at::Tensor& old, const Opt& ref, const Opt& w, const Opt& counts, double el,
                            double eh, std::optional<double> delta, double beta, std::optional<double> d, double s,
                            bool entropy, const Opt& stats, int64_t vs, int64_t vn) {
    LogitsSource src("grpo", logits, target, vs, vn, false, true);
    auto o = grpo_forward(src, target, adv, old, ref, w, counts, el, eh, delta, beta, d, s, entropy, stats, kBackend());
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]};
  }
};

}  // namespace rl_losses
