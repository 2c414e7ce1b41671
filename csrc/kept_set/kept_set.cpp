// _scatter_rows (kept_set.h): its checks, the CPU kernel and its registration (the CUDA kernel is kept_set_cuda.cu,
// registered in cuda_registration.cpp).
#include "kept_set/kept_set.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "common/boxed_kernel.h"
#include "common/row_pass.h"

namespace rl_losses {

at::Tensor scatter_rows(const ScatterRowsArgs& a, ScatterRowsKernel kernel) {
  const char* op = "_scatter_rows";
  const at::Tensor &ids = a.ids, &values = a.values;
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, ": ids must be an int64 tensor, got ", ids.scalar_type());
  const auto dtype = values.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": values must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(ids.dim() >= 1 && ids.sizes() == values.sizes(), op, ": ids and values must have one shape (..., K), "
              "got ids ", ids.sizes(), " and values ", values.sizes());
  TORCH_CHECK(a.vocab_size >= 0, op, ": vocab_size must be >= 0, got ", a.vocab_size);
  TORCH_CHECK(values.device() == ids.device(), op, ": values is on ", values.device(), " but ids is on ", ids.device());
  const int64_t k = ids.size(-1), n_rows = c10::multiply_integers(ids.sizes().begin(), ids.sizes().end() - 1);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end() - 1);
  shape.push_back(a.vocab_size);
  const at::Tensor out = new_empty(shape, values.options());
  // Any strides: the kernels read (rows, K) contiguous (a copy only where the caller's are not).
  ScatterRowsInputs in{ids.reshape({n_rows, k}).contiguous(), values.reshape({n_rows, k}).contiguous(),
                       out.view({n_rows, a.vocab_size})};
  if (ids.is_cpu()) {  // the ids' range, before any write (elsewhere reading it would synchronise: asserted there)
    const int64_t* p = in.ids.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < n_rows * k; ++i) {
      TORCH_CHECK(p[i] >= -1 && p[i] < a.vocab_size, op, ": ids: id ", p[i], " at row ", i / k, ", position ", i % k,
                  " is outside [-1, ", a.vocab_size, ") (-1: padding)");
    }
  }
  if (n_rows > 0 && a.vocab_size > 0) kernel(in);
  return out;
}

namespace {

void scatter_rows_cpu(const ScatterRowsInputs& in) {
  const int64_t n = in.out.size(0), vocab = in.out.size(1), k = in.ids.size(1);
  RL_LOSSES_DISPATCH_LOGITS(in.values.scalar_type(), "_scatter_rows", [&] {
    const int64_t* ids = in.ids.const_data_ptr<int64_t>();
    const scalar_t* values = in.values.const_data_ptr<scalar_t>();
    scalar_t* out = in.out.data_ptr<scalar_t>();
    // About 64 KB written per task: short rows are not one task each.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / ((vocab + k) * int64_t(sizeof(scalar_t))));
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = out + r * vocab;
        std::memset(row, 0, vocab * sizeof(scalar_t));  // all-zero bytes: +0 in every floating type
        for (int64_t j = r * k; j < (r + 1) * k; ++j) {
          if (scatter_rows_stores(ids[j], values[j])) row[ids[j]] = values[j];
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_scatter_rows", boxed<&scatter_rows_op<&scatter_rows_cpu>>());
}

}  // namespace rl_losses
