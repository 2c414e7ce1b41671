// The sm_90 bulk-copy and mbarrier primitives of the cluster row kernel (cuda/cluster_kernel.cuh), free of torch
// headers (a standalone copy benchmark built on them measured the same instructions: docs/design.md).
#pragma once

#include <cstdint>

namespace rl_losses {
namespace cuda {

// Bulk copies from global to shared memory by the copy engine (cp.async.bulk, sm_90), completing on an
// mbarrier that counts the bytes still to land. One thread issues a whole slice; every thread then waits on
// the barrier's phase. (Per-thread 16-byte cp.async copies made L2 serve about twice the read sectors
// that DRAM delivered.)
__device__ inline unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ inline void mbarrier_init(uint64_t* bar) {  // one arrival per phase: the issuing thread's
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrive on the barrier and announce `bytes` of copies that complete its current phase.
__device__ inline void mbarrier_arrive_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// The barrier at the shared address `bar` (a loop may carry it; see the distillation cluster kernel).
__device__ inline void mbarrier_wait_at(unsigned bar, unsigned phase) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  }
}
__device__ inline void mbarrier_wait(uint64_t* bar, unsigned phase) { mbarrier_wait_at(smem_addr(bar), phase); }
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to this CTA's `dst`.
__device__ inline void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

}  // namespace cuda
}  // namespace rl_losses
