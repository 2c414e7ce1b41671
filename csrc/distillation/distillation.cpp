#include "distillation/distillation.h"

#include <ATen/ops/empty.h>
#include <ATen/TensorUtils.h>

#include <cmath>

#include "common/checks.h"
#include "common/row_pass.h"

namespace rl_losses {

namespace {

constexpr const char* kDistill = "distillation";

// (N, V) with a unit column stride: a view where the batch dims merge into one row stride, else a copy.
at::Tensor rows_of(const char* name, const at::Tensor& t, bool* is_view = nullptr, const char* op = kDistill) {
  TORCH_CHECK(t.defined() && at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a floating-point tensor (float32, float64, bfloat16 or float16), got ",
              t.defined() ? c10::toString(t.scalar_type()) : "undefined");
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, " must have at least 1 dimension (…, vocab), got a 0-dim tensor");
  TORCH_CHECK(t.size(-1) >= 1, op, ": ", name, " has an empty vocabulary dimension (shape ", t.sizes(), ")");
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name,
              " must have a unit stride in the vocabulary (last) dimension, got stride ", t.stride(-1));
  const int64_t v = t.size(-1), n = t.numel() / v;
  const int64_t shape[2] = {n, v};
  auto strides = n == 0 ? std::nullopt : at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef(shape));
  if (is_view) *is_view = strides.has_value();
  if (!strides) return t.reshape({n, v}).contiguous();
  return t.as_strided({n, v}, {(*strides)[0], 1});
}

void check_pair(const at::Tensor& logits, const at::Tensor& teacher, const char* op = kDistill) {
  TORCH_CHECK(teacher.defined(), op, ": teacher_logits is undefined");
  TORCH_CHECK(teacher.device() == logits.device(), op, ": teacher_logits is on ", teacher.device(),
              " but logits is on ", logits.device());
  TORCH_CHECK(teacher.sizes() == logits.sizes(), op, ": teacher_logits has shape ", teacher.sizes(),
              " but logits has shape ", logits.sizes(),
              (teacher.dim() == logits.dim() && teacher.dim() > 0 && teacher.size(-1) != logits.size(-1)
                   ? " (the vocabularies differ)"
                   : ""));
}

void check_softmax(double temperature, double scale, const char* op = kDistill) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, op, ": temperature must be finite and > 0, got ",
              temperature);
  check_scale(op, scale);
}

void check_acc_input(const char* name, const at::Tensor& t, int64_t n, int64_t cols, const at::Tensor& logits) {
  const auto acc = acc_dtype(logits.scalar_type());
  TORCH_CHECK(t.numel() == n * cols && t.size(-1) == cols, kDistill, ": ", name, " must hold (", n, ", ", cols,
              ") values, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == acc, kDistill, ": ", name, " must be ", acc, " (the accumulation dtype of ",
              logits.scalar_type(), " logits), got ", t.scalar_type());
  TORCH_CHECK(t.device() == logits.device(), kDistill, ": ", name, " is on ", t.device(), " but logits is on ",
              logits.device());
}

}  // namespace

void check_distill_beta(const char* op, double beta, const char* name) {
  TORCH_CHECK(std::isfinite(beta) && beta >= 0 && beta <= 1, op, ": ", name, " must be in [0, 1], got ", beta);
}

DistillOptions<double> make_distill_options(DistillKind kind, double beta, double temperature, double scale) {
  // log β and log(1−β) only matter for JSD, where 0 < β < 1.
  const bool jsd = kind == DistillKind::kJsd;
  return {.kind = kind,
          .scale = scale,
          .inv_temperature = 1.0 / temperature,
          .beta = beta,
          .log_beta = jsd ? std::log(beta) : 0.0,
          .log_one_minus_beta = jsd ? std::log1p(-beta) : 0.0};
}

DistillKind parse_distill_kind(const char* op, const std::string& kind, double beta) {
  if (kind == "forward_kl") return DistillKind::kForwardKl;
  if (kind == "reverse_kl") return DistillKind::kReverseKl;
  if (kind == "cross_entropy") return DistillKind::kCrossEntropy;
  if (kind == "jsd") {
    // Liger-Kernel's convention: β = 0 is the forward KL, β = 1 the reverse KL (the general formula is 0 there).
    if (beta == 0) return DistillKind::kForwardKl;
    if (beta == 1) return DistillKind::kReverseKl;
    return DistillKind::kJsd;
  }
  TORCH_CHECK(false, op, ": kind must be 'forward_kl', 'reverse_kl', 'cross_entropy' or 'jsd', got '", kind, "'");
}

DistillState distill_term_state(const char* op, const DistillTermArgs& a, bool* is_view) {
  const at::Tensor& logits = a.logits;
  at::Tensor x = rows_of("logits", logits, is_view, op);
  check_pair(logits, a.teacher, op);
  at::Tensor y = rows_of("teacher_logits", a.teacher, nullptr, op);
  check_distill_beta(op, a.beta, a.beta_name);
  check_softmax(a.temperature, a.scale, op);
  check_divisor(op, a.divisor);
  const DistillKind k = parse_distill_kind(op, a.kind, a.beta);
  const int64_t n = x.size(0);
  const auto acc = acc_dtype(logits.scalar_type());
  const auto opts = logits.options().dtype(acc);
  const auto batch = logits.sizes().slice(0, logits.dim() - 1);

  DistillState s;
  s.opt = make_distill_options(k, a.beta, a.temperature, a.scale);
  s.logits = x;
  s.teacher = y;
  if (a.mask) s.mask = check_loss_mask(op, *a.mask, logits, "logits", batch, "batch shape", a.mask_name).to(acc);
  // D: given, or the number of rows the mask keeps (all rows without one), at least 1; no host synchronisation.
  if (a.divisor) {
    s.divisor_value = *a.divisor;
  } else if (s.mask.defined()) {
    s.divisor = sum_1d(s.mask).clamp_min(1);
  } else {
    s.divisor_value = static_cast<double>(std::max<int64_t>(n, 1));
  }
  // The buffers between the passes in one allocation; the divergence, a result, its own.
  const bool jsd = k == DistillKind::kJsd;
  const std::vector<at::Tensor> scratch =
      new_scratch(opts, {{n, DistillStats<double>::kFields}, {jsd ? n : 0, 2}, {n}, {n, kDistGradFields}});
  s.stats = scratch[0];
  if (jsd) s.jsd_sums = scratch[1];
  s.row_loss = scratch[2];
  s.grad_rows = scratch[3];
  s.divergence = new_empty({n}, opts);
  return s;
}

std::pair<DistillResults, at::Tensor> distillation_forward(const DistillationArgs& a, bool compute_grad, bool inplace,
                                                           const DistillBackend& backend) {
  const at::Tensor& logits = a.logits;
  const OptTensor &row_stats = a.row_stats, &jsd_sums = a.jsd_sums;
  bool is_view = false;
  DistillState s = distill_term_state(kDistill, {a.logits, a.teacher_logits, a.kind, a.beta, a.temperature,
                                                 a.logits_scale_factor, a.loss_mask, a.divisor, "beta", "loss_mask"},
                                      &is_view);
  const at::Tensor& x = s.logits;
  const int64_t n = x.size(0);
  const auto batch = logits.sizes().slice(0, logits.dim() - 1);
  if (row_stats) {
    check_acc_input("row_stats", *row_stats, n, DistillStats<double>::kFields, logits);
    s.stats = row_stats->reshape({n, DistillStats<double>::kFields}).contiguous();
    s.stats_given = true;
  }
  if (s.opt.kind == DistillKind::kJsd && jsd_sums) {
    TORCH_CHECK(row_stats.has_value(), kDistill, ": jsd_sums needs row_stats (both come from the tensor-parallel ",
                "all-reduce)");
    check_acc_input("jsd_sums", *jsd_sums, n, 2, logits);
    s.jsd_sums = jsd_sums->reshape({n, 2}).contiguous();
    s.jsd_given = true;
  }
  at::Tensor grad_out;
  if (inplace) {
    TORCH_CHECK(is_view, kDistill, ": inplace_backward needs logits whose batch dimensions flatten to one row ",
                "stride (got shape ", logits.sizes(), ", strides ", logits.strides(), ")");
    s.grad = x;
  } else if (compute_grad) {
    s.grad = at::empty({n, x.size(1)}, logits.options());
    grad_out = s.grad.view(logits.sizes());
  } else {
    grad_out = at::empty({0}, logits.options());
  }
  if (n > 0) backend.rows(s);
  return {DistillResults{sum_1d(s.row_loss), s.divergence.view(batch)}, grad_out};
}

at::Tensor distillation_stats_op(const DistillStatsArgs& a, const DistillBackend& backend) {
  const at::Tensor& logits = a.logits;
  DistillState s;
  s.logits = rows_of("logits", logits);
  check_pair(logits, a.teacher_logits);
  s.teacher = rows_of("teacher_logits", a.teacher_logits);
  check_softmax(a.temperature, a.logits_scale_factor);
  // The statistics read no β (make_distill_options uses it for JSD only).
  s.opt = make_distill_options(DistillKind::kForwardKl, 0.0, a.temperature, a.logits_scale_factor);
  const int64_t n = s.logits.size(0);
  s.stats = at::empty({n, DistillStats<double>::kFields}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  if (n > 0) backend.stats(s);
  auto shape = logits.sizes().vec();
  shape.back() = DistillStats<double>::kFields;
  return s.stats.view(shape);
}

at::Tensor distillation_jsd_sums_op(const DistillJsdArgs& a, const DistillBackend& backend) {
  const at::Tensor &logits = a.logits, &row_stats = a.row_stats;
  DistillState s;
  s.logits = rows_of("logits", logits);
  check_pair(logits, a.teacher_logits);
  s.teacher = rows_of("teacher_logits", a.teacher_logits);
  check_distill_beta(kDistill, a.beta, "beta");
  check_softmax(a.temperature, a.logits_scale_factor);
  TORCH_CHECK(a.beta > 0 && a.beta < 1, kDistill, ": the JSD sums need 0 < beta < 1, got ", a.beta);
  s.opt = make_distill_options(DistillKind::kJsd, a.beta, a.temperature, a.logits_scale_factor);
  const int64_t n = s.logits.size(0);
  check_acc_input("row_stats", row_stats, n, DistillStats<double>::kFields, logits);
  s.stats = row_stats.reshape({n, DistillStats<double>::kFields}).contiguous();
  s.jsd_sums = at::empty({n, 2}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  if (n > 0) backend.jsd_sums(s);
  auto shape = logits.sizes().vec();
  shape.back() = 2;
  return s.jsd_sums.view(shape);
}

}  // namespace rl_losses
