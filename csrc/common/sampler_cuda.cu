// Each row's sampler floor on CUDA (common/sampler.h): one block per row, a few sweeps over the row (the later
// ones mostly from L2): its max; min_p's floor; top_k's k-th largest value and top_p's floor by radix selection
// over the values' order-preserving keys, 8 bits per sweep, with shared-memory histograms of counts (top_k) and
// fixed-point masses (top_p): integer sums, so the same bits whatever the order of the atomics.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "common/cuda/vectors.cuh"
#include "common/cuda_backends.h"
#include "common/dependent_launch.cuh"
#include "common/sampler.h"

namespace rl_losses {
namespace cuda {
namespace {

constexpr int kSamplerThreads = 1024;
constexpr int kBins = 256;

template <typename T>
__device__ inline T block_max(T v, T* scratch) {
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % (kSamplerThreads / 32)];
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
template <typename T>
__device__ inline T block_min(T v, T* scratch) {
  return -block_max(-v, scratch);
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kSamplerThreads)
    sampler_floor_kernel(RowPassView<scalar_t, int64_t, acc_t> v, const float* params, acc_t* out) {
  using Key = decltype(sampler_key(acc_t(0)));
  constexpr int kDigits = static_cast<int>(sizeof(Key));
  __shared__ acc_t scratch[32];
  __shared__ unsigned count[kBins];
  __shared__ unsigned long long mass[kBins];
  __shared__ unsigned long long total_shared;
  __shared__ Key prefix_shared;
  __shared__ long long need_shared;          // top_k: how many of the values under the prefix are still to take
  __shared__ unsigned long long above_shared;  // top_p: the mass strictly above the prefix's values
  __shared__ int found_shared;
  wait_previous_grid();
  const acc_t inf = -neg_inf<acc_t>();
  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const scalar_t* z = v.logits + row * v.row_stride;
    const SamplerRow<acc_t> o(params + row * kSamplerColumns);
    auto at = [&](int64_t j) { return static_cast<acc_t>(z[j]); };
    // The max (a NaN anywhere leaves the row unfiltered: its statistics are NaN anyway).
    acc_t m = neg_inf<acc_t>();
    bool nan = false;
    for (int64_t j = threadIdx.x; j < v.vocab; j += kSamplerThreads) {
      const acc_t x = at(j);
      nan |= x != x;
      m = ::fmax(m, x);
    }
    nan = __syncthreads_or(nan);
    m = block_max(m, scratch);
    acc_t floor = neg_inf<acc_t>();
    if (!nan && m > neg_inf<acc_t>()) {
      const ExpShifted<acc_t> e_of(v.scale, v.scale * m);
      if (o.min_p_acts()) {
        acc_t lo = inf;
        for (int64_t j = threadIdx.x; j < v.vocab; j += kSamplerThreads) {
          const acc_t x = at(j);
          if (o.min_p_keeps(e_of(x))) lo = ::fmin(lo, x);
        }
        floor = block_min(lo, scratch);
      }
      // top_k: the k-th largest key among the values >= floor, a digit at a time from the top.
      if (o.k_acts(v.vocab)) {
        if (threadIdx.x == 0) {
          prefix_shared = 0;
          need_shared = static_cast<long long>(o.top_k);
          found_shared = 1;
        }
        for (int d = kDigits - 1; d >= 0; --d) {
          for (int b = threadIdx.x; b < kBins; b += kSamplerThreads) count[b] = 0;
          __syncthreads();
          const int shift = 8 * d;
          const Key high = d == kDigits - 1 ? Key(0) : ~Key(0) << (shift + 8), prefix = prefix_shared;
          if (found_shared) {
            for (int64_t j = threadIdx.x; j < v.vocab; j += kSamplerThreads) {
              const acc_t x = at(j);
              const Key k = sampler_key(x);
              if (x >= floor && (k & high) == prefix) atomicAdd(&count[(k >> shift) & 0xff], 1u);
            }
          }
          __syncthreads();
          if (threadIdx.x == 0 && found_shared) {
            long long need = need_shared;
            int b = kBins - 1;
            for (; b >= 0 && need > count[b]; --b) need -= count[b];
            if (b < 0) {
              found_shared = 0;  // fewer values than k: top_k removes nothing
            } else {
              prefix_shared = prefix | (Key(b) << shift);
              need_shared = need;
            }
          }
          __syncthreads();
        }
        if (found_shared) floor = sampler_value<acc_t>(prefix_shared);
      }
      // top_p: the lowest key whose mass strictly above is < top_p · Z, among the values >= floor.
      if (o.p_acts()) {
        if (threadIdx.x == 0) {
          total_shared = 0;
          prefix_shared = 0;
          above_shared = 0;
        }
        __syncthreads();
        unsigned long long mine = 0;
        for (int64_t j = threadIdx.x; j < v.vocab; j += kSamplerThreads) {
          const acc_t x = at(j);
          if (x >= floor) mine += sampler_mass(e_of(x));
        }
        atomicAdd(&total_shared, mine);
        for (int d = kDigits - 1; d >= 0; --d) {
          for (int b = threadIdx.x; b < kBins; b += kSamplerThreads) {
            count[b] = 0;
            mass[b] = 0;
          }
          __syncthreads();
          const int shift = 8 * d;
          const Key high = d == kDigits - 1 ? Key(0) : ~Key(0) << (shift + 8), prefix = prefix_shared;
          for (int64_t j = threadIdx.x; j < v.vocab; j += kSamplerThreads) {
            const acc_t x = at(j);
            const Key k = sampler_key(x);
            if (x >= floor && (k & high) == prefix) {
              const int b = static_cast<int>((k >> shift) & 0xff);
              atomicAdd(&count[b], 1u);
              atomicAdd(&mass[b], static_cast<unsigned long long>(sampler_mass(e_of(x))));
            }
          }
          __syncthreads();
          if (threadIdx.x == 0) {
            const unsigned long long total = total_shared;
            unsigned long long above = above_shared, best_above = above;
            int best = -1;
            for (int b = kBins - 1; b >= 0 && o.p_keeps(above, total); --b) {
              if (count[b] != 0) {
                best = b;
                best_above = above;
              }
              above += mass[b];
            }
            // The bin of the prefix's own values holds at least one value that qualifies (the prefix was chosen
            // so): best >= 0.
            prefix_shared = prefix | (Key(best < 0 ? 0 : best) << shift);
            above_shared = best_above;
          }
          __syncthreads();
        }
        floor = sampler_value<acc_t>(prefix_shared);
      }
    }
    if (threadIdx.x == 0) {
      const int64_t label = v.target[row];
      const bool has_label = label >= 0 && label < v.vocab;
      out[row] = floor_with_label(floor, has_label, has_label ? at(label) : acc_t(0));
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
    const int per_sm = cuda::occupancy_once(reinterpret_cast<const void*>(kernel), cuda::kSamplerThreads, 0, [&] {
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, cuda::kSamplerThreads, 0));
      return blocks;
    });
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(v.n_rows, sms * std::max(per_sm, 1))));
    cuda::DependentLaunch(grid, cuda::kSamplerThreads, 0)(kernel, v, params.const_data_ptr<float>(),
                                                          out.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rl_losses
