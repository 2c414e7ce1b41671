// CPU registration of `row_stats` and `_scale_grad_`.
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "common/row_stats.h"

namespace rl_losses {
namespace {

void stats_cpu(const RowPassArgs& args, const at::Tensor& out) {
  row_pass_cpu(args, "row_stats", [&](auto* tag) {
    using acc_t = std::remove_pointer_t<decltype(tag)>;
    return StoreStatsEpilogue<acc_t>{out.data_ptr<acc_t>()};
  });
}

// Backward of every fused loss: the gradient was computed in the forward for an upstream gradient of 1;
// scale it by the real one (a scalar, or one value per row for reduction="none"). Skipped when it is 1.
void scale_grad_cpu(const at::Tensor& grad, const at::Tensor& grad_output) {
  if (grad.numel() == 0) return;
  if (grad_output.numel() == 1 && grad_output.dim() == 0) {
    const double g = grad_output.item<double>();  // a CPU scalar: no device synchronisation involved
    if (g != 1.0) grad.mul_(g);
    return;
  }
  grad.mul_(grad_output.unsqueeze(-1));
}

}  // namespace

void labelled_count_cpu(const at::Tensor& target1d, const at::Tensor& out) {
  labelled_count_on<CpuRunner>(target1d, out);
}

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("row_stats", &row_stats_op<stats_cpu>);
  m.impl("_scale_grad_", &scale_grad_cpu);
}

}  // namespace rl_losses
