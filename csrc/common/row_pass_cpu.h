// CPU back-end of the row pass (row_pass.h): at::parallel_for over rows, two sweeps per row (statistics,
// then gradient), fp32 (fp64) accumulation, inner loops written so that the compiler vectorises them (at the
// machine's widest vector ISA: cpu_isa.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/row_pass.h"

// Lets the compiler vectorise a loop it would otherwise leave scalar (the polynomial exp's float-to-int
// conversion reads to GCC as control flow). Needs -fopenmp or -fopenmp-simd; a no-op without them.
#define RL_LOSSES_SIMD _Pragma("omp simd")

namespace rl_losses {

// Statistics of one row in two sweeps: the max, then the sums relative to it (so no rescaling inside the
// loop). Both are `omp simd` reductions, which lets the compiler vectorise without -ffast-math; the sums run
// over blocks of kBlock logits whose partial results are added at the end, which keeps the fp32 rounding
// error near sqrt(kBlock/width + V/kBlock) additions rather than sqrt(V). (The CUDA kernel gets the same from
// its per-thread states and tree reduction.)
// kFloor: a logit below `floor` (the sampler's, row_pass.h) counts as −inf in the sums; the max is the row's own
// (the most probable token is always kept).
template <bool kEntropy, bool kSmoothing, bool kFloor = false, typename scalar_t,
          typename acc_t = typename acc_type<scalar_t>::type>
RowStats<acc_t> row_stats_cpu(const scalar_t* x, int64_t n, acc_t scale, acc_t floor = acc_t(0)) {
  constexpr int64_t kBlock = 1024;
  acc_t m = neg_inf<acc_t>();
  _Pragma("omp simd reduction(max : m)")
  for (int64_t j = 0; j < n; ++j) {
    const acc_t xj = static_cast<acc_t>(x[j]) * scale;
    m = xj > m ? xj : m;
  }
  RowStats<acc_t> st = RowStats<acc_t>::empty();
  if (m == neg_inf<acc_t>()) {  // every logit is -inf or NaN (or the row is empty): NaN if any is NaN
    for (int64_t j = 0; j < n; ++j) {
      const acc_t xj = static_cast<acc_t>(x[j]);
      if (xj != xj) return {xj, xj, xj, xj, acc_t(0)};
    }
    if (kSmoothing && n > 0) st.sum_x = neg_inf<acc_t>();  // Σx of -inf values (label smoothing)
    return st;
  }
  st.max = m;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    acc_t se = 0, spx = 0, sx = 0;
    _Pragma("omp simd reduction(+ : se, spx, sx)")
    for (int64_t j = b; j < end; ++j) {
      const acc_t zj = static_cast<acc_t>(x[j]);
      const acc_t xj = kFloor && zj < floor ? neg_inf<acc_t>() : zj * scale;
      const acc_t e = exp_nonpos(xj - m);
      se += e;
      if (kEntropy) spx += e > acc_t(0) ? e * xj : acc_t(0);
      if (kSmoothing) sx += xj;
    }
    st.sumexp += se;
    st.sum_px += spx;
    st.sum_x += sx;
  }
  return st;
}

// The row loop's one error, a function of its own: inside the loop (run_vectorised's `flatten` inlines every call)
// its message's formatting was compiled again into every instantiation of the loop, 9 % of a row-loop file's code.
[[noreturn, gnu::noinline, gnu::cold]] inline void label_out_of_range(int64_t label, int64_t row, int64_t vocab) {
  TORCH_CHECK(false, "target: label ", label, " at row ", row, " is out of range for vocab_size ", vocab);
}

template <typename scalar_t, typename label_t, bool kEntropy, bool kSmoothing, typename Epilogue>
void row_pass_cpu_typed(const RowPassArgs& args, const Epilogue& epi) {
  using acc_t = typename acc_type<scalar_t>::type;
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const bool stats = args.compute_stats(), grad = args.write_grad();
  // Rows are independent; a grain of a few rows keeps the scheduling cost far below one row's work.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(v.vocab, 1));
  at::parallel_for(0, v.n_rows, grain, [&](int64_t begin, int64_t end) {
    run_vectorised([&] {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* x = v.logits + row * v.row_stride;
        const int64_t label = static_cast<int64_t>(v.target[row]);
        if (label >= v.vocab_total) label_out_of_range(label, v.epilogue_row(row), v.vocab_total);
        const int64_t local = label - v.vocab_start;
        const bool has_label = label >= 0 && local >= 0 && local < v.vocab;
        // The sampler's floor of this row, where one filters it (-inf filters nothing).
        const acc_t floor = v.floor != nullptr ? v.floor[row] : neg_inf<acc_t>();
        const bool filtered = floor > neg_inf<acc_t>();
        RowStats<acc_t> st = RowStats<acc_t>::empty();
        if (stats) {
          if (!(Epilogue::kSkipsUnlabelled && label < 0)) {
            st = filtered ? row_stats_cpu<kEntropy, kSmoothing, true>(x, v.vocab, v.scale, floor)
                          : row_stats_cpu<kEntropy, kSmoothing>(x, v.vocab, v.scale);
            st.label = has_label ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
          }
          if (v.stats_out != nullptr) store_stats(v.stats_out, row, st);
        } else {
          st = load_stats(v.stats_in, row);
        }
        const GradCoef<acc_t> coef = epi(v.epilogue_row(row), label, st);
        if (!grad) continue;
        scalar_t* g = v.grad + row * v.grad_row_stride;
        constexpr bool kEntropyGrad = Epilogue::kMayUseEntropyGrad;
        if (coef.a == acc_t(0) && coef.b == acc_t(0) && coef.c == acc_t(0) && (!kEntropyGrad || coef.h == acc_t(0))) {
          std::fill(g, g + v.vocab, scalar_t(0));  // masked row: exact zeros, no exp of a possibly -inf lse
          continue;
        }
        // p = exp((s·x − max) − log Σ), relative to the max first (ExpShifted says why); its exponent is
        // log p, which the entropy term h·p·log p takes (one more FMA, compiled only for epilogues with it).
        const ExpShifted<acc_t> p_of(v.scale, st.max, std::log(st.sumexp));
        const acc_t sa = v.scale * coef.a, sc = v.scale * coef.c, sh = v.scale * coef.h;
        const int64_t n = v.vocab;  // locals: loads through `v` inside the loop would block vectorisation
        auto sweep = [&](auto masked) {
          RL_LOSSES_SIMD
          for (int64_t k = 0; k < n; ++k) {
            const acc_t z = static_cast<acc_t>(x[k]);
            const acc_t log_p = p_of.arg(z);
            const acc_t p = ExpShifted<acc_t>::exp_of_arg(log_p);
            acc_t gk;
            if constexpr (kEntropyGrad) {
              gk = (sa + sh * log_p) * p + sc;
            } else {
              gk = sa * p + sc;
            }
            if constexpr (decltype(masked)::value) gk = z < floor ? acc_t(0) : gk;  // outside the kept set
            g[k] = static_cast<scalar_t>(gk);
          }
        };
        if (filtered) {
          sweep(std::true_type{});
        } else {
          sweep(std::false_type{});
        }
        // The label term is added after the vectorised sweep rather than tested per element. Its logit comes
        // from the statistics, not from x: with inplace_backward, x[local] already holds the gradient.
        if (has_label) {
          const acc_t log_p = st.log_prob(st.label);
          const acc_t p = exp_nonpos(log_p);
          const acc_t pa = kEntropyGrad ? sa + sh * log_p : sa;
          g[local] = static_cast<scalar_t>(pa * p + sc + v.scale * coef.b);
        }
      }
    });
  });
}

// Entry point: dispatch on dtypes and on the statistics flags.
template <typename Epilogue_for>
void row_pass_cpu(const RowPassArgs& args, const char* name, Epilogue_for&& make_epilogue) {
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), name, [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto epi = prescaled_epilogue<scalar_t>(args, make_epilogue(static_cast<acc_t*>(nullptr)));
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
  // out[index[i], :] = Σ values[i, :] over the i with that index (out: (S, K), values: (N, K), contiguous;
  // K as the CUDA runner takes it).
  template <int K>
  static void sum_rows_by_index(const at::Tensor& values, const at::Tensor& index, const at::Tensor& out) {
    sum_rows_by_index_aten(values, index, out);
  }
  // first[b], b < count <= n: the indices of the `count` smallest key.key(i), in order, ties by index.
  template <typename K>
  static void select_first(int64_t n, int64_t count, const K& key, int64_t* first) {
    std::vector<std::pair<double, int64_t>> keys(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) keys[i] = {key.key(i), i};
    std::partial_sort(keys.begin(), keys.begin() + count, keys.end());
    for (int64_t b = 0; b < count; ++b) first[b] = keys[b].second;
  }
  // r.finish(s) once, with s[k] = Σ_{i < n} of r.terms(i)[k] (see row_pass.h): summed in order, in fp64.
  template <typename R>
  static void sum_then(int64_t n, const R& r) {
    using acc_t = typename R::acc_t;
    double s[R::kTerms] = {};
    for (int64_t i = 0; i < n; ++i) {
      acc_t v[R::kTerms];
      r.terms(i, v);
      for (int k = 0; k < R::kTerms; ++k) s[k] += static_cast<double>(v[k]);
    }
    acc_t out[R::kTerms];
    for (int k = 0; k < R::kTerms; ++k) out[k] = static_cast<acc_t>(s[k]);
    r.finish(out);
  }
  // The steps in order (row_pass.h).
  template <typename... S>
  static void chain(const S&... steps) {
    (run_step<CpuRunner>(steps), ...);
  }
};

}  // namespace rl_losses
