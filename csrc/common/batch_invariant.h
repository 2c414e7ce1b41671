// The batch-invariant mode (docs/consistency.md, "Batch invariance"): each row's outputs and gradient row depend
// on that row alone (not on the batch size, the row's position or the other rows), and the statistics of a row
// have the same bits with and without a gradient, so that a trainer's log-probs equal an inference engine's
// batch-invariant ones bit for bit. On while rl_losses.batch_invariant() is entered or
// torch.use_deterministic_algorithms(True) is set; read once per call (make_row_pass_args, LinearSource).
#pragma once

#include <cstdint>

namespace rl_losses {

// In the batch-invariant mode every GEMM over rows takes exactly this many rows (the chunk's last piece padded
// with zero rows): a GEMM library picks its kernel, and with it the order of each row's sums (split-K or not, the
// tiles), by the shape, so that a row's logits and grad_hidden would otherwise depend on how many rows share its
// GEMM. A multiple of 1024 (linear/linear_source.cpp's part_size). The fused lm_head's GEMMs (LinearSource) and
// linear_distillation_loss's (Python, through the op `_invariant_gemm_rows`).
constexpr int64_t kInvariantGemmRows = 1024;

// Whether the mode is on: the library's own switch, or ATen's deterministic-algorithms flag. Two loads.
bool batch_invariant();
// Sets the library's own switch (the op `_set_batch_invariant`); returns its previous value.
bool set_batch_invariant(bool enabled);

}  // namespace rl_losses
