"""TRL: ``rl_losses.integrations.trl.GRPOTrainer``, a drop-in for ``trl.GRPOTrainer`` (docs/integrations/trl.md).

What changes against TRL's own trainer:
  * the policy loss comes from the fused lm_head ops, ``rl_losses.linear_grpo_loss`` (token-level importance
    sampling, and ``loss_type="vespo"`` at either level) or ``rl_losses.linear_gspo_loss``
    (``importance_sampling_level="sequence"``), applied to the last hidden state of the completion: loss,
    gradient and metrics in one chunked pass, the completion logits never materialised. ``op_options`` is the
    one mapping from TRL's configuration to the op's options: ``loss_type`` (grpo, bnpo, dr_grpo, dapo, luspo,
    cispo, sapo, vespo) and its parameters, ``delta`` (at either level: at sequence level TRL caps the
    sequence ratio, ``min(R_s, δ)``, as the GSPO op's ``delta`` does), the vLLM importance-sampling correction
    (the rollout correction, from the batch's ``sampling_per_token_logps``), ``use_bias_correction_kl`` (the
    ratio-weighted KL); ``_aggregation`` turns the loss type into per-token weights and a divisor;
  * every other log-prob the trainer computes (old-policy and reference log-probs, and the loss of the options
    the fused ops do not cover, below) goes through ``rl_losses.linear_token_log_probs``.
The entropy bonus becomes the op's ``entropy_coefficient`` (rescaled to its divisor): the static one
(``entropy_coef``) and the adaptive one (``use_adaptive_entropy``: the coefficient applied is TRL's gated
``entropy_coef``, and the controller is updated from the op's entropy, its mean over the labelled tokens, so no
extra output). TRL's bonus is a token mean while ``loss_type`` grpo and sapo weigh each token by 1/|o_i|: since
their surrogates are linear in the advantage, the 1/|o_i| moves into the advantages and the tokens weigh 1,
which leaves one coefficient for the bonus; with a KL term (``beta != 0``, not linear in A) that does not hold,
and the op has one token weight for both terms, so that case keeps TRL's formula.
Options without a fused form keep TRL's own loss formula, computed from rl_losses' log-probs:
``off_policy_mask_threshold`` and ``top_entropy_quantile < 1`` (they mask tokens by the current log-probs or
entropies of the whole batch before the loss: a second pass over the logits), the entropy bonus with grpo/sapo
and ``beta != 0`` (above), a MoE aux loss, multimodal inputs, a truncating vLLM correction with
``vllm_importance_sampling_clip_min`` or without a ``clip_max``, logit scaling or softcapping in the model
config. The ``rl_losses/fused_loss`` metric says which path a step took (1 fused, 0 TRL's formula).
"""
from __future__ import annotations

import math
import types

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput, nanmax, nanmin

import rl_losses
from rl_losses import _schema, aggregation

# TRL's loss_type -> the op's loss_type (the aggregation is _aggregation's).
_LOSS_TYPES = {name: ours for name, (ours, _) in aggregation.TRL_LOSS_TYPES.items()} | {"vespo": "vespo"}
# VESPO's options, which TRL's GRPOConfig names as the ops do.
_VESPO = tuple(sorted(name for name in _schema.arguments("grpo") if name.startswith("vespo_")))


def op_options(trainer) -> tuple[dict, str | None]:
    """The fused policy op's options for a ``trl.GRPOTrainer``'s configuration (those that do not depend on the
    batch), and why the configuration has no fused form (None: it has one).

    Returns ``(options, reason)``: ``options`` are keyword arguments of ``rl_losses.linear_grpo_loss`` /
    ``linear_gspo_loss``: ``loss_type`` (TRL's grpo, bnpo, dr_grpo, dapo and luspo are all ``ppo_clip``),
    ``epsilon_low/high``, ``delta``, ``sapo_temperature_pos/neg``, ``vespo_*``, ``beta``,
    ``kl_importance_weighted`` (``use_bias_correction_kl``), and, with the vLLM importance-sampling correction,
    ``rollout_correction`` (``vllm_importance_sampling_mode``) with ``rollout_cap`` (truncation at
    ``vllm_importance_sampling_clip_max``) or ``rollout_mask_bounds`` (``(clip_min or 0, clip_max or inf)``);
    the batch's ``sampling_per_token_logps`` become ``rollout_log_probs``."""
    args = trainer.args
    reasons = []
    if trainer.loss_type not in _LOSS_TYPES:
        return {}, f"loss_type={trainer.loss_type!r}"
    loss_type = _LOSS_TYPES[trainer.loss_type]
    options = dict(loss_type=loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
                   beta=trainer.beta)
    if args.delta is not None and loss_type == "ppo_clip":  # TRL's other loss types ignore delta
        options["delta"] = args.delta  # at sequence level: TRL's coef_1 = min(R_s, δ), as the GSPO op's
    if loss_type == "sapo":
        options.update(sapo_temperature_pos=args.sapo_temperature_pos,
                       sapo_temperature_neg=args.sapo_temperature_neg)
    if loss_type == "vespo":
        options.update({name: getattr(args, name) for name in _VESPO})
    if trainer.beta != 0.0:
        options["kl_importance_weighted"] = bool(args.use_bias_correction_kl)
    if trainer._entropy_bonus_enabled:
        if trainer.loss_type in ("grpo", "sapo") and trainer.beta != 0.0:
            # TRL's bonus is a token mean; these weigh each token by 1/|o_i|. Without a KL term the 1/|o_i| moves
            # into the advantages (_fused_loss); the KL term is not linear in A, so it keeps TRL's formula.
            reasons.append(f"an entropy bonus with loss_type={trainer.loss_type!r} and beta != 0")
        # TRL divides its bonus by the token count: _fused_loss rescales c to the op's divisor.
        options["entropy_coefficient"] = applied_entropy_coef(trainer)
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        mode = trainer.vllm_importance_sampling_mode
        low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
        options["rollout_correction"] = mode
        if mode.endswith("truncate"):
            if low is not None:
                reasons.append(f"vllm_importance_sampling_clip_min={low} with mode {mode!r}")
            if high is None:
                reasons.append(f"vllm_importance_sampling_clip_max=None with mode {mode!r}")
            options["rollout_cap"] = high
        else:  # TRL's mask keeps low <= ratio <= high; the ratio is >= 0, so no lower bound is 0
            options["rollout_mask_bounds"] = (0.0 if low is None else float(low),
                                              math.inf if high is None else float(high))
    return options, ", ".join(reasons) if reasons else None


def applied_entropy_coef(trainer) -> float:
    """The entropy coefficient this step applies: ``entropy_coef``, or with ``use_adaptive_entropy`` TRL's
    gate, ``entropy_coef`` if the last optimizer step's entropy was at or below ``entropy_target``, else 0."""
    if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


def _full(t):
    # FSDP2 (DTensor) parameters: the lm_head is gathered once per call, as TRL's own fused head does.
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _unsupported_scaling(model) -> str | None:
    config = model.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "final_logit_softcapping"
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            return name
    return None


def add_fused_lm_head(model, temperature: float = 1.0) -> None:
    """Patch ``model`` (after TRL's ``add_fused_lm_head``) so that ``model(..., labels=labels,
    fused_lm_head=True)`` computes its per-token log-probs and entropies with
    ``rl_losses.linear_token_log_probs``, and so that ``rl_losses_head=fn`` returns ``fn(hidden, weight, bias,
    labels)`` on the shifted last hidden state (the trainer's fused loss). A model whose config scales or
    softcaps its logits keeps TRL's head for the log-probs."""
    previous = model.forward
    unsupported = _unsupported_scaling(model)

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                rl_losses_head=None, **kwargs):
        if not fused_lm_head or (unsupported is not None and rl_losses_head is None):
            return previous(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                            num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:  # the hidden state at t predicts the token at t + 1
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        weight = _full(lm_head.weight)
        bias = None if lm_head.bias is None else _full(lm_head.bias)
        # The ops take one dtype: under autocast the lm_head runs in the autocast dtype (as TRL's head's matmul
        # would), else in the weight's.
        device_type = weight.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        hidden = hidden.to(device=weight.device, dtype=dtype)
        labels = labels.to(weight.device)
        if rl_losses_head is not None:
            return rl_losses_head(hidden, weight, bias, labels)
        mask = labels != -100
        # Only the labelled positions are projected (the prompt's are not), as TRL's own head does.
        lp, entropy = rl_losses.linear_token_log_probs(hidden[mask], weight, labels[mask], bias=bias,
                                                       temperature=temperature, compute_entropy=True)
        log_probs = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                   label_mask=mask)

    model.forward = types.MethodType(forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with its loss from rl_losses' fused lm_head ops (see the module docstring). Same
    constructor, same config (``trl.GRPOConfig``), same logged metric names."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_lm_head(model, temperature=self.temperature)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model, temperature=self.temperature)

    @property
    def _rl_losses_fallback(self) -> str | None:
        # Read at each step (a few attribute checks), so that options changed on the trainer are followed.
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return self._fallback_reason(model)

    # ---- which path ------------------------------------------------------------------------------------------
    def _fallback_reason(self, model) -> str | None:
        """Why the fused loss cannot express this configuration (None: it can)."""
        _, reason = op_options(self)
        checks = [
            (reason is not None, reason),
            (self.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
            (self.top_entropy_quantile < 1.0, "top_entropy_quantile"),
            (self.aux_loss_enabled, "a MoE aux loss"),
            (_unsupported_scaling(model) is not None, f"the model's {_unsupported_scaling(model)}"),
        ]
        reasons = [why for bad, why in checks if bad]
        return ", ".join(reasons) if reasons else None

    def _compute_loss(self, model, inputs):
        multimodal = any(inputs.get(k) is not None for k in ("pixel_values", "token_type_ids", "mm_token_type_ids"))
        mode = "train" if self.model.training else "eval"
        if self._rl_losses_fallback is not None or multimodal:
            self._metrics[mode]["rl_losses/fused_loss"].append(0.0)
            return super()._compute_loss(model, inputs)  # TRL's formula over rl_losses' log-probs
        self._metrics[mode]["rl_losses/fused_loss"].append(1.0)
        return self._fused_loss(model, inputs, mode)

    # ---- the fused loss ----------------------------------------------------------------------------------------
    def _aggregation(self, mask: torch.Tensor, inputs, mode: str):
        """TRL's loss_type as (per-token weights, divisor, sequence-level weighting) of the rl_losses ops.

        The per-token loss ℓ is summed as Σ w·ℓ / D; TRL's division by the gradient-accumulation steps is
        folded into D. ``weighting`` applies to importance_sampling_level="sequence" (GSPO), where TRL's
        per-sequence loss f_s is broadcast over the sequence's tokens before the same aggregation."""
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        m = mask.to(torch.float32)
        batch = mask.shape[0]
        lengths = m.sum(-1, keepdim=True).clamp(min=1.0)
        if self.loss_type in ("grpo", "sapo"):  # mean over sequences of each sequence's token mean
            return m / lengths, batch * ga, "document"
        if self.loss_type == "bnpo":  # token mean over the micro-batch
            return m, float(m.sum().clamp(min=1.0)) * ga, "token"
        if self.loss_type == "dr_grpo":  # token sum over a constant
            return m, batch * self.max_completion_length * ga, "token"
        if self.loss_type == "luspo":  # per-sequence token sums, mean over sequences
            return m, batch * ga, "token"
        # dapo, cispo, vespo: token sum over the generation batch's token count, per accumulation window
        normalizer = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return m, normalizer, "token"

    def _fused_loss(self, model, inputs, mode: str):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        keep = completion_ids.size(1)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        target = completion_ids.masked_fill(mask == 0, -100)
        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mask).float()
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        weights, divisor, weighting = self._aggregation(mask, inputs, mode)
        options, _ = op_options(self)
        sequence = self.importance_sampling_level == "sequence" and options["loss_type"] != "vespo"
        if "entropy_coefficient" in options and self.loss_type in ("grpo", "sapo"):
            # TRL's bonus weighs every token alike, these loss types each token by 1/|o_i|: ppo_clip's and sapo's
            # surrogates are linear in A > 0 scalings (−min(r·kA, clip(r)·kA) = −k·min(r·A, clip(r)·A)), so
            # A/|o_i| with token weights m gives the same policy term and leaves m for the bonus (no KL here:
            # op_options keeps TRL's formula for it).
            lengths = mask.sum(-1, keepdim=True).clamp(min=1).float()
            op_advantages, weights, weighting = advantages / lengths, mask.float(), "token"
        else:
            op_advantages = advantages
        rollout = None
        if "rollout_correction" in options:
            # TRL's ratio is exp(old - sampling); a token whose sampling log-prob is NaN (not returned by the
            # engine) gets the ratio 1, as TRL's nan_to_num of the difference gives it.
            sampling = inputs["sampling_per_token_logps"]
            rollout = torch.where(torch.isnan(sampling), old, sampling).float()
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        tokens = float(mask.sum().clamp(min=1))
        if "entropy_coefficient" in options:
            # TRL subtracts c·Σ m·H / (Σ m · ga); the op subtracts c'·Σ w·H / D with w = m here.
            options["entropy_coefficient"] *= divisor / (tokens * ga)
        options.update(divisor=divisor, compute_entropy=True, logits_scale_factor=1.0 / self.temperature,
                       rollout_log_probs=rollout, ref_log_probs=None if ref is None else ref.float())

        def head(hidden, weight, bias, _labels):
            hidden = hidden[:, -keep:]  # the completion's positions only
            old_lp = old
            if old_lp is None:
                # On-policy (num_iterations=1): the old log-probs are the current ones, detached (ratio 1).
                with torch.no_grad():
                    old_lp, _ = rl_losses.linear_token_log_probs(hidden, weight, target, bias=bias,
                                                                 temperature=self.temperature)
            old_lp = old_lp.float()
            if sequence:
                doc = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)
                return rl_losses.linear_gspo_loss(hidden, weight, target, op_advantages, old_lp, doc, bias=bias,
                                                  num_documents=mask.shape[0], weighting=weighting,
                                                  **options), old_lp
            return rl_losses.linear_grpo_loss(hidden, weight, target, op_advantages, old_lp, bias=bias,
                                              loss_weights=weights, **options), old_lp

        out, old_lp = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, fused_lm_head=True,
                            rl_losses_head=head)
        self._log_metrics(out, old_lp, ref, advantages[:, :1], mask, mode, sequence, inputs)
        if "entropy_coefficient" in options:  # TRL's metrics of the bonus: the loss without it, and c
            policy_loss = out.loss.detach() + options["entropy_coefficient"] * out.entropy.detach() * tokens / divisor
            if self.loss_type not in ("cispo", "dapo", "vespo"):
                policy_loss = policy_loss * ga  # TRL logs these before its division by the accumulation steps
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._update_entropy_coef(out.entropy.detach() * mask.sum(), mask.sum())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return out.loss

    def _update_entropy_coef(self, entropy_sum, count):
        """TRL's adaptive entropy controller, from the op's entropy (its mean over the labelled tokens times their
        count): the window's sums accumulate over the micro-batches; at the optimizer step their mean over the
        processes raises ``entropy_coef`` by ``entropy_coef_delta`` if it is at or below ``entropy_target``, else
        lowers it, within [entropy_coef_min, entropy_coef_max], for the next window."""
        stats = torch.stack([entropy_sum, count.to(entropy_sum.dtype)])
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _log_metrics(self, out, old_lp, ref, advantages, mask, mode, sequence, inputs):
        """TRL's metric names and definitions, from the op's detached per-token log-probs."""
        maskf = mask.float()

        def global_masked_mean(x):
            if x.shape[1] == 1:
                local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                local_sum, local_count = (x * maskf).sum(), maskf.sum()
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

        metrics = self._metrics[mode]
        lp = out.log_probs.detach()
        ratio = out.document_ratios.detach().unsqueeze(1) if sequence else torch.exp(lp - old_lp)
        if self.beta != 0.0:
            d = ref - lp
            kl = torch.exp(d) - d - 1
            metrics["kl"].append(global_masked_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        entropy_sum = out.entropy.detach() * maskf.sum()
        totals = self.accelerator.reduce(torch.stack([entropy_sum, maskf.sum()]), reduction="sum")
        metrics["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        if self.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(global_masked_mean(((ratio > self.epsilon_high) & (advantages > 0))
                                                                  .float()))
        elif self.loss_type == "vespo":
            ratios = inputs.get("importance_sampling_ratio") if self.use_vllm and \
                self.vllm_importance_sampling_correction else None
            metrics["vespo/phi_seq_mean"].append(global_masked_mean(self.get_gamma_weights(
                advantages, lp - old_lp, maskf, ratios, k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos, k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg)))
        elif self.loss_type != "sapo":
            low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
            metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())
