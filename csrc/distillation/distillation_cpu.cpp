// CPU back-end of distillation: at::parallel_for over rows; each row's passes (statistics, JSD sums, row step,
// gradient) run back to back while its two rows are in cache. The inner loops are `omp simd` reductions and
// element-wise sweeps the compiler vectorises (cpu_isa.h picks the widest ISA).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/boxed_kernel.h"
#include "common/row_pass_cpu.h"
#include "distillation/distillation.h"

namespace rl_losses {
namespace {

// Statistics of one row in two sweeps: both maxima, then the sums at them (no rescaling in the loop), in
// blocks whose partial sums are added at the end (row_stats_cpu does the same for one softmax).
template <typename student_t, typename teacher_t, typename acc_t>
DistillStats<acc_t> row_stats(const student_t* z, const teacher_t* zt, int64_t n, const DistillOptions<acc_t>& o) {
  constexpr int64_t kBlock = 1024;
  const acc_t s = o.scale, it = o.inv_temperature;
  acc_t ms = neg_inf<acc_t>(), mt = neg_inf<acc_t>();
  _Pragma("omp simd reduction(max : ms, mt)")
  for (int64_t j = 0; j < n; ++j) {
    const acc_t x = static_cast<acc_t>(z[j]) * s, y = static_cast<acc_t>(zt[j]) * it;
    ms = x > ms ? x : ms;
    mt = y > mt ? y : mt;
  }
  DistillStats<acc_t> st = DistillStats<acc_t>::empty();
  st.ms = ms;
  st.mt = mt;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    acc_t ss = 0, stt = 0, wt = 0, ws = 0, hx = 0;
    _Pragma("omp simd reduction(+ : ss, stt, wt, ws, hx)")
    for (int64_t j = b; j < end; ++j) {
      const acc_t x = static_cast<acc_t>(z[j]) * s, y = static_cast<acc_t>(zt[j]) * it;
      const acc_t eq = exp_nonpos(x - ms), ep = exp_nonpos(y - mt);
      ss += eq;
      stt += ep;
      wt += ep > acc_t(0) ? ep * (y - x) : acc_t(0);
      hx += ep > acc_t(0) ? ep * x : acc_t(0);
      ws += eq > acc_t(0) ? eq * (x - y) : acc_t(0);
    }
    st.ss += ss;
    st.st += stt;
    st.wt += wt;
    st.ws += ws;
    st.hx += hx;
  }
  return st;
}

// JSD's row sums (loss, S) given the statistics.
template <typename student_t, typename teacher_t, typename acc_t>
void row_jsd_sums(const student_t* z, const teacher_t* zt, int64_t n, const DistillOptions<acc_t>& o,
                  const DistillStats<acc_t>& st, acc_t* out) {
  const acc_t s = o.scale, it = o.inv_temperature, lse_s = st.lse_student(), lse_t = st.lse_teacher();
  acc_t loss = 0, q_sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const JsdTerms<acc_t> t =
        jsd_terms(o, static_cast<acc_t>(z[j]) * s - lse_s, static_cast<acc_t>(zt[j]) * it - lse_t);
    loss += t.loss;
    q_sum += t.q_term;
  }
  out[0] = loss;
  out[1] = q_sum;
}

// The gradient of a row from its table (and the head's coefficients, where `head` is not null). A row of weight 0
// (zt null where the mask skips it) reads only the student, for the head's terms, or is zero-filled without them.
template <DistillKind kKind, typename student_t, typename teacher_t, typename acc_t>
void row_grad(const student_t* z, const teacher_t* zt, student_t* g, int64_t n, const DistillOptions<acc_t>& o,
              const acc_t* table, const acc_t* head, int64_t label) {
  const acc_t w = table[kDistWeight];
  if (w == acc_t(0) && (head == nullptr || DistillHeadCoef<acc_t>::load(head).zero())) {
    std::fill(g, g + n, student_t(0));
    return;
  }
  const acc_t s = o.scale, it = o.inv_temperature;
  const acc_t lse_s = table[kDistLseS], lse_t = table[kDistLseT], c = table[kDistConst];
  const DistillOptions<acc_t> opt = o;  // a local: loads through a reference would block vectorisation
  if (head == nullptr) {
    const acc_t sw = s * w;
    RL_LOSSES_SIMD
    for (int64_t j = 0; j < n; ++j) {
      const acc_t x = static_cast<acc_t>(z[j]) * s, y = static_cast<acc_t>(zt[j]) * it;
      g[j] = static_cast<student_t>(sw * distill_grad<kKind>(opt, x, y, lse_s, lse_t, c));
    }
    return;
  }
  // The head's step writes the student's lse on every row, also one of weight 0: its terms read Q there too.
  const DistillHeadCoef<acc_t> sh = DistillHeadCoef<acc_t>::load(head).scaled(s);
  const acc_t sw = s * w;
  auto sweep = [&](auto distill) {
    constexpr bool kDistill = decltype(distill)::value;
    RL_LOSSES_SIMD
    for (int64_t j = 0; j < n; ++j) {
      const acc_t x = static_cast<acc_t>(z[j]) * s, y = kDistill ? static_cast<acc_t>(zt[j]) * it : acc_t(0);
      g[j] = static_cast<student_t>(distill_head_grad<kKind, kDistill>(opt, x, y, lse_s, lse_t, c, sw, sh,
                                                                        j == label));
    }
  };
  if (w != acc_t(0)) {
    sweep(std::true_type{});
  } else {
    sweep(std::false_type{});
  }
}

// The teacher dtypes the row loops are compiled for: the student's own and its accumulation dtype, 6 pairs of
// the 16 (an fp32 or fp64 student: one each). A teacher of another dtype is converted to acc_t a row at a time, into
// a buffer of the thread's, by a loop of its own: the row loops read the teacher only as static_cast<acc_t>(zt[j]),
// so the results are the same to the bit, and the converted row is read from cache by the sweeps that follow it.
// With all 16 pairs this file was the build's longest: 30.0 CPU-s to compile, 15.7 with these 6
// (benchmarks/results/cpu-2026-11-27-build-tus.txt).
#define RL_LOSSES_DISPATCH_DISTILL_CPU(STUDENT, TEACHER, ...)                                                 \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, STUDENT, "distillation", [&] {                   \
    using student_t = scalar_t;                                                                               \
    using acc_t = typename acc_type<student_t>::type;                                                         \
    if constexpr (std::is_same_v<student_t, acc_t>) {                                                         \
      using teacher_t = acc_t;                                                                                \
      __VA_ARGS__();                                                                                          \
    } else if ((TEACHER) == c10::CppTypeToScalarType<student_t>::value) {                                     \
      using teacher_t = student_t;                                                                            \
      __VA_ARGS__();                                                                                          \
    } else {                                                                                                  \
      using teacher_t = acc_t;                                                                                \
      __VA_ARGS__();                                                                                          \
    }                                                                                                         \
  })

// n values of a teacher's row of dtype src_t as acc_t.
template <typename src_t, typename acc_t>
void convert_row(const void* src, acc_t* dst, int64_t n) {
  const src_t* x = static_cast<const src_t*>(src);
  run_vectorised([&] {
    RL_LOSSES_SIMD
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(x[j]);
  });
}

// f(i, zt) for every row i, with zt the teacher's row i as teacher_t: the tensor's own row where it has that
// dtype, else the row converted (RL_LOSSES_DISPATCH_DISTILL_CPU); null where `mask` (the student's dtype's
// accumulation type, or null) is 0, a row whose teacher is not read.
template <typename teacher_t, typename acc_t, typename F>
void for_rows(const DistillState& s, const acc_t* mask, const F& f) {
  const int64_t n_rows = s.logits.size(0), vocab = s.logits.size(1);
  void (*convert)(const void*, teacher_t*, int64_t) = nullptr;
  if (s.teacher.scalar_type() != c10::CppTypeToScalarType<teacher_t>::value) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.teacher.scalar_type(), "distillation",
                                    [&] { convert = &convert_row<scalar_t, teacher_t>; });
  }
  const char* teacher = static_cast<const char*>(s.teacher.const_data_ptr());
  const int64_t row_bytes = s.teacher.stride(0) * s.teacher.element_size();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, n_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<teacher_t> converted(convert != nullptr ? vocab : 0);
    run_vectorised([&] {
      for (int64_t i = begin; i < end; ++i) {
        // One call of f (run_vectorised's `flatten` inlines each call site).
        const teacher_t* row = reinterpret_cast<const teacher_t*>(teacher + i * row_bytes);
        if (mask != nullptr && mask[i] == acc_t(0)) {
          row = nullptr;
        } else if (convert != nullptr) {
          convert(row, converted.data(), vocab);
          row = converted.data();
        }
        f(i, row);
      }
    });
  });
}

void stats_cpu(const DistillState& s) {
  RL_LOSSES_DISPATCH_DISTILL_CPU(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    const auto o = distill_options_as<acc_t>(s.opt);
    const student_t* z = s.logits.const_data_ptr<student_t>();
    const int64_t v = s.logits.size(1), rs = s.logits.stride(0);
    acc_t* out = s.stats.data_ptr<acc_t>();
    for_rows<teacher_t>(s, static_cast<const acc_t*>(nullptr), [&](int64_t i, const teacher_t* zt) {
      row_stats(z + i * rs, zt, v, o).store(out + i * DistillStats<acc_t>::kFields);
    });
  });
}

void jsd_sums_cpu(const DistillState& s) {
  RL_LOSSES_DISPATCH_DISTILL_CPU(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    const auto o = distill_options_as<acc_t>(s.opt);
    const student_t* z = s.logits.const_data_ptr<student_t>();
    const int64_t v = s.logits.size(1), rs = s.logits.stride(0);
    const acc_t* stats = s.stats.const_data_ptr<acc_t>();
    acc_t* out = s.jsd_sums.data_ptr<acc_t>();
    for_rows<teacher_t>(s, static_cast<const acc_t*>(nullptr), [&](int64_t i, const teacher_t* zt) {
      const auto st = DistillStats<acc_t>::load(stats + i * DistillStats<acc_t>::kFields);
      row_jsd_sums(z + i * rs, zt, v, o, st, out + 2 * i);
    });
  });
}

template <DistillKind kKind>
void rows_cpu_kind(const DistillState& s) {
  RL_LOSSES_DISPATCH_DISTILL_CPU(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    const auto o = distill_options_as<acc_t>(s.opt);
    const auto step = make_distill_row_step<acc_t>(s);
    const student_t* z = s.logits.const_data_ptr<student_t>();
    student_t* grad = s.grad.defined() ? s.grad.data_ptr<student_t>() : nullptr;
    const int64_t v = s.logits.size(1), rs = s.logits.stride(0);
    const int64_t rg = s.grad.defined() ? s.grad.stride(0) : 0;
    const acc_t* mask = s.mask.defined() ? s.mask.const_data_ptr<acc_t>() : nullptr;
    acc_t* stats = s.stats.data_ptr<acc_t>();
    acc_t* sums = s.jsd_sums.defined() ? s.jsd_sums.data_ptr<acc_t>() : nullptr;
    // A masked row is not read (zti is null): the step writes zeros and the gradient row is zero-filled.
    for_rows<teacher_t>(s, mask, [&](int64_t i, const teacher_t* zti) {
      const student_t* zi = z + i * rs;
      if (zti != nullptr) {
        acc_t* st = stats + i * DistillStats<acc_t>::kFields;
        if (!s.stats_given) row_stats(zi, zti, v, o).store(st);
        if (kKind == DistillKind::kJsd && !s.jsd_given) {
          row_jsd_sums(zi, zti, v, o, DistillStats<acc_t>::load(st), sums + 2 * i);
        }
      }
      step(i);
      if (grad != nullptr) {
        row_grad<kKind>(zi, zti, grad + i * rg, v, o, step.grad_rows + i * kDistGradFields,
                        static_cast<const acc_t*>(nullptr), -1);
      }
    });
  });
}

template <typename F>
void for_distill_kind(DistillKind kind, const F& f) {
  switch (kind) {
    case DistillKind::kForwardKl:
      return f(std::integral_constant<DistillKind, DistillKind::kForwardKl>{});
    case DistillKind::kReverseKl:
      return f(std::integral_constant<DistillKind, DistillKind::kReverseKl>{});
    case DistillKind::kCrossEntropy:
      return f(std::integral_constant<DistillKind, DistillKind::kCrossEntropy>{});
    default:
      return f(std::integral_constant<DistillKind, DistillKind::kJsd>{});
  }
}

void rows_cpu(const DistillState& s) {
  for_distill_kind(s.opt.kind, [&](auto kind) { rows_cpu_kind<decltype(kind)::value>(s); });
}

// The gradient pass alone (the fused head's: distill_head_grad with its coefficients). The teacher's row is read
// where the row's distillation weight is not 0.
template <DistillKind kKind>
void grad_cpu_kind(const DistillState& s) {
  RL_LOSSES_DISPATCH_DISTILL_CPU(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    const auto o = distill_options_as<acc_t>(s.opt);
    const student_t* z = s.logits.const_data_ptr<student_t>();
    student_t* grad = s.grad.data_ptr<student_t>();
    const int64_t v = s.logits.size(1), rs = s.logits.stride(0), rg = s.grad.stride(0);
    const acc_t* table = s.grad_rows.const_data_ptr<acc_t>();
    const acc_t* head = s.head_coef.defined() ? s.head_coef.const_data_ptr<acc_t>() : nullptr;
    const int64_t* labels = s.head_labels.defined() ? s.head_labels.const_data_ptr<int64_t>() : nullptr;
    const at::Tensor weight = s.grad_rows.select(1, kDistWeight).contiguous();
    for_rows<teacher_t>(s, weight.const_data_ptr<acc_t>(), [&](int64_t i, const teacher_t* zti) {
      row_grad<kKind>(z + i * rs, zti, grad + i * rg, v, o, table + i * kDistGradFields,
                      head != nullptr ? head + i * kDistHeadFields : nullptr, labels != nullptr ? labels[i] : -1);
    });
  });
}

void grad_cpu(const DistillState& s) {
  if (s.logits.size(0) == 0) return;
  for_distill_kind(s.opt.kind, [&](auto kind) { grad_cpu_kind<decltype(kind)::value>(s); });
}

}  // namespace

const DistillBackend& distill_backend_cpu() {
  static constexpr DistillBackend backend{&stats_cpu, &jsd_sums_cpu, &rows_cpu, &grad_cpu};
  return backend;
}

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  using K = DistillKernels<distill_backend_cpu>;
  m.impl("_distillation_forward", boxed<&K::forward<false>>());
  m.impl("_distillation_forward_inplace", boxed<&K::forward<true>>());
  m.impl("distillation_stats", boxed<&K::stats>());
  m.impl("distillation_jsd_sums", boxed<&K::jsd_sums>());
}

}  // namespace rl_losses
