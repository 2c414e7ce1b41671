// DPO over packed documents (docs/distillation_dpo.md): each document (a run of tokens sharing a
// document_index) is the chosen or the rejected response of one pair, `pairs` (P, 2) = (chosen, rejected)
// document ids, and every document is in exactly one pair. Per document s, π_s = Σ_{t ∈ s, labelled} lp_t;
// per pair k, h_k = β·((π_c − ref_c) − (π_r − ref_r)) and L = −Σ_k log σ(h_k) / D (D = P by default).
//
// The passes are GSPO's: the statistics row pass, the per-token log-probs summed per document, a per-pair step
// (loss, metrics, each document's gradient factor), the per-token coefficient, then the gradient pass
// coef_t·(p − onehot) (PolicyCoefEpilogue), which reads the logits again.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <limits>
#include <optional>
#include <tuple>

#include "common/row_pass.h"
#include "common/row_source.h"
#include "op_args.h"

namespace rl_losses {

// log σ(h) without overflow: −softplus(−h).
template <typename T>
C10_HOST_DEVICE inline T log_sigmoid(T h) {
  return h >= T(0) ? -::log1p(::exp(-h)) : h - ::log1p(::exp(h));
}
template <typename T>
C10_HOST_DEVICE inline T sigmoid(T h) {
  return h >= T(0) ? T(1) / (T(1) + ::exp(-h)) : ::exp(h) / (T(1) + ::exp(h));
}

// Per token: lp_t = x_y − lse for a labelled token of a document (0 otherwise), and its document (padding to
// document 0, with a zero term).
template <typename acc_t>
struct DpoTokenLogProbs {
  const acc_t* stats;  // (N, 5)
  const int64_t* target;
  const int64_t* document;
  int64_t num_documents;
  acc_t* log_probs;       // (N,)
  int64_t* safe_document;  // (N,)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const int64_t s = document[i];
#if defined(__CUDA_ARCH__)
    CUDA_KERNEL_ASSERT(s < num_documents && "rl_losses: a document index is >= 2 * number of pairs");
#endif
    const bool on = target[i] >= 0 && s >= 0;
    const RowStats<acc_t> st = load_stats(stats, i);
    log_probs[i] = on ? st.log_prob(st.label) : acc_t(0);
    safe_document[i] = s >= 0 ? s : 0;
  }
};

// Columns of the per-pair outputs, summed for the scalar outputs.
enum DpoPairField : int { kDpoLoss = 0, kDpoRewardChosen, kDpoRewardRejected, kDpoCorrect, kDpoPairFields };

// Per pair: its loss share −log σ(h)/D, the rewards β(π − ref) of both sides, whether chosen wins, and each
// document's gradient factor −∂L/∂π_s (the coefficient of (p − onehot) for its tokens).
template <typename acc_t>
struct DpoPairStep {
  acc_t beta;
  const int64_t* pairs;  // (P, 2)
  const acc_t* ref_chosen;
  const acc_t* ref_rejected;
  const acc_t* document_sums;  // (S,) π_s
  acc_t divisor;               // D (given, or the number of pairs: known on the host)
  acc_t* out;                  // (P, kDpoPairFields)
  acc_t* document_coef;        // (S,)
  int64_t num_documents;       // 2P
  C10_HOST_DEVICE void operator()(int64_t k) const {
    const int64_t c = pairs[2 * k], r = pairs[2 * k + 1];
#if defined(__CUDA_ARCH__)  // pairs checked on the host never reach this unchecked (dpo_forward)
    CUDA_KERNEL_ASSERT(c >= 0 && c < num_documents && r >= 0 && r < num_documents &&
                       "rl_losses: pairs holds a document id outside 0 .. 2 * number of pairs - 1");
#endif
    const acc_t reward_c = beta * (document_sums[c] - ref_chosen[k]);
    const acc_t reward_r = beta * (document_sums[r] - ref_rejected[k]);
    const acc_t h = reward_c - reward_r;
    const acc_t inv_d = acc_t(1) / divisor;
    acc_t* o = out + k * kDpoPairFields;
    o[kDpoLoss] = -log_sigmoid(h) * inv_d;
    o[kDpoRewardChosen] = reward_c;
    o[kDpoRewardRejected] = reward_r;
    o[kDpoCorrect] = h > acc_t(0) ? acc_t(1) : acc_t(0);
    // ∂L/∂π_c = −β·σ(−h)/D, ∂L/∂π_r = +β·σ(−h)/D; the gradient w.r.t. x is −∂L/∂lp·(p − onehot).
    const acc_t g = beta * sigmoid(-h) * inv_d;
    document_coef[c] = g;
    document_coef[r] = -g;
  }
};

// Pairs not checked on the host: 2P ids in range that leave no document unclaimed pair every document exactly
// once, so a document whose factor is still the NaN it started with reveals a document paired twice.
template <typename acc_t>
struct DpoPairCoverage {
  const acc_t* document_coef;  // (S,)
  C10_HOST_DEVICE void operator()(int64_t s) const {
#if defined(__CUDA_ARCH__)
    CUDA_KERNEL_ASSERT(document_coef[s] == document_coef[s] &&
                       "rl_losses: a document is in no pair of pairs (and another is in two)");
#else
    (void)s;
#endif
  }
};

template <typename acc_t>
struct DpoTokenCoef {
  const int64_t* target;
  const int64_t* document;
  const acc_t* document_coef;
  acc_t* coef;  // (N,)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const int64_t s = document[i];
    coef[i] = target[i] >= 0 && s >= 0 ? document_coef[s] : acc_t(0);
  }
};

// The scalar outputs over the pairs: loss, and the means of the chosen and rejected rewards, the accuracy and the
// margin (TRL's metrics).
template <typename T>
struct DpoMetrics {
  using acc_t = T;
  static constexpr int kTerms = kDpoPairFields;
  const acc_t* out;  // (P, kDpoPairFields)
  int64_t num_pairs;
  acc_t* dst[5];  // 0-dim each: loss, rewards/chosen, rewards/rejected, accuracy, margin
  C10_HOST_DEVICE void terms(int64_t k, acc_t* v) const {
    for (int i = 0; i < kTerms; ++i) v[i] = out[k * kDpoPairFields + i];
  }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    const acc_t n = at_least_one(static_cast<acc_t>(num_pairs));
    *dst[0] = s[kDpoLoss];
    *dst[1] = s[kDpoRewardChosen] / n;
    *dst[2] = s[kDpoRewardRejected] / n;
    *dst[3] = s[kDpoCorrect] / n;
    *dst[4] = (s[kDpoRewardChosen] - s[kDpoRewardRejected]) / n;
  }
};

// Everything between the passes.
struct DpoState {
  double beta;
  int64_t num_pairs, num_documents;
  bool pairs_checked;  // on the host; otherwise by the pair steps on the device
  double divisor;  // D
  at::Tensor stats, target, document, pairs, ref_chosen, ref_rejected;
  at::Tensor log_probs, safe_document, document_sums, pair_out, document_coef, coef;
  at::Tensor scalars[5];  // 0-dim: loss, rewards_chosen, rewards_rejected, accuracy, margin
};

struct DpoBackend {
  void (*stats)(const RowPassArgs&, const at::Tensor& out);
  void (*grad)(const RowPassArgs&, const at::Tensor& coef);
  void (*steps)(DpoState&);  // log-probs, document sums, pair step, token coefficients, metrics
};

// dpo's arguments but the logits (op_args.h).
#define RL_LOSSES_DPO_ARGS(X) RL_LOSSES_DPO_INPUT(X) RL_LOSSES_DPO_KEYWORDS(X)
RL_LOSSES_ARG_GROUP(DpoArgs, RL_LOSSES_DPO_ARGS)
RL_LOSSES_RESULT_GROUP(DpoResults, RL_LOSSES_DPO_RESULTS)

// The results: loss, rewards_chosen, rewards_rejected, accuracy, margin (0-dim), log_probs (batch shape),
// document_log_probs (2P,); the gradient, when asked, is the source's. Tensor parallelism: `row_stats` are the
// statistics all-reduced over the vocabulary shards (the op then reads its shard once, for the gradient), and
// the source's vocab_start / vocab_size place the shard in the vocabulary.
DpoResults dpo_forward(RowSource& src, const at::Tensor& target, const DpoArgs& a, const OptTensor& row_stats,
                       const DpoBackend& backend);

// The loss of the registered kernels (common/loss_kernels.h), given a back-end.
template <const DpoBackend& (*kBackend)()>
struct DpoLoss {
  static constexpr const char* kName = "dpo";
  static DpoResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool /*logits_op*/) {
    return dpo_forward(src, target, args.read<DpoArgs>(), args.read<RowStatsArg>().row_stats, kBackend());
  }
};

// The back-end, written once over a device runner (CpuRunner / CudaRunner).
template <typename Runner>
struct DpoBackendImpl {
  // The row step uses no statistics of an unlabelled token, so such rows are not read.
  static void stats(const RowPassArgs& args, const at::Tensor& out) {
    Runner::row_pass(args, "dpo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return StoreStatsEpilogue<acc_t, true>{out.data_ptr<acc_t>()};
    });
  }
  static void grad(const RowPassArgs& args, const at::Tensor& coef) {
    Runner::row_pass(args, "dpo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return PolicyCoefEpilogue<acc_t>{coef.const_data_ptr<acc_t>()};
    });
  }
  // One chain (a runner's chain()): unchecked pairs first mark every document unclaimed (NaN, DpoPairCoverage).
  static void steps(DpoState& g) {
    AT_DISPATCH_FLOATING_TYPES(g.stats.scalar_type(), "dpo", [&] {
      using T = scalar_t;
      const int64_t n = g.target.numel();
      const auto sums = std::make_tuple(
          for_each_step(n, DpoTokenLogProbs<T>{g.stats.const_data_ptr<T>(), g.target.const_data_ptr<int64_t>(),
                                               g.document.const_data_ptr<int64_t>(), g.num_documents,
                                               g.log_probs.data_ptr<T>(), g.safe_document.data_ptr<int64_t>()}),
          SumByIndexStep<1, T>{g.log_probs.view({n, 1}), g.safe_document,
                               g.document_sums.view({g.num_documents, 1})},
          for_each_step(g.num_pairs,
                        DpoPairStep<T>{static_cast<T>(g.beta), g.pairs.const_data_ptr<int64_t>(),
                                       g.ref_chosen.const_data_ptr<T>(), g.ref_rejected.const_data_ptr<T>(),
                                       g.document_sums.const_data_ptr<T>(), static_cast<T>(g.divisor),
                                       g.pair_out.data_ptr<T>(), g.document_coef.data_ptr<T>(), g.num_documents}));
      DpoMetrics<T> metrics{g.pair_out.const_data_ptr<T>(), g.num_pairs, {}};
      for (int k = 0; k < 5; ++k) metrics.dst[k] = g.scalars[k].data_ptr<T>();
      const auto coef = std::make_tuple(
          for_each_step(n, DpoTokenCoef<T>{g.target.const_data_ptr<int64_t>(), g.document.const_data_ptr<int64_t>(),
                                           g.document_coef.const_data_ptr<T>(), g.coef.data_ptr<T>()}),
          sum_then_step(g.num_pairs, metrics));
      if (g.pairs_checked) {
        run_chain<Runner>(std::tuple_cat(sums, coef));
      } else {
        T* doc_coef = g.document_coef.data_ptr<T>();
        run_chain<Runner>(std::tuple_cat(
            std::make_tuple(for_each_step(g.num_documents, FillWith<T>{doc_coef, std::numeric_limits<T>::quiet_NaN()})),
            sums, std::make_tuple(for_each_step(g.num_documents, DpoPairCoverage<T>{doc_coef})), coef));
      }
    });
  }
  static constexpr DpoBackend backend() { return {&stats, &grad, &steps}; }
};

}  // namespace rl_losses
