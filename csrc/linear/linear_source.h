// The fused lm_head (linear_cross_entropy / linear_grpo / linear_gspo): the loss ops' row passes run
// over logits = s-free hidden @ weight.T (+ bias), computed a chunk of rows at a time, so that no more than
// one chunk of logits exists (the full (N, V) logits and their gradient never do).
//
// Per chunk of rows [r0, r1):
//   logits_c = hidden_c @ weight.T + bias                       GEMM 1 (cuBLAS, fp32 accumulation)
//   the op's row pass, writing dL/dlogits_c over logits_c         (the same kernels as the logits ops)
//   grad_hidden[r0:r1] = grad_c @ weight                        GEMM 2
//   grad_weight += grad_c.T @ hidden_c                           GEMM 3, accumulated across chunks in fp32
//   grad_bias += column sums of grad_c                            (fp32)
// GSPO runs the chunks twice: a statistics pass (GEMM 1 only: its per-document step needs every token's
// log-prob first), then the gradient pass above — four GEMMs in all, against three for CE and GRPO.
//
// grad_weight is accumulated in fp32 whatever the weight dtype (bf16 accumulation across chunks loses the
// small per-chunk contributions) and converted once at the end; that accumulator (V x H fp32) is the only
// large buffer besides one chunk of logits.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>

#include "common/row_source.h"

namespace rl_losses {

// acc (V, H) += grad_chunk.T (V, n) @ hidden_chunk (n, H), or = when `overwrite` (the first chunk: saves
// zeroing the accumulator and reading it back); acc is fp32 (fp64 for fp64 inputs), the chunks are in the
// input dtype. One implementation per device (linear_source.cpp: ATen; linear_cuda.cpp: cuBLAS
// with a fp32 output).
using WeightGradFn = void (*)(const at::Tensor& acc, const at::Tensor& grad_chunk, const at::Tensor& hidden_chunk,
                              bool overwrite);
void accumulate_weight_grad_cpu(const at::Tensor& acc, const at::Tensor& grad_chunk, const at::Tensor& hidden_chunk,
                                bool overwrite);
void accumulate_weight_grad_cuda(const at::Tensor& acc, const at::Tensor& grad_chunk, const at::Tensor& hidden_chunk,
                                 bool overwrite);

// The default number of rows per chunk: as many as fit kDefaultChunkBytes of logits, a multiple of 128
// (GEMM tiles) when that is at least 128, at most N.
constexpr int64_t kDefaultChunkBytes = int64_t(512) << 20;
int64_t default_chunk_rows(int64_t n_rows, int64_t vocab, int64_t element_size);

class LinearSource final : public RowSource {
 public:
  // hidden (..., H), weight (V, H), bias (V,) or none, target (...) labels. output_mask: which of
  // grad_hidden, grad_weight, grad_bias to compute. chunk_size: rows per chunk (default from the budget).
  LinearSource(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias, const at::Tensor& target, std::optional<int64_t> chunk_size,
               std::array<bool, 3> output_mask, WeightGradFn accumulate_weight_grad);
  void run(const RowPassArgs& args, bool with_grad, const Pass& pass) override;
  // grad_hidden (hidden's shape), grad_weight (V, H) and grad_bias (V,) in their inputs' dtypes. Frees the
  // fp32 accumulators.
  std::vector<at::Tensor> grads() override;

 private:
  at::Tensor hidden_;  // (N, H) contiguous
  at::Tensor weight_, bias_;
  std::vector<int64_t> hidden_shape_;
  std::array<bool, 3> mask_;
  int64_t chunk_;
  WeightGradFn accumulate_weight_grad_;
  at::Tensor grad_hidden_, grad_weight_acc_, grad_bias_acc_;
  bool weight_grad_written_ = false;  // grad_weight_acc_ holds a sum (it starts uninitialised)
};

}  // namespace rl_losses
