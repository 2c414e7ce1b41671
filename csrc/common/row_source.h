// Where an op's row passes find the logits and where the gradient goes.
//
// Every loss is written once against this interface, for two kinds of input:
//   * LogitsSource: the (..., V) logits the user passed; one pass over all rows, the gradient written into
//     a new (N, V) buffer or into the logits themselves (inplace_backward);
//   * LinearSource (linear/linear_source.h): logits = hidden @ weight.T (+ bias), computed a chunk of rows
//     at a time; each chunk's gradient is written over the chunk and at once turned into grad_hidden,
//     grad_weight and grad_bias by GEMMs, so no more than one chunk of logits ever exists.
// A pass sees the rows of one chunk: args.logits, target, stats_in and grad are the chunk's, while the
// epilogue indexes its per-token arrays globally through args.row_offset or args.row_index (row_pass.h).
// A source may leave the unlabelled rows out of its passes altogether (LinearSource's skip_unlabelled): their
// epilogue never runs, so an op allocates the per-row outputs its epilogue writes with row_outputs(), zeros
// there, and reads no statistics of an unlabelled row. Where a source may leave them out but runs them
// (unlabelled_outputs_zero() without skips_unlabelled()), the epilogues write those zeros themselves, so that a
// call's outputs do not depend on whether the rows were left out.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <functional>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/row_pass.h"

namespace rl_losses {

// A second look at a few rows once a pass has seen every row (grpo's clip_cov / kl_cov on the fused lm_head, whose
// chunks' gradients are consumed before the last chunk's pass): the source calls `select` once every row's per-row
// outputs exist and before any gradient it derives is final; it returns the rows to run again (global, int64
// (bound,), the bound known on the host: nothing waits for the device) and, (bound,) bool, where their pass changes
// (it may also set what later passes read). `pass` runs them as a sub-batch (args.row_index: those rows) with the
// change, or without it (`changed` false: as the first pass ran them, for a source that subtracts what it consumed).
struct RowRevisit {
  std::function<std::pair<at::Tensor, at::Tensor>()> select;
  std::function<void(RowPassArgs&, bool changed)> pass;
};

class RowSource {
 public:
  using Pass = std::function<void(RowPassArgs&)>;
  virtual ~RowSource() = default;

  // The public op's name, for error messages.
  const char* op() const { return op_; }
  const FlatLogits& flat() const { return f_; }
  // The accumulation dtype of the per-row outputs, on the logits' device.
  at::TensorOptions acc_options() const { return f_.options.dtype(acc_dtype(f_.options.dtype().toScalarType())); }
  // Whether the op must compute its gradient (the caller asked for it).
  bool wants_grad() const { return wants_grad_; }
  // Whether the passes leave the unlabelled rows out (see above).
  bool skips_unlabelled() const { return skips_unlabelled_; }
  // Whether an unlabelled row's per-row outputs are zeros, left out or not (LinearSource unless skip_unlabelled is
  // False): an output an epilogue writes on every row (cross_entropy's lse) is then 0 there too.
  bool unlabelled_outputs_zero() const { return unlabelled_outputs_zero_; }
  // Whether one pass sees every row at once and leaves the logits as they were (the logits as given, the gradient
  // not written over them): an op may then run rows again after that pass (grpo's clip_cov / kl_cov fix-up).
  bool rows_revisitable() const { return rows_revisitable_; }
  // Whether the gradient the passes write is scaled row by row by `_scale_grad_` in the backward (the logits ops'
  // autograd: LogitsSource with scaled_later): an op may then change rows' factors after its pass.
  bool grad_scaled_by_rows() const { return grad_scaled_by_rows_; }
  // The backward's factor of each row, (N,) fp32: the pass's 2^-k where it pre-scales fp16 rows, else ones,
  // allocated on the first call (after the passes: the passes treat a defined one as the fp16 pre-scaling's).
  // Needs grad_scaled_by_rows().
  virtual at::Tensor& grad_row_factors();
  // A per-row output of the accumulation dtype that the op's epilogue fills: zeros where the source skips
  // rows, uninitialised otherwise.
  at::Tensor row_outputs(at::IntArrayRef sizes) const {
    return skips_unlabelled_ ? at::zeros(sizes, acc_options()) : new_empty(sizes, acc_options());
  }

  // Whether run() takes a RowRevisit of `bound` rows (at most): LinearSource where the sub-batch's logits fit its
  // chunk budget.
  virtual bool revisits(int64_t bound) const { (void)bound; return false; }
  // Runs `pass` over every row, chunk by chunk. With `with_grad`, each pass writes dL/dlogits of its rows
  // (for an upstream gradient of 1) into args.grad, and the source turns it into the op's gradients. `revisit`
  // (where revisits()): the rows it selects end with its changed pass's outputs and gradients.
  virtual void run(const RowPassArgs& args, bool with_grad, const Pass& pass, const RowRevisit* revisit = nullptr) = 0;
  // The op's gradient outputs (empty placeholders where none was computed), once, after the passes.
  virtual std::vector<at::Tensor> grads() = 0;

 protected:
  RowSource(const char* op, FlatLogits f, bool wants_grad) : op_(op), f_(std::move(f)), wants_grad_(wants_grad) {}
  const char* op_;
  FlatLogits f_;
  bool wants_grad_;
  bool skips_unlabelled_ = false;
  bool unlabelled_outputs_zero_ = false;
  bool rows_revisitable_ = false;
  bool grad_scaled_by_rows_ = false;
};

class LogitsSource final : public RowSource {
 public:
  // Validates and flattens the logits (check_and_flatten). The gradient goes into the logits' own storage
  // (inplace), a new buffer (compute_grad), or nowhere. `scaled_later`: the gradient is computed for an
  // upstream gradient of 1 and scaled by `_scale_grad_` in the backward, so that fp16 rows may be stored
  // pre-scaled (row_pass.h, GradRowPrescaled; grad_row_unscale() returns their factors).
  LogitsSource(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
               int64_t vocab_size, bool compute_grad, bool inplace, bool scaled_later = false);
  void run(const RowPassArgs& args, bool with_grad, const Pass& pass, const RowRevisit* revisit = nullptr) override;
  std::vector<at::Tensor> grads() override { return {grad_}; }
  at::Tensor& grad_row_factors() override;
  // (N,) fp32 2^-k per row for fp16 gradients computed with scaled_later, or the factors grad_row_factors() gave;
  // an empty fp32 tensor otherwise (`_scale_grad_`'s row_unscale).
  const at::Tensor& grad_row_unscale() const { return grad_row_unscale_; }

 private:
  at::Tensor grad2d_;  // (N, V_loc) where the passes write, or undefined
  at::Tensor grad_;    // what the op returns: shaped like the logits, or an empty placeholder
  at::Tensor grad_row_unscale_;
  at::Tensor floor_;  // the sampler's floors, computed by the first pass that needs them
};

}  // namespace rl_losses
