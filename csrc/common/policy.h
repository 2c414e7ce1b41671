// The options of the policy-loss family shared by GRPO and GSPO (docs/policy_losses.md): the loss type, the
// rollout-engine correction, the KL estimator and the entropy bonus. Host side: the schema's arguments are
// validated here, in one place, and turned into the PolicyOptions the kernels see (common/math.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include "common/math.h"
#include "common/row_pass.h"

namespace rl_losses {

// The schema arguments of the policy family, as given (names as in the schemas of registration.cpp).
struct PolicyArgs {
  std::string loss_type = "ppo_clip";
  double sapo_temperature_pos = 1.0;
  double sapo_temperature_neg = 1.05;
  std::optional<std::string> rollout_correction;
  double rollout_cap = 3.0;
  std::optional<std::vector<double>> rollout_mask_bounds;
  std::string kl_estimator = "k3";
  bool kl_importance_weighted = false;
  double entropy_coefficient = 0.0;
  double vespo_k_pos = 2.0, vespo_lambda_pos = 3.0, vespo_k_neg = 3.0, vespo_lambda_neg = 2.0;
};

// The policy family's schema arguments, in schema order (registration.cpp: RL_LOSSES_POLICY_ARGS), into
// PolicyArgs.
inline PolicyArgs policy_args(c10::string_view loss_type, double tau_pos, double tau_neg,
                              std::optional<c10::string_view> rollout_correction, double rollout_cap,
                              std::optional<c10::ArrayRef<double>> rollout_mask_bounds, c10::string_view kl_estimator,
                              bool kl_importance_weighted, double entropy_coefficient, double vespo_k_pos,
                              double vespo_lambda_pos, double vespo_k_neg, double vespo_lambda_neg) {
  PolicyArgs a;
  a.loss_type = std::string(loss_type);
  a.sapo_temperature_pos = tau_pos;
  a.sapo_temperature_neg = tau_neg;
  if (rollout_correction) a.rollout_correction = std::string(*rollout_correction);
  a.rollout_cap = rollout_cap;
  if (rollout_mask_bounds) a.rollout_mask_bounds = rollout_mask_bounds->vec();
  a.kl_estimator = std::string(kl_estimator);
  a.kl_importance_weighted = kl_importance_weighted;
  a.entropy_coefficient = entropy_coefficient;
  a.vespo_k_pos = vespo_k_pos;
  a.vespo_lambda_pos = vespo_lambda_pos;
  a.vespo_k_neg = vespo_k_neg;
  a.vespo_lambda_neg = vespo_lambda_neg;
  return a;
}

// Whether the rollout correction is taken per token or per sequence (ρ_s: the product of the token ratios
// over the sequence, TRL's definition).
inline bool sequence_level_rollout(const PolicyArgs& a) {
  return a.rollout_correction && a.rollout_correction->rfind("sequence_", 0) == 0;
}

template <typename T>
PolicyOptions<T> policy_options_as(const PolicyOptions<double>& o) {
  return {{T(o.clip.epsilon_low), T(o.clip.epsilon_high), T(o.clip.delta)},
          o.loss_type,
          T(o.sapo_tau_pos),
          T(o.sapo_tau_neg),
          T(o.beta),
          o.kl_estimator,
          o.kl_importance_weighted,
          o.rollout_mode,
          T(o.rollout_cap),
          T(o.rollout_lo),
          T(o.rollout_hi),
          T(o.entropy_coefficient),
          T(o.vespo_k_pos),
          T(o.vespo_lambda_pos),
          T(o.vespo_k_neg),
          T(o.vespo_lambda_neg)};
}

// Validates every option (messages name the argument and its value) and returns the kernels' options.
// `has_delta`: the two-sided clip was given; `has_rollout`: rollout_log_probs was given.
PolicyOptions<double> make_policy_options(const char* op, const PolicyArgs& a, double epsilon_low,
                                          double epsilon_high, std::optional<double> delta, double beta,
                                          bool has_rollout);

// Per-sequence advantages broadcast to the tokens: (B,) for (B, T) labels (any batch shape: advantages shaped
// like the labels' leading dimensions) become (B, T); a tensor shaped like the labels is returned as is.
at::Tensor broadcast_per_sequence(const char* op, const char* name, const at::Tensor& t, const at::Tensor& target);

// The sequences of GRPO's sequence-level options (a sequence-level rollout correction, vespo): from
// document_index (negative = padding; `ids` flattened, int64; the count is num_documents, or else max + 1, read
// on the host: the one synchronisation of a call, which num_documents avoids) or,
// without it, the rows of the labels' leading dimensions ((B, T) labels: sequence = row b, B sequences; `ids`
// undefined and `row_length` = T: the kernels take i / T).
struct SequenceIds {
  at::Tensor ids;
  int64_t row_length = 0;
  int64_t count = 0;
};
SequenceIds sequence_ids(const char* op, const std::optional<at::Tensor>& document_index,
                         std::optional<int64_t> num_documents, const at::Tensor& target, const char* why);

template <size_t... I>
auto tensors_as_tuple(const std::vector<at::Tensor>& v, std::index_sequence<I...>) {
  return std::make_tuple(v[I]...);
}
template <size_t N>
auto tensors_as_tuple(const std::vector<at::Tensor>& v) {
  TORCH_INTERNAL_ASSERT(v.size() == N, "rl_losses: ", v.size(), " outputs where the schema has ", N);
  return tensors_as_tuple(v, std::make_index_sequence<N>{});
}

// The number of outputs of the policy ops (before GSPO's document_ratios and the gradients).
constexpr size_t kPolicyOutputs = kPolicyScalars + 1;

}  // namespace rl_losses
