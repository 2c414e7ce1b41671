// Input validation shared by every op: one function per concern, messages that name the argument, the
// expected and the actual value (docs/conventions.md, errors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "common/row_pass.h"

namespace rl_losses {

// The flattened problem every op works on: (N, V_loc) logits with unit column stride and a uniform row
// stride (a view when the batch dims allow one, a copy otherwise), and (N,) contiguous labels.
struct FlatLogits {
  at::Tensor logits2d;  // (N, V_loc); undefined for the fused-linear ops, whose logits exist a chunk at a time
  at::Tensor target1d;  // (N,)
  bool is_view;         // logits2d shares the logits' storage
  int64_t n_rows;
  int64_t vocab;        // V_loc
  int64_t vocab_start;  // global id of column 0
  int64_t vocab_total;  // V of the whole vocabulary
  at::TensorOptions options;  // the logits' dtype and device
};

// `t` flattened to 1-D, contiguous, in `dtype` (a view of t where it can be).
at::Tensor flat_contiguous(const at::Tensor& t, at::ScalarType dtype);

// The labels: integer ids shaped like `input`'s batch dims (all but the last), on its device; returned
// flattened, contiguous, int64.
at::Tensor check_target(const char* op, const at::Tensor& target, const at::Tensor& input, const char* input_name);

FlatLogits check_and_flatten(const char* op, const at::Tensor& logits, const at::Tensor& target,
                             int64_t vocab_start, int64_t vocab_size);

// Labels >= vocab_total are refused before any pass runs (CPU tensors only: elsewhere it would synchronise).
void check_label_range(const char* op, const at::Tensor& target1d, int64_t vocab_total);

// A per-token float tensor (advantages, old log-probs, …): same shape as `target`, floating, same device.
// Returns it flattened, contiguous, in `dtype`.
at::Tensor check_per_token(const char* op, const char* name, const at::Tensor& t, const at::Tensor& target,
                           at::ScalarType dtype);
at::Tensor check_per_token_int(const char* op, const char* name, const at::Tensor& t, const at::Tensor& target);

// A loss mask (bool or integer, nonzero where a position counts) of `sizes` on `like`'s device; `like_name` and
// `shape_name` word the messages ("... but logits has batch shape ..."). Returned flattened, contiguous, bool.
at::Tensor check_loss_mask(const char* op, const at::Tensor& mask, const at::Tensor& like, const char* like_name,
                           c10::IntArrayRef sizes, const char* shape_name, const char* mask_name = "loss_mask");

// label_counts (integer or float): the target's shape and device; returned flattened, contiguous, in `dtype`.
at::Tensor check_label_counts(const char* op, const at::Tensor& t, const at::Tensor& target, at::ScalarType dtype);

void check_scale(const char* op, double scale);
void check_divisor(const char* op, std::optional<double> divisor);
void check_epsilons(const char* op, double epsilon_low, double epsilon_high);
// The two-sided clip δ of ppo_clip (grpo, gspo, policy_token_loss): unset, or finite and > 0 (ε_h: for the
// message).
void check_delta(const char* op, std::optional<double> delta, double epsilon_high);
// The KL weight beta: finite, >= 0, and with ref_log_probs wherever it is > 0.
void check_beta(const char* op, double beta, bool has_ref_log_probs);
// GSPO's weighting of a document's tokens: 'document' or 'token' (gspo, gspo_document_sums, the fused head's term).
void check_weighting(const char* op, const std::string& weighting);
// The per-document buffers hold num_documents rows: a bound far above any real batch turns a mistaken value
// (e.g. 2**40) into this message rather than an allocator failure.
constexpr int64_t kMaxDocuments = int64_t(1) << 31;
void check_num_documents(const char* op, int64_t num_documents);
// The number of documents of `ids` (document_index flattened; negative = padding): `given`, or max(ids) + 1 read
// on the host (a synchronisation on a GPU, which giving the count avoids); within check_num_documents' bound. On
// the CPU the ids are checked against a given count here; CUDA kernels assert it on the device.
int64_t document_count(const char* op, const at::Tensor& ids, std::optional<int64_t> given);
void check_row_stats(const char* op, const std::optional<at::Tensor>& row_stats, const FlatLogits& f);

// A row pass over the flattened problem, before an op sets its optional parts (statistics, flags) and its
// RowSource sets the logits and the gradient.
RowPassArgs make_row_pass_args(const FlatLogits& f, double logits_scale_factor);

// The number of labelled tokens (target >= 0) as a 0-dim `dtype` tensor, at least 1: the default divisor of a
// token mean and the metrics' denominator. One reduction on the target's device, no host synchronisation.
at::Tensor labelled_count(const at::Tensor& target1d, at::ScalarType dtype);

// The sum of a contiguous 1-D floating tensor, 0-dim. On CUDA one single-block launch that can follow the row
// pass without a launch gap (dependent_launch.cuh), where ATen's sum is a launch of its own; elsewhere at::sum.
at::Tensor sum_1d(const at::Tensor& x);

}  // namespace rl_losses
