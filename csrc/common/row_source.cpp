#include "common/row_source.h"

#include "common/sampler.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>

namespace rl_losses {

namespace {

// Asks Linux for transparent huge pages under a new CPU gradient buffer, before anything touches it
// (madvise(MADV_HUGEPAGE) on its whole 2 MB pages; a hint, honoured where the kernel's THP mode is "madvise"
// or "always"). First-touching a fresh N × V buffer 4 KB at a time cost about as much as the row pass that
// writes it (262 MB: 185 ms of page faults and zeroing against 91 ms with huge pages, 2 cores).
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  if (!t.is_cpu() || t.nbytes() < 4 * kHugePage) return;
  const auto start = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1), end = (start + t.nbytes()) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

}  // namespace

LogitsSource::LogitsSource(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                           int64_t vocab_size, bool compute_grad, bool inplace, bool scaled_later)
    : RowSource(op, check_and_flatten(op, logits, target, vocab_start, vocab_size), compute_grad || inplace) {
  const bool prescaled = scaled_later && (compute_grad || inplace) && logits.scalar_type() == at::kHalf;
  if (prescaled) grad_row_unscale_ = new_empty({f_.n_rows}, logits.options().dtype(at::kFloat));
  rows_revisitable_ = !inplace;
  grad_scaled_by_rows_ = scaled_later && (compute_grad || inplace);
  if (inplace) {
    TORCH_CHECK(f_.is_view, op, ": inplace_backward needs logits whose batch dimensions flatten to one row ",
                "stride (got shape ", logits.sizes(), ", strides ", logits.strides(), ")");
    // Each row's gradient is written over that row's logits while other rows are still being read: rows that
    // share memory (expand, as_strided) would read one another's gradients as logits.
    const int64_t row_stride = f_.logits2d.stride(0);
    TORCH_CHECK(f_.n_rows <= 1 || f_.vocab == 0 || row_stride >= f_.vocab, op,
                ": inplace_backward needs logits whose rows do not overlap in memory, got shape ", logits.sizes(),
                " with strides ", logits.strides(), " (rows ", row_stride, " elements apart, ", f_.vocab,
                " long); pass a tensor that owns its rows, e.g. logits.contiguous()");
    grad2d_ = f_.logits2d;
    grad_ = logits;
  } else if (compute_grad) {
    grad2d_ = at::empty({f_.n_rows, f_.vocab}, logits.options());
    advise_huge_pages(grad2d_);
    grad_ = grad2d_.view(logits.sizes());
  } else {
    grad_ = new_empty({0}, logits.options());
  }
}

at::Tensor& RowSource::grad_row_factors() {
  TORCH_INTERNAL_ASSERT(false, op_, ": this source's gradient is not scaled by rows in the backward");
}

at::Tensor& LogitsSource::grad_row_factors() {
  TORCH_INTERNAL_ASSERT(grad_scaled_by_rows_, op_, ": a gradient without per-row factors in the backward");
  if (!grad_row_unscale_.defined()) {
    grad_row_unscale_ = at::ones({f_.n_rows}, f_.logits2d.options().dtype(at::kFloat));
  }
  return grad_row_unscale_;
}

void LogitsSource::run(const RowPassArgs& args, bool with_grad, const Pass& pass, const RowRevisit* revisit) {
  TORCH_INTERNAL_ASSERT(revisit == nullptr, "rl_losses: the logits source revisits no rows (revisits() is false)");
  TORCH_INTERNAL_ASSERT(!with_grad || grad2d_.defined(), "rl_losses: a gradient pass without a gradient buffer");
  RowPassArgs a = args;
  a.logits = f_.logits2d;
  if (with_grad) {
    a.grad = grad2d_;
    a.grad_row_unscale = grad_row_unscale_;
  }
  // A floor the pass computes itself (min_p alone, CUDA) is not kept: a later pass computes its own.
  if (a.sampler_params.defined() && (floor_.defined() || !sampler_floor_in_pass(op_, a))) {
    if (!floor_.defined()) floor_ = sampler_floor(op_, a, a.sampler_params);
    a.logit_floor = floor_;
  }
  pass(a);
}

}  // namespace rl_losses
