#include "fused_head/fused_head.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/checks.h"
#include "fused_head/fused_head_distill.h"

namespace rl_losses {

namespace {

// The policy terms' options (make_policy_options without the fused ops' own: the entropy bonus, VESPO's weight
// parameters and rollout_rs are grpo's and gspo's alone, so loss_type 'vespo', whose weight reads them, is theirs).
PolicyOptions<double> head_policy_options(const char* op, const FusedHeadArgs& a) {
  // rollout_log_probs feed the correction or, without one, the rejection, which make_policy_options (here without
  // the fused ops' arguments) does not see: it refuses them only where neither reads them.
  const bool read = a.rollout_log_probs.has_value() && (a.policy.rollout_correction || !a.rollout_rs);
  // bypass_mode's rejection judges the current log-probs, known only after the head's statistics: grpo's and gspo's.
  TORCH_CHECK(!a.bypass_mode, op, ": bypass_mode (verl's: rollout_rs judging the current log-probs) is grpo_loss's "
              "and gspo_loss's, not the fused head's: use those ops");
  const PolicyOptions<double> o = make_policy_options(op, a.policy, nullptr, &a.clip, a.beta, read);
  TORCH_CHECK(o.loss_type != kVespo, op, ": loss_type 'vespo' weighs a sequence with vespo_k_* and vespo_lambda_*, "
              "options of grpo_loss and gspo_loss, not of the fused head: use those ops");
  return o;
}

// The GSPO term's checks and state (gspo.cpp: gspo_forward's, for the GSPO the head fuses: the per-token policy
// options at the sequence ratio, the document's mean advantage).
GspoState gspo_term_state(const char* op, const FlatLogits& f, const at::Tensor& target, const FusedHeadArgs& a,
                          at::ScalarType acc) {
  check_epsilons(op, a.clip.epsilon_low, a.clip.epsilon_high);
  TORCH_CHECK(!a.clip.delta, op, ": delta is the GRPO term's two-sided clip; the GSPO term has none, got delta = ",
              a.clip.delta.value_or(0.0));
  TORCH_CHECK(!a.loss_weights, op, ": loss_weights weigh the GRPO term's tokens; the GSPO term weighs them by "
              "`weighting` (pass loss_weights=None)");
  check_beta(op, a.beta, a.ref_log_probs.has_value());
  check_weighting(op, a.weighting);
  GspoState g;
  g.opt = head_policy_options(op, a);
  check_sequence_ratio_loss_type(op, g.opt, a.policy);
  check_geo_mean(op, g.opt, /*token_advantages=*/false, a.policy);
  const std::vector<RejectionRule> rules = rollout_rejection_rules(op, a.rollout_rs, a.rollout_rs_threshold,
                                                                   a.old_log_probs.has_value(),
                                                                   a.rollout_log_probs.has_value(), false);
  TORCH_CHECK(a.advantages && a.document_index, op, ": gspo_weight = ", a.gspo_weight,
              " > 0 needs advantages and document_index");
  g.target = f.target1d;
  g.advantages = check_per_token(op, "advantages", *a.advantages, target, acc);
  if (a.old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, target, acc);
  set_policy_inputs(op, g, a.beta != 0 ? a.ref_log_probs : std::nullopt, a.rollout_log_probs, a.policy, target, acc);
  g.document = check_per_token_int(op, "document_index", *a.document_index, target);
  if (a.label_counts) g.label_counts = check_label_counts(op, *a.label_counts, target, acc);
  // The number of documents: given, or max(document_index) + 1 (which synchronises with the device).
  g.num_documents = document_count(op, g.document, a.num_documents);
  reject_rollout_documents(op, g, rules, f.target1d, target, a.rollout_log_probs, acc, g.num_documents,
                           g.old_log_probs);
  g.divisor = a.gspo_divisor;
  g.token_weighting = a.weighting == "token";
  return g;
}

// Between the statistics and the head pass: the GSPO op's own steps (gspo.cpp), each token's loss share and
// gradient coefficient from its document's ratio.
void gspo_term_steps(GspoState& g, const GspoBackend& backend, const at::TensorOptions& opts) {
  const int64_t n = g.target.numel();
  g.log_probs = at::empty({n}, opts);
  g.safe_document = at::empty({n}, g.document.options());
  g.terms = at::empty({n, kGspoSums}, opts);
  g.local_sums = at::empty({g.num_documents, kGspoSums}, opts);
  g.sums = at::empty({g.num_documents, kGspoSums}, opts);
  g.fields = at::empty({g.num_documents, kGspoDocFields}, opts);
  g.ratios = at::empty({g.num_documents}, opts);
  g.totals = at::empty({kGspoTotals}, opts);
  g.token_out = at::empty({n, kGspoTokenFields}, opts);
  g.coef = at::empty({n}, opts);
  backend.steps(g, nullptr);
}

}  // namespace

FusedHeadResults fused_head_forward(RowSource& src, const at::Tensor& target, const FusedHeadArgs& a,
                                    const OptTensor& row_stats, const FusedHeadBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  const double label_weight = a.label_weight, label_smoothing = a.label_smoothing, z_loss_weight = a.z_loss_weight;
  const double grpo_weight = a.grpo_weight, gspo_weight = a.gspo_weight, logits_scale_factor = a.logits_scale_factor;
  const double distillation_weight = a.distillation_weight;
  check_scale(op, logits_scale_factor);
  const double weights[kHeadTerms] = {label_weight, z_loss_weight, grpo_weight, gspo_weight, distillation_weight};
  const char* names[kHeadTerms] = {"label_weight", "z_loss_weight", "grpo_weight", "gspo_weight",
                                   "distillation_weight"};
  for (int k = 0; k < kHeadTerms; ++k) {
    TORCH_CHECK(std::isfinite(weights[k]) && weights[k] >= 0, op, ": ", names[k], " must be finite and >= 0, got ",
                weights[k]);
  }
  TORCH_CHECK(grpo_weight == 0 || gspo_weight == 0, op, ": grpo_weight = ", grpo_weight, " and gspo_weight = ",
              gspo_weight, " are both > 0; the head fuses one policy term, GRPO or GSPO");
  // The distillation term runs the head on distillation's passes (fused_head_distill.h), which take neither GSPO's
  // statistics pass nor the all-reduced statistics of tensor parallelism.
  TORCH_CHECK(distillation_weight == 0 || gspo_weight == 0, op, ": distillation_weight = ", distillation_weight,
              " and gspo_weight = ", gspo_weight, " are both > 0; the head fuses distillation with CE, z-loss and "
              "GRPO, not GSPO: use gspo_loss beside it");
  TORCH_CHECK(distillation_weight == 0 || !row_stats, op, ": distillation_weight = ", distillation_weight,
              " > 0 runs without tensor parallelism (row_stats given): use distillation_loss beside the head");
  TORCH_CHECK(std::isfinite(label_smoothing) && label_smoothing >= 0 && label_smoothing < 1, op,
              ": label_smoothing must be in [0, 1), got ", label_smoothing);
  for (const auto& d : {a.label_divisor, a.z_loss_divisor, a.grpo_divisor, a.gspo_divisor, a.distillation_divisor}) {
    check_divisor(op, d);
  }
  check_row_stats(op, row_stats, f);
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  FusedHeadRows rows;
  rows.ce = {.label_weight = 1.0,
             .label_smoothing = label_smoothing,
             .z_loss_factor = 0.0,
             .vocab_size = static_cast<double>(f.vocab_total)};
  for (int k = 0; k < kHeadTerms; ++k) rows.weight[k] = weights[k];
  at::Tensor grpo_kept;  // the GRPO term's labels after rollout_rs (undefined without it)
  if (grpo_weight != 0) {
    check_clip(op, a.clip, a.beta, a.ref_log_probs.has_value());
    rows.grpo = head_policy_options(op, a);
    check_token_ratio_loss_type(op, rows.grpo, a.policy);
    // The row pass's epilogue reads one token at a time: what needs a sequence's or the batch's log-probs first
    // (a sequence-level correction; clip_cov's and kl_cov's subsets) is grpo_loss's.
    TORCH_CHECK(!sequence_level_rollout(a.policy) && !cov_loss_type(rows.grpo.loss_type), op, ": the GRPO term "
                "takes the per-token options; rollout_correction '", a.policy.rollout_correction.value_or("None"),
                "' with loss_type '", a.policy.loss_type, "' needs a sequence's or the batch's log-probs first: use "
                "grpo_loss for 'sequence_*' corrections, 'clip_cov' and 'kl_cov'");
    TORCH_CHECK(a.advantages && a.old_log_probs, op, ": grpo_weight = ", grpo_weight,
                " > 0 needs advantages and old_log_probs");
    rows.advantages = check_per_token(op, "advantages", *a.advantages, target, acc);
    rows.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, target, acc);
    if (a.beta != 0) rows.ref_log_probs = check_per_token(op, "ref_log_probs", *a.ref_log_probs, target, acc);
    if (rows.grpo.rollout_mode != kRolloutNone) {
      rows.rollout_log_probs = check_per_token(op, "rollout_log_probs", *a.rollout_log_probs, target, acc);
    }
    if (a.loss_weights) rows.loss_weights = check_per_token(op, "loss_weights", *a.loss_weights, target, acc);
    const std::vector<RejectionRule> rules = rollout_rejection_rules(op, a.rollout_rs, a.rollout_rs_threshold,
                                                                     /*has_old=*/true, a.rollout_log_probs.has_value(),
                                                                     /*bypass_mode=*/false);
    if (!rules.empty()) {
      // grpo_forward's pre-pass: a rejected token weighs 0 in the GRPO term and leaves its default divisor.
      const at::Tensor rollout = rows.rollout_log_probs.defined()
                                     ? rows.rollout_log_probs
                                     : check_per_token(op, "rollout_log_probs", *a.rollout_log_probs, target, acc);
      SequenceIds seq;
      if (has_sequence_rule(rules)) {
        seq = sequence_ids(op, a.document_index, a.num_documents, target, "rollout_rs (its sequence modes)");
      }
      grpo_kept = reject_rollout_tokens(rules, f.target1d, rows.old_log_probs, rollout, seq);
      const at::Tensor m = grpo_kept.ge(0).to(acc);
      rows.loss_weights = rows.loss_weights.defined() ? rows.loss_weights * m : m;
    }
  }
  GspoState g;
  if (gspo_weight != 0) g = gspo_term_state(op, f, target, a, acc);
  FusedHeadDistillRows distill;
  if (distillation_weight != 0) distill = fused_head_distill_state(op, f, target, a);
  if (z_loss_weight != 0 && a.z_loss_mask) {
    const at::Tensor& m = *a.z_loss_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isIntegralType(m.scalar_type(), false), op,
                ": z_loss_mask must be a bool or integer tensor, got ", m.scalar_type());
    TORCH_CHECK(m.device() == f.options.device() && m.sizes() == target.sizes(), op,
                ": z_loss_mask must have the target's shape ", target.sizes(), " and device ", f.options.device(),
                ", got ", m.sizes(), " on ", m.device());
    rows.z_mask = m.reshape({-1}).ne(0).to(acc).contiguous();
  }
  // Each divisor: given, or the number of the term's tokens (at least 1; no host synchronisation): the labelled
  // ones for CE and GRPO (GRPO's: those rollout_rs keeps), those of z_loss_mask (every token without one) for the z-loss. GSPO divides its shares
  // itself (GspoTokenStep: by gspo_divisor, default the labelled documents).
  at::Tensor n_labelled;
  const std::optional<double> divisors[kHeadGspo] = {a.label_divisor, a.z_loss_divisor, a.grpo_divisor};
  for (int k = 0; k < kHeadGspo; ++k) {
    if (rows.weight[k] == 0) continue;  // an off term reads no divisor (FusedHeadEpilogue): no count, no fill launch
    if (divisors[k]) {
      rows.divisor_value[k] = *divisors[k];
    } else if (k == kHeadZLoss && !rows.z_mask.defined()) {
      rows.divisor_value[k] = static_cast<double>(std::max<int64_t>(f.n_rows, 1));
    } else if (k == kHeadZLoss) {
      rows.divisor[k] = sum_1d(rows.z_mask).clamp_min(1);
    } else if (k == kHeadGrpo && grpo_kept.defined()) {
      rows.divisor[k] = labelled_count(grpo_kept, acc);
    } else {
      if (!n_labelled.defined()) n_labelled = labelled_count(f.target1d, acc);
      rows.divisor[k] = n_labelled;
    }
  }
  rows.out = new_empty({f.n_rows, kHeadTerms}, opts);
  rows.log_probs = new_empty({f.n_rows}, opts);
  // The total, and each term's loss where its weight is not 0: an output costs a CUDA host its allocation and its
  // Python object, read or not (docs/host_time.md); an off term's is None.
  rows.scalars[0] = new_empty({}, opts);
  for (int k = 0; k < kHeadTerms; ++k) {
    if (rows.weight[k] != 0) rows.scalars[k + 1] = new_empty({}, opts);
  }

  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  rows.labels = f.target1d;
  if (row_stats) args.stats_in = *row_stats;
  if (z_loss_weight != 0) {
    // The z-loss's unlabelled tokens get the stand-in label 0, so that the row pass reads them (the epilogue
    // reads the true labels); the other unlabelled rows stay skipped.
    at::Tensor z_only = f.target1d < 0;
    if (rows.z_mask.defined()) z_only = z_only.logical_and(rows.z_mask != 0);
    args.target = at::where(z_only, at::zeros({}, f.target1d.options()), f.target1d);
    // The row pass takes the label's logit from the statistics, which, given (tensor parallelism), hold 0 on
    // those rows: the shard holding column 0 puts its logit there (read before any in-place gradient).
    if (row_stats && f.vocab_start == 0 && f.n_rows > 0 && f.vocab > 0) {
      at::Tensor label_logit = f.logits2d.select(1, 0).to(acc) * logits_scale_factor;
      args.stats_in = row_stats->clone(at::MemoryFormat::Contiguous);
      args.stats_in.select(1, 4).copy_(at::where(z_only, label_logit, args.stats_in.select(1, 4)));
    }
  }
  args.smoothing = label_smoothing != 0 && label_weight != 0;
  if (f.n_rows > 0 && distillation_weight != 0) {
    fused_head_distill_rows(src, rows, distill, logits_scale_factor, args.smoothing, backend);
  } else if (f.n_rows > 0 && gspo_weight != 0) {
    // GSPO's statistics pass (unless given: every rank then computes the same document sums from the all-reduced
    // statistics), its per-document steps, then one head pass with the statistics given. The statistics pass
    // reads the rows the head pass reads (args.target holds the z-loss's stand-in labels).
    const GspoBackend& gb = backend.gspo();
    if (!args.stats_in.defined()) {
      at::Tensor stats = at::empty({f.n_rows, 5}, opts);
      src.run(args, false, [&](RowPassArgs& a) { gb.stats(a, stats); });
      args.stats_in = stats;
    }
    g.stats = args.stats_in;
    gspo_term_steps(g, gb, opts);
    rows.gspo_out = g.token_out;
    rows.gspo_coef = g.coef;
    src.run(args, src.wants_grad(), [&](RowPassArgs& a) { backend.rows(a, rows); });
  } else if (f.n_rows > 0) {
    src.run(args, src.wants_grad(), [&](RowPassArgs& a) {
      split_stats_pass_on_cuda(a);
      backend.rows(a, rows);
    });
  }
  backend.totals(rows);
  // rows.scalars: the total, then the terms.
  FusedHeadResults r;
  r.loss = rows.scalars[0];
  r.label_loss = rows.scalars[kHeadLabel + 1];
  r.z_loss = rows.scalars[kHeadZLoss + 1];
  r.grpo_loss = rows.scalars[kHeadGrpo + 1];
  r.gspo_loss = rows.scalars[kHeadGspo + 1];
  r.distillation_loss = rows.scalars[kHeadDistill + 1];
  r.log_probs = rows.log_probs.view(target.sizes());
  return r;
}

}  // namespace rl_losses
