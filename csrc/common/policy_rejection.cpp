// verl's rollout rejection inside the fused policy ops (docs/policy_losses.md, verl's
// compute_rollout_rejection_mask): the options parsed as verl parses them, and the pre-pass that turns the rejected
// tokens into unlabelled ones. The pre-pass reads the (N,) inputs only (old and rollout log-probs, labels,
// sequences): a few O(N + S) ATen launches before the row pass, none over the logits. In bypass_mode the same steps
// judge the current log-probs instead, once the op has them (grpo.cpp, gspo.cpp).
#include <ATen/ops/arange.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>

#include "common/cuda_backends.h"
#include "common/policy.h"
#include "common/rollout_statistic.h"

namespace rl_losses {

namespace {

// The comma-separated, whitespace-trimmed, non-empty parts of `s` (verl's split(",") and strip()).
std::vector<std::string> parts(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    size_t a = start, b = end;
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    if (b > a) out.push_back(s.substr(a, b - a));
    start = end + 1;
  }
  return out;
}

// A decimal number (digits, '.', an exponent, a sign) or "inf", read as strtod reads it (as Python's float, which
// the fake kernel uses: past the doubles' range inf or 0, no error), all of it.
double number(const char* op, const std::string& text, const std::string& spec, const std::string& mode) {
  const bool decimal = !text.empty() && text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  double v = std::numeric_limits<double>::quiet_NaN();
  if (decimal || text == "inf" || text == "+inf") {
    char* end = nullptr;
    const double read = std::strtod(text.c_str(), &end);
    if (end == text.c_str() + text.size()) v = read;
  }
  TORCH_CHECK(!std::isnan(v), op, ": rollout_rs_threshold '", spec, "' for rollout_rs mode '", mode,
              "' is not a number");
  return v;
}

constexpr const char* kModes[] = {"token_k1",    "token_k2",    "token_k3",    "seq_sum_k1", "seq_sum_k2",
                                  "seq_sum_k3",  "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                                  "seq_max_k3"};

}  // namespace

std::vector<RejectionRule> rollout_rejection_rules(const char* op, const OptString& rollout_rs,
                                                   const OptString& rollout_rs_threshold, bool has_old,
                                                   bool has_rollout, bool bypass_mode) {
  std::vector<RejectionRule> rules;
  if (!rollout_rs) {
    TORCH_CHECK(!rollout_rs_threshold, op, ": rollout_rs_threshold = '", *rollout_rs_threshold,
                "' given without rollout_rs");
    return rules;
  }
  const std::string& given = *rollout_rs;
  std::vector<std::string> modes;
  for (const std::string& m : parts(given)) {
    TORCH_CHECK(std::find(std::begin(kModes), std::end(kModes), m) != std::end(kModes), op, ": rollout_rs mode '",
                m, "' is not one of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 (verl's), got "
                "rollout_rs = '", given, "'");
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  }
  TORCH_CHECK(!modes.empty(), op, ": rollout_rs must name at least one mode, got '", given, "'");
  TORCH_CHECK(rollout_rs_threshold, op, ": rollout_rs = '", given, "' needs rollout_rs_threshold (verl's "
              "specification: one per mode or one for all, 'lo_hi' or 'hi' for the k1 modes)");
  TORCH_CHECK(has_rollout, op, ": rollout_rs = '", given, "' needs rollout_log_probs");
  // Without old_log_probs (on-policy) the old side would be the current log-probs: that is bypass_mode's, asked for
  // by name, whose old side is the rollout.
  TORCH_CHECK(has_old || bypass_mode, op, ": rollout_rs = '", given, "' needs old_log_probs (it judges old against "
              "rollout), or bypass_mode = True (verl's: it judges the current log-probs against rollout)");
  std::vector<std::string> specs = parts(*rollout_rs_threshold);
  TORCH_CHECK(specs.size() == 1 || specs.size() == modes.size(), op, ": rollout_rs_threshold = '",
              *rollout_rs_threshold, "' must hold one threshold for all modes or one per mode (", modes.size(),
              " in rollout_rs = '", given, "')");
  if (specs.size() == 1) specs.resize(modes.size(), specs[0]);
  for (size_t i = 0; i < modes.size(); ++i) {
    const std::string& m = modes[i];
    const std::string& spec = specs[i];
    RejectionRule r{};
    r.level = m.rfind("token_", 0) == 0     ? RejectionRule::kToken
              : m.rfind("seq_sum_", 0) == 0 ? RejectionRule::kSeqSum
              : m.rfind("seq_mean_", 0) == 0 ? RejectionRule::kSeqMean
                                              : RejectionRule::kSeqMax;
    r.estimator = m.back() - '0';
    const size_t sep = spec.find('_');
    if (r.estimator == 1) {
      const double hi = number(op, sep == std::string::npos ? spec : spec.substr(sep + 1), spec, m);
      const double lo = sep == std::string::npos ? 1.0 / hi : number(op, spec.substr(0, sep), spec, m);
      TORCH_CHECK(lo > 0 && hi > 0, op, ": rollout_rs_threshold '", spec, "' for mode '", m, "' must be positive ",
                  "ratio bounds, got lower ", lo, " and upper ", hi);
      TORCH_CHECK(lo <= hi, op, ": rollout_rs_threshold '", spec, "' for mode '", m, "' must be ordered, lower <= "
                  "upper, got lower ", lo, " and upper ", hi);
      r.lo = std::log(lo);
      r.hi = std::log(hi);
    } else {
      TORCH_CHECK(sep == std::string::npos, op, ": rollout_rs_threshold '", spec, "' for mode '", m, "' takes one "
                  "upper bound (no '_': lower and upper bounds are for the k1 modes)");
      r.hi = number(op, spec, spec, m);
      TORCH_CHECK(r.hi > 0, op, ": rollout_rs_threshold '", spec, "' for mode '", m, "' must be positive, got ",
                  r.hi);
      r.lo = -std::numeric_limits<double>::infinity();
    }
    rules.push_back(r);
  }
  return rules;
}

TokenRejection<double> token_rejection(const std::vector<RejectionRule>& rules) {
  TokenRejection<double> t{};
  for (const RejectionRule& r : rules) {
    if (r.level != RejectionRule::kToken) continue;
    t.on[r.estimator - 1] = true;
    t.lo[r.estimator - 1] = r.lo;
    t.hi[r.estimator - 1] = r.hi;
  }
  return t;
}

std::vector<RejectionRule> sequence_rules(const std::vector<RejectionRule>& rules) {
  std::vector<RejectionRule> out;
  std::copy_if(rules.begin(), rules.end(), std::back_inserter(out),
               [](const RejectionRule& r) { return r.level != RejectionRule::kToken; });
  return out;
}

std::pair<at::Tensor, at::Tensor> sequence_of_tokens(const SequenceIds& seq, int64_t n, const at::Device& device) {
  if (seq.ids.defined()) return {seq.ids.clamp_min(0), seq.ids.ge(0)};
  const at::Tensor rows = at::arange(n, at::TensorOptions().dtype(at::kLong).device(device))
                              .div(std::max<int64_t>(seq.row_length, 1), "floor");
  return {rows, at::ones({n}, rows.options().dtype(at::kBool))};
}

at::Tensor recount_labels(const at::Tensor& counts, const at::Tensor& target1d, const at::Tensor& kept,
                          const SequenceIds& seq) {
  const auto [ids, in_sequence] = sequence_of_tokens(seq, target1d.numel(), target1d.device());
  const at::Tensor rejected = (target1d.ge(0) & kept.lt(0) & in_sequence).to(counts.scalar_type());
  return counts - at::zeros({seq.count}, counts.options()).index_add(0, ids, rejected).index_select(0, ids);
}

namespace {

void rollout_statistic(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                       const at::Tensor& out) {
#ifdef RL_LOSSES_WITH_CUDA
  if (out.is_cuda()) return rollout_statistic_cuda(estimator, log_probs, rollout_log_probs, out);
#endif
  rollout_statistic_cpu(estimator, log_probs, rollout_log_probs, out);
}

// A seq_sum / seq_mean rule's verdict per token, on the tensors' device (rollout_statistic.h).
at::Tensor sequence_rule(const RejectionRule& r, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                         const at::Tensor& ids, const at::Tensor& in_sequence, const at::Tensor& counted,
                         int64_t count) {
  const bool mean = r.level == RejectionRule::kSeqMean;
#ifdef RL_LOSSES_WITH_CUDA
  if (log_probs.is_cuda()) {
    return sequence_rule_cuda(r.estimator, mean, r.lo, r.hi, log_probs, rollout_log_probs, ids, in_sequence, counted,
                              count);
  }
#endif
  return sequence_rule_cpu(r.estimator, mean, r.lo, r.hi, log_probs, rollout_log_probs, ids, in_sequence, counted,
                           count);
}

}  // namespace

at::Tensor reject_rollout_tokens(const std::vector<RejectionRule>& rules, const at::Tensor& target1d,
                                 const at::Tensor& old_log_probs, const at::Tensor& rollout_log_probs,
                                 const SequenceIds& seq) {
  if (rules.empty() || target1d.numel() == 0) return target1d;
  // The statistics in the log-probs' dtype (at least float32), as the row pass's token rules compute them.
  at::ScalarType dtype = at::result_type(old_log_probs, rollout_log_probs);
  if (dtype != at::kDouble) dtype = at::kFloat;
  const at::Tensor lp = old_log_probs.reshape(-1).to(dtype).contiguous();
  const at::Tensor rollout = rollout_log_probs.reshape(-1).to(dtype).contiguous();
  TORCH_INTERNAL_ASSERT(lp.numel() == target1d.numel() && rollout.numel() == lp.numel(), "rl_losses: internal error: "
                        "the rejection's log-probs are not one per token");
  at::Tensor ids, in_sequence, counted;  // counted: the labelled tokens of a sequence, which its statistic sums
  if (has_sequence_rule(rules)) {
    std::tie(ids, in_sequence) = sequence_of_tokens(seq, target1d.numel(), target1d.device());
    counted = target1d.ge(0) & in_sequence;
  }
  at::Tensor keep;  // every rule's test, and'ed
  at::Tensor per_token[3];  // each estimator's statistic of every token, computed once for the rules that read it
  for (const RejectionRule& r : rules) {
    if (r.level == RejectionRule::kSeqSum || r.level == RejectionRule::kSeqMean) {
      const at::Tensor passes = sequence_rule(r, lp, rollout, ids, in_sequence, counted, seq.count);
      keep = keep.defined() ? keep & passes : passes;
      continue;
    }
    at::Tensor& k = per_token[r.estimator - 1];
    if (!k.defined()) {
      k = at::empty_like(lp);
      rollout_statistic(r.estimator, lp, rollout, k);
    }
    at::Tensor stat = k;
    if (r.level == RejectionRule::kSeqMax) {
      // verl's masked max: −inf outside the mask, 0 for a sequence without tokens; no sequence: kept.
      const double inf = std::numeric_limits<double>::infinity();
      at::Tensor per_seq = at::full({seq.count}, -inf, k.options())
                               .scatter_reduce(0, ids, at::where(counted, k, -inf), "amax", true);
      per_seq = at::where(per_seq == -inf, at::zeros({seq.count}, k.options()), per_seq);
      stat = at::where(in_sequence, per_seq.index_select(0, ids), r.hi);
    }
    // (a NaN statistic fails both tests, as verl's)
    const bool no_lower = r.lo == -std::numeric_limits<double>::infinity();
    const at::Tensor passes = no_lower ? stat.le(r.hi) : stat.ge(r.lo) & stat.le(r.hi);
    keep = keep.defined() ? keep & passes : passes;
  }
  return at::where(keep, target1d, -100);
}

}  // namespace rl_losses
