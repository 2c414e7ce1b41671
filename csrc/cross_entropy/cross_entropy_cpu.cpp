// CPU registration of the cross-entropy forward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "cross_entropy/cross_entropy.h"
#include "linear/linear.h"

namespace rl_losses {
namespace {

void rows_cpu(const RowPassArgs& args, const CrossEntropyRows& rows) {
  row_pass_cpu(args, "cross_entropy", [&](auto* tag) {
    return make_cross_entropy_epilogue<std::remove_pointer_t<decltype(tag)>>(rows);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_cross_entropy_forward", &CrossEntropyOps<rows_cpu>::forward);
  m.impl("_cross_entropy_forward_inplace", &CrossEntropyOps<rows_cpu>::forward_inplace);
  m.impl("_linear_cross_entropy_forward", &LinearCrossEntropyOp<rows_cpu, linear_backend_cpu>::forward);
}

}  // namespace rl_losses
