// The statistics-only row pass as an op (`row_stats`): per row max, sumexp, Σexp(x-max)·x, Σx and the
// label's logit of this rank's vocabulary shard. Tensor parallelism all-reduces these and hands them back to
// the loss ops through their `row_stats` argument; GSPO uses them for its first pass.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "common/checks.h"
#include "common/row_pass.h"
#include "op_args.h"

namespace rl_losses {

using StatsBackend = void (*)(const RowPassArgs&, const at::Tensor& out);

// row_stats' arguments (op_args.h).
#define RL_LOSSES_ROW_STATS_OP_ARGS(X) \
  RL_LOSSES_LOGITS_INPUT(X) RL_LOSSES_SCALE(X) RL_LOSSES_VOCAB_SHARD(X) RL_LOSSES_ROW_STATS_OPTIONS(X)
RL_LOSSES_ARG_GROUP(RowStatsOpArgs, RL_LOSSES_ROW_STATS_OP_ARGS)

// The op's kernel on one back-end (boxed, arguments by name: common/schema.h).
template <StatsBackend kBackend>
void row_stats_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const auto a = args.read<RowStatsOpArgs>();
  const FlatLogits f = check_and_flatten("row_stats", a.logits, a.target, a.vocab_start, a.vocab_size);
  check_scale("row_stats", a.logits_scale_factor);
  at::Tensor out = at::empty({f.n_rows, 5}, a.logits.options().dtype(acc_dtype(a.logits.scalar_type())));
  RowPassArgs pass = make_row_pass_args(f, a.logits_scale_factor);
  pass.logits = f.logits2d;
  pass.entropy = a.entropy;
  pass.smoothing = a.smoothing;
  if (f.n_rows > 0) kBackend(pass, out);
  auto shape = a.target.sizes().vec();
  shape.push_back(5);
  StatsResult{out.view(shape)}.write(args);
  args.push_results();
}

// labelled_count (checks.h) on one device: `out` a 0-dim floating tensor.
template <typename Runner>
void labelled_count_on(const at::Tensor& target1d, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "labelled_count", [&] {
    Runner::sum_then(target1d.numel(),
                     LabelledCount<scalar_t>{target1d.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>()});
  });
}
void labelled_count_cpu(const at::Tensor& target1d, const at::Tensor& out);

// The labelled count, and a value known on the host (a given divisor) written into a 0-dim tensor by the same
// launch: where an op needs both on the device, one reduction instead of the reduction and a fill kernel.
template <typename T>
struct LabelledCountAndConstant {
  using acc_t = T;
  static constexpr int kTerms = 1;
  LabelledCount<T> count;
  acc_t* constant_out;  // 0-dim
  acc_t constant;
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const { count.terms(i, v); }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    count.finish(s);
    *constant_out = constant;
  }
};
template <typename Runner>
void labelled_count_and_constant_on(const at::Tensor& target1d, const at::Tensor& out, const at::Tensor& constant_out,
                                    double constant) {
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "labelled_count", [&] {
    Runner::sum_then(target1d.numel(),
                     LabelledCountAndConstant<scalar_t>{{target1d.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>()},
                                                        constant_out.data_ptr<scalar_t>(),
                                                        static_cast<scalar_t>(constant)});
  });
}
void labelled_count_and_constant_cpu(const at::Tensor& target1d, const at::Tensor& out, const at::Tensor& constant_out,
                                     double constant);
#ifdef RL_LOSSES_WITH_CUDA
void labelled_count_and_constant_cuda(const at::Tensor& target1d, const at::Tensor& out,
                                      const at::Tensor& constant_out, double constant);
#endif

// (labelled_count(target1d, dtype), a 0-dim `dtype` tensor holding `constant`) on the target's device.
std::pair<at::Tensor, at::Tensor> labelled_count_and_constant(const at::Tensor& target1d, at::ScalarType dtype,
                                                              double constant);

}  // namespace rl_losses
