#include "linear/linear_source.h"

#include <algorithm>

namespace rl_losses {

void accumulate_weight_grad_cpu(const at::Tensor& acc, const at::Tensor& grad_chunk, const at::Tensor& hidden_chunk,
                                bool overwrite) {
  const auto t = acc.scalar_type();
  acc.addmm_(grad_chunk.t().to(t), hidden_chunk.to(t), /*beta=*/overwrite ? 0 : 1);
}

int64_t default_chunk_rows(int64_t n_rows, int64_t vocab, int64_t element_size) {
  int64_t rows = std::max<int64_t>(1, kDefaultChunkBytes / std::max<int64_t>(1, vocab * element_size));
  if (rows >= 128) rows -= rows % 128;
  return std::max<int64_t>(1, std::min(rows, n_rows));
}

namespace {

FlatLogits flatten_linear(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor& target) {
  TORCH_CHECK(hidden.defined() && at::isFloatingType(hidden.scalar_type()), op,
              ": hidden must be a floating-point tensor (float32, float64, bfloat16 or float16), got ",
              hidden.defined() ? c10::toString(hidden.scalar_type()) : "undefined");
  TORCH_CHECK(hidden.dim() >= 1, op, ": hidden must have at least 1 dimension (..., hidden_size), got a 0-dim tensor");
  TORCH_CHECK(weight.defined() && weight.dim() == 2, op, ": weight must be a 2-D (vocab_size, hidden_size) tensor, got ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight.size(1) == hidden.size(-1), op, ": weight has hidden size ", weight.size(1),
              " but hidden has ", hidden.size(-1), " (weight shape ", weight.sizes(), ", hidden shape ",
              hidden.sizes(), ")");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight is ", weight.scalar_type(),
              " but hidden is ", hidden.scalar_type());
  TORCH_CHECK(weight.device() == hidden.device(), op, ": weight is on ", weight.device(), " but hidden is on ",
              hidden.device());
  TORCH_CHECK(weight.size(0) >= 1, op, ": weight has an empty vocabulary dimension (shape ", weight.sizes(), ")");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": bias must have shape (",
                weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type() && bias->device() == hidden.device(), op,
                ": bias must be ", hidden.scalar_type(), " on ", hidden.device(), ", got ", bias->scalar_type(),
                " on ", bias->device());
  }
  FlatLogits f;
  f.target1d = check_target(op, target, hidden, "hidden");
  check_label_range(op, f.target1d, weight.size(0));
  f.is_view = false;
  f.n_rows = f.target1d.numel();
  f.vocab = weight.size(0);
  f.vocab_start = 0;
  f.vocab_total = f.vocab;
  f.options = hidden.options();
  return f;
}

}  // namespace

LinearSource::LinearSource(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& target,
                           std::optional<int64_t> chunk_size, std::array<bool, 3> output_mask,
                           WeightGradFn accumulate_weight_grad)
    : RowSource(op, flatten_linear(op, hidden, weight, bias, target),
                output_mask[0] || output_mask[1] || (output_mask[2] && bias)),
      weight_(weight),
      hidden_shape_(hidden.sizes().vec()),
      mask_{output_mask[0], output_mask[1], output_mask[2] && bias.has_value()},
      accumulate_weight_grad_(accumulate_weight_grad) {
  TORCH_CHECK(!chunk_size || *chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size.value_or(0));
  hidden_ = hidden.reshape({f_.n_rows, hidden.size(-1)}).contiguous();
  if (bias) bias_ = *bias;
  chunk_ = chunk_size ? std::min(*chunk_size, std::max<int64_t>(f_.n_rows, 1))
                      : default_chunk_rows(f_.n_rows, f_.vocab, hidden.element_size());
  const auto acc = hidden.options().dtype(acc_dtype(hidden.scalar_type()));
  if (mask_[0]) grad_hidden_ = at::empty_like(hidden_);
  if (mask_[1]) grad_weight_acc_ = at::empty(weight.sizes(), acc);
  if (mask_[2]) grad_bias_acc_ = at::zeros({f_.vocab}, acc);
}

void LinearSource::run(const RowPassArgs& args, bool with_grad, const Pass& pass) {
  const int64_t n = f_.n_rows;
  at::Tensor buffer = at::empty({std::min(chunk_, n), f_.vocab}, hidden_.options());  // one chunk of logits
  for (int64_t r0 = 0; r0 < n; r0 += chunk_) {
    const int64_t rows = std::min(chunk_, n - r0);
    const at::Tensor h = hidden_.narrow(0, r0, rows);
    at::Tensor logits = buffer.narrow(0, 0, rows);
    if (bias_.defined()) {
      at::addmm_out(logits, bias_, h, weight_.t());
    } else {
      at::mm_out(logits, h, weight_.t());
    }
    RowPassArgs a = args;
    a.logits = logits;
    a.target = args.target.narrow(0, r0, rows);
    if (args.stats_in.defined()) a.stats_in = args.stats_in.narrow(0, r0, rows);
    a.row_offset = r0;
    if (with_grad) a.grad = logits;  // the chunk's gradient overwrites its logits
    pass(a);
    if (!with_grad) continue;
    if (mask_[0]) {
      at::Tensor out = grad_hidden_.narrow(0, r0, rows);
      at::mm_out(out, logits, weight_);
    }
    if (mask_[1]) {
      accumulate_weight_grad_(grad_weight_acc_, logits, h, !weight_grad_written_);
      weight_grad_written_ = true;
    }
    if (mask_[2]) grad_bias_acc_.add_(logits.sum({0}, false, grad_bias_acc_.scalar_type()));
  }
}

std::vector<at::Tensor> LinearSource::grads() {
  const auto none = at::empty({0}, hidden_.options());
  if (mask_[1] && !weight_grad_written_) grad_weight_acc_.zero_();  // no rows
  std::vector<at::Tensor> out{mask_[0] ? grad_hidden_.view(hidden_shape_) : none,
                              mask_[1] ? grad_weight_acc_.to(weight_.scalar_type()) : none,
                              mask_[2] ? grad_bias_acc_.to(bias_.scalar_type()) : none};
  grad_weight_acc_.reset();
  grad_bias_acc_.reset();
  return out;
}

}  // namespace rl_losses
