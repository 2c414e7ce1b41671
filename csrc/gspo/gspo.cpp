#include "gspo/gspo.h"

#include <limits>

#include "common/checks.h"

namespace rl_losses {

namespace {

// Labelled and not padding: the tokens that count (m_t of SPEC §2.3, with padding folded in).
at::Tensor token_mask(const at::Tensor& target1d, const at::Tensor& doc, at::ScalarType acc) {
  return at::logical_and(target1d.ge(0), doc.ge(0)).to(acc);
}

}  // namespace

at::Tensor gspo_document_sums(const at::Tensor& log_probs, const at::Tensor& target, const at::Tensor& advantages,
                              const at::Tensor& old_log_probs, const at::Tensor& document_index,
                              const at::Tensor& label_counts, int64_t num_documents) {
  constexpr const char* op = "gspo_document_sums";
  TORCH_CHECK(num_documents >= 0, op, ": num_documents must be >= 0, got ", num_documents);
  const auto acc = log_probs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor lp = check_per_token(op, "log_probs", log_probs, target, acc);
  const at::Tensor adv = check_per_token(op, "advantages", advantages, target, acc);
  const at::Tensor old = check_per_token(op, "old_log_probs", old_log_probs, target, acc);
  const at::Tensor doc = check_per_token_int(op, "document_index", document_index, target);
  TORCH_CHECK(label_counts.sizes() == target.sizes(), op, ": label_counts has shape ", label_counts.sizes(),
              " but target has shape ", target.sizes());
  const at::Tensor mask = token_mask(target.reshape({-1}), doc, acc);
  const at::Tensor u = mask / label_counts.reshape({-1}).to(acc).clamp_min(1);
  const at::Tensor values = at::stack({u * (lp - old), u * adv, mask}, 1);
  // Padding (negative ids) carries zero values; send it to document 0 rather than out of range.
  const at::Tensor safe = at::where(doc.ge(0), doc, at::zeros_like(doc));
  return at::zeros({num_documents, kGspoSums}, lp.options()).index_add_(0, safe, values);
}

std::vector<at::Tensor> gspo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const at::Tensor& old_log_probs, const at::Tensor& document_index,
                                     std::optional<int64_t> num_documents,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, const std::string& weighting, bool token_advantages,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats,
                                     const std::optional<at::Tensor>& document_sums, const GspoBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  check_epsilons(op, epsilon_low, epsilon_high);
  check_divisor(op, divisor);
  check_row_stats(op, row_stats, f);
  TORCH_CHECK(weighting == "document" || weighting == "token", op,
              ": weighting must be 'document' or 'token', got '", weighting, "'");
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  const at::Tensor adv = check_per_token(op, "advantages", advantages, target, acc);
  const at::Tensor old = check_per_token(op, "old_log_probs", old_log_probs, target, acc);
  const at::Tensor doc = check_per_token_int(op, "document_index", document_index, target);

  // The number of documents: given, implied by document_sums, or max(document_index) + 1 (which
  // synchronises with the device: pass num_documents to avoid it).
  int64_t n_docs;
  if (num_documents) {
    n_docs = *num_documents;
  } else if (document_sums) {
    n_docs = document_sums->size(0);
  } else {
    n_docs = f.n_rows > 0 ? std::max<int64_t>(doc.max().item<int64_t>() + 1, 0) : 0;
  }
  TORCH_CHECK(n_docs >= 0, op, ": num_documents must be >= 0, got ", n_docs);
  if (!doc.is_cuda() && f.n_rows > 0) {
    const int64_t high = doc.max().item<int64_t>();  // CPU: no device to synchronise with
    TORCH_CHECK(high < n_docs, op, ": document_index holds ", high, " but num_documents is ", n_docs);
  }
  if (document_sums) {
    TORCH_CHECK(document_sums->dim() == 2 && document_sums->size(0) == n_docs && document_sums->size(1) == kGspoSums &&
                    document_sums->scalar_type() == acc && document_sums->device() == opts.device(),
                op, ": document_sums must be (", n_docs, ", ", int(kGspoSums), ") ", acc, " on ", opts.device(),
                ", got ", document_sums->sizes(), " ", document_sums->scalar_type(), " on ",
                document_sums->device());
  }

  // Pass 1: row statistics (unless given, e.g. all-reduced over the tensor-parallel group).
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  at::Tensor stats;
  if (row_stats) {
    stats = *row_stats;
  } else {
    stats = at::empty({f.n_rows, 5}, opts);
    args.entropy = compute_entropy;
    if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.stats(a, stats); });
    args.entropy = false;
  }

  // Per token: log-probs (and entropy); per document: the sums, unless given (SDP all-reduce).
  const at::Tensor mask = token_mask(f.target1d, doc, acc);
  const at::Tensor lp = at::empty({f.n_rows}, opts);
  const at::Tensor entropy = compute_entropy ? at::empty({f.n_rows}, opts) : at::Tensor();
  backend.log_probs(stats, mask, lp, entropy);
  const at::Tensor safe_doc = at::where(doc.ge(0), doc, at::zeros_like(doc));
  at::Tensor counts;
  if (label_counts) {
    counts = check_label_counts(op, *label_counts, target, acc);
  } else {
    counts = at::zeros({n_docs}, opts).index_add_(0, safe_doc, mask).index_select(0, safe_doc);
  }
  const at::Tensor sums = document_sums ? *document_sums
                                        : gspo_document_sums(lp, f.target1d, adv, old, doc, counts, n_docs);

  // Per document: ratio and metrics; then per token: loss share and gradient coefficient.
  const ClipOptions<double> clip{epsilon_low, epsilon_high, std::numeric_limits<double>::infinity()};
  const at::Tensor doc_out = at::empty({n_docs, kGspoDocFields}, opts);
  backend.documents(clip, sums, doc_out);
  const at::Tensor doc_totals = doc_out.sum(0);
  const at::Tensor n_labelled_docs = doc_totals[kGspoHasLabel].clamp_min(1);
  const at::Tensor d = divisor_tensor(divisor, n_labelled_docs);
  const at::Tensor token_loss = at::empty({f.n_rows}, opts);
  const at::Tensor coef = at::empty({f.n_rows}, opts);
  backend.tokens(clip, sums, safe_doc, mask, counts, adv, d, token_advantages, weighting == "token", token_loss,
                 coef);

  // Pass 2: the gradient.
  if (src.wants_grad() && f.n_rows > 0) {
    args.stats_in = stats;
    src.run(args, true, [&](RowPassArgs& a) { backend.grad(a, coef); });
  }

  // Metrics (SPEC §2.4).
  const at::Tensor u = mask / counts.clamp_min(1);
  const at::Tensor ratios = doc_out.select(1, kGspoRatio);
  const at::Tensor has = doc_out.select(1, kGspoHasLabel);
  return {token_loss.sum(),
          (u * lp).sum() / n_labelled_docs,
          doc_totals[kGspoLow] / n_labelled_docs,
          doc_totals[kGspoHigh] / n_labelled_docs,
          doc_totals[kGspoKlOld] / n_labelled_docs,
          compute_entropy ? entropy.sum() / mask.sum().clamp_min(1) : at::zeros({}, opts),
          lp.view(target.sizes()),
          (ratios * has).sum() / n_labelled_docs,
          ratios.contiguous()};
}

}  // namespace rl_losses
