// Runs the CPU row loops at the widest vector width the machine has.
//
// The extension is compiled for the baseline x86-64 ISA (SSE2), so that one build loads on any CPU. Its row
// loops are vectorised by the compiler, 4 floats wide at that baseline; on a 2-core AVX-512 machine the
// statistics sweep took 3.1 ns per logit per core at SSE2, 1.5 at AVX2 and 1.0 at AVX-512. So the loop body
// is compiled again for each wider width, in functions carrying the ISA as a target attribute and marked
// `flatten`: every call inside them (the sweeps, the exp polynomial, the epilogue) is inlined there and
// vectorised at that width. Nothing is emitted as a separately linked copy, so no inline function of another
// translation unit is replaced by an AVX one (which a file built with -mavx2 would risk).
//
// Each width is a copy of every row loop (about half of compiling a file with row loops: docs/performance.md), so
// a build may compile only some: those from RL_LOSSES_CPU_NARROWEST to RL_LOSSES_CPU_WIDEST (0 baseline, 1 AVX2,
// 2 AVX-512). setup.py sets them from RL_LOSSES_CPU_WIDTHS: a build in place compiles only the widest width its
// machine runs, the wheel and CI all three; unset (another build system), all three.
#pragma once

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

#ifndef RL_LOSSES_CPU_WIDEST
#define RL_LOSSES_CPU_WIDEST 2
#endif
#ifndef RL_LOSSES_CPU_NARROWEST
#define RL_LOSSES_CPU_NARROWEST 0
#endif

namespace rl_losses {

enum class CpuIsa { kBaseline, kAvx2, kAvx512 };  // narrowest first: the order std::min compares

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RL_LOSSES_CPU_ISA_DISPATCH 1
inline constexpr CpuIsa kWidestCompiled = static_cast<CpuIsa>(RL_LOSSES_CPU_WIDEST);
inline constexpr CpuIsa kNarrowestCompiled = static_cast<CpuIsa>(RL_LOSSES_CPU_NARROWEST);

// What this CPU and its OS run (the features of the target attributes below). ATen's choice alone is not enough:
// ATEN_CPU_CAPABILITY=avx512 makes it report AVX512 on any CPU.
inline CpuIsa cpu_runs() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return avx512 ? CpuIsa::kAvx512 : avx2 ? CpuIsa::kAvx2 : CpuIsa::kBaseline;
}
#else
inline constexpr CpuIsa kWidestCompiled = CpuIsa::kBaseline;
inline constexpr CpuIsa kNarrowestCompiled = CpuIsa::kBaseline;
inline CpuIsa cpu_runs() { return CpuIsa::kBaseline; }
#endif

// The names ATen gives the widths (torch.backends.cpu.get_cpu_capability()).
inline std::string cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::kAvx512 ? "AVX512" : isa == CpuIsa::kAvx2 ? "AVX2" : "DEFAULT";
}

// The width the loops run at, read once: ATen's own choice for its vectorised CPU kernels
// (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY=default / avx2 / avx512 sets), but no wider
// than the CPU runs nor than this build compiled, and no narrower than this build compiled (a build in place has
// only its machine's widest width).
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
    const std::string c = at::get_cpu_capability();
    const CpuIsa aten = c == "AVX512" ? CpuIsa::kAvx512 : c == "AVX2" ? CpuIsa::kAvx2 : CpuIsa::kBaseline;
    const CpuIsa runs = cpu_runs();
    TORCH_CHECK(runs >= kNarrowestCompiled, "rl_losses: the CPU row loops of this build need ",
                cpu_isa_name(kNarrowestCompiled), ", which this CPU lacks (it runs ", cpu_isa_name(runs),
                "): rebuild on this machine or with RL_LOSSES_CPU_WIDTHS=all");
    return std::max(kNarrowestCompiled, std::min({aten, runs, kWidestCompiled}));
  }();
  return isa;
}

// The widths this build compiled, narrowest first (tests/test_cpu_isa.py).
inline std::vector<std::string> cpu_isas_compiled() {
  std::vector<std::string> names;
  for (int i = static_cast<int>(kNarrowestCompiled); i <= static_cast<int>(kWidestCompiled); ++i) {
    names.push_back(cpu_isa_name(static_cast<CpuIsa>(i)));
  }
  return names;
}

#ifdef RL_LOSSES_CPU_ISA_DISPATCH
#if RL_LOSSES_CPU_WIDEST >= 2
template <typename F>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c"), gnu::flatten]] void run_avx512(
    const F& f) {
  f();
}
#endif
#if RL_LOSSES_CPU_WIDEST >= 1 && RL_LOSSES_CPU_NARROWEST <= 1
template <typename F>
[[gnu::target("avx2,fma,bmi,bmi2,f16c"), gnu::flatten]] void run_avx2(const F& f) {
  f();
}
#endif
#endif

// f(), compiled for the ISA cpu_isa() names (other architectures: as built).
template <typename F>
void run_vectorised(const F& f) {
#ifdef RL_LOSSES_CPU_ISA_DISPATCH
  switch (cpu_isa()) {
#if RL_LOSSES_CPU_WIDEST >= 2
    case CpuIsa::kAvx512:
      return run_avx512(f);
#endif
#if RL_LOSSES_CPU_WIDEST >= 1 && RL_LOSSES_CPU_NARROWEST <= 1
    case CpuIsa::kAvx2:
      return run_avx2(f);
#endif
    default:
      break;
  }
#endif
#if !defined(RL_LOSSES_CPU_ISA_DISPATCH) || RL_LOSSES_CPU_NARROWEST == 0
  f();  // the baseline copy, which a build starting at a wider width leaves out
#endif
}

}  // namespace rl_losses
