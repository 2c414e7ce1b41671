// Every schema of the rl_losses namespace, in one place. Back-end kernels are registered in their own files
// (`*_cpu.cpp` for CPU, `*_cuda.cu` for CUDA), the autograd kernels in `*_autograd.cpp`, and the fake
// (meta) kernels in python/rl_losses/_fake.py.
//
// Conventions:
//   * Public ops (`cross_entropy`, `grpo`, `gspo`, `row_stats`) take the tensors positionally and every
//     option by keyword, with the defaults of docs/api.md.
//   * `_<op>_forward` computes the loss, the per-row outputs and — when asked — the gradient in the same
//     pass; `_<op>_forward_inplace` writes the gradient into the logits' own storage (inplace_backward).
//   * `_scale_grad_` is the backward of every loss: it scales the gradient computed in the forward by the
//     upstream gradient, in place, and does nothing (decided on the device) when that is 1. The forwards of the
//     ops over the row pass return `grad_row_unscale` last: for fp16 logits, 2^-k per row of a gradient stored
//     times 2^k (common/row_pass.h, GradRowPrescaled), which `_scale_grad_` folds into its factor; empty
//     otherwise.
//   * The fused-linear ops `linear_<op>` take `hidden (..., H)` and `weight (V, H)` (and a keyword `bias`)
//     in place of the logits, with the options of the logits op (no inplace_backward, no tensor-parallel
//     hooks) plus the fused lm_head's own (RL_LOSSES_LINEAR_KWARGS); `_linear_<op>_forward(<the same
//     arguments>, output_mask)` returns their outputs followed by grad_hidden, grad_weight, grad_bias (linear/).
//   * `row_stats`/`vocab_start`/`vocab_size` are the hooks of vocabulary (tensor) parallelism: a loss op given
//     `row_stats` (all-reduced over the TP group) skips its own statistics pass and writes this shard's
//     gradient.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// An empty Python module: importing rl_losses._C loads this library, whose static initialisers register
// the ops with the dispatcher. No pybind11 is needed for ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(rl_losses, m) {
  // ---- shared ---------------------------------------------------------------------------------------
  m.def(
      "row_stats(Tensor logits, Tensor target, *, float logits_scale_factor=1.0, int vocab_start=0, "
      "int vocab_size=-1, bool entropy=False, bool smoothing=False) -> Tensor");
  m.def("_scale_grad_(Tensor(a!) grad, Tensor grad_output, Tensor? row_unscale=None) -> ()");

  // ---- cross-entropy (docs/math.md); label_weight=0 with z_loss_factor>0 is the z-loss alone -----------
#define RL_LOSSES_CE_ARGS                                                                                     \
  "float logits_scale_factor, float label_smoothing, float z_loss_factor, float label_weight, str reduction, " \
  "float? divisor, Tensor? row_stats, int vocab_start, int vocab_size"
  m.def(
      "cross_entropy(Tensor logits, Tensor target, *, float logits_scale_factor=1.0, float label_smoothing=0.0, "
      "float z_loss_factor=0.0, float label_weight=1.0, str reduction=\"mean\", float? divisor=None, "
      "bool inplace_backward=False, Tensor? row_stats=None, int vocab_start=0, int vocab_size=-1) "
      "-> (Tensor loss, Tensor lse)");
  m.def("_cross_entropy_forward(Tensor logits, Tensor target, " RL_LOSSES_CE_ARGS
        ", bool compute_grad) -> (Tensor loss, Tensor lse, Tensor grad, Tensor grad_row_unscale)");
  m.def("_cross_entropy_forward_inplace(Tensor(a!) logits, Tensor target, " RL_LOSSES_CE_ARGS
        ") -> (Tensor loss, Tensor lse, Tensor grad_row_unscale)");
#undef RL_LOSSES_CE_ARGS

  // ---- GRPO (docs/math.md) ------------------------------------------------------------------------
  // Outputs after the loss are detached metrics (docs/math.md); `entropy` is 0 unless compute_entropy.
// The policy family's options (docs/policy_losses.md) follow each policy op's own arguments; its metrics
// follow ratio_mean: kl (mean KL estimate towards ref_log_probs), rollout_ratio_mean (mean ρ),
// rollout_weight_mean (mean correction weight), rollout_corrected_fraction (tokens truncated or masked), and,
// last (after GSPO's document_ratios), vespo_phi_mean (the mean VESPO weight φ over the labelled sequences;
// TRL's vespo/phi_seq_mean; 0 for the other loss types).
#define RL_LOSSES_POLICY_OUTS                                                                           \
  "(Tensor loss, Tensor new_logprobs, Tensor clipped_fraction_low, Tensor clipped_fraction_high, "     \
  "Tensor kl_old, Tensor entropy, Tensor log_probs, Tensor ratio_mean, Tensor kl, Tensor rollout_ratio_mean, " \
  "Tensor rollout_weight_mean, Tensor rollout_corrected_fraction"
#define RL_LOSSES_POLICY_ARGS                                                                                   \
  "str loss_type, float sapo_temperature_pos, float sapo_temperature_neg, Tensor? rollout_log_probs, "          \
  "str? rollout_correction, float rollout_cap, float[]? rollout_mask_bounds, str kl_estimator, "                \
  "bool kl_importance_weighted, float entropy_coefficient, float vespo_k_pos, float vespo_lambda_pos, "          \
  "float vespo_k_neg, float vespo_lambda_neg"
#define RL_LOSSES_POLICY_KWARGS                                                                                 \
  "str loss_type=\"ppo_clip\", float sapo_temperature_pos=1.0, float sapo_temperature_neg=1.05, "              \
  "Tensor? rollout_log_probs=None, str? rollout_correction=None, float rollout_cap=3.0, "                        \
  "float[]? rollout_mask_bounds=None, str kl_estimator=\"k3\", bool kl_importance_weighted=False, "             \
  "float entropy_coefficient=0.0, float vespo_k_pos=2.0, float vespo_lambda_pos=3.0, float vespo_k_neg=3.0, "   \
  "float vespo_lambda_neg=2.0"
  // old_log_probs=None: on-policy (old = sg(lp)). advantages: per token, or per sequence ((B,) for (B, T)
  // labels). document_index: the sequences of a sequence-level rollout_correction or of vespo (default: the
  // rows); num_documents: their count (default: max(document_index) + 1, read on the host).
#define RL_LOSSES_GRPO_ARGS                                                                                    \
  "Tensor? ref_log_probs, Tensor? loss_weights, Tensor? label_counts, float epsilon_low, float epsilon_high, " \
  "float? delta, float beta, float? divisor, float logits_scale_factor, bool compute_entropy, "                \
  "Tensor? row_stats, int vocab_start, int vocab_size, " RL_LOSSES_POLICY_ARGS ", Tensor? document_index, "      \
  "int? num_documents"
  m.def(
      "grpo(Tensor logits, Tensor target, Tensor advantages, Tensor? old_log_probs, *, Tensor? ref_log_probs=None, "
      "Tensor? loss_weights=None, Tensor? label_counts=None, float epsilon_low=0.2, float epsilon_high=0.2, "
      "float? delta=None, float beta=0.0, float? divisor=None, float logits_scale_factor=1.0, "
      "bool compute_entropy=False, bool inplace_backward=False, Tensor? row_stats=None, int vocab_start=0, "
      "int vocab_size=-1, " RL_LOSSES_POLICY_KWARGS ", Tensor? document_index=None, int? num_documents=None) -> "
      RL_LOSSES_POLICY_OUTS
      ", Tensor vespo_phi_mean)");
  m.def("_grpo_forward(Tensor logits, Tensor target, Tensor advantages, Tensor? old_log_probs, " RL_LOSSES_GRPO_ARGS
        ", bool compute_grad) -> " RL_LOSSES_POLICY_OUTS ", Tensor vespo_phi_mean, Tensor grad, Tensor grad_row_unscale)");
  m.def("_grpo_forward_inplace(Tensor(a!) logits, Tensor target, Tensor advantages, Tensor? old_log_probs, "
        RL_LOSSES_GRPO_ARGS ") -> " RL_LOSSES_POLICY_OUTS ", Tensor vespo_phi_mean, Tensor grad_row_unscale)");
#undef RL_LOSSES_GRPO_ARGS

  // ---- GSPO (docs/math.md) ------------------------------------------------------------------------
  // `document_sums` (num_documents, 6: Σu(lp−old), Σu·A, labelled-token count, Σm(old−rollout),
  // VESPO's Σm·clamp(lp−old) [+ Σm·clamp(log ω)], the importance-weighted KL's Σκ·KL; gspo/gspo.h: GspoSum), when
  // given, replaces the op's own per-document sums: the sequence-data-parallel layer all-reduces them over its
  // group. Its first 3 columns alone are accepted where the others are unused. Extra outputs: document_ratios R_s
  // (num_documents,), then vespo_phi_mean.
#define RL_LOSSES_GSPO_ARGS                                                                                   \
  "int? num_documents, Tensor? label_counts, float epsilon_low, float epsilon_high, float? delta, "           \
  "str weighting, bool token_advantages, float? divisor, float logits_scale_factor, bool compute_entropy, "    \
  "Tensor? row_stats, Tensor? document_sums, int vocab_start, int vocab_size, Tensor? ref_log_probs, "          \
  "float beta, "                                                                                               \
  RL_LOSSES_POLICY_ARGS
  m.def(
      "gspo(Tensor logits, Tensor target, Tensor advantages, Tensor? old_log_probs, Tensor document_index, *, "
      "int? num_documents=None, Tensor? label_counts=None, float epsilon_low=0.2, float epsilon_high=0.2, "
      "float? delta=None, str weighting=\"document\", bool token_advantages=False, float? divisor=None, "
      "float logits_scale_factor=1.0, bool compute_entropy=False, bool inplace_backward=False, "
      "Tensor? row_stats=None, Tensor? document_sums=None, int vocab_start=0, int vocab_size=-1, "
      "Tensor? ref_log_probs=None, float beta=0.0, " RL_LOSSES_POLICY_KWARGS ") -> "
      RL_LOSSES_POLICY_OUTS ", Tensor document_ratios, Tensor vespo_phi_mean)");
  m.def("_gspo_forward(Tensor logits, Tensor target, Tensor advantages, Tensor? old_log_probs, "
        "Tensor document_index, " RL_LOSSES_GSPO_ARGS ", bool compute_grad) -> " RL_LOSSES_POLICY_OUTS
        ", Tensor document_ratios, Tensor vespo_phi_mean, Tensor grad, Tensor grad_row_unscale)");
  m.def("_gspo_forward_inplace(Tensor(a!) logits, Tensor target, Tensor advantages, Tensor? old_log_probs, "
        "Tensor document_index, " RL_LOSSES_GSPO_ARGS ") -> " RL_LOSSES_POLICY_OUTS
        ", Tensor document_ratios, Tensor vespo_phi_mean, Tensor grad_row_unscale)");
  // The per-document sums of one rank (for the sequence-data-parallel all-reduce), from this rank's
  // per-token log-probs: (num_documents, 6) as described above; the keyword options are the gspo op's that the
  // sums depend on.
  m.def(
      "gspo_document_sums(Tensor log_probs, Tensor target, Tensor advantages, Tensor? old_log_probs, "
      "Tensor document_index, Tensor label_counts, int num_documents, *, str weighting=\"document\", "
      "bool token_advantages=False, Tensor? ref_log_probs=None, float beta=0.0, " RL_LOSSES_POLICY_KWARGS
      ") -> Tensor");
#undef RL_LOSSES_GSPO_ARGS

  // ---- fused lm_head: the same losses from hidden states (linear/linear_source.h) --------------------
#define RL_LOSSES_LINEAR_GRADS "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias"
  // The fused lm_head's options (linear/linear_source.h, docs/performance.md): chunk_size, the rows of logits
  // alive at once (default: from the strategy's budget); strategy, "fast" (rows outer, a fp32 weight-gradient
  // accumulator across chunks) or "lean" (no accumulator, at most 256 MiB beyond the gradients, one more GEMM);
  // weight_main_grad, a (V, H) fp32 buffer that grad_weight is added into instead of being returned (the
  // losses add it in the forward, for an upstream gradient of 1); skip_unlabelled, rows with a negative label
  // take no GEMM work (their count is read on the host: one synchronisation).
#define RL_LOSSES_LINEAR_KWARGS \
  "int? chunk_size=None, str strategy=\"fast\", Tensor(a!)? weight_main_grad=None, bool skip_unlabelled=True"
#define RL_LOSSES_LINEAR_ARGS "int? chunk_size, str strategy, Tensor(a!)? weight_main_grad, bool skip_unlabelled"
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, *, Tensor? bias=None, "
      "float logits_scale_factor=1.0, float label_smoothing=0.0, float z_loss_factor=0.0, float label_weight=1.0, "
      "str reduction=\"mean\", float? divisor=None, " RL_LOSSES_LINEAR_KWARGS ") -> (Tensor loss, Tensor lse)");
  m.def(
      "_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
      "float logits_scale_factor, float label_smoothing, float z_loss_factor, float label_weight, str reduction, "
      "float? divisor, " RL_LOSSES_LINEAR_ARGS ", bool[3] output_mask) -> (Tensor loss, Tensor lse, "
      RL_LOSSES_LINEAR_GRADS ")");
  m.def(
      "linear_grpo(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, Tensor? old_log_probs, *, "
      "Tensor? bias=None, Tensor? ref_log_probs=None, Tensor? loss_weights=None, Tensor? label_counts=None, "
      "float epsilon_low=0.2, float epsilon_high=0.2, float? delta=None, float beta=0.0, float? divisor=None, "
      "float logits_scale_factor=1.0, bool compute_entropy=False, " RL_LOSSES_LINEAR_KWARGS ", "
      RL_LOSSES_POLICY_KWARGS ", Tensor? document_index=None, int? num_documents=None) -> " RL_LOSSES_POLICY_OUTS
      ", Tensor vespo_phi_mean)");
  m.def(
      "_linear_grpo_forward(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, Tensor? old_log_probs, "
      "Tensor? bias, Tensor? ref_log_probs, Tensor? loss_weights, Tensor? label_counts, float epsilon_low, "
      "float epsilon_high, float? delta, float beta, float? divisor, float logits_scale_factor, "
      "bool compute_entropy, " RL_LOSSES_LINEAR_ARGS ", " RL_LOSSES_POLICY_ARGS ", Tensor? document_index, "
      "int? num_documents, bool[3] output_mask) -> " RL_LOSSES_POLICY_OUTS ", Tensor vespo_phi_mean, "
      RL_LOSSES_LINEAR_GRADS ")");
  m.def(
      "linear_gspo(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, Tensor? old_log_probs, "
      "Tensor document_index, *, Tensor? bias=None, int? num_documents=None, Tensor? label_counts=None, "
      "float epsilon_low=0.2, float epsilon_high=0.2, float? delta=None, str weighting=\"document\", "
      "bool token_advantages=False, float? divisor=None, float logits_scale_factor=1.0, bool compute_entropy=False, "
      RL_LOSSES_LINEAR_KWARGS ", Tensor? ref_log_probs=None, float beta=0.0, " RL_LOSSES_POLICY_KWARGS ") -> "
      RL_LOSSES_POLICY_OUTS ", Tensor document_ratios, Tensor vespo_phi_mean)");
  m.def(
      "_linear_gspo_forward(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, Tensor? old_log_probs, "
      "Tensor document_index, Tensor? bias, int? num_documents, Tensor? label_counts, float epsilon_low, "
      "float epsilon_high, float? delta, str weighting, bool token_advantages, float? divisor, "
      "float logits_scale_factor, bool compute_entropy, " RL_LOSSES_LINEAR_ARGS ", Tensor? ref_log_probs, float beta, "
      RL_LOSSES_POLICY_ARGS ", "
      "bool[3] output_mask) -> " RL_LOSSES_POLICY_OUTS ", "
      "Tensor document_ratios, Tensor vespo_phi_mean, " RL_LOSSES_LINEAR_GRADS ")");

  // ---- per-token log-probs and entropies (token_log_probs/) ------------------------------------------
  // Differentiable through both outputs with any upstream gradients, so the backward is an op of its own:
  // `_token_log_probs_forward` also returns the row statistics (N, 5) it computed (empty when `row_stats`
  // were given: those are saved instead), which `_token_log_probs_backward` reads in place of a second
  // statistics pass. `entropy` is an empty tensor unless compute_entropy. The fused-linear form recomputes
  // each chunk's logits in its backward, which is where weight_main_grad is added into (the forward only checks it).
  m.def(
      "token_log_probs(Tensor logits, Tensor target, *, float logits_scale_factor=1.0, bool compute_entropy=False, "
      "Tensor? row_stats=None, int vocab_start=0, int vocab_size=-1) -> (Tensor log_probs, Tensor entropy)");
  m.def(
      "_token_log_probs_forward(Tensor logits, Tensor target, float logits_scale_factor, bool compute_entropy, "
      "Tensor? row_stats, int vocab_start, int vocab_size) -> (Tensor log_probs, Tensor entropy, Tensor stats)");
  m.def(
      "_token_log_probs_backward(Tensor logits, Tensor target, Tensor stats, Tensor? grad_log_probs, "
      "Tensor? grad_entropy, float logits_scale_factor, int vocab_start, int vocab_size) -> Tensor");
  m.def(
      "linear_token_log_probs(Tensor hidden, Tensor weight, Tensor target, *, Tensor? bias=None, "
      "float logits_scale_factor=1.0, bool compute_entropy=False, " RL_LOSSES_LINEAR_KWARGS ") "
      "-> (Tensor log_probs, Tensor entropy)");
  m.def(
      "_linear_token_log_probs_forward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
      "float logits_scale_factor, bool compute_entropy, " RL_LOSSES_LINEAR_ARGS ") "
      "-> (Tensor log_probs, Tensor entropy, Tensor stats)");
  m.def(
      "_linear_token_log_probs_backward(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor stats, "
      "Tensor? grad_log_probs, Tensor? grad_entropy, float logits_scale_factor, " RL_LOSSES_LINEAR_ARGS ", "
      "bool[3] output_mask) -> (" RL_LOSSES_LINEAR_GRADS ")");
#undef RL_LOSSES_LINEAR_GRADS
#undef RL_LOSSES_LINEAR_KWARGS
#undef RL_LOSSES_LINEAR_ARGS
#undef RL_LOSSES_POLICY_OUTS

  // ---- distillation against a teacher's logits (distillation/, docs/distillation_dpo.md) --------------
  // kind: forward_kl | reverse_kl | cross_entropy | jsd (β: Liger-Kernel's generalised JSD). The teacher's
  // softmax is over teacher_logits / temperature, the student's over logits_scale_factor·logits. Outputs: the
  // loss and the per-row divergence (detached; 0 on masked rows). `row_stats` (…, 7) and, for JSD,
  // `jsd_sums` (…, 2) are the tensor-parallel hooks: the all-reduced outputs of distillation_stats and
  // distillation_jsd_sums, which the op then uses in place of its own passes.
#define RL_LOSSES_DISTILL_ARGS                                                                             \
  "str kind, float beta, float temperature, float logits_scale_factor, Tensor? loss_mask, float? divisor, " \
  "Tensor? row_stats, Tensor? jsd_sums"
  m.def(
      "distillation(Tensor logits, Tensor teacher_logits, *, str kind=\"forward_kl\", float beta=0.5, "
      "float temperature=1.0, float logits_scale_factor=1.0, Tensor? loss_mask=None, float? divisor=None, "
      "bool inplace_backward=False, Tensor? row_stats=None, Tensor? jsd_sums=None) -> (Tensor loss, "
      "Tensor divergence)");
  m.def("_distillation_forward(Tensor logits, Tensor teacher_logits, " RL_LOSSES_DISTILL_ARGS
        ", bool compute_grad) -> (Tensor loss, Tensor divergence, Tensor grad)");
  m.def("_distillation_forward_inplace(Tensor(a!) logits, Tensor teacher_logits, " RL_LOSSES_DISTILL_ARGS
        ") -> (Tensor loss, Tensor divergence)");
  m.def(
      "distillation_stats(Tensor logits, Tensor teacher_logits, *, float temperature=1.0, "
      "float logits_scale_factor=1.0) -> Tensor");
  m.def(
      "distillation_jsd_sums(Tensor logits, Tensor teacher_logits, Tensor row_stats, *, float beta=0.5, "
      "float temperature=1.0, float logits_scale_factor=1.0) -> Tensor");
#undef RL_LOSSES_DISTILL_ARGS

  // ---- DPO over packed documents (dpo/, docs/distillation_dpo.md) ------------------------------------
  // pairs (P, 2): (chosen, rejected) document ids, every document 0 .. 2P−1 in exactly one pair; reference
  // log-probs per pair. Outputs after the loss are detached metrics; document_log_probs (2P,) are the π_s.
  // row_stats / vocab_start / vocab_size: the tensor-parallel hooks, as on cross_entropy.
#define RL_LOSSES_DPO_OUTS                                                                             \
  "(Tensor loss, Tensor rewards_chosen, Tensor rewards_rejected, Tensor accuracy, Tensor margin, " \
  "Tensor log_probs, Tensor document_log_probs"
  m.def(
      "dpo(Tensor logits, Tensor target, Tensor document_index, Tensor pairs, Tensor reference_chosen_log_probs, "
      "Tensor reference_rejected_log_probs, *, float beta=1.0, float logits_scale_factor=1.0, float? divisor=None, "
      "bool inplace_backward=False, Tensor? row_stats=None, int vocab_start=0, int vocab_size=-1) -> "
      RL_LOSSES_DPO_OUTS ")");
  m.def(
      "_dpo_forward(Tensor logits, Tensor target, Tensor document_index, Tensor pairs, "
      "Tensor reference_chosen_log_probs, Tensor reference_rejected_log_probs, float beta, "
      "float logits_scale_factor, float? divisor, Tensor? row_stats, int vocab_start, int vocab_size, "
      "bool compute_grad) -> " RL_LOSSES_DPO_OUTS ", Tensor grad, Tensor grad_row_unscale)");
  m.def(
      "_dpo_forward_inplace(Tensor(a!) logits, Tensor target, Tensor document_index, Tensor pairs, "
      "Tensor reference_chosen_log_probs, Tensor reference_rejected_log_probs, float beta, "
      "float logits_scale_factor, float? divisor, Tensor? row_stats, int vocab_start, int vocab_size) -> "
      RL_LOSSES_DPO_OUTS ", Tensor grad_row_unscale)");
#undef RL_LOSSES_DPO_OUTS

  // ---- several losses in one pass (combined/): label CE, z-loss and GRPO or GSPO with weights --------------
  // loss = label_weight·label_loss + z_loss_weight·z_loss + grpo_weight·grpo_loss + gspo_weight·gspo_loss, each
  // term with its own divisor (default: the term's tokens: the labelled ones, z_loss_mask's for the z-loss; the
  // labelled documents for GSPO) and each reported (detached) beside the total; one summed gradient. The GSPO
  // term shares advantages, old_log_probs, ref_log_probs, epsilon_low/high and beta with GRPO (at most one of the
  // two is on). row_stats / vocab_start / vocab_size: the tensor-parallel hooks, as on cross_entropy.
#define RL_LOSSES_HEAD_ARGS                                                                                    \
  "float label_weight, float label_smoothing, float? label_divisor, float z_loss_weight, "                     \
  "float? z_loss_divisor, Tensor? z_loss_mask, float grpo_weight, Tensor? advantages, Tensor? old_log_probs, " \
  "Tensor? ref_log_probs, Tensor? loss_weights, float epsilon_low, float epsilon_high, float? delta, "         \
  "float beta, float? grpo_divisor, float gspo_weight, Tensor? document_index, int? num_documents, "           \
  "Tensor? label_counts, str weighting, float? gspo_divisor, float logits_scale_factor, Tensor? row_stats, "   \
  "int vocab_start, int vocab_size"
#define RL_LOSSES_HEAD_OUTS \
  "(Tensor loss, Tensor label_loss, Tensor z_loss, Tensor grpo_loss, Tensor log_probs, Tensor gspo_loss"
  m.def(
      "fused_head_loss(Tensor logits, Tensor target, *, float label_weight=0.0, float label_smoothing=0.0, "
      "float? label_divisor=None, float z_loss_weight=0.0, float? z_loss_divisor=None, Tensor? z_loss_mask=None, "
      "float grpo_weight=0.0, Tensor? advantages=None, Tensor? old_log_probs=None, Tensor? ref_log_probs=None, "
      "Tensor? loss_weights=None, float epsilon_low=0.2, float epsilon_high=0.2, float? delta=None, float beta=0.0, "
      "float? grpo_divisor=None, float gspo_weight=0.0, Tensor? document_index=None, int? num_documents=None, "
      "Tensor? label_counts=None, str weighting='document', float? gspo_divisor=None, float logits_scale_factor=1.0, "
      "bool inplace_backward=False, Tensor? row_stats=None, int vocab_start=0, int vocab_size=-1) -> "
      RL_LOSSES_HEAD_OUTS ")");
  m.def("_fused_head_loss_forward(Tensor logits, Tensor target, " RL_LOSSES_HEAD_ARGS
        ", bool compute_grad) -> " RL_LOSSES_HEAD_OUTS ", Tensor grad, Tensor grad_row_unscale)");
  m.def("_fused_head_loss_forward_inplace(Tensor(a!) logits, Tensor target, " RL_LOSSES_HEAD_ARGS
        ") -> " RL_LOSSES_HEAD_OUTS ", Tensor grad_row_unscale)");
#undef RL_LOSSES_HEAD_OUTS
#undef RL_LOSSES_HEAD_ARGS
#undef RL_LOSSES_POLICY_ARGS
#undef RL_LOSSES_POLICY_KWARGS
}
