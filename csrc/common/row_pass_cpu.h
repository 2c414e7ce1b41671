// CPU back-end of the row pass (row_pass.h): at::parallel_for over rows, two sweeps per row (statistics,
// then gradient), fp32 (fp64) accumulation, inner loops written so that the compiler vectorises them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "common/row_pass.h"

namespace rl_losses {

// Statistics of one row in two sweeps: the max, then the sums relative to it. Each sweep keeps kLanes
// independent partial results (combined pairwise at the end): that is what lets the compiler vectorise
// without reassociating, and it keeps fp32 summation error at sqrt(V/kLanes) rather than sqrt(V) roundings.
// (The CUDA kernel gets the same effect from its per-thread states and tree reduction.)
template <bool kEntropy, bool kSmoothing, typename scalar_t, typename acc_t = typename acc_type<scalar_t>::type>
RowStats<acc_t> row_stats_cpu(const scalar_t* x, int64_t n, acc_t scale) {
  constexpr int kLanes = 16;
  acc_t lane[kLanes];
  for (int i = 0; i < kLanes; ++i) lane[i] = neg_inf<acc_t>();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int i = 0; i < kLanes; ++i) {
      const acc_t xi = static_cast<acc_t>(x[j + i]) * scale;
      lane[i] = xi > lane[i] ? xi : lane[i];
    }
  acc_t m = neg_inf<acc_t>();
  for (int i = 0; i < kLanes; ++i) m = lane[i] > m ? lane[i] : m;
  for (; j < n; ++j) m = std::max(m, static_cast<acc_t>(x[j]) * scale);
  RowStats<acc_t> st = RowStats<acc_t>::empty();
  if (m == neg_inf<acc_t>()) return st;  // every logit is -inf (or the row is empty)
  acc_t se[kLanes] = {}, spx[kLanes] = {}, sx[kLanes] = {};
  for (j = 0; j + kLanes <= n; j += kLanes)
    for (int i = 0; i < kLanes; ++i) {
      const acc_t xi = static_cast<acc_t>(x[j + i]) * scale;
      const acc_t e = exp_nonpos(xi - m);
      se[i] += e;
      if (kEntropy) spx[i] += e > acc_t(0) ? e * xi : acc_t(0);
      if (kSmoothing) sx[i] += xi;
    }
  for (int i = 0; j < n; ++j, ++i) {  // tail, spread over the lanes too
    const acc_t xi = static_cast<acc_t>(x[j]) * scale;
    const acc_t e = exp_nonpos(xi - m);
    se[i] += e;
    if (kEntropy) spx[i] += e > acc_t(0) ? e * xi : acc_t(0);
    if (kSmoothing) sx[i] += xi;
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) {
      se[i] += se[i + w];
      spx[i] += spx[i + w];
      sx[i] += sx[i + w];
    }
  st.max = m;
  st.sumexp = se[0];
  st.sum_px = spx[0];
  st.sum_x = sx[0];
  return st;
}

template <typename scalar_t, typename label_t, bool kEntropy, bool kSmoothing, typename Epilogue>
void row_pass_cpu_typed(const RowPassArgs& args, const Epilogue& epi) {
  using acc_t = typename acc_type<scalar_t>::type;
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const bool stats = args.compute_stats(), grad = args.write_grad();
  // Rows are independent; a grain of a few rows keeps the scheduling cost far below one row's work.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(v.vocab, 1));
  at::parallel_for(0, v.n_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* x = v.logits + row * v.row_stride;
      const int64_t label = static_cast<int64_t>(v.target[row]);
      TORCH_CHECK(label < v.vocab_total, "target: label ", label, " at row ", row, " is out of range for ",
                  "vocab_size ", v.vocab_total);
      const int64_t local = label - v.vocab_start;
      const bool has_label = label >= 0 && local >= 0 && local < v.vocab;
      RowStats<acc_t> st;
      if (stats) {
        st = row_stats_cpu<kEntropy, kSmoothing>(x, v.vocab, v.scale);
        st.label = has_label ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
      } else {
        st = load_stats(v.stats_in, row);
      }
      const GradCoef<acc_t> coef = epi(row, label, st);
      if (!grad) continue;
      scalar_t* g = v.grad + row * v.grad_row_stride;
      if (coef.a == acc_t(0) && coef.b == acc_t(0) && coef.c == acc_t(0)) {
        std::fill(g, g + v.vocab, scalar_t(0));  // masked row: exact zeros, no exp of a possibly -inf lse
        continue;
      }
      const acc_t lse = st.lse();
      const acc_t sa = v.scale * coef.a, sc = v.scale * coef.c;
      for (int64_t k = 0; k < v.vocab; ++k) {
        const acc_t p = exp_nonpos(static_cast<acc_t>(x[k]) * v.scale - lse);
        g[k] = static_cast<scalar_t>(sa * p + sc);
      }
      // The label term is added after the vectorised sweep rather than tested per element. Its logit comes
      // from the statistics, not from x: with inplace_backward, x[local] already holds the gradient.
      if (has_label) {
        const acc_t p = exp_nonpos(st.label - lse);
        g[local] = static_cast<scalar_t>(sa * p + sc + v.scale * coef.b);
      }
    }
  });
}

// Entry point: dispatch on dtypes and on the statistics flags.
template <typename Epilogue_for>
void row_pass_cpu(const RowPassArgs& args, const char* name, Epilogue_for&& make_epilogue) {
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), name, [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto epi = make_epilogue(static_cast<acc_t*>(nullptr));
    using Epi = std::decay_t<decltype(epi)>;
    dispatch_stat_flags<Epi>(args, [&](auto entropy, auto smoothing) {
      row_pass_cpu_typed<scalar_t, int64_t, decltype(entropy)::value, decltype(smoothing)::value>(args, epi);
    });
  });
}

}  // namespace rl_losses

namespace rl_losses {

// The CPU runner: what an op's back-end-independent code needs from a device (see gspo.h).
struct CpuRunner {
  template <typename MakeEpilogue>
  static void row_pass(const RowPassArgs& args, const char* name, MakeEpilogue&& make) {
    row_pass_cpu(args, name, std::forward<MakeEpilogue>(make));
  }
  // f(i) for i in [0, n): the O(N) and O(S) steps between the row passes.
  template <typename F>
  static void for_each(int64_t n, const F& f) {
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) f(i);
    });
  }
};

}  // namespace rl_losses
