// verl's rollout rejection statistic of every token (rollout_rs_statistic, common/policy_math.h) for the pre-pass of
// policy_rejection.cpp, on the tensors' device: the same formula the row pass's token rules take.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include "common/policy_math.h"

namespace rl_losses {

template <typename T>
struct RolloutStatistic {
  int estimator;
  const T* log_probs;
  const T* rollout_log_probs;
  T* out;
  C10_HOST_DEVICE void operator()(int64_t i) const {
    out[i] = rollout_rs_statistic(estimator, log_probs[i], rollout_log_probs[i]);
  }
};

// out = estimator's statistic of each token (all (N,), contiguous, of one floating dtype).
template <typename Runner>
void rollout_statistic_on(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                          const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "rollout_rs", [&] {
    Runner::for_each(out.numel(), RolloutStatistic<scalar_t>{estimator, log_probs.const_data_ptr<scalar_t>(),
                                                             rollout_log_probs.const_data_ptr<scalar_t>(),
                                                             out.data_ptr<scalar_t>()});
  });
}

void rollout_statistic_cpu(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                           const at::Tensor& out);

}  // namespace rl_losses
