"""Host cost of the ways to get a small tensor, of a device guard, the current stream and one launch, timed in C++
(no Python in the loop; the extension is compiled on first use). The profiler's per-event times include its own cost;
these do not.

    python3 benchmarks/host_alloc.py
"""
import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <chrono>
using clk = std::chrono::steady_clock;
template <class F> double per(int n, F f) {
  for (int i = 0; i < 200; ++i) f();
  auto t0 = clk::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::micro>(clk::now() - t0).count() / n;
}
std::vector<double> run(bool cuda, int n) {
  auto opts = at::TensorOptions().dtype(at::kFloat).device(cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  std::vector<double> r;
  r.push_back(per(n, [&] { auto t = at::empty({}, opts); }));                                    // 0 at::empty
  r.push_back(per(n, [&] { auto t = cuda ? at::detail::empty_cuda({}, at::kFloat, opts.device(), std::nullopt)
                                         : at::detail::empty_cpu({}, at::kFloat, false); }));   // 1 detail::empty_*
  r.push_back(per(n, [&] {                                                                         // 2 12 x at::empty
    at::Tensor t[12]; for (auto& x : t) x = at::empty({}, opts); }));
  r.push_back(per(n, [&] {                                                                         // 3 1 empty + 12 select
    auto b = at::empty({12}, opts); at::Tensor t[12]; for (int k = 0; k < 12; ++k) t[k] = b.select(0, k); }));
  r.push_back(per(n, [&] {                                                                         // 4 1 empty + 12 from_blob
    auto b = at::empty({12}, opts); at::Tensor t[12];
    for (int k = 0; k < 12; ++k) t[k] = at::from_blob(b.data_ptr<float>() + k, {}, [b](void*) {}, opts); }));
  r.push_back(per(n, [&] {                                                                         // 5 12 x detail::empty
    at::Tensor t[12]; for (auto& x : t) x = cuda ? at::detail::empty_cuda({}, at::kFloat, opts.device(), std::nullopt)
                                                   : at::detail::empty_cpu({}, at::kFloat, false); }));
  if (cuda) {
    r.push_back(per(n, [&] { c10::cuda::CUDAGuard g(0); }));                                      // 6 device guard
    r.push_back(per(n, [&] { auto s = c10::cuda::getCurrentCUDAStream(); (void)s; }));           // 7 current stream
    r.push_back(per(n, [&] { int d; cudaGetDevice(&d); }));                                       // 8 cudaGetDevice
    auto x = at::empty({8}, opts);
    r.push_back(per(n, [&] { x.fill_(1); }));                                                     // 9 fill_ (1 launch)
    r.push_back(per(n, [&] { auto v = x.view({2, 4}); }));                                        // 10 view
  }
  return r;
}
'''
m = load_inline("alloc_probe", src, functions=["run"], with_cuda=True, extra_cflags=["-O2"], verbose=False)
names = ["at::empty({})", "at::detail::empty_*({})", "12 x at::empty({})", "at::empty({12}) + 12 select",
         "at::empty({12}) + 12 from_blob", "12 x at::detail::empty_*", "CUDAGuard(0)", "getCurrentCUDAStream",
         "cudaGetDevice", "x.fill_(1) (one launch)", "x.view"]
for cuda in (False, True):
    best = None
    for _ in range(3):
        r = m.run(cuda, 20000)
        best = r if best is None else [min(a, b) for a, b in zip(best, r)]
    print("== cuda" if cuda else "== cpu", "(us per item, best of 3 x 20000)")
    for n, v in zip(names, best): print(f"  {n:34s} {v:8.3f}")
