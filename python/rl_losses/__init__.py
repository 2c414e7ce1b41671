"""rl_losses: fused cross-entropy, GRPO and GSPO loss heads for PyTorch.

The ops live in ``torch.ops.rl_losses`` (C++/CUDA, loaded from ``rl_losses._C``); this package adds the
functional wrappers (``rl_losses.cross_entropy``, ``rl_losses.z_loss``, ``rl_losses.grpo_loss``,
``rl_losses.gspo_loss``; ``rl_losses.linear_*``: the same from hidden states and the lm_head weight, without
materialising the logits), a pure-PyTorch reference (``rl_losses.reference``) and Fast-LLM-style configs and
loss modules (``rl_losses.config``).
"""
import torch  # noqa: F401  (must load before the library, which links against it)

from rl_losses import _C  # noqa: F401  (loads the library, which registers the ops)
from rl_losses import _fake  # noqa: F401  (fake kernels for torch.compile / meta tensors)
from rl_losses.functional import (  # noqa: F401
    PolicyLossOutput,
    cross_entropy,
    cuda_kernels_available,
    grpo_loss,
    gspo_loss,
    linear_cross_entropy,
    linear_grpo_loss,
    linear_gspo_loss,
    z_loss,
)
from rl_losses import aggregation, config, losses, packing  # noqa: F401  (presets, configs, modules, packing)
from rl_losses.config import LanguageModelLossConfig  # noqa: F401
from rl_losses.packing import Document, pack_documents  # noqa: F401

__version__ = "0.1.0"
