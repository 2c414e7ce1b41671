// The statistics-only row pass as an op (`row_stats`): per row max, sumexp, Σexp(x-max)·x, Σx and the
// label's logit of this rank's vocabulary shard. Tensor parallelism all-reduces these and hands them back to
// the loss ops through their `row_stats` argument; GSPO uses them for its first pass.
#pragma once

#include <ATen/ATen.h>

#include "common/checks.h"
#include "common/row_pass.h"

namespace rl_losses {

using StatsBackend = void (*)(const RowPassArgs&, const at::Tensor& out);

template <StatsBackend kBackend>
at::Tensor row_stats_op(const at::Tensor& logits, const at::Tensor& target, double logits_scale_factor,
                        int64_t vocab_start, int64_t vocab_size, bool entropy, bool smoothing) {
  constexpr const char* op = "row_stats";
  const FlatLogits f = check_and_flatten(op, logits, target, vocab_start, vocab_size);
  check_scale(op, logits_scale_factor);
  at::Tensor out = at::empty({f.n_rows, 5}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  args.logits = f.logits2d;
  args.entropy = entropy;
  args.smoothing = smoothing;
  if (f.n_rows > 0) kBackend(args, out);
  auto shape = target.sizes().vec();
  shape.push_back(5);
  return out.view(shape);
}

}  // namespace rl_losses
