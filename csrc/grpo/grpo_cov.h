// grpo's clip_cov / kl_cov fix-up (grpo_cov.cpp): the rows that may hold a selected token copied into a sub-batch
// before its pass, and its results copied back over the selected rows after it, each one elementwise launch over
// the sub-batch's logits (its few rows' per-row fields with column 0) where an index_select or an index_copy per
// tensor took one each: these launches follow the loss pass on its critical path.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace rl_losses {

// The per-row inputs of the GRPO epilogue that the sub-batch gathers (grpo_row_inputs; vespo's are not a cov
// loss type's).
constexpr int kGrpoCovInputs = 6;

// Row i of the sub-batch (bound × width elements, width = max(V_loc, 1)) is row index[i] of the batch.
template <typename scalar_t, typename acc_t>
struct GrpoCovGather {
  int64_t width, vocab;
  const int64_t* index;  // (bound,)
  const scalar_t* logits;
  int64_t row_stride;
  scalar_t* sub_logits;  // (bound, V_loc) contiguous
  const int64_t* target;
  int64_t* sub_target;
  const bool* selected;
  bool* sub_selected;
  const acc_t* in[kGrpoCovInputs];  // null where absent
  acc_t* sub_in[kGrpoCovInputs];
  C10_HOST_DEVICE void operator()(int64_t e) const {
    const int64_t i = e / width, j = e - i * width, r = index[i];
    if (j < vocab) sub_logits[i * vocab + j] = logits[r * row_stride + j];
    if (j != 0) return;
    sub_target[i] = target[r];
    sub_selected[i] = selected[r];
    for (int k = 0; k < kGrpoCovInputs; ++k) {
      if (in[k] != nullptr) sub_in[k][i] = in[k][r];
    }
  }
};

// Where the sub-batch's token is selected: its gradient row, per-token outputs, log-prob and fp16 unscale factor
// over the batch's row index[i]; elsewhere the batch's first pass keeps its bits.
template <typename scalar_t, typename acc_t>
struct GrpoCovWriteBack {
  int64_t width;  // V_loc with a gradient, else 1
  int64_t fields;
  const int64_t* index;
  const bool* keep;          // (bound,)
  const scalar_t* sub_grad;  // (bound, V_loc) contiguous, or null
  scalar_t* grad;
  int64_t grad_row_stride;
  const acc_t* sub_out;  // (bound, fields)
  acc_t* out;
  const acc_t* sub_log_probs;
  acc_t* log_probs;
  const float* sub_unscale;  // or null
  float* unscale;
  C10_HOST_DEVICE void operator()(int64_t e) const {
    const int64_t i = e / width;
    if (!keep[i]) return;
    const int64_t j = e - i * width, r = index[i];
    if (sub_grad != nullptr) grad[r * grad_row_stride + j] = sub_grad[e];
    if (j != 0) return;
    for (int k = 0; k < fields; ++k) out[r * fields + k] = sub_out[i * fields + k];
    log_probs[r] = sub_log_probs[i];
    if (sub_unscale != nullptr) unscale[r] = sub_unscale[i];
  }
};

}  // namespace rl_losses
