// CUDA back-end of the row pass (row_pass.h).
//
// Three kernels, all persistent (each block or cluster loops over rows), with 16-byte global accesses; the
// two that compute statistics keep an online softmax state per thread (math.h) and reduce it per block:
// - row_cluster_kernel, for the fused shape (statistics and gradient in one launch: CE, GRPO): a cluster of
//   C CTAs per row, each holding its slice of the row in shared memory, so that the logits are read from
//   DRAM once and the gradient is written once (2 passes of memory traffic). The CTAs' statistics are
//   combined over distributed shared memory (sm_90). It applies when a row fits in C <= 16 slices of at
//   most kClusterCtaBytes and the rows are 16-byte aligned (row_cluster_shape); split_stats_pass_on_cuda
//   (row_pass.h) gives every other fused call a statistics launch of its own first.
// - row_pass_kernel, one block per row, for the statistics-only shape and the gradient-only one where rows
//   are not aligned vectors (tensor parallelism, GSPO, the split path): each reads the row once, and the
//   gradient pass writes it once. A fused call that reaches it anyway (no resident cluster fits) re-reads
//   the row for its gradient: correct, but the re-read misses L2 (benchmarks/NOTES.md).
// - grad_rows_kernel, the gradient-only shape where rows are 16-byte aligned vectors (as row_pass_kernel,
//   without a barrier per row).
// Row offsets are 64-bit. Labels >= vocab_total trip a device-side assert (as PyTorch's own losses do);
// the opt-in host check in Python reports them as a Python error instead.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#include "common/bulk_copy.cuh"
#include "common/dependent_launch.cuh"
#include "common/row_pass.h"

namespace rl_losses {
namespace cuda {

// Shared-memory bytes of one CTA's slice buffer in the cluster kernel. 64 KB lets 3 CTAs share an SM (3 x 64
// KB plus their static shared memory fit the 228 KB of an H100/H200 SM), so that one CTA's wait for its slice
// hides behind the others' work (slices of 96 KB, 2 CTAs per SM, measured faster on one H100 only, slower on
// an H200 and at V = 262144). 64 KB slices hold a bf16 row of 128256 in 4 CTAs, of 262144 in 8; an fp32 row of 262144
// in 16.
constexpr int64_t kClusterCtaBytes = 64 * 1024;
constexpr int kMaxClusterSize = 16;  // 8 is portable; H100/H200 allow 16 (NonPortableClusterSizeAllowed)
// A slice arrives in pieces of kClusterPieceBytes, each on its own mbarrier, so that the statistics start
// on the first piece while the others are still in flight (waiting for the whole slice measured slower).
constexpr int kClusterPieceBytes = 16 * 1024;
constexpr int kClusterMaxPieces = static_cast<int>(kClusterCtaBytes / kClusterPieceBytes);
constexpr int kClusterThreads = 256;
// The slice buffers start on a boundary of this many bytes of shared memory. The dynamic shared memory
// follows the static variables, which leave it only 16-byte aligned; buffers placed there held the kernel up
// to 5 points of the copy bandwidth lower on an H100 (3.5-4 at V = 128256; boundaries of 64, 128, 256 and
// 1024 bytes measured alike; benchmarks/NOTES.md v19).
constexpr unsigned kSliceSmemAlign = 128;
// 16-byte vectors per online-softmax chunk of the cluster kernel's statistics (a thread's vectors i,
// i + kThreads, ...: one max and one rescale test per chunk). 4 fit the 80 registers only without the
// entropy and smoothing sums (with them: spills), which get 2.
template <bool kEntropy, bool kSmoothing>
constexpr int kClusterChunkVecs = kEntropy || kSmoothing ? 2 : 4;
static_assert(kClusterPieceBytes / 16 % (4 * kClusterThreads) == 0, "a statistics chunk must not straddle pieces");
// CTAs per SM the kernel's registers must allow: 3 caps them at 65536 / (3 x 256) = 85 per thread (80
// allocated), where the fp32 math fits without spills; fp64 (reference-grade tests) needs more and gets 2.
template <typename acc_t>
constexpr int kClusterCtasPerSm = sizeof(acc_t) == 8 ? 2 : 3;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// One 16-byte access per vector. A plain copy of a Pack of c10::BFloat16 (a class) may be split into one
// access per element: the statistics loop read shared memory as 8 ld.shared.u16 per vector, 4-way bank
// conflicted, which with the extra instructions held the cluster kernel to ~64% of the copy bandwidth
// (Nsight Compute: 68% excess shared wavefronts, issue slots 67% busy). Going through uint4 cannot split.
template <typename VecT>
__device__ inline VecT load_vec(const VecT* p) {
  static_assert(sizeof(VecT) == sizeof(uint4), "16-byte vectors only");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  VecT v;
  memcpy(&v, &raw, sizeof(raw));
  return v;
}
template <typename VecT>
__device__ inline void store_vec(VecT* p, const VecT& v) {
  static_assert(sizeof(VecT) == sizeof(uint4), "16-byte vectors only");
  uint4 raw;
  memcpy(&raw, &v, sizeof(raw));
  *reinterpret_cast<uint4*>(p) = raw;
}

template <typename acc_t>
__device__ inline RowStats<acc_t> shfl_xor(const RowStats<acc_t>& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, mask), __shfl_xor_sync(0xffffffffu, s.sumexp, mask),
          __shfl_xor_sync(0xffffffffu, s.sum_px, mask), __shfl_xor_sync(0xffffffffu, s.sum_x, mask),
          __shfl_xor_sync(0xffffffffu, s.label, mask)};
}

// Every thread of the block gets the combined state (the same bits: combine is commutative, and each
// butterfly step combines the same two values in both lanes). `scratch` holds one state per warp. The
// second round takes log2(warps) steps, lane l holding warp l mod warps: this reduction is on every row's
// critical path, while the CTA has no memory traffic of its own.
template <int kThreads, typename acc_t>
__device__ inline RowStats<acc_t> block_combine(RowStats<acc_t> s, RowStats<acc_t>* scratch) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && (kWarps & (kWarps - 1)) == 0, "a power of two of whole warps");
  for (int m = 16; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = scratch[lane % kWarps];
  for (int m = kWarps / 2; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  return s;
}

// The kVec values of a 16-byte vector in acc_t. bf16 to fp32 is a shift of the low half of each 32-bit word
// and a mask of the high half, one instruction per value (the generic conversion took two for a high half).
template <typename acc_t, typename scalar_t, int kVec>
__device__ inline void unpack(const Pack<scalar_t, kVec>& z, acc_t (&out)[kVec]) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    unsigned w[kVec / 2];
    memcpy(w, &z, sizeof(w));
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      out[2 * k] = __uint_as_float(w[k] << 16);
      out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = static_cast<acc_t>(z.v[k]);
  }
}

// Folds N 16-byte vectors of raw logits (x = s·z) into the state as one chunk: one max and one rescale test
// per N·kVec logits. bf16 takes the chunk's max over packed pairs first (one instruction per two values,
// exact: the max of bf16 values is one of them).
template <bool kEntropy, bool kSmoothing, typename acc_t, typename scalar_t, int kVec, int N>
__device__ inline void add_vecs(RowStats<acc_t>& st, const Pack<scalar_t, kVec> (&z)[N], acc_t scale) {
  acc_t chunk[N * kVec];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    acc_t one[kVec];
    unpack(z[n], one);
#pragma unroll
    for (int k = 0; k < kVec; ++k) chunk[n * kVec + k] = one[k];
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    __nv_bfloat162 pairs[N * kVec / 2];
    memcpy(pairs, z, sizeof(pairs));
    // __hmax2 returns the other input where one is NaN, as fmax does; a NaN still reaches the sums.
    const __nv_bfloat162 m2 = tree_reduce(pairs, [](__nv_bfloat162 a, __nv_bfloat162 b) { return __hmax2(a, b); });
    const float z_max = ::fmaxf(__low2float(m2), __high2float(m2));
    st.template add_chunk_with_max<kEntropy, kSmoothing, N * kVec>(chunk, z_max, scale);
  } else {
    st.template add_chunk<kEntropy, kSmoothing, N * kVec>(chunk, scale);
  }
}

// dL/dz_j = s·(a·p_j + c + b·[j = label]), p_j = exp(s·z_j − lse), given the row's coefficients and lse: of
// one element, or of a 16-byte vector without the label term. The kernels rewrite the label's element
// afterwards (the thread that wrote its vector, so in order): a test per row instead of one per element.
template <typename scalar_t, typename acc_t>
struct GradOf {
  acc_t sa, sb, sc;
  ExpAffine<acc_t> p_of;
  int64_t label;  // the label's column in the caller's indexing; out of range when the row has none here
  bool zero;      // a = b = c = 0 (a masked row): exact zeros, never exp of a -inf lse

  __device__ GradOf(const GradCoef<acc_t>& coef, acc_t lse, acc_t scale, int64_t label_)
      : sa(scale * coef.a),
        sb(scale * coef.b),
        sc(scale * coef.c),
        p_of(scale, lse),
        label(label_),
        zero(coef.a == acc_t(0) && coef.b == acc_t(0) && coef.c == acc_t(0)) {}

  __device__ scalar_t operator()(scalar_t z, int64_t j) const {
    if (zero) return scalar_t(0);
    return static_cast<scalar_t>(sa * p_of(static_cast<acc_t>(z)) + sc + (j == label ? sb : acc_t(0)));
  }

  template <int kVec>
  __device__ Pack<scalar_t, kVec> operator()(const Pack<scalar_t, kVec>& z) const {
    Pack<scalar_t, kVec> out;
    if (zero) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = scalar_t(0);
      return out;
    }
    acc_t g[kVec];
    unpack(z, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = sa * p_of(g[k]) + sc;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {  // one cvt.rn.bf16x2.f32 per pair
        const __nv_bfloat162 two = __floats2bfloat162_rn(g[k], g[k + 1]);
        memcpy(&out.v[k], &two, sizeof(two));
      }
    } else if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {
        const __half2 two = __floats2half2_rn(g[k], g[k + 1]);
        memcpy(&out.v[k], &two, sizeof(two));
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = static_cast<scalar_t>(g[k]);
    }
    return out;
  }
};

// The elements of a row of n at p before its first 16-byte boundary: those accessed one by one.
template <typename scalar_t>
__device__ inline int64_t unaligned_head(const scalar_t* p, int64_t n) {
  return std::min<int64_t>((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16 / sizeof(scalar_t), n);
}

// Zeros over g[0, n) by the block's threads, 16-byte stores between an element-wise head and tail. A row
// with a zero gradient (a masked token, a clipped document) is written this way without reading its
// logits, which also saves the read. (When the row was read, stores that did not depend on the loads went,
// in place, to addresses with loads in flight: such rows measured 2x slower in place; benchmarks/NOTES.md
// v15.)
template <int kThreads, typename scalar_t>
__device__ inline void block_zero_fill(scalar_t* g, int64_t n) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  const int64_t head = unaligned_head(g, n);
  const int64_t n_vec = (n - head) / kVec;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) g[j] = scalar_t(0);
  VecT zeros;
#pragma unroll
  for (int k = 0; k < kVec; ++k) zeros.v[k] = scalar_t(0);
  VecT* gz = reinterpret_cast<VecT*>(g + head);
  for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) store_vec(&gz[i], zeros);
  for (int64_t j = head + n_vec * kVec + threadIdx.x; j < n; j += kThreads) g[j] = scalar_t(0);
}

// One block per row: kStats streams the row (kUnroll 16-byte loads in flight per thread) into the block's
// statistics, else they are read from stats_in; thread 0 runs the epilogue; kGrad then streams the row again
// and writes the gradient. The row may start anywhere: an unaligned head and a tail go element by element.
template <int kThreads, int kUnroll, typename scalar_t, typename label_t, typename acc_t, bool kStats,
          bool kGrad, bool kEntropy, bool kSmoothing, typename Epilogue>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 4 : 1)  // 256 threads: >= 4 blocks (64 regs)
    row_pass_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi) {
  constexpr int kVec = 16 / sizeof(scalar_t);  // elements per 16-byte access
  using VecT = Pack<scalar_t, kVec>;
  __shared__ RowStats<acc_t> scratch[32];
  __shared__ GradCoef<acc_t> coef_shared;
  __shared__ acc_t lse_shared;
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

    RowStats<acc_t> st = RowStats<acc_t>::empty();
    if constexpr (kStats) {
      // An epilogue that skips unlabelled rows gets them without statistics: the row is not read.
      if (!(Epilogue::kSkipsUnlabelled && label < 0)) {
        for (int64_t j = threadIdx.x; j < head; j += kThreads)
          st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(x[j]), v.scale);
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
              add_vecs<kEntropy, kSmoothing>(st, chunk, v.scale);
            } else if (i0 + u * kThreads < n_vec) {
              const VecT one[1] = {buf[u]};
              add_vecs<kEntropy, kSmoothing>(st, one, v.scale);
            }
          }
        }
        for (int64_t j = tail + threadIdx.x; j < v.vocab; j += kThreads)
          st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(x[j]), v.scale);
        st = block_combine<kThreads>(st, scratch);
      }
    }

    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
      if constexpr (kStats) {
        st.label = has_label ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
      } else {
        st = load_stats(v.stats_in, row);
      }
      coef_shared = epi(row + v.row_offset, label, st);
      lse_shared = st.lse();
    }
    __syncthreads();

    if constexpr (kGrad) {
      const GradOf<scalar_t, acc_t> grad_of(coef_shared, lse_shared, v.scale, local);
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
// the last ones the statistics pass read, some still in L2. On an H100 (benchmarks/NOTES.md v20) the pass
// takes as long as row_pass_kernel's (2.91 ms at N = 16384, V = 128256: ~95% of the copy's rate, with or
// without the per-row barrier); GSPO's step measured 0-1% faster, about what the rows read from L2 save.
constexpr int kGradTableRows = 64;

template <int kThreads, int kUnroll, typename scalar_t, typename label_t, typename acc_t, typename Epilogue>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 4 : 1)
    grad_rows_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  using Grad = GradOf<scalar_t, acc_t>;
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
      const Grad grad_of(epi(row + v.row_offset, label, st), st.lse(), v.scale,
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

// Whether every row of the logits and of the gradient starts on a 16-byte boundary.
inline bool rows_16_byte_aligned(const RowPassArgs& args) {
  const int64_t elem = args.logits.element_size();
  auto aligned = [&](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.stride(0) * elem) % 16 == 0;
  };
  return aligned(args.logits) && aligned(args.grad);
}

// Whether grad_rows_kernel applies: 16-byte aligned rows of whole vectors, few enough for its int indices.
inline bool grad_rows_aligned(const RowPassArgs& args) {
  const int64_t row_bytes = args.logits.size(1) * args.logits.element_size();
  return row_bytes % 16 == 0 && row_bytes / 16 < (int64_t(1) << 30) && rows_16_byte_aligned(args);
}

// Writes `value` into `dst` of the cluster's CTA `rank` (dst: this CTA's address of the same variable) and
// counts its bytes on that CTA's mbarrier `bar` (st.async, sm_90): no fence, no cluster barrier.
template <typename T>
__device__ inline void send_to_rank(T* dst, const T& value, uint64_t* bar, unsigned rank) {
  static_assert(sizeof(T) % 4 == 0, "sent as 32-bit words");
  unsigned words[sizeof(T) / 4];
  memcpy(words, &value, sizeof(T));
  unsigned remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_dst) : "r"(smem_addr(dst)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_bar) : "r"(smem_addr(bar)), "r"(rank));
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T) / 4); ++k) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                     remote_dst + 4 * k),
                 "r"(words[k]), "r"(remote_bar)
                 : "memory");
  }
}

// Fused statistics, epilogue and gradient (CE, GRPO) with a cluster of C CTAs per row, C = the cluster's
// size (1 to 16). CTA rank r owns the columns [r·slice, min(V, (r+1)·slice)) of every row and keeps them in
// shared memory from their load to their gradient, so that the logits are read from DRAM once. Per row:
//   1. the slice arrives in shared memory by bulk copy, in pieces; each thread folds its 16-byte vectors
//      into an online softmax state (a piece as soon as it has landed) and the block reduces them; with the
//      label's logit (if the label is in this slice) the CTA's state is sent to every CTA of the cluster
//      (st.async into a slot of their `gathered`, counted on an mbarrier there);
//   2. once all C states have landed, warp 0 of every CTA combines them (in rank order, by a fixed shuffle
//      tree: every CTA gets the same bits) and lane 0 runs the epilogue; every CTA's epilogue writes the
//      same per-row outputs, which is cheaper than a second round of messages from one CTA;
//   3. every CTA writes the gradient of its slice from shared memory. In place (grad == logits) is safe: a
//      CTA writes only its own slice, after reading all of it.
// Where the epilogue skips unlabelled rows (kSkipsUnlabelled, 1 stage), such a row takes none of these steps:
// every CTA writes zeros over its slice and rank 0 alone runs the epilogue (its outputs do not depend on
// statistics). Every CTA of a cluster skips the same rows, so "row" below counts the rows read.
// No cluster barrier per row: a cluster barrier orders memory, so it waited for every thread's outstanding
// gradient stores (Nsight Compute: membar + barrier stalls were 40% of the warps' cycles).
// With 1 stage (what the launcher asks for), the copy of a row is issued when the previous row is done; with
// 2 stages (two slice buffers of half the size: measured slower, as C doubles), the copy of the CTA's next row
// is issued before step 1. A block barrier before each copy keeps it from overwriting a buffer some thread still
// reads (the gradient of the last row read with 1 stage, of two rows back with 2). The 2-stage path is never
// launched, but this launch loop's structure is kept as measured: an equivalent rewrite without the stage
// option ran 10% slower (same inner-loop SASS, cause not found; benchmarks/NOTES.md, v8b).
// The copies go to shared memory directly because registers are the scarce resource here: 3 CTAs of 256
// threads per SM leave 85 per thread. The partial last vector of a row is loaded by one thread and stored
// at the end of the slice, beyond the copied bytes. A slot of `gathered` is rewritten two rows read later, which
// a peer can reach only after this CTA has sent it the next row's state, i.e. after this CTA's block barrier
// that follows warp 0's reads of the slot.
template <int kThreads, typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing,
          typename Epilogue>
__global__ void __launch_bounds__(kThreads, kClusterCtasPerSm<acc_t>)
    row_cluster_kernel(RowPassView<scalar_t, label_t, acc_t> v, Epilogue epi, int slice_vecs, int stages,
                       int piece_vecs, bool tail) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  CUDA_KERNEL_ASSERT(false && "rl_losses: thread-block clusters need sm_90");  // not launched there
#else
  // A tail launch (launch_row_cluster) follows the main launch over the other rows and reads nothing the main
  // launch writes. It can be scheduled only once every CTA of the main launch has passed its own wait for the
  // kernels before (each triggers right after it), i.e. once those kernels have finished and their writes
  // reached L2, which the tail's loads read. (The PTX guarantee of visibility is to a grid that waits itself;
  // this relies on the writes being flushed by then.) So it starts at once, on the SMs the main launch frees,
  // and waits at its end instead, so that its completion still implies the main launch's for the kernel after
  // it.
  if (tail) {
    let_next_grid_launch();
  } else {
    wait_previous_grid();
  }
  constexpr int kVec = 16 / sizeof(scalar_t);
  using VecT = Pack<scalar_t, kVec>;
  const auto cluster = cooperative_groups::this_cluster();
  const int n_ctas = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  extern __shared__ __align__(16) unsigned char slice_raw[];
  // `stages` buffers of slice_vecs vectors, from the first kSliceSmemAlign boundary (ClusterLaunch::smem()
  // asks for the bytes this skips).
  VecT* const buffers = reinterpret_cast<VecT*>(
      slice_raw + (kSliceSmemAlign - smem_addr(slice_raw) % kSliceSmemAlign) % kSliceSmemAlign);
  __shared__ RowStats<acc_t> scratch[32];
  // Every CTA's statistics of a row, by rank, in a slot per row parity, and an mbarrier per slot that
  // completes when all n_ctas have landed.
  __shared__ RowStats<acc_t> gathered[2][kMaxClusterSize];
  __shared__ uint64_t gathered_full[2];
  __shared__ GradCoef<acc_t> coef_shared;
  __shared__ acc_t lse_shared;
  // One mbarrier per piece of each buffer: that piece of the slice has arrived.
  __shared__ uint64_t landed[2][kClusterMaxPieces];

  // This CTA's columns: n_full whole vectors, then rem < kVec elements (the row's end, in the last CTA only).
  const int64_t begin = static_cast<int64_t>(rank) * slice_vecs * kVec;
  const int n_elems = static_cast<int>(
      std::max<int64_t>(0, std::min<int64_t>(v.vocab - begin, static_cast<int64_t>(slice_vecs) * kVec)));
  const int n_full = n_elems / kVec, rem = n_elems % kVec;
  const bool owns_rem = rem != 0 && static_cast<int>(threadIdx.x) == n_full % kThreads;
  const int64_t row_step = gridDim.x / n_ctas;
  const int n_pieces = (n_full + piece_vecs - 1) / piece_vecs;
  int ctas_pow2 = 1;  // the butterfly that combines the CTAs' states in lane 0 spans this many lanes
  while (ctas_pow2 < n_ctas) ctas_pow2 *= 2;

  if (threadIdx.x == 0) {
    for (int p = 0; p < kClusterMaxPieces; ++p) {
      mbarrier_init(&landed[0][p]);
      mbarrier_init(&landed[1][p]);
    }
    mbarrier_init(&gathered_full[0]);
    mbarrier_init(&gathered_full[1]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster.sync();  // every CTA's barriers are initialised before any peer sends to them
  // Thread 0 copies this CTA's whole vectors of `row` into buffer b: piece p (piece_vecs vectors) completes
  // landed[b][p], in copies of at most 16 KB.
  auto fetch = [&](int64_t row, int b) {
    if (threadIdx.x != 0) return;
    const char* src = reinterpret_cast<const char*>(v.logits + row * v.row_stride + begin);
    char* dst = reinterpret_cast<char*>(buffers + b * slice_vecs);
    for (int p = 0; p < n_pieces; ++p) {
      const unsigned start = static_cast<unsigned>(p * piece_vecs) * 16,
                     end = static_cast<unsigned>(std::min(n_full, (p + 1) * piece_vecs)) * 16;
      mbarrier_arrive_expect(&landed[b][p], end - start);
      for (unsigned off = start; off < end; off += 16384) {
        bulk_copy_to_shared(dst + off, src + off, std::min(16384u, end - off), &landed[b][p]);
      }
    }
  };

  int64_t row = blockIdx.x / n_ctas;
  if (stages == 2 && row < v.n_rows) fetch(row, 0);
  // Where the epilogue skips unlabelled rows, each row's label is loaded a row ahead, and (with 1 stage) an
  // unlabelled row is written as zeros without being read or exchanged. Every CTA of the cluster skips the
  // same rows. `it` counts the rows read, which set the barriers' phases and the `gathered` slots (for other
  // epilogues it is the loop's own counter and the label is loaded where it was, so that their code is the
  // same as without this).
  constexpr bool kSkips = Epilogue::kSkipsUnlabelled;
  int64_t next_label = kSkips && row < v.n_rows ? static_cast<int64_t>(v.target[row]) : 0;
  for (int rows_done = 0, rows_read = 0; row < v.n_rows; row += row_step, ++rows_done) {
    const int64_t label_ahead = next_label;  // this row's label where kSkips
    if (kSkips) {
      if (row + row_step < v.n_rows) next_label = static_cast<int64_t>(v.target[row + row_step]);
      if (stages == 1 && label_ahead < 0) {
        if (rank == 0 && threadIdx.x == 0) epi(row + v.row_offset, label_ahead, RowStats<acc_t>::empty());
        block_zero_fill<kThreads>(v.grad + row * v.grad_row_stride + begin, n_elems);
        continue;
      }
    }
    const int it = kSkips ? rows_read++ : rows_done;
    const int b = stages == 2 ? it & 1 : 0;
    VecT* const slice = buffers + b * slice_vecs;
    __syncthreads();  // every thread is done reading the buffer the next copy overwrites
    if (stages == 2) {
      if (row + row_step < v.n_rows) fetch(row + row_step, b ^ 1);
    } else {
      fetch(row, 0);
    }
    // The phase of buffer b's barriers this row waits for: its uses so far, mod 2. A thread waits for the
    // pieces in order, through the one of vector i, before it reads vector i (its vectors i, i + kThreads of
    // a chunk share a piece): a compare per chunk, not a division.
    const unsigned phase = static_cast<unsigned>(stages == 2 ? (it >> 1) & 1 : it & 1);
    int next_piece = 0, piece_end = 0;
    auto wait_piece = [&](int i) {
      for (; i >= piece_end; piece_end += piece_vecs) mbarrier_wait(&landed[b][next_piece++], phase);
    };
    const scalar_t* x = v.logits + row * v.row_stride + begin;
    const int64_t label = kSkips ? label_ahead : static_cast<int64_t>(v.target[row]);
    const int64_t local = label - v.vocab_start - begin;  // the label's column within this slice
    const bool has_label = label >= 0 && local >= 0 && local < n_elems;

    RowStats<acc_t> st = RowStats<acc_t>::empty();
    if (owns_rem) {
      VecT part;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < rem) {
          part.v[k] = x[n_full * kVec + k];
          st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(part.v[k]), v.scale);
        }
      }
      store_vec(&slice[n_full], part);
    }
    constexpr int kChunk = kClusterChunkVecs<kEntropy, kSmoothing>;
    int i = threadIdx.x;
    for (; i + (kChunk - 1) * kThreads < n_full; i += kChunk * kThreads) {
      wait_piece(i);
      VecT chunk[kChunk];
#pragma unroll
      for (int c = 0; c < kChunk; ++c) chunk[c] = load_vec(&slice[i + c * kThreads]);
      add_vecs<kEntropy, kSmoothing>(st, chunk, v.scale);
    }
    for (; i < n_full; i += kThreads) {
      wait_piece(i);
      const VecT one[1] = {load_vec(&slice[i])};
      add_vecs<kEntropy, kSmoothing>(st, one, v.scale);
    }
    st = block_combine<kThreads>(st, scratch);  // its barrier also makes the whole slice visible to every thread
    const int q = it & 1;            // the row's slot in `gathered`
    if (threadIdx.x == 0) mbarrier_arrive_expect(&gathered_full[q], n_ctas * static_cast<unsigned>(sizeof(st)));
    if (threadIdx.x < n_ctas) {  // thread t sends this CTA's statistics to rank t
      if (has_label && local < n_full * kVec) wait_piece(static_cast<int>(local / kVec));  // it may be another's
      st.label = has_label ? static_cast<acc_t>(reinterpret_cast<const scalar_t*>(slice)[local]) * v.scale
                           : acc_t(0);
      send_to_rank(&gathered[q][rank], st, &gathered_full[q], threadIdx.x);
    }
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      mbarrier_wait(&gathered_full[q], static_cast<unsigned>((it >> 1) & 1));
      RowStats<acc_t> all = lane < n_ctas ? gathered[q][lane] : RowStats<acc_t>::empty();
      for (int m = ctas_pow2 / 2; m > 0; m >>= 1) all = RowStats<acc_t>::combine(all, shfl_xor(all, m));
      if (lane == 0) {
        CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
        coef_shared = epi(row + v.row_offset, label, all);
        lse_shared = all.lse();
      }
    }
    __syncthreads();

    const GradOf<scalar_t, acc_t> grad_of(coef_shared, lse_shared, v.scale, has_label ? local : int64_t(-1));
    VecT* gv = reinterpret_cast<VecT*>(v.grad + row * v.grad_row_stride + begin);
    // Unrolled by 2. By 4 gained up to a point at large V, but took the bf16 kernel from 64 to 72 registers
    // (4 to 3 CTAs per SM where the slices allow more): -6.5 points at V = 8192 (benchmarks/NOTES.md v16).
#pragma unroll 2
    for (int i = threadIdx.x; i < n_full; i += kThreads) store_vec(&gv[i], grad_of(load_vec(&slice[i])));
    if (has_label && local < n_full * kVec && local / kVec % kThreads == threadIdx.x) {
      reinterpret_cast<scalar_t*>(gv)[local] = grad_of(reinterpret_cast<const scalar_t*>(slice)[local], local);
    }
    if (owns_rem) {
      const VecT z = load_vec(&slice[n_full]);
      scalar_t* g = reinterpret_cast<scalar_t*>(gv + n_full);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < rem) g[k] = grad_of(z.v[k], n_full * kVec + k);
      }
    }
  }
  cluster.sync();  // no CTA exits while a peer may still write into its shared memory
  if (tail) wait_for_previous_grid();
#endif
}

// 16-byte vectors in each CTA's slice when a row of `vocab` elements of `elem_bytes` is split over n_ctas:
// rounded up to a multiple of kClusterSliceAlign bytes where that still fits `cta_bytes`, so that in rows
// that start on such a boundary every slice does too (V = 128256: 64512-byte slices instead of 64128, whose
// starts alternate between 256- and 128-byte alignment; +0.3-0.7 points of the copy, benchmarks/NOTES.md v13).
constexpr int64_t kClusterSliceAlign = 512;
inline int64_t cluster_slice_vecs(int64_t vocab, int64_t elem_bytes, int n_ctas, int64_t cta_bytes) {
  const int64_t per_cta = (vocab + n_ctas - 1) / n_ctas;
  const int64_t vec = 16 / elem_bytes;
  const int64_t vecs = (per_cta + vec - 1) / vec;
  constexpr int64_t align_vecs = kClusterSliceAlign / 16;
  const int64_t rounded = (vecs + align_vecs - 1) / align_vecs * align_vecs;
  return n_ctas > 1 && rounded * 16 <= cta_bytes ? rounded : vecs;
}

struct ClusterShape {
  int ctas = 0;        // CTAs per row; 0: the cluster kernel does not apply
  int slice_vecs = 0;  // 16-byte vectors of each CTA's slice
};

// The shape with c CTAs per row, or ctas = 0 where the slices do not fit kClusterCtaBytes.
inline ClusterShape cluster_shape(const RowPassArgs& args, int c) {
  const int64_t slice_vecs =
      cluster_slice_vecs(args.logits.size(1), args.logits.element_size(), c, kClusterCtaBytes);
  if (slice_vecs * 16 > kClusterCtaBytes) return {};
  return {c, static_cast<int>(slice_vecs)};
}

// The shape row_cluster_kernel runs these arguments with: the fewest CTAs per row (1 to 16) whose slices fit
// (a power of two measured slower: 84.0% of the copy at V = 151936 bf16 with 8 CTAs, 88.1% with 5), 1 stage
// (launch_row_cluster falls back to row_pass_kernel where the device cannot make it resident). ctas = 0 where
// the kernel does not apply: not the fused shape, a device older than sm_90, rows of the logits or the
// gradient not 16-byte aligned, a row longer than kMaxClusterSize slices.
inline ClusterShape row_cluster_shape(const RowPassArgs& args) {
  if (!args.logits.is_cuda() || !args.compute_stats() || !args.write_grad()) return {};
  if (!rows_16_byte_aligned(args)) return {};
  if (at::cuda::getDeviceProperties(args.logits.get_device())->major < 9) return {};
  for (int c = 1; c <= kMaxClusterSize; ++c) {
    const ClusterShape shape = cluster_shape(args, c);
    if (shape.ctas != 0) return shape;
  }
  return {};
}

// compute(), the occupancy calculator's answer for `kernel` on the current device with parameters (a, b),
// once per process: it does not change, and asking it took host time on every call of an op.
inline int occupancy_once(const void* kernel, int a, int b, const std::function<int()>& compute) {
  static std::mutex mutex;
  static std::map<std::tuple<uintptr_t, int, int, int>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<uintptr_t>(kernel), c10::cuda::current_device(), a, b);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  return it != known.end() ? it->second : known.emplace(key, compute()).first->second;
}

// The cluster launch of `shape` for `kernel`: its attributes, and the clusters the current device can hold
// at once (0: none), asked of the occupancy calculator once per kernel, device and shape.
template <typename Kernel>
class ClusterLaunch {
 public:
  ClusterLaunch(Kernel* kernel, const ClusterShape& shape) : kernel_(kernel), shape_(shape) {
    dim_.id = cudaLaunchAttributeClusterDimension;
    dim_.val.clusterDim.x = static_cast<unsigned>(shape.ctas);
    dim_.val.clusterDim.y = 1;
    dim_.val.clusterDim.z = 1;
  }

  int resident_clusters() const {
    return occupancy_once(reinterpret_cast<const void*>(kernel_), shape_.ctas, static_cast<int>(smem()), [&] {
      // Room for the largest buffers any shape takes, all of the SM's unified L1/shared memory as shared
      // memory so that 3 CTAs' buffers fit (the kernel's loads bypass L1 anyway), and clusters of 16 (beyond
      // the portable 8).
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kClusterCtaBytes + kSliceSmemAlign)));
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(static_cast<unsigned>(shape_.ctas));
      cfg.blockDim = dim3(kClusterThreads);
      cfg.dynamicSmemBytes = smem();
      cudaLaunchAttribute dim = dim_;
      cfg.attrs = &dim;
      cfg.numAttrs = 1;
      // A cluster cannot span GPCs, so this can be fewer than SMs x CTAs per SM / C. A shape the device
      // cannot make resident at all gives 0 or an error: the caller tries the next.
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel_, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();  // clear it
        clusters = 0;
      }
      return clusters;
    });
  }

  // `clusters` clusters over the view's rows.
  template <typename View, typename Epilogue>
  void operator()(const View& v, const Epilogue& epi, int64_t clusters, bool tail) const {
    DependentLaunch launch(dim3(static_cast<unsigned>(shape_.ctas * clusters)), kClusterThreads, smem());
    launch.add(dim_);
    launch(kernel_, v, epi, shape_.slice_vecs, /*stages=*/1, kClusterPieceBytes / 16, tail);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  // The buffers, and the most the kernel may skip to align them (the dynamic shared memory is 16-byte aligned).
  size_t smem() const { return static_cast<size_t>(shape_.slice_vecs) * 16 + kSliceSmemAlign - 16; }
  Kernel* kernel_;
  ClusterShape shape_;
  cudaLaunchAttribute dim_;
};

// Launches row_cluster_kernel where it applies; returns false otherwise. The grid is persistent: as many
// clusters as can be resident at once, each taking every `clusters`-th row (any more would wait for a second
// wave). Rows dealt out that way leave the last round of a call part-empty when the clusters do not divide
// the rows (N = 4096, V = 32000: 396 clusters of 1 take 11 rounds for 10.3 rows each). Those rows go to a
// tail launch with more CTAs per row instead, each with a shorter slice, where slices of at least a piece
// fit and the device holds a cluster per tail row: its CTAs start on the SMs the main launch frees.
template <typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing, typename Epilogue>
bool launch_row_cluster(const RowPassArgs& args, const Epilogue& epi) {
  auto* kernel = &row_cluster_kernel<kClusterThreads, scalar_t, label_t, acc_t, kEntropy, kSmoothing, Epilogue>;
  using Launch = ClusterLaunch<std::remove_pointer_t<decltype(kernel)>>;
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const ClusterShape shape = row_cluster_shape(args);
  if (shape.ctas == 0) return false;
  const Launch main_launch(kernel, shape);
  const int clusters = main_launch.resident_clusters();
  if (clusters == 0) return false;
  const int64_t tail_rows = v.n_rows > clusters ? v.n_rows % clusters : 0;
  if (tail_rows != 0) {
    for (int c = kMaxClusterSize; c > shape.ctas; --c) {
      const ClusterShape tail = cluster_shape(args, c);
      if (tail.ctas == 0 || tail.slice_vecs * 16 < kClusterPieceBytes) continue;
      const Launch tail_launch(kernel, tail);
      if (tail_launch.resident_clusters() < tail_rows) continue;
      auto head = v, rest = v;
      head.n_rows = v.n_rows - tail_rows;
      rest.n_rows = tail_rows;
      rest.logits += head.n_rows * v.row_stride;
      rest.target += head.n_rows;
      rest.grad += head.n_rows * v.grad_row_stride;
      rest.row_offset += head.n_rows;
      TORCH_INTERNAL_ASSERT(v.stats_in == nullptr, "rl_losses: the fused pass reads no statistics");
      main_launch(head, epi, clusters, false);
      tail_launch(rest, epi, tail_rows, true);
      return true;
    }
  }
  main_launch(v, epi, std::min<int64_t>(v.n_rows, clusters), false);
  return true;
}

template <int kThreads, typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing,
          typename Epilogue>
void launch_row_pass(const RowPassArgs& args, const Epilogue& epi) {
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const bool stats = args.compute_stats(), grad = args.write_grad();
  // Grid: as many blocks as can be resident, each looping over rows (rows are dealt out statically, so a
  // block of a second wave would start its rows late). (One resident 1024-thread block per SM measured 1.7x
  // slower on an H100.)
  auto launch_resident = [&](auto* kernel) {
    const int per_sm = occupancy_once(reinterpret_cast<const void*>(kernel), kThreads, 0, [&] {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
      return blocks;
    });
    const int64_t max_blocks = static_cast<int64_t>(props->multiProcessorCount) * std::max(per_sm, 1);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, max_blocks)));
    DependentLaunch(grid, kThreads, 0)(kernel, v, epi);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread
  auto launch = [&](auto s, auto g) {
    constexpr bool kS = decltype(s)::value, kG = decltype(g)::value;
    launch_resident(
        &row_pass_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, kS, kG, kEntropy, kSmoothing, Epilogue>);
  };
  using T = std::true_type;
  using F = std::false_type;
  // Only the pass shapes the epilogue can be used in are compiled (see row_pass.h).
  TORCH_CHECK((stats || Epilogue::kMayReadStats) && (!grad || Epilogue::kMayWriteGrad),
              "rl_losses: internal error: unsupported row-pass shape");
  if constexpr (Epilogue::kMayWriteGrad) {
    if (stats && grad) {
      if (launch_row_cluster<scalar_t, label_t, acc_t, kEntropy, kSmoothing>(args, epi)) return;
      return launch(T{}, T{});
    }
    if constexpr (Epilogue::kMayReadStats) {
      if (grad && grad_rows_aligned(args)) {
        return launch_resident(&grad_rows_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, Epilogue>);
      }
      if (grad) return launch(F{}, T{});
    }
  }
  if (stats) return launch(T{}, F{});
  if constexpr (Epilogue::kMayReadStats) launch(F{}, F{});
}

// Entry point: dispatch on dtypes, statistics flags and block size (by the shard width).
template <typename Epilogue_for>
void row_pass_cuda(const RowPassArgs& args, const char* name, Epilogue_for&& make_epilogue) {
  if (args.logits.size(0) == 0) return;
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), name, [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto epi = make_epilogue(static_cast<acc_t*>(nullptr));
    using Epi = std::decay_t<decltype(epi)>;
    // Rows of up to 64K elements get 256-thread blocks, several rows per SM at once: a 1024-thread block
    // covers a bf16 row of 32000 in one round of loads, and its per-row reductions then dominate (GSPO at
    // V = 32000 ran at 72% of the copy bandwidth, 90% at V = 128256). Longer rows: 1024.
    const bool small = args.logits.size(1) <= 65536;
    dispatch_stat_flags<Epi>(args, [&](auto entropy, auto smoothing) {
      constexpr bool kE = decltype(entropy)::value, kS = decltype(smoothing)::value;
      if (small) {
        launch_row_pass<256, scalar_t, int64_t, acc_t, kE, kS, Epi>(args, epi);
      } else {
        launch_row_pass<1024, scalar_t, int64_t, acc_t, kE, kS, Epi>(args, epi);
      }
    });
  });
}

}  // namespace cuda
}  // namespace rl_losses

namespace rl_losses {
namespace cuda {

template <typename F>
__global__ void for_each_kernel(int64_t n, F f) {
  wait_previous_grid();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) f(i);
}

// One block: each thread sums the terms of its indices i ≡ threadIdx.x (mod kThreads) in order, a fixed tree
// combines the threads, thread 0 finishes. Deterministic, and one launch where a column sum and the
// divisions after it took one each.
template <int kThreads, typename R>
__global__ void __launch_bounds__(kThreads) sum_then_kernel(int64_t n, R r) {
  wait_previous_grid();
  using acc_t = typename R::acc_t;
  constexpr int K = R::kTerms;
  acc_t s[K];
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = acc_t(0);
  // Unrolled so that a thread's loads of several indices are in flight together: at small N this kernel is
  // a few dependent L2 round trips per thread, on the critical path right after the row pass.
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    acc_t v[K];
    r.terms(i, v);
#pragma unroll
    for (int k = 0; k < K; ++k) s[k] += v[k];
  }
  auto warp_sum = [](acc_t x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
  };
  __shared__ acc_t partial[kThreads / 32][K];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    s[k] = warp_sum(s[k]);
    if (lane == 0) partial[warp][k] = s[k];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = warp_sum(lane < kThreads / 32 ? partial[lane][k] : acc_t(0));
  if (lane == 0) r.finish(s);
}

// out[index[i], :] += values[i, :] for i < n (K columns, out zeroed before). A warp whose 32 rows share one
// index (the common case: packed documents are runs of tokens) adds their sum with one atomic per column;
// any other warp adds row by row. It replaces ATen's fill and index_add_ (a slow generic kernel: 9 us at
// N = 4096, 23 us at N = 16384 on an H100, contended by the few documents of a long-document batch). Atomic
// like index_add_, so the order of the additions varies between runs; under torch.use_deterministic_algorithms
// the runner calls index_add_, whose deterministic path has a fixed order.
template <int K, typename acc_t>
__global__ void sum_rows_by_index_kernel(int64_t n, const acc_t* values, const int64_t* index, acc_t* out) {
  wait_previous_grid();
  const int lane = threadIdx.x % 32;
  // The loop bound is warp-uniform (base is a multiple of 32), so every lane reaches the warp votes.
  for (int64_t base = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32 * 32; base < n;
       base += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = base + lane;
    const bool in = i < n;
    const int64_t s = in ? index[i] : -1;
    const int64_t s0 = __shfl_sync(0xffffffffu, s, 0);
    if (__all_sync(0xffffffffu, in && s == s0)) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        acc_t v = values[i * K + k];
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (lane == 0) atomicAdd(out + s0 * K + k, v);
      }
    } else if (in) {
#pragma unroll
      for (int k = 0; k < K; ++k) atomicAdd(out + s * K + k, values[i * K + k]);
    }
  }
}

}  // namespace cuda

// The CUDA runner: what an op's back-end-independent code needs from a device (see gspo.h).
struct CudaRunner {
  template <typename MakeEpilogue>
  static void row_pass(const RowPassArgs& args, const char* name, MakeEpilogue&& make) {
    cuda::row_pass_cuda(args, name, std::forward<MakeEpilogue>(make));
  }
  template <typename F>
  static void for_each(int64_t n, const F& f) {
    if (n == 0) return;
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
    cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(cuda::for_each_kernel<F>, n, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // out[index[i], :] = Σ values[i, :] over the i with that index (out: (S, K), values: (N, K), contiguous):
  // a memset and one launch.
  template <int K>
  static void sum_rows_by_index(const at::Tensor& values, const at::Tensor& index, const at::Tensor& out) {
    if (at::globalContext().deterministicAlgorithms()) {  // the atomics' order varies; ATen has a fixed one
      sum_rows_by_index_aten(values, index, out);
      return;
    }
    if (out.numel() == 0) return;
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), at::cuda::getCurrentCUDAStream()));
    const int64_t n = values.size(0);
    if (n == 0) return;
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sum_rows_by_index", [&] {
      cuda::DependentLaunch(dim3(static_cast<unsigned>(blocks)), kThreads, 0)(
          cuda::sum_rows_by_index_kernel<K, scalar_t>, n, values.const_data_ptr<scalar_t>(),
          index.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // r.finish(s) once, with s[k] = Σ_{i < n} of r.terms(i)[k] (see row_pass.h), in one single-block launch (the
  // sums here are over tokens or documents, read from L2 right after they were written).
  template <typename R>
  static void sum_then(int64_t n, const R& r) {
    cuda::DependentLaunch(1, 1024, 0)(cuda::sum_then_kernel<1024, R>, n, r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace rl_losses
