#include "common/checks.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorUtils.h>

#include <algorithm>
#include <cmath>

#include "common/batch_invariant.h"
#include "common/row_stats.h"
#ifdef RL_LOSSES_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>

#include "common/cuda_backends.h"
#endif

namespace rl_losses {

at::Tensor flat_contiguous(const at::Tensor& t, at::ScalarType dtype) {
  // Already so (packed sequences): the tensor itself, without the three ATen calls' host time.
  if (t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous()) return t;
  return t.reshape({-1}).to(dtype).contiguous();
}

at::Tensor check_target(const char* op, const at::Tensor& target, const at::Tensor& input, const char* input_name) {
  TORCH_CHECK(target.defined() && at::isIntegralType(target.scalar_type(), /*includeBool=*/false), op,
              ": target must be an integer tensor of label ids (int32 or int64), got ",
              target.defined() ? c10::toString(target.scalar_type()) : "undefined");
  TORCH_CHECK(target.scalar_type() == at::kInt || target.scalar_type() == at::kLong, op,
              ": target must be int32 or int64, got ", target.scalar_type());
  TORCH_CHECK(target.device() == input.device(), op, ": target is on ", target.device(), " but ", input_name,
              " is on ", input.device());
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK(target.sizes() == batch, op, ": target has shape ", target.sizes(), " but ", input_name,
              " has batch shape ", batch, " (", input_name, " shape ", input.sizes(), ")");
  // int64 labels only in the kernels: converting an int32 target is O(N) and halves the compiled kernels.
  return flat_contiguous(target, at::kLong);
}

FlatLogits check_and_flatten(const char* op, const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start, int64_t vocab_size) {
  TORCH_CHECK(logits.defined() && at::isFloatingType(logits.scalar_type()), op,
              ": logits must be a floating-point tensor (float32, float64, bfloat16 or float16), got ",
              logits.defined() ? c10::toString(logits.scalar_type()) : "undefined");
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have at least 1 dimension (…, vocab), got a 0-dim tensor");
  // A dimension of size 1 or 0 has no second element, so its stride means nothing (PyTorch leaves any value
  // there, e.g. after a transpose or a narrow): only a longer vocabulary needs unit stride.
  TORCH_CHECK(logits.size(-1) <= 1 || logits.stride(-1) == 1, op,
              ": logits must have a unit stride in the vocabulary (last) dimension, got stride ",
              logits.stride(-1));
  at::Tensor target1d = check_target(op, target, logits, "logits");
  const int64_t v = logits.size(-1);
  TORCH_CHECK(v >= 1 || target.numel() == 0, op, ": logits has an empty vocabulary dimension (shape ",
              logits.sizes(), ")");
  TORCH_CHECK(vocab_start >= 0, op, ": vocab_start must be >= 0, got ", vocab_start);
  const int64_t total = vocab_size < 0 ? vocab_start + v : vocab_size;
  TORCH_CHECK(total >= vocab_start + v, op, ": vocab_size ", vocab_size, " is smaller than vocab_start + the ",
              "logits' vocabulary shard (", vocab_start, " + ", v, ")");
  FlatLogits f;
  f.n_rows = target.numel();
  f.vocab = v;
  f.vocab_start = vocab_start;
  f.vocab_total = total;
  f.options = logits.options();
  // A view keeps `inplace_backward` meaningful and avoids an N×V copy; only batch dims that cannot be
  // merged into one uniform row stride force a copy.
  auto view = f.n_rows == 0 ? std::optional<at::Tensor>(logits.reshape({0, v}))
                            : [&]() -> std::optional<at::Tensor> {
    const int64_t shape[2] = {f.n_rows, v};
    auto strides = at::detail::computeStride(logits.sizes(), logits.strides(), at::IntArrayRef(shape));
    if (!strides) return std::nullopt;
    (*strides)[1] = 1;  // the kernels read a unit column stride (only V = 1 can have another, meaningless one)
    return logits.as_strided({f.n_rows, v}, *strides);
  }();
  check_label_range(op, target1d, total);
  f.is_view = view.has_value();
  f.logits2d = view ? *view : logits.reshape({f.n_rows, v}).contiguous();
  f.target1d = target1d;
  return f;
}

void check_label_range(const char* op, const at::Tensor& target1d, int64_t vocab_total) {
  // On the CPU a plain loop (no device to synchronise with); the row pass checks again as it goes, but by
  // then an in-place gradient may have overwritten earlier rows. CUDA keeps its device-side assert.
  if (!target1d.is_cpu()) return;
  const int64_t* t = target1d.const_data_ptr<int64_t>();
  const int64_t n = target1d.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(t[i] < vocab_total, op, ": target: label ", t[i], " at row ", i, " is out of range for vocab_size ",
                vocab_total);
  }
}

at::Tensor check_per_token(const char* op, const char* name, const at::Tensor& t, const at::Tensor& target,
                           at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name, " must be a floating-point tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == target.device(), op, ": ", name, " is on ", t.device(), " but logits is on ",
              target.device());
  TORCH_CHECK(t.sizes() == target.sizes(), op, ": ", name, " has shape ", t.sizes(),
              " but target has shape ", target.sizes());
  return flat_contiguous(t, dtype);
}

at::Tensor check_per_token_int(const char* op, const char* name, const at::Tensor& t, const at::Tensor& target) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(at::isIntegralType(t.scalar_type(), false), op, ": ", name, " must be an integer tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == target.device(), op, ": ", name, " is on ", t.device(), " but logits is on ",
              target.device());
  TORCH_CHECK(t.sizes() == target.sizes(), op, ": ", name, " has shape ", t.sizes(),
              " but target has shape ", target.sizes());
  return flat_contiguous(t, at::kLong);
}

at::Tensor check_loss_mask(const char* op, const at::Tensor& mask, const at::Tensor& like, const char* like_name,
                           c10::IntArrayRef sizes, const char* shape_name, const char* mask_name) {
  TORCH_CHECK(mask.scalar_type() == at::kBool || at::isIntegralType(mask.scalar_type(), false), op, ": ", mask_name,
              " must be a bool or integer tensor, got ", mask.scalar_type());
  TORCH_CHECK(mask.device() == like.device(), op, ": ", mask_name, " is on ", mask.device(), " but ", like_name,
              " is on ", like.device());
  TORCH_CHECK(mask.sizes() == sizes, op, ": ", mask_name, " has shape ", mask.sizes(), " but ", like_name, " has ",
              shape_name, " ", sizes);
  return mask.reshape({-1}).ne(0).contiguous();
}

at::Tensor check_label_counts(const char* op, const at::Tensor& t, const at::Tensor& target, at::ScalarType dtype) {
  TORCH_CHECK(t.device() == target.device() && t.sizes() == target.sizes(), op,
              ": label_counts must have the target's shape ", target.sizes(), " and device ", target.device(),
              ", got ", t.sizes(), " on ", t.device());
  return flat_contiguous(t, dtype);
}

void check_scale(const char* op, double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": logits_scale_factor must be finite and > 0, got ", scale);
}

void check_divisor(const char* op, std::optional<double> divisor) {
  TORCH_CHECK(!divisor || (std::isfinite(*divisor) && *divisor > 0), op, ": divisor must be finite and > 0, got ",
              divisor ? *divisor : 0.0);
}

void check_epsilons(const char* op, double epsilon_low, double epsilon_high) {
  TORCH_CHECK(std::isfinite(epsilon_low) && epsilon_low >= 0 && epsilon_low < 1, op,
              ": epsilon_low must be in [0, 1), got ", epsilon_low);
  TORCH_CHECK(std::isfinite(epsilon_high) && epsilon_high >= 0, op, ": epsilon_high must be finite and >= 0, got ",
              epsilon_high);
}

void check_delta(const char* op, std::optional<double> delta, double epsilon_high) {
  TORCH_CHECK(!delta || std::isfinite(*delta), op, ": delta must be finite (leave it unset for no cap), got ",
              delta ? *delta : 0.0);
  // Any δ > 0 is well defined (common/math.h: clip_coefficient); δ <= 0 would leave no gradient where A > 0.
  TORCH_CHECK(!delta || *delta > 0, op, ": delta must be > 0 (it caps the ratio r = exp(lp - old) > 0; the usual "
              "two-sided clip takes delta > 1 + epsilon_high = ", 1 + epsilon_high, "), got ", delta ? *delta : 0.0);
}

void check_beta(const char* op, double beta, bool has_ref_log_probs) {
  TORCH_CHECK(std::isfinite(beta) && beta >= 0, op, ": beta must be >= 0, got ", beta);
  TORCH_CHECK(beta == 0 || has_ref_log_probs, op, ": beta = ", beta, " > 0 needs ref_log_probs");
}

void check_weighting(const char* op, const std::string& weighting) {
  TORCH_CHECK(weighting == "document" || weighting == "token", op, ": weighting must be 'document' or 'token', got '",
              weighting, "'");
}

void check_num_documents(const char* op, int64_t num_documents) {
  TORCH_CHECK(num_documents >= 0 && num_documents <= kMaxDocuments, op, ": num_documents must be in [0, ",
              kMaxDocuments, "], got ", num_documents);
}

int64_t document_count(const char* op, const at::Tensor& ids, std::optional<int64_t> given) {
  if (!given) {
    const int64_t n = ids.numel() > 0 ? std::max<int64_t>(ids.max().item<int64_t>() + 1, 0) : 0;
    check_num_documents(op, n);
    return n;
  }
  check_num_documents(op, *given);
  if (!ids.is_cuda() && ids.numel() > 0) {
    const int64_t high = ids.max().item<int64_t>();  // CPU: no device to synchronise with
    TORCH_CHECK(high < *given, op, ": document_index holds ", high, " but num_documents is ", *given);
  }
  return *given;
}

void check_row_stats(const char* op, const std::optional<at::Tensor>& row_stats, const FlatLogits& f) {
  if (!row_stats) return;
  const auto& s = *row_stats;
  TORCH_CHECK(s.dim() == 2 && s.size(0) == f.n_rows && s.size(1) == 5, op,
              ": row_stats must have shape (", f.n_rows, ", 5), got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == acc_dtype(f.options.dtype().toScalarType()), op,
              ": row_stats must be float32 (float64 for float64 logits), got ", s.scalar_type());
  TORCH_CHECK(s.device() == f.options.device(), op, ": row_stats is on ", s.device(), " but logits is on ",
              f.options.device());
  TORCH_CHECK(s.is_contiguous(), op, ": row_stats must be contiguous");
}

RowPassArgs make_row_pass_args(const FlatLogits& f, double logits_scale_factor) {
  RowPassArgs args;
  args.target = f.target1d;
  args.scale = logits_scale_factor;
  args.vocab_start = f.vocab_start;
  args.vocab_total = f.vocab_total;
  args.batch_invariant = batch_invariant();
  return args;
}

at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef RL_LOSSES_WITH_CUDA
  if (options.device().is_cuda()) return at::detail::empty_cuda(sizes, options);
#endif
  if (options.device().is_cpu()) return at::detail::empty_cpu(sizes, options);
  return at::empty(sizes, options);
}

std::vector<at::Tensor> new_scratch(const at::TensorOptions& options,
                                    std::initializer_list<std::initializer_list<int64_t>> shapes) {
  const int64_t align = std::max<int64_t>(1, 64 / static_cast<int64_t>(options.dtype().itemsize()));
  std::vector<int64_t> offsets;
  offsets.reserve(shapes.size());
  int64_t total = 0;
  for (const auto& shape : shapes) {
    offsets.push_back(total);
    total += (c10::multiply_integers(shape) + align - 1) / align * align;
  }
  const at::Tensor all = new_empty({total}, options);
  std::vector<at::Tensor> pieces;
  pieces.reserve(shapes.size());
  for (const auto& shape : shapes) {
    // A tensor over the buffer's storage made directly, as a view would be but without the dispatcher.
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(all.storage()), all.key_set(), all.dtype());
    t.unsafeGetTensorImpl()->set_storage_offset(offsets[pieces.size()]);
    t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    pieces.push_back(std::move(t));
  }
  return pieces;
}

at::Tensor labelled_count(const at::Tensor& target1d, at::ScalarType dtype) {
  at::Tensor out = new_empty({}, target1d.options().dtype(dtype));
#ifdef RL_LOSSES_WITH_CUDA
  if (target1d.is_cuda()) {
    labelled_count_cuda(target1d, out);
    return out;
  }
#endif
  labelled_count_cpu(target1d, out);
  return out;
}

std::pair<at::Tensor, at::Tensor> labelled_count_and_constant(const at::Tensor& target1d, at::ScalarType dtype,
                                                              double constant) {
  at::Tensor out = new_empty({}, target1d.options().dtype(dtype));
  at::Tensor c = new_empty({}, out.options());
#ifdef RL_LOSSES_WITH_CUDA
  if (target1d.is_cuda()) {
    labelled_count_and_constant_cuda(target1d, out, c, constant);
    return {out, c};
  }
#endif
  labelled_count_and_constant_cpu(target1d, out, c, constant);
  return {out, c};
}

at::Tensor sum_1d(const at::Tensor& x) {
  TORCH_INTERNAL_ASSERT(x.dim() == 1 && x.is_contiguous() && at::isFloatingType(x.scalar_type()),
                        "rl_losses: sum_1d takes a contiguous 1-D floating tensor");
#ifdef RL_LOSSES_WITH_CUDA
  if (x.is_cuda()) {
    at::Tensor out = new_empty({}, x.options());
    sum_cuda(x, out);
    return out;
  }
#endif
  return x.sum();
}

}  // namespace rl_losses
