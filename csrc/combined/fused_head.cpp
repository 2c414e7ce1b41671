#include "combined/fused_head.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/checks.h"

namespace rl_losses {

namespace {

// The GSPO term's checks and state (gspo.cpp: gspo_forward's, for the plain GSPO the head fuses: ppo_clip at the
// sequence ratio, the k3 KL per token, no rollout correction, the document's mean advantage).
GspoState gspo_term_state(const char* op, const FlatLogits& f, const at::Tensor& target, const HeadGspoArgs& gspo,
                          const std::optional<at::Tensor>& advantages, const std::optional<at::Tensor>& old_log_probs,
                          const std::optional<at::Tensor>& ref_log_probs,
                          const std::optional<at::Tensor>& loss_weights, double epsilon_low, double epsilon_high,
                          std::optional<double> delta, double beta, const PolicyOptions<double>& options,
                          at::ScalarType acc) {
  check_epsilons(op, epsilon_low, epsilon_high);
  TORCH_CHECK(!delta, op, ": delta is the GRPO term's two-sided clip; the GSPO term has none, got delta = ",
              delta ? *delta : 0.0);
  TORCH_CHECK(!loss_weights, op, ": loss_weights weigh the GRPO term's tokens; the GSPO term weighs them by "
              "`weighting` (pass loss_weights=None)");
  check_beta(op, beta, ref_log_probs.has_value());
  TORCH_CHECK(gspo.weighting == "document" || gspo.weighting == "token", op,
              ": weighting must be 'document' or 'token', got '", gspo.weighting, "'");
  TORCH_CHECK(advantages && gspo.document_index, op, ": gspo_weight = ", gspo.weight,
              " > 0 needs advantages and document_index");
  GspoState g;
  g.opt = options;
  g.target = f.target1d;
  g.advantages = check_per_token(op, "advantages", *advantages, target, acc);
  if (old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, target, acc);
  if (beta != 0) g.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, target, acc);
  g.document = check_per_token_int(op, "document_index", *gspo.document_index, target);
  if (gspo.label_counts) g.label_counts = check_label_counts(op, *gspo.label_counts, target, acc);
  // The number of documents: given, or max(document_index) + 1 (which synchronises with the device).
  g.num_documents = document_count(op, g.document, gspo.num_documents);
  g.divisor = gspo.divisor;
  g.token_weighting = gspo.weighting == "token";
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
  backend.token_terms(g);
  g.sums = at::empty({g.num_documents, kGspoSums}, opts);
  g.fields = at::empty({g.num_documents, kGspoDocFields}, opts);
  g.ratios = at::empty({g.num_documents}, opts);
  g.totals = at::empty({kGspoTotals}, opts);
  backend.documents(g);
  g.token_out = at::empty({n, kGspoTokenFields}, opts);
  g.coef = at::empty({n}, opts);
  backend.tokens(g);
}

}  // namespace

std::vector<at::Tensor> fused_head_forward(RowSource& src, const at::Tensor& target, double label_weight,
                                           double label_smoothing, std::optional<double> label_divisor,
                                           double z_loss_weight, std::optional<double> z_loss_divisor,
                                           const std::optional<at::Tensor>& z_loss_mask, double grpo_weight,
                                           const std::optional<at::Tensor>& advantages,
                                           const std::optional<at::Tensor>& old_log_probs,
                                           const std::optional<at::Tensor>& ref_log_probs,
                                           const std::optional<at::Tensor>& loss_weights, double epsilon_low,
                                           double epsilon_high, std::optional<double> delta, double beta,
                                           std::optional<double> grpo_divisor, double logits_scale_factor,
                                           const HeadGspoArgs& gspo, const std::optional<at::Tensor>& row_stats,
                                           const FusedHeadBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  const double weights[kHeadTerms] = {label_weight, z_loss_weight, grpo_weight, gspo.weight};
  const char* names[kHeadTerms] = {"label_weight", "z_loss_weight", "grpo_weight", "gspo_weight"};
  for (int k = 0; k < kHeadTerms; ++k) {
    TORCH_CHECK(std::isfinite(weights[k]) && weights[k] >= 0, op, ": ", names[k], " must be finite and >= 0, got ",
                weights[k]);
  }
  TORCH_CHECK(grpo_weight == 0 || gspo.weight == 0, op, ": grpo_weight = ", grpo_weight, " and gspo_weight = ",
              gspo.weight, " are both > 0; the head fuses one policy term, GRPO or GSPO");
  TORCH_CHECK(std::isfinite(label_smoothing) && label_smoothing >= 0 && label_smoothing < 1, op,
              ": label_smoothing must be in [0, 1), got ", label_smoothing);
  check_divisor(op, label_divisor);
  check_divisor(op, z_loss_divisor);
  check_divisor(op, grpo_divisor);
  check_divisor(op, gspo.divisor);
  check_row_stats(op, row_stats, f);
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  FusedHeadRows rows;
  rows.ce = {1.0, label_smoothing, 0.0, static_cast<double>(f.vocab_total)};
  rows.grpo = {{epsilon_low, epsilon_high, delta ? *delta : std::numeric_limits<double>::infinity()},
               kPpoClip, 1.0, 1.0, beta, kKlK3, false, kRolloutNone, 1.0, 0.0, 0.0, 0.0};
  for (int k = 0; k < kHeadTerms; ++k) rows.weight[k] = weights[k];
  if (grpo_weight != 0) {
    check_epsilons(op, epsilon_low, epsilon_high);
    check_delta(op, delta, epsilon_high);
    check_beta(op, beta, ref_log_probs.has_value());
    TORCH_CHECK(advantages && old_log_probs, op, ": grpo_weight = ", grpo_weight,
                " > 0 needs advantages and old_log_probs");
    rows.advantages = check_per_token(op, "advantages", *advantages, target, acc);
    rows.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, target, acc);
    if (beta != 0) rows.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, target, acc);
    if (loss_weights) rows.loss_weights = check_per_token(op, "loss_weights", *loss_weights, target, acc);
  }
  GspoState g;
  if (gspo.weight != 0) {
    g = gspo_term_state(op, f, target, gspo, advantages, old_log_probs, ref_log_probs, loss_weights, epsilon_low,
                        epsilon_high, delta, beta, rows.grpo, acc);
  }
  if (z_loss_weight != 0 && z_loss_mask) {
    const at::Tensor& m = *z_loss_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isIntegralType(m.scalar_type(), false), op,
                ": z_loss_mask must be a bool or integer tensor, got ", m.scalar_type());
    TORCH_CHECK(m.device() == f.options.device() && m.sizes() == target.sizes(), op,
                ": z_loss_mask must have the target's shape ", target.sizes(), " and device ", f.options.device(),
                ", got ", m.sizes(), " on ", m.device());
    rows.z_mask = m.reshape({-1}).ne(0).to(acc).contiguous();
  }
  // Each divisor: given, or the number of the term's tokens (at least 1; no host synchronisation): the labelled
  // ones for CE and GRPO, those of z_loss_mask (every token without one) for the z-loss. GSPO divides its shares
  // itself (GspoTokenStep: by gspo_divisor, default the labelled documents).
  at::Tensor n_labelled;
  const std::optional<double> divisors[kHeadTerms - 1] = {label_divisor, z_loss_divisor, grpo_divisor};
  for (int k = 0; k < kHeadTerms - 1; ++k) {
    if (divisors[k]) {
      rows.divisor[k] = at::full({}, *divisors[k], opts);
    } else if (k == kHeadZLoss) {
      rows.divisor[k] = rows.z_mask.defined() ? sum_1d(rows.z_mask).clamp_min(1)
                                              : at::full({}, static_cast<double>(std::max<int64_t>(f.n_rows, 1)), opts);
    } else {
      if (!n_labelled.defined()) n_labelled = labelled_count(f.target1d, acc);
      rows.divisor[k] = n_labelled;
    }
  }
  rows.out = at::empty({f.n_rows, kHeadTerms}, opts);
  rows.log_probs = at::empty({f.n_rows}, opts);
  for (auto& t : rows.scalars) t = at::empty({}, opts);

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
  if (f.n_rows > 0 && gspo.weight != 0) {
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
  // (total, label, z, grpo), log_probs, then gspo: the outputs' order before the GSPO term, then its own.
  std::vector<at::Tensor> out(std::begin(rows.scalars), std::begin(rows.scalars) + kHeadGspo + 1);
  out.push_back(rows.log_probs.view(target.sizes()));
  out.push_back(rows.scalars[kHeadGspo + 1]);
  return out;
}

}  // namespace rl_losses
