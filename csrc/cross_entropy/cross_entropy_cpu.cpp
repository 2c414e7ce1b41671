// CPU registration of the cross-entropy forward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "cross_entropy/cross_entropy.h"

namespace rl_losses {
namespace {

void rows_cpu(const RowPassArgs& args, const CrossEntropyRows& rows) {
  row_pass_cpu(args, "cross_entropy", [&](auto* tag) {
    return make_cross_entropy_epilogue<std::remove_pointer_t<decltype(tag)>>(rows);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  register_loss<CrossEntropyLoss<rows_cpu>>(m);
  register_linear_loss<CrossEntropyLoss<rows_cpu>, linear_backend_cpu>(m);
}

}  // namespace rl_losses
