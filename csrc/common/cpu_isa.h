// Runs the CPU row loops at the widest vector width the machine has.
//
// The extension is compiled for the baseline x86-64 ISA (SSE2), so that one build loads on any CPU. Its row
// loops are vectorised by the compiler, 4 floats wide at that baseline; on a 2-core AVX-512 machine the
// statistics sweep took 3.1 ns per logit per core at SSE2, 1.5 at AVX2 and 1.0 at AVX-512. So the loop body
// is compiled three times, in functions carrying the ISA as a target attribute and marked `flatten`: every
// call inside them (the sweeps, the exp polynomial, the epilogue) is inlined there and vectorised at that
// width. Nothing is emitted as a separately linked copy, so no inline function of another translation unit is
// replaced by an AVX one (which a file built with -mavx2 would risk).
#pragma once

#include <ATen/Version.h>

#include <string>

namespace rl_losses {

enum class CpuIsa { kBaseline, kAvx2, kAvx512 };

// ATen's own choice for its vectorised CPU kernels, read once: it checks what the CPU and the OS support and
// honours ATEN_CPU_CAPABILITY=default / avx2 / avx512 (torch.backends.cpu.get_cpu_capability()).
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
    const std::string c = at::get_cpu_capability();
    return c == "AVX512" ? CpuIsa::kAvx512 : c == "AVX2" ? CpuIsa::kAvx2 : CpuIsa::kBaseline;
  }();
  return isa;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RL_LOSSES_CPU_ISA_DISPATCH 1
template <typename F>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c"), gnu::flatten]] void run_avx512(
    const F& f) {
  f();
}
template <typename F>
[[gnu::target("avx2,fma,bmi,bmi2,f16c"), gnu::flatten]] void run_avx2(const F& f) {
  f();
}
#endif

// f(), compiled for the ISA cpu_isa() names (other architectures: as built).
template <typename F>
void run_vectorised(const F& f) {
#ifdef RL_LOSSES_CPU_ISA_DISPATCH
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      return run_avx512(f);
    case CpuIsa::kAvx2:
      return run_avx2(f);
    case CpuIsa::kBaseline:
      break;
  }
#endif
  f();
}

}  // namespace rl_losses
