"""The arms of bench_head_peers.py: the loss step a trainer runs from hidden states (hidden and the lm_head weight
-> a scalar loss, differentiated w.r.t. both), as rl_losses and each peer library computes it, on the same inputs
and the same definition: GRPO with ppo_clip, epsilon 0.2, the token mean (TRL's bnpo, verl's token-mean, Liger's
bnpo), or plain cross-entropy (the mean over tokens).

Each arm is ``make(x) -> fn(hidden, weight) -> loss``; ``make`` imports the peer (an ImportError there is the
arm's reason to be skipped). verl's package imports ray, hydra and tensordict at its root, which the GPU machine
lacks: where it does not import, its files are loaded by path from where it is installed (the carried wheel),
never copied here.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
import types
from typing import Any, Optional

import torch

import rl_losses

EPS = 0.2
SEQS = 8  # sequences per batch (the (B, T) layouts of Liger and verl; Liger's advantages are per sequence)
VERL_CHUNK = 512  # FusedLinearForPPO's default rows per chunk
COMPILE_ROWS = 2048  # rows per chunk of the compiled eager loss


def grpo_per_token(lp, old, adv):
    """TRL's GRPOTrainer._compute_loss, ppo_clip: -min(r·A, clip(r, 1-ε, 1+ε)·A), r = exp(lp - old)."""
    ratio = torch.exp(lp.float() - old)
    return -torch.min(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)


def rl_grpo(strategy):
    def make(x):
        return lambda h, w: rl_losses.linear_grpo_loss(h, w, x["target"], x["adv"], x["old"], epsilon_low=EPS,
                                                       epsilon_high=EPS, strategy=strategy).loss
    return make


def rl_ce(strategy):
    def make(x):
        return lambda h, w: rl_losses.linear_cross_entropy(h, w, x["target"], strategy=strategy)
    return make


def trl_grpo(x):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # the vocabulary tile TRL's fused head uses

    def fn(h, w):
        lp = ChunkedLogProbFunction.apply(h, w, None, x["target"], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())[0]
        return grpo_per_token(lp, x["old"], x["adv"]).mean()
    return fn


def liger_grpo(x):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled=True (its default) on the GPU; the CPU dry run checks the mapping without Inductor's compile time.
    loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=EPS, epsilon_high=EPS,
                                    loss_type="bnpo", compiled=x["device"] == "cuda")
    b, t = SEQS, x["target"].numel() // SEQS
    mask = torch.ones(b, t, device=x["target"].device)
    return lambda h, w: loss(h.view(b, t, -1), w, x["target"].view(b, t), mask, x["adv_seq"],
                             old_per_token_logps=x["old"].view(b, t))[0]


def liger_ce(x):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda h, w: liger_fused_linear_cross_entropy(h, w, x["target"])


def _cce_impl(x) -> str:
    # Its Triton kernels fail in Triton's CPU interpreter: the CPU dry run checks the mapping on its torch_compile
    # implementation.
    return "cce" if x["device"] == "cuda" else "torch_compile"


def cce_grpo(x):
    from cut_cross_entropy import linear_cross_entropy

    def fn(h, w):  # its defaults (filter_eps="high")
        lp = -linear_cross_entropy(h, w, x["target"], reduction="none", impl=_cce_impl(x))
        return grpo_per_token(lp, x["old"], x["adv"]).mean()
    return fn


def cce_ce(x):
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, w: linear_cross_entropy(h, w, x["target"], impl=_cce_impl(x))


def compiled_grpo(x):
    def chunked(h, w, target, old, adv):
        total = torch.zeros((), device=h.device)
        for s in range(0, h.shape[0], COMPILE_ROWS):
            logits = (h[s:s + COMPILE_ROWS] @ w.T).float()
            lp = logits.log_softmax(-1).gather(-1, target[s:s + COMPILE_ROWS, None])[:, 0]
            total = total + grpo_per_token(lp, old[s:s + COMPILE_ROWS], adv[s:s + COMPILE_ROWS]).sum()
        return total / h.shape[0]

    fn = torch.compile(chunked, dynamic=False)
    return lambda h, w: fn(h, w, x["target"], x["old"], x["adv"])


# ---- verl --------------------------------------------------------------------------------------------------------
@functools.cache  # asked before _verl_kernels puts its stand-in verl package in sys.modules
def _verl_dir() -> str:
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed (carry its wheel)")
    return spec.submodule_search_locations[0]


def _load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _functions_of(path: str, names: tuple[str, ...], namespace: dict) -> dict:
    """The named top-level functions of a verl file, without their registration decorators, executed in
    `namespace` (for a file whose module imports what is missing here)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    if len(defs) != len(names):
        raise ImportError(f"{path} lacks one of {names}")
    for node in defs:
        node.decorator_list = []
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return namespace


class VerlActorConfig(dict):
    """The fields of verl's ActorConfig that compute_policy_loss_vanilla reads (attribute and .get access)."""
    __getattr__ = dict.__getitem__


VERL_CONFIG = VerlActorConfig(clip_ratio=EPS, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                              global_batch_info={})


def verl_policy_loss():
    """verl's compute_policy_loss_vanilla: from verl.trainer.ppo.core_algos where verl imports, else that
    function (and agg_loss, masked_sum, masked_mean) from its files."""
    try:
        from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
        return compute_policy_loss_vanilla
    except ImportError:
        pass
    root = _verl_dir()
    masked = _functions_of(os.path.join(root, "utils", "torch_functional.py"), ("masked_sum", "masked_mean"),
                           {"torch": torch})
    ns = {"torch": torch, "Optional": Optional, "Any": Any, "AlgoConfig": type("AlgoConfig", (), {}),
          "ActorConfig": VerlActorConfig, "verl_F": types.SimpleNamespace(**{k: masked[k] for k in
                                                                             ("masked_sum", "masked_mean")})}
    return _functions_of(os.path.join(root, "trainer", "ppo", "core_algos.py"),
                         ("agg_loss", "compute_policy_loss_vanilla"), ns)["compute_policy_loss_vanilla"]


def _verl_loss(lp, x, policy_loss):
    b, t = SEQS, x["target"].numel() // SEQS
    mask = torch.ones(b, t, device=lp.device)
    return policy_loss(x["old"].view(b, t), lp.float().view(b, t), x["adv"].view(b, t), mask,
                       loss_agg_mode="token-mean", config=VERL_CONFIG)[0]


def verl_torch(x):
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
    except ImportError:
        FusedLinearForPPO = _load_file("verl_experimental_torch_functional", os.path.join(
            _verl_dir(), "utils", "experimental", "torch_functional.py")).FusedLinearForPPO
    head, policy_loss = FusedLinearForPPO(chunk_size=VERL_CHUNK), verl_policy_loss()
    return lambda h, w: _verl_loss(head(h, w, x["target"], 1.0)[0], x, policy_loss)


def verl_triton(x):
    policy_loss = verl_policy_loss()
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except ImportError:
        linear_cross_entropy = _verl_kernels().linear_cross_entropy
    return lambda h, w: _verl_loss(linear_cross_entropy(h, w, x["target"], 1.0, "none")[0], x, policy_loss)


def _verl_kernels():
    """verl/utils/kernel/linear_cross_entropy.py with the four verl.utils.device functions its kernels import
    (bench_token_log_probs.load_verl_kernels's stand-ins) in place of the rest of verl."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_token_log_probs import load_verl_kernels

    return load_verl_kernels(os.path.join(_verl_dir(), "utils", "kernel"))


# name -> (op, make). The first arm of each op is the reference of the others' agreement check.
ARMS = {
    "rl_losses_fast": ("grpo", rl_grpo("fast")),
    "rl_losses_lean": ("grpo", rl_grpo("lean")),
    "trl_chunked_logprob": ("grpo", trl_grpo),
    "liger_grpo": ("grpo", liger_grpo),
    "verl_fused_torch": ("grpo", verl_torch),
    "verl_triton": ("grpo", verl_triton),
    "cce_grpo": ("grpo", cce_grpo),
    "torch_compile_chunked": ("grpo", compiled_grpo),
    "rl_losses_ce_fast": ("ce", rl_ce("fast")),
    "rl_losses_ce_lean": ("ce", rl_ce("lean")),
    "liger_flce": ("ce", liger_ce),
    "cce": ("ce", cce_ce),
}
NOTES = {
    "rl_losses_fast": "rl_losses.linear_grpo_loss(strategy='fast'): chunks of rows, fp32 grad_weight accumulator",
    "rl_losses_lean": "rl_losses.linear_grpo_loss(strategy='lean'): vocabulary blocks, <= 256 MiB beyond the grads",
    "trl_chunked_logprob": "trl.kernels.ChunkedLogProbFunction (TRL's fused head, its vocabulary tile) -> "
                           "log-probs, then TRL's GRPO formula in eager PyTorch (bnpo: token mean)",
    "liger_grpo": "liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(loss_type='bnpo', beta=0, compiled=True), "
                  "(B, T, H) = (8, N/8, H), per-sequence advantages",
    "verl_fused_torch": "verl FusedLinearForPPO(chunk_size=512) (PyTorch) -> log-probs (and entropy), then "
                        "verl's compute_policy_loss_vanilla (token-mean, clip_ratio_c=3)",
    "verl_triton": "verl.utils.kernel.linear_cross_entropy (Triton) -> log-probs (and entropy), then "
                   "compute_policy_loss_vanilla",
    "cce_grpo": "cut_cross_entropy.linear_cross_entropy(reduction='none', defaults: filter_eps='high') -> "
                "-log-probs, then TRL's GRPO formula",
    "torch_compile_chunked": f"torch.compile(dynamic=False) of eager chunks of {COMPILE_ROWS} rows: logits = h @ W.T "
                             "(fp32), log_softmax, gather, GRPO formula",
    "rl_losses_ce_fast": "rl_losses.linear_cross_entropy(strategy='fast')",
    "rl_losses_ce_lean": "rl_losses.linear_cross_entropy(strategy='lean')",
    "liger_flce": "liger_fused_linear_cross_entropy (its defaults: bf16 grad_weight accumulation)",
    "cce": "cut_cross_entropy.linear_cross_entropy (its defaults: filter_eps='high')",
}
