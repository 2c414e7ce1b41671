#include "linear/linear_source.h"

#include "common/sampler.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <utility>

#include "common/batch_invariant.h"

namespace rl_losses {

namespace {

// The CPU GEMM: in the accumulation dtype, rounded once into `out` (a bf16 CPU GEMM need not keep its partial
// sums in fp32), so that the CPU measures the rounding the CUDA GEMMs make.
void gemm_cpu(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  const auto acc = acc_dtype(a.scalar_type());
  if (out.scalar_type() == acc && a.scalar_type() == acc) {
    at::Tensor o = out;
    at::addmm_out(o, o, a, b, /*beta=*/accumulate ? 1 : 0);
    return;
  }
  at::Tensor r = at::mm(a.to(acc), b.to(acc));
  if (accumulate) r.add_(out);
  out.copy_(r);
}

bool never_capturing(const at::Tensor&) { return false; }

// t.narrow(0, start, length), or t itself where that is all of it: at small shapes every ATen call costs a GPU's
// host a few us, and a call of one chunk made a dozen narrows of whole tensors.
at::Tensor part(const at::Tensor& t, int64_t start, int64_t length) {
  return start == 0 && length == t.size(0) ? t : t.narrow(0, start, length);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The size of each of the fewest parts of at most `max_size` that cover n, as equal as a multiple of
// `multiple` allows (the last part is the smaller one). cuBLAS picked split-K kernels for chunks of rows that
// are not multiples of 1024 (docs/design.md); a part below `multiple` is any size.
int64_t part_size(int64_t n, int64_t max_size, int64_t multiple) {
  max_size = std::max<int64_t>(max_size, 1);
  if (n <= max_size) return std::max<int64_t>(n, 1);
  if (max_size >= multiple) {
    max_size -= max_size % multiple;
  } else {
    multiple = 1;
  }
  return std::min(max_size, ceil_div(ceil_div(n, ceil_div(n, max_size)), multiple) * multiple);
}

// f(p0, pn, rows) over the pieces [p0, p0 + pn) of n rows that a GEMM over rows (GEMM 1, GEMM 2) takes at once:
// at most kGemmPieceRows; in the batch-invariant mode (`fixed`) kInvariantGemmRows, the GEMM then taking
// `rows` = kInvariantGemmRows rows, the last piece's padded.
template <typename F>
void for_gemm_pieces(int64_t n, bool fixed, const F& f) {
  const int64_t piece = fixed ? kInvariantGemmRows : part_size(n, kGemmPieceRows, 1024);
  for (int64_t p0 = 0; p0 < n; p0 += piece) {
    const int64_t pn = std::min(piece, n - p0);
    f(p0, pn, fixed ? piece : pn);
  }
}

// The gradient `g` (fp32, contiguous (rows, V), starting its buffer) rounded to `dtype` over the first half of its
// own bytes, returned as that (rows, V) view: GEMM 2's and GEMM 3's operands share one dtype, and the chunk needs no
// second buffer. In pieces of 1/16 of the rows, in order: piece k >= 1 lands below where it is read (bytes
// [2kq, 2(k+1)q) against [4kq, 4(k+1)q), per q·V elements), over pieces already rounded; piece 0 overlaps itself
// and goes through a copy, taken before piece 1 overwrites it.
at::Tensor round_in_place(const at::Tensor& g, at::ScalarType dtype) {
  const int64_t rows = g.size(0), piece = ceil_div(rows, 16);
  const at::Tensor out = g.view(-1).view(dtype).narrow(0, 0, g.numel()).view(g.sizes());
  if (rows == 0) return out;
  const at::Tensor first = part(g, 0, piece).to(dtype);
  for (int64_t r0 = piece; r0 < rows; r0 += piece) {
    const int64_t n = std::min(piece, rows - r0);
    part(out, r0, n).copy_(part(g, r0, n));
  }
  part(out, 0, piece).copy_(first);
  return out;
}

bool aligned_16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// The rows [p0, p0 + pn) of h as a GEMM operand of `rows` rows: h's own, or (`fixed`: where they are fewer or do
// not start on a 16-byte boundary, which cuBLAS also picks its kernel by) a copy padded with zero rows.
at::Tensor gemm_rows(const at::Tensor& h, int64_t p0, int64_t pn, int64_t rows, bool fixed) {
  const at::Tensor own = part(h, p0, pn);
  if (!fixed || (pn == rows && aligned_16(own))) return own;
  at::Tensor out = at::zeros({rows, h.size(1)}, h.options());
  part(out, 0, pn).copy_(own);
  return out;
}

// Rows of a sweep's logits buffer: n, rounded up to whole GEMM pieces in the batch-invariant mode.
int64_t buffer_rows(int64_t n, bool fixed) {
  return fixed ? ceil_div(n, kInvariantGemmRows) * kInvariantGemmRows : n;
}

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

void check_linear_options(const char* op, const LinearOptions& o, const at::Tensor& weight) {
  TORCH_CHECK(!o.chunk_size || *o.chunk_size >= 1, op, ": chunk_size must be >= 1, got ", o.chunk_size.value_or(0));
  TORCH_CHECK(o.strategy == "fast" || o.strategy == "lean", op, ": strategy must be 'fast' or 'lean', got '",
              o.strategy, "'");
  TORCH_CHECK(o.head_dtype == "weight" || o.head_dtype == "float32", op,
              ": head_dtype must be 'weight' or 'float32', got '", o.head_dtype, "'");
  if (!o.weight_main_grad) return;
  const at::Tensor& g = *o.weight_main_grad;
  const auto acc = acc_dtype(weight.scalar_type());
  TORCH_CHECK(g.scalar_type() == acc, op, ": weight_main_grad must be ", acc, " (the accumulation dtype of a ",
              weight.scalar_type(), " weight), got ", g.scalar_type());
  TORCH_CHECK(g.sizes() == weight.sizes(), op, ": weight_main_grad must have the weight's shape ", weight.sizes(),
              ", got ", g.sizes());
  TORCH_CHECK(g.device() == weight.device(), op, ": weight_main_grad is on ", g.device(), " but weight is on ",
              weight.device());
  TORCH_CHECK(g.is_contiguous(), op, ": weight_main_grad must be contiguous, got strides ", g.strides());
}

// Whether the labelled rows are counted (and the others left out): skip_unlabelled True or False as given; None
// where it pays: on the CPU (no synchronisation there), on a GPU where the GEMMs are large enough for the count's
// synchronisation to be small against them (kCountLabelledMinMacs), and never under a graph capture, which no host
// synchronisation may enter (every row then runs). True under a capture is refused.
bool counts_labelled(const char* op, const std::optional<bool>& skip, const at::Tensor& hidden, int64_t n,
                     int64_t vocab, const LinearBackend& backend) {
  if (n == 0 || !skip.value_or(true)) return false;
  if (skip) {
    TORCH_CHECK(!backend.capturing(hidden), op, ": skip_unlabelled=True counts the labelled rows on the host, which "
                "a CUDA graph capture does not allow; pass skip_unlabelled=False or None");
    return true;
  }
  return hidden.is_cpu() || (n * vocab * hidden.size(-1) >= kCountLabelledMinMacs && !backend.capturing(hidden));
}

}  // namespace

const LinearBackend& linear_backend_cpu() {
  static constexpr LinearBackend backend{&gemm_cpu, &never_capturing};
  return backend;
}

LinearSource::LinearSource(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& target,
                           const LinearOptions& options, std::array<bool, 3> output_mask,
                           const LinearBackend& backend)
    : RowSource(op, flatten_linear(op, hidden, weight, bias, target),
                output_mask[0] || output_mask[1] || (output_mask[2] && bias)),
      weight_(weight),
      hidden_shape_(hidden.sizes().vec()),
      mask_{output_mask[0], output_mask[1], output_mask[2] && bias.has_value()},
      backend_(backend),
      invariant_(batch_invariant()) {
  check_linear_options(op, options, weight);
  lean_ = options.strategy == "lean";
  const bool half = weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf;
  logits_dtype_ = half && options.head_dtype == "float32" ? at::kFloat : weight.scalar_type();
  if (options.weight_main_grad) main_grad_ = *options.weight_main_grad;
  if (bias) bias_ = *bias;
  const int64_t n = f_.n_rows, vocab = f_.vocab, hidden_size = hidden.size(-1), e = hidden.element_size();
  // A logit's bytes in the budgets, in sixteenths: fp32 logits whose gradient is rounded also hold a sixteenth of
  // their rows in the weight's dtype meanwhile (round_in_place).
  const bool rounds = wants_grad_ && logits_dtype_ != weight.scalar_type();
  const int64_t el16 = 16 * c10::elementSize(logits_dtype_) + (rounds ? e : 0);
  hidden_ = hidden.reshape({n, hidden_size}).contiguous();
  hidden_all_ = hidden_;
  target_ = f_.target1d;
  m_ = n;
  unlabelled_outputs_zero_ = options.skip_unlabelled.value_or(true);
  if (counts_labelled(op, options.skip_unlabelled, hidden, n, vocab, backend)) {
    at::Tensor labelled = at::nonzero(target_ >= 0).view({-1});  // the one host synchronisation on a GPU
    if (labelled.size(0) < n) {
      rows_ = std::move(labelled);
      m_ = rows_.size(0);
      hidden_ = hidden_.index_select(0, rows_);
      target_ = target_.index_select(0, rows_);
      skips_unlabelled_ = true;
    }
  }

  // The chunks and blocks (docs/performance.md, the fused lm_head's modes).
  if (options.chunk_size) {
    chunk_rows_ = std::min(*options.chunk_size, std::max<int64_t>(m_, 1));
    // lean: blocks of as many logits as a chunk
    if (lean_ && chunk_rows_ < m_) block_cols_ = std::clamp<int64_t>(chunk_rows_ * vocab / m_, 1, vocab);
  } else if (!lean_) {
    const int64_t max_rows = kFastLogitsBytes * 16 / (vocab * el16);
    chunk_rows_ = part_size(m_, max_rows, max_rows >= 1024 ? 1024 : 128);
  } else {
    // What the budget leaves the logits after the statistics table and the gathered rows of hidden; a chunk of
    // rows also holds its grad_hidden rows before they are scattered.
    const int64_t gathered = rows_.defined() ? m_ * hidden_size * e : 0;
    const int64_t logits_bytes = std::max(kLeanBytes - m_ * RowStats<float>::kFields * 8 - gathered, kLeanBytes / 8);
    const int64_t row16 = vocab * el16 + (rows_.defined() ? 16 * hidden_size * e : 0);
    chunk_rows_ = part_size(m_, logits_bytes * 16 / row16, 128);
    if (chunk_rows_ < m_) block_cols_ = part_size(vocab, logits_bytes * 16 / (m_ * el16), 128);
  }

  const auto acc = hidden.options().dtype(acc_dtype(hidden.scalar_type()));
  if (mask_[0]) {
    grad_hidden_ = rows_.defined() ? at::zeros({n, hidden_size}, hidden.options())
                                   : new_empty({n, hidden_size}, hidden.options());
  }
  // Each element of grad_weight is written once (in the weight's dtype, its sum in fp32 inside one GEMM) where
  // one chunk holds every row or lean mode's blocks write it; across fast mode's chunks it is a fp32 sum.
  if (mask_[1] && !main_grad_.defined()) {
    grad_weight_ = new_empty(weight.sizes(), lean_ || chunk_rows_ >= m_ ? weight.options() : acc);
  }
  if (mask_[2]) grad_bias_acc_ = at::zeros({vocab}, acc);
}

at::Tensor LinearSource::as_weight_dtype(const at::Tensor& grad) const {
  return grad.scalar_type() == weight_.scalar_type() ? grad : round_in_place(grad, weight_.scalar_type());
}

at::Tensor LinearSource::rows_of(const at::Tensor& t, int64_t r0, int64_t n) const {
  return rows_.defined() ? t.index_select(0, part(rows_, r0, n)) : part(t, r0, n);
}

void LinearSource::logits_of(const at::Tensor& out, const at::Tensor& h, int64_t v0, bool fixed) const {
  const int64_t nv = out.size(1);
  const at::Tensor w = part(weight_, v0, nv).t();
  for_gemm_pieces(h.size(0), fixed, [&](int64_t p0, int64_t pn, int64_t rows) {
    at::Tensor o = part(out, p0, rows);
    const at::Tensor hp = gemm_rows(h, p0, pn, rows, fixed);
    if (out.scalar_type() != weight_.scalar_type()) {  // fp32 logits of 16-bit operands: the sums kept, bias added
      if (bias_.defined()) o.copy_(part(bias_, v0, nv));
      backend_.gemm(o, hp, w, bias_.defined());
    } else if (bias_.defined()) {
      at::addmm_out(o, part(bias_, v0, nv), hp, w);
    } else {
      at::mm_out(o, hp, w);
    }
  });
}

void LinearSource::run(const RowPassArgs& args, bool with_grad, const Pass& pass, const RowRevisit* revisit) {
  TORCH_CHECK(!(lean_ && args.sampler_params.defined()), op_, ": top_k, top_p and min_p need each row's whole ",
              "vocabulary at once, which strategy='lean' does not hold; use strategy='fast'");
  if (m_ == 0) return;
  const int64_t vocab = f_.vocab;
  const bool weight_grad = with_grad && (mask_[1] || mask_[2]);
  const bool two_sweeps = weight_grad && block_cols_ > 0;
  const int64_t rows = buffer_rows(std::min(chunk_rows_, m_), invariant_);
  // A revisit's one more row: where the rows the passes skip land (revisit_chunk).
  const int64_t extra = revisit != nullptr ? vocab : 0;
  at::Tensor buffer = new_empty({std::max(rows * vocab + extra, two_sweeps ? m_ * block_cols_ : 0)},
                                hidden_.options().dtype(logits_dtype_));
  if (!two_sweeps) {
    row_sweep(args, with_grad, weight_grad, at::Tensor(), buffer, pass, revisit);
    return;
  }
  // Lean mode. Sweep 1: grad_hidden, and each row's statistics unless the op gave them.
  const bool given = args.stats_in.defined();
  const at::Tensor stats = given ? rows_of(args.stats_in, 0, m_) : new_empty({m_, RowStats<float>::kFields},
                                                                              acc_options());
  if (mask_[0] || !given) row_sweep(args, mask_[0], false, given ? at::Tensor() : stats, buffer, pass, nullptr);
  // Every row's statistics exist before the weight's gradient: the revisit's change reaches sweep 2's passes, and
  // only grad_hidden's rows need replacing.
  if (revisit != nullptr) revisit_rows(args, *revisit, mask_[0], false);
  // Sweep 2: the weight's and the bias's gradients, a block of vocabulary at a time over all the rows.
  RowPassArgs a = args;
  a.stats_in = stats;
  a.entropy = a.smoothing = false;
  a.target = target_;
  a.row_offset = 0;
  a.row_index = rows_;
  vocab_sweep(a, buffer, pass);
}

void LinearSource::row_sweep(const RowPassArgs& args, bool with_grad, bool weight_grad, const at::Tensor& stats,
                             const at::Tensor& buffer, const Pass& pass, const RowRevisit* revisit) {
  const int64_t vocab = f_.vocab, hidden_size = hidden_.size(1);
  for (int64_t r0 = 0; r0 < m_; r0 += chunk_rows_) {
    const int64_t n = std::min(chunk_rows_, m_ - r0);
    const at::Tensor h = part(hidden_, r0, n);
    // Where the GEMMs take padded pieces (batch-invariant), `padded` holds their rows beyond the chunk's n.
    const int64_t n_padded = buffer_rows(n, invariant_);
    const at::Tensor padded = part(buffer, 0, n_padded * vocab).view({n_padded, vocab});
    const at::Tensor logits = part(padded, 0, n);
    logits_of(padded, h, 0, invariant_);
    RowPassArgs a = args;
    a.logits = logits;
    a.target = part(target_, r0, n);
    if (rows_.defined()) {
      a.row_index = part(rows_, r0, n);
    } else {
      a.row_offset = r0;
    }
    if (args.stats_in.defined()) a.stats_in = rows_of(args.stats_in, r0, n);
    if (args.sampler_params.defined()) a.logit_floor = sampler_floor(op_, a, args.sampler_params);
    if (stats.defined()) a.stats_out = part(stats, r0, n);
    if (with_grad) a.grad = logits;  // the chunk's gradient overwrites its logits
    pass(a);
    // Where the CUDA back-end ran the statistics as a pass of their own (split_stats_pass_on_cuda), those are
    // the statistics the epilogue saw.
    if (stats.defined() && a.stats_in.defined()) part(stats, r0, n).copy_(a.stats_in);
    if (revisit != nullptr && n == m_) revisit_chunk(args, *revisit, with_grad, buffer, n_padded);
    if (!with_grad) continue;
    if (weight_grad && mask_[2]) grad_bias_acc_.add_(logits.sum({0}, false, grad_bias_acc_.scalar_type()));
    if (!mask_[0] && !(weight_grad && mask_[1])) continue;
    const at::Tensor g_padded = as_weight_dtype(padded), g = part(g_padded, 0, n);
    if (mask_[0]) {
      at::Tensor out = rows_.defined() ? new_empty({n, hidden_size}, hidden_.options()) : part(grad_hidden_, r0, n);
      hidden_grad_of(out, g_padded, n);
      if (rows_.defined()) grad_hidden_.index_copy_(0, part(rows_, r0, n), out);
    }
    if (weight_grad && mask_[1]) {
      const bool into_main_grad = main_grad_.defined();
      backend_.gemm(into_main_grad ? main_grad_ : grad_weight_, g.t(), h, into_main_grad || weight_grad_written_);
      weight_grad_written_ = true;
    }
  }
  if (revisit != nullptr && chunk_rows_ < m_) revisit_rows(args, *revisit, with_grad, weight_grad);
}

void LinearSource::hidden_grad_of(const at::Tensor& out, const at::Tensor& g_padded, int64_t n) const {
  const at::Tensor g = part(g_padded, 0, n);
  for_gemm_pieces(n, invariant_, [&](int64_t p0, int64_t pn, int64_t rows) {
    const at::Tensor own = part(out, p0, pn);
    if (rows == pn && (!invariant_ || aligned_16(own))) return backend_.gemm(own, part(g, p0, pn), weight_, false);
    const at::Tensor o = new_empty({rows, out.size(1)}, out.options());
    backend_.gemm(o, part(g_padded, p0, rows), weight_, false);
    own.copy_(part(o, 0, pn));
  });
}

void LinearSource::vocab_sweep(const RowPassArgs& args, const at::Tensor& buffer, const Pass& pass) {
  const int64_t vocab = f_.vocab;
  for (int64_t v0 = 0; v0 < vocab; v0 += block_cols_) {
    const int64_t nv = std::min(block_cols_, vocab - v0);
    const at::Tensor logits = part(buffer, 0, m_ * nv).view({m_, nv});
    logits_of(logits, hidden_, v0, false);  // these logits feed grad_weight alone, a sum over rows
    RowPassArgs a = args;
    a.logits = logits;
    a.grad = logits;
    a.vocab_start = args.vocab_start + v0;
    pass(a);
    if (mask_[2]) part(grad_bias_acc_, v0, nv).add_(logits.sum({0}, false, grad_bias_acc_.scalar_type()));
    if (mask_[1]) {
      const bool into_main_grad = main_grad_.defined();
      backend_.gemm(part(into_main_grad ? main_grad_ : grad_weight_, v0, nv), as_weight_dtype(logits).t(),
                    hidden_, into_main_grad);
    }
  }
  weight_grad_written_ = true;
}

RowPassArgs LinearSource::sub_batch(const RowPassArgs& args, const at::Tensor& index, const at::Tensor& h,
                                    at::Tensor& padded) const {
  const int64_t bound = index.size(0);
  // GEMM 1 over the sub-batch's rows, in whole pieces in the batch-invariant mode: its rows' logits then have the
  // bits the sweep's had.
  padded = new_empty({buffer_rows(bound, invariant_), f_.vocab}, hidden_.options().dtype(logits_dtype_));
  logits_of(padded, h, 0, invariant_);
  RowPassArgs a = args;
  a.logits = part(padded, 0, bound);
  a.target = f_.target1d.index_select(0, index);
  a.row_offset = 0;
  a.row_index = index;  // the epilogue reads and writes the per-row arrays at the batch's rows
  a.stats_out = at::Tensor();
  if (args.stats_in.defined()) a.stats_in = args.stats_in.index_select(0, index);
  if (args.sampler_params.defined()) a.logit_floor = sampler_floor(op_, a, args.sampler_params);
  return a;
}

void LinearSource::revisit_chunk(const RowPassArgs& args, const RowRevisit& revisit, bool with_grad,
                                 const at::Tensor& buffer, int64_t n_padded) {
  const auto [index, changed] = revisit.select();
  at::Tensor padded;
  RowPassArgs s = sub_batch(args, index, hidden_all_.index_select(0, index), padded);
  if (with_grad) s.grad = s.logits;
  revisit.pass(s, true);
  if (!with_grad) return;
  const int64_t vocab = f_.vocab;
  // The chunk's row of each revisited row: its own where no row is skipped; else found through rows_, a skipped
  // row (never changed) landing on the scratch row past the chunk's, so that no two changed rows share one.
  at::Tensor local = index;
  if (rows_.defined()) {
    local = at::full({f_.n_rows}, n_padded, index.options());
    local.index_copy_(0, rows_, at::arange(m_, index.options()));
    local = local.index_select(0, index);
  }
  const at::Tensor chunk = part(buffer, 0, (n_padded + 1) * vocab).view({n_padded + 1, vocab});
  chunk.index_copy_(0, local, at::where(changed.unsqueeze(1), s.grad, chunk.index_select(0, local)));
}

void LinearSource::revisit_rows(const RowPassArgs& args, const RowRevisit& revisit, bool with_grad,
                                bool weight_delta) {
  const auto [index, changed] = revisit.select();
  const int64_t bound = index.size(0);
  const at::Tensor h = hidden_all_.index_select(0, index);
  at::Tensor padded, before;
  RowPassArgs s = sub_batch(args, index, h, padded);
  weight_delta = weight_delta && with_grad && (mask_[1] || mask_[2]);
  if (weight_delta) {  // the gradient rows the sweep consumed, as the first pass wrote them
    before = part(padded, 0, bound).clone();
    RowPassArgs b = s;
    b.logits = b.grad = before;
    revisit.pass(b, false);
  }
  if (with_grad) s.grad = s.logits;
  revisit.pass(s, true);  // last: the per-row outputs are the changed pass's
  if (!with_grad) return;
  const at::Tensor keep = changed.unsqueeze(1), after = s.grad;
  const auto wdtype = weight_.scalar_type();
  if (weight_delta && mask_[2]) {  // before any rounding, as the sweep's sums
    const auto acc = grad_bias_acc_.scalar_type();
    grad_bias_acc_.add_(at::where(keep, after.to(acc) - before.to(acc), 0).sum(0));
  }
  if (weight_delta && mask_[1]) {
    // grad_weight (+)= Σ over changed rows of (after − before)ᵀ h, as one GEMM over both sets of rows (the
    // second negated) into the fp32 sum: no partial sum rounded to the weight's dtype.
    TORCH_INTERNAL_ASSERT(main_grad_.defined() || grad_weight_.scalar_type() == acc_dtype(wdtype),
                          "rl_losses: a revisit's weight gradient needs an fp32 sum");
    const at::Tensor d = at::cat({at::where(keep, after, 0), at::where(keep, -before, 0)}).to(wdtype);
    backend_.gemm(main_grad_.defined() ? main_grad_ : grad_weight_, d.t(), at::cat({h, h}), true);
    weight_grad_written_ = true;
  }
  if (mask_[0]) {  // a row's grad_hidden is its own gradient row's: replaced outright
    const at::Tensor out = new_empty({bound, hidden_.size(1)}, hidden_.options());
    hidden_grad_of(out, padded.to(wdtype), bound);
    grad_hidden_.index_copy_(0, index, at::where(keep, out, grad_hidden_.index_select(0, index)));
  }
}

std::vector<at::Tensor> LinearSource::grads() {
  const auto none = new_empty({0}, hidden_.options());
  const bool weight = mask_[1] && !main_grad_.defined();
  if (weight && !weight_grad_written_) grad_weight_.zero_();  // no rows
  // The buffer was written below autograd: its version moves, as an in-place op's would.
  if (mask_[1] && main_grad_.defined()) main_grad_.unsafeGetTensorImpl()->bump_version();
  std::vector<at::Tensor> out{mask_[0] ? grad_hidden_.view(hidden_shape_) : none,
                              weight ? grad_weight_.to(weight_.scalar_type()) : none,
                              mask_[2] ? grad_bias_acc_.to(bias_.scalar_type()) : none};
  grad_weight_.reset();
  grad_bias_acc_.reset();
  return out;
}

}  // namespace rl_losses
