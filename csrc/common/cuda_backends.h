// The CUDA back-ends, defined in the *_cuda.cu files and registered by csrc/cuda_registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "common/row_pass.h"

namespace rl_losses {

struct CrossEntropyRows;
struct GrpoBackend;
struct GspoBackend;
struct DistillBackend;
struct DpoBackend;
struct FusedHeadBackend;
struct TokenLogProbsBackend;
struct PolicyTokenInputs;
struct ScatterRowsInputs;
struct TopkRows;
struct CovSelectArgs;

void labelled_count_cuda(const at::Tensor& target1d, const at::Tensor& out);
void sum_cuda(const at::Tensor& x, const at::Tensor& out);
void cov_select_cuda(const CovSelectArgs& s);
void rollout_statistic_cuda(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                            const at::Tensor& out);
at::Tensor sequence_rule_cuda(int estimator, bool mean, double lo, double hi, const at::Tensor& log_probs,
                              const at::Tensor& rollout_log_probs, const at::Tensor& ids, const at::Tensor& in_sequence,
                              const at::Tensor& counted, int64_t count);
void row_stats_cuda(const RowPassArgs& args, const at::Tensor& out);
void row_stats_blocks_cuda(const RowPassArgs& args, const at::Tensor& out);
void sampler_floor_cuda(const RowPassArgs& args, const at::Tensor& params, const at::Tensor& out);
void scale_grad_cuda_rows(const at::Tensor& grad, const at::Tensor& grad_output, const float* unscale);
void cross_entropy_rows_cuda(const RowPassArgs& args, const CrossEntropyRows& rows);
const GrpoBackend& grpo_backend_cuda();
const GspoBackend& gspo_backend_cuda();
const DistillBackend& distill_backend_cuda();
const DpoBackend& dpo_backend_cuda();
const FusedHeadBackend& fused_head_backend_cuda();
const TokenLogProbsBackend& token_log_probs_backend_cuda();
void policy_token_cuda(const PolicyTokenInputs& in);
void scatter_rows_cuda(const ScatterRowsInputs& in);
void topk_distillation_rows_cuda(const RowPassArgs& args, const TopkRows& rows, bool gather);

}  // namespace rl_losses
