// Cross-entropy from labels, with label smoothing and z-loss (docs/math.md): the row-pass epilogue and the
// device-independent forward that the CPU and CUDA registrations share.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "common/row_pass.h"
#include "common/row_source.h"
#include "op_args.h"

namespace rl_losses {

template <typename acc_t>
struct CrossEntropyEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = true;
  static constexpr bool kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = false;  // lse is an output of every row (unless lse_of_labelled_only)
  CrossEntropyOptions<acc_t> opt;
  // D: counted on the device (0-dim, the labelled tokens) or, when that is null, known on the host (a given
  // divisor, 1 for reduction "sum" or "none"): a host value needs no fill kernel before the row pass.
  const acc_t* divisor;
  acc_t divisor_value;
  acc_t* row_loss;       // (N,) m_t·ℓ_t / D
  acc_t* lse;            // (N,)
  // lse 0 on an unlabelled row, as where the source leaves such rows out (RowSource::unlabelled_outputs_zero): the
  // result then does not depend on whether it did, and no kernel clears those rows afterwards.
  bool lse_of_labelled_only;

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    const acc_t l = st.lse();
    lse[row] = label < 0 && lse_of_labelled_only ? acc_t(0) : l;
    if (label < 0) {  // no label: no loss, zero gradient
      row_loss[row] = acc_t(0);
      return {acc_t(0), acc_t(0), acc_t(0)};
    }
    const acc_t inv_d = acc_t(1) / divisor_of(divisor, divisor_value);
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
  bool lse_of_labelled_only = false;  // CrossEntropyEpilogue's
};

using CrossEntropyBackend = void (*)(const RowPassArgs&, const CrossEntropyRows&);

// cross_entropy's and linear_cross_entropy's options (op_args.h).
RL_LOSSES_ARG_GROUP(CrossEntropyArgs, RL_LOSSES_CROSS_ENTROPY_KEYWORDS)
RL_LOSSES_RESULT_GROUP(CrossEntropyResults, RL_LOSSES_CE_RESULTS)

// Shared forward over any row source: validation, divisor, back-end call, reduction. The gradient, when the source
// wants one, is the source's (src.grads()).
CrossEntropyResults cross_entropy_forward(RowSource& src, const at::Tensor& target, const CrossEntropyArgs& a,
                                          const OptTensor& row_stats, CrossEntropyBackend backend);

// The loss of the registered kernels (common/loss_kernels.h), given a back-end's row function.
template <CrossEntropyBackend kBackend>
struct CrossEntropyLoss {
  static constexpr const char* kName = "cross_entropy";
  static constexpr const char* kLinearName = "linear_cross_entropy";
  static CrossEntropyResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool logits_op) {
    const auto a = args.read<CrossEntropyArgs>();
    // The fused lm_head sums the weight gradient over tokens in the forward, so one upstream value per token
    // cannot be applied afterwards.
    TORCH_CHECK(logits_op || a.reduction != "none" || !src.wants_grad(), src.op(),
                ": reduction='none' cannot be differentiated (the weight gradient is summed over tokens in the "
                "forward); use 'sum' or 'mean', or call it without gradients");
    return cross_entropy_forward(src, target, a, logits_op ? args.read<RowStatsArg>().row_stats : std::nullopt,
                                 kBackend);
  }
};

// Builds the epilogue for accumulation type acc_t (the back-ends call this inside their dtype dispatch).
template <typename acc_t>
CrossEntropyEpilogue<acc_t> make_cross_entropy_epilogue(const CrossEntropyRows& rows) {
  return {.opt = rows.opt.template as<acc_t>(),
          .divisor = rows.divisor.defined() ? rows.divisor.const_data_ptr<acc_t>() : nullptr,
          .divisor_value = acc_t(rows.divisor_value),
          .row_loss = rows.row_loss.data_ptr<acc_t>(),
          .lse = rows.lse.data_ptr<acc_t>(),
          .lse_of_labelled_only = rows.lse_of_labelled_only};
}

}  // namespace rl_losses
