// Where and how distillation's cluster kernel (distillation_cluster.cuh) is launched: the launch shape (CTAs per
// row, slice width, pieces), the most CTAs per row at which it measured faster than the separate passes, and
// launch_distill_cluster, which runs every row there or returns false, having launched nothing.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/batch_invariant.h"
#include "common/cuda/cluster_launch.cuh"
#include "distillation/distillation_cluster.cuh"

namespace rl_losses {
namespace distill_cuda {

// The launch shape with c CTAs per row: columns per CTA rounded up to 256 (slices starting on 512-byte
// boundaries of a bf16 row, as the CE kernel's: cluster_kernel.cuh) where that still fits, else to 8; ctas = 0
// where the slices do not fit kClusterCtaBytes.
struct DistillClusterShape {
  int ctas = 0;
  int slice_cols = 0, teacher_offset = 0, piece_groups = 0;
  size_t smem = 0;  // dynamic shared memory: the slices and the most the kernel skips to align them
};

inline DistillClusterShape distill_cluster_shape(int64_t vocab, int64_t ss, int64_t st, int c) {
  const int64_t per_cta = (vocab + c - 1) / c;
  auto round_up = [](int64_t x, int64_t to) { return (x + to - 1) / to * to; };
  auto bytes = [&](int64_t cols) { return round_up(cols * ss, cuda::kSliceSmemAlign) + cols * st; };
  int64_t cols = round_up(per_cta, 256);
  if (c == 1 || bytes(cols) > cuda::kClusterCtaBytes) cols = round_up(per_cta, 8);
  if (bytes(cols) > cuda::kClusterCtaBytes) return {};
  const int64_t vec = 16 / ss;
  // Pieces of ~16 KB of both tensors: kClusterThreads groups, or a multiple of them.
  const int64_t unit = cuda::kClusterThreads * vec * (ss + st);
  const int64_t piece_groups = cuda::kClusterThreads * std::max<int64_t>(1, cuda::kClusterPieceBytes / unit);
  TORCH_INTERNAL_ASSERT((cols / vec + piece_groups - 1) / piece_groups <= kDistillMaxPieces);
  DistillClusterShape s;
  s.ctas = c;
  s.slice_cols = static_cast<int>(cols);
  s.teacher_offset = static_cast<int>(round_up(cols * ss, cuda::kSliceSmemAlign));
  s.piece_groups = static_cast<int>(piece_groups);
  s.smem = static_cast<size_t>(bytes(cols) + cuda::kSliceSmemAlign - 16);
  return s;
}

// The most CTAs per row at which the kernel measured faster than the separate passes (H200, bf16 student and
// teacher, fwd+bwd, the same build: benchmarks/results/h200-2026-11-27-distill-cluster.txt): the KLs 1.37x /
// 1.25x / 1.18x at 2 / 4 / 8 CTAs (V = 32000 / 65536 / 128256), 0.91x at 10 (V = 151936); JSD, which reads its
// slices twice more from shared memory, 1.10x / 0.99x / 0.95x / 0.70x. (The tail launch's wider clusters carry
// only a last round's few rows.)
template <DistillKind kKind>
constexpr int kDistillClusterMaxCtas = kKind == DistillKind::kJsd ? 4 : 8;

inline bool rows_aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0;
}

// Runs the whole of DistillState's rows (outputs and gradient) in the cluster kernel where it applies (the
// file's header); false otherwise, having launched nothing. Persistent grid and tail launch as
// launch_row_cluster's (cluster_launch.cuh).
// With a head (DistillNoHead says what it provides), s.mask must be undefined: the head reads its own.
template <DistillKind kKind, typename student_t, typename teacher_t, typename Head = DistillNoHead>
bool launch_distill_cluster(const DistillState& s, const Head& row_head = {}) {
  if constexpr (std::is_same_v<student_t, double> || std::is_same_v<teacher_t, double>) {
    return false;  // fp64 (reference-grade tests) keeps the separate passes
  } else {
    if (!s.grad.defined() || s.stats_given || s.jsd_given || !s.logits.is_cuda() || batch_invariant()) return false;
    const int64_t n = s.logits.size(0), vocab = s.logits.size(1);
    if (n == 0 || vocab % 8 != 0) return false;
    if (!rows_aligned_16(s.logits) || !rows_aligned_16(s.teacher) || !rows_aligned_16(s.grad)) return false;
    if (at::cuda::getDeviceProperties(s.logits.get_device())->major < 9) return false;
    constexpr int64_t ss = sizeof(student_t), st = sizeof(teacher_t);
    DistillClusterShape shape;
    for (int c = 1; c <= cuda::kMaxClusterSize && shape.ctas == 0; ++c) shape = distill_cluster_shape(vocab, ss, st, c);
    if (shape.ctas == 0 || shape.ctas > kDistillClusterMaxCtas<kKind>) return false;
    auto* kernel = &distill_cluster_kernel<kKind, student_t, teacher_t, Head>;
    using Launch = cuda::ClusterLaunch<std::remove_pointer_t<decltype(kernel)>>;
    const Launch main_launch(kernel, shape.ctas, shape.smem);
    const int clusters = main_launch.resident_clusters();
    if (clusters == 0) return false;

    using View = DistillClusterView<student_t, teacher_t, Head>;
    View v;
    v.z = s.logits.const_data_ptr<student_t>();
    v.zt = s.teacher.const_data_ptr<teacher_t>();
    v.grad = s.grad.data_ptr<student_t>();
    v.rs = s.logits.stride(0);
    v.rt = s.teacher.stride(0);
    v.rg = s.grad.stride(0);
    v.n_rows = n;
    v.vocab = vocab;
    v.mask = s.mask.defined() ? s.mask.const_data_ptr<float>() : nullptr;
    v.divisor = s.divisor.defined() ? s.divisor.const_data_ptr<float>() : nullptr;
    v.divisor_value = static_cast<float>(s.divisor_value);
    v.row_loss = s.row_loss.data_ptr<float>();
    v.divergence = s.divergence.data_ptr<float>();
    v.opt = distill_options_as<float>(s.opt);
    v.head = row_head;
    v.row0 = 0;
    auto with_shape = [](View w, const DistillClusterShape& sh) {
      w.slice_cols = sh.slice_cols;
      w.teacher_offset = sh.teacher_offset;
      w.piece_groups = sh.piece_groups;
      return w;
    };
    const int64_t tail_rows = n > clusters ? n % clusters : 0;
    if (tail_rows != 0) {
      for (int c = cuda::kMaxClusterSize; c > shape.ctas; --c) {
        const DistillClusterShape tail = distill_cluster_shape(vocab, ss, st, c);
        if (tail.ctas == 0 || tail.slice_cols * (ss + st) < cuda::kClusterPieceBytes) continue;
        const Launch tail_launch(kernel, tail.ctas, tail.smem);
        if (tail_launch.resident_clusters() < tail_rows) continue;
        auto head = with_shape(v, shape), rest = with_shape(v, tail);
        head.n_rows = n - tail_rows;
        rest.n_rows = tail_rows;
        rest.z += head.n_rows * v.rs;
        rest.zt += head.n_rows * v.rt;
        rest.grad += head.n_rows * v.rg;
        if (v.mask != nullptr) rest.mask += head.n_rows;
        rest.row_loss += head.n_rows;
        rest.divergence += head.n_rows;
        rest.row0 = head.n_rows;
        main_launch.launch(clusters, head, false);
        tail_launch.launch(tail_rows, rest, true);
        return true;
      }
    }
    main_launch.launch(std::min<int64_t>(n, clusters), with_shape(v, shape), false);
    return true;
  }
}

}  // namespace distill_cuda
}  // namespace rl_losses
