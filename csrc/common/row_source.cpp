#include "common/row_source.h"

namespace rl_losses {

LogitsSource::LogitsSource(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                           int64_t vocab_size, bool compute_grad, bool inplace)
    : RowSource(op, check_and_flatten(op, logits, target, vocab_start, vocab_size), compute_grad || inplace) {
  if (inplace) {
    TORCH_CHECK(f_.is_view, op, ": inplace_backward needs logits whose batch dimensions flatten to one row ",
                "stride (got shape ", logits.sizes(), ", strides ", logits.strides(), ")");
    grad2d_ = f_.logits2d;
    grad_ = logits;
  } else if (compute_grad) {
    grad2d_ = at::empty({f_.n_rows, f_.vocab}, logits.options());
    grad_ = grad2d_.view(logits.sizes());
  } else {
    grad_ = at::empty({0}, logits.options());
  }
}

void LogitsSource::run(const RowPassArgs& args, bool with_grad, const Pass& pass) {
  TORCH_INTERNAL_ASSERT(!with_grad || grad2d_.defined(), "rl_losses: a gradient pass without a gradient buffer");
  RowPassArgs a = args;
  a.logits = f_.logits2d;
  if (with_grad) a.grad = grad2d_;
  pass(a);
}

}  // namespace rl_losses
