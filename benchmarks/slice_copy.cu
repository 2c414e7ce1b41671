// Memory-only forms of the cluster row kernel's access pattern, timed against a plain copy of the same
// bytes: how fast can a CTA that bulk-copies a slice into shared memory and then writes it out from there
// (what row_cluster_kernel does around its math) move bytes, and which structure gets closest to the copy?
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/slice_copy benchmarks/slice_copy.cu && /tmp/slice_copy
//     /tmp/slice_copy clusters      # only the cluster-launched slices (the last section)
//     /tmp/slice_copy sizes         # only slices of byte sizes near 64 KB (alignment of a slice's start)
//     /tmp/slice_copy placement     # CTAs per SM of a persistent cluster launch, by cluster size
//     /tmp/slice_copy data          # memcpy and slices on constant bytes and on random bf16, ~2 s each,
//                                   # with each pattern's wall-clock window (for nvidia-smi's clock samples)
//     /tmp/slice_copy zeros         # writing zeros: over random data or over zeros, in place or not
//
// Every pattern reads N·V bf16 (N = 16384, V = 128256: 4.2 GB) and writes as many; GB/s counts both, over
// the median of 20 timed runs (CUDA events) after 3 of warm-up. Patterns:
//   memcpy        cudaMemcpyDeviceToDevice (the ceiling the benchmarks use)
//   grid_copy     grid-stride 16-byte loads and stores, 8 blocks of 256 per SM
//   slice S/Pk/cN a persistent grid of N CTAs per SM (256 threads), each taking slices of S KB in turn: one
//                 thread bulk-copies the slice into shared memory in P pieces on mbarriers, every thread waits
//                 for each piece and reads its 16-byte vectors (ld.shared), then stores them to global memory;
//                 a block barrier before the next slice's copy (the cluster kernel's 1-stage structure)
//   +tma_store    the same, but the slice goes out by one bulk copy shared -> global (cp.async.bulk), and
//                 the next copy in waits until that one has read the buffer
//   ring S/k/tT   one CTA of T threads per SM, k buffers of S KB: thread 0 keeps k-1 slices in flight
//                 ahead of the slice being written (a pipelined structure, loads never stop)
//   +work         with the loss's math between the copy in and the copy out (stats_of, block_sum, grad_of):
//                 two exponentials per value, a block reduction per slice
//   cluster C x K the slice pattern launched as K clusters of C CTAs (the most that can be resident)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/bulk_copy.cuh"  // the kernel's own bulk-copy and mbarrier primitives

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

using rl_losses::cuda::bulk_copy_to_shared;
using rl_losses::cuda::mbarrier_arrive_expect;
using rl_losses::cuda::mbarrier_init;
using rl_losses::cuda::mbarrier_wait;
using rl_losses::cuda::smem_addr;

__device__ inline void bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ inline void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ inline void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

__global__ void grid_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

constexpr int kMaxPieces = 8;

// The math of the fused loss around the copy (with `work`): per 16-byte vector of 8 bf16, the statistics
// pass takes 8 exponentials into a per-thread sum, a block reduction follows (warp shuffles, a barrier),
// then the gradient pass writes 8 exponentials (FFMA, ex2, FFMA, pack) per vector. Without `work` the slice
// is copied as is.
__device__ inline float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ inline float stats_of(uint4 v, float a, float b) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  float e[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    e[2 * k] = ex2(fmaf(__uint_as_float(w[k] << 16), a, -b));
    e[2 * k + 1] = ex2(fmaf(__uint_as_float(w[k] & 0xffff0000u), a, -b));
  }
  return ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}
__device__ inline uint4 grad_of(uint4 v, float a, float b, float sa, float sc) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  unsigned o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float lo = sa * ex2(fmaf(__uint_as_float(w[k] << 16), a, -b)) + sc;
    const float hi = sa * ex2(fmaf(__uint_as_float(w[k] & 0xffff0000u), a, -b)) + sc;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(o[k]) : "f"(hi), "f"(lo));
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}
// Sum over the block; every thread gets it. `scratch` holds a float per warp.
template <int kThreads>
__device__ inline float block_sum(float x, float* scratch) {
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = threadIdx.x % 32 < kThreads / 32 ? scratch[threadIdx.x % 32] : 0.f;
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// One buffer per CTA: copy in (pieces), wait, write out, block barrier, next slice.
__global__ void __launch_bounds__(256) slice_copy(const char* src, char* dst, long n_slices, int slice_bytes,
                                                  int pieces, int tma_store, int work) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ uint64_t landed[kMaxPieces];
  __shared__ float scratch[32];
  const int piece_bytes = slice_bytes / pieces;
  if (threadIdx.x == 0) {
    for (int p = 0; p < pieces; ++p) mbarrier_init(&landed[p]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int n_vec = slice_bytes / 16;
  int it = 0;
  for (long s = blockIdx.x; s < n_slices; s += gridDim.x, ++it) {
    __syncthreads();  // every thread is done with the buffer
    if (threadIdx.x == 0) {
      if (tma_store) bulk_wait_read();  // the previous slice's store has read the buffer
      for (int p = 0; p < pieces; ++p) {
        mbarrier_arrive_expect(&landed[p], piece_bytes);
        bulk_copy_to_shared(buf + p * piece_bytes, src + s * slice_bytes + p * piece_bytes, piece_bytes, &landed[p]);
      }
    }
    const unsigned phase = it & 1;
    if (tma_store) {
      if (threadIdx.x == 0) {
        for (int p = 0; p < pieces; ++p) mbarrier_wait(&landed[p], phase);
        bulk_store(dst + s * slice_bytes, buf, slice_bytes);
        bulk_commit();
      }
      continue;
    }
    const uint4* in = reinterpret_cast<const uint4*>(buf);
    uint4* out = reinterpret_cast<uint4*>(dst + s * slice_bytes);
    int next = 0, piece_end = 0;
    if (!work) {
      for (int i = threadIdx.x; i < n_vec; i += 256) {
        for (; i >= piece_end; piece_end += piece_bytes / 16) mbarrier_wait(&landed[next++], phase);
        out[i] = in[i];
      }
      continue;
    }
    float sum = 0.f;
    for (int i = threadIdx.x; i < n_vec; i += 256) {
      for (; i >= piece_end; piece_end += piece_bytes / 16) mbarrier_wait(&landed[next++], phase);
      sum += stats_of(in[i], 1.4f, 30.f);
    }
    const float total = block_sum<256>(sum, scratch);
    const float sa = 1.f / (total + 1.f), sc = -sa * 1e-3f;
    for (int i = threadIdx.x; i < n_vec; i += 256) out[i] = grad_of(in[i], 1.4f, 30.f, sa, sc);
  }
  if (tma_store && threadIdx.x == 0) bulk_wait_all();
}

// k buffers in a ring: slice j in buffer j % k; thread 0 issues slice j + k - 1 as soon as slice j - 1's
// buffer is free (after the block barrier that ends slice j - 1), so k - 1 slices are always in flight.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) ring_copy(const char* src, char* dst, long n_slices, int slice_bytes,
                                                      int k, int work) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ uint64_t landed[kMaxPieces];
  __shared__ float scratch[32];
  if (threadIdx.x == 0) {
    for (int b = 0; b < k; ++b) mbarrier_init(&landed[b]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto slice_of = [&](long j) { return blockIdx.x + j * gridDim.x; };
  auto issue = [&](long j) {
    if (threadIdx.x != 0 || slice_of(j) >= n_slices) return;
    const int b = j % k;
    mbarrier_arrive_expect(&landed[b], slice_bytes);
    bulk_copy_to_shared(buf + size_t(b) * slice_bytes, src + slice_of(j) * slice_bytes, slice_bytes, &landed[b]);
  };
  for (long j = 0; j < k - 1; ++j) issue(j);
  const int n_vec = slice_bytes / 16;
  for (long j = 0; slice_of(j) < n_slices; ++j) {
    issue(j + k - 1);  // into the buffer of slice j - 1, free since the barrier below
    const int b = j % k;
    mbarrier_wait(&landed[b], (j / k) & 1);
    const uint4* in = reinterpret_cast<const uint4*>(buf + size_t(b) * slice_bytes);
    uint4* out = reinterpret_cast<uint4*>(dst + slice_of(j) * slice_bytes);
    if (work) {
      float sum = 0.f;
      for (int i = threadIdx.x; i < n_vec; i += kThreads) sum += stats_of(in[i], 1.4f, 30.f);
      const float total = block_sum<kThreads>(sum, scratch);
      const float sa = 1.f / (total + 1.f), sc = -sa * 1e-3f;
      for (int i = threadIdx.x; i < n_vec; i += kThreads) out[i] = grad_of(in[i], 1.4f, 30.f, sa, sc);
    } else {
      for (int i = threadIdx.x; i < n_vec; i += kThreads) out[i] = in[i];
    }
    __syncthreads();
  }
}

// Random bf16 of a N(0, 1)-like spread (the sum of 4 uniforms, centred), from a hash of the index.
__global__ void fill_random(uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned w[4];
    for (int k = 0; k < 4; ++k) {
      unsigned h = static_cast<unsigned>(i * 4 + k) * 2654435761u;
      unsigned out = 0;
      for (int half = 0; half < 2; ++half) {
        float u = 0.f;
        for (int j = 0; j < 4; ++j) {
          h ^= h >> 15;
          h *= 2246822519u;
          h ^= h >> 13;
          u += (h & 0xffffff) * (1.f / 16777216.f);
        }
        out |= (__float_as_uint((u - 2.f) * 1.7f) >> 16) << (16 * half);
      }
      w[k] = out;
    }
    dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// In place: x = x / 2 (nonzero over nonzero) or x = 0 (zeros over the values just read), as
// (x - sub) & mask with run-time sub and mask, so that the compiler keeps the load for mask = 0.
__global__ void rewrite(uint4* x, size_t n, unsigned sub, unsigned mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = x[i];
    x[i] = make_uint4((v.x - sub) & mask, (v.y - sub) & mask, (v.z - sub) & mask, (v.w - sub) & mask);
  }
}
// Out of place: dst = src / 2 or dst = 0, reading src all the same.
__global__ void transform(const uint4* src, uint4* dst, size_t n, unsigned sub, unsigned mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = src[i];
    dst[i] = make_uint4((v.x - sub) & mask, (v.y - sub) & mask, (v.z - sub) & mask, (v.w - sub) & mask);
  }
}
// Writes only: zeros or a nonzero constant.
__global__ void fill(uint4* dst, size_t n, unsigned word) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = make_uint4(word, word, word, word);
}

double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
}

template <typename F>
float median_ms(F f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A launch of `kernel` (256 threads, `smem` bytes of dynamic shared memory) as clusters of c CTAs, as many
// as can be resident at once (`clusters`); `attr` holds the cluster shape the configuration points to.
template <typename Kernel>
cudaLaunchConfig_t resident_clusters(Kernel kernel, int c, int smem, cudaLaunchAttribute& attr, int& clusters) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = c;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(c);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  CK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  cfg.gridDim = dim3(c * clusters);
  return cfg;
}

// Where the CTAs of a persistent cluster launch land: each CTA of the most clusters that can be resident
// records its SM while all are resident; the histogram counts SMs by the CTAs they hold. (On the H100s
// measured, every cluster size >= 3 leaves 8 SMs without a CTA; sizes 1 and 2 fill all 132.)
__global__ void where_am_i(int* sm_of_cta, unsigned long long spin_ns) {
  unsigned sm;
  asm("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) sm_of_cta[blockIdx.x] = static_cast<int>(sm);
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < spin_ns);  // stay resident
}

int placement() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  CK(cudaFuncSetAttribute(where_am_i, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(where_am_i, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  CK(cudaFuncSetAttribute(where_am_i, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int* sm_of_cta;
  CK(cudaMalloc(&sm_of_cta, 4096 * sizeof(int)));
  // The cluster kernel's shared memory per CTA at V = 128256 (64 KB slices, 3 per SM) and with 96 KB slices.
  for (int smem : {64512 + 1500, 85504 + 1500}) {
    for (int c : {1, 2, 3, 4, 5, 6, 8}) {
      cudaLaunchAttribute attr;
      int clusters = 0;
      const cudaLaunchConfig_t cfg = resident_clusters(where_am_i, c, smem, attr, clusters);
      CK(cudaLaunchKernelEx(&cfg, where_am_i, sm_of_cta, 200000ull));
      std::vector<int> sm(c * clusters), per_sm(prop.multiProcessorCount, 0), hist(9, 0);
      CK(cudaMemcpy(sm.data(), sm_of_cta, sm.size() * sizeof(int), cudaMemcpyDeviceToHost));
      for (int s : sm) ++per_sm[s];
      for (int n : per_sm) ++hist[std::min(n, 8)];
      std::printf("smem %6d B, cluster %d: %3d clusters, %3d CTAs; SMs holding 0/1/2/3 CTAs: %d/%d/%d/%d\n", smem,
                  c, clusters, c * clusters, hist[0], hist[1], hist[2], hist[3]);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool clusters_only = mode == "clusters", sizes_only = mode == "sizes";
  if (mode == "placement") return placement();
  const long n_rows = 16384, vocab = 128256;
  const size_t bytes = size_t(n_rows) * vocab * 2;
  char *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  if (mode == "zeros") {
    // Is writing zeros slower than writing other values, and does it depend on what the memory held? Each
    // timed call is preceded (untimed) by what sets the memory's prior contents: random bf16 or zeros.
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int grid = prop.multiProcessorCount * 8;
    const size_t nv = bytes / 16;
    uint4* a = reinterpret_cast<uint4*>(src);
    uint4* b = reinterpret_cast<uint4*>(dst);
    auto randomize = [&](uint4* p) { fill_random<<<grid, 256>>>(p, nv); };
    auto zero_out = [&](uint4* p) { CK(cudaMemsetAsync(p, 0, bytes)); };
    auto time = [&](const char* name, double moved, auto prep, auto f) {
      std::vector<float> t;
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      for (int r = 0; r < 12; ++r) {
        prep();
        CK(cudaEventRecord(e0));
        f();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      const float ms = t[t.size() / 2];
      std::printf("%-44s %7.3f ms %7.0f GB/s\n", name, ms, moved / ms / 1e6);
    };
    const double b1 = double(bytes), b2 = 2.0 * bytes;
    const unsigned kHalf = 0x00800080u;  // subtracted from a bf16 pair: both exponents down by one
    randomize(a);
    time("memcpy random -> random", b2, [&] { randomize(b); }, [&] {
      CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
    });
    time("in place x/2 over random", b2, [&] { randomize(a); },
         [&] { rewrite<<<grid, 256>>>(a, nv, kHalf, ~0u); });
    time("in place x unchanged over random", b2, [&] { randomize(a); },
         [&] { rewrite<<<grid, 256>>>(a, nv, 0u, ~0u); });
    time("in place 0 over random (reads x)", b2, [&] { randomize(a); },
         [&] { rewrite<<<grid, 256>>>(a, nv, 0u, 0u); });
    time("in place 0 over zeros (reads x)", b2, [&] { zero_out(a); },
         [&] { rewrite<<<grid, 256>>>(a, nv, 0u, 0u); });
    randomize(a);
    time("out of place x/2 -> over random", b2, [&] { randomize(b); },
         [&] { transform<<<grid, 256>>>(a, b, nv, kHalf, ~0u); });
    time("out of place 0 -> over random", b2, [&] { randomize(b); },
         [&] { transform<<<grid, 256>>>(a, b, nv, 0u, 0u); });
    time("out of place 0 -> over zeros", b2, [&] { zero_out(b); },
         [&] { transform<<<grid, 256>>>(a, b, nv, 0u, 0u); });
    time("out of place x/2 -> over zeros", b2, [&] { zero_out(b); },
         [&] { transform<<<grid, 256>>>(a, b, nv, kHalf, ~0u); });
    time("write 0 over random", b1, [&] { randomize(b); }, [&] { fill<<<grid, 256>>>(b, nv, 0u); });
    time("write 0 over zeros", b1, [&] { zero_out(b); }, [&] { fill<<<grid, 256>>>(b, nv, 0u); });
    time("write 0x3f803f80 over random", b1, [&] { randomize(b); }, [&] { fill<<<grid, 256>>>(b, nv, 0x3f803f80u); });
    time("write 0x3f803f80 over zeros", b1, [&] { zero_out(b); }, [&] { fill<<<grid, 256>>>(b, nv, 0x3f803f80u); });
    time("cudaMemset 0 over random", b1, [&] { randomize(b); }, [&] { zero_out(b); });
    CK(cudaGetLastError());
    return 0;
  }
  if (mode == "data") {
    // Does the data change the speed? Each pattern runs back to back for ~2 s (so that clocks and power
    // settle) on constant bytes, then on random bf16; a WINDOW line gives its wall-clock span in ms.
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount, sb = 64512;
    CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    for (const char* fill : {"const", "random"}) {
      if (fill[0] == 'c') {
        CK(cudaMemset(src, 1, bytes));
      } else {
        fill_random<<<sms * 8, 256>>>(reinterpret_cast<uint4*>(src), bytes / 16);
      }
      CK(cudaDeviceSynchronize());
      auto run = [&](const char* name, auto f) {
        std::vector<cudaEvent_t> ev(201);
        for (auto& e : ev) CK(cudaEventCreate(&e));
        for (int i = 0; i < 3; ++i) f();
        CK(cudaDeviceSynchronize());
        const double t0 = wall_ms();
        std::vector<float> t;
        for (int rep = 0; rep < 4; ++rep) {  // 4 x 200 calls of ~3 ms: ~2.4 s
          CK(cudaEventRecord(ev[0]));
          for (int i = 0; i < 200; ++i) {
            f();
            CK(cudaEventRecord(ev[i + 1]));
          }
          CK(cudaEventSynchronize(ev[200]));
          for (int i = 0; i < 200; ++i) {
            float ms;
            CK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
            t.push_back(ms);
          }
        }
        const double t1 = wall_ms();
        std::sort(t.begin(), t.end());
        const float ms = t[t.size() / 2];
        std::printf("WINDOW %s/%s %.0f %.0f %.4f %.0f\n", name, fill, t0, t1, ms, 2 * bytes / ms / 1e6);
        std::fflush(stdout);
        for (auto& e : ev) CK(cudaEventDestroy(e));
      };
      run("memcpy", [&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
      for (int work : {0, 1}) {
        run(work ? "slice+work" : "slice", [&] {
          slice_copy<<<sms * 3, 256, sb>>>(src, dst, static_cast<long>(bytes / sb), sb, 4, 0, work);
        });
      }
    }
    CK(cudaGetLastError());
    return 0;
  }
  CK(cudaMemset(src, 1, bytes));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, %.2f GB each way\n", prop.name, sms, bytes / 1e9);
  const float copy_ms = median_ms([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  auto report = [&](const char* name, float ms) {
    std::printf("%-28s %7.3f ms %7.0f GB/s %6.1f%% of memcpy\n", name, ms, 2 * bytes / ms / 1e6,
                100.0 * copy_ms / ms);
  };
  report("memcpy", copy_ms);
  if (sizes_only) {
    // Slices of a few byte sizes near 64 KB, back to back (so a slice starts at a multiple of its size):
    // does a slice whose start is only 128-byte aligned (64128 = V = 128256's quarter row) move bytes as
    // fast as one on a 512-byte or 64 KB boundary? GB/s over the bytes the whole slices cover.
    CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    for (int work : {0, 1}) {
      for (int sb : {65536, 64128, 64256, 64512, 63488, 65024}) {
        const long n_slices = bytes / sb;
        const float ms = median_ms([&] { slice_copy<<<sms * 3, 256, sb>>>(src, dst, n_slices, sb, 4, 0, work); });
        const double moved = 2.0 * n_slices * sb;
        std::printf("slice %6d B/4p/c3%-6s   %7.3f ms %7.0f GB/s %6.1f%% of memcpy\n", sb, work ? "+work" : "", ms,
                    moved / ms / 1e6, 100.0 * (moved / ms) / (2.0 * bytes / copy_ms));
      }
    }
    return 0;
  }
  if (!clusters_only) report("grid_copy", median_ms([&] {
           grid_copy<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                                       bytes / 16);
         }));
  CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));  // all uses
  CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  struct Shape {
    int kb, pieces, ctas;
  };
  for (int work : {0, 1}) {
    if (clusters_only) break;
    for (int tma : {0, 1}) {
      if (tma && work) continue;
      for (Shape sh : {Shape{64, 4, 3}, Shape{64, 1, 3}, Shape{32, 2, 6}, Shape{96, 6, 2}, Shape{48, 3, 4},
                       Shape{16, 1, 12}}) {
        const int sb = sh.kb * 1024;
        const long n_slices = bytes / sb;
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, slice_copy, 256, sb));
        char name[64];
        std::snprintf(name, sizeof(name), "slice %d/%dp/c%d%s%s", sh.kb, sh.pieces, std::min(per_sm, sh.ctas),
                      tma ? "+tma_store" : "", work ? "+work" : "");
        report(name, median_ms([&] {
                 slice_copy<<<sms * std::min(per_sm, sh.ctas), 256, sb>>>(src, dst, n_slices, sb, sh.pieces, tma,
                                                                           work);
               }));
      }
    }
    auto rings = [&](auto kernel, int threads) {
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      for (Shape sh : {Shape{64, 3, 1}, Shape{96, 2, 1}, Shape{48, 4, 1}, Shape{32, 6, 1}, Shape{16, 8, 1}}) {
        const int sb = sh.kb * 1024;
        char name[64];
        std::snprintf(name, sizeof(name), "ring %d/%d/t%d%s", sh.kb, sh.pieces, threads, work ? "+work" : "");
        report(name, median_ms([&] { kernel<<<sms, threads, sb * sh.pieces>>>(src, dst, bytes / sb, sb, sh.pieces, work); }));
      }
    };
    rings(ring_copy<512>, 512);
    rings(ring_copy<768>, 768);
    rings(ring_copy<1024>, 1024);
  }
  // The same slices launched as clusters of C CTAs (as the cluster kernel is; the CTAs of a cluster do not
  // talk here): as many clusters as cudaOccupancyMaxActiveClusters allows, i.e. the CTA slots a cluster
  // shape leaves empty.
  for (Shape sh : {Shape{64, 4, 3}, Shape{96, 6, 2}, Shape{128, 8, 1}}) {
    const int sb = sh.kb * 1024;
    for (int c : {1, 2, 3, 4, 5, 6, 8}) {
      CK(cudaFuncSetAttribute(slice_copy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      cudaLaunchAttribute attr;
      int clusters = 0;
      const cudaLaunchConfig_t cfg = resident_clusters(slice_copy, c, sb, attr, clusters);
      char name[64];
      std::snprintf(name, sizeof(name), "slice %d/%dp cluster %d x %d", sh.kb, sh.pieces, c, clusters);
      const long n_slices = bytes / sb;
      report(name, median_ms([&] {
               CK(cudaLaunchKernelEx(&cfg, slice_copy, static_cast<const char*>(src), dst, n_slices, sb, sh.pieces,
                                     0, 0));
             }));
    }
  }
  // A last check that the slices moved what they should.
  std::vector<unsigned char> head(1 << 20);
  CK(cudaMemcpy(head.data(), dst, head.size(), cudaMemcpyDeviceToHost));
  std::printf("check: %s\n", std::all_of(head.begin(), head.end(), [](unsigned char c) { return c == 1; })
                                 ? "ok"
                                 : "WRONG");
  return 0;
}
