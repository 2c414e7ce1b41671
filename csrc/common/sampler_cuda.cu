// Each row's sampler floor on CUDA (common/sampler.h): one block per row, a few sweeps over the row (the later ones
// mostly from L2). The max; min_p's floor; then top_k and top_p each in two steps: a histogram of the tokens by how
// far below the max they are (255 bins of 0.1 units of ExpShifted's exponent, and the rest, whose top_p masses are
// 0), spread enough that its shared-memory atomics rarely collide, finds the bin that holds the edge; a radix
// selection over the raw bits of that bin's logits, 8 bits a sweep, finds the edge's exact value. top_k counts,
// top_p sums fixed-point masses (2^-24 units) in 64 bits out of 32-bit atomics: integer sums, the same decision
// whatever the order of the additions.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstring>

#include "common/cuda/vectors.cuh"
#include "common/cuda_backends.h"
#include "common/dependent_launch.cuh"
#include "common/sampler.h"

namespace rl_losses {
namespace cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 256;
constexpr int kRestBin = kBins - 1;
constexpr float kBinsPerUnit = 10.f;  // bins 0..254 cover 25.5 units of the exponent: beyond, a mass is 0

// The raw bits of a logit as an unsigned key in the values' order (±0 one key), and back.
template <typename scalar_t>
struct RawKey {
  using Bits = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, std::conditional_t<sizeof(scalar_t) == 4,
                                                                                        uint32_t, uint64_t>>;
  static constexpr Bits kSign = Bits(Bits(1) << (8 * sizeof(Bits) - 1));
  __device__ static Bits of(scalar_t z) {
    Bits u;
    memcpy(&u, &z, sizeof(u));
    if ((u & Bits(~kSign)) == 0) u = 0;
    return (u & kSign) ? Bits(~u) : Bits(u | kSign);
  }
  template <typename acc_t>
  __device__ static acc_t value(Bits key) {
    const Bits u = (key & kSign) ? Bits(key & Bits(~kSign)) : Bits(~key);
    scalar_t z;
    memcpy(&z, &u, sizeof(z));
    return static_cast<acc_t>(z);
  }
};

template <typename T>
__device__ inline T block_max(T v, T* scratch) {
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % (kThreads / 32)];
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// f(z) for each logit of a row, by 16-byte loads between an element-wise head and tail (the order is free: every
// sweep's result is a max, a min or an integer sum).
// kUnroll independent 16-byte loads in flight per thread: 4 measured 8-12% faster than 1 on an H200 (top_k, top_p);
// 8 copies of the histograms, one per group of warps, were 5% slower: the cost is not collisions between warps.
template <typename scalar_t, typename F>
__device__ inline void for_each_logit(const scalar_t* z, int64_t n, F&& f) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t head = unaligned_head(z, n), n_vec = (n - head) / kVec;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) f(z[j]);
  const auto* zv = reinterpret_cast<const Pack<scalar_t, kVec>*>(z + head);
  constexpr int kUnroll = 4;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < n_vec; i += kUnroll * kThreads) {
    Pack<scalar_t, kVec> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p[u] = load_vec(&zv[i + u * kThreads]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(p[u].v[k]);
    }
  }
  for (; i < n_vec; i += kThreads) {
    const auto pack = load_vec(&zv[i]);
#pragma unroll
    for (int k = 0; k < kVec; ++k) f(pack.v[k]);
  }
  for (int64_t j = head + n_vec * kVec + threadIdx.x; j < n; j += kThreads) f(z[j]);
}

// A 64-bit sum in two 32-bit words, by 32-bit atomics (native in shared memory; 64-bit ones are not).
__device__ inline void add_mass(unsigned* lo, unsigned* hi, unsigned v) {
  if (v != 0 && atomicAdd(lo, v) + v < v) atomicAdd(hi, 1u);
}
__device__ inline unsigned long long mass_at(const unsigned* lo, const unsigned* hi, int b) {
  return (static_cast<unsigned long long>(hi[b]) << 32) | lo[b];
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    sampler_floor_kernel(RowPassView<scalar_t, int64_t, acc_t> v, const float* params, acc_t* out) {
  using Key = RawKey<scalar_t>;
  using Bits = typename Key::Bits;
  constexpr int kDigits = static_cast<int>(sizeof(Bits));
  __shared__ acc_t scratch[32];
  __shared__ unsigned count[kBins], lo[kBins], hi[kBins];
  __shared__ Bits prefix_s;
  __shared__ int bin_s;
  __shared__ long long need_s;                   // top_k: the rank of the edge among the candidates left
  __shared__ unsigned long long above_s, total_s;  // top_p: the mass above the candidates left; the kept set's
  wait_previous_grid();
  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const scalar_t* z = v.logits + row * v.row_stride;
    const SamplerRow<acc_t> o(params + row * kSamplerColumns);
    acc_t m = neg_inf<acc_t>();
    bool nan = false;
    for_each_logit(z, v.vocab, [&](scalar_t zj) {
      const acc_t x = static_cast<acc_t>(zj);
      nan |= x != x;
      m = ::fmax(m, x);
    });
    nan = __syncthreads_or(nan);
    m = block_max(m, scratch);
    acc_t floor = neg_inf<acc_t>();
    if (!nan && m > neg_inf<acc_t>()) {
      const ExpShifted<acc_t> e_of(v.scale, v.scale * m);
      // The bin of a logit: how far below the max, monotone (a larger logit never has a larger bin).
      auto bin_of = [&](acc_t x) {
        const acc_t d = -e_of.arg(x) * acc_t(kBinsPerUnit);
        return d < acc_t(kRestBin) ? static_cast<int>(d) : kRestBin;
      };
      auto clear = [&] {
        for (int b = threadIdx.x; b < kBins; b += kThreads) count[b] = lo[b] = hi[b] = 0;
        __syncthreads();
      };
      if (o.min_p_acts()) {
        acc_t lowest = -neg_inf<acc_t>();
        for_each_logit(z, v.vocab, [&](scalar_t zj) {
          const acc_t x = static_cast<acc_t>(zj);
          if (o.min_p_keeps(e_of(x))) lowest = ::fmin(lowest, x);
        });
        floor = -block_max(-lowest, scratch);
      }
      // The exact edge within bin bin_s: `need` (top_k) or the mass above (top_p) from the bins before, then a
      // digit of the raw bits per sweep, from the top; `pick` chooses the digit.
      auto select = [&](bool by_mass, auto pick) {
        for (int d = kDigits - 1; d >= 0; --d) {
          clear();
          const int shift = 8 * d;
          const Bits high = d == kDigits - 1 ? Bits(0) : Bits(Bits(~Bits(0)) << (shift + 8)), prefix = prefix_s;
          const int bin = bin_s;
          for_each_logit(z, v.vocab, [&](scalar_t zj) {
            const acc_t x = static_cast<acc_t>(zj);
            const Bits k = Key::of(zj);
            if (x >= floor && bin_of(x) == bin && (k & high) == prefix) {
              const int b = static_cast<int>((k >> shift) & 0xff);
              atomicAdd(&count[b], 1u);
              if (by_mass) add_mass(&lo[b], &hi[b], sampler_mass(e_of(x)));
            }
          });
          __syncthreads();
          if (threadIdx.x == 0) prefix_s = prefix | Bits(Bits(pick()) << shift);
          __syncthreads();
        }
        return Key::template value<acc_t>(prefix_s);
      };
      if (o.k_acts(v.vocab)) {
        clear();
        unsigned rest = 0;
        for_each_logit(z, v.vocab, [&](scalar_t zj) {
          const acc_t x = static_cast<acc_t>(zj);
          if (x < floor) return;
          const int b = bin_of(x);
          if (b == kRestBin) {
            ++rest;
          } else {
            atomicAdd(&count[b], 1u);
          }
        });
        rest = __reduce_add_sync(0xffffffffu, rest);
        if (threadIdx.x % 32 == 0 && rest != 0) atomicAdd(&count[kRestBin], rest);
        __syncthreads();
        if (threadIdx.x == 0) {
          long long need = static_cast<long long>(o.top_k);
          int b = 0;
          for (; b < kBins && need > count[b]; ++b) need -= count[b];
          bin_s = b;  // kBins: fewer candidates than k, top_k removes nothing
          need_s = need;
          prefix_s = 0;
        }
        __syncthreads();
        if (bin_s < kBins) {
          floor = select(false, [&] {
            long long need = need_s;
            int b = kBins - 1;
            for (; b > 0 && need > count[b]; --b) need -= count[b];
            need_s = need;
            return b;
          });
        }
      }
      if (o.p_acts()) {
        clear();
        for_each_logit(z, v.vocab, [&](scalar_t zj) {
          const acc_t x = static_cast<acc_t>(zj);
          const int b = x >= floor ? bin_of(x) : kRestBin;
          if (b != kRestBin) {  // the rest have no mass: never kept by top_p
            atomicAdd(&count[b], 1u);
            add_mass(&lo[b], &hi[b], sampler_mass(e_of(x)));
          }
        });
        __syncthreads();
        if (threadIdx.x == 0) {
          unsigned long long total = 0;
          for (int b = 0; b < kBins; ++b) total += mass_at(lo, hi, b);
          // The last bin whose top value has less than top_p · Z above it: the edge is in it.
          unsigned long long above = 0, best_above = 0;
          int best = 0;
          for (int b = 0; b < kBins && o.p_keeps(above, total); ++b) {
            if (count[b] != 0) {
              best = b;
              best_above = above;
            }
            above += mass_at(lo, hi, b);
          }
          total_s = total;
          bin_s = best;
          above_s = best_above;
          prefix_s = 0;
        }
        __syncthreads();
        floor = select(true, [&] {
          const unsigned long long total = total_s;
          unsigned long long above = above_s, best_above = above;
          int best = kBins - 1;
          for (int b = kBins - 1; b >= 0 && o.p_keeps(above, total); --b) {
            if (count[b] != 0) {
              best = b;
              best_above = above;
            }
            above += mass_at(lo, hi, b);
          }
          above_s = best_above;
          return best;
        });
      }
    }
    if (threadIdx.x == 0) {
      const int64_t label = v.target[row];
      const bool has_label = label >= 0 && label < v.vocab;
      out[row] = floor_with_label(floor, has_label, has_label ? static_cast<acc_t>(z[label]) : acc_t(0));
    }
    __syncthreads();  // the shared state is reset for the next row
  }
}

}  // namespace
}  // namespace cuda

void sampler_floor_cuda(const RowPassArgs& args, const at::Tensor& params, const at::Tensor& out) {
  RL_LOSSES_DISPATCH_LOGITS(args.logits.scalar_type(), "sampler", [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const auto v = make_view<scalar_t, int64_t, acc_t>(args);
    auto* kernel = &cuda::sampler_floor_kernel<scalar_t, acc_t>;
    const int per_sm = cuda::occupancy_once(reinterpret_cast<const void*>(kernel), cuda::kThreads, 0, [&] {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, cuda::kThreads, 0));
      return blocks;
    });
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, sms * std::max(per_sm, 1))));
    cuda::DependentLaunch(grid, cuda::kThreads, 0)(kernel, v, params.const_data_ptr<float>(), out.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rl_losses
