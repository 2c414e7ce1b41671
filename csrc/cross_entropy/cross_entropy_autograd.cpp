// Autograd and backend-independent kernels of the public `cross_entropy` op.
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/autograd.h"

namespace rl_losses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, double, double, double, double, c10::string_view, std::optional<double>,
    const std::optional<at::Tensor>&, int64_t, int64_t, bool);
using ForwardInplaceFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, double, double, double, double, c10::string_view, std::optional<double>,
    const std::optional<at::Tensor>&, int64_t, int64_t);

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target, double s,
                               double eps, double z, double lw, c10::string_view red, std::optional<double> d,
                               bool inplace, const std::optional<at::Tensor>& stats, int64_t vs, int64_t vn,
                               bool need_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor loss, lse, grad;
    if (need_grad && inplace) {
      static const auto op = find_op("rl_losses::_cross_entropy_forward_inplace").typed<ForwardInplaceFn>();
      std::tie(loss, lse) = op.call(logits, target, s, eps, z, lw, red, d, stats, vs, vn);
      mark_overwritten(logits);
      grad = logits;
    } else {
      static const auto op = find_op("rl_losses::_cross_entropy_forward").typed<ForwardFn>();
      std::tie(loss, lse, grad) = op.call(logits, target, s, eps, z, lw, red, d, stats, vs, vn, need_grad);
    }
    if (need_grad) save_fused_grad(ctx, grad);
    ctx->mark_non_differentiable({lse});
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    at::Tensor grad = take_fused_grad(ctx, grad_outputs[0], "cross_entropy");
    variable_list out(13);
    out[0] = grad;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target,
                                                          double s, double eps, double z, double lw,
                                                          c10::string_view red, std::optional<double> d,
                                                          bool inplace, const std::optional<at::Tensor>& stats,
                                                          int64_t vs, int64_t vn) {
  auto out = CrossEntropyFunction::apply(logits, target, s, eps, z, lw, red, d, inplace, stats, vs, vn,
                                         logits_need_grad(logits));
  return {out[0], out[1]};
}

// Without autograd (inference mode, or below the Autograd key): the forward alone.
std::tuple<at::Tensor, at::Tensor> cross_entropy_no_grad(const at::Tensor& logits, const at::Tensor& target,
                                                         double s, double eps, double z, double lw,
                                                         c10::string_view red, std::optional<double> d, bool,
                                                         const std::optional<at::Tensor>& stats, int64_t vs,
                                                         int64_t vn) {
  static const auto op = find_op("rl_losses::_cross_entropy_forward").typed<ForwardFn>();
  auto [loss, lse, grad] = op.call(logits, target, s, eps, z, lw, red, d, stats, vs, vn, false);
  return {loss, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) {
  m.impl("cross_entropy", &cross_entropy_autograd);
}

TORCH_LIBRARY_IMPL(rl_losses, CompositeExplicitAutograd, m) {
  m.impl("cross_entropy", &cross_entropy_no_grad);
}

}  // namespace rl_losses
