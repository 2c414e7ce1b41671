// Distillation's fused CUDA pass (sm_90): statistics, JSD's sums, the row step and the gradient of a row in one
// kernel, the row split over a thread-block cluster of C CTAs that hold their column slices of BOTH the
// student's and the teacher's row in shared memory from the load to the gradient, so that each tensor is read
// from DRAM once (the separate passes of distillation_cuda.cu read both rows two or three times).
//
// The structure is the cross-entropy cluster kernel's (common/cuda/cluster_kernel.cuh, whose helpers it uses:
// bulk copies in pieces on mbarriers, st.async messages between the CTAs, ClusterLaunch's occupancy, the
// persistent grid and its tail launch). Per row, CTA rank r owning columns [r·slice, min(V, (r+1)·slice)):
//   1. thread 0 bulk-copies the student's and the teacher's slice side by side (student at 0, teacher at a
//      128-byte boundary after it), in pieces of both of ~16 KB, each on its own mbarrier; every thread folds
//      its groups of 16 bytes of the student (and the teacher's columns beside them) into a DistillStats as
//      soon as their piece has landed (distillation_math.h: one copy of the formula), the block combines them
//      and sends the CTA's state to every CTA of the cluster (st.async into a slot of their `gathered`);
//   2. JSD only: with both log-normalisers known, the sums (Σ loss terms, S) over the slice from shared
//      memory, block sums, the same exchange of the two values;
//   3. warp 0 of every CTA combines the C states (and sums) in rank order by a fixed butterfly, so that every
//      CTA has the same bits, and lane 0 runs distill_row (the row step's math; a head's other terms run in warp
//      1 at the same time); rank 0 writes row_loss and divergence (the op's outputs; the statistics, sums and
//      gradient table stay on chip);
//   4. every CTA writes the gradient of its slice from shared memory (distill_grad), one 16-byte store per
//      group, a piece at a time: once every thread is done with a piece (a block barrier), thread 0 issues the
//      copy of that piece of the cluster's next row read, so the next row's load overlaps this row's gradient
//      (the per-element math is heavy here: 4 exponentials for the KLs, and the first version, which issued a
//      row's copy only once the previous row was done, ran at 56% of the copy ceiling on an H200 with the SMs'
//      special-function and issue slots ~60% busy). In place (grad == logits) is safe: a CTA writes only its
//      own slice, after it has landed.
// The statistics accumulate only the weighted sums the kind's row step reads (distill_sums_of).
// A masked row (mask 0) is neither read nor exchanged: every CTA writes zeros over its slice, rank 0 the zero
// outputs (every CTA reads the same mask, so all skip the same rows). No cluster barrier per row (it would
// wait for every thread's outstanding gradient stores): a slot of `gathered` / `gathered_sums` is rewritten two
// rows read later, which a peer reaches only after this CTA has sent it the next row's state, i.e. after the
// block barrier that follows warp 0's reads of the slot.
//
// Where: CUDA sm_90+, a gradient asked, statistics and JSD sums not given (tensor parallelism keeps the
// separate passes, which take them), not in the batch-invariant mode (the tail launch's C depends on N, and
// the forward-only path's bits would differ), student and teacher each fp32/bf16/fp16, V a multiple of 8
// (every slice and piece a whole number of 16-byte copies), rows 16-byte aligned in logits, teacher and grad,
// and the slices of the fewest CTAs fitting kClusterCtaBytes, at most kDistillClusterMaxCtas (8 for the KLs and
// the cross-entropy, 4 for JSD: where it measured faster; bf16 + bf16 take 4 bytes a column, so 8 CTAs at
// V = 128256 and 10 at 151936; bf16 + fp32 6 bytes). Otherwise launch_distill_cluster
// (distillation_cluster_launch.cuh) returns false and the separate passes run.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/cuda/cluster_launch.cuh"
#include "distillation/distillation.h"
#include "distillation/distillation_block.cuh"

namespace rl_losses {
namespace distill_cuda {

// A slice arrives in at most this many pieces (each of kClusterThreads groups or a multiple: >= 6 KB).
constexpr int kDistillMaxPieces = 12;

// The row step of the distillation op: no other terms. A head (the fused head's, fused_head_distill.h) has kOn and
//   cluster_distill(row, stats, jsd_loss, jsd_s, write, table): the distillation term's output (written where
//       `write`: one CTA of the cluster) and its gradient table;
//   cluster_others(row, stats, write, coef, part): the other terms' outputs and coefficients (distill_head_grad) in
//       kParts parts, part p run by warp 1 + p beside warp 0's cluster_distill, the parts' coefficients then added;
//   label(row): the label those read;
//   prefetch(row): a hint at the row's start (its per-row inputs, read by cluster_others once the statistics are in);
// it reads its own mask (the kernel then reads every row), and indexes its arrays by the row of the whole call.
struct DistillNoHead {
  static constexpr bool kOn = false;
  static constexpr int kParts = 0;
};

template <typename student_t, typename teacher_t, typename Head = DistillNoHead>
struct DistillClusterView {
  const student_t* z;
  const teacher_t* zt;
  student_t* grad;
  int64_t rs, rt, rg;  // row strides (elements)
  int64_t n_rows, vocab;
  const float* mask;     // (N,) or null
  const float* divisor;  // 0-dim D, or null: divisor_value
  float divisor_value;
  float* row_loss;       // (N,)
  float* divergence;     // (N,)
  DistillOptions<float> opt;
  int slice_cols;      // columns per CTA (a multiple of 8)
  int teacher_offset;  // bytes from the student's slice to the teacher's in shared memory
  int piece_groups;    // groups of 16 student bytes per piece (a multiple of kClusterThreads)
  Head head;
  int64_t row0;  // the call's index of row 0 (the tail launch's rows follow the main launch's)
};

template <DistillKind kKind, typename student_t, typename teacher_t, typename Head>
__global__ void __launch_bounds__(cuda::kClusterThreads, 3)
    distill_cluster_kernel(DistillClusterView<student_t, teacher_t, Head> v, bool tail) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  CUDA_KERNEL_ASSERT(false && "rl_losses: thread-block clusters need sm_90");  // not launched there
#else
  using namespace cuda;
  using Stats = DistillStats<float>;
  constexpr int kThreads = kClusterThreads, kWarps = kThreads / 32;
  constexpr int kVec = 16 / sizeof(student_t);  // columns per group
  // The gradient of the cross-entropy is the forward KL's (distill_row reads the kind for the loss).
  constexpr DistillKind kGrad = kKind == DistillKind::kCrossEntropy ? DistillKind::kForwardKl : kKind;
  // The tail launch starts at once and waits at its end (cluster_kernel.cuh says why that is safe: it reads
  // nothing the main launch writes).
  if (tail) {
    let_next_grid_launch();
  } else {
    wait_previous_grid();
  }
  const auto cluster = cooperative_groups::this_cluster();
  const int n_ctas = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* const base =
      smem_raw + (kSliceSmemAlign - smem_addr(smem_raw) % kSliceSmemAlign) % kSliceSmemAlign;
  // The slices' 32-bit shared addresses (load_shared_elems says why not pointers).
  const unsigned zs = smem_addr(base), ts = zs + static_cast<unsigned>(v.teacher_offset);
  __shared__ Stats scratch[kWarps];
  __shared__ float sum_scratch[kWarps];
  __shared__ Stats gathered[2][kMaxClusterSize];
  __shared__ float2 gathered_sums[2][kMaxClusterSize];
  __shared__ uint64_t gathered_full[2], sums_full[2];
  __shared__ uint64_t landed[kDistillMaxPieces];
  __shared__ Stats jsd_stats;           // JSD: the row's statistics between steps 1 and 3
  __shared__ float lse_shared[2];       // JSD: the log-normalisers for step 2
  __shared__ float table[kDistGradFields];
  __shared__ float head_coef[Head::kParts > 0 ? Head::kParts : 1][kDistHeadFields];  // a head's parts' (a, b, c)

  const int64_t begin = static_cast<int64_t>(rank) * v.slice_cols;
  const int n_cols = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(v.vocab - begin, v.slice_cols)));
  const int n_groups = n_cols / kVec;
  const int n_pieces = (n_groups + v.piece_groups - 1) / v.piece_groups;
  const int64_t row_step = gridDim.x / n_ctas;
  int ctas_pow2 = 1;
  while (ctas_pow2 < n_ctas) ctas_pow2 *= 2;

  if (threadIdx.x == 0) {
    for (int p = 0; p < kDistillMaxPieces; ++p) mbarrier_init(&landed[p]);
    for (int q = 0; q < 2; ++q) {
      mbarrier_init(&gathered_full[q]);
      mbarrier_init(&sums_full[q]);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster.sync();  // every CTA's barriers are initialised before any peer sends to them

  // Thread 0 copies piece p of this CTA's slice of `row`: both tensors' columns of the piece complete landed[p].
  auto fetch_piece = [&](int64_t row, int p) {
    if (threadIdx.x != 0) return;
    constexpr unsigned ss = sizeof(student_t), st = sizeof(teacher_t);
    const unsigned c0 = static_cast<unsigned>(p * v.piece_groups * kVec),
                   c1 = static_cast<unsigned>(std::min(n_groups, (p + 1) * v.piece_groups) * kVec);
    auto copy = [&](char* dst, const char* src, unsigned start, unsigned end) {
      for (unsigned off = start; off < end; off += 16384) {
        bulk_copy_to_shared(dst + off, src + off, std::min(16384u, end - off), &landed[p]);
      }
    };
    mbarrier_arrive_expect(&landed[p], (c1 - c0) * (ss + st));
    copy(reinterpret_cast<char*>(base), reinterpret_cast<const char*>(v.z + row * v.rs + begin), c0 * ss, c1 * ss);
    copy(reinterpret_cast<char*>(base) + v.teacher_offset, reinterpret_cast<const char*>(v.zt + row * v.rt + begin),
         c0 * st, c1 * st);
  };
  // Group i of the slice from shared memory, as x = s·z and y = z_teacher / T.
  // (unpack: bf16 to fp32 at one instruction per value.) The raw vectors stay in a and b.
  // load_raw_at takes the group's shared addresses, za = zs + i·16 and ta = ts + i·kVec·sizeof(teacher_t), which the
  // loops carry: ptxas recomputes zs and ts (the CTA's shared window, from its rank in the cluster) where a loop
  // starts, or at every group (8 uniform instructions) in a loop that waits for its pieces inside.
  auto load_raw_at = [&](unsigned za, unsigned ta, Pack<student_t, kVec>& a, Pack<teacher_t, kVec>& b,
                         float (&x)[kVec], float (&y)[kVec]) {
    load_shared_elems(za, a.v);
    load_shared_elems(ta, b.v);
    unpack(a, x);
    unpack(b, y);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      x[k] *= v.opt.scale;
      y[k] *= v.opt.inv_temperature;
    }
  };
  auto load_group_at = [&](unsigned za, unsigned ta, float (&x)[kVec], float (&y)[kVec]) {
    Pack<student_t, kVec> a;
    Pack<teacher_t, kVec> b;
    load_raw_at(za, ta, a, b, x, y);
  };
  auto load_group = [&](int i, float (&x)[kVec], float (&y)[kVec]) {
    load_group_at(zs + static_cast<unsigned>(i * kVec * sizeof(student_t)),
                  ts + static_cast<unsigned>(i * kVec * sizeof(teacher_t)), x, y);
  };
  // Lane 0 of warp 0: the row step from the combined statistics (and sums); rank 0 writes the outputs.
  auto finish_row = [&](int64_t row, const Stats& all, float jsd_loss, float jsd_s) {
    if constexpr (Head::kOn) {
      v.head.cluster_distill(row + v.row0, all, jsd_loss, jsd_s, rank == 0, table);
      return;
    }
    const float m = v.mask != nullptr ? v.mask[row] : 1.0f;
    const DistillRowResult<float> r =
        distill_row(v.opt, all, jsd_loss, jsd_s, m / divisor_of(v.divisor, v.divisor_value));
#pragma unroll
    for (int k = 0; k < kDistGradFields; ++k) table[k] = r.table[k];
    if (rank == 0) {
      v.row_loss[row] = r.table[kDistWeight] * r.divergence;
      v.divergence[row] = r.divergence;
    }
  };

  // The rows this cluster reads: from r on, the first whose mask is not 0 (every CTA of the cluster reads the same
  // mask, so all skip the same rows).
  auto next_read = [&](int64_t r) {
    if (v.mask != nullptr) {
      while (r < v.n_rows && v.mask[r] == 0.0f) r += row_step;
    }
    return r;
  };

  int64_t row = blockIdx.x / n_ctas;
  int64_t read_row = next_read(row);
  if (read_row < v.n_rows) {
    for (int p = 0; p < n_pieces; ++p) fetch_piece(read_row, p);
  }
  // `it` counts the rows read (the barriers' phases, the slots).
  for (int it = 0; row < v.n_rows; row += row_step) {
    student_t* const g = v.grad + row * v.rg + begin;
    if (row != read_row) {  // masked: zeros, nothing read or exchanged
      if (rank == 0 && threadIdx.x == 0) {
        v.row_loss[row] = 0.0f;
        v.divergence[row] = 0.0f;
      }
      block_zero_fill<kThreads>(g, n_cols);
      continue;
    }
    const int64_t next = next_read(row + row_step);  // its mask loads overlap this row's work
    if constexpr (Head::kOn) {
      if (threadIdx.x == 32) v.head.prefetch(row + v.row0);  // warp 1: thread 0 issues the copies
    }
    const unsigned phase = static_cast<unsigned>(it & 1);
    // A thread waits for each piece before it reads that piece's groups (a piece is a multiple of kThreads
    // groups, so a thread's groups of a piece are those of its loop below, with no test per group). The loops carry
    // the shared addresses of the group and of the piece's barrier, and the piece's end: recomputed at every piece,
    // they took ~30 instructions a piece, as many as 4 columns' statistics where a thread has 2 groups in a piece
    // (bf16 + bf16, V = 128256 on 8 CTAs: 4 pieces of 512 groups).
    Stats st = Stats::empty();
    constexpr unsigned kStepS = kThreads * kVec * sizeof(student_t), kStepT = kThreads * kVec * sizeof(teacher_t);
    unsigned za = zs + threadIdx.x * (kStepS / kThreads), ta = ts + threadIdx.x * (kStepT / kThreads);
    unsigned bar = smem_addr(&landed[0]);
    for (int i = threadIdx.x, end = 0; i < n_groups; bar += sizeof(uint64_t)) {
      mbarrier_wait_at(bar, phase);
      end = std::min(n_groups, end + v.piece_groups);
      for (; i < end; i += kThreads, za += kStepS, ta += kStepT) {
        Pack<student_t, kVec> a;
        Pack<teacher_t, kVec> b;
        float x[kVec], y[kVec];
        load_raw_at(za, ta, a, b, x, y);
        add_group_at<distill_sums_of(kKind)>(st, x, y, scaled_max(a, x, v.opt.scale),
                                             scaled_max(b, y, v.opt.inv_temperature));
      }
    }
    constexpr int kSums = distill_sums_of(kKind);
    st = block_combine<kThreads, kSums>(st, scratch);  // in warp 0
    const int q = it & 1;
    const unsigned slot_phase = static_cast<unsigned>((it >> 1) & 1);
    if (threadIdx.x == 0) mbarrier_arrive_expect(&gathered_full[q], n_ctas * static_cast<unsigned>(sizeof(Stats)));
    if (threadIdx.x < n_ctas) send_to_rank(&gathered[q][rank], st, &gathered_full[q], threadIdx.x);
    // Warp 0 combines the CTAs' statistics and runs the row step; with a head, warps 1 to kParts do the same and
    // run the parts of the head's other terms at the same time.
    if (threadIdx.x < 32 * (1 + Head::kParts)) {
      const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
      mbarrier_wait(&gathered_full[q], slot_phase);
      Stats all = lane < n_ctas ? gathered[q][lane] : Stats::empty();
      for (int m = ctas_pow2 / 2; m > 0; m >>= 1) all = Stats::template combine<kSums>(all, shfl_xor<kSums>(all, m));
      if constexpr (Head::kOn) {
        if (lane == 0 && warp > 0) v.head.cluster_others(row + v.row0, all, rank == 0, head_coef[warp - 1], warp - 1);
      }
      if (threadIdx.x == 0) {
        if constexpr (kKind == DistillKind::kJsd) {
          jsd_stats = all;
          lse_shared[0] = all.lse_student();
          lse_shared[1] = all.lse_teacher();
        } else {
          finish_row(row, all, 0.0f, 0.0f);
        }
      }
    }
    __syncthreads();
    if constexpr (kKind == DistillKind::kJsd) {
      // Each thread reads the groups it has waited for in step 1.
      const float lse_s = lse_shared[0], lse_t = lse_shared[1];
      float loss = 0.0f, q_sum = 0.0f;
      for (int i = threadIdx.x; i < n_groups; i += kThreads) {
        float x[kVec], y[kVec];
        load_group(i, x, y);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const JsdTerms<float> t = jsd_terms(v.opt, x[k] - lse_s, y[k] - lse_t);
          loss += t.loss;
          q_sum += t.q_term;
        }
      }
      loss = block_sum<kThreads>(loss, sum_scratch);
      __syncthreads();  // sum_scratch is reused
      q_sum = block_sum<kThreads>(q_sum, sum_scratch);
      if (threadIdx.x == 0) mbarrier_arrive_expect(&sums_full[q], n_ctas * static_cast<unsigned>(sizeof(float2)));
      if (threadIdx.x < n_ctas) {
        send_to_rank(&gathered_sums[q][rank], make_float2(loss, q_sum), &sums_full[q], threadIdx.x);
      }
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        mbarrier_wait(&sums_full[q], slot_phase);
        float2 all = lane < n_ctas ? gathered_sums[q][lane] : make_float2(0.0f, 0.0f);
        for (int m = ctas_pow2 / 2; m > 0; m >>= 1) {
          all.x += __shfl_xor_sync(0xffffffffu, all.x, m);
          all.y += __shfl_xor_sync(0xffffffffu, all.y, m);
        }
        if (lane == 0) finish_row(row, jsd_stats, all.x, all.y);
      }
      __syncthreads();
    }
    ++it;

    const float w = table[kDistWeight], lse_s = table[kDistLseS], lse_t = table[kDistLseT], c = table[kDistConst];
    // The head's coefficients in registers, its label as a column of this slice (-1 outside it: 32-bit compares).
    DistillHeadCoef<float> h{0.0f, 0.0f, 0.0f};
    int label = -1;
    if constexpr (Head::kOn) {
      h = DistillHeadCoef<float>::load(head_coef[0]);
#pragma unroll
      for (int p = 1; p < Head::kParts; ++p) h = h.plus(DistillHeadCoef<float>::load(head_coef[p]));
      const int64_t col = v.head.label(row + v.row0) - begin;
      if (col >= 0 && col < n_cols) label = static_cast<int>(col);
    }
    // The gradient piece by piece; once every thread is done with a piece, the next row's copy of it is issued, so
    // that the copy overlaps the rest of this row's gradient. kDistill: the row's distillation weight is not 0 (a
    // head's rows of weight 0 read the teacher's slice, unused). The head's coefficients come scaled, and its label
    // term is added to the one vector holding the label, not tested at every element.
    const float sw = v.opt.scale * w;
    [[maybe_unused]] const DistillHeadCoef<float> sh = h.scaled(v.opt.scale);
    const int label_group = label >= 0 ? label / kVec : -1, label_k = label >= 0 ? label % kVec : 0;
    auto gradient = [&](auto distill) {
      constexpr bool kDistill = decltype(distill)::value;
      // The group's shared and global addresses carried across the pieces, as in the statistics loop.
      unsigned za = zs + threadIdx.x * (kStepS / kThreads), ta = ts + threadIdx.x * (kStepT / kThreads);
      student_t* gi = g + threadIdx.x * kVec;
      for (int p = 0, i = threadIdx.x, end = 0; p < n_pieces; ++p) {
        end = std::min(n_groups, end + v.piece_groups);
#pragma unroll 2
        for (; i < end; i += kThreads, za += kStepS, ta += kStepT, gi += kThreads * kVec) {
          float x[kVec], y[kVec];
          load_group_at(za, ta, x, y);
          float gf[kVec];
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            if constexpr (Head::kOn) {
              gf[k] = distill_head_grad<kGrad, kDistill>(v.opt, x[k], y[k], lse_s, lse_t, c, sw, sh, false);
            } else {
              gf[k] = sw * distill_grad<kGrad>(v.opt, x[k], y[k], lse_s, lse_t, c);
            }
          }
          if constexpr (Head::kOn) {
            if (i == label_group) {
#pragma unroll
              for (int k = 0; k < kVec; ++k) {
                if (k == label_k) gf[k] += sh.b;
              }
            }
          }
          store_rounded(gi, gf);
        }
        if (next < v.n_rows) {
          __syncthreads();  // piece p is read (statistics, sums, gradient) by every thread
          fetch_piece(next, p);
        }
      }
    };
    if (!Head::kOn || w != 0.0f) {
      gradient(std::true_type{});
    } else {
      gradient(std::false_type{});
    }
    read_row = next;
  }
  cluster.sync();  // no CTA exits while a peer may still write into its shared memory
  if (tail) wait_for_previous_grid();
#endif
}

}  // namespace distill_cuda
}  // namespace rl_losses
