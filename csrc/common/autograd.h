// Pieces every loss's C++ autograd function shares.
//
// The forward computes the gradient for an upstream gradient of 1 and saves it; the backward hands it on
// after `_scale_grad_` (an op, so that AOTAutograd traces it) scales it by the real upstream gradient. The
// saved gradient is scaled in place, so a second backward through the same graph (retain_graph=True) would
// scale it twice: that is refused with a clear error instead.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <optional>
#include <utility>
#include <vector>

namespace rl_losses {

inline c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Calls an op with a boxed argument list; returns its outputs (undefined where a `Tensor?` result is None).
inline std::vector<at::Tensor> call_boxed(const c10::OperatorHandle& op, std::vector<c10::IValue> args) {
  op.callBoxed(args);
  std::vector<at::Tensor> out;
  out.reserve(args.size());
  for (auto& v : args) out.push_back(v.isNone() ? at::Tensor() : std::move(v).toTensor());
  return out;
}

// A loss's autograd function's outputs: the loss, then the others marked non-differentiable. Autograd takes no
// undefined output, so those a forward left out (a `Tensor?` result, None) leave the list; `present` says where
// they were, for push_outputs.
inline torch::autograd::variable_list non_differentiable_after_loss(torch::autograd::AutogradContext* ctx,
                                                                    std::vector<at::Tensor> out,
                                                                    std::vector<bool>* present) {
  present->resize(out.size());
  torch::autograd::variable_list kept;
  kept.reserve(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    (*present)[i] = out[i].defined();
    if (out[i].defined()) kept.push_back(std::move(out[i]));
  }
  ctx->mark_non_differentiable(torch::autograd::variable_list(kept.begin() + 1, kept.end()));
  return kept;
}

// The autograd function's outputs onto the stack, with None where `present` says a result was left out.
inline void push_outputs(torch::jit::Stack* stack, torch::autograd::variable_list outputs,
                         const std::vector<bool>& present) {
  auto it = outputs.begin();
  for (const bool p : present) stack->emplace_back(p ? c10::IValue(std::move(*it++)) : c10::IValue());
}

// True when the forward must produce the gradient w.r.t. `t`: grad mode is on and `t` requires it.
inline bool input_needs_grad(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

// `grads`: the gradients w.r.t. the differentiable inputs, computed in the forward (undefined: not needed);
// `row_unscale`: the per-row factors of a pre-scaled fp16 gradients[0] (row_pass.h, GradRowPrescaled), or
// undefined/empty.
inline void save_fused_grads(torch::autograd::AutogradContext* ctx, const std::vector<at::Tensor>& grads,
                             const at::Tensor& row_unscale = at::Tensor()) {
  ctx->save_for_backward(grads);
  // Saved even when empty (all but fp16): under symbolic shapes its numel() cannot be asked here.
  if (row_unscale.defined()) ctx->saved_data["row_unscale"] = row_unscale;
  ctx->saved_data["consumed"] = false;
  // The backward reads only the loss's gradient: autograd need not fill zeros for the other outputs (the
  // metrics), which on CUDA cost a kernel launch each (GRPO: 7 per step).
  ctx->set_materialize_grads(false);
}

// The saved gradients, scaled in place by the upstream gradient (undefined ones stay undefined).
inline std::vector<at::Tensor> take_fused_grads(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_output,
                                                const char* op) {
  TORCH_CHECK(!ctx->saved_data["consumed"].toBool(), op,
              ": backward was already run through this loss; its gradient is computed in the forward and "
              "scaled in place, so a second backward (retain_graph=True) is not supported: call the loss again");
  ctx->saved_data["consumed"] = true;
  // Autograd runs a backward in grad mode only for create_graph=True. The saved gradient has no graph of its
  // own, so the second-order terms would silently come out as zeros: refuse instead.
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": double backward (create_graph=True) is not supported: the gradient is computed in the forward "
              "and carries no graph, so its own derivatives would be silently zero; use the pure-PyTorch "
              "reference (rl_losses.reference) for higher-order derivatives");
  static const auto scale =
      find_op("rl_losses::_scale_grad_")
          .typed<void(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  std::vector<at::Tensor> grads = ctx->get_saved_variables();
  if (!grad_output.defined()) return std::vector<at::Tensor>(grads.size());  // no gradient reached the loss
  std::optional<at::Tensor> row_unscale;
  if (ctx->saved_data.count("row_unscale")) row_unscale = ctx->saved_data["row_unscale"].toTensor();
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) scale.call(grads[i], grad_output, i == 0 ? row_unscale : std::nullopt);
  }
  return grads;
}

// inplace_backward overwrites the logits in the forward. PyTorch refuses in-place writes to a leaf that
// requires grad (or to a view of one): its .grad would be computed from values that no longer exist, and any
// later reader would see the gradient. The same is refused here, before anything is written.
inline void check_inplace_target(const at::Tensor& logits, const char* op) {
  const bool leaf = logits.is_leaf() || (logits.is_view() && logits._base().is_leaf());
  TORCH_CHECK(!(logits.requires_grad() && leaf), op, ": inplace_backward=True overwrites the logits with their ",
              "gradient during the forward, but the logits are ", logits.is_leaf() ? "a leaf" : "a view of a leaf",
              " tensor that requires grad; pass the output of a computation (e.g. the lm_head's) or use "
              "inplace_backward=False");
}

// inplace_backward mutates the logits below autograd: bump their version so that any other autograd node
// that saved them fails loudly instead of reading the gradient as logits.
inline void mark_overwritten(const at::Tensor& logits) {
  logits.unsafeGetTensorImpl()->bump_version();
}

}  // namespace rl_losses
