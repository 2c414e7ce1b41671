#include "cross_entropy/cross_entropy.h"

#include <cmath>

#include "common/checks.h"

namespace rl_losses {

CrossEntropyResults cross_entropy_forward(RowSource& src, const at::Tensor& target, const CrossEntropyArgs& a,
                                          const OptTensor& row_stats, CrossEntropyBackend backend) {
  const char* op = src.op();
  const double logits_scale_factor = a.logits_scale_factor, label_smoothing = a.label_smoothing;
  const double z_loss_factor = a.z_loss_factor, label_weight = a.label_weight;
  const std::string& reduction = a.reduction;
  const std::optional<double>& divisor = a.divisor;
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  TORCH_CHECK(std::isfinite(label_smoothing) && label_smoothing >= 0 && label_smoothing < 1, op,
              ": label_smoothing must be in [0, 1), got ", label_smoothing);
  TORCH_CHECK(std::isfinite(z_loss_factor) && z_loss_factor >= 0, op, ": z_loss_factor must be >= 0, got ",
              z_loss_factor);
  TORCH_CHECK(std::isfinite(label_weight) && label_weight >= 0, op, ": label_weight must be finite and >= 0, got ",
              label_weight);
  TORCH_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none", op,
              ": reduction must be 'mean', 'sum' or 'none', got '", reduction, "'");
  check_divisor(op, divisor);
  check_row_stats(op, row_stats, f);

  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  // The divisor: the labelled count (one reduction on the device) for a token mean without a given divisor;
  // otherwise a host value the epilogue takes by value (an at::full here would be a fill kernel per call).
  at::Tensor d;
  double d_value = 1.0;
  if (reduction == "none") {
    TORCH_CHECK(!divisor, op, ": divisor has no meaning with reduction='none'");
  } else if (divisor || reduction == "sum") {
    d_value = divisor.value_or(1.0);
  } else {
    d = labelled_count(f.target1d, acc);
  }

  CrossEntropyRows rows{.opt = {.label_weight = label_weight,
                                .label_smoothing = label_smoothing,
                                .z_loss_factor = z_loss_factor,
                                .vocab_size = static_cast<double>(f.vocab_total)},
                        .divisor = d,
                        .divisor_value = d_value,
                        .row_loss = src.row_outputs({f.n_rows}),
                        .lse = src.row_outputs({f.n_rows}),
                        .lse_of_labelled_only = src.unlabelled_outputs_zero()};
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  if (row_stats) args.stats_in = *row_stats;
  args.smoothing = label_smoothing != 0 && label_weight != 0;
  if (f.n_rows > 0) {
    src.run(args, src.wants_grad(), [&](RowPassArgs& a) {
      split_stats_pass_on_cuda(a);
      backend(a, rows);
    });
  }

  const auto batch = target.sizes();
  at::Tensor loss = reduction == "none" ? rows.row_loss.view(batch) : sum_1d(rows.row_loss);
  return {loss, rows.lse.view(batch)};
}

}  // namespace rl_losses
