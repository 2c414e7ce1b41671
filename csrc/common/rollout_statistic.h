// verl's rollout rejection statistic of every token (rollout_rs_statistic, common/policy_math.h) for the pre-pass of
// policy_rejection.cpp, on the tensors' device: the same formula the row pass's token rules take; and a sequence
// rule's verdict (seq_sum_k*, seq_mean_k*) from it in two element-wise launches and the runner's per-sequence sum (in
// the batch-invariant mode in a fixed order), where ATen took a dozen launches and index_add_'s atomics.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "common/policy_math.h"
#include "common/row_pass.h"

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

// terms[i] = (the statistic of token i, 1) where the token counts for its sequence, else (0, 0): where(), not a
// product, so that a NaN statistic of a token outside the mask (padding) does not reach its sequence's sum.
template <typename T>
struct SequenceStatisticTerms {
  int estimator;
  const T* log_probs;
  const T* rollout_log_probs;
  const bool* counted;
  const int64_t* ids;  // checked on the host for CPU tensors (document_count), here on the device
  int64_t count;
  T* terms;  // (N, 2)
  C10_HOST_DEVICE void operator()(int64_t i) const {
#if defined(__CUDA_ARCH__)
    CUDA_KERNEL_ASSERT(ids[i] < count && "rl_losses: a document index is >= the number of sequences");
#endif
    const bool c = counted[i];
    terms[2 * i] = c ? rollout_rs_statistic(estimator, log_probs[i], rollout_log_probs[i]) : T(0);
    terms[2 * i + 1] = c ? T(1) : T(0);
  }
};

// passes[i]: whether token i's sequence keeps within [lo, hi] its statistic's sum, or verl's masked mean
// Σ / (count + 1e-8); a token outside every sequence passes; a NaN fails (as verl's comparisons do). No lower bound
// is lo = −inf, which every other value passes.
template <typename T>
struct SequenceVerdict {
  const T* sums;  // (S, 2): the statistic's sum and the count of each sequence
  const int64_t* ids;
  const bool* in_sequence;
  bool mean;
  T lo, hi;
  bool* passes;
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const T* s = sums + 2 * ids[i];
    const T stat = !in_sequence[i] ? hi : mean ? s[0] / (s[1] + T(1e-8)) : s[0];
    passes[i] = stat >= lo && stat <= hi;
  }
};

// A sequence rule's verdict per token (bool, (N,)): log_probs and rollout_log_probs (N,) of one floating dtype, ids
// (N,) int64 in [0, count), in_sequence and counted (N,) bool, contiguous.
template <typename Runner>
at::Tensor sequence_rule_on(int estimator, bool mean, double lo, double hi, const at::Tensor& log_probs,
                            const at::Tensor& rollout_log_probs, const at::Tensor& ids, const at::Tensor& in_sequence,
                            const at::Tensor& counted, int64_t count) {
  const int64_t n = log_probs.numel();
  const at::Tensor terms = at::empty({n, 2}, log_probs.options());
  const at::Tensor sums = at::empty({count, 2}, log_probs.options());
  const at::Tensor passes = at::empty({n}, log_probs.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(log_probs.scalar_type(), "rollout_rs", [&] {
    Runner::chain(
        for_each_step(n, SequenceStatisticTerms<scalar_t>{estimator, log_probs.const_data_ptr<scalar_t>(),
                                                          rollout_log_probs.const_data_ptr<scalar_t>(),
                                                          counted.const_data_ptr<bool>(), ids.const_data_ptr<int64_t>(),
                                                          count, terms.data_ptr<scalar_t>()}),
        SumByIndexStep<2, scalar_t>{terms, ids, sums},
        for_each_step(n, SequenceVerdict<scalar_t>{sums.const_data_ptr<scalar_t>(), ids.const_data_ptr<int64_t>(),
                                                   in_sequence.const_data_ptr<bool>(), mean,
                                                   static_cast<scalar_t>(lo), static_cast<scalar_t>(hi),
                                                   passes.data_ptr<bool>()}));
  });
  return passes;
}

void rollout_statistic_cpu(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                           const at::Tensor& out);
at::Tensor sequence_rule_cpu(int estimator, bool mean, double lo, double hi, const at::Tensor& log_probs,
                             const at::Tensor& rollout_log_probs, const at::Tensor& ids, const at::Tensor& in_sequence,
                             const at::Tensor& counted, int64_t count);

}  // namespace rl_losses
