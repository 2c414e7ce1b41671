// The one pass over the vocabulary that every op is built from.
//
// For each row t of the flattened logits (N rows, V_loc columns of this rank's vocabulary shard):
//   1. statistics: online max / sum-exp / Σp·x / Σx of x = s·z, and the label's logit      (kStats)
//      — or, when they were computed before (tensor parallelism, GSPO), read from `stats_in`;
//   2. the op's epilogue turns the statistics into its per-row outputs and the gradient coefficients
//      (a, b, c, h) of dL/dx_j = a·p_j + c + b·[j = y] + h·p_j·log p_j  (math.h; h only where the epilogue
//      declares kMayUseEntropyGrad);
//   3. the gradient dL/dz_j = s·(that) is written once                                       (kGrad).
// CE and GRPO run 1-3 in one pass: one read of the logits from DRAM, one write of the gradient (on CUDA
// where a row fits a thread-block cluster's shared memory; split_stats_pass_on_cuda says what runs
// otherwise). GSPO runs 1, a per-document step, then 3. The CPU and CUDA back-ends implement this contract.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/math.h"

namespace rl_losses {

// Host-side description of one row pass. Tensors are already validated and 2-D (N, V_loc) / 1-D (N).
struct RowPassArgs {
  at::Tensor logits;    // (N, V_loc), any row stride, unit column stride
  at::Tensor target;    // (N,) int64 global label ids; negative = no label
  at::Tensor stats_in;  // (N, 5) accumulation dtype, or undefined: compute the statistics
  at::Tensor grad;      // (N, V_loc) unit column stride, or undefined: no gradient
  double scale = 1.0;   // logits_scale_factor s
  int64_t vocab_start = 0;   // global id of this shard's column 0
  int64_t vocab_total = 0;   // V of the whole vocabulary (label range check)
  bool entropy = false;      // accumulate Σp·x
  bool smoothing = false;    // accumulate Σx
  // Where a pass that computes the statistics also stores them, (N, 5) like stats_in, or undefined: the
  // fused lm_head's lean mode keeps each row's statistics for its passes over vocabulary blocks.
  at::Tensor stats_out;
  // The epilogue's index of row 0: the rows are a chunk of a larger batch (the fused-linear ops), whose
  // per-token arrays the epilogue indexes globally. Logits, target, stats_in, stats_out and grad are the chunk's.
  int64_t row_offset = 0;
  // (N,) fp32, or undefined: for fp16 logits whose gradient is computed in the forward and scaled in the
  // backward, each row's gradient is stored multiplied by 2^k and 2^-k goes here (GradRowPrescaled).
  at::Tensor grad_row_unscale;
  // (N,) int64, or undefined: the epilogue's index of each row, where the rows are not consecutive (the fused
  // lm_head's labelled rows, gathered); it replaces row_offset.
  at::Tensor row_index;
  // The sampler's distribution (common/sampler.h): sampler_params, the call's (N, 3) per-row options, or undefined;
  // logit_floor, (rows,) of the accumulation dtype, each row's floor, which the row source computes from them
  // for the rows of a pass. A logit below its row's floor counts as −inf in the statistics and gets a zero
  // gradient.
  at::Tensor sampler_params;
  at::Tensor logit_floor;
  // Whether a row's top_k may act (given, and not as the number 0): the CUDA selection's room for top_k's
  // candidates is allocated only then. Whether a row's top_p may act (given, and not as the number 1).
  bool sampler_top_k = false, sampler_top_p = false;
  // logit_floor undefined, and the pass computes each row's floor from sampler_params itself: min_p is the only
  // filter of the call and the CUDA cluster kernel runs the pass (sampler_floor_in_pass, common/sampler.h).
  bool min_p_in_pass = false;
  // The batch-invariant mode (common/batch_invariant.h), read once per call: each row reduced in one order,
  // whatever the batch and the pass shape (the CUDA back-end's kernel choice; the CPU's is already so).
  bool batch_invariant = false;

  bool compute_stats() const { return !stats_in.defined(); }
  bool write_grad() const { return grad.defined(); }
};

// The accumulation dtype of the per-row outputs for given logits: fp64 for fp64, fp32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType logits_dtype) {
  return logits_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

#ifdef RL_LOSSES_WITH_CUDA
// Whether the CUDA back-end runs this pass, statistics and gradient, as one kernel that reads each row once
// (the cluster kernel of common/cuda/cluster_kernel.cuh). Defined in common/row_stats_cuda.cu, so CUDA builds
// only.
bool cuda_fuses_row_pass(const RowPassArgs& args);
// The statistics pass alone into out (N, 5) (cuda_backends.h), for a pass with the sampler's floors, which the
// `row_stats` op does not take.
void row_stats_cuda(const RowPassArgs& args, const at::Tensor& out);
#endif

// The statistics of the pass's rows as a pass of their own (the `row_stats` op, on any device) into stats_in,
// where the epilogue needs more than they give before the gradient is written (topk_distillation's JSD).
inline void stats_pass_first(RowPassArgs& args) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("rl_losses::row_stats", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, bool,
                                               bool, bool)>();
  args.stats_in = op.call(args.logits, args.target, args.scale, args.vocab_start, args.vocab_total, args.entropy,
                          args.smoothing, /*tp_blocks=*/false);
}

#ifdef RL_LOSSES_WITH_CUDA
// The statistics of a pass with the sampler's floors (which the `row_stats` op does not take) as a launch of their
// own into args.stats_in: of the pass's own rows, as the `row_stats` op's.
inline void floor_stats_pass_first(RowPassArgs& args) {
  RowPassArgs stats_pass = args;
  stats_pass.grad = at::Tensor();
  stats_pass.row_offset = 0;
  stats_pass.row_index = at::Tensor();
  args.stats_in = at::empty({args.logits.size(0), RowStats<float>::kFields},
                            args.logits.options().dtype(acc_dtype(args.logits.scalar_type())));
  row_stats_cuda(stats_pass, args.stats_in);
}
#endif

// On CUDA, a loss that needs its gradient runs the statistics and the gradient in one kernel where
// cuda_fuses_row_pass says so. Elsewhere (rows too long for a cluster's shared memory, unaligned rows, a
// device older than sm_90) it runs the statistics pass as its own kernel first, then the epilogue and the
// gradient in a second one (as tensor parallelism does): one block per row re-reading its row for the
// gradient misses L2 and measured 1.6x slower than this split on an H100 (7.3 vs 4.7 ms at N=16384,
// V=128256 bf16; docs/design.md). The CPU keeps the fused pass (a row stays in its cache).
inline void split_stats_pass_on_cuda(RowPassArgs& args) {
  if (!args.logits.is_cuda() || !args.write_grad() || !args.compute_stats()) return;
#ifdef RL_LOSSES_WITH_CUDA
  if (cuda_fuses_row_pass(args)) return;
  if (args.logit_floor.defined()) return floor_stats_pass_first(args);
#endif
  stats_pass_first(args);
}

// Raw view the kernels see: plain pointers and sizes, no torch types.
template <typename scalar_t, typename label_t, typename acc_t>
struct RowPassView {
  const scalar_t* logits;
  int64_t row_stride;
  const label_t* target;
  const acc_t* stats_in;
  scalar_t* grad;
  int64_t grad_row_stride;
  int64_t n_rows;
  int64_t vocab;  // V_loc
  int64_t vocab_start;
  int64_t vocab_total;
  int64_t row_offset;
  const int64_t* row_index;  // or null
  acc_t* stats_out;          // or null
  const acc_t* floor;        // (n_rows,) or null: the sampler's floor of each row
  // (rows of the whole call, 3) or null: the sampler's options by the epilogue's row index, where the pass
  // computes the floor (min_p_in_pass)
  const float* sampler_params;
  acc_t scale;

  // The index the epilogue (and every per-token array it reads) knows the row by.
  C10_HOST_DEVICE int64_t epilogue_row(int64_t row) const {
    return row_index != nullptr ? row_index[row] : row + row_offset;
  }
};

template <typename scalar_t, typename label_t, typename acc_t>
inline RowPassView<scalar_t, label_t, acc_t> make_view(const RowPassArgs& a) {
  RowPassView<scalar_t, label_t, acc_t> v;
  v.logits = a.logits.const_data_ptr<scalar_t>();
  v.row_stride = a.logits.stride(0);
  v.target = a.target.const_data_ptr<label_t>();
  v.stats_in = a.stats_in.defined() ? a.stats_in.const_data_ptr<acc_t>() : nullptr;
  v.grad = a.grad.defined() ? a.grad.data_ptr<scalar_t>() : nullptr;
  v.grad_row_stride = a.grad.defined() ? a.grad.stride(0) : 0;
  v.n_rows = a.logits.size(0);
  v.vocab = a.logits.size(1);
  v.vocab_start = a.vocab_start;
  v.vocab_total = a.vocab_total;
  v.row_offset = a.row_offset;
  v.row_index = a.row_index.defined() ? a.row_index.const_data_ptr<int64_t>() : nullptr;
  v.stats_out = a.stats_out.defined() ? a.stats_out.data_ptr<acc_t>() : nullptr;
  v.floor = a.logit_floor.defined() ? a.logit_floor.const_data_ptr<acc_t>() : nullptr;
  v.sampler_params = a.min_p_in_pass ? a.sampler_params.const_data_ptr<float>() : nullptr;
  v.scale = static_cast<acc_t>(a.scale);
  return v;
}

// Every epilogue declares which optional statistics it can consume (kMayUseEntropy, kMayUseSmoothing), whether
// its gradient may have the entropy term h·p·log p (kMayUseEntropyGrad: one more FMA per element in the
// gradient loops, compiled only for such epilogues), and in which pass shapes it is used — with statistics
// read from `stats_in` (kMayReadStats), with a gradient (kMayWriteGrad) — so that only those kernel variants
// are compiled. kSkipsUnlabelled: for a row with
// label < 0 it uses no statistics and returns a zero gradient, so a pass that computes the statistics may
// skip reading that row and pass RowStats::empty() (the CPU pass and both CUDA kernels do; the separate
// `row_stats` op, used by the split path and tensor parallelism, reads every row). `go` is called with
// std::true_type/false_type flags.

// Whether an epilogue's ops take the sampler's options (kMaySample; false where not declared): only those get
// the CUDA kernel variants that read a floor.
template <typename Epi, typename = void>
struct MaySample : std::false_type {};
template <typename Epi>
struct MaySample<Epi, std::void_t<decltype(Epi::kMaySample)>> : std::bool_constant<Epi::kMaySample> {};

template <typename Epi, typename Go>
void dispatch_stat_flags(const RowPassArgs& args, Go&& go) {
  using T = std::true_type;
  using F = std::false_type;
  TORCH_CHECK(!args.entropy || Epi::kMayUseEntropy, "rl_losses: internal error: entropy not supported here");
  TORCH_CHECK(!args.smoothing || Epi::kMayUseSmoothing, "rl_losses: internal error: smoothing not supported here");
  if constexpr (Epi::kMayUseEntropy && Epi::kMayUseSmoothing) {
    if (args.entropy && args.smoothing) return go(T{}, T{});
  }
  if constexpr (Epi::kMayUseEntropy) {
    if (args.entropy) return go(T{}, F{});
  }
  if constexpr (Epi::kMayUseSmoothing) {
    if (args.smoothing) return go(F{}, T{});
  }
  return go(F{}, F{});
}

// Row `row` of an (N, 5) statistics tensor: max, sumexp, sum_px, sum_x, label.
template <typename acc_t>
C10_HOST_DEVICE inline RowStats<acc_t> load_stats(const acc_t* stats, int64_t row) {
  const acc_t* s = stats + row * RowStats<acc_t>::kFields;
  return {s[0], s[1], s[2], s[3], s[4]};
}
template <typename acc_t>
C10_HOST_DEVICE inline void store_stats(acc_t* stats, int64_t row, const RowStats<acc_t>& st) {
  acc_t* o = stats + row * RowStats<acc_t>::kFields;
  o[0] = st.max;
  o[1] = st.sumexp;
  o[2] = st.sum_px;
  o[3] = st.sum_x;
  o[4] = st.label;
}

// Epilogue that stores the raw statistics (N, 5): max, sumexp, sum_px, sum_x, label. Used by the
// statistics-only pass (tensor-parallel forward, GSPO pass 1). No gradient. kLabelledOnly: a row with
// label < 0 is not read and gets RowStats::empty(), for a caller that uses no statistics of such rows.
template <typename acc_t, bool kLabelledOnly = false>
struct StoreStatsEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = true;
  static constexpr bool kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = false, kMayWriteGrad = false, kSkipsUnlabelled = kLabelledOnly;
  static constexpr bool kMaySample = true;
  acc_t* out;
  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t /*label*/, const RowStats<acc_t>& st) const {
    store_stats(out, row, st);
    return {acc_t(0), acc_t(0), acc_t(0)};
  }
};

// Epilogue for a gradient pass whose per-row coefficients were computed elsewhere (GSPO): the gradient is
// coef_t·(p − onehot), i.e. (a, b, c) = (coef, −coef, 0), plus an entropy bonus's h_t·p·(log p + H_t) where
// `entropy_h` (h_t) and `entropy` (H_t) are given.
// kEntropyBonus: compiled with the entropy term (one more FMA per logit), only where entropy_h is given.
template <typename acc_t, bool kEntropyBonus = false>
struct PolicyCoefEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = false, kMayUseEntropyGrad = kEntropyBonus;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true, kSkipsUnlabelled = false, kMaySample = true;
  const acc_t* coef;
  const acc_t* entropy_h = nullptr;  // (N,) or null
  const acc_t* entropy = nullptr;    // (N,) when entropy_h is given
  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t, const RowStats<acc_t>&) const {
    const acc_t c = coef[row];
    if (entropy_h == nullptr) return {c, -c, acc_t(0), acc_t(0)};
    const acc_t h = entropy_h[row];
    return {c + h * entropy[row], -c, acc_t(0), h};
  }
};

// The power of two 2^k by which a fp16 row's gradient is stored, chosen from its coefficients: the gradient
// s·(a·p_j + c + b·[j = y] + h·p_j·log p_j) is bounded by B = s·(|a| + |b| + |c| + |h|/e) (p ≤ 1,
// |p·log p| ≤ 1/e), and B·2^k lands in [2^14, 2^15), below fp16's largest finite value (65504). A gradient
// computed for an upstream gradient of 1 is small (1/D per token), so that rounded to fp16 as it is, its small
// values would be subnormal or zero before a loss scale multiplies them in the backward; stored pre-scaled they
// keep fp16's full precision, and the backward (_scale_grad_) multiplies by g·2^-k in fp32 and rounds once more.
// k = 0 for a zero (masked) row and for a bound that is not finite. Exponents are read and built from the float's
// bits (frexp/ldexp's general paths cost registers the kernels' epilogue thread does not have).
// `extra`: a bound on what the op writes over the row pass's gradient afterwards (HasExtraGradBound).
C10_HOST_DEVICE inline int fp16_grad_row_exponent(const GradCoef<float>& c, float scale, float extra = 0.f) {
  const float bound =
      ::fabsf(scale) * (::fabsf(c.a) + ::fabsf(c.b) + ::fabsf(c.c) + ::fabsf(c.h) * 0.36787944f + extra);
  if (!(bound > 0.f) || !(bound <= std::numeric_limits<float>::max())) return 0;
  uint32_t bits;
  memcpy(&bits, &bound, sizeof(bits));
  const int e = static_cast<int>(bits >> 23) - 126;  // bound < 2^e (a normal bound also ≥ 2^(e-1))
  return std::min(std::max(15 - e, -100), 100);       // 2^±100: normal floats
}

// 2^k as a float, for |k| ≤ 126.
C10_HOST_DEVICE inline float exp2_of_int(int k) {
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

// An epilogue whose op writes more gradient values after the row pass (topk distillation's values at the
// teacher's ids) declares `extra_grad_bound(row)`, a bound on them before the factor s, which it knows once it has
// run for that row; the pre-scaling's exponent covers them too.
template <typename Epi, typename = void>
struct HasExtraGradBound : std::false_type {};
template <typename Epi>
struct HasExtraGradBound<Epi, std::void_t<decltype(std::declval<const Epi&>().extra_grad_bound(int64_t(0)))>>
    : std::true_type {};

// The epilogue of a fp16 gradient pass whose gradient is scaled in the backward: the wrapped epilogue's
// coefficients times 2^k (fp16_grad_row_exponent), exact in fp32, and 2^-k in row_unscale[row] (the row as the
// epilogue indexes it). With row_unscale null it is the wrapped epilogue. prescaled_epilogue applies it.
template <typename Epi>
struct GradRowPrescaled {
  static constexpr bool kMayUseEntropy = Epi::kMayUseEntropy, kMayUseSmoothing = Epi::kMayUseSmoothing;
  static constexpr bool kMayUseEntropyGrad = Epi::kMayUseEntropyGrad, kMayReadStats = Epi::kMayReadStats;
  static constexpr bool kMayWriteGrad = Epi::kMayWriteGrad, kSkipsUnlabelled = Epi::kSkipsUnlabelled;
  static constexpr bool kMaySample = MaySample<Epi>::value;
  Epi epi;
  float* row_unscale;
  float scale;
  C10_HOST_DEVICE GradCoef<float> operator()(int64_t row, int64_t label, const RowStats<float>& st) const {
    const GradCoef<float> c = epi(row, label, st);
    if (row_unscale == nullptr) return c;
    float extra = 0.f;
    if constexpr (HasExtraGradBound<Epi>::value) extra = epi.extra_grad_bound(row);
    const int k = fp16_grad_row_exponent(c, scale, extra);
    row_unscale[row] = exp2_of_int(-k);
    const float f = exp2_of_int(k);
    return {c.a * f, c.b * f, c.c * f, c.h * f};
  }
};

// The epilogue a back-end runs for logits of type scalar_t: GradRowPrescaled for fp16 gradient passes (its
// pointer null unless args.grad_row_unscale is given), the op's own epilogue otherwise. bf16 and fp32 share
// fp32's exponent range and need no pre-scaling.
template <typename scalar_t, typename Epi>
auto prescaled_epilogue(const RowPassArgs& args, const Epi& epi) {
  if constexpr (std::is_same_v<scalar_t, c10::Half> && Epi::kMayWriteGrad) {
    float* unscale = args.write_grad() && args.grad_row_unscale.defined() ? args.grad_row_unscale.data_ptr<float>()
                                                                           : nullptr;
    return GradRowPrescaled<Epi>{epi, unscale, static_cast<float>(args.scale)};
  } else {
    return epi;
  }
}

// A reduction for a runner's sum_then (CpuRunner, CudaRunner): kTerms values per index i, `terms(i, v)`,
// summed over i; then `finish(sums)` once, on the device. It replaces a column sum and the small ops after
// it, each a kernel launch of its own.
//
// The labelled-token count (target >= 0), at least 1, so that an all-masked batch gives 0 rather than 0/0.
template <typename T>
struct LabelledCount {
  using acc_t = T;
  static constexpr int kTerms = 1;
  const int64_t* target;
  acc_t* out;  // 0-dim
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const { v[0] = target[i] >= 0 ? acc_t(1) : acc_t(0); }
  C10_HOST_DEVICE void finish(const acc_t* s) const { *out = at_least_one(s[0]); }
};

// The sum of a 1-D tensor (checks.h, sum_1d).
template <typename T>
struct SumOf {
  using acc_t = T;
  static constexpr int kTerms = 1;
  const T* x;
  acc_t* out;  // 0-dim
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const { v[0] = x[i]; }
  C10_HOST_DEVICE void finish(const acc_t* s) const { *out = s[0]; }
};

// The scalar results of GRPO and GSPO (docs/math.md), written by their finishing reductions: 0-dim tensors of the
// accumulation dtype, and their pointers for the device. The policy family's (docs/policy_losses.md): the mean KL
// estimate towards ref_log_probs, and over the labelled tokens the mean rollout ratio ρ, the mean correction weight
// and the fraction of tokens whose weight was truncated or masked; the mean VESPO weight over the sequences (0 for
// the other loss types). policy_results (common/policy.h) names them.
enum PolicyScalar : int { kPolicyLoss = 0, kPolicyNewLogProbs, kPolicyClipLow, kPolicyClipHigh, kPolicyKlOld,
                          kPolicyEntropy, kPolicyRatioMean, kPolicyKl, kPolicyRolloutRatio, kPolicyRolloutWeight,
                          kPolicyRolloutCorrected, kPolicyVespoPhi, kPolicyScalars };
// Null where the call does not return the scalar (PolicyScalarOutputs): set() skips it.
template <typename acc_t>
struct PolicyScalarPtrs {
  acc_t* p[kPolicyScalars];
  C10_HOST_DEVICE void set(int k, acc_t value) const {
    if (p[k] != nullptr) *p[k] = value;
  }
};

// at::empty(sizes, options) without the trip through the dispatcher (at::detail::empty_cpu / empty_cuda; the
// fill of uninitialised memory under torch.use_deterministic_algorithms is left out: for buffers the call writes
// whole). A call's small outputs and scratch buffers, a dozen and more per policy op, are most of its allocations
// (checks.cpp).
at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options);
// Scratch buffers of one dtype and device that live as long as the call and never leave it, in one allocation
// (new_empty): each a contiguous tensor over its own piece, starting on a 64-byte boundary. (A returned output stays
// a tensor of its own: a custom op's outputs must not alias one another.)
std::vector<at::Tensor> new_scratch(const at::TensorOptions& options,
                                    std::initializer_list<std::initializer_list<int64_t>> shapes);

// Which scalars a call returns: each of those its own tensor, the others (the metrics of an option that is off,
// policy_metrics_on) undefined and not written (a null pointer: each output costs a CUDA host ~3.7 us to allocate
// and wrap, and a buffer for those not returned one allocation more: docs/host_time.md).
struct PolicyScalarOutputs {
  at::Tensor t[kPolicyScalars];
  PolicyScalarOutputs(const at::TensorOptions& options, const std::array<bool, kPolicyScalars>& returned) {
    for (int k = 0; k < kPolicyScalars; ++k) {
      if (returned[k]) t[k] = new_empty({}, options);
    }
  }
  template <typename acc_t>
  PolicyScalarPtrs<acc_t> ptrs() const {
    PolicyScalarPtrs<acc_t> out;
    for (int k = 0; k < kPolicyScalars; ++k) out.p[k] = t[k].defined() ? t[k].data_ptr<acc_t>() : nullptr;
    return out;
  }
};

// The O(N + S) steps between and after an op's row passes, as a runner's chain(steps...) takes them: each step sees
// what the steps before it wrote. A runner runs them one by one (its for_each, sum_rows_by_index and sum_then); the
// CUDA runner runs a short chain as one single-block launch instead (cuda/block_steps.cuh): at small shapes a call's
// host time is mostly its launches (docs/host_time.md).
template <typename F>
struct ForEachStep {  // f(i) for i in [0, n)
  int64_t n;
  F f;
};
template <int K, typename T>
struct SumByIndexStep {  // out[index[i], :] = Σ values[i, :] over the i with that index ((S, K) and (N, K) of T)
  at::Tensor values, index, out;
};
template <typename R>
struct SumThenStep {  // r.finish(Σ_{i < n} r.terms(i))
  int64_t n;
  R r;
};
template <typename F>
ForEachStep<F> for_each_step(int64_t n, F f) {
  return {n, f};
}
template <typename R>
SumThenStep<R> sum_then_step(int64_t n, R r) {
  return {n, r};
}
// One step by a runner's own functions (its for_each, sum_rows_by_index, sum_then): CpuRunner's chain, and
// CudaRunner's where the chain is not one launch.
template <typename Runner, typename F>
void run_step(const ForEachStep<F>& s) {
  Runner::for_each(s.n, s.f);
}
template <typename Runner, int K, typename T>
void run_step(const SumByIndexStep<K, T>& s) {
  Runner::template sum_rows_by_index<K>(s.values, s.index, s.out);
}
template <typename Runner, typename R>
void run_step(const SumThenStep<R>& s) {
  Runner::sum_then(s.n, s.r);
}
// Runner::chain over a tuple of steps (an op composes its chain from the options that are on).
template <typename Runner, typename... Steps>
void run_chain(const std::tuple<Steps...>& steps) {
  std::apply([](const auto&... s) { Runner::chain(s...); }, steps);
}

// out[i] = value for i < n: a fill as a step of a chain (no launch of its own).
template <typename T>
struct FillWith {
  T* out;
  T value;
  C10_HOST_DEVICE void operator()(int64_t i) const { out[i] = value; }
};

// out[index[i], :] = Σ values[i, :] over the i with that index, by ATen: the CPU runner's sum_rows_by_index
// (index_add_ on the CPU adds the rows in order, so an index's sum depends on its own rows alone).
inline void sum_rows_by_index_aten(const at::Tensor& values, const at::Tensor& index, const at::Tensor& out) {
  out.zero_().index_add_(0, index, values);
}

// Dispatch over the logits dtype: fp32/bf16/fp16, and fp64 (reference-grade tests; fp32 math becomes fp64).
// (AT_DISPATCH needs a literal name; the ops' own checks have already named the argument.)
#define RL_LOSSES_DISPATCH_LOGITS(DTYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, DTYPE, "rl_losses", __VA_ARGS__)

}  // namespace rl_losses
