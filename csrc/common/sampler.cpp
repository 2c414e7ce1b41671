// The sampler's options checked and laid out per row, and each row's floor on the CPU (common/sampler.h).
#include "common/sampler.h"

#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

#include "common/checks.h"
#include "common/cuda_backends.h"
#include "op_args.h"

namespace rl_losses {

namespace {

// One option: a 0-dim tensor (every row) or one value per row shaped like the target; values in [lo, hi]
// (lo excluded where `open_low`). Reading a device tensor's values synchronises once; a 0-dim CPU tensor (what
// the Python wrappers pass for a number) does not.
at::Tensor sampler_column(const char* op, const char* name, const OptTensor& t, const at::Tensor& target,
                          int64_t n_rows, bool integral, double lo, double hi, bool open_low, float off) {
  if (!t) return at::full({n_rows}, off, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor& v = *t;
  if (integral) {
    TORCH_CHECK(at::isIntegralType(v.scalar_type(), false), op, ": ", name, " must be an integer tensor, got ",
                v.scalar_type());
  } else {
    TORCH_CHECK(at::isFloatingType(v.scalar_type()), op, ": ", name, " must be a floating-point tensor, got ",
                v.scalar_type());
  }
  TORCH_CHECK(v.dim() == 0 || v.sizes() == target.sizes(), op, ": ", name,
              " must be 0-dim (every row) or shaped like the target ", target.sizes(), ", got shape ", v.sizes());
  TORCH_CHECK(v.dim() == 0 || v.device() == target.device(), op, ": ", name, " is on ", v.device(),
              " but the target is on ", target.device());
  // min and max read on the host together: one synchronisation for a device tensor.
  double min = lo, max = hi;
  if (v.numel() > 0) {
    const auto [lowest, highest] = at::aminmax(v.to(at::kDouble));
    const at::Tensor bounds = at::stack({lowest, highest}).cpu();
    min = bounds[0].item<double>();
    max = bounds[1].item<double>();
  }
  const bool low_ok = open_low ? min > lo : min >= lo;
  TORCH_CHECK(low_ok && max <= hi && min == min && max == max, op, ": ", name, " must hold values in ",
              open_low ? "(" : "[", lo, ", ", hi, "], got ", (low_ok && min == min ? max : min));
  return v.to(at::kFloat).reshape({-1}).expand({n_rows});
}

// One row's floor on the CPU: the max, then each active filter over the values left by the ones before.
template <typename scalar_t, typename acc_t>
acc_t row_floor_cpu(const scalar_t* z, int64_t n, acc_t s, const SamplerRow<acc_t>& o, std::vector<acc_t>& kept) {
  acc_t m = neg_inf<acc_t>();
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = static_cast<acc_t>(z[j]);
    if (v != v) return neg_inf<acc_t>();  // a NaN row stays NaN: no filtering
    m = v > m ? v : m;
  }
  if (!(m > neg_inf<acc_t>())) return neg_inf<acc_t>();
  const ExpShifted<acc_t> e_of(s, s * m);
  acc_t floor = neg_inf<acc_t>();
  kept.clear();
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = static_cast<acc_t>(z[j]);
    if (!o.min_p_acts() || o.min_p_keeps(e_of(v))) kept.push_back(v);
  }
  if (o.min_p_acts()) floor = *std::min_element(kept.begin(), kept.end());
  if (o.k_acts(n) && static_cast<int64_t>(kept.size()) > static_cast<int64_t>(o.top_k)) {
    const auto kth = kept.begin() + (static_cast<int64_t>(o.top_k) - 1);
    std::nth_element(kept.begin(), kth, kept.end(), std::greater<acc_t>());
    floor = *kth;
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](acc_t v) { return v < floor; }), kept.end());
  }
  if (o.p_acts()) {
    std::sort(kept.begin(), kept.end(), std::greater<acc_t>());
    uint64_t total = 0;
    for (acc_t v : kept) total += sampler_mass(e_of(v));
    uint64_t above = 0;  // the mass of the values strictly above the current one
    for (size_t i = 0; i < kept.size();) {
      if (!o.p_keeps(above, total)) break;
      floor = kept[i];
      for (; i < kept.size() && kept[i] == floor; ++i) above += sampler_mass(e_of(kept[i]));
    }
  }
  return floor;
}

void sampler_floor_cpu(const RowPassArgs& args, const at::Tensor& params, const at::Tensor& out) {
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), "sampler", [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto v = make_view<scalar_t, int64_t, acc_t>(args);
    const float* p = params.const_data_ptr<float>();
    acc_t* o = out.data_ptr<acc_t>();
    at::parallel_for(0, v.n_rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> kept;
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* z = v.logits + row * v.row_stride;
        const int64_t label = v.target[row];
        const acc_t floor = row_floor_cpu(z, v.vocab, v.scale, SamplerRow<acc_t>(p + row * kSamplerColumns), kept);
        const bool has_label = label >= 0 && label < v.vocab;
        o[row] = floor_with_label(floor, has_label, has_label ? static_cast<acc_t>(z[label]) : acc_t(0));
      }
    });
  });
}

}  // namespace

void set_sampler_params(RowPassArgs& args, const char* op, const SamplerArgs& a, const at::Tensor& target,
                        int64_t n_rows, const at::TensorOptions& device, bool row_stats_given) {
  args.sampler_params = at::Tensor();
  args.sampler_top_k = args.sampler_top_p = args.min_p_in_pass = false;
  if (!a.top_k && !a.top_p && !a.min_p) return;
  // Options given as numbers (0-dim CPU tensors of the right kind) that filter nothing cost nothing.
  auto off = [](const OptTensor& t, bool integral, double value) {
    return !t || (t->dim() == 0 && t->is_cpu() && integral == at::isIntegralType(t->scalar_type(), false) &&
                  t->item<double>() == value);
  };
  const bool top_k_off = off(a.top_k, true, 0);
  if (top_k_off && off(a.top_p, false, 1) && off(a.min_p, false, 0)) return;
  TORCH_CHECK(!row_stats_given, op, ": top_k, top_p and min_p need each row's whole vocabulary; they are not ",
              "available with row_stats (tensor parallelism)");
  const at::Tensor k = sampler_column(op, "top_k", a.top_k, target, n_rows, true, 0, 1e9, false, 0.f);
  const at::Tensor p = sampler_column(op, "top_p", a.top_p, target, n_rows, false, 0, 1, true, 1.f);
  const at::Tensor m = sampler_column(op, "min_p", a.min_p, target, n_rows, false, 0, 1, false, 0.f);
  const auto on_device = [&](const at::Tensor& t) { return t.to(device.device()); };
  args.sampler_params = at::stack({on_device(k), on_device(p), on_device(m)}, 1).contiguous();
  args.sampler_top_k = !top_k_off;
  args.sampler_top_p = !off(a.top_p, false, 1);
}

namespace {
void check_whole_vocabulary(const char* op, const RowPassArgs& args) {
  TORCH_CHECK(args.vocab_start == 0 && args.logits.size(1) == args.vocab_total, op,
              ": top_k, top_p and min_p need each row's whole vocabulary; they are not available with a vocabulary "
              "shard (vocab_start ", args.vocab_start, ", vocab_size ", args.vocab_total, ", shard of ",
              args.logits.size(1), ")");
}
}  // namespace

bool sampler_floor_in_pass(const char* op, RowPassArgs& args) {
  check_whole_vocabulary(op, args);
  args.min_p_in_pass = false;
  if (!args.logits.is_cuda() || args.sampler_top_k || args.sampler_top_p) return false;
#ifdef RL_LOSSES_WITH_CUDA
  args.min_p_in_pass = cuda_fuses_row_pass(args);
#endif
  return args.min_p_in_pass;
}

at::Tensor sampler_floor(const char* op, const RowPassArgs& args, const at::Tensor& params) {
  check_whole_vocabulary(op, args);
  const int64_t rows = args.logits.size(0);
  const at::Tensor mine = args.row_index.defined() ? params.index_select(0, args.row_index)
                                                   : params.narrow(0, args.row_offset, rows).contiguous();
  at::Tensor out = at::empty({rows}, args.logits.options().dtype(acc_dtype(args.logits.scalar_type())));
  if (rows == 0) return out;
#ifdef RL_LOSSES_WITH_CUDA
  if (args.logits.is_cuda()) {
    sampler_floor_cuda(args, mine, out);
    return out;
  }
#endif
  sampler_floor_cpu(args, mine, out);
  return out;
}

}  // namespace rl_losses
