// Every schema of the rl_losses namespace, in one place, built from the argument lists of op_args.h (each
// default typed once, there). Back-end kernels are registered in their own files (`*_cpu.cpp` for CPU,
// cuda_registration.cpp for CUDA), the autograd kernels in `*_autograd.cpp`, and the fake (meta) kernels in
// python/rl_losses/_fake.py.
//
// Conventions:
//   * Public ops take the tensors positionally and every option by keyword, with its default; `_<op>_forward`
//     ops take the same arguments (no keywords) and the switches of their caller, without defaults but for the
//     losses' `_<op>_forward` and `_linear_<op>_forward` (def_loss, def_linear): rl_losses.forward_backward calls
//     them with the arguments its wrapper gave, the others left to the schema (binding every argument from Python
//     cost more than the op's own work).
//   * A loss `<op>` (def_loss) comes with `_<op>_forward(<its arguments but inplace_backward>, compute_grad)`,
//     which computes the loss, the per-row outputs and, when asked, the gradient in the same pass, returning the
//     op's results then `grad`; and `_<op>_forward_inplace`, which writes the gradient into the logits' own storage
//     (inplace_backward). The autograd kernel (common/fused_loss_autograd.cpp) passes the public op's arguments on.
//   * `_scale_grad_` is the backward of every loss: it scales the gradient computed in the forward by the
//     upstream gradient, in place, and does nothing (decided on the device) when that is 1. The forwards of the
//     losses over the row pass return `grad_row_unscale` last (RL_LOSSES_GRAD_ROW_UNSCALE), which `_scale_grad_`
//     takes with the gradient.
//   * The fused-linear ops `linear_<op>` (def_linear) take `hidden (..., H)` and `weight (V, H)` in place of the
//     logits, with the options of the logits op (no inplace_backward, no tensor-parallel hooks) and the fused lm_head's
//     own (RL_LOSSES_LINEAR_OPTIONS); `_linear_<op>_forward(<the same arguments>, output_mask)` returns their results
//     followed by grad_hidden, grad_weight, grad_bias (linear/).
//   * `row_stats`/`vocab_start`/`vocab_size` are the hooks of vocabulary (tensor) parallelism: a loss op given
//     `row_stats` (all-reduced over the TP group) skips its own statistics pass and writes this shard's
//     gradient.
#include <Python.h>
#include <torch/library.h>

#include <initializer_list>
#include <string>

#include "common/batch_invariant.h"
#include "common/cpu_isa.h"
#include "op_args.h"

extern "C" {
// An empty Python module: importing rl_losses._C loads this library, whose static initialisers register
// the ops with the dispatcher. No pybind11 is needed for ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace rl_losses {
namespace {

using schema::Entries;
using schema::OpSchema;

Entries cat(std::initializer_list<Entries> lists) {
  Entries out;
  for (const Entries& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

void def(torch::Library& m, const OpSchema& s) { m.def(s.str().c_str()); }

// `name(<inputs>, *, <options>, bool inplace_backward=False, <hooks>) -> (<results>)` and its two forward ops;
// `row_pass`: a loss over the row pass, whose forwards also return grad_row_unscale.
void def_loss(torch::Library& m, const std::string& name, const Entries& inputs, const Entries& options,
              const Entries& hooks, const Entries& results, bool row_pass = true) {
  const Entries unscale = row_pass ? RL_LOSSES_ENTRIES(RL_LOSSES_GRAD_ROW_UNSCALE) : Entries{};
  def(m, OpSchema(name).args(inputs).kwargs().args(options).args(RL_LOSSES_ENTRIES(RL_LOSSES_INPLACE)).args(hooks)
             .results(results));
  def(m, OpSchema("_" + name + "_forward").args(inputs).args(options).args(hooks)
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_COMPUTE_GRAD))
             .results(cat({results, RL_LOSSES_ENTRIES(RL_LOSSES_GRAD), unscale})));
  def(m, OpSchema("_" + name + "_forward_inplace").without_defaults().first_mutable().args(inputs).args(options)
             .args(hooks).results(cat({results, unscale})));
}

// `linear_<name>(hidden, weight, target, <inputs>, *, <linear options>, <options>) -> (<results>)` and its forward
// op.
void def_linear(torch::Library& m, const std::string& name, const Entries& inputs, const Entries& options,
                const Entries& results) {
  const Entries head = RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_INPUT), linear = RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_OPTIONS);
  def(m, OpSchema("linear_" + name).args(head).args(inputs).kwargs().args(linear).args(options).results(results));
  def(m, OpSchema("_linear_" + name + "_forward").args(head).args(inputs).args(linear).args(options).kwargs()
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_OUTPUT_MASK))
             .results(cat({results, RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_GRADS)})));
}

}  // namespace
}  // namespace rl_losses

TORCH_LIBRARY(rl_losses, m) {
  using namespace rl_losses;
  const Entries logits = RL_LOSSES_ENTRIES(RL_LOSSES_LOGITS_INPUT);
  const Entries tp_hooks = cat({RL_LOSSES_ENTRIES(RL_LOSSES_ROW_STATS), RL_LOSSES_ENTRIES(RL_LOSSES_VOCAB_SHARD)});
  const Entries scale = RL_LOSSES_ENTRIES(RL_LOSSES_SCALE), stats = RL_LOSSES_ENTRIES(RL_LOSSES_STATS_RESULT);
  const Entries sampler = RL_LOSSES_ENTRIES(RL_LOSSES_SAMPLER);

  // ---- shared ---------------------------------------------------------------------------------------------
  def(m, OpSchema("row_stats").args(logits).kwargs().args(scale).args(RL_LOSSES_ENTRIES(RL_LOSSES_VOCAB_SHARD))
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_ROW_STATS_OPTIONS)).results(stats));
  m.def("_scale_grad_(Tensor(a!) grad, Tensor grad_output, Tensor? row_unscale=None) -> ()");
  // The batch-invariant mode's switch (common/batch_invariant.h; rl_losses.batch_invariant()): no tensors, one
  // kernel for every device. _set_batch_invariant returns the switch's previous value, _batch_invariant whether the
  // mode is on (the switch or torch.use_deterministic_algorithms).
  m.def("_set_batch_invariant(bool enabled) -> bool", &set_batch_invariant);
  m.def("_batch_invariant() -> bool", &batch_invariant);
  m.def("_invariant_gemm_rows() -> int", [] { return kInvariantGemmRows; });
  // The CPU row loops' vector widths (common/cpu_isa.h): the one they run at, and those this build compiled.
  m.def("_cpu_isa() -> str", [] { return cpu_isa_name(cpu_isa()); });
  m.def("_cpu_isas_compiled() -> str[]", [] { return cpu_isas_compiled(); });

  // ---- cross-entropy (docs/math.md) --------------------------------------------------------------------------
  const Entries ce_options = RL_LOSSES_ENTRIES(RL_LOSSES_CROSS_ENTROPY_KEYWORDS);
  const Entries ce_results = RL_LOSSES_ENTRIES(RL_LOSSES_CE_RESULTS);
  def_loss(m, "cross_entropy", logits, ce_options, tp_hooks, ce_results);
  def_linear(m, "cross_entropy", {}, ce_options, ce_results);

  // ---- the policy family: GRPO, GSPO (docs/math.md, docs/policy_losses.md) ------------------------------------
  // old_log_probs=None: on-policy (old = sg(lp)). advantages: per token, or per sequence ((B,) for (B, T) labels;
  // GSPO: also per document).
  const Entries policy_inputs = RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_INPUTS);
  const Entries policy_tensors = RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_TENSORS);
  const Entries clip = RL_LOSSES_ENTRIES(RL_LOSSES_CLIP), kl_weight = RL_LOSSES_ENTRIES(RL_LOSSES_KL_WEIGHT);
  const Entries policy = RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_OPTIONS);
  const Entries fused_policy = RL_LOSSES_ENTRIES(RL_LOSSES_FUSED_POLICY_OPTIONS);
  const Entries policy_results = RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_RESULTS);
  const Entries vespo_results = RL_LOSSES_ENTRIES(RL_LOSSES_VESPO_RESULTS);
  const Entries grpo_options = cat({RL_LOSSES_ENTRIES(RL_LOSSES_GRPO_KEYWORDS), clip, policy, fused_policy, sampler});
  const Entries grpo_results = cat({policy_results, vespo_results});
  def_loss(m, "grpo", cat({logits, policy_inputs}), grpo_options, tp_hooks, grpo_results);
  def_linear(m, "grpo", policy_inputs, grpo_options, grpo_results);

  // `document_sums` (num_documents, 6: gspo/gspo.h: GspoSum), when given, replaces the op's own per-document sums:
  // the sequence-data-parallel layer all-reduces them over its group. Its first 3 columns alone are accepted where
  // the others are unused.
  const Entries gspo_inputs = cat({policy_inputs, RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_DOCUMENTS)});
  const Entries weighting = RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_WEIGHTING);
  const Entries token_advantages = RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_TOKEN_ADVANTAGES);
  const Entries gspo_options = cat({RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_KEYWORDS), clip, policy, fused_policy, sampler});
  const Entries gspo_results = cat({policy_results, RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_RESULTS), vespo_results});
  def_loss(m, "gspo", cat({logits, gspo_inputs}), gspo_options,
           cat({RL_LOSSES_ENTRIES(RL_LOSSES_ROW_STATS), RL_LOSSES_ENTRIES(RL_LOSSES_GSPO_SUMS),
                RL_LOSSES_ENTRIES(RL_LOSSES_VOCAB_SHARD)}),
           gspo_results);
  def_linear(m, "gspo", gspo_inputs, gspo_options, gspo_results);
  // The per-document sums of one rank (for the sequence-data-parallel all-reduce), from its per-token log-probs;
  // the keyword options are those of the gspo op that the sums depend on.
  def(m, OpSchema("gspo_document_sums").args(RL_LOSSES_ENTRIES(RL_LOSSES_DOCUMENT_SUMS_INPUT)).kwargs()
             .args(weighting).args(token_advantages).args(policy_tensors).args(clip).args(kl_weight).args(policy)
             .results(RL_LOSSES_ENTRIES(RL_LOSSES_DOCUMENT_SUMS_RESULTS)));

  // Per-token policy loss ℓ_t and ∂ℓ_t/∂lp_t from per-token log-probs (policy_token/: the fused ops' per-token math,
  // without the logits), each shaped like log_probs, float32 (float64 for float64 log-probs); all 0 where loss_mask
  // is 0 (no input read there). Aggregation is the caller's. Its tensors are positional (see RL_LOSSES_POLICY_TOKEN_INPUT).
  def(m, OpSchema("policy_token_loss").args(RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_TOKEN_INPUT)).args(policy_tensors)
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_TOKEN_MASK)).kwargs().args(clip).args(kl_weight).args(policy)
             .results(RL_LOSSES_ENTRIES(RL_LOSSES_POLICY_TOKEN_RESULTS)));

  // ---- the kept-set gradient (kept_set/) -----------------------------------------------------------------------
  // grad (..., vocab_size) in values' dtype: zeros, but values[..., j] at ids[..., j] where the id is >= 0 (-1:
  // padding) and the value nonzero (at most one nonzero value per id and row: kept_set.h). The backward of
  // rl_losses.kept_token_log_probs (python/rl_losses/kept_set.py), in one pass over the rows.
  def(m, OpSchema("_scatter_rows").args(RL_LOSSES_ENTRIES(RL_LOSSES_SCATTER_ROWS_INPUT))
             .results(RL_LOSSES_ENTRIES(RL_LOSSES_GRAD)));

  // ---- per-token log-probs and entropies (token_log_probs/) ---------------------------------------------------
  // Differentiable through both outputs with any upstream gradients, so the backward is an op of its own:
  // `_token_log_probs_forward` also returns the row statistics (N, 5) it computed (empty when `row_stats` were
  // given: those are saved instead), which `_token_log_probs_backward` reads in place of a second statistics
  // pass. `entropy` is an empty tensor unless compute_entropy. The fused-linear form recomputes each chunk's
  // logits in its backward, which is where weight_main_grad is added into (the forward only checks it).
  const Entries tlp_options = cat({RL_LOSSES_ENTRIES(RL_LOSSES_TOKEN_LOG_PROBS_KEYWORDS), sampler});
  const Entries tlp_results = RL_LOSSES_ENTRIES(RL_LOSSES_TOKEN_LOG_PROBS_RESULTS);
  const Entries upstream = RL_LOSSES_ENTRIES(RL_LOSSES_TOKEN_LOG_PROBS_UPSTREAM);
  def(m, OpSchema("token_log_probs").args(logits).kwargs().args(tlp_options).args(tp_hooks).results(tlp_results));
  def(m, OpSchema("_token_log_probs_forward").without_defaults().args(logits).args(tlp_options).args(tp_hooks)
             .results(cat({tlp_results, stats})));
  def(m, OpSchema("_token_log_probs_backward").without_defaults().args(logits).args(upstream).args(scale).args(sampler)
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_VOCAB_SHARD)).results(RL_LOSSES_ENTRIES(RL_LOSSES_GRAD)));
  const Entries lin = cat({RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_INPUT), RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_OPTIONS)});
  def(m, OpSchema("linear_token_log_probs").args(RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_INPUT)).kwargs()
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_OPTIONS)).args(tlp_options).results(tlp_results));
  def(m, OpSchema("_linear_token_log_probs_forward").without_defaults().args(lin).args(tlp_options)
             .results(cat({tlp_results, stats})));
  def(m, OpSchema("_linear_token_log_probs_backward").without_defaults().args(lin).args(upstream).args(scale).args(sampler)
             .args(RL_LOSSES_ENTRIES(RL_LOSSES_OUTPUT_MASK)).results(RL_LOSSES_ENTRIES(RL_LOSSES_LINEAR_GRADS)));

  // ---- distillation against a teacher's logits (distillation/, docs/distillation_dpo.md) ----------------------
  // kind: forward_kl | reverse_kl | cross_entropy | jsd (β: Liger-Kernel's generalised JSD). The results: the loss
  // and the per-row divergence (detached; 0 on masked rows). `row_stats` (…, 7) and, for JSD, `jsd_sums` (…, 2)
  // are the tensor-parallel hooks: the all-reduced results of distillation_stats and distillation_jsd_sums, which
  // the op then uses in place of its own passes.
  const Entries distill = RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_INPUT), softmax = RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_SOFTMAX);
  const Entries distill_beta = RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_BETA);
  def_loss(m, "distillation", distill,
           RL_LOSSES_ENTRIES(RL_LOSSES_DISTILLATION_KEYWORDS),
           RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_HOOKS), RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_RESULTS),
           /*row_pass=*/false);
  def(m, OpSchema("distillation_stats").args(distill).kwargs().args(softmax).results(stats));
  def(m, OpSchema("distillation_jsd_sums").args(distill).args(RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_STATS_INPUT))
             .kwargs().args(distill_beta).args(softmax).results(RL_LOSSES_ENTRIES(RL_LOSSES_DISTILL_JSD_RESULTS)));

  // ---- distillation from a sparse teacher (topk_distillation/, docs/distillation_dpo.md) ----------------------------
  // The forward KL over the teacher's K ids per token; target marks the tokens that count (negative: ignored, not
  // read). A vocabulary shard takes its hooks: the all-reduced row statistics and the logits at the teacher's ids.
  const Entries topk_input = RL_LOSSES_ENTRIES(RL_LOSSES_TOPK_INPUT);
  const Entries topk_options = RL_LOSSES_ENTRIES(RL_LOSSES_TOPK_DISTILLATION_KEYWORDS);
  const Entries topk_results = RL_LOSSES_ENTRIES(RL_LOSSES_TOPK_RESULTS);
  def_loss(m, "topk_distillation", cat({logits, topk_input}), topk_options,
           cat({RL_LOSSES_ENTRIES(RL_LOSSES_TOPK_HOOKS), RL_LOSSES_ENTRIES(RL_LOSSES_VOCAB_SHARD)}), topk_results);
  def_linear(m, "topk_distillation", topk_input, topk_options, topk_results);

  // ---- DPO over packed documents (dpo/, docs/distillation_dpo.md) ------------------------------------------------
  // pairs (P, 2): (chosen, rejected) document ids, every document 0 .. 2P−1 in exactly one pair; reference
  // log-probs per pair. The results after the loss are detached metrics; document_log_probs (2P,) are the π_s.
  def_loss(m, "dpo", cat({logits, RL_LOSSES_ENTRIES(RL_LOSSES_DPO_INPUT)}),
           RL_LOSSES_ENTRIES(RL_LOSSES_DPO_KEYWORDS), tp_hooks,
           RL_LOSSES_ENTRIES(RL_LOSSES_DPO_RESULTS));

  // ---- several losses in one pass (fused_head/): label CE, z-loss and GRPO or GSPO with weights -------------------
  // loss = label_weight·label_loss + z_loss_weight·z_loss + grpo_weight·grpo_loss + gspo_weight·gspo_loss
  // + distillation_weight·distillation_loss, each
  // term with its own divisor (default: the term's tokens: the labelled ones, z_loss_mask's for the z-loss; the
  // labelled documents for GSPO) and each reported (detached) beside the total; one summed gradient. The GSPO term
  // shares advantages, old_log_probs, the policy tensors, the clip, beta and the per-token policy options with GRPO
  // (at most one of the two is on).
  def_loss(m, "fused_head", logits,
           cat({RL_LOSSES_ENTRIES(RL_LOSSES_FUSED_HEAD_KEYWORDS), clip, policy}),
           tp_hooks,
           RL_LOSSES_ENTRIES(RL_LOSSES_FUSED_HEAD_RESULTS));
}
