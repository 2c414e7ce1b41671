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

// Columns of the per-token output the epilogue writes (zeros on unlabelled tokens).
enum GrpoField : int { kGrpoLoss = 0, kGrpoLogProb, kGrpoRatio, kGrpoLow, kGrpoHigh, kGrpoKlOld, kGrpoEntropy,
                       kGrpoFields };

template <typename acc_t>
struct GrpoEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  GrpoOptions<acc_t> opt;
  const acc_t* advantages;
  const acc_t* old_log_probs;
  const acc_t* ref_log_probs;  // null when beta == 0
  const acc_t* loss_weights;   // null: the label mask
  const acc_t* divisor;        // 0-dim D
  acc_t* out;                  // (N, kGrpoFields)
  bool entropy;

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    acc_t* o = out + row * kGrpoFields;
    if (label < 0) {
      for (int k = 0; k < kGrpoFields; ++k) o[k] = acc_t(0);
      return {acc_t(0), acc_t(0), acc_t(0)};
    }
    const acc_t lp = st.label - st.lse();
    const acc_t adv = advantages[row], old = old_log_probs[row];
    const PolicyToken<acc_t> t = grpo_token(opt, lp, old, adv, ref_log_probs ? ref_log_probs[row] : acc_t(0));
    const acc_t w = (loss_weights ? loss_weights[row] : acc_t(1)) / *divisor;
    o[kGrpoLoss] = w * t.loss;
    o[kGrpoLogProb] = lp;
    o[kGrpoRatio] = t.ratio;
    o[kGrpoLow] = clipped_low(opt.clip, t.ratio, adv) ? acc_t(1) : acc_t(0);
    o[kGrpoHigh] = clipped_high(opt.clip, t.ratio, adv) ? acc_t(1) : acc_t(0);
    o[kGrpoKlOld] = k3(old - lp);
    o[kGrpoEntropy] = entropy ? st.entropy() : acc_t(0);
    return {w * t.coef, -w * t.coef, acc_t(0)};
  }
};

struct GrpoRows {
  GrpoOptions<double> opt;
  at::Tensor advantages, old_log_probs, ref_log_probs, loss_weights;  // (N,) acc dtype; last two optional
  at::Tensor divisor;
  at::Tensor out;  // (N, kGrpoFields)
  bool entropy;
};

template <typename acc_t>
GrpoEpilogue<acc_t> make_grpo_epilogue(const GrpoRows& r) {
  const auto& o = r.opt;
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
  return {{{acc_t(o.clip.epsilon_low), acc_t(o.clip.epsilon_high), acc_t(o.clip.delta)}, acc_t(o.beta)},
          ptr(r.advantages), ptr(r.old_log_probs), ptr(r.ref_log_probs), ptr(r.loss_weights),
          r.divisor.const_data_ptr<acc_t>(), r.out.data_ptr<acc_t>(), r.entropy};
}

using GrpoBackend = void (*)(const RowPassArgs&, const GrpoRows&);

// Returns the 8 outputs of the `grpo` schema; the gradient, when the source wants one, is the source's.
std::vector<at::Tensor> grpo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const at::Tensor& old_log_probs, const std::optional<at::Tensor>& ref_log_probs,
                                     const std::optional<at::Tensor>& loss_weights,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, std::optional<double> delta, double beta,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats, GrpoBackend backend);

using T8 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using T9 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                      at::Tensor>;

template <GrpoBackend kBackend>
struct GrpoOps {
  using Opt = std::optional<at::Tensor>;
  static T9 forward(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv, const at::Tensor& old,
                    const Opt& ref, const Opt& w, const Opt& counts, double el, double eh, std::optional<double> delta,
                    double beta, std::optional<double> d, double s, bool entropy, const Opt& stats, int64_t vs,
                    int64_t vn, bool compute_grad) {
    LogitsSource src("grpo", logits, target, vs, vn, compute_grad, false);
    auto o = grpo_forward(src, target, adv, old, ref, w, counts, el, eh, delta, beta, d, s, entropy, stats, kBackend);
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], src.grads()[0]};
  }
  static T8 forward_inplace(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv,
                            const at::Tensor& old, const Opt& ref, const Opt& w, const Opt& counts, double el,
                            double eh, std::optional<double> delta, double beta, std::optional<double> d, double s,
                            bool entropy, const Opt& stats, int64_t vs, int64_t vn) {
    LogitsSource src("grpo", logits, target, vs, vn, false, true);
    auto o = grpo_forward(src, target, adv, old, ref, w, counts, el, eh, delta, beta, d, s, entropy, stats, kBackend);
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]};
  }
};

}  // namespace rl_losses
