// Programmatic dependent launch (sm_90) for every kernel of this library: a call is a chain of kernels on
// one stream (label count, row pass, reductions, ...), and at small shapes the gaps between them cost as
// much as the small kernels themselves (~2 us each on an H100; benchmarks/NOTES.md v14). A kernel launched
// through DependentLaunch may be scheduled while the kernel before it is still running; it waits in
// wait_previous_grid(), before it touches global memory, until that kernel has finished and its writes are
// visible. So the order of effects is the plain stream order; only the launch latency overlaps. (One
// exception, the cluster kernel's tail launch, waits at its end instead: cuda/cluster_kernel.cuh says why it is
// safe there.)
// Also here: occupancy_once, the occupancy calculator's answers that size the persistent grids, cached.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

namespace rl_losses {
namespace cuda {

// Waits until the kernel before this one in the stream has finished and its writes are visible (at once
// when this launch was not a dependent one).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next kernel be scheduled: it waits in its own wait_for_previous_grid before it reads anything.
__device__ __forceinline__ void let_next_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// The first statement of each kernel (before any global memory access), the tail launch's excepted.
__device__ __forceinline__ void wait_previous_grid() {
  wait_for_previous_grid();
  let_next_grid_launch();
}

// A launch configuration on the current stream with the dependent-launch attribute (sm_90 and later), room
// for one more attribute (add: the cluster kernel's cluster shape), and the launch itself.
class DependentLaunch {
 public:
  DependentLaunch(dim3 grid, dim3 block, size_t smem) {
    cfg_.gridDim = grid;
    cfg_.blockDim = block;
    cfg_.dynamicSmemBytes = smem;
    cfg_.stream = at::cuda::getCurrentCUDAStream();
    cfg_.attrs = attrs_;
    if (enabled()) {
      cudaLaunchAttribute a;
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
      add(a);
    }
  }
  DependentLaunch(const DependentLaunch&) = delete;  // cfg_ points into this object
  DependentLaunch& operator=(const DependentLaunch&) = delete;

  void add(const cudaLaunchAttribute& a) {
    TORCH_INTERNAL_ASSERT(cfg_.numAttrs < 2, "rl_losses: DependentLaunch holds two attributes");
    attrs_[cfg_.numAttrs++] = a;
  }

  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), Args&&... args) {
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg_, kernel, std::forward<Args>(args)...));
  }

 private:
  // Only on sm_90 itself, whose machine code setup.py always builds with the waits: another device could
  // run the kernels from PTX of an older architecture, compiled without them.
  static bool enabled() { return at::cuda::getCurrentDeviceProperties()->major == 9; }
  cudaLaunchAttribute attrs_[2];
  cudaLaunchConfig_t cfg_ = {};
};

// compute(), the occupancy calculator's answer for `kernel` on the current device with parameters (a, b),
// once per process: it does not change, and asking it took host time on every call of an op.
inline int occupancy_once(const void* kernel, int a, int b, const std::function<int()>& compute) {
  static std::mutex mutex;
  static std::map<std::tuple<uintptr_t, int, int, int>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<uintptr_t>(kernel), c10::cuda::current_device(), a, b);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  return it != known.end() ? it->second : known.emplace(key, compute()).first->second;
}

}  // namespace cuda
}  // namespace rl_losses
