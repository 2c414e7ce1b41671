// The boxed back-end kernels of the loss ops, written once: each reads its op's arguments by name
// (common/schema.h), builds the row source and runs the loss's shared forward, then sets the results by name.
//
// A loss is a struct `Loss` with
//   static constexpr const char* kName;          // the public op (messages, registration)
//   static constexpr const char* kLinearName;    // its fused-linear op, where it has one
//   static Results run(RowSource&, const at::Tensor& target, schema::Args&, bool logits_op);
// where run reads the loss's own argument groups (the tensor-parallel hooks only when `logits_op`) and Results is
// a result group. Its `_<name>_forward`, `_<name>_forward_inplace` and, when it has one, `_linear_<name>_forward`
// kernels are registered by register_loss below, the same way on every back-end.
#pragma once

#include <torch/library.h>

#include <string>

#include "common/boxed_kernel.h"
#include "common/row_source.h"
#include "linear/linear_source.h"
#include "op_args.h"

namespace rl_losses {

template <class Loss, bool kInplace>
void logits_loss_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const auto in = args.read<LogitsInput>();
  const auto shard = args.read<VocabShard>();
  const bool compute_grad = !kInplace && args.read<ComputeGradArg>().compute_grad;
  // The gradient is scaled by `_scale_grad_` in the backward, so fp16 rows may be stored pre-scaled.
  LogitsSource src(Loss::kName, in.logits, in.target, shard.vocab_start, shard.vocab_size, compute_grad, kInplace,
                   /*scaled_later=*/true);
  Loss::run(src, in.target, args, true).write(args);
  if (!kInplace) GradResult{src.grads()[0]}.write(args);
  GradRowUnscaleResult{src.grad_row_unscale()}.write(args);
  args.push_results();
}

template <class Loss, const LinearBackend& (*kLinear)()>
void linear_loss_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const auto in = args.read<LinearInput>();
  const auto linear = args.read<LinearOptions>();
  LinearSource src(Loss::kLinearName, in.hidden, in.weight, linear.bias, in.target, linear,
                   args.read<OutputMaskArg>().output_mask, kLinear());
  Loss::run(src, in.target, args, false).write(args);
  const auto g = src.grads();
  LinearGradResults{g[0], g[1], g[2]}.write(args);
  args.push_results();
}

// Registers a loss's forward kernels on one back-end: `_<name>_forward` and `_<name>_forward_inplace`.
template <class Loss, template <BoxedKernel> class Wrap = BelowAutograd>
void register_loss(torch::Library& m) {
  const std::string name = Loss::kName;
  m.impl(("_" + name + "_forward").c_str(), boxed<&logits_loss_kernel<Loss, false>, Wrap>());
  m.impl(("_" + name + "_forward_inplace").c_str(), boxed<&logits_loss_kernel<Loss, true>, Wrap>());
}

// And `_linear_<name>_forward`, over the back-end's GEMMs.
template <class Loss, const LinearBackend& (*kLinear)(), template <BoxedKernel> class Wrap = BelowAutograd>
void register_linear_loss(torch::Library& m) {
  const std::string name = std::string("_") + Loss::kLinearName + "_forward";
  m.impl(name.c_str(), boxed<&linear_loss_kernel<Loss, kLinear>, Wrap>());
}

}  // namespace rl_losses
