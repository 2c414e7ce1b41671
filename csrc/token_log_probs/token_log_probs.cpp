
#include "token_log_probs/token_log_probs.h"

#include <ATen/ops/empty.h>

#include "common/checks.h"
#include "common/sampler.h"

namespace rl_losses {

TokenLogProbsForward token_log_probs_forward(RowSource& src, const at::Tensor& target, const TokenLogProbsArgs& a,
                                             const OptTensor& row_stats, const TokenLogProbsBackend& backend) {
  const char* op = src.op();
  const double logits_scale_factor = a.logits_scale_factor;
  const bool compute_entropy = a.compute_entropy;
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  check_row_stats(op, row_stats, f);
  const auto opts = src.acc_options();
  TokenLogProbsRows rows{src.row_outputs({f.n_rows}), compute_entropy ? src.row_outputs({f.n_rows}) : at::Tensor(),
                         row_stats ? at::Tensor() : src.row_outputs({f.n_rows, RowStats<float>::kFields})};
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  set_sampler_params(args, op, a.sampler, target, f.n_rows, opts, row_stats.has_value());
  if (row_stats) args.stats_in = *row_stats;
  args.entropy = compute_entropy;
  if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.forward(a, rows); });
  const auto batch = target.sizes();
  return {rows.log_probs.view(batch), compute_entropy ? rows.entropy.view(batch) : at::empty({0}, opts),
          row_stats ? at::empty({0}, opts) : rows.stats_out};
}

void token_log_probs_backward(RowSource& src, const at::Tensor& target, const TokenLogProbsUpstream& upstream,
                              double logits_scale_factor, const SamplerArgs& sampler,
                              const TokenLogProbsBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  check_row_stats(op, upstream.stats, f);
  const auto acc = src.acc_options().dtype().toScalarType();
  TokenLogProbsGrads grads;
  if (upstream.grad_log_probs) {
    grads.grad_log_probs = check_per_token(op, "grad_log_probs", *upstream.grad_log_probs, target, acc);
  }
  if (upstream.grad_entropy) {
    grads.grad_entropy = check_per_token(op, "grad_entropy", *upstream.grad_entropy, target, acc);
  }
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  // The same floors as the forward's: computed again from the same logits.
  set_sampler_params(args, op, sampler, target, f.n_rows, src.acc_options(), false);
  args.stats_in = upstream.stats;
  if (f.n_rows > 0) src.run(args, true, [&](RowPassArgs& a) { backend.backward(a, grads); });
}

}  // namespace rl_losses
