// CPU registration of topk_distillation and linear_topk_distillation: the steps of topk_distillation.h on CpuRunner.
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "topk_distillation/topk_distillation.h"

namespace rl_losses {
namespace {

void rows_cpu(const RowPassArgs& args, const TopkRows& rows, bool gather) {
  topk_distillation_rows<CpuRunner>(args, rows, gather, [](const auto& g, int64_t n) { CpuRunner::for_each(n, g); });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  register_loss<TopkDistillationLoss<rows_cpu>>(m);
  register_linear_loss<TopkDistillationLoss<rows_cpu>, linear_backend_cpu>(m);
}

}  // namespace rl_losses
