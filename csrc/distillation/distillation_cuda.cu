// CUDA back-end of distillation (registered in csrc/cuda_registration.cpp). A call that computes the gradient
// runs on sm_90 as one cluster kernel that reads both rows once (distillation_cluster.cuh, where it applies);
// otherwise here: one kernel per pass over all rows (statistics of both softmaxes, JSD's sums, the gradient),
// the O(N) row step between them (CudaRunner).
//
// Each kernel gives one block to a row at a time (a persistent grid looping over rows) and streams the
// student's and the teacher's rows together: 16-byte loads of the student (and the teacher's elements at the
// same columns) where both rows are aligned and V is a whole number of vectors, element by element otherwise;
// fp32 accumulation, 64-bit row offsets. The passes read the rows again from DRAM.
#include "common/row_pass_cuda.cuh"
#include "distillation/distillation.h"
#include "distillation/distillation_block.cuh"
#include "distillation/distillation_cluster_launch.cuh"

#include <ATen/Dispatch.h>

#include <type_traits>

namespace rl_losses {
namespace {

using distill_cuda::add_group;
using distill_cuda::block_combine;
using distill_cuda::block_sum;
using distill_cuda::load_elems;
using distill_cuda::store_rounded;

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
  const acc_t* head;       // (N, kDistHeadFields): the fused head's other terms (kHead only)
  const int64_t* labels;   // (N,) their labels (kHead only)
  DistillOptions<acc_t> opt;
  bool vec;  // the 16-byte vector path applies (both rows aligned, V a multiple of the vector)
};

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

// kHead: the gradient pass adds the fused head's terms (distill_head_grad); compiled only for its calls.
template <int kThreads, int kVec, DistillPass kPass, DistillKind kKind, bool kHead, typename student_t,
          typename teacher_t, typename acc_t>
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
        add_group(st, x, y);
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
      DistillHeadCoef<acc_t> h{acc_t(0), acc_t(0), acc_t(0)};
      if constexpr (kHead) h = DistillHeadCoef<acc_t>::load(v.head + row * kDistHeadFields);
      const bool head_on = kHead && !h.zero();
      if (w == acc_t(0) && !head_on) {  // a masked row: exact zeros, its logits not read
        for (int64_t j = threadIdx.x; j < v.vocab; j += kThreads) g[j] = student_t(0);
        continue;
      }
      const acc_t s = v.opt.scale, lse_s = table[kDistLseS], lse_t = table[kDistLseT], c = table[kDistConst];
      const int64_t label = kHead ? v.labels[row] : -1;
      auto store = [&](int64_t j0, const auto& out) {
        constexpr int n = std::extent_v<std::remove_reference_t<decltype(out)>>;
        if constexpr (n == 1) {
          g[j0] = static_cast<student_t>(out[0]);
        } else {
          store_rounded(g + j0, out);
        }
      };
      if constexpr (!kHead) {
        const acc_t sw = s * w;
        for_row<kThreads, kVec>(v, z, zt, [&](int64_t j0, const auto& x, const auto& y) {
          constexpr int n = std::extent_v<std::remove_reference_t<decltype(x)>>;
          acc_t out[n];
#pragma unroll
          for (int k = 0; k < n; ++k) out[k] = sw * distill_grad<kKind>(v.opt, x[k], y[k], lse_s, lse_t, c);
          store(j0, out);
        });
      } else {
        // A row of distillation weight 0 still reads the teacher's (any values: unused) for the shared loop.
        const DistillHeadCoef<acc_t> sh = h.scaled(s);
        const acc_t sw = s * w;
        const auto sweep = [&](auto distill) {
          constexpr bool kDistill = decltype(distill)::value;
          for_row<kThreads, kVec>(v, z, zt, [&](int64_t j0, const auto& x, const auto& y) {
            constexpr int n = std::extent_v<std::remove_reference_t<decltype(x)>>;
            acc_t out[n];
#pragma unroll
            for (int k = 0; k < n; ++k) {
              out[k] = distill_head_grad<kKind, kDistill>(v.opt, x[k], y[k], lse_s, lse_t, c, sw, sh, j0 + k == label);
            }
            store(j0, out);
          });
        };
        if (w != acc_t(0)) {
          sweep(std::true_type{});
        } else {
          sweep(std::false_type{});
        }
      }
    }
    __syncthreads();  // the shared scratch is reused by the next row
  }
}

bool aligned(const void* p, int64_t stride_bytes, int64_t to) {
  return reinterpret_cast<uintptr_t>(p) % to == 0 && stride_bytes % to == 0;
}

template <DistillPass kPass, DistillKind kKind, bool kHead = false>
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
    v.head = kHead ? s.head_coef.const_data_ptr<acc_t>() : nullptr;
    v.labels = kHead ? s.head_labels.const_data_ptr<int64_t>() : nullptr;
    v.opt = distill_options_as<acc_t>(s.opt);
    const int64_t teacher_bytes = std::min<int64_t>(16, kVec * sizeof(teacher_t));
    v.vec = v.vocab % kVec == 0 && aligned(v.z, v.rs * sizeof(student_t), 16) &&
            aligned(v.zt, v.rt * sizeof(teacher_t), teacher_bytes) &&
            (!grad || aligned(v.grad, v.rg * sizeof(student_t), 16));
    const auto kernel = distill_kernel<kThreads, kVec, kPass, kKind, kHead, student_t, teacher_t, acc_t>;
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

// The fused pass (distillation_cluster.cuh) where it applies: every output and the gradient in one read.
bool cluster_rows_cuda(const DistillState& s) {
  bool done = false;
  RL_LOSSES_DISPATCH_DISTILL(s.logits.scalar_type(), s.teacher.scalar_type(), [&] {
    switch (s.opt.kind) {
      case DistillKind::kForwardKl:
        done = distill_cuda::launch_distill_cluster<DistillKind::kForwardKl, student_t, teacher_t>(s);
        break;
      case DistillKind::kCrossEntropy:
        done = distill_cuda::launch_distill_cluster<DistillKind::kCrossEntropy, student_t, teacher_t>(s);
        break;
      case DistillKind::kReverseKl:
        done = distill_cuda::launch_distill_cluster<DistillKind::kReverseKl, student_t, teacher_t>(s);
        break;
      default:
        done = distill_cuda::launch_distill_cluster<DistillKind::kJsd, student_t, teacher_t>(s);
        break;
    }
  });
  return done;
}

template <bool kHead>
void grad_cuda_kind(const DistillState& s) {
  switch (s.opt.kind) {
    case DistillKind::kForwardKl:
    case DistillKind::kCrossEntropy:  // the same gradient as the forward KL
      return launch<DistillPass::kGrad, DistillKind::kForwardKl, kHead>(s);
    case DistillKind::kReverseKl:
      return launch<DistillPass::kGrad, DistillKind::kReverseKl, kHead>(s);
    default:
      return launch<DistillPass::kGrad, DistillKind::kJsd, kHead>(s);
  }
}

void rows_cuda(const DistillState& s) {
  if (cluster_rows_cuda(s)) return;
  if (!s.stats_given) stats_cuda(s);
  if (s.opt.kind == DistillKind::kJsd && !s.jsd_given) jsd_sums_cuda(s);
  AT_DISPATCH_FLOATING_TYPES(s.row_loss.scalar_type(), "distillation", [&] {
    CudaRunner::for_each(s.logits.size(0), make_distill_row_step<scalar_t>(s));
  });
  if (s.grad.defined()) grad_cuda_kind<false>(s);
}

// The gradient pass alone, with the fused head's terms (DistillBackend::grad).
void grad_cuda(const DistillState& s) {
  TORCH_INTERNAL_ASSERT(s.head_coef.defined() && s.head_labels.defined(), "distillation: grad without head terms");
  grad_cuda_kind<true>(s);
}

}  // namespace

const DistillBackend& distill_backend_cuda() {
  static constexpr DistillBackend backend{&stats_cuda, &jsd_sums_cuda, &rows_cuda, &grad_cuda};
  return backend;
}

}  // namespace rl_losses
