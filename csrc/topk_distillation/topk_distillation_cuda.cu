// CUDA back-end of topk_distillation (registered in csrc/cuda_registration.cpp): the steps of topk_distillation.h on
// CudaRunner: the gather (a thread per row, K reads each), the row pass's kernels, the scatter (a thread per id).
#include "common/row_pass_cuda.cuh"
#include "topk_distillation/topk_distillation.h"

namespace rl_losses {

void topk_distillation_rows_cuda(const RowPassArgs& args, const TopkRows& rows, bool gather) {
  topk_distillation_rows<CudaRunner>(args, rows, gather);
}

}  // namespace rl_losses
