// The sampler's distribution (docs/consistency.md): each row's softmax renormalised over the tokens an inference
// engine's sampler keeps, in vLLM's order — min_p (p_j ≥ min_p · p_max), then top_k (the k largest, a tie with the
// k-th kept), then top_p over what is left (the largest tokens while the mass above them is < top_p; the most
// probable token always kept). Every such set is an upper set of the row's values, so a row's kept set is one
// number, its *floor*: the smallest kept logit, lowered to the label's logit where the label would fall outside
// (the sampled token is in the engine's kept set; trainer and engine logits may differ at the edge). The row pass
// then reads a logit z < floor as −inf in its statistics and writes a zero gradient there (row_pass.h).
//
// The floor's math is here, once, for the CPU loop (sampler.cpp) and the CUDA kernel (sampler_cuda.cu); both take
// the top_p masses in fixed point (2^-24 units, integer sums: the same decision whatever the summation order).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

#include "common/math.h"
#include "common/schema.h"

namespace rl_losses {

// The options as the schemas list them (op_args.h: RL_LOSSES_SAMPLER).
struct SamplerArgs;

// One row's options: top_k (0: off), top_p (1: off), min_p (0: off). The kernels read them from a (N, 3) fp32
// tensor of the call's rows, in this order.
enum SamplerColumn : int { kSamplerTopK = 0, kSamplerTopP, kSamplerMinP, kSamplerColumns };

struct RowPassArgs;
// The per-row options of a call, validated, into args.sampler_params: (N, 3) fp32 on the logits' device, or
// undefined where no option is given (no filtering, no cost); and args.sampler_top_k: whether top_k may act.
// `row_stats_given`: the call's statistics come from elsewhere (tensor parallelism), which the options refuse.
void set_sampler_params(RowPassArgs& args, const char* op, const SamplerArgs& a, const at::Tensor& target,
                        int64_t n_rows, const at::TensorOptions& device, bool row_stats_given);

// Whether the row pass of `args` (its gradient buffer set) computes each row's floor itself: min_p is the call's only
// filter and the CUDA cluster kernel runs the pass (common/cuda/cluster_sampler.cuh). Then it sets
// args.min_p_in_pass. Refuses a vocabulary shard, as sampler_floor does.
bool sampler_floor_in_pass(const char* op, RowPassArgs& args);

// (rows,) of the accumulation dtype: each row's floor (−inf: nothing filtered), for the rows of args.logits, whose
// options are rows `args.row_index` (or row_offset + r) of `params`. Refuses a vocabulary shard: the kept set
// needs the whole row.
at::Tensor sampler_floor(const char* op, const RowPassArgs& args, const at::Tensor& params);

// A token's top_p mass e^(s·z − s·max) ∈ [0, 1] in units of 2^-24 (below one unit: 0, never kept by top_p); the
// sums of a row fit 64 bits.
constexpr double kSamplerMassUnit = 16777216.0;  // 2^24
template <typename T>
C10_HOST_DEVICE inline uint32_t sampler_mass(T e) {
  return static_cast<uint32_t>(static_cast<double>(e) * kSamplerMassUnit);
}

// One row's options, read from its params row: which filters act.
template <typename T>
struct SamplerRow {
  T top_k, top_p, min_p;
  C10_HOST_DEVICE explicit SamplerRow(const float* params)
      : top_k(params[kSamplerTopK]), top_p(params[kSamplerTopP]), min_p(params[kSamplerMinP]) {}
  C10_HOST_DEVICE bool k_acts(int64_t vocab) const { return top_k > T(0) && top_k < T(vocab); }
  C10_HOST_DEVICE bool p_acts() const { return top_p < T(1); }
  C10_HOST_DEVICE bool min_p_acts() const { return min_p > T(0); }
  // min_p keeps a token whose e^(x − max) ≥ min_p (p_j ≥ min_p · p_max).
  C10_HOST_DEVICE bool min_p_keeps(T e) const { return e >= min_p; }
  // Whether min_p may keep a logit of a group whose max has e^(x − max) = e: the CUDA kernels skip the other groups,
  // judged with a margin (the exponential's rounding need not be monotone; a group read for nothing costs only that).
  C10_HOST_DEVICE bool min_p_may_keep(T e) const { return e >= min_p * T(0.999); }
  // top_p keeps the tokens whose mass strictly above them is below top_p · Z (Z: the mass left by min_p and top_k).
  C10_HOST_DEVICE bool p_keeps(uint64_t mass_above, uint64_t total) const {
    return static_cast<double>(mass_above) < static_cast<double>(top_p) * static_cast<double>(total);
  }
};

// The label's logit lowers the floor (see above); a row without a label here keeps its floor.
template <typename T>
C10_HOST_DEVICE inline T floor_with_label(T floor, bool has_label, T z_label) {
  return has_label && z_label < floor ? z_label : floor;
}

}  // namespace rl_losses
