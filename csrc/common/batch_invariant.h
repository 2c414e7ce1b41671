// The batch-invariant mode (docs/consistency.md, "Batch invariance"): each row's outputs and gradient row depend
// on that row alone (not on the batch size, the row's position or the other rows), and the statistics of a row
// have the same bits with and without a gradient, so that a trainer's log-probs equal an inference engine's
// batch-invariant ones bit for bit. On while rl_losses.batch_invariant() is entered or
// torch.use_deterministic_algorithms(True) is set; read once per call (make_row_pass_args, LinearSource).
#pragma once

namespace rl_losses {

// Whether the mode is on: the library's own switch, or ATen's deterministic-algorithms flag. Two loads.
bool batch_invariant();
// Sets the library's own switch (the op `_set_batch_invariant`); returns its previous value.
bool set_batch_invariant(bool enabled);

}  // namespace rl_losses
