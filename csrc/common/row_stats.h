// The statistics-only row pass as an op (`row_stats`): per row max, sumexp, Σexp(x-max)·x, Σx and the
// label's logit of this rank's vocabulary shard. Tensor parallelism all-reduces these and hands them back to
// the loss ops through their `row_stats` argument; GSPO uses them for its first pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <type_traits>
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

// The op's kernel on one back-end (boxed, arguments by name: common/schema.h); kBlocks for tp_blocks in the
// batch-invariant mode.
template <StatsBackend kBackend, StatsBackend kBlocks = kBackend>
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
  if (f.n_rows > 0) (a.tp_blocks && pass.batch_invariant ? kBlocks : kBackend)(pass, out);
  auto shape = a.target.sizes().vec();
  shape.push_back(5);
  StatsResult{out.view(shape)}.write(args);
  args.push_results();
}

// One value of `_scale_grad_`: the stored gradient value s times its row's factor f (the upstream gradient,
// times 2^-k for a pre-scaled fp16 row), in fp32 and rounded once to the gradient's dtype. A pre-scaled fp16 value
// has been rounded once already (row_pass.h, GradRowPrescaled): where the product rounds to zero but the value
// stored, give or take its own rounding, is above half fp16's smallest subnormal (2^-25, below which eager's single
// rounding g·gradient -> fp16 gives zero), it becomes that subnormal (2^-24) instead, so that no value the single
// rounding keeps is lost.
template <typename scalar_t, typename acc_t, bool kPrescaled>
C10_HOST_DEVICE inline scalar_t scaled_grad_value(scalar_t s, acc_t f) {
  const acc_t v = static_cast<acc_t>(s) * f;
  const scalar_t out = static_cast<scalar_t>(v);
  if constexpr (kPrescaled && std::is_same_v<scalar_t, c10::Half>) {
    const float a = ::fabsf(static_cast<float>(s));
    if (static_cast<float>(out) == 0.f && a != 0.f && (a * (1.f + 0x1p-11f) + 0x1p-25f) * ::fabsf(f) > 0x1p-25f)
      return static_cast<scalar_t>(v < 0.f ? -0x1p-24f : 0x1p-24f);
  }
  return out;
}

// `_scale_grad_`'s arguments: grad_output one value (0-dim) or one per row of the gradient (reduction="none");
// row_unscale (row_pass.h, GradRowPrescaled) absent or empty, or one contiguous fp32 factor per row, on the
// gradient's device.
inline void check_scale_grad(const at::Tensor& grad2d, const at::Tensor& grad_output,
                             const std::optional<at::Tensor>& u) {
  TORCH_CHECK((grad_output.numel() == 1 && grad_output.dim() == 0) || grad_output.numel() == grad2d.size(0),
              "_scale_grad_: grad_output has ", grad_output.numel(), " values for a gradient of ", grad2d.size(0),
              " rows");
  if (!u.has_value() || u->numel() == 0) return;
  TORCH_CHECK(u->scalar_type() == at::kFloat && u->dim() == 1 && u->numel() == grad2d.size(0) && u->is_contiguous() &&
                  u->device() == grad2d.device(),
              "_scale_grad_: row_unscale must be a contiguous float32 vector of ", grad2d.size(0), " values on ",
              grad2d.device(), ", got ", u->scalar_type(), " of shape ", u->sizes(), " on ", u->device());
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
