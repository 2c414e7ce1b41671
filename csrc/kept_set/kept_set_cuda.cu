// _scatter_rows on CUDA (kept_set.h): a block per row zero-fills it with 16-byte stores and, after one barrier,
// stores the row's nonzero values at their ids. The row was written a moment before by the same block, so the
// scattered 2- or 4-byte stores land in L2 rather than each costing a DRAM read-modify-write. Registered in
// cuda_registration.cpp.
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include "common/cuda/vectors.cuh"
#include "common/cuda_backends.h"
#include "common/dependent_launch.cuh"
#include "kept_set/kept_set.h"

namespace rl_losses {
namespace {

constexpr int kThreads = 256;
// Ids and values each thread loads before the zero fill, so that their reads are in flight during its stores
// (K = 1024, a top_k = 1024 kept set, takes 4 per thread); the rest are read after it.
constexpr int kEarly = 4;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const int64_t* __restrict__ ids, const scalar_t* __restrict__ values,
                        scalar_t* __restrict__ out, int64_t n_rows, int64_t k, int64_t vocab) {
  cuda::wait_previous_grid();
  for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
    const int64_t* row_ids = ids + r * k;
    const scalar_t* row_values = values + r * k;
    scalar_t* row = out + r * vocab;  // 64-bit offsets: rows * vocab exceeds 2^31 at N = 16384, V = 128256
    int64_t early_id[kEarly];
    scalar_t early_value[kEarly];
#pragma unroll
    for (int i = 0; i < kEarly; ++i) {
      const int64_t j = threadIdx.x + int64_t(i) * kThreads;
      early_id[i] = j < k ? row_ids[j] : -1;
      early_value[i] = j < k ? row_values[j] : scalar_t(0);
    }
    cuda::block_zero_fill<kThreads>(row, vocab);
    // The zeros before the values: after the barrier every thread's zero stores are ordered before any value's
    // store to the same address.
    __syncthreads();
    auto store = [&](int64_t id, scalar_t v) {
      if (!scatter_rows_stores(id, v)) return;
      // Checked on the CPU; on a GPU reading the ids first would synchronise.
      CUDA_KERNEL_ASSERT(id < vocab && "rl_losses: an id of _scatter_rows is >= vocab_size");
      if (id < vocab) row[id] = v;
    };
#pragma unroll
    for (int i = 0; i < kEarly; ++i) store(early_id[i], early_value[i]);
    for (int64_t j = threadIdx.x + int64_t(kEarly) * kThreads; j < k; j += kThreads) store(row_ids[j], row_values[j]);
  }
}

}  // namespace

void scatter_rows_cuda(const ScatterRowsInputs& in) {
  const int64_t n = in.out.size(0), vocab = in.out.size(1), k = in.ids.size(1);
  // A block per row up to the grid's limit; beyond it, each block takes every gridDim-th row.
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(n, (int64_t(1) << 31) - 1));
  RL_LOSSES_DISPATCH_LOGITS(in.values.scalar_type(), "_scatter_rows", [&] {
    cuda::DependentLaunch(dim3(blocks), kThreads, 0)(scatter_rows_kernel<scalar_t>, in.ids.const_data_ptr<int64_t>(),
                                                      in.values.const_data_ptr<scalar_t>(), in.out.data_ptr<scalar_t>(),
                                                      n, k, vocab);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace rl_losses
