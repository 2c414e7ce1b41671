// CUDA back-end of distillation (registered in csrc/cuda_registration.cpp): one kernel per pass over all rows
// (statistics of both softmaxes, JSD's sums, the gradient), the O(N) row step between them (CudaRunner).
//
// Each kernel gives one block to a row at a time (a persistent grid looping over rows) and streams the
// student's and the teacher's rows together: 16-byte loads of the student (and the teacher's elements at the
// same columns) where both rows are aligned and V is a whole number of vectors, element by element otherwise;
// fp32 accumulation, 64-bit row offsets. The passes read the rows again from DRAM: the floor of one read of
// each tensor would need the rows held on chip between passes (the cross-entropy's cluster kernel does that
// for one tensor; a pair of rows of V = 128256 in bf16 is 513 KB).
#include "common/row_pass_cuda.cuh"
#include "distillation/distillation.h"

#include <ATen/Dispatch.h>

#include <type_traits>

namespace rl_losses {
namespace {

enum class DistillPass { kStats, kJsdSums, kGrad };

template <typename student_t, typename teacher_t, typename acc_t>
struct DistillView {
  const student_t* z;
  const teacher_t* zt;
  student_t* grad;
  int64_t rs, rt, rg;  // row strides (elements)
  int64_t n_rows, vocab;
  const acc_t* mask;       // (N,) or null
  acc_t* stats;            // (N, 7)
  acc_t* sums;             // (N, 2) or null
  const acc_t* grad_rows;  // (N, kDistGradFields)
  DistillOptions<acc_t> opt;
  bool vec;  // the 16-byte vector path applies (both rows aligned, V a multiple of the vector)
};

// K elements of T from p in as few aligned loads as their bytes allow (16, 8 or 4 bytes each).
template <typename T, int K>
__device__ inline void load_elems(const T* p, T (&out)[K]) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    uint4 raw[kBytes / 16];
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
    memcpy(out, raw, kBytes);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    memcpy(out, &raw, kBytes);
  } else {
    static_assert(kBytes == 4, "4, 8 or a multiple of 16 bytes");
    const unsigned raw = *reinterpret_cast<const unsigned*>(p);
    memcpy(out, &raw, kBytes);
  }
}

template <typename acc_t>
__device__ inline DistillStats<acc_t> shfl_xor(const DistillStats<acc_t>& s, int m) {
  return {__shfl_xor_sync(0xffffffffu, s.ms, m), __shfl_xor_sync(0xffffffffu, s.ss, m),
          __shfl_xor_sync(0xffffffffu, s.mt, m), __shfl_xor_sync(0xffffffffu, s.st, m),
          __shfl_xor_sync(0xffffffffu, s.wt, m), __shfl_xor_sync(0xffffffffu, s.ws, m),
          __shfl_xor_sync(0xffffffffu, s.hx, m)};
}

// The block's combined state, in thread 0 (warps by shuffles, then warp 0 over the warps' states).
template <int kThreads, typename acc_t>
__device__ inline DistillStats<acc_t> block_combine(DistillStats<acc_t> s, DistillStats<acc_t>* scratch) {
  constexpr int kWarps = kThreads / 32;
  for (int m = 16; m > 0; m >>= 1) s = DistillStats<acc_t>::combine(s, shfl_xor(s, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? scratch[lane] : DistillStats<acc_t>::empty();
    for (int m = 16; m > 0; m >>= 1) s = DistillStats<acc_t>::combine(s, shfl_xor(s, m));
  }
  return s;
}

template <int kThreads, typename acc_t>
__device__ inline acc_t block_sum(acc_t x, acc_t* scratch) {
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : acc_t(0);
  if (warp == 0) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  }
  return x;
}

// f(j0, x[kVec], y[kVec]) over the row's columns j0, j0+1, ... in groups of kVec (vector path), or f on groups
// of one element (element path), each thread taking every kThreads-th group.
template <int kThreads, int kVec, typename student_t, typename teacher_t, typename acc_t, typename F>
__device__ inline void for_row(const DistillView<student_t, teacher_t, acc_t>& v, const student_t* z,
                               const teacher_t* zt, const F& f) {
  if (v.vec) {
    const int64_t n_vec = v.vocab / kVec;
    for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) {
      student_t a[kVec];
      teacher_t b[kVec];
      load_elems(z + i * kVec, a);
      load_elems(zt + i * kVec, b);
      acc_t x[kVec], y[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        x[k] = static_cast<acc_t>(a[k]) * v.opt.scale;
        y[k] = static_cast<acc_t>(b[k]) * v.opt.inv_temperature;
      }
      f(i * kVec, x, y);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v.vocab; j += kThreads) {
      const acc_t x[1] = {static_cast<acc_t>(z[j]) * v.opt.scale};
      const acc_t y[1] = {static_cast<acc_t>(zt[j]) * v.opt.inv_temperature};
      f(j, x, y);
    }
  }
}

template <int kThreads, int kVec, DistillPass kPass, DistillKind kKind, typename student_t, typename teacher_t,
          typename acc_t>
__global__ void __launch_bounds__(kThreads) distill_kernel(DistillView<student_t, teacher_t, acc_t> v) {
  __shared__ DistillStats<acc_t> scratch[kThreads / 32];
  __shared__ acc_t sum_scratch[kThreads / 32];
  cuda::wait_previous_grid();
  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const student_t* z = v.z + row * v.rs;
    const teacher_t* zt = v.zt + row * v.rt;
    const bool masked = v.mask != nullptr && v.mask[row] == acc_t(0);
    if constexpr (kPass == DistillPass::kStats) {
      if (masked) continue;  // the row step writes zeros for it without reading its statistics
      DistillStats<acc_t> st = DistillStats<acc_t>::empty();
      for_row<kThreads, kVec>(v, z, zt, [&](int64_t, const auto& x, const auto& y) {
        constexpr int n = std::extent_v<std::remove_reference_t<decltype(x)>>;
        acc_t mx = x[0], my = y[0];
#pragma unroll
        for (int k = 1; k < n; ++k) {
          mx = ::fmax(mx, x[k]);
          my = ::fmax(my, y[k]);
        }
        st.rescale(mx, my);
#pragma unroll
        for (int k = 0; k < n; ++k) st.add_at_max(x[k], y[k]);
      });
      st = block_combine<kThreads>(st, scratch);
      if (threadIdx.x == 0) st.store(v.stats + row * DistillStats<acc_t>::kFields);
    } else if constexpr (kPass == DistillPass::kJsdSums) {
      if (masked) continue;
      const auto st = DistillStats<acc_t>::load(v.stats + row * DistillStats<acc_t>::kFields);
      const acc_t lse_s = st.lse_student(), lse_t = st.lse_teacher();
      acc_t loss = 0, q_sum = 0;
      for_row<kThreads, kVec>(v, z, zt, [&](int64_t, const auto& x, const auto& y) {
        constexpr int n = std::extent_v<std::remove_reference_t<decltype(x)>>;
#pragma unroll
        for (int k = 0; k < n; ++k) {
          const JsdTerms<acc_t> t = jsd_terms(v.opt, x[k] - lse_s, y[k] - lse_t);
          loss += t.loss;
          q_sum += t.q_term;
        }
      });
      loss = block_sum<kThreads>(loss, sum_scratch);
      __syncthreads();  // sum_scratch is reused
      q_sum = block_sum<kThreads>(q_sum, sum_scratch);
      if (threadIdx.x == 0) {
        v.sums[2 * row] = loss;
        v.sums[2 * row + 1] = q_sum;
      }
    } else {
      const acc_t* table = v.grad_rows + row * kDistGradFields;
      const acc_t w = table[kDistWeight];
      student_t* g = v.grad + row * v.rg;
      if (w == acc_t(0)) {  // a masked row: exact zeros, its logits not read
        for (int64_t j = threadIdx.x; j < v.vocab; j += kThreads) g[j] = student_t(0);
        continue;
      }
      const acc_t sw = v.opt.scale * w, lse_s = table[kDistLseS], lse_t = table[kDistLseT], c = table[kDistConst];
      for_row<kThreads, kVec>(v, z, zt, [&](int64_t j0, const auto& x, const auto& y) {
        constexpr int n = std::extent_v<std::remove_reference_t<decltype(x)>>;
        student_t out[n];
#pragma unroll
        for (int k = 0; k < n; ++k) {
          out[k] = static_cast<student_t>(sw * distill_grad<kKind>(v.opt, x[k], y[k], lse_s, lse_t, c));
        }
        if constexpr (n == 1) {
          g[j0] = out[0];
        } else {
          static_assert(n * sizeof(student_t) == 16, "16-byte student vectors");
          uint4 raw;
          memcpy(&raw, out, sizeof(raw));
          *reinterpret_cast<uint4*>(g + j0) = raw;
        }
      });
    }
    __syncthreads();  // the shared scratch is reused by the next row
  }
}

bool aligned(const void* p, int64_t stride_bytes, int64_t to) {
  return reinterpret_cast<uintptr_t>(p) % to == 0 && stride_bytes % to == 0;
}

template <DistillPass kPass, DistillKind kKind>
void launch(const DistillState& s) {
  const int64_t n = s.logits.size(0);
  if (n == 0) return;
  RL_LOSSES_DISPATCH_DISTILL(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    constexpr int kThreads = 256;
    constexpr int kVec = 16 / sizeof(student_t);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<acc_t>() : nullptr; };
    DistillView<student_t, teacher_t, acc_t> v;
    v.z = s.logits.const_data_ptr<student_t>();
    v.zt = s.teacher.const_data_ptr<teacher_t>();
    const bool grad = kPass == DistillPass::kGrad;
    v.grad = grad ? s.grad.data_ptr<student_t>() : nullptr;
    v.rs = s.logits.stride(0);
    v.rt = s.teacher.stride(0);
    v.rg = grad ? s.grad.stride(0) : 0;
    v.n_rows = n;
    v.vocab = s.logits.size(1);
    v.mask = ptr(s.mask);
    v.stats = ptr(s.stats);
    v.sums = ptr(s.jsd_sums);
    v.grad_rows = ptr(s.grad_rows);
    v.opt = distill_options_as<acc_t>(s.opt);
    const int64_t teacher_bytes = std::min<int64_t>(16, kVec * sizeof(teacher_t));
    v.vec = v.vocab % kVec == 0 && aligned(v.z, v.rs * sizeof(student_t), 16) &&
            aligned(v.zt, v.rt * sizeof(teacher_t), teacher_bytes) &&
            (!grad || aligned(v.grad, v.rg * sizeof(student_t), 16));
    const auto kernel = distill_kernel<kThreads, kVec, kPass, kKind, student_t, teacher_t, acc_t>;
    // A persistent grid of as many blocks as can be resident (asked once per kernel): rows are dealt out
    // statically, so a block of a second wave would start its rows late.
    static const int per_sm = [&] {
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, 0));
      return std::max(blocks_per_sm, 1);
    }();
    const int64_t blocks = std::min<int64_t>(
        n, static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * per_sm);
    cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(kernel, v);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void stats_cuda(const DistillState& s) { launch<DistillPass::kStats, DistillKind::kForwardKl>(s); }
void jsd_sums_cuda(const DistillState& s) { launch<DistillPass::kJsdSums, DistillKind::kJsd>(s); }

void rows_cuda(const DistillState& s) {
  if (!s.stats_given) stats_cuda(s);
  if (s.opt.kind == DistillKind::kJsd && !s.jsd_given) jsd_sums_cuda(s);
  AT_DISPATCH_FLOATING_TYPES(s.row_loss.scalar_type(), "distillation", [&] {
    CudaRunner::for_each(s.logits.size(0), make_distill_row_step<scalar_t>(s));
  });
  if (!s.grad.defined()) return;
  switch (s.opt.kind) {
    case DistillKind::kForwardKl:
    case DistillKind::kCrossEntropy:  // the same gradient as the forward KL
      return launch<DistillPass::kGrad, DistillKind::kForwardKl>(s);
    case DistillKind::kReverseKl:
      return launch<DistillPass::kGrad, DistillKind::kReverseKl>(s);
    default:
      return launch<DistillPass::kGrad, DistillKind::kJsd>(s);
  }
}

}  // namespace

const DistillBackend& distill_backend_cuda() {
  static constexpr DistillBackend backend{&stats_cuda, &jsd_sums_cuda, &rows_cuda};
  return backend;
}

}  // namespace rl_losses
