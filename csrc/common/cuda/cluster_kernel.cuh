// The cluster kernel of the CUDA row pass (row_pass.h): statistics, epilogue and gradient of the fused shape
// (CE, GRPO) in one launch, each row split over a thread-block cluster of C CTAs (sm_90) that keep their
// slices in shared memory from the load to the gradient, so that the logits are read from DRAM once.
// Its shapes and launches: cluster_launch.cuh.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/bulk_copy.cuh"
#include "common/cuda/cluster_sampler.cuh"
#include "common/cuda/vectors.cuh"
#include "common/dependent_launch.cuh"

namespace rl_losses {
namespace cuda {

// Shared-memory bytes of one CTA's slice buffer. 64 KB lets 3 CTAs share an SM (3 x 64 KB plus their static
// shared memory fit the 228 KB of an H100/H200 SM), so that one CTA's wait for its slice hides behind the
// others' work (slices of 96 KB, 2 CTAs per SM, measured faster on one H100 only, slower on an H200 and at
// V = 262144). 64 KB slices hold a bf16 row of 128256 in 4 CTAs, of 262144 in 8; an fp32 row of 262144 in 16.
constexpr int64_t kClusterCtaBytes = 64 * 1024;
// A slice arrives in pieces of kClusterPieceBytes, each on its own mbarrier, so that the statistics start
// on the first piece while the others are still in flight (waiting for the whole slice measured slower).
constexpr int kClusterPieceBytes = 16 * 1024;
constexpr int kClusterMaxPieces = static_cast<int>(kClusterCtaBytes / kClusterPieceBytes);
constexpr int kClusterThreads = 256;
// The slice buffers start on a boundary of this many bytes of shared memory. The dynamic shared memory
// follows the static variables, which leave it only 16-byte aligned; buffers placed there held the kernel up
// to 5 points of the copy bandwidth lower on an H100 (3.5-4 at V = 128256; boundaries of 64, 128, 256 and
// 1024 bytes measured alike; docs/design.md v19).
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

// Fused statistics, epilogue and gradient (CE, GRPO) with a cluster of C CTAs per row, C = the cluster's
// size (1 to 16). CTA rank r owns the columns [r·slice, min(V, (r+1)·slice)) of every row and keeps them in
// shared memory from their load to their gradient, so that the logits are read from DRAM once. Per row:
//   1. the slice arrives in shared memory by bulk copy, in pieces; each thread folds its 16-byte vectors
//      into an online softmax state (a piece as soon as it has landed) and the block reduces them; with the
//      label's logit (if the label is in this slice) the CTA's state is sent to every CTA of the cluster
//      (st.async into a slot of their `gathered`, counted on an mbarrier there);
//   2. once all C states have landed, warp 0 of every CTA combines them (in rank order, by a fixed shuffle
//      tree: every CTA gets the same bits) and lane 0 runs the epilogue; every CTA's epilogue writes the
//      same per-row outputs, which is cheaper than a second round of messages from one CTA (rank 0 alone
//      stores the statistics where stats_out is given);
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
// option ran 10% slower (same inner-loop SASS, cause not found; docs/design.md, v8b).
// The copies go to shared memory directly because registers are the scarce resource here: 3 CTAs of 256
// threads per SM leave 85 per thread. The partial last vector of a row is loaded by one thread and stored
// at the end of the slice, beyond the copied bytes. A slot of `gathered` is rewritten two rows read later, which
// a peer can reach only after this CTA has sent it the next row's state, i.e. after this CTA's block barrier
// that follows warp 0's reads of the slot.
// kMinP: each row's sampler floor, min_p's, computed here (cluster_sampler.cuh). kChunk: the statistics' online-softmax
// chunk (launch_row_cluster).
template <int kThreads, typename scalar_t, typename label_t, typename acc_t, bool kEntropy, bool kSmoothing,
          typename Epilogue, bool kMinP = false, int kChunk = kClusterChunkVecs<kEntropy, kSmoothing>>
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
  __shared__ acc_t max_shared, log_sumexp_shared;
  // One mbarrier per piece of each buffer: that piece of the slice has arrived.
  __shared__ uint64_t landed[2][kClusterMaxPieces];
  __shared__ ClusterMinPShared<kMinP, acc_t> min_p_shared;  // empty unless kMinP

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
    min_p_shared.init();
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
        if (rank == 0 && threadIdx.x == 0) {
          epi(v.epilogue_row(row), label_ahead, RowStats<acc_t>::empty());
          if (v.stats_out != nullptr) store_stats(v.stats_out, row, RowStats<acc_t>::empty());
        }
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

    acc_t floor = acc_t(0);
    if constexpr (kMinP) {  // steps 1 and 2 of cluster_sampler.cuh
      auto& ms = min_p_shared;
      const int q = it & 1;  // the row's slots, and their barriers' phase
      const unsigned gather_phase = static_cast<unsigned>((it >> 1) & 1);
      // 1. the raw max of the slice; block_nan_min's barrier makes the whole slice visible to every thread
      acc_t m = slice_max<kThreads, acc_t>(slice, x, n_full, rem, owns_rem, wait_piece);
      m = -block_nan_min<kThreads>(-m, ms.scratch);
      if (threadIdx.x < 32) {
        acc_t all = cluster_gather(m, ms.maxes[q], &ms.maxes_full[q], rank, n_ctas, gather_phase, neg_inf<acc_t>());
        for (int k = 16; k > 0; k >>= 1) all = max_nan(all, __shfl_xor_sync(0xffffffffu, all, k));
        if (threadIdx.x == 0) ms.row_max = all;
      }
      __syncthreads();
      // 2. the least logit min_p keeps, or the label's: every CTA filters alike (the same max and option; a NaN
      // max, from a NaN in the row, filters nothing)
      const acc_t row_max = ms.row_max;
      const SamplerRow<acc_t> o(v.sampler_params + v.epilogue_row(row) * kSamplerColumns);
      const bool filters = o.min_p_acts() && row_max > neg_inf<acc_t>();
      acc_t lowest = -neg_inf<acc_t>();
      if (filters) {
        const ExpShifted<acc_t> e_of(v.scale, v.scale * row_max);  // the floor kernel's
        lowest = min_p_lowest<kThreads>(slice, n_full, rem, owns_rem, e_of, o);
        if (threadIdx.x == 0 && has_label) {
          if (local < n_full * kVec) wait_piece(static_cast<int>(local / kVec));  // it may be another's
          lowest = floor_with_label(lowest, true, static_cast<acc_t>(reinterpret_cast<const scalar_t*>(slice)[local]));
        }
      }
      lowest = block_nan_min<kThreads>(lowest, ms.scratch);
      if (threadIdx.x < 32) {
        acc_t all = cluster_gather(lowest, ms.lowest[q], &ms.lowest_full[q], rank, n_ctas, gather_phase, -neg_inf<acc_t>());
        for (int k = 16; k > 0; k >>= 1) all = ::fmin(all, __shfl_xor_sync(0xffffffffu, all, k));
        if (threadIdx.x == 0) ms.floor = filters ? all : neg_inf<acc_t>();
      }
      __syncthreads();
      floor = ms.floor;
    }
    // The statistics of the slice; where kMinP (step 3), over the logits at or above the floor (below: −inf).
    RowStats<acc_t> st = RowStats<acc_t>::empty();
    if (owns_rem) {
      VecT part;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < rem) {
          part.v[k] = x[n_full * kVec + k];
          const acc_t z = static_cast<acc_t>(part.v[k]);
          st.template add<kEntropy, kSmoothing>(kMinP && z < floor ? neg_inf<acc_t>() : z, v.scale);
        }
      }
      store_vec(&slice[n_full], part);
    }
    int i = threadIdx.x;
    for (; i + (kChunk - 1) * kThreads < n_full; i += kChunk * kThreads) {
      wait_piece(i);
      VecT chunk[kChunk];
#pragma unroll
      for (int c = 0; c < kChunk; ++c) chunk[c] = load_vec(&slice[i + c * kThreads]);
      add_vecs<kEntropy, kSmoothing, kMinP>(st, chunk, v.scale, floor);
    }
    for (; i < n_full; i += kThreads) {
      wait_piece(i);
      const VecT one[1] = {load_vec(&slice[i])};
      add_vecs<kEntropy, kSmoothing, kMinP>(st, one, v.scale, floor);
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
        coef_shared = epi(v.epilogue_row(row), label, all);
        if (rank == 0 && v.stats_out != nullptr) store_stats(v.stats_out, row, all);
        max_shared = all.max;
        log_sumexp_shared = ::log(all.sumexp);
      }
    }
    __syncthreads();

    const GradOf<scalar_t, acc_t, Epilogue::kMayUseEntropyGrad, kMinP> grad_of(
        coef_shared, max_shared, log_sumexp_shared, v.scale, has_label ? local : int64_t(-1), floor);
    VecT* gv = reinterpret_cast<VecT*>(v.grad + row * v.grad_row_stride + begin);
    // Unrolled by 2. By 4 gained up to a point at large V, but took the bf16 kernel from 64 to 72 registers
    // (4 to 3 CTAs per SM where the slices allow more): -6.5 points at V = 8192 (docs/design.md v16).
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

}  // namespace cuda
}  // namespace rl_losses
