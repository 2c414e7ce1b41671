// CUDA back-end of the fused head (registered in csrc/cuda_registration.cpp): the CE/GRPO row kernels with the
// combined epilogue; the GSPO term uses GSPO's own back-end (gspo_cuda.cu) for its statistics and steps, the
// distillation term distillation's passes (distillation_cuda.cu) or its cluster kernel with the head's step
// (fused_head_distill.h).
#include "fused_head/fused_head_distill.h"
#include "common/cuda_backends.h"
#include "common/row_pass_cuda.cuh"
#include "distillation/distillation_cluster_launch.cuh"

namespace rl_losses {
namespace {

// The distillation term and the others in distillation's cluster kernel, where it applies (its conditions,
// distillation_cluster.cuh) and the teacher has the student's dtype (the pairs compiled here; any other pair runs
// the separate passes). The kernel then reads every row: the head's step applies the distillation mask.
bool distill_fused_cuda(const FusedHeadRows& r, const FusedHeadDistillRows& d) {
  DistillState s = d.state;
  if (s.stats.scalar_type() != at::kFloat || s.teacher.scalar_type() != s.logits.scalar_type()) return false;
  s.mask = at::Tensor();
  const FusedHeadDistillStep<float> step = make_fused_head_distill_step<float>(r, d);
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, s.logits.scalar_type(), "fused_head", [&] {
    using student_t = scalar_t;
    switch (s.opt.kind) {
      case DistillKind::kForwardKl:
        done = distill_cuda::launch_distill_cluster<DistillKind::kForwardKl, student_t, student_t>(s, step);
        break;
      case DistillKind::kCrossEntropy:
        done = distill_cuda::launch_distill_cluster<DistillKind::kCrossEntropy, student_t, student_t>(s, step);
        break;
      case DistillKind::kReverseKl:
        done = distill_cuda::launch_distill_cluster<DistillKind::kReverseKl, student_t, student_t>(s, step);
        break;
      default:
        done = distill_cuda::launch_distill_cluster<DistillKind::kJsd, student_t, student_t>(s, step);
        break;
    }
  });
  return done;
}

}  // namespace

const FusedHeadBackend& fused_head_backend_cuda() {
  static constexpr FusedHeadBackend backend =
      FusedHeadBackendImpl<CudaRunner, gspo_backend_cuda, distill_backend_cuda, distill_fused_cuda>::backend();
  return backend;
}

}  // namespace rl_losses
