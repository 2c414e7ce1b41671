#include "dpo/dpo.h"

#include <cmath>
#include <vector>

#include "common/checks.h"
#include "common/row_source.h"

namespace rl_losses {

namespace {

constexpr const char* kDpo = "dpo";

// `pairs` must pair every document 0 .. 2P−1 exactly once, as (chosen, rejected): a pairing mistake would
// otherwise be a silently wrong loss. Pairs on the CPU (also with CUDA logits: documents_from_spans builds them
// there) are checked on the host, where reading them costs no synchronisation, then copied to the logits'
// device; pairs already on the device are checked there (DpoPairStep, DpoPairCoverage: a device-side assert),
// so that the call never waits for the device.
at::Tensor check_pairs(const at::Tensor& pairs, const c10::Device& logits_device) {
  TORCH_CHECK(pairs.defined() && at::isIntegralType(pairs.scalar_type(), false), kDpo,
              ": pairs must be an integer tensor of (chosen, rejected) document ids, got ",
              pairs.defined() ? c10::toString(pairs.scalar_type()) : "undefined");
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(1) == 2, kDpo, ": pairs must have shape (num_pairs, 2), got ",
              pairs.sizes());
  TORCH_CHECK(pairs.device() == logits_device || pairs.is_cpu(), kDpo, ": pairs is on ", pairs.device(),
              " but logits is on ", logits_device, " (pairs may be on the logits' device or on the CPU)");
  // (each ATen call, a no-op `to` too, costs a GPU's host a few us: made only where it changes something)
  const at::Tensor p = (pairs.scalar_type() == at::kLong ? pairs : pairs.to(at::kLong)).contiguous();
  if (!p.is_cpu()) return p;
  const int64_t n_pairs = p.size(0), n_docs = 2 * n_pairs;
  const int64_t* id = p.const_data_ptr<int64_t>();
  std::vector<int64_t> seen(n_docs, -1);
  for (int64_t i = 0; i < n_docs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n_docs, kDpo, ": pairs[", i / 2, "] holds document ", id[i], ", but ",
                n_pairs, " pairs cover the documents 0 .. ", n_docs - 1,
                " (every document must be the chosen or the rejected side of exactly one pair)");
    TORCH_CHECK(seen[id[i]] < 0, kDpo, ": document ", id[i], " is in pairs[", seen[id[i]] / 2, "] and in pairs[",
                i / 2, "]; every document must be in exactly one pair");
    seen[id[i]] = i;
  }
  return logits_device.is_cpu() ? p : p.to(logits_device, /*non_blocking=*/true);
}

at::Tensor check_per_pair(const char* name, const at::Tensor& t, int64_t n_pairs, const c10::Device& logits_device,
                          at::ScalarType acc) {
  TORCH_CHECK(t.defined() && at::isFloatingType(t.scalar_type()), kDpo, ": ", name,
              " must be a floating-point tensor");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n_pairs, kDpo, ": ", name, " must have shape (", n_pairs,
              ",) (one value per pair), got ", t.sizes());
  TORCH_CHECK(t.device() == logits_device, kDpo, ": ", name, " is on ", t.device(), " but logits is on ",
              logits_device);
  return flat_contiguous(t, acc);
}

}  // namespace

DpoResults dpo_forward(RowSource& src, const at::Tensor& target, const DpoArgs& a, const OptTensor& row_stats,
                       const DpoBackend& backend) {
  const FlatLogits& f = src.flat();
  const double beta = a.beta;
  const at::Tensor& pairs = a.pairs;
  check_scale(kDpo, a.logits_scale_factor);
  check_divisor(kDpo, a.divisor);
  check_row_stats(kDpo, row_stats, f);
  TORCH_CHECK(std::isfinite(beta) && beta > 0, kDpo, ": beta must be finite and > 0, got ", beta);
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  DpoState g;
  g.beta = beta;
  g.pairs = check_pairs(pairs, f.options.device());
  g.num_pairs = g.pairs.size(0);
  g.num_documents = 2 * g.num_pairs;
  TORCH_CHECK(g.num_pairs > 0, kDpo, ": pairs is empty; DPO needs at least one (chosen, rejected) pair");
  g.ref_chosen = check_per_pair("reference_chosen_log_probs", a.reference_chosen_log_probs, g.num_pairs,
                                f.options.device(), acc);
  g.ref_rejected =
      check_per_pair("reference_rejected_log_probs", a.reference_rejected_log_probs, g.num_pairs,
                                  f.options.device(), acc);
  g.target = f.target1d;
  g.document = check_per_token_int(kDpo, "document_index", a.document_index, target);
  if (!g.document.is_cuda() && f.n_rows > 0) {  // CUDA: a device-side assert in the per-token step
    const int64_t high = g.document.max().item<int64_t>();
    TORCH_CHECK(high < g.num_documents, kDpo, ": document_index holds ", high, " but ", g.num_pairs,
                " pairs cover the documents 0 .. ", g.num_documents - 1, " (a span without a chosen/rejected pair)");
  }
  g.divisor = a.divisor.value_or(static_cast<double>(g.num_pairs));
  g.pairs_checked = pairs.is_cpu();

  RowPassArgs args = make_row_pass_args(f, a.logits_scale_factor);
  // The buffers between the steps that no result returns, in one allocation; the results each their own.
  const std::vector<at::Tensor> scratch = new_scratch(
      opts, {{row_stats ? 0 : f.n_rows, 5}, {g.num_pairs, kDpoPairFields}, {g.num_documents}, {f.n_rows}});
  g.pair_out = scratch[1];
  g.document_coef = scratch[2];
  g.coef = scratch[3];
  if (row_stats) {
    g.stats = *row_stats;
  } else {
    g.stats = scratch[0];
    if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.stats(a, g.stats); });
  }
  g.log_probs = new_empty({f.n_rows}, opts);
  g.safe_document = new_empty({f.n_rows}, g.document.options());
  g.document_sums = new_empty({g.num_documents}, opts);
  for (auto& t : g.scalars) t = new_empty({}, opts);
  backend.steps(g);
  if (src.wants_grad() && f.n_rows > 0) {
    args.stats_in = g.stats;
    src.run(args, true, [&](RowPassArgs& a) { backend.grad(a, g.coef); });
  }
  DpoResults r;
  r.loss = g.scalars[0];
  r.rewards_chosen = g.scalars[1];
  r.rewards_rejected = g.scalars[2];
  r.accuracy = g.scalars[3];
  r.margin = g.scalars[4];
  r.log_probs = g.log_probs.view(target.sizes());
  r.document_log_probs = g.document_sums;
  return r;
}

}  // namespace rl_losses
