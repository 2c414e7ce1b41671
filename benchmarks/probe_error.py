# One bad-input call (a negative logits_scale_factor) on the CPU: it must raise RuntimeError.
import torch

import rl_losses  # noqa: F401

try:
    torch.ops.rl_losses.row_stats(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), logits_scale_factor=-1.0)
except RuntimeError as e:
    print("raised:", str(e)[:80])
