// _scatter_rows on CUDA (kept_set.h): a block per row builds the row a tile at a time in shared memory (zeros, the
// row's values at their ids in the tile) and writes each tile out with 16-byte stores. Every byte of the result is
// then written once, by full-sector stores: scattered 2-byte stores into global memory after a zero fill would
// reach L2 after the row's start was evicted (the blocks in flight write far more than L2 holds while one row is
// filled), each a partial-sector write that HBM's ECC turns into a read-modify-write. Registered in
// cuda_registration.cpp.
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include <cstdint>

#include "common/cuda_backends.h"
#include "common/dependent_launch.cuh"
#include "kept_set/kept_set.h"

namespace rl_losses {
namespace {

constexpr int kThreads = 256;
// 32 KB of shared memory per block: 7 blocks (1792 threads) per SM on sm_90, and a 128256-wide bf16 row in 8 tiles.
constexpr int kTileBytes = 32768;
constexpr int kTileVecs = kTileBytes / 16;
// Ids each thread keeps in registers across a row's tiles (a top_k = 1024 kept set and its label: 1025 ids, all but
// one held); the others are read again for each tile, from L1.
constexpr int kHeld = 4;

// Rows are laid out from `base`, the 16-byte boundary at or before the row's start, so that a tile's vectors are
// 16-byte aligned in global memory whatever V is: position p of the tile sequence is base[p], the row being
// positions [lead, lead + vocab). Positions before `lead` belong to the row before and are never written.
// At least 4 blocks per SM: ptxas then fits the kernel in 56-60 registers without spills, where on its own it took
// 72-80 (3 blocks).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 4)
    scatter_rows_kernel(const int64_t* __restrict__ ids, const scalar_t* __restrict__ values,
                        scalar_t* __restrict__ out, int64_t n_rows, int64_t k, int64_t vocab) {
  constexpr int kTile = kTileBytes / sizeof(scalar_t);
  constexpr int kVec = 16 / sizeof(scalar_t);
  __shared__ uint4 tile_mem[kTileVecs];
  scalar_t* tile = reinterpret_cast<scalar_t*>(tile_mem);
  cuda::wait_previous_grid();
  for (int q = threadIdx.x; q < kTileVecs; q += kThreads) tile_mem[q] = make_uint4(0, 0, 0, 0);
  // The tile is all zeros between tiles: each tile's copy-out zeroes what it read.
  __syncthreads();
  for (int64_t r = blockIdx.x; r < n_rows; r += gridDim.x) {
    const int64_t* row_ids = ids + r * k;
    const scalar_t* row_values = values + r * k;
    scalar_t* row = out + r * vocab;  // 64-bit offsets: rows * vocab exceeds 2^31 at N = 16384, V = 128256
    const int lead = static_cast<int>(reinterpret_cast<uintptr_t>(row) % 16 / sizeof(scalar_t));
    scalar_t* base = row - lead;
    const int64_t end = lead + vocab;
    // An id's position (-1: nothing to store), the ids asserted in range (checked on the CPU; on a GPU reading them
    // first would synchronise). Were asserts compiled out, an id past the row would land at or past `end`, where
    // nothing is stored.
    auto position = [&](int64_t j) -> int64_t {
      const int64_t id = row_ids[j];
      CUDA_KERNEL_ASSERT(id >= -1 && id < vocab && "rl_losses: an id of _scatter_rows is outside [-1, vocab_size)");
      return scatter_rows_stores(id, row_values[j]) ? lead + id : -1;
    };
    int64_t held_pos[kHeld];
    scalar_t held_value[kHeld];
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t j = threadIdx.x + int64_t(i) * kThreads;
      held_pos[i] = j < k ? position(j) : -1;
      held_value[i] = j < k ? row_values[j] : scalar_t(0);
    }
    for (int64_t t0 = 0; t0 < end; t0 += kTile) {
      const int64_t n = std::min<int64_t>(kTile, end - t0);  // the tile's positions [t0, t0 + n)
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        const int64_t p = held_pos[i] - t0;
        if (held_pos[i] >= 0 && p >= 0 && p < n) tile[p] = held_value[i];
      }
      for (int64_t j = threadIdx.x + int64_t(kHeld) * kThreads; j < k; j += kThreads) {
        const int64_t pos = position(j), p = pos - t0;
        if (pos >= 0 && p >= 0 && p < n) tile[p] = row_values[j];
      }
      __syncthreads();
      // Out, and the tile zeroed behind: a whole vector where it lies inside the row, else element by element (the
      // row's first and last vectors where V is not a multiple of one).
      for (int q = threadIdx.x; int64_t(q) * kVec < n; q += kThreads) {
        const int64_t p0 = t0 + int64_t(q) * kVec;
        if (p0 >= lead && p0 + kVec <= end) {
          *reinterpret_cast<uint4*>(base + p0) = tile_mem[q];
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if (p0 + e >= lead && p0 + e < end) base[p0 + e] = tile[q * kVec + e];
          }
        }
        tile_mem[q] = make_uint4(0, 0, 0, 0);
      }
      __syncthreads();  // the tile read and zeroed before the next one's values go in
    }
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
