// _scatter_rows: dense (..., V) rows, each zero but for K values at K ids, written in one pass. It is the gradient
// of rl_losses.kept_token_log_probs (python/rl_losses/kept_set.py), whose K + 1 columns' values go to their ids:
// one pass over the rows instead of a zero fill and a scatter_add_, and plain stores instead of atomic adds.
//
// A value is written at its id where the id is >= 0 (-1: padding) and the value nonzero. The row is zero already,
// so leaving the zeros out changes nothing, and an id listed twice in a row (kept_set.py's padding gathers id 0,
// and a listed label is masked at its own column, both with the value 0) has its one nonzero copy written with no
// zero racing it (a GPU orders two stores to one address arbitrarily). So the result is
// zeros.scatter_add_(-1, ids, values) wherever no id holds two nonzero values in one row: the caller's promise
// (kept_token_log_probs checks that its ids are distinct), not checked here.
#pragma once

#include "op_args.h"

#include <ATen/core/Tensor.h>

namespace rl_losses {

// Whether `value` is stored at `id`: the one rule of both back-ends.
template <typename T>
C10_HOST_DEVICE inline bool scatter_rows_stores(int64_t id, T value) {
  return id >= 0 && value != T(0);
}

// The validated call: (rows, K) ids and values, (rows, vocab) out, each contiguous; ids in [-1, vocab) (checked on
// the CPU; a GPU kernel asserts it on the device).
struct ScatterRowsInputs {
  at::Tensor ids;     // int64
  at::Tensor values;  // float32/float64/bfloat16/float16
  at::Tensor out;     // values' dtype
};
using ScatterRowsKernel = void (*)(const ScatterRowsInputs&);

RL_LOSSES_ARG_GROUP(ScatterRowsArgs, RL_LOSSES_SCATTER_ROWS_INPUT)

// Checks, flattens, allocates the (..., vocab_size) result and runs `kernel` on it (not for zero rows).
at::Tensor scatter_rows(const ScatterRowsArgs& a, ScatterRowsKernel kernel);

// The op's kernel over one device's (the CPU and CUDA registrations).
template <ScatterRowsKernel kKernel>
void scatter_rows_op(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  GradResult r;
  r.grad = scatter_rows(args.read<ScatterRowsArgs>(), kKernel);
  r.write(args);
  args.push_results();
}

}  // namespace rl_losses
