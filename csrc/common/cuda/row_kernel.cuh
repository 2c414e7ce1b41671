// The one-block-per-row kernels of the CUDA row pass (row_pass.h); row_pass_cuda.cuh chooses between them and
// the cluster kernel (cluster_kernel.cuh).
// - row_pass_kernel: any pass shape (statistics and/or gradient, or the epilogue alone), any row alignment: a
//   block streams its row with 16-byte loads between an element-wise head and tail. It runs the
//   statistics-only pass, the gradient-only pass over rows that are not aligned vectors, and a fused pass
//   that no cluster fits (which then reads its row twice).
// - grad_rows_kernel: the gradient-only pass (statistics from stats_in) over 16-byte aligned rows of whole
//   vectors (grad_rows_aligned), without a barrier per row.
// Both are persistent (block b takes the rows b, b + gridDim.x, ...) and dependent launches
// (dependent_launch.cuh): they wait for the kernel before them before touching global memory.
#pragma once

#include <algorithm>
#include <cstring>

#include "common/cuda/vectors.cuh"
#include "common/dependent_launch.cuh"

namespace rl_losses {
namespace cuda {

// One block per row: kStats streams the row (kUnroll 16-byte loads in flight per thread) into the block's
// statistics (stored in stats_out where given), else they are read from stats_in; thread 0 runs the epilogue;
// kGrad then streams the row again and writes the gradient. The row may start anywhere: an unaligned head and a
// tail go element by element.
// kFloor: the sampler's floor of each row in v.floor (row_pass.h): a logit below it counts as −inf and gets a zero
// gradient.
template <int kThreads, int kUnroll, typename scalar_t, typename label_t, typename acc_t, bool kStats,
          bool kGrad, bool kEntropy, bool kSmoothing, typename Epilogue, bool kFloor = false>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 4 : 1)  // 256 threads: >= 4 blocks (64 regs)
    row_pass_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi) {
  constexpr int kVec = 16 / sizeof(scalar_t);  // elements per 16-byte access
  using VecT = Pack<scalar_t, kVec>;
  __shared__ RowStats<acc_t> scratch[32];
  __shared__ GradCoef<acc_t> coef_shared;
  __shared__ acc_t max_shared, log_sumexp_shared;
  wait_previous_grid();

  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const scalar_t* x = v.logits + row * v.row_stride;
    const int64_t label = static_cast<int64_t>(v.target[row]);
    const int64_t local = label - v.vocab_start;
    const bool has_label = label >= 0 && local >= 0 && local < v.vocab;
    // Split the row into an unaligned head, a 16-byte-aligned body and a tail.
    const int64_t head = unaligned_head(x, v.vocab);
    const int64_t n_vec = (v.vocab - head) / kVec;
    const int64_t tail = head + n_vec * kVec;
    const acc_t floor = kFloor ? v.floor[row] : acc_t(0);
    auto kept = [&](acc_t z) { return kFloor && z < floor ? neg_inf<acc_t>() : z; };

    RowStats<acc_t> st = RowStats<acc_t>::empty();
    if constexpr (kStats) {
      // An epilogue that skips unlabelled rows gets them without statistics: the row is not read.
      if (!(Epilogue::kSkipsUnlabelled && label < 0)) {
        for (int64_t j = threadIdx.x; j < head; j += kThreads)
          st.template add<kEntropy, kSmoothing>(kept(static_cast<acc_t>(x[j])), v.scale);
        const VecT* xv = reinterpret_cast<const VecT*>(x + head);
        // kUnroll independent 16-byte loads are issued before any is used, to keep enough bytes in flight.
        for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += kThreads * kUnroll) {
          VecT buf[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * kThreads;
            if (i < n_vec) buf[u] = load_vec(&xv[i]);
          }
          // Two vectors per online-softmax chunk where both are in the row (one with the entropy or smoothing
          // sums, and never 4: beyond the 64 registers this kernel has, they spill).
          constexpr int kChunk = kEntropy || kSmoothing ? 1 : 2;
#pragma unroll
          for (int u = 0; u < kUnroll; u += kChunk) {
            if (i0 + (u + kChunk - 1) * kThreads < n_vec) {
              VecT chunk[kChunk];
#pragma unroll
              for (int c = 0; c < kChunk; ++c) chunk[c] = buf[u + c];
              add_vecs<kEntropy, kSmoothing, kFloor>(st, chunk, v.scale, floor);
            } else if (i0 + u * kThreads < n_vec) {
              const VecT one[1] = {buf[u]};
              add_vecs<kEntropy, kSmoothing, kFloor>(st, one, v.scale, floor);
            }
          }
        }
        for (int64_t j = tail + threadIdx.x; j < v.vocab; j += kThreads)
          st.template add<kEntropy, kSmoothing>(kept(static_cast<acc_t>(x[j])), v.scale);
        st = block_combine<kThreads>(st, scratch);
      }
    }

    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
      if constexpr (kStats) {
        st.label = has_label ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
        if (v.stats_out != nullptr) store_stats(v.stats_out, row, st);
      } else {
        st = load_stats(v.stats_in, row);
      }
      coef_shared = epi(v.epilogue_row(row), label, st);
      max_shared = st.max;
      log_sumexp_shared = ::log(st.sumexp);
    }
    __syncthreads();

    if constexpr (kGrad) {
      GradOf<scalar_t, acc_t, Epilogue::kMayUseEntropyGrad, kFloor> grad_of(coef_shared, max_shared,
                                                                            log_sumexp_shared, v.scale, local);
      grad_of.floor = floor;
      scalar_t* g = v.grad + row * v.grad_row_stride;
      if (grad_of.zero) {
        block_zero_fill<kThreads>(g, v.vocab);  // without reading the row
        __syncthreads();  // the shared coefficient is rewritten for the next row
        continue;
      }
      // The vector path needs the gradient row to share the logits row's alignment (true for contiguous
      // logits and a contiguous gradient); otherwise the row is written element by element.
      const bool same_align = (reinterpret_cast<uintptr_t>(g) % 16) == (reinterpret_cast<uintptr_t>(x) % 16);
      if (same_align) {
        for (int64_t j = threadIdx.x; j < head; j += kThreads) g[j] = grad_of(x[j], j);
        // The thread that writes the label's vector keeps its logit first (in place, the vector overwrites it).
        const bool label_vec_mine = has_label && local >= head && local < tail &&
                                    (local - head) / kVec % kThreads == static_cast<int64_t>(threadIdx.x);
        const scalar_t z_label = label_vec_mine ? x[local] : scalar_t(0);
        const VecT* xv = reinterpret_cast<const VecT*>(x + head);
        VecT* gv = reinterpret_cast<VecT*>(g + head);
        for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += kThreads * kUnroll) {
          VecT buf[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * kThreads;
            if (i < n_vec) buf[u] = load_vec(&xv[i]);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * kThreads;
            if (i < n_vec) store_vec(&gv[i], grad_of(buf[u]));
          }
        }
        if (label_vec_mine) g[local] = grad_of(z_label, local);
        for (int64_t j = tail + threadIdx.x; j < v.vocab; j += kThreads) g[j] = grad_of(x[j], j);
      } else {
        for (int64_t j = threadIdx.x; j < v.vocab; j += kThreads) g[j] = grad_of(x[j], j);
      }
    }
    __syncthreads();  // the shared coefficient is rewritten for the next row
  }
}

// The gradient-only pass (statistics from stats_in: GSPO's pass 2, tensor parallelism, the split path) over
// rows whose logits and gradient rows are 16-byte aligned and a whole number of 16-byte vectors long. The
// block's rows are those of row_pass_kernel (blockIdx.x + k·gridDim.x), kGradTableRows at a time: their
// epilogues run first, a row per thread, into a table in shared memory, and the threads then stream those
// rows with no barrier between them. The rows go from the last to the first, so that the first rows read are
// the last ones the statistics pass read, some still in L2. On an H100 (docs/design.md v20) the pass
// takes as long as row_pass_kernel's (2.91 ms at N = 16384, V = 128256: ~95% of the copy's rate, with or
// without the per-row barrier); GSPO's step measured 0-1% faster, about what the rows read from L2 save.
constexpr int kGradTableRows = 64;

template <int kThreads, int kUnroll, typename scalar_t, typename label_t, typename acc_t, typename Epilogue>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 4 : 1)
    grad_rows_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  using Grad = GradOf<scalar_t, acc_t, Epilogue::kMayUseEntropyGrad>;
  __shared__ alignas(Grad) unsigned char table[kGradTableRows][sizeof(Grad)];
  wait_previous_grid();
  const int n_vec = static_cast<int>(v.vocab / kVec);  // fits an int (grad_rows_aligned): fewer registers
  const int64_t rows = (v.n_rows - blockIdx.x + gridDim.x - 1) / gridDim.x;  // this block's
  for (int64_t k_end = rows; k_end > 0; k_end -= kGradTableRows) {
    const int64_t k_begin = std::max<int64_t>(0, k_end - kGradTableRows);
    __syncthreads();  // the previous rows' table is read
    for (int64_t k = k_begin + threadIdx.x; k < k_end; k += kThreads) {
      const int64_t row = blockIdx.x + k * gridDim.x;
      const int64_t label = static_cast<int64_t>(v.target[row]);
      CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
      const int64_t local = label - v.vocab_start;
      const RowStats<acc_t> st = load_stats(v.stats_in, row);
      const Grad grad_of(epi(v.epilogue_row(row), label, st), st.max, ::log(st.sumexp), v.scale,
                         label >= 0 && local >= 0 && local < v.vocab ? local : int64_t(-1));
      memcpy(table[k - k_begin], &grad_of, sizeof(Grad));
    }
    __syncthreads();
    for (int64_t k = k_end - 1; k >= k_begin; --k) {
      const int64_t row = blockIdx.x + k * gridDim.x;
      Grad grad_of = *reinterpret_cast<const Grad*>(table[k - k_begin]);
      scalar_t* g = v.grad + row * v.grad_row_stride;
      if (grad_of.zero) {
        block_zero_fill<kThreads>(g, v.vocab);  // without reading the row
        continue;
      }
      const VecT* xv = reinterpret_cast<const VecT*>(v.logits + row * v.row_stride);
      VecT* gv = reinterpret_cast<VecT*>(g);
      // The label's element is rewritten in its vector before the store (in place, the store overwrites it).
      const int label_vec = grad_of.label >= 0 ? static_cast<int>(grad_of.label / kVec) : -1;
      const int label_elem = static_cast<int>(grad_of.label - int64_t(label_vec) * kVec);
      for (int i0 = threadIdx.x; i0 < n_vec; i0 += kThreads * kUnroll) {
        VecT buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (i0 + u * kThreads < n_vec) buf[u] = load_vec(&xv[i0 + u * kThreads]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int i = i0 + u * kThreads;
          if (i < n_vec) {
            VecT out = grad_of(buf[u]);
            if (i == label_vec) {
#pragma unroll
              for (int e = 0; e < kVec; ++e) {  // no runtime index into registers (it would put them in memory)
                if (e == label_elem) out.v[e] = grad_of(buf[u].v[e], grad_of.label);
              }
            }
            store_vec(&gv[i], out);
          }
        }
      }
    }
  }
}

// Whether grad_rows_kernel applies: 16-byte aligned rows of whole vectors, few enough for its int indices.
inline bool grad_rows_aligned(const RowPassArgs& args) {
  if (args.logit_floor.defined()) return false;  // row_pass_kernel reads the sampler's floor
  const int64_t row_bytes = args.logits.size(1) * args.logits.element_size();
  return row_bytes % 16 == 0 && row_bytes / 16 < (int64_t(1) << 30) && rows_16_byte_aligned(args);
}

}  // namespace cuda
}  // namespace rl_losses
