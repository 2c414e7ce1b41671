// How every back-end registers its boxed kernels: `boxed<F>()`, kernel F run below autograd and ADInplaceOrView.
//
// ATen's own back-end kernels run there: their autograd kernel sets it before it redispatches. Most of this
// library's ops have no autograd kernel (the forward ops that forward_backward and the autograd functions call, the
// statistics ops of the distributed layer, `_scale_grad_`): the dispatcher reaches their kernels through autograd's
// fallback, which leaves ADInplaceOrView on, so every ATen call inside a kernel (narrow, t, view, empty, mm) went
// through the autograd and ADInplaceOrView kernels again and each view recorded autograd's view metadata, a cost of
// host time only (on this library's CPU host, 2026-11-28: a small fused lm_head forward spent ~17 of its ~54 µs
// there). Nothing inside a kernel is differentiated: the op is the autograd unit.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

namespace rl_losses {

using BoxedKernel = void (*)(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack*);

template <BoxedKernel F>
struct BelowAutograd {
  static void call(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    at::AutoDispatchBelowADInplaceOrView guard;
    F(op, ks, stack);
  }
};

// Kernel F as a registrable function, through a back-end's wrapper (CUDA: the device guard of
// cuda_registration.cpp, around BelowAutograd).
template <BoxedKernel F, template <BoxedKernel> class Wrap = BelowAutograd>
torch::CppFunction boxed() {
  return torch::CppFunction::makeFromBoxedFunction<&Wrap<F>::call>();
}

}  // namespace rl_losses
