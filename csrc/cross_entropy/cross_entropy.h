// Cross-entropy from labels, with label smoothing and z-loss (docs/math.md): the row-pass epilogue and the
// device-independent forward that the CPU and CUDA registrations share.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "common/row_pass.h"
#include "common/row_source.h"

namespace rl_losses {

template <typename acc_t>
struct CrossEntropyEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = true;
  static constexpr bool kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = false;  // lse is an output of every row, labelled or not
  CrossEntropyOptions<acc_t> opt;
  // D: counted on the device (0-dim, the labelled tokens) or, when that is null, known on the host (a given
  // divisor, 1 for reduction "sum" or "none"): a host value needs no fill kernel before the row pass.
  const acc_t* divisor;
  acc_t divisor_value;
  acc_t* row_loss;       // (N,) m_t·ℓ_t / D
  acc_t* lse;            // (N,)

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    const acc_t l = st.lse();
    lse[row] = l;
    if (label < 0) {  // no label: no loss, zero gradient
      row_loss[row] = acc_t(0);
      return {acc_t(0), acc_t(0), acc_t(0)};
    }
    const acc_t inv_d = acc_t(1) / (divisor != nullptr ? *divisor : divisor_value);
    row_loss[row] = cross_entropy_loss(opt, l, st.log_prob(st.label), st.sum_x) * inv_d;
    return cross_entropy_grad(opt, l, inv_d);
  }
};

// What the back-end fills: row_loss and lse (N,), and the gradient when args.grad is defined.
struct CrossEntropyRows {
  CrossEntropyOptions<double> opt;
  at::Tensor divisor;           // 0-dim D on the device, or undefined: divisor_value
  double divisor_value = 1.0;
  at::Tensor row_loss;
  at::Tensor lse;
};

using CrossEntropyBackend = void (*)(const RowPassArgs&, const CrossEntropyRows&);

// Shared forward over any row source: validation, divisor, back-end call, reduction. Returns (loss, lse);
// the gradient, when the source wants one, is the source's (src.grads()).
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(RowSource& src, const at::Tensor& target,
                                                         double logits_scale_factor, double label_smoothing,
                                                         double z_loss_factor, double label_weight,
                                                         const std::string& reduction, std::optional<double> divisor,
                                                         const std::optional<at::Tensor>& row_stats,
                                                         CrossEntropyBackend backend);

// The registered forward ops of one back-end (its .cpp/.cu file registers these with its row function).
template <CrossEntropyBackend kBackend>
struct CrossEntropyOps {
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
      const at::Tensor& logits, const at::Tensor& target, double s, double eps, double z, double lw,
      c10::string_view reduction, std::optional<double> d, const std::optional<at::Tensor>& stats, int64_t vs,
      int64_t vn, bool compute_grad) {
    LogitsSource src("cross_entropy", logits, target, vs, vn, compute_grad, false, true);
    auto [loss, lse] = cross_entropy_forward(src, target, s, eps, z, lw, std::string(reduction), d, stats, kBackend);
    return {loss, lse, src.grads()[0], src.grad_row_unscale()};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_inplace(
      const at::Tensor& logits, const at::Tensor& target, double s, double eps, double z, double lw,
      c10::string_view reduction, std::optional<double> d, const std::optional<at::Tensor>& stats, int64_t vs,
      int64_t vn) {
    LogitsSource src("cross_entropy", logits, target, vs, vn, false, true, true);
    auto [loss, lse] = cross_entropy_forward(src, target, s, eps, z, lw, std::string(reduction), d, stats, kBackend);
    return {loss, lse, src.grad_row_unscale()};
  }
};

// Builds the epilogue for accumulation type acc_t (the back-ends call this inside their dtype dispatch).
template <typename acc_t>
CrossEntropyEpilogue<acc_t> make_cross_entropy_epilogue(const CrossEntropyRows& rows) {
  const auto& o = rows.opt;
  return {{acc_t(o.label_weight), acc_t(o.label_smoothing), acc_t(o.z_loss_factor), acc_t(o.vocab_size)},
          rows.divisor.defined() ? rows.divisor.const_data_ptr<acc_t>() : nullptr, acc_t(rows.divisor_value),
          rows.row_loss.data_ptr<acc_t>(), rows.lse.data_ptr<acc_t>()};
}

}  // namespace rl_losses
