// GSPO (SPEC §2.3): the sequence-level, geometric-mean importance ratio over packed documents.
//
// Pass 1 (the statistics row pass) reads the logits once; the per-token log-probs, the per-document sums
// Λ_s = Σ u_t(lp_t − old_t), Ā_s = Σ u_t·A_t and the labelled counts, and each token's gradient coefficient
// are then O(N + S) steps on the device; pass 2 reads the logits again and writes the gradient. Between the
// two, the document sums may be replaced by their all-reduce over a sequence-data-parallel group
// (`document_sums`), which is how documents split across ranks get one ratio.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/row_pass.h"
#include "common/row_source.h"

namespace rl_losses {

// Columns of the per-document sums (the SDP all-reduce payload).
enum GspoSum : int { kGspoLogRatio = 0, kGspoAdvantage, kGspoCount, kGspoSums };
// Columns of the per-document metrics.
enum GspoDocField : int { kGspoRatio = 0, kGspoLow, kGspoHigh, kGspoKlOld, kGspoHasLabel, kGspoDocFields };

// Per token: the label's log-prob (and entropy) from the row statistics; 0 where masked.
template <typename acc_t>
struct GspoLogProbStep {
  const acc_t* stats;  // (N, 5)
  const acc_t* mask;   // (N,)
  acc_t* log_probs;    // (N,)
  acc_t* entropy;      // (N,) or null
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const RowStats<acc_t> st = load_stats(stats, i);
    const bool on = mask[i] != acc_t(0);
    log_probs[i] = on ? st.label - st.lse() : acc_t(0);
    if (entropy) entropy[i] = on ? st.entropy() : acc_t(0);
  }
};

// Per document: R_s and the metrics of SPEC §2.4.
template <typename acc_t>
struct GspoDocumentStep {
  ClipOptions<acc_t> clip;
  const acc_t* sums;  // (S, kGspoSums)
  acc_t* out;         // (S, kGspoDocFields)
  C10_HOST_DEVICE void operator()(int64_t s) const {
    const acc_t* d = sums + s * kGspoSums;
    acc_t* o = out + s * kGspoDocFields;
    const bool has = d[kGspoCount] > acc_t(0);
    const acc_t ratio = ::exp(d[kGspoLogRatio]);
    o[kGspoRatio] = ratio;
    o[kGspoLow] = has && clipped_low(clip, ratio, d[kGspoAdvantage]) ? acc_t(1) : acc_t(0);
    o[kGspoHigh] = has && clipped_high(clip, ratio, d[kGspoAdvantage]) ? acc_t(1) : acc_t(0);
    o[kGspoKlOld] = has ? k3(-d[kGspoLogRatio]) : acc_t(0);
    o[kGspoHasLabel] = has ? acc_t(1) : acc_t(0);
  }
};

// Per token: its share of the loss, κ_t·f(R_s, A)/D, and its gradient coefficient κ_t·c(R_s, A)·R_s/D, with
// A = Ā_s (or A_t for GSPO-token) and κ_t = u_t (weighting "document") or m_t ("token"). Summing the shares
// of a document's tokens gives f_s (or N_s·f_s) because Σ u_t = 1 over the whole document.
template <typename acc_t>
struct GspoTokenStep {
  ClipOptions<acc_t> clip;
  const acc_t* sums;        // (S, kGspoSums)
  const int64_t* document;  // (N,)
  const acc_t* mask;        // (N,)
  const acc_t* counts;      // (N,) N_t
  const acc_t* advantages;  // (N,)
  const acc_t* divisor;     // 0-dim
  bool token_advantages;
  bool token_weighting;
  int64_t num_documents;
  acc_t* loss;  // (N,)
  acc_t* coef;  // (N,)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    if (mask[i] == acc_t(0)) {
      loss[i] = acc_t(0);
      coef[i] = acc_t(0);
      return;
    }
    const int64_t s = document[i];
#if defined(__CUDA_ARCH__)
    // The CPU checks the range up front; on the device an out-of-range id must not read past the buffer.
    CUDA_KERNEL_ASSERT(s < num_documents && "rl_losses: a document index is >= num_documents");
#endif
    const acc_t* d = sums + s * kGspoSums;
    const acc_t count = counts[i] > acc_t(1) ? counts[i] : acc_t(1);
    const acc_t kappa = (token_weighting ? acc_t(1) : acc_t(1) / count) / *divisor;
    const acc_t adv = token_advantages ? advantages[i] : d[kGspoAdvantage];
    const PolicyToken<acc_t> t = gspo_document(clip, d[kGspoLogRatio], adv);
    loss[i] = kappa * t.loss;
    coef[i] = kappa * t.coef;
  }
};

// The back-end: the two row passes and the three O(N + S) steps, on one device.
struct GspoBackend {
  void (*stats)(const RowPassArgs&, const at::Tensor& out);
  void (*grad)(const RowPassArgs&, const at::Tensor& coef);
  void (*log_probs)(const at::Tensor& stats, const at::Tensor& mask, const at::Tensor& log_probs,
                    const at::Tensor& entropy);
  void (*documents)(const ClipOptions<double>&, const at::Tensor& sums, const at::Tensor& out);
  void (*tokens)(const ClipOptions<double>&, const at::Tensor& sums, const at::Tensor& document,
                 const at::Tensor& mask, const at::Tensor& counts, const at::Tensor& advantages,
                 const at::Tensor& divisor, bool token_advantages, bool token_weighting, const at::Tensor& loss,
                 const at::Tensor& coef);
};

// The per-document sums of this rank's tokens (see registration.cpp: gspo_document_sums).
at::Tensor gspo_document_sums(const at::Tensor& log_probs, const at::Tensor& target, const at::Tensor& advantages,
                              const at::Tensor& old_log_probs, const at::Tensor& document_index,
                              const at::Tensor& label_counts, int64_t num_documents);

// The 9 outputs of the `gspo` schema; the gradient, when the source wants one, is the source's.
std::vector<at::Tensor> gspo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const at::Tensor& old_log_probs, const at::Tensor& document_index,
                                     std::optional<int64_t> num_documents,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, const std::string& weighting, bool token_advantages,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats,
                                     const std::optional<at::Tensor>& document_sums, const GspoBackend& backend);

// The registered forward ops, given a back-end (the CPU and CUDA registrations bind it).
using GspoOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor>;
using GspoOutputsAndGrad = decltype(std::tuple_cat(std::declval<GspoOutputs>(), std::declval<std::tuple<at::Tensor>>()));

template <const GspoBackend& (*kBackend)()>
struct GspoOps {
  using Opt = std::optional<at::Tensor>;
  static GspoOutputsAndGrad forward(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv,
                                    const at::Tensor& old, const at::Tensor& doc, std::optional<int64_t> n_docs,
                                    const Opt& counts, double el, double eh, c10::string_view weighting,
                                    bool token_adv, std::optional<double> d, double s, bool entropy, const Opt& stats,
                                    const Opt& sums, int64_t vs, int64_t vn, bool compute_grad) {
    LogitsSource src("gspo", logits, target, vs, vn, compute_grad, false);
    auto o = gspo_forward(src, target, adv, old, doc, n_docs, counts, el, eh, std::string(weighting), token_adv, d, s,
                          entropy, stats, sums, kBackend());
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], src.grads()[0]};
  }
  static GspoOutputs forward_inplace(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& adv,
                                     const at::Tensor& old, const at::Tensor& doc, std::optional<int64_t> n_docs,
                                     const Opt& counts, double el, double eh, c10::string_view weighting,
                                     bool token_adv, std::optional<double> d, double s, bool entropy,
                                     const Opt& stats, const Opt& sums, int64_t vs, int64_t vn) {
    LogitsSource src("gspo", logits, target, vs, vn, false, true);
    auto o = gspo_forward(src, target, adv, old, doc, n_docs, counts, el, eh, std::string(weighting), token_adv, d, s,
                          entropy, stats, sums, kBackend());
    return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8]};
  }
};

// The back-end functions, written once over a device runner (CpuRunner / CudaRunner).
template <typename Runner>
struct GspoBackendImpl {
  template <typename acc_t>
  static ClipOptions<acc_t> clip_as(const ClipOptions<double>& c) {
    return {acc_t(c.epsilon_low), acc_t(c.epsilon_high), acc_t(c.delta)};
  }
  template <typename acc_t>
  static acc_t* ptr(const at::Tensor& t) {
    return t.defined() ? t.data_ptr<acc_t>() : nullptr;
  }
#define RL_LOSSES_DISPATCH_ACC(T, ...) AT_DISPATCH_FLOATING_TYPES(T.scalar_type(), "gspo", __VA_ARGS__)

  static void stats(const RowPassArgs& args, const at::Tensor& out) {
    Runner::row_pass(args, "gspo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return StoreStatsEpilogue<acc_t>{out.data_ptr<acc_t>()};
    });
  }
  static void grad(const RowPassArgs& args, const at::Tensor& coef) {
    Runner::row_pass(args, "gspo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return PolicyCoefEpilogue<acc_t>{coef.const_data_ptr<acc_t>()};
    });
  }
  static void log_probs(const at::Tensor& stats, const at::Tensor& mask, const at::Tensor& lp,
                        const at::Tensor& entropy) {
    RL_LOSSES_DISPATCH_ACC(stats, [&] {
      Runner::for_each(mask.numel(), GspoLogProbStep<scalar_t>{ptr<scalar_t>(stats), ptr<scalar_t>(mask),
                                                               ptr<scalar_t>(lp), ptr<scalar_t>(entropy)});
    });
  }
  static void documents(const ClipOptions<double>& clip, const at::Tensor& sums, const at::Tensor& out) {
    RL_LOSSES_DISPATCH_ACC(sums, [&] {
      Runner::for_each(sums.size(0), GspoDocumentStep<scalar_t>{clip_as<scalar_t>(clip), ptr<scalar_t>(sums),
                                                                ptr<scalar_t>(out)});
    });
  }
  static void tokens(const ClipOptions<double>& clip, const at::Tensor& sums, const at::Tensor& document,
                     const at::Tensor& mask, const at::Tensor& counts, const at::Tensor& advantages,
                     const at::Tensor& divisor, bool token_advantages, bool token_weighting, const at::Tensor& loss,
                     const at::Tensor& coef) {
    RL_LOSSES_DISPATCH_ACC(sums, [&] {
      Runner::for_each(mask.numel(), GspoTokenStep<scalar_t>{clip_as<scalar_t>(clip), ptr<scalar_t>(sums),
                                                             document.data_ptr<int64_t>(), ptr<scalar_t>(mask),
                                                             ptr<scalar_t>(counts), ptr<scalar_t>(advantages),
                                                             ptr<scalar_t>(divisor), token_advantages,
                                                             token_weighting, sums.size(0), ptr<scalar_t>(loss),
                                                             ptr<scalar_t>(coef)});
    });
  }
#undef RL_LOSSES_DISPATCH_ACC

  static constexpr GspoBackend backend() { return {&stats, &grad, &log_probs, &documents, &tokens}; }
};

}  // namespace rl_losses
