// CUDA back-end of the row pass (row_pass.h).
//
// One thread block per row (grid-stride over rows). Pass 1 streams the row once with 16-byte loads, several
// in flight per thread, folding them into an online softmax state; a block reduction combines the states;
// thread 0 runs the op's epilogue; pass 2 re-reads the row (it is still in L2: a block's row is at most a
// few hundred KB and only ~2 rows per SM are in flight) and writes the gradient with 16-byte stores.
// Row offsets are 64-bit. Labels >= vocab_total trip a device-side assert (as PyTorch's own losses do);
// the opt-in host check in Python reports them as a Python error instead.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <cstdlib>
#include <string>

#include "common/row_pass.h"

namespace rl_losses {
namespace cuda {

// Off by default: on an H100 no cache size beat none (benchmarks/NOTES.md); RL_LOSSES_ROW_CACHE_KB tunes it.
constexpr int kDefaultRowCacheKB = 0;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename acc_t>
__device__ inline RowStats<acc_t> shfl_xor(const RowStats<acc_t>& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, mask), __shfl_xor_sync(0xffffffffu, s.sumexp, mask),
          __shfl_xor_sync(0xffffffffu, s.sum_px, mask), __shfl_xor_sync(0xffffffffu, s.sum_x, mask),
          __shfl_xor_sync(0xffffffffu, s.label, mask)};
}

// Every thread of the block gets the combined state. `scratch` holds one state per warp.
template <typename acc_t>
__device__ inline RowStats<acc_t> block_combine(RowStats<acc_t> s, RowStats<acc_t>* scratch) {
  for (int m = 16; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = (blockDim.x + 31) / 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  s = lane < n_warps ? scratch[lane] : RowStats<acc_t>::empty();
  for (int m = 16; m > 0; m >>= 1) s = RowStats<acc_t>::combine(s, shfl_xor(s, m));
  return s;
}

template <int kThreads, int kUnroll, typename scalar_t, typename label_t, typename acc_t, bool kStats,
          bool kGrad, bool kEntropy, bool kSmoothing, typename Epilogue>
__global__ void __launch_bounds__(kThreads) row_pass_kernel(RowPassView<scalar_t, label_t, acc_t> v,
                                                            Epilogue epi, int64_t cache_vecs) {
  constexpr int kVec = 16 / sizeof(scalar_t);  // elements per 16-byte access
  using VecT = Pack<scalar_t, kVec>;
  // Fused passes keep the first `cache_vecs` vectors of the row in shared memory, so that pass 2 reads
  // them from there instead of L2/DRAM; the rest is re-read from global memory (mostly L2 hits).
  extern __shared__ __align__(16) unsigned char row_cache_raw[];
  VecT* cache = reinterpret_cast<VecT*>(row_cache_raw);
  constexpr bool kCache = kStats && kGrad;
  __shared__ RowStats<acc_t> scratch[32];
  __shared__ GradCoef<acc_t> coef_shared;
  __shared__ acc_t lse_shared;

  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const scalar_t* x = v.logits + row * v.row_stride;
    const int64_t label = static_cast<int64_t>(v.target[row]);
    const int64_t local = label - v.vocab_start;
    const bool has_label = label >= 0 && local >= 0 && local < v.vocab;
    // Split the row into an unaligned head, a 16-byte-aligned body and a tail.
    const int64_t misalign = (reinterpret_cast<uintptr_t>(x) % 16) / sizeof(scalar_t);
    const int64_t head = misalign == 0 ? 0 : std::min<int64_t>(kVec - misalign, v.vocab);
    const int64_t n_vec = (v.vocab - head) / kVec;
    const int64_t tail = head + n_vec * kVec;

    RowStats<acc_t> st;
    if constexpr (kStats) {
      st = RowStats<acc_t>::empty();
      for (int64_t j = threadIdx.x; j < head; j += kThreads)
        st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(x[j]) * v.scale);
      const VecT* xv = reinterpret_cast<const VecT*>(x + head);
      // kUnroll independent 16-byte loads are issued before any is used, to keep enough bytes in flight.
      for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += kThreads * kUnroll) {
        VecT buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + u * kThreads;
          if (i < n_vec) buf[u] = xv[i];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + u * kThreads;
          // Each thread later re-reads exactly the vectors it cached: no barrier needed for the cache.
          if (kCache && i < cache_vecs) cache[i] = buf[u];
          if (i < n_vec) {
            acc_t chunk[kVec];
#pragma unroll
            for (int k = 0; k < kVec; ++k) chunk[k] = static_cast<acc_t>(buf[u].v[k]) * v.scale;
            st.template add_chunk<kEntropy, kSmoothing, kVec>(chunk);
          }
        }
      }
      for (int64_t j = tail + threadIdx.x; j < v.vocab; j += kThreads)
        st.template add<kEntropy, kSmoothing>(static_cast<acc_t>(x[j]) * v.scale);
      st = block_combine(st, scratch);
    }

    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT(label < v.vocab_total && "rl_losses: a target label is >= the vocabulary size");
      if constexpr (kStats) {
        st.label = has_label ? static_cast<acc_t>(x[local]) * v.scale : acc_t(0);
      } else {
        st = load_stats(v.stats_in, row);
      }
      coef_shared = epi(row, label, st);
      lse_shared = st.lse();
    }
    __syncthreads();

    if constexpr (kGrad) {
      const GradCoef<acc_t> coef = coef_shared;
      const acc_t lse = lse_shared;
      scalar_t* g = v.grad + row * v.grad_row_stride;
      const bool zero = coef.a == acc_t(0) && coef.b == acc_t(0) && coef.c == acc_t(0);
      const acc_t sa = v.scale * coef.a, sc = v.scale * coef.c, sb = v.scale * coef.b;
      auto grad_of = [&](scalar_t z, int64_t j) -> scalar_t {
        if (zero) return scalar_t(0);  // masked row: exact zeros, never exp of a -inf lse
        const acc_t p = exp_nonpos(static_cast<acc_t>(z) * v.scale - lse);
        return static_cast<scalar_t>(sa * p + sc + (j == local ? sb : acc_t(0)));
      };
      // The vector path needs the gradient row to share the logits row's alignment (true for contiguous
      // logits and a contiguous gradient); otherwise the row is written element by element.
      const bool same_align = (reinterpret_cast<uintptr_t>(g) % 16) == (reinterpret_cast<uintptr_t>(x) % 16);
      if (same_align) {
        for (int64_t j = threadIdx.x; j < head; j += kThreads) g[j] = grad_of(x[j], j);
        const VecT* xv = reinterpret_cast<const VecT*>(x + head);
        VecT* gv = reinterpret_cast<VecT*>(g + head);
        for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += kThreads * kUnroll) {
          VecT buf[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * kThreads;
            if (kCache && i < cache_vecs) {
              buf[u] = cache[i];
            } else if (i < n_vec) {
              buf[u] = xv[i];
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 + u * kThreads;
            if (i < n_vec) {
              VecT out;
              const int64_t j0 = head + i * kVec;
#pragma unroll
              for (int k = 0; k < kVec; ++k) out.v[k] = grad_of(buf[u].v[k], j0 + k);
              gv[i] = out;
            }
          }
        }
        for (int64_t j = tail + threadIdx.x; j < v.vocab; j += kThreads) g[j] = grad_of(x[j], j);
      } else {
        for (int64_t j = threadIdx.x; j < v.vocab; j += kThreads) g[j] = grad_of(x[j], j);
      }
    }
    __syncthreads();  // the shared coefficient is rewritten for the next row
  }
}

// Bytes of a row the fused kernel keeps in shared memory. RL_LOSSES_ROW_CACHE_KB overrides the default
// (a tuning knob, read once per process); see benchmarks/NOTES.md for how the default was chosen.
inline int64_t row_cache_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("RL_LOSSES_ROW_CACHE_KB");
    return (env ? std::atoll(env) : int64_t(kDefaultRowCacheKB)) * 1024;
  }();
  return bytes;
}

template <int kThreads, typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing,
          typename Epilogue>
void launch_row_pass(const RowPassArgs& args, const Epilogue& epi) {
  const auto v = make_view<scalar_t, label_t, acc_t>(args);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool stats = args.compute_stats(), grad = args.write_grad();
  auto launch = [&](auto s, auto g) {
    constexpr bool kS = decltype(s)::value, kG = decltype(g)::value;
    constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread
    auto* kernel =
        &row_pass_kernel<kThreads, kUnroll, scalar_t, label_t, acc_t, kS, kG, kEntropy, kSmoothing, Epilogue>;
    // Shared-memory row cache (fused passes only): as much of a row as fits the budget.
    const int64_t row_vecs = v.vocab * static_cast<int64_t>(sizeof(scalar_t)) / 16;
    const int64_t budget = std::min<int64_t>(row_cache_bytes(), props->sharedMemPerBlockOptin - 2048);
    const int64_t cache_vecs = (kS && kG) ? std::min<int64_t>(row_vecs, budget / 16) : 0;
    const size_t smem = static_cast<size_t>(cache_vecs) * 16;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    // Grid: a full SM's worth of threads per SM, each block looping over rows. (Sizing it by the occupancy
    // calculator instead, i.e. one resident 1024-thread block per SM, measured 1.7x slower on an H100.)
    static const bool one_block_per_row = [] {
      const char* env = std::getenv("RL_LOSSES_ROW_GRID");  // tuning knob: "rows" or "persistent" (default)
      return env && std::string(env) == "rows";
    }();
    const int64_t max_blocks = one_block_per_row ? v.n_rows
                                                 : static_cast<int64_t>(props->multiProcessorCount) * (2048 / kThreads);
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, max_blocks)));
    kernel<<<grid, kThreads, smem, stream>>>(v, epi, cache_vecs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  using T = std::true_type;
  using F = std::false_type;
  // Only the pass shapes the epilogue can be used in are compiled (see row_pass.h).
  TORCH_CHECK((stats || Epilogue::kMayReadStats) && (!grad || Epilogue::kMayWriteGrad),
              "rl_losses: internal error: unsupported row-pass shape");
  if constexpr (Epilogue::kMayWriteGrad) {
    if (stats && grad) return launch(T{}, T{});
    if constexpr (Epilogue::kMayReadStats) {
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
  const c10::cuda::OptionalCUDAGuard guard(args.logits.device());
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), name, [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto epi = make_epilogue(static_cast<acc_t*>(nullptr));
    using Epi = std::decay_t<decltype(epi)>;
    // Small vocabularies get a smaller block so that threads are not idle; 1024 otherwise.
    const bool small = args.logits.size(1) <= 4096;
    dispatch_stat_flags<Epi>(args, [&](auto entropy, auto smoothing) {
      constexpr bool kE = decltype(entropy)::value, kS = decltype(smoothing)::value;
      if (small) {
        launch_row_pass<128, scalar_t, int64_t, acc_t, kE, kS, Epi>(args, epi);
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
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) f(i);
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
    cuda::for_each_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(n, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace rl_losses
