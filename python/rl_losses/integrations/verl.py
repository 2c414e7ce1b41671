"""verl: rl_losses' fused log-prob/entropy kernel in place of verl's (docs/integrations/verl.md).

verl's actor, with ``actor_rollout_ref.model.use_fused_kernels=True``, computes the per-token log-probs and
entropies of the rolled labels from the last hidden state and the lm_head weight, through
``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (``fused_kernel_options.impl_backend=torch``)
or ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``impl_backend=triton``), then its own
policy loss from them. This module provides both with the same signatures, computed by
``rl_losses.linear_token_log_probs`` (one chunked pass forward, one backward; CPU and CUDA), and
``install()`` puts them in verl's modules. Importing this module installs them when verl is importable, so
naming it in verl's ``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib`` turns it on in
every worker.

``register_verl_policy_losses()`` adds rl_losses' policy losses to verl's policy-loss registry
(``actor_rollout_ref.actor.policy_loss.loss_mode``): ``rl_losses_ppo_clip`` (verl's ``vanilla``, dual-clip PPO
with ``clip_ratio_c``), ``rl_losses_gspo``, ``rl_losses_sapo``, ``rl_losses_cispo``, ``rl_losses_gpg``,
``rl_losses_dro``, ``rl_losses_dppo_tv``, ``rl_losses_dppo_kl``, ``rl_losses_geo_mean``, ``rl_losses_clip_cov``,
``rl_losses_kl_cov`` and ``rl_losses_bypass_mode`` (verl's loss_mode of the same name after the prefix). verl
hands them per-token log-probs, so their per-token math is ``rl_losses.policy_token_loss`` (the fused ops'
per-token definition, one elementwise kernel) and their aggregation is verl's ``loss_agg_mode`` as an
``rl_losses.aggregation`` preset with verl's global batch sizes.

``fused_policy_options(algorithm.rollout_correction, actor.loss_agg_mode)`` (verl_options.py) gives the fused ops'
options of verl's rollout correction: its importance weights and its rejection (``rollout_rs``) inside the op.
"""
from __future__ import annotations

import logging
import math

import torch

import rl_losses
from rl_losses import _schema, aggregation
from rl_losses.integrations.verl_options import _value as _config_value, fused_policy_options  # noqa: F401 (API)
from rl_losses._calls import DirectCallModule
from rl_losses._inputs import _CHECK_INPUTS, _ENVIRON, _direct
from rl_losses.functional import _scale_of_temperature

_ops = torch.ops.rl_losses
logger = logging.getLogger(__name__)
# verl's own linear_cross_entropy, saved by install(): the vocabulary-parallel calls go back to it.
_VERL_KERNELS: dict = {}
_WARNED: set[str] = set()  # the fallbacks already warned about (once per process)


def _shape_error(hidden_states: torch.Tensor, input_ids: torch.Tensor) -> ValueError:
    if hidden_states.dim() not in (2, 3):
        return ValueError(f"hidden_states must be 2-D (T, H) or 3-D (B, T, H), got shape {tuple(hidden_states.shape)}")
    return ValueError(f"input_ids has shape {tuple(input_ids.shape)} but hidden_states has batch shape "
                      f"{tuple(hidden_states.shape[:-1])}")


class FusedLinearForPPO(DirectCallModule):
    """Drop-in for verl's ``FusedLinearForPPO``: ``forward(hidden_states, vocab_weights, input_ids,
    temperature=1.0) -> (log_probs, entropy)``, log-probs float32 and the entropy in the hidden states' dtype,
    as verl returns them; differentiable w.r.t. hidden_states and vocab_weights through both outputs.

    ``chunk_size`` is the number of rows of logits alive at once (verl's default 512; None: rl_losses' own
    default, as many rows as fit 512 MiB of logits). ``impl_backend`` is accepted for compatibility and
    ignored: rl_losses runs its own kernels."""

    def __init__(self, chunk_size: int | None = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger", "triton", "rl_losses"):
            raise ValueError(f"FusedLinearForPPO: unsupported impl_backend {impl_backend!r}")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden_states.dim() not in (2, 3):
            raise _shape_error(hidden_states, input_ids)
        # Host time (µs a call, CPU host): .to(dtype), chunk_size only where needed; the op's C++ function where the
        # wrapper would do nothing more (~2-3); input_ids' shape read only where the op refuses it, as any other (~2).
        labels = input_ids if input_ids.dtype is _INT64 else input_ids.to(_INT64)
        options = _WITH_ENTROPY if self.chunk_size is None else {**_WITH_ENTROPY, "chunk_size": self.chunk_size}
        try:
            if type(hidden_states) is _TENSOR and type(vocab_weights) in _PLAIN and _CHECK_INPUTS not in _ENVIRON:
                if temperature != 1.0:
                    options = {**options, "logits_scale_factor": _scale_of_temperature(_OP_NAME, temperature)}
                log_probs, entropy = _direct(_ops.linear_token_log_probs)(hidden_states, vocab_weights, labels,
                                                                          **options)
            else:
                log_probs, entropy = rl_losses.linear_token_log_probs(hidden_states, vocab_weights, labels,
                                                                      temperature=float(temperature), **options)
        except Exception:
            if input_ids.shape == hidden_states.shape[:-1]:
                raise
            raise _shape_error(hidden_states, input_ids) from None  # as a check before the op would
        dtype = hidden_states.dtype
        if dtype is _FLOAT32:  # the op's outputs are float32 already
            return log_probs, entropy
        return (log_probs if log_probs.dtype is _FLOAT32 else log_probs.float(),
                entropy if entropy.dtype is dtype else entropy.to(dtype))


_INT64, _FLOAT32, _TENSOR, _PLAIN = torch.int64, torch.float32, torch.Tensor, (torch.Tensor, torch.nn.Parameter)
_WITH_ENTROPY, _OP_NAME = {"compute_entropy": True}, "linear_token_log_probs"  # (the wrapper's name in messages)


def fused_linear_for_ppo_fwd(hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``_fused_linear_for_ppo_fwd`` (one chunk, no autograd): (log_probs float32, entropy)."""
    with torch.no_grad():
        log_probs, entropy = rl_losses.linear_token_log_probs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                                              temperature=temperature, compute_entropy=True)
    return log_probs.float(), entropy.to(hidden_states.dtype)


# The options of linear_token_log_probs at its defaults but the temperature's and the entropy's, which the private ops
# (they take every argument) get from fused_linear_for_ppo_bwd: read once from the schema.
_LM_HEAD_DEFAULTS = {name: value for name, value in _schema.defaults("linear_token_log_probs").items()
                     if name not in ("logits_scale_factor", "compute_entropy")}


def fused_linear_for_ppo_bwd(dlog_probs: torch.Tensor | None, dentropy: torch.Tensor | None,
                             hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``_fused_linear_for_ppo_bwd``: (d hidden_states, d vocab_weights) for the upstream gradients of
    the log-probs and the entropy (either may be None). Runs the statistics pass, then the gradient pass."""
    if dlog_probs is None and dentropy is None:
        raise ValueError("fused_linear_for_ppo_bwd: dlog_probs and dentropy are both None")
    labels = input_ids.to(torch.int64)
    lm_head = dict(_LM_HEAD_DEFAULTS, logits_scale_factor=1.0 / float(temperature))
    _, _, stats = _ops._linear_token_log_probs_forward(hidden_states, vocab_weights, labels,
                                                       compute_entropy=dentropy is not None, **lm_head)
    d_hidden, d_weight, _ = _ops._linear_token_log_probs_backward(
        hidden_states, vocab_weights, labels, stats=stats, grad_log_probs=dlog_probs, grad_entropy=dentropy,
        output_mask=[True, True, False], **lm_head)
    return d_hidden, d_weight


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none", dist_process_group=None):
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (verl's Triton kernel):
    returns (log_probs, entropy) float32 per token, flattened to (N,) as verl's kernel returns them, for
    reduction="none"; their sums or means otherwise.

    A ``dist_process_group`` of more than one rank (Megatron's vocabulary-parallel lm_head: each rank holds a shard
    of the vocabulary) goes to verl's own kernel, with a warning: the fused linear form has no tensor
    parallelism."""
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        original = _VERL_KERNELS.get("linear_cross_entropy")
        if original is None:
            raise ValueError("linear_cross_entropy: a vocabulary-parallel dist_process_group (more than one rank) "
                             "needs verl's own kernel, and install() has not saved it (verl not importable)")
        if "linear_cross_entropy" not in _WARNED:
            _WARNED.add("linear_cross_entropy")
            logger.warning("rl_losses linear_cross_entropy: a vocabulary-parallel dist_process_group (Megatron's "
                           "tensor parallelism) has no fused form in rl_losses; verl's own kernel runs")
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    log_probs, entropy = rl_losses.linear_token_log_probs(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                          labels.reshape(-1).to(torch.int64),
                                                          temperature=float(temperature), compute_entropy=True)
    if reduction == "sum":
        return log_probs.sum(), entropy.sum()
    if reduction == "mean":
        return log_probs.mean(), entropy.mean()
    return log_probs, entropy


def install() -> bool:
    """Replace verl's fused log-prob/entropy kernels with rl_losses' (both backends). Returns False when verl
    is not importable. verl's model forwards import these names at call time, so installing before the first
    forward is enough."""
    try:
        import verl.utils.experimental.torch_functional as torch_functional
        import verl.utils.kernel.linear_cross_entropy as triton_functional
    except ImportError:
        return False
    # verl's own per-chunk functions (_fused_linear_for_ppo_fwd/_bwd) stay: only its FusedLinearForPPOFunction
    # calls them, and that is no longer reached through FusedLinearForPPO.
    torch_functional.FusedLinearForPPO = FusedLinearForPPO
    if triton_functional.linear_cross_entropy is not linear_cross_entropy:
        _VERL_KERNELS["linear_cross_entropy"] = triton_functional.linear_cross_entropy
    triton_functional.linear_cross_entropy = linear_cross_entropy
    return True


# ---- the policy-loss registry --------------------------------------------------------------------------------
def _default(name):
    # verl's config may leave an option out: the op's default then.
    return _schema.default("policy_token_loss", name)


def _policy_loss_value(config, name, default=None):
    """``config.policy_loss.<name>`` (verl's PolicyLossConfig), ``default`` where absent or None."""
    return _config_value(_config_value(config, "policy_loss", {}), name, default)


def _clip_ratios(config, lower_clip: bool = True) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), checked under verl's names: the op's clip [1 − low, 1 + high] needs
    0 <= low < 1 (``lower_clip``; CISPO has no lower clip) and a finite high >= 0."""
    clip = _config_value(config, "clip_ratio", 0.2)
    low = float(_config_value(config, "clip_ratio_low", clip))
    high = float(_config_value(config, "clip_ratio_high", clip))
    if lower_clip and not 0.0 <= low < 1.0:
        raise ValueError(f"rl_losses verl policy loss: clip_ratio_low must be in [0, 1) (the ratio's lower clip "
                         f"1 - clip_ratio_low must be > 0), got clip_ratio_low={low}")
    if not (math.isfinite(high) and high >= 0.0):
        raise ValueError(f"rl_losses verl policy loss: clip_ratio_high must be finite and >= 0, got "
                         f"clip_ratio_high={high}")
    return low, high


def _aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, config) -> torch.Tensor:
    """verl's agg_loss as Σ w·ℓ / D: the weights of the mode's rl_losses.aggregation preset, the divisor from
    verl's ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) as verl's
    agg_loss reads it (fully masked sequences not counted)."""
    info = dict(_config_value(config, "global_batch_info", {}) or {})
    dp = info.get("dp_size", 1) or 1
    mask = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-sum":
        return (loss_mat * mask).sum() * dp
    if loss_agg_mode not in aggregation.VERL_LOSS_AGG_MODES:
        raise ValueError(f"rl_losses verl policy loss: loss_agg_mode must be one of "
                         f"{sorted(aggregation.VERL_LOSS_AGG_MODES) + ['token-sum']}, got {loss_agg_mode!r}")
    preset = aggregation.VERL_LOSS_AGG_MODES[loss_agg_mode]
    # Local counts would weigh each rank's tokens by its own batch: verl's agg_loss refuses that, and so do we.
    needed = "batch_num_tokens" if preset == "token_mean" else "global_batch_size"
    if dp > 1 and info.get(needed) is None:
        raise ValueError(f"rl_losses verl policy loss: loss_agg_mode={loss_agg_mode!r} with dp_size = {dp} needs "
                         f"global_batch_info[{needed!r}] (the global count; verl's agg_loss raises likewise)")
    horizon = info.get("loss_scale_factor") or mask.shape[-1]
    weights, _ = aggregation.aggregation_weights(preset, completion_mask=mask, max_completion_length=horizon,
                                                 dtype=loss_mat.dtype)
    if preset == "token_mean":
        count = info.get("batch_num_tokens")
        divisor = mask.sum() if count is None else count
    else:
        count = info.get("global_batch_size")
        divisor = (mask.sum(-1) > 0).to(loss_mat.dtype).sum() if count is None else count
        if preset == "sequence_sum_constant":
            divisor = divisor * horizon
    return (loss_mat * weights).sum() / divisor * dp


_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                 op_old_log_prob=None, clipped=None, lower=None, negative=None, metrics=_METRICS, **options):
    """One registered loss: the op's per-token loss (from ``op_old_log_prob`` in place of the old log-probs when
    given; with the options ``negative`` where A < 0 when given), verl's rollout weights, the aggregation, verl's
    ``metrics`` (``clipped(out)``: the tokens verl's ``pg_clipfrac`` counts, when not the op's clipped flags;
    ``lower(out)``: the tokens ``pg_clipfrac_lower`` counts, none if None). Nothing outside ``response_mask`` is
    read: verl's padding may hold NaN."""
    op_old = old_log_prob if op_old_log_prob is None else op_old_log_prob
    keep = response_mask != 0
    out = rl_losses.policy_token_loss(log_prob, op_old, advantages, loss_mask=keep, **options)
    if negative is not None:
        other = rl_losses.policy_token_loss(log_prob, op_old, advantages, loss_mask=keep & (advantages < 0),
                                            **dict(options, **negative))
        out = type(out)(*(torch.where(advantages < 0, a, b) for a, b in zip(other, out)))
    loss_mat = out.loss
    if rollout_is_weights is not None:
        loss_mat = loss_mat * torch.where(keep, rollout_is_weights, 0.0)
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, config)
    mask = keep.to(out.ratio.dtype)
    count = mask.sum().clamp(min=1)
    values = {
        "actor/pg_clipfrac": lambda: ((out.clipped_low + out.clipped_high if clipped is None else clipped(out)) * mask
                                      ).sum() / count,
        "actor/ppo_kl": lambda: torch.where(keep, old_log_prob - log_prob, 0.0).detach().sum() / count,
        "actor/pg_clipfrac_lower": lambda: (torch.zeros((), device=mask.device) if lower is None
                                            else (lower(out) * mask).sum() / count),
    }
    return loss, {name: values[name]().item() for name in metrics}


def ppo_clip_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                         rollout_is_weights=None):
    """verl's ``vanilla`` (dual-clip PPO): ``clip_ratio_low/high`` are ε_l/ε_h, ``clip_ratio_c`` (default 3, > 1)
    caps the ratio where A < 0 only: ℓ = −A·min(r, 1+ε_h) for A > 0, −A·min(c, max(r, 1−ε_l)) for A < 0.

    That is the op's two-sided clip δ = c wherever c > 1 + ε_h. From 1 + ε_h down, the op's δ would cap the ratio
    where A > 0 (TRL's delta) and its clip flags with it: the tokens with A < 0 then take ε_h' = c − 1 and δ = c,
    the others no δ."""
    low, high = _clip_ratios(config)
    c = float(_config_value(config, "clip_ratio_c", 3.0))
    if not c > 1.0:
        raise ValueError(f"rl_losses_ppo_clip: clip_ratio_c (dual-clip PPO's cap of the ratio where the advantage is "
                         f"negative) must be > 1, as verl's vanilla asserts, got clip_ratio_c={c}")
    if c > 1.0 + high:
        options = dict(epsilon_low=low, epsilon_high=high, delta=c)
    else:
        options = dict(epsilon_low=low, epsilon_high=high, negative=dict(epsilon_high=c - 1.0, delta=c))
    # pg_clipfrac_lower: the dual clip's region, r > clip_ratio_c where A < 0.
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        lower=lambda out: (out.ratio > c) & (advantages < 0), **options)


def gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                     rollout_is_weights=None):
    """verl's ``gspo``: each token's ratio is its sequence's geometric-mean ratio s_i in value, with the gradient of
    its own log-prob (``sg(s_i)·π/sg(π)``): the token-level clip with old log-prob ``sg(lp − log s_i)``."""
    low, high = _clip_ratios(config)
    keep = response_mask != 0
    log_s = (torch.where(keep, log_prob - old_log_prob, 0.0).sum(-1) / keep.sum(-1).clamp(min=1)).detach()
    old = log_prob.detach() - log_s.unsqueeze(-1)
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights, op_old_log_prob=old, epsilon_low=low, epsilon_high=high)


def geo_mean_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                         rollout_is_weights=None):
    """verl's ``geo_mean`` (GMPO): −Ā_i·R_i per sequence, R_i = exp(mean_m δ̃), each δ = lp − old clipped to
    [−clip_ratio_low, clip_ratio_high] on the side its advantage favours (A > 0: min(δ, high); A < 0: max(δ, −low);
    A = 0: 0); the plain mean over the rows whatever ``loss_agg_mode``, as verl's. Per token: ppo_clip of the
    advantage sg(Ā_i·R_i) at r_t = exp(lp_t − sg(lp_t)) (1 in value), lp_t detached where δ̃_t is clipped, so that
    its gradient is −Ā_i·R_i/n_i on the unclipped tokens only. verl's rollout weights enter as their geometric
    mean per sequence. (The fused form, from the logits: gspo's loss_type="geo_mean".)"""
    low, high = _clip_ratios(config, lower_clip=False)
    keep = response_mask != 0
    n = keep.sum(-1).clamp(min=1)
    delta = torch.where(keep, log_prob - old_log_prob, 0.0).detach()
    clipped = torch.where(advantages > 0, delta.clamp(max=high),
                          torch.where(advantages < 0, delta.clamp(min=-low), 0.0))
    inside = keep & (clipped == delta) & (advantages != 0)
    seq = torch.where(keep, advantages, 0.0).sum(-1) / n * (torch.where(keep, clipped, 0.0).sum(-1) / n).exp()
    if rollout_is_weights is not None:
        seq = seq * (torch.where(keep, torch.log(rollout_is_weights + 1e-10), 0.0).sum(-1) / n).exp()
    lp = torch.where(inside, log_prob, log_prob.detach())
    out = rl_losses.policy_token_loss(lp, log_prob.detach(), seq.detach().unsqueeze(-1).expand_as(lp), loss_mask=keep,
                                      epsilon_low=0.5, epsilon_high=0.5)  # (r = 1: no clip reached)
    loss = (out.loss.sum(-1) / n).sum() / log_prob.shape[0]
    outside = keep & ((delta < -low) | (delta > high))
    count = keep.sum().clamp(min=1)
    return loss, {"actor/pg_clipfrac": ((outside & (advantages > 0)).sum() / count).item(),
                  "actor/ppo_kl": (-delta.sum() / count).item(),
                  "actor/pg_clipfrac_lower": ((outside & (advantages < 0)).sum() / count).item()}


def sapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None):
    """verl's ``sapo``: the soft gate with ``tau_pos``/``tau_neg``; aggregated per sequence (seq-mean-token-mean)
    whatever ``loss_agg_mode``, as verl's own."""
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, "seq-mean-token-mean", config,
                        rollout_is_weights, loss_type="sapo",
                        sapo_temperature_pos=_temperature(config, "tau_pos", _default("sapo_temperature_pos")),
                        sapo_temperature_neg=_temperature(config, "tau_neg", _default("sapo_temperature_neg")))


def _temperature(config, name: str, default: float) -> float:
    tau = float(_config_value(config, name, default))
    if not (math.isfinite(tau) and tau > 0.0):
        raise ValueError(f"rl_losses_sapo: {name} must be finite and > 0, got {name}={tau}")
    return tau


def cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                      rollout_is_weights=None):
    """CISPO: ``−sg(min(r, 1 + clip_ratio_high))·A·lp``. The weight is capped above only (MiniMax-M1's CISPO, as
    TRL's); verl's own ``cispo`` also clamps it below at ``1 − clip_ratio_low``, so this one needs
    ``clip_ratio_low >= 1`` (no lower bound: the two then agree)."""
    low, high = _clip_ratios(config, lower_clip=False)
    if low < 1.0:
        raise ValueError(f"rl_losses_cispo caps the importance weight above only: set clip_ratio_low >= 1 (no lower "
                         f"bound), got clip_ratio_low={low}")
    # verl counts every token whose weight is capped, whatever the advantage's sign.
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        clipped=lambda out: (out.ratio > 1.0 + high).to(out.ratio.dtype), loss_type="cispo",
                        epsilon_high=1.0 + high)


def gpg_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):
    """verl's ``gpg``: ℓ = −A·lp; no metrics, as verl's."""
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        metrics=(), loss_type="gpg")


def dro_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None):
    """verl's ``dro``: ℓ = −(A·lp − β/2·(lp − old)²), β = ``policy_loss.dro_beta`` (> 0, required as verl's)."""
    beta = _policy_loss_value(config, "dro_beta")
    if beta is None or not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"rl_losses_dro: policy_loss.dro_beta must be a finite value > 0 (verl's dro requires it), "
                         f"got dro_beta={beta}")
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        metrics=("actor/ppo_kl",), loss_type="dro", dro_beta=float(beta))


def _dppo_policy_loss(loss_type):
    def dppo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                         rollout_is_weights=None):
        low, high = _clip_ratios(config)
        c = float(_config_value(config, "clip_ratio_c", 20.0))  # verl's fallback where the config has none
        # pg_clipfrac: the tokens outside the trust region (the op's clip flags); pg_clipfrac_lower: those inside
        # it whose ratio is truncated at clip_ratio_c.
        def truncated(out):
            return (out.ratio > c) & (out.clipped_low + out.clipped_high == 0)

        return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                            rollout_is_weights, lower=truncated, loss_type=loss_type, epsilon_low=low,
                            epsilon_high=high, clip_ratio_c=c)
    dppo_policy_loss.__name__ = f"{loss_type}_policy_loss"
    dppo_policy_loss.__doc__ = (f"verl's ``{loss_type}``: −A·sg(min(r, clip_ratio_c))·lp inside DPPO's trust region "
                                f"(clip_ratio_low/high its bounds), 0 outside.")
    return dppo_policy_loss


dppo_tv_policy_loss = _dppo_policy_loss("dppo_tv")
dppo_kl_policy_loss = _dppo_policy_loss("dppo_kl")


def _policy_loss_options(config, names, fallbacks=None):
    # verl's policy_loss options under their own names; where verl's config leaves one None, verl's function's own
    # fallback (``fallbacks``), else the op's default (verl's PolicyLossConfig default).
    fallbacks = fallbacks or {}
    return {name: float(_policy_loss_value(config, name, fallbacks.get(name, _default(name)))) for name in names}


def clip_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                         rollout_is_weights=None):
    """verl's ``clip_cov``: PPO's clip (clip_ratio_low/high, no dual clip), 0 on a random subset of at most
    max(⌊clip_cov_ratio·N⌋, 1) of the tokens the clip leaves alone with clip_cov_lb < cov < clip_cov_ub, cov =
    (A − mean A)·(lp − mean lp) over the micro-batch's response tokens; the subset is uniformly random as verl's,
    drawn on the tensors' device without a host synchronisation (not verl's torch.randperm draw: docs/policy_losses.md).
    pg_clipfrac: the subset's share."""
    low, high = _clip_ratios(config)
    options = _policy_loss_options(config, ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
    return _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                        metrics=_METRICS[:2], loss_type="clip_cov", epsilon_low=low, epsilon_high=high, **options)


def kl_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                       rollout_is_weights=None):
    """verl's ``kl_cov``: −A·r, plus ppo_kl_coef·|lp − old| on the max(⌊kl_cov_ratio·N⌋, 1) response tokens of
    largest cov (as clip_cov's); ppo_kl: the mean |lp − old|."""
    options = _policy_loss_options(config, ("kl_cov_ratio", "ppo_kl_coef"), fallbacks=dict(ppo_kl_coef=1.0))
    loss, _ = _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                           rollout_is_weights, metrics=(), loss_type="kl_cov", **options)
    keep = response_mask != 0
    distance = torch.where(keep, log_prob - old_log_prob, 0.0).detach().abs().sum() / keep.sum().clamp(min=1)
    return loss, {"actor/ppo_kl": distance.item()}


def bypass_mode_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None):
    """verl's ``bypass_mode`` (``old_log_prob`` holds the rollout log-probs): verl's own importance weights and
    rejection mask of the current log-probs against the rollout's (``compute_rollout_correction_and_rejection_mask``,
    detached, from ``policy_loss.rollout_correction``), then on the kept tokens ``rollout_correction.loss_type``
    "ppo_clip" (rl_losses_ppo_clip, no weights: the ratio is the correction) or "reinforce" (−A·lp times the
    weights: rl_losses_gpg); verl's rollout metrics added."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    rc = _policy_loss_value(config, "rollout_correction")
    if rc is None:
        raise ValueError("rl_losses_bypass_mode: policy_loss.rollout_correction is None (verl's bypass_mode needs it)")
    loss_type = _config_value(rc, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"rl_losses_bypass_mode: rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got "
                         f"{loss_type!r}")
    with torch.no_grad():
        weights, mask, rollout_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob, rollout_log_prob=old_log_prob, response_mask=response_mask,
            **{name: _config_value(rc, name, default) for name, default in (
                ("rollout_is", None), ("rollout_is_threshold", 2.0), ("rollout_is_batch_normalize", False),
                ("rollout_rs", None), ("rollout_rs_threshold", None))})
    if loss_type == "ppo_clip":
        loss, metrics = ppo_clip_policy_loss(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config)
    else:
        weights = weights.batch["rollout_is_weights"] if weights is not None else None
        loss, metrics = _policy_loss(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights,
                                     metrics=("actor/ppo_kl",), loss_type="gpg")
    return loss, {**metrics, **rollout_metrics}


POLICY_LOSSES = {
    "rl_losses_ppo_clip": ppo_clip_policy_loss,
    "rl_losses_gspo": gspo_policy_loss,
    "rl_losses_sapo": sapo_policy_loss,
    "rl_losses_cispo": cispo_policy_loss,
    "rl_losses_gpg": gpg_policy_loss,
    "rl_losses_dro": dro_policy_loss,
    "rl_losses_dppo_tv": dppo_tv_policy_loss,
    "rl_losses_dppo_kl": dppo_kl_policy_loss,
    "rl_losses_geo_mean": geo_mean_policy_loss,
    "rl_losses_clip_cov": clip_cov_policy_loss,
    "rl_losses_kl_cov": kl_cov_policy_loss,
    "rl_losses_bypass_mode": bypass_mode_policy_loss,
}


def register_verl_policy_losses() -> bool:
    """Register POLICY_LOSSES in verl's policy-loss registry (``loss_mode`` names ``rl_losses_*``). Returns False
    when verl is not importable."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError:
        return False
    for name, fn in POLICY_LOSSES.items():
        register_policy_loss(name)(fn)
    return True


INSTALLED = install() and register_verl_policy_losses()
