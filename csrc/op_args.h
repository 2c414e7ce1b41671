// Every argument and result of the ops, one X-macro list per group: X(C++ type, name, default in schema syntax).
//
// A list is the one home of its entries: registration.cpp builds the ops' schemas from these lists (the public op
// with the defaults, its `_forward` ops without), and each kernel reads the same list's struct by name
// (common/schema.h). Python reads the defaults and the result names back from the schemas (rl_losses._schema).
// An entry's place in a list is free: nothing reads an argument by position.
#pragma once

#include "common/schema.h"

// ---- shared by every op ---------------------------------------------------------------------------------------
#define RL_LOSSES_LOGITS_INPUT(X) \
  X(at::Tensor, logits, )         \
  X(at::Tensor, target, )
// The fused lm_head in place of the logits: logits = hidden @ weight.T (+ bias), chunk_size rows at a time.
#define RL_LOSSES_LINEAR_INPUT(X) \
  X(at::Tensor, hidden, )         \
  X(at::Tensor, weight, )         \
  X(at::Tensor, target, )
// The fused lm_head's options (linear/linear_source.h, docs/performance.md): chunk_size, the rows of logits alive at
// once (default: from the strategy's budget); strategy, "fast" (rows outer, a fp32 weight-gradient accumulator
// across chunks) or "lean" (no accumulator, at most 256 MiB beyond the gradients, one more GEMM); weight_main_grad,
// a (V, H) fp32 buffer that grad_weight is added into instead of being returned (the losses add it in the forward,
// for an upstream gradient of 1); skip_unlabelled, whether rows with a negative label take no GEMM work (their count
// is read on the host: one synchronisation): True, False, or None, where it pays (linear_source.h: on the CPU; on a
// GPU where N·V·H reaches kCountLabelledMinMacs, outside a graph capture); head_dtype, the logits' dtype (vLLM's
// name): "weight" (rounded to the weight's dtype, as an unfused head) or "float32" (GEMM 1's fp32 sums kept, vLLM's
// and SGLang's fp32 lm_head).
#define RL_LOSSES_LINEAR_OPTIONS(X)          \
  X(OptTensor, bias, None)                   \
  X(OptInt, chunk_size, None)                \
  X(std::string, strategy, "fast")           \
  X(OptTensorOut, weight_main_grad, None)    \
  X(OptBool, skip_unlabelled, None)          \
  X(std::string, head_dtype, "weight")
// Every softmax is over logits_scale_factor · logits.
#define RL_LOSSES_SCALE(X) X(double, logits_scale_factor, 1.0)
// D of a mean: None is the op's own count.
#define RL_LOSSES_DIVISOR(X) X(OptDouble, divisor, None)
#define RL_LOSSES_ENTROPY(X) X(bool, compute_entropy, False)
// GRPO's and GSPO's metrics beside the loss, new_logprobs and log_probs: False leaves every one out (None), unless
// compute_entropy asks for the entropy; each output costs a CUDA host its allocation and object (docs/host_time.md).
#define RL_LOSSES_POLICY_METRICS(X) X(bool, compute_metrics, True)
// The hooks of vocabulary (tensor) parallelism: statistics all-reduced over the group, and this rank's shard.
#define RL_LOSSES_ROW_STATS(X) X(OptTensor, row_stats, None)
#define RL_LOSSES_VOCAB_SHARD(X) \
  X(int64_t, vocab_start, 0)     \
  X(int64_t, vocab_size, -1)
// The public loss ops' switch between a new gradient buffer and the logits' own storage (fused_loss_autograd.cpp).
#define RL_LOSSES_INPLACE(X) X(bool, inplace_backward, False)
// The `_forward` ops' switch: compute the gradient in the same pass or not.
#define RL_LOSSES_COMPUTE_GRAD(X) X(bool, compute_grad, False)
// The `_linear_*_forward` ops' switch: which of grad_hidden, grad_weight, grad_bias to compute.
#define RL_LOSSES_OUTPUT_MASK(X) X(OutputMask, output_mask, )
#define RL_LOSSES_GRAD(X) X(at::Tensor, grad, )
// The last result of the `_forward` ops over the row pass: for fp16 logits, 2^-k per row of a gradient stored times
// 2^k (common/row_pass.h, GradRowPrescaled), which `_scale_grad_` folds into its factor; None otherwise (an output
// costs a CUDA host its object even when empty), an empty tensor from the `_forward_inplace` ops (schema.cpp).
#define RL_LOSSES_GRAD_ROW_UNSCALE(X) X(MaybeTensor, grad_row_unscale, )
// Row statistics: row_stats' (N..., 5), token_log_probs' for its backward, distillation_stats' (N..., 7).
#define RL_LOSSES_STATS_RESULT(X) X(at::Tensor, stats, )
#define RL_LOSSES_LINEAR_GRADS(X) \
  X(at::Tensor, grad_hidden, )    \
  X(at::Tensor, grad_weight, )    \
  X(at::Tensor, grad_bias, )

// The sampler's distribution (common/sampler.h, docs/consistency.md): every softmax renormalised over the tokens that
// min_p, then top_k, then top_p keep (vLLM's order); each None, a 0-dim tensor for every row, or one value per row
// shaped like the target. top_k: integer, 0 = off; top_p in (0, 1], 1 = off; min_p in [0, 1], 0 = off.
#define RL_LOSSES_SAMPLER(X) \
  X(OptTensor, top_k, None)  \
  X(OptTensor, top_p, None)  \
  X(OptTensor, min_p, None)

// ---- row_stats: the statistics pass alone (tensor parallelism's first step) ------------------------------------
// tp_blocks: the rows are tensor parallelism's vocabulary blocks in the batch-invariant mode
// (python/rl_losses/batch_invariance.py), whose bits only `row_stats` itself must repeat: on CUDA in the mode they
// take a kernel of their own (cuda/warp_stats.cuh); elsewhere it changes nothing.
#define RL_LOSSES_ROW_STATS_OPTIONS(X) \
  X(bool, entropy, False)              \
  X(bool, smoothing, False)            \
  X(bool, tp_blocks, False)

// ---- cross-entropy (docs/math.md); label_weight = 0 with z_loss_factor > 0 is the z-loss alone ------------------
#define RL_LOSSES_CE_OPTIONS(X)      \
  X(double, label_smoothing, 0.0)    \
  X(double, z_loss_factor, 0.0)      \
  X(double, label_weight, 1.0)       \
  X(std::string, reduction, "mean")
// An op's keyword options (`<OP>_KEYWORDS`), in schema order: both its schema's (registration.cpp, which adds the
// groups an op reads apart) and what its own argument group reads (the op's header). An option goes in once, here.
#define RL_LOSSES_CROSS_ENTROPY_KEYWORDS(X) RL_LOSSES_SCALE(X) RL_LOSSES_CE_OPTIONS(X) RL_LOSSES_DIVISOR(X)
#define RL_LOSSES_TOKEN_LOG_PROBS_KEYWORDS(X) RL_LOSSES_SCALE(X) RL_LOSSES_ENTROPY(X)
#define RL_LOSSES_CE_RESULTS(X) \
  X(at::Tensor, loss, )         \
  X(at::Tensor, lse, )

// ---- the policy family (docs/policy_losses.md): GRPO, GSPO, policy_token_loss, the fused head's terms ---------------
#define RL_LOSSES_POLICY_INPUTS(X) \
  X(at::Tensor, advantages, )      \
  X(OptTensor, old_log_probs, )
#define RL_LOSSES_POLICY_TENSORS(X)     \
  X(OptTensor, ref_log_probs, None)     \
  X(OptTensor, rollout_log_probs, None)
// The clipped objective: ratio clipped to [1 − ε_l, 1 + ε_h], and ppo_clip's two-sided cap δ.
#define RL_LOSSES_CLIP(X)         \
  X(double, epsilon_low, 0.2)     \
  X(double, epsilon_high, 0.2)    \
  X(OptDouble, delta, None)
#define RL_LOSSES_KL_WEIGHT(X) X(double, beta, 0.0)
// The per-token options: every policy op applies them, policy_token_loss and the fused head's policy terms too.
// dro_beta: loss type dro's penalty (verl's policy_loss.dro_beta, no default); clip_ratio_c: dppo_tv/dppo_kl's cap
// of the ratio (verl's name and ActorConfig default); clip_cov_* and kl_cov_ratio, ppo_kl_coef: clip_cov's and
// kl_cov's token selection and penalty (verl's policy_loss names and defaults).
#define RL_LOSSES_POLICY_OPTIONS(X)              \
  X(std::string, loss_type, "ppo_clip")          \
  X(double, sapo_temperature_pos, 1.0)           \
  X(double, sapo_temperature_neg, 1.05)          \
  X(OptDouble, dro_beta, None)                   \
  X(double, clip_ratio_c, 3.0)                   \
  X(double, clip_cov_ratio, 0.0002)              \
  X(double, clip_cov_lb, 1.0)                    \
  X(double, clip_cov_ub, 5.0)                    \
  X(double, kl_cov_ratio, 0.0002)                \
  X(double, ppo_kl_coef, 0.1)                    \
  X(OptString, rollout_correction, None)         \
  X(double, rollout_cap, 3.0)                    \
  X(OptDoubles, rollout_mask_bounds, None)       \
  X(std::string, kl_estimator, "k3")             \
  X(bool, kl_importance_weighted, False)
// rollout_rs, rollout_rs_threshold: verl's rollout rejection (its algorithm.rollout_correction names and threshold
// specification, e.g. "token_k1" with "0.8_1.25", "token_k3,seq_mean_k2" with "0.02,0.03"): the tokens it rejects
// count as unlabelled (common/policy_rejection.cpp). grpo's, gspo's and the fused head's policy terms'.
// bypass_mode: verl's (algorithm.rollout_correction.bypass_mode): old_log_probs default to rollout_log_probs and
// rollout_rs judges the current log-probs against rollout_log_probs (grpo's and gspo's; the fused head refuses it).
#define RL_LOSSES_ROLLOUT_REJECTION(X)   \
  X(OptString, rollout_rs, None)           \
  X(OptString, rollout_rs_threshold, None) \
  X(bool, bypass_mode, False)
// The options that need the logits or whole sequences: the fused ops' alone (not policy_token_loss's).
#define RL_LOSSES_FUSED_POLICY_OPTIONS(X)   \
  X(double, entropy_coefficient, 0.0)       \
  X(double, vespo_k_pos, 2.0)               \
  X(double, vespo_lambda_pos, 3.0)          \
  X(double, vespo_k_neg, 3.0)               \
  X(double, vespo_lambda_neg, 2.0)          \
  RL_LOSSES_ROLLOUT_REJECTION(X)
// The metrics after the loss are detached: kl (mean KL estimate towards ref_log_probs), rollout_ratio_mean (mean ρ),
// rollout_weight_mean (mean correction weight), rollout_corrected_fraction (tokens truncated or masked); GSPO adds
// document_ratios; vespo_phi_seq_mean (the mean VESPO weight φ over the labelled sequences) is last. The metrics of
// an option are None where it is off (policy_metrics_on): entropy, kl, the rollout correction's, vespo's; every
// metric but new_logprobs (and the entropy asked for) without compute_metrics.
#define RL_LOSSES_POLICY_RESULTS(X)          \
  X(at::Tensor, loss, )                      \
  X(at::Tensor, new_logprobs, )              \
  X(MaybeTensor, clipped_fraction_low, )     \
  X(MaybeTensor, clipped_fraction_high, )    \
  X(MaybeTensor, kl_old, )                   \
  X(MaybeTensor, entropy, )                  \
  X(at::Tensor, log_probs, )                 \
  X(MaybeTensor, ratio_mean, )               \
  X(MaybeTensor, kl, )                       \
  X(MaybeTensor, rollout_ratio_mean, )       \
  X(MaybeTensor, rollout_weight_mean, )      \
  X(MaybeTensor, rollout_corrected_fraction, )
#define RL_LOSSES_GSPO_RESULTS(X) X(at::Tensor, document_ratios, )
#define RL_LOSSES_VESPO_RESULTS(X) X(MaybeTensor, vespo_phi_seq_mean, )

// ---- GRPO ---------------------------------------------------------------------------------------------------------
// document_index: the sequences of a sequence-level rollout_correction, of vespo, of a sequence rejection rule or of
// a sequence aggregation (default: the rows); num_documents: their count (default: max(document_index) + 1, read on
// the host). aggregation: a preset of rl_losses.aggregation computed by the op over the tokens rollout_rs keeps
// (loss_weights then multiply its weights; divisor, when given, replaces its count).
#define RL_LOSSES_GRPO_OPTIONS(X)        \
  X(OptTensor, loss_weights, None)       \
  X(OptTensor, label_counts, None)       \
  X(OptTensor, document_index, None)     \
  X(OptInt, num_documents, None)         \
  X(OptString, aggregation, None)
// grpo's and linear_grpo's (beside the clip, the policy options, the fused ones and the sampler's, read apart).
#define RL_LOSSES_GRPO_KEYWORDS(X)                                                                          \
  RL_LOSSES_GRPO_OPTIONS(X) RL_LOSSES_POLICY_TENSORS(X) RL_LOSSES_KL_WEIGHT(X) RL_LOSSES_SCALE(X)         \
  RL_LOSSES_DIVISOR(X) RL_LOSSES_ENTROPY(X) RL_LOSSES_POLICY_METRICS(X)

// ---- GSPO ---------------------------------------------------------------------------------------------------------
#define RL_LOSSES_GSPO_DOCUMENTS(X) X(at::Tensor, document_index, )
#define RL_LOSSES_GSPO_OPTIONS(X)    \
  X(OptInt, num_documents, None)     \
  X(OptTensor, label_counts, None)
// How a document's tokens share its loss (also the fused head's GSPO term's), and whose advantage the sequence
// ratio takes (GSPO-token).
#define RL_LOSSES_GSPO_WEIGHTING(X) X(std::string, weighting, "document")
#define RL_LOSSES_GSPO_TOKEN_ADVANTAGES(X) X(bool, token_advantages, False)
// gspo's and linear_gspo's (as grpo's).
#define RL_LOSSES_GSPO_KEYWORDS(X)                                                                             \
  RL_LOSSES_GSPO_OPTIONS(X) RL_LOSSES_POLICY_TENSORS(X) RL_LOSSES_KL_WEIGHT(X) RL_LOSSES_GSPO_WEIGHTING(X)   \
  RL_LOSSES_GSPO_TOKEN_ADVANTAGES(X) RL_LOSSES_SCALE(X) RL_LOSSES_DIVISOR(X) RL_LOSSES_ENTROPY(X)            \
  RL_LOSSES_POLICY_METRICS(X)
// The sequence-data-parallel hook: the per-document sums all-reduced over the group (gspo/gspo.h: GspoSum).
#define RL_LOSSES_GSPO_SUMS(X) X(OptTensor, document_sums, None)
// gspo_document_sums: one rank's per-document sums, from its per-token log-probs.
#define RL_LOSSES_DOCUMENT_SUMS_INPUT(X) \
  X(at::Tensor, log_probs, )             \
  X(at::Tensor, target, )                \
  X(at::Tensor, advantages, )            \
  X(OptTensor, old_log_probs, )          \
  X(at::Tensor, document_index, )        \
  X(at::Tensor, label_counts, )          \
  X(int64_t, num_documents, )
#define RL_LOSSES_DOCUMENT_SUMS_RESULTS(X) X(at::Tensor, document_sums, )

// ---- policy_token_loss: the per-token policy loss from per-token log-probs -------------------------------------
// Every tensor is positional, as callers of torch.ops.rl_losses.policy_token_loss pass them.
#define RL_LOSSES_POLICY_TOKEN_INPUT(X) \
  X(at::Tensor, log_probs, )            \
  X(OptTensor, old_log_probs, )         \
  X(at::Tensor, advantages, )
// Where loss_mask is 0 no input is read (padding may hold NaN) and every result is 0.
#define RL_LOSSES_POLICY_TOKEN_MASK(X) X(OptTensor, loss_mask, None)
#define RL_LOSSES_POLICY_TOKEN_RESULTS(X) \
  X(at::Tensor, loss, )                   \
  X(at::Tensor, grad_log_probs, )         \
  X(at::Tensor, ratio, )                  \
  X(at::Tensor, clipped_low, )            \
  X(at::Tensor, clipped_high, )           \
  X(at::Tensor, kl, )                     \
  X(at::Tensor, rollout_weight, )

// ---- the kept-set gradient (kept_set/): dense (..., vocab_size) rows from K values per row at K ids ---------------
#define RL_LOSSES_SCATTER_ROWS_INPUT(X) \
  X(at::Tensor, ids, )                  \
  X(at::Tensor, values, )               \
  X(int64_t, vocab_size, )

// ---- per-token log-probs and entropies (token_log_probs/) -------------------------------------------------------
#define RL_LOSSES_TOKEN_LOG_PROBS_RESULTS(X) \
  X(at::Tensor, log_probs, )                 \
  X(at::Tensor, entropy, )
// The backward ops' inputs: the forward's statistics and the upstream gradients.
#define RL_LOSSES_TOKEN_LOG_PROBS_UPSTREAM(X) \
  X(at::Tensor, stats, )                      \
  X(OptTensor, grad_log_probs, )              \
  X(OptTensor, grad_entropy, )

// ---- distillation against a teacher's logits (distillation/) -----------------------------------------------------
#define RL_LOSSES_DISTILL_INPUT(X) \
  X(at::Tensor, logits, )          \
  X(at::Tensor, teacher_logits, )
// The teacher's softmax is over teacher_logits / temperature, the student's over logits_scale_factor · logits.
#define RL_LOSSES_DISTILL_TEMPERATURE(X) X(double, temperature, 1.0)
#define RL_LOSSES_DISTILL_SOFTMAX(X) RL_LOSSES_DISTILL_TEMPERATURE(X) RL_LOSSES_SCALE(X)
// kind and beta: the divergence and JSD's β, shared with the top-K op (topk_distillation/).
#define RL_LOSSES_DISTILL_KIND(X) X(std::string, kind, "forward_kl")
// JSD's β under a name of the op's: the fused head's `beta` is the policy terms' KL weight.
#define RL_LOSSES_DISTILL_BETA_NAMED(X, NAME) X(double, NAME, 0.5)
#define RL_LOSSES_DISTILL_BETA(X) RL_LOSSES_DISTILL_BETA_NAMED(X, beta)
#define RL_LOSSES_DISTILL_OPTIONS(X) RL_LOSSES_DISTILL_KIND(X) X(OptTensor, loss_mask, None)
// The tensor-parallel hooks: distillation_stats' and (JSD) distillation_jsd_sums' outputs all-reduced.
#define RL_LOSSES_DISTILL_HOOKS(X) \
  X(OptTensor, row_stats, None)    \
  X(OptTensor, jsd_sums, None)
#define RL_LOSSES_DISTILLATION_KEYWORDS(X) \
  RL_LOSSES_DISTILL_OPTIONS(X) RL_LOSSES_DISTILL_BETA(X) RL_LOSSES_DISTILL_SOFTMAX(X) RL_LOSSES_DIVISOR(X)
#define RL_LOSSES_DISTILL_STATS_INPUT(X) X(at::Tensor, row_stats, )
#define RL_LOSSES_DISTILL_RESULTS(X) \
  X(at::Tensor, loss, )              \
  X(at::Tensor, divergence, )
#define RL_LOSSES_DISTILL_JSD_RESULTS(X) X(at::Tensor, jsd_sums, )

// ---- distillation from a sparse teacher (topk_distillation/): the teacher's top-K ids and log-probs per token ----
#define RL_LOSSES_TOPK_INPUT(X)        \
  X(at::Tensor, teacher_ids, )         \
  X(at::Tensor, teacher_log_probs, )
// tail: what the teacher's remaining mass 1 − P becomes: "none" (dropped), "renormalize" (both sides renormalised
// over the K ids) or "tail" (one more bucket); kind ("forward_kl", "reverse_kl" or "jsd") and beta: the divergence
// over those buckets, as distillation's.
#define RL_LOSSES_TOPK_OPTIONS(X) X(std::string, tail, "none") RL_LOSSES_DISTILL_KIND(X) RL_LOSSES_DISTILL_BETA(X)
#define RL_LOSSES_TOPK_DISTILLATION_KEYWORDS(X) RL_LOSSES_TOPK_OPTIONS(X) RL_LOSSES_SCALE(X) RL_LOSSES_DIVISOR(X)
// Its hooks of a vocabulary shard (beside vocab_start/vocab_size): the whole vocabulary's row statistics, and
// student_at_ids, (..., K) s·z at the teacher's ids over the whole vocabulary (each id's value from the shard that
// holds it, the others' 0, summed over the ranks: python/rl_losses/topk_distillation.py); both given or neither.
#define RL_LOSSES_TOPK_HOOKS(X) RL_LOSSES_ROW_STATS(X) X(OptTensor, student_at_ids, None)
// divergence: the per-token divergence of `kind` (0 where unlabelled); student_mass Q and teacher_mass P: the K ids' probabilities.
#define RL_LOSSES_TOPK_RESULTS(X)  \
  X(at::Tensor, loss, )            \
  X(at::Tensor, divergence, )      \
  X(at::Tensor, student_mass, )    \
  X(at::Tensor, teacher_mass, )

// ---- DPO over packed documents (dpo/) ------------------------------------------------------------------------------
#define RL_LOSSES_DPO_INPUT(X)                      \
  X(at::Tensor, document_index, )                   \
  X(at::Tensor, pairs, )                            \
  X(at::Tensor, reference_chosen_log_probs, )       \
  X(at::Tensor, reference_rejected_log_probs, )
#define RL_LOSSES_DPO_BETA(X) X(double, beta, 1.0)
#define RL_LOSSES_DPO_KEYWORDS(X) RL_LOSSES_DPO_BETA(X) RL_LOSSES_SCALE(X) RL_LOSSES_DIVISOR(X)
#define RL_LOSSES_DPO_RESULTS(X)         \
  X(at::Tensor, loss, )                  \
  X(at::Tensor, rewards_chosen, )        \
  X(at::Tensor, rewards_rejected, )      \
  X(at::Tensor, accuracy, )              \
  X(at::Tensor, margin, )                \
  X(at::Tensor, log_probs, )             \
  X(at::Tensor, document_log_probs, )

// ---- the fused head: label CE, z-loss and a GRPO or GSPO term in one pass (fused_head/) ---------------------------
// Its policy terms also take the policy family's shared groups: RL_LOSSES_POLICY_TENSORS (ref_log_probs,
// rollout_log_probs), RL_LOSSES_CLIP, RL_LOSSES_KL_WEIGHT, RL_LOSSES_POLICY_OPTIONS and RL_LOSSES_ROLLOUT_REJECTION
// (registration.cpp).
#define RL_LOSSES_FUSED_HEAD_OPTIONS(X)   \
  X(double, label_weight, 0.0)            \
  X(double, label_smoothing, 0.0)         \
  X(OptDouble, label_divisor, None)       \
  X(double, z_loss_weight, 0.0)           \
  X(OptDouble, z_loss_divisor, None)      \
  X(OptTensor, z_loss_mask, None)         \
  X(double, grpo_weight, 0.0)             \
  X(OptTensor, advantages, None)          \
  X(OptTensor, old_log_probs, None)       \
  X(OptTensor, loss_weights, None)        \
  X(OptDouble, grpo_divisor, None)        \
  X(double, gspo_weight, 0.0)             \
  X(OptTensor, document_index, None)      \
  X(OptInt, num_documents, None)          \
  X(OptTensor, label_counts, None)        \
  X(OptDouble, gspo_divisor, None)
// The distillation term (distillation/'s kind and temperature; its β as distillation_beta, its loss_mask as
// distillation_mask: every row without one, as the distillation op's).
#define RL_LOSSES_FUSED_HEAD_DISTILL(X)                                                                 \
  X(double, distillation_weight, 0.0)                                                                   \
  X(OptTensor, teacher_logits, None)                                                                    \
  RL_LOSSES_DISTILL_KIND(X) RL_LOSSES_DISTILL_BETA_NAMED(X, distillation_beta) RL_LOSSES_DISTILL_TEMPERATURE(X) \
  X(OptTensor, distillation_mask, None)                                                                 \
  X(OptDouble, distillation_divisor, None)
// fused_head's (beside the clip and the policy options, read apart).
#define RL_LOSSES_FUSED_HEAD_KEYWORDS(X)                                                                      \
  RL_LOSSES_FUSED_HEAD_OPTIONS(X) RL_LOSSES_FUSED_HEAD_DISTILL(X) RL_LOSSES_POLICY_TENSORS(X) RL_LOSSES_KL_WEIGHT(X) \
  RL_LOSSES_GSPO_WEIGHTING(X) RL_LOSSES_ROLLOUT_REJECTION(X) RL_LOSSES_SCALE(X)
// A term's loss is None where its weight is 0 (the term is not computed).
#define RL_LOSSES_FUSED_HEAD_RESULTS(X) \
  X(at::Tensor, loss, )                 \
  X(MaybeTensor, label_loss, )          \
  X(MaybeTensor, z_loss, )              \
  X(MaybeTensor, grpo_loss, )           \
  X(at::Tensor, log_probs, )            \
  X(MaybeTensor, gspo_loss, )           \
  X(MaybeTensor, distillation_loss, )

namespace rl_losses {

// The groups more than one op family reads; each op's own struct is in its header.
RL_LOSSES_ARG_GROUP(LogitsInput, RL_LOSSES_LOGITS_INPUT)
RL_LOSSES_ARG_GROUP(LinearInput, RL_LOSSES_LINEAR_INPUT)
RL_LOSSES_ARG_GROUP(LinearOptions, RL_LOSSES_LINEAR_OPTIONS)
RL_LOSSES_ARG_GROUP(RowStatsArg, RL_LOSSES_ROW_STATS)
RL_LOSSES_ARG_GROUP(VocabShard, RL_LOSSES_VOCAB_SHARD)
RL_LOSSES_ARG_GROUP(ComputeGradArg, RL_LOSSES_COMPUTE_GRAD)
RL_LOSSES_ARG_GROUP(OutputMaskArg, RL_LOSSES_OUTPUT_MASK)
RL_LOSSES_ARG_GROUP(SamplerArgs, RL_LOSSES_SAMPLER)
RL_LOSSES_RESULT_GROUP(GradResult, RL_LOSSES_GRAD)
RL_LOSSES_RESULT_GROUP(GradRowUnscaleResult, RL_LOSSES_GRAD_ROW_UNSCALE)
RL_LOSSES_RESULT_GROUP(LinearGradResults, RL_LOSSES_LINEAR_GRADS)
RL_LOSSES_RESULT_GROUP(StatsResult, RL_LOSSES_STATS_RESULT)

RL_LOSSES_ARG_GROUP(GspoSumsArg, RL_LOSSES_GSPO_SUMS)
RL_LOSSES_RESULT_GROUP(DocumentSumsResult, RL_LOSSES_DOCUMENT_SUMS_RESULTS)

RL_LOSSES_ARG_GROUP(ClipArgs, RL_LOSSES_CLIP)
RL_LOSSES_ARG_GROUP(PolicyArgs, RL_LOSSES_POLICY_OPTIONS)
RL_LOSSES_ARG_GROUP(FusedPolicyArgs, RL_LOSSES_FUSED_POLICY_OPTIONS)
#define RL_LOSSES_POLICY_RESULT_FIELDS(X) \
  RL_LOSSES_POLICY_RESULTS(X) RL_LOSSES_GSPO_RESULTS(X) RL_LOSSES_VESPO_RESULTS(X)
// GRPO's and GSPO's results (GRPO, whose schema has no document_ratios, leaves that field undefined).
RL_LOSSES_RESULT_GROUP(PolicyResults, RL_LOSSES_POLICY_RESULT_FIELDS)

}  // namespace rl_losses
