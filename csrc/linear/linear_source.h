// The fused lm_head (linear_cross_entropy / linear_grpo / linear_gspo / linear_token_log_probs): the loss ops'
// row passes run over logits = hidden @ weight.T (+ bias), computed a block at a time, so that the full (N, V)
// logits and their gradient never exist. docs/design.md has the measurements behind the rules below.
//
// Each row pass an op asks for (src.run) becomes, with strategy "fast" (rows outer; chunks of C rows):
//   logits_c = hidden_c @ weight.T + bias                       GEMM 1 (in pieces of at most kGemmPieceRows rows)
//   the op's row pass, writing dL/dlogits_c over logits_c         (the same kernels as the logits ops)
//   grad_hidden[c] = grad_c @ weight                             GEMM 2 (pieces as GEMM 1)
//   grad_weight (+)= grad_c.T @ hidden_c                          GEMM 3, all C rows in one GEMM
//   grad_bias += column sums of grad_c                            (fp32)
// with C from a kFastLogitsBytes budget, a multiple of 1024 rows. When every row fits one chunk, GEMM 3 is one
// GEMM over all rows writing the weight's dtype directly; otherwise it accumulates across chunks into a (V, H)
// fp32 accumulator, converted once at the end.
// With strategy "lean" (no (V, H) accumulator; at most kLeanBytes beyond the gradients), a pass with a gradient is
// two sweeps over the same logits buffer:
//   sweep 1, chunks of rows over the whole vocabulary: GEMM 1, the op's pass (its statistics stored in an
//     (N, 5) table, unless the op gave them), GEMM 2: grad_hidden rows complete (K = V in one GEMM);
//   sweep 2, blocks of vocabulary columns over all rows: GEMM 1 of the block, the op's pass with the table's
//     statistics over that shard (as tensor parallelism runs it: vocab_start, stats_in), GEMM 3: that block of
//     grad_weight complete (K = N in one GEMM), written once in the weight's dtype.
//   4 GEMMs instead of 3; where every row fits one chunk of the budget, sweep 1 alone, as in fast.
// A caller's fp32 buffer (weight_main_grad, Megatron's main_grad) takes GEMM 3 with either strategy, added with
// beta = 1 from the first chunk or block: no weight gradient or accumulator of ours.
// The unlabelled rows (label < 0) take no GEMM work where they are counted (skip_unlabelled True, or None where it
// pays: counts_labelled): the labelled rows are counted once on the host (one synchronisation), gathered, and the
// passes see only them (row_index gives each its global row); their grad_hidden rows are scattered back, the others
// are zeros. Where they are not counted, the passes see every row and the unlabelled ones' outputs are the same.
// Statistics-only passes (GSPO's first pass, linear_token_log_probs' forward) are GEMM 1 and the pass, chunk
// by chunk; GSPO thus costs 4 GEMMs when fast and 5 when lean.
// A pass with a RowRevisit (grpo's clip_cov / kl_cov, docs/policy_losses.md) redoes a few rows once every row's
// epilogue has run: their logits recomputed (GEMM 1 over their hidden rows), the op's pass over them as a
// sub-batch (row_index: their global rows). Where one chunk holds every row, the changed rows' gradient replaces
// the chunk's before GEMM 2 and GEMM 3; after several chunks, grad_hidden's changed rows are recomputed (GEMM 2) and
// grad_weight's fp32 sum (the accumulator or weight_main_grad; never a rounded one) and grad_bias take the change
// of those gradient rows (the sub-batch's pass without the change gives the rows the chunks consumed); in lean
// mode the selection comes between the sweeps (sweep 1's statistics), so only grad_hidden's rows are recomputed.
// Every GEMM sums in fp32 (fp64 for fp64 inputs), with no partial sum rounded to bf16/fp16.
// The logits' dtype (head_dtype): "weight", GEMM 1 rounds them to the weight's dtype, as an unfused head does;
// "float32", a bf16/fp16 weight's GEMM 1 writes its fp32 sums (the bias added in fp32), the passes read them, and
// the gradient they write is rounded once to the weight's dtype, in place (round_in_place), for GEMM 2 and GEMM 3,
// whose operands share a dtype; grad_bias sums it before that rounding. The chunks then hold fewer rows: the
// budgets count the logits' element and the rounding's copy. With a fp32 or fp64 weight both values are the
// weight's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>

#include "common/batch_invariant.h"  // kInvariantGemmRows
#include "common/row_source.h"
#include "op_args.h"  // LinearOptions: the options every linear_* op takes beside its loss's

namespace rl_losses {

// out (m, n) = a (m, k) @ b (k, n), plus out's own values when `accumulate`. a and b are in the inputs' dtype,
// row-major or transposed views; out is row-major with unit column stride, in that dtype or the accumulation
// dtype (fp32; fp64 for fp64 inputs). One implementation per device (linear_source.cpp: ATen, in the
// accumulation dtype; linear_cuda.cpp: cuBLAS, fp32 compute without reduced-precision reductions).
using LinearGemmFn = void (*)(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate);
struct LinearBackend {
  LinearGemmFn gemm;
  // Whether the current stream of `t`'s device is being captured into a CUDA graph (no host synchronisation).
  bool (*capturing)(const at::Tensor& t);
};
const LinearBackend& linear_backend_cpu();
#ifdef RL_LOSSES_WITH_CUDA
const LinearBackend& linear_backend_cuda();
#endif

// The memory rules (docs/performance.md): fast mode's logits budget (chunks of 8192 bf16 rows up to
// V = 163840: one pass of the accumulator per 8192 rows), lean mode's whole budget beyond the gradients, and the
// most rows a GEMM over rows (GEMM 1, GEMM 2) takes at once (cuBLAS picked a slower kernel for 8192-row GEMMs on
// an H100).
constexpr int64_t kFastLogitsBytes = int64_t(5) << 29;  // 2.5 GiB
constexpr int64_t kLeanBytes = int64_t(256) << 20;
constexpr int64_t kGemmPieceRows = 4096;
// skip_unlabelled=None counts the labelled rows on a GPU where each of the three GEMMs over every row takes at least
// this many multiply-adds (N·V·H; the three, about 40 us on an H100 in bf16): below it, the count's launches and
// host synchronisation cost more than the unlabelled rows' GEMM work they save.
constexpr int64_t kCountLabelledMinMacs = int64_t(1) << 32;

class LinearSource final : public RowSource {
 public:
  // hidden (..., H), weight (V, H), bias (V,) or none, target (...) labels. output_mask: which of
  // grad_hidden, grad_weight, grad_bias to compute. skip_unlabelled other than False only where the op's outputs
  // and gradient of an unlabelled row do not depend on its logits (the op's adapter decides); the source then
  // tells the op that those outputs are zeros (unlabelled_outputs_zero), counted or not.
  LinearSource(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias, const at::Tensor& target, const LinearOptions& options,
               std::array<bool, 3> output_mask, const LinearBackend& backend);
  // A RowRevisit (grpo's clip_cov / kl_cov) of at most `bound` rows: cheaper than the statistics pass it saves
  // (the sub-batch runs up to two passes), and two sub-batches of logits within a chunk's budget.
  bool revisits(int64_t bound) const override { return bound * 8 <= m_ && 2 * bound <= chunk_rows_; }
  void run(const RowPassArgs& args, bool with_grad, const Pass& pass, const RowRevisit* revisit = nullptr) override;
  // grad_hidden (hidden's shape), grad_weight (V, H) and grad_bias (V,) in their inputs' dtypes, or empty
  // placeholders (grad_weight: also when it went into weight_main_grad). Frees the accumulators.
  std::vector<at::Tensor> grads() override;

 private:
  // The rows [r0, r0 + n) of the passes (the labelled ones where rows are skipped) of a per-row tensor.
  at::Tensor rows_of(const at::Tensor& t, int64_t r0, int64_t n) const;
  // GEMM 1 into `out` (of logits_dtype_); `fixed`: in pieces of kInvariantGemmRows rows, `out` holding h's rows
  // rounded up to whole pieces.
  void logits_of(const at::Tensor& out, const at::Tensor& h, int64_t v0, bool fixed) const;
  // A pass's gradient (a buffer's first rows) as GEMM 2's and GEMM 3's operand: itself, or rounded in place to the
  // weight's dtype (fp32 logits).
  at::Tensor as_weight_dtype(const at::Tensor& grad) const;
  // GEMM 2 over the first n rows of a gradient (n_padded, V) in the weight's dtype, into out (n, H).
  void hidden_grad_of(const at::Tensor& out, const at::Tensor& g_padded, int64_t n) const;
  void row_sweep(const RowPassArgs& args, bool with_grad, bool weight_grad, const at::Tensor& stats,
                 const at::Tensor& buffer, const Pass& pass, const RowRevisit* revisit);
  // A revisit's sub-batch: its rows' logits (GEMM 1 into `padded`, (rows, V)) as a pass's.
  RowPassArgs sub_batch(const RowPassArgs& args, const at::Tensor& index, const at::Tensor& h,
                        at::Tensor& padded) const;
  // Where a single chunk holds every row: its gradient rows replaced before GEMM 2 and GEMM 3 read them.
  void revisit_chunk(const RowPassArgs& args, const RowRevisit& revisit, bool with_grad, const at::Tensor& buffer,
                     int64_t n_padded);
  // After the sweep over rows: grad_hidden's rows replaced; with `weight_delta`, grad_weight (an fp32 sum) and
  // grad_bias take the changed rows' difference.
  void revisit_rows(const RowPassArgs& args, const RowRevisit& revisit, bool with_grad, bool weight_delta);
  void vocab_sweep(const RowPassArgs& args, const at::Tensor& buffer, const Pass& pass);

  at::Tensor hidden_;  // (M, H) contiguous: the rows the passes see
  at::Tensor hidden_all_;  // (N, H): every row, the skipped ones too (a revisit indexes rows globally)
  at::Tensor target_;  // (M,)
  at::Tensor rows_;    // (M,) their global rows where unlabelled rows are skipped, else undefined (M = N)
  at::Tensor weight_, bias_;
  std::vector<int64_t> hidden_shape_;
  std::array<bool, 3> mask_;
  const LinearBackend& backend_;
  bool invariant_;  // the batch-invariant mode (common/batch_invariant.h), read once per call
  bool lean_;
  at::ScalarType logits_dtype_;  // the weight's, or fp32 (head_dtype="float32" with a 16-bit weight)
  int64_t m_;               // rows the passes see
  int64_t chunk_rows_;      // rows per chunk of a sweep over rows
  int64_t block_cols_ = 0;  // vocabulary columns per block of lean mode's sweep 2 (0: one sweep)
  at::Tensor main_grad_;    // weight_main_grad, or undefined
  // grad_weight: the weight's dtype where each element is written once (one chunk, lean's blocks), else the
  // fp32 accumulator. weight_grad_written_: it holds a sum (it starts uninitialised).
  at::Tensor grad_hidden_, grad_weight_, grad_bias_acc_;
  bool weight_grad_written_ = false;
};

}  // namespace rl_losses
