// Each row's sampler floor on CUDA (common/sampler.h): one block per row. Every threshold is a radix selection over
// ordered keys (a value's raw bits, sign folded), a digit of kDigitBits at a time from the top, each digit's bin
// found by a parallel scan of a shared-memory histogram (select_rank, find_mass_edge):
//  1. a sweep of the row: the max of each thread's kUnroll groups of vectors (packed max.NaN, no conversion);
//  2. top_k <= kGroups: the k-th largest group max bounds the k-th largest logit from below (two digits over the
//     group maxima in shared memory); a second read, of only the groups whose max reaches the bound, copies the
//     logits at or above it out (~1% of the row at k = 1024, V = 128256), and top_k's digits are counted there:
//     the k-th largest value v_k exactly. min_p's floor (the smallest kept logit) takes a sweep of its own, or
//     rides on that read. The floor is max(min_p's, v_k): top_k over min_p's upper set is v_k when that set holds
//     more than k tokens, else void;
//  3. top_p: the same selection over the masses of the tokens at or above that floor (the copied-out logits when
//     top_k took them): fixed point (2^-24 units) in 64-bit sums, integer sums that decide alike whatever the
//     order of the additions.
// Measured on an H200 (docs/consistency.md): the selection's cost is its instructions (ALU-bound, IPC 2.75, DRAM
// 16% busy for top_k before the copy-out), not the bytes it reads.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
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
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 11;  // 2048 bins: the histograms and the group maxima fit 48 KB of static shared memory
constexpr int kBins = 1 << kDigitBits;
constexpr int kDigitsAll = 64;  // select_rank: every digit of the key
// Room for each block's top_k candidates (a row's logits at or above a bound, top_k <= kGroups): beyond, the
// selection reads the row.
constexpr int64_t kMaxCandidates = 32768;

// The raw bits of a logit as an unsigned key in the values' order (±0 one key), and back.
template <typename scalar_t>
struct RawKey {
  using Bits = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, std::conditional_t<sizeof(scalar_t) == 4,
                                                                                        uint32_t, uint64_t>>;
  static constexpr int kBits = 8 * sizeof(Bits);
  static constexpr Bits kSign = Bits(Bits(1) << (kBits - 1));
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

// One digit of the selection: the bits [shift, shift + width) of the keys whose bits above them equal `prefix`.
template <typename Bits>
struct Digit {
  int shift, width;
  Bits prefix;  // the key bits chosen so far (above shift + width), in place
  __device__ bool holds(Bits key) const {
    return shift + width >= 8 * static_cast<int>(sizeof(Bits)) || (key >> (shift + width)) == (prefix >> (shift + width));
  }
  __device__ int bin(Bits key) const { return static_cast<int>((key >> shift) & Bits((1u << width) - 1)); }
  __device__ int bins() const { return 1 << width; }
  // The digit below, once this one's bin is chosen (the last one reaches bit 0).
  __device__ Digit next(int chosen) const {
    const int w = shift < kDigitBits ? shift : kDigitBits;
    return {shift - w, w, Bits(prefix | (Bits(chosen) << shift))};
  }
  __device__ Bits key(int chosen) const { return Bits(prefix | (Bits(chosen) << shift)); }
  // The first digit: the keys' top kDigitBits.
  __device__ static Digit top() { return {8 * static_cast<int>(sizeof(Bits)) - kDigitBits, kDigitBits, Bits(0)}; }
};

template <typename T>
__device__ inline T block_max(T v, T* scratch) {
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % kWarps];
  for (int m = 16; m > 0; m >>= 1) v = ::fmax(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// The block's exclusive prefix sum of one value per thread in thread order, and (in `total`) the sum of all.
template <typename T>
__device__ inline T block_exclusive_sum(T v, T* sums /* kWarps + 1 */, T& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = v;
  for (int d = 1; d < 32; d <<= 1) {
    const T o = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += o;
  }
  __syncthreads();  // `sums` may still be read by the previous call
  if (lane == 31) sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const T w = sums[lane];
    T scan = w;
    for (int d = 1; d < 32; d <<= 1) {
      const T o = __shfl_up_sync(0xffffffffu, scan, d);
      if (lane >= d) scan += o;
    }
    sums[lane] = scan - w;
    if (lane == 31) sums[kWarps] = scan;
  }
  __syncthreads();
  total = sums[kWarps];
  return sums[warp] + inclusive - v;
}
static_assert(kWarps == 32, "block_exclusive_sum scans the warps' sums with one warp");

// A row read by 16-byte vectors between an element-wise head and tail (the order is free: every sweep's result is a
// max, a min or an integer sum), kUnroll independent loads in flight per thread (4 measured 8-12% faster than 1 on
// an H200). The vectors a thread reads fall in kUnroll groups, u = (vector index / kThreads) % kUnroll (the head and
// tail in group 0): fvec(vector, u) for the vectors of the groups `wanted(u)` keeps, one(z) for the head and tail.
constexpr int kUnroll = 4;
constexpr int kGroups = kThreads * kUnroll;  // of a row
template <typename scalar_t, typename FVec, typename FOne, typename Wanted>
__device__ inline void for_each_vector(const scalar_t* z, int64_t n, FVec&& fvec, FOne&& one, Wanted&& wanted) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t head = unaligned_head(z, n), n_vec = (n - head) / kVec;
  bool want[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) want[u] = wanted(u);
  if (want[0]) {
    for (int64_t j = threadIdx.x; j < head; j += kThreads) one(z[j]);
    for (int64_t j = head + n_vec * kVec + threadIdx.x; j < n; j += kThreads) one(z[j]);
  }
  const auto* zv = reinterpret_cast<const Pack<scalar_t, kVec>*>(z + head);
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < n_vec; i += kUnroll * kThreads) {
    Pack<scalar_t, kVec> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (want[u]) p[u] = load_vec(&zv[i + u * kThreads]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (want[u]) fvec(p[u], u);
    }
  }
  for (; i < n_vec; i += kThreads) {
    const int u = static_cast<int>(i / kThreads % kUnroll);
    if (want[u]) fvec(load_vec(&zv[i]), u);
  }
}

// f(z) for each logit of a row's groups that `wanted` keeps.
template <typename scalar_t, typename F, typename Wanted>
__device__ inline void for_each_logit(const scalar_t* z, int64_t n, F&& f, Wanted&& wanted) {
  for_each_vector(
      z, n,
      [&](const auto& p, int) {
#pragma unroll
        for (int k = 0; k < static_cast<int>(sizeof(p.v) / sizeof(p.v[0])); ++k) f(p.v[k]);
      },
      f, wanted);
}

// The top_p masses of a digit's bins, 64-bit sums. Shared memory has no native 64-bit atomic add, so a row of up to
// 2^20 tokens keeps two 32-bit sums per bin: of each mass's low 12 bits and of the rest (a mass <= 2^24 has 13 more),
// each below 2^32; neither atomic waits for its result (one that added the carry of a 32-bit sum did, and made
// top_p's histogram sweep cost ~6x a plain one). A longer row takes the 64-bit add (a compare-and-swap loop).
struct MassBins {
  static constexpr int kLowBits = 12;
  unsigned long long* words;  // kBins of them: the 64-bit sums, or the low and the high 32-bit sums one after another
  bool wide;
  __device__ unsigned* low() const { return reinterpret_cast<unsigned*>(words); }
  __device__ unsigned* high() const { return low() + kBins; }
  __device__ void add(int b, unsigned v) const {
    if (wide) {
      atomicAdd(&words[b], static_cast<unsigned long long>(v));
    } else {
      atomicAdd(&low()[b], v & ((1u << kLowBits) - 1));
      atomicAdd(&high()[b], v >> kLowBits);
    }
  }
  __device__ unsigned long long at(int b) const {
    return wide ? words[b] : (static_cast<unsigned long long>(high()[b]) << kLowBits) + low()[b];
  }
  __device__ void clear() const {
    for (int i = threadIdx.x; i < kBins; i += kThreads) words[i] = 0;
    __syncthreads();
  }
};

// The bins of a digit read from the largest keys down: thread t owns the positions [t·per, (t+1)·per).
struct BinsOwned {
  int nb, per, first;
  __device__ explicit BinsOwned(int bins) : nb(bins), per((bins + kThreads - 1) / kThreads), first(threadIdx.x * per) {}
  __device__ int count() const { return first >= nb ? 0 : (nb - first < per ? nb - first : per); }
  __device__ int bin(int i) const { return nb - 1 - first - i; }
};

// top_k: the bin that holds the key of rank `need` (1: the largest) among `count`'s, and that key's rank within it.
__device__ inline void find_rank(const unsigned* count, int bins, unsigned long long need, unsigned long long* sums,
                                 int* bin_s, unsigned long long* need_s) {
  __syncthreads();  // the histogram is complete
  const BinsOwned own(bins);
  unsigned long long mine = 0, total;
  for (int i = 0; i < own.count(); ++i) mine += count[own.bin(i)];
  unsigned long long above = block_exclusive_sum(mine, sums, total);
  for (int i = 0; i < own.count(); ++i) {
    const unsigned c = count[own.bin(i)];
    if (above < need && need <= above + c) {
      *bin_s = own.bin(i);
      *need_s = need - above;
    }
    above += c;
  }
  __syncthreads();
}

// The key of rank `need` (1: the largest) among the keys visit(f) gives f, a digit at a time from the top; after
// `digits` digits, the least key of the bin reached (at or below the exact one).
template <typename Bits, typename Visit>
__device__ inline Bits select_rank(Visit&& visit, unsigned long long need, int digits, unsigned* count,
                                   unsigned long long* sums, int* bin_s, unsigned long long* found_s) {
  Digit<Bits> d = Digit<Bits>::top();
  for (int digit = 1;; ++digit) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) count[i] = 0;
    __syncthreads();
    visit([&](Bits k) {
      if (d.holds(k)) atomicAdd(&count[d.bin(k)], 1u);
    });
    find_rank(count, d.bins(), need, sums, bin_s, found_s);
    const int chosen = *bin_s;
    need = *found_s;
    if (d.shift == 0 || digit == digits) return d.key(chosen);
    d = d.next(chosen);
  }
}

// top_p: the smallest non-empty bin whose keys have a mass above them (`above0` from the bins before this digit's)
// that top_p keeps, and that mass; `total` (the kept set's mass) is the sum of the first digit's bins.
template <typename acc_t>
__device__ inline void find_mass_edge(const MassBins& mass, int bins, unsigned long long above0,
                                      bool first_digit, unsigned long long& total, const SamplerRow<acc_t>& o,
                                      unsigned long long* sums, int* best_s, int* bin_s, unsigned long long* above_s) {
  __syncthreads();  // the histogram is complete
  const BinsOwned own(bins);
  if (threadIdx.x == 0) *best_s = -1;
  unsigned long long mine = 0, sum;
  for (int i = 0; i < own.count(); ++i) mine += mass.at(own.bin(i));
  unsigned long long above = above0 + block_exclusive_sum(mine, sums, sum);
  if (first_digit) total = sum;
  int best = -1;
  unsigned long long best_above = 0;
  for (int i = 0; i < own.count(); ++i) {
    const unsigned long long m = mass.at(own.bin(i));
    if (m != 0 && o.p_keeps(above, total)) {
      best = own.first + i;
      best_above = above;
    }
    above += m;
  }
  if (best >= 0) atomicMax(best_s, best);
  __syncthreads();
  if (best >= 0 && best == *best_s) {
    *bin_s = bins - 1 - best;
    *above_s = best_above;
  }
  __syncthreads();
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    sampler_floor_kernel(RowPassView<scalar_t, int64_t, acc_t> v, const float* params, scalar_t* workspace,
                         acc_t* out) {
  using Key = RawKey<scalar_t>;
  using Bits = typename Key::Bits;
  __shared__ acc_t scratch[kWarps];
  __shared__ unsigned count[kBins];
  __shared__ unsigned long long mass_words[kBins];
  __shared__ float group_max[kGroups];
  __shared__ unsigned long long sums[kWarps + 1], found_s;
  __shared__ int bin_s, best_s;
  __shared__ unsigned n_cands_s;
  scalar_t* cands = workspace ? workspace + blockIdx.x * kMaxCandidates : nullptr;  // read only where top_k acts
  const MassBins mass{mass_words, v.vocab > (int64_t(1) << 20)};
  wait_previous_grid();
  for (int64_t row = blockIdx.x; row < v.n_rows; row += gridDim.x) {
    const scalar_t* z = v.logits + row * v.row_stride;
    const SamplerRow<acc_t> o(params + row * kSamplerColumns);
    // The max of each of the thread's groups of vectors (NaN if one holds a NaN).
    acc_t gmax[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) gmax[u] = neg_inf<acc_t>();
    for_each_vector(
        z, v.vocab,
        [&](const auto& p, int g) {
          const acc_t x = vec_max_nan(p);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) gmax[u] = u == g ? max_nan(gmax[u], x) : gmax[u];
        },
        [&](scalar_t zj) { gmax[0] = max_nan(gmax[0], static_cast<acc_t>(zj)); }, [](int) { return true; });
    acc_t m = gmax[0];
#pragma unroll
    for (int u = 1; u < kUnroll; ++u) m = max_nan(m, gmax[u]);
    const bool nan = __syncthreads_or(m != m);
    m = block_max(m, scratch);
    acc_t floor = neg_inf<acc_t>();
    if (!nan && m > neg_inf<acc_t>()) {
      const ExpShifted<acc_t> e_of(v.scale, v.scale * m);
      bool min_p_due = o.min_p_acts();  // min_p's floor: the smallest kept logit
      acc_t lowest = -neg_inf<acc_t>();
      auto min_p_floor = [&] {
        const acc_t f = -block_max(-lowest, scratch);
        min_p_due = false;
        return f;
      };
      acc_t kth = neg_inf<acc_t>(), min_p = neg_inf<acc_t>();
      // What the selections read: the row, or the candidates copied out of it (n_cands >= 0).
      int64_t n_cands = -1;
      // Each filter's kept logits lie in the groups whose max it keeps (every kept set is an upper set): the
      // sweeps of the row read only those (`wanted`), judged with a margin (the exponential's rounding need not
      // be monotone; a group read for nothing costs only its read).
      auto min_p_may_keep = [&](int u) { return o.min_p_may_keep(e_of(gmax[u])); };
      auto sweep = [&](auto&& f, auto&& wanted) {
        if (n_cands < 0) {
          for_each_logit(z, v.vocab, f, wanted);
        } else {
          for (int64_t i = threadIdx.x; i < n_cands; i += kThreads) f(cands[i]);
        }
      };
      if (o.k_acts(v.vocab)) {
        if (o.top_k <= acc_t(kGroups)) {
          // Each group's max is at or above the k-th largest of them, L, for at least k groups: so at least k
          // logits are, and the k-th largest logit is too. The logits at or above L (~1% of a row of 128256 at
          // k = 1024) are copied out, reading again only the groups whose max reaches L, and the selection reads
          // them rather than the row (a shared-memory atomic per logit, or a sweep of the row per digit, cost 2-4x
          // a plain sweep each). L is the least float of the bin two digits reach (at or below the exact one).
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            group_max[threadIdx.x * kUnroll + u] =
                sizeof(acc_t) == 8 ? __double2float_rd(gmax[u]) : static_cast<float>(gmax[u]);
          }
          __syncthreads();
          using FloatKey = RawKey<float>;
          const auto over_groups = [&](auto f) {
            for (int i = threadIdx.x; i < kGroups; i += kThreads) f(FloatKey::of(group_max[i]));
          };
          acc_t bound = FloatKey::template value<acc_t>(select_rank<uint32_t>(
              over_groups, static_cast<unsigned long long>(o.top_k), 2, count, sums, &bin_s, &found_s));
          if (bound != bound) bound = neg_inf<acc_t>();  // the keys below −inf's are NaNs: the bin of −inf
          if (threadIdx.x == 0) n_cands_s = 0;
          __syncthreads();
          auto take = [&](scalar_t zj) {
            const acc_t x = static_cast<acc_t>(zj);
            if (x >= bound) {
              const unsigned i = atomicAdd(&n_cands_s, 1u);
              if (i < kMaxCandidates) cands[i] = zj;
            }
            if (min_p_due && o.min_p_keeps(e_of(x))) lowest = ::fmin(lowest, x);
          };
          for_each_logit(z, v.vocab, take,
                         [&](int u) { return gmax[u] >= bound || (min_p_due && min_p_may_keep(u)); });
          __syncthreads();
          if (n_cands_s <= kMaxCandidates) n_cands = n_cands_s;
          if (min_p_due) min_p = min_p_floor();
        }
        kth = Key::template value<acc_t>(select_rank<Bits>(
            [&](auto f) { sweep([&](scalar_t zj) { f(Key::of(zj)); }, [](int) { return true; }); },
            static_cast<unsigned long long>(o.top_k),
            kDigitsAll, count, sums, &bin_s, &found_s));
      }
      if (min_p_due) {
        for_each_logit(
            z, v.vocab,
            [&](scalar_t zj) {
              const acc_t x = static_cast<acc_t>(zj);
              if (o.min_p_keeps(e_of(x))) lowest = ::fmin(lowest, x);
            },
            min_p_may_keep);
        min_p = min_p_floor();
      }
      floor = kth > min_p ? kth : min_p;
      if (o.p_acts()) {
        Digit<Bits> d = Digit<Bits>::top();
        unsigned long long above = 0, total = 0;
        for (bool first = true;; first = false) {
          mass.clear();
          sweep([&](scalar_t zj) {  // the candidates hold top_k's kept set, and so top_p's
            const acc_t x = static_cast<acc_t>(zj);
            if (!(x >= floor)) return;
            const Bits k = Key::of(zj);
            if (!d.holds(k)) return;
            const unsigned units = sampler_mass(e_of(x));
            if (units != 0) mass.add(d.bin(k), units);
          }, [&](int u) { return gmax[u] >= floor && e_of(gmax[u]) >= acc_t(0.5 / kSamplerMassUnit); });
          find_mass_edge(mass, d.bins(), above, first, total, o, sums, &best_s, &bin_s, &found_s);
          const int chosen = bin_s;
          above = found_s;
          if (d.shift == 0) {
            floor = Key::template value<acc_t>(d.key(chosen));
            break;
          }
          d = d.next(chosen);
        }
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
    // top_k's candidates: room for each block's, only where a row's top_k may act (8.6 MB of bf16 on an H200).
    const at::Tensor workspace = args.sampler_top_k ? at::empty({grid.x * cuda::kMaxCandidates}, args.logits.options())
                                                    : at::Tensor();
    cuda::DependentLaunch(grid, cuda::kThreads, 0)(
        kernel, v, params.const_data_ptr<float>(),
        workspace.defined() ? workspace.data_ptr<scalar_t>() : nullptr, out.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rl_losses
