"""TRL: ``rl_losses.integrations.trl.GRPOTrainer``, a drop-in for ``trl.GRPOTrainer`` (docs/integrations/trl.md).

What changes against TRL's own trainer:
  * the policy loss comes from the fused lm_head ops, ``rl_losses.linear_grpo_loss`` (token-level importance
    sampling, and ``loss_type="vespo"`` at either level) or ``rl_losses.linear_gspo_loss``
    (``importance_sampling_level="sequence"``), applied to the last hidden state of the completion: loss,
    gradient and metrics in one chunked pass, the completion logits never materialised. ``op_options`` is the
    one mapping from TRL's configuration to the op's options: ``loss_type`` (grpo, bnpo, dr_grpo, dapo, luspo,
    cispo, sapo, vespo) and its parameters, ``delta`` (TRL's two-sided clip, any value TRL takes; at sequence
    level of the sequence ratio), the vLLM importance-sampling correction (the rollout correction, from the
    batch's ``sampling_per_token_logps``), ``use_bias_correction_kl`` (the ratio-weighted KL); ``_aggregation``
    turns the loss type into per-token weights and a divisor;
  * every other log-prob the trainer computes (old-policy and reference log-probs, and the loss of the options
    the fused ops do not cover, below) goes through ``rl_losses.linear_token_log_probs``, in float32 with
    ``cast_lm_head_to_fp32`` as TRL's head;
  * on-policy (TRL computed no old log-probs: ``num_iterations=1`` without vLLM's importance-sampling correction)
    the op gets ``old_log_probs=None`` (the detached current log-probs, ratio 1): no extra pass;
  * ``lm_head_strategy`` (a constructor keyword, "fast" by default, or "lean") is the ``strategy`` of every
    lm_head op the trainer runs.
The entropy bonus becomes the op's ``entropy_coefficient`` (rescaled to its divisor): the static one
(``entropy_coef``) and the adaptive one (``use_adaptive_entropy``: the coefficient applied is TRL's gated
``entropy_coef``, and the controller is updated from the entropy of the tokens the bonus acts on). TRL's bonus is
a token mean while ``loss_type`` grpo and sapo weigh each token by 1/|o_i|: since their surrogates are linear in
the advantage, the 1/|o_i| moves into the advantages and the tokens weigh 1, which leaves one coefficient for the
bonus; with a KL term (``beta != 0``, not linear in A) that does not hold, and the op has one token weight for
both terms, so that case keeps TRL's formula.
``off_policy_mask_threshold`` and ``top_entropy_quantile < 1`` are fused too: a no-gradient
``linear_token_log_probs`` pre-pass gives every token's current log-prob (and entropy) first, TRL's own mask
functions turn them into masks, and a masked token's surrogate is switched off through its advantage (the
surrogates are linear in positive scalings of A and 0 at A = 0; the KL and the entropy bonus stay, as TRL's).
The rest keeps TRL's own loss formula over rl_losses' per-token log-probs, with a warning once per trainer and
reason (``FALLBACK_COST``): the entropy bonus with grpo/sapo and ``beta != 0`` (above), ``top_entropy_quantile``
at sequence level (the GSPO op has no per-token weights) or with the bonus and ``beta != 0`` (the bonus's mask
would weigh the KL too), a MoE aux loss, multimodal inputs, a truncating vLLM correction with
``vllm_importance_sampling_clip_min`` or without a ``clip_max``, logit scaling or softcapping in the model config.
The ``rl_losses/fused_loss`` metric says which path a step took (1 fused, 0 TRL's formula).
"""
from __future__ import annotations

import contextlib
import logging
import math
import types

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput, nanmax, nanmin

import rl_losses
from rl_losses import _schema, aggregation
from rl_losses._checks import LINEAR_STRATEGIES

logger = logging.getLogger(__name__)

# TRL's loss_type -> the op's loss_type (the aggregation is _aggregation's).
_LOSS_TYPES = {name: ours for name, (ours, _) in aggregation.TRL_LOSS_TYPES.items()} | {"vespo": "vespo"}
# VESPO's options, which TRL's GRPOConfig names as the ops do.
_VESPO = tuple(sorted(name for name in _schema.arguments("grpo") if name.startswith("vespo_")))
# What a step on TRL's formula costs against the fused one (docs/integrations/trl.md, "Fallbacks").
FALLBACK_COST = ("one more lm_head GEMM per chunk, since the backward recomputes the logits, and TRL's per-token "
                 "autograd graph: 1.1x to 1.4x the fused loss step on the CPU at V = 32768; the logits still never "
                 "exist whole")


def op_options(trainer) -> tuple[dict, list[str]]:
    """The fused policy op's options for a ``trl.GRPOTrainer``'s configuration (those that do not depend on the
    batch), and the reasons the configuration has no fused form (none: it has one).

    Returns ``(options, reasons)``: ``options`` are keyword arguments of ``rl_losses.linear_grpo_loss`` /
    ``linear_gspo_loss``: ``loss_type`` (TRL's grpo, bnpo, dr_grpo, dapo and luspo are all ``ppo_clip``),
    ``epsilon_low/high``, ``delta``, ``sapo_temperature_pos/neg``, ``vespo_*``, ``beta``,
    ``kl_importance_weighted`` (``use_bias_correction_kl``), and, with the vLLM importance-sampling correction,
    ``rollout_correction`` (``vllm_importance_sampling_mode``) with ``rollout_cap`` (truncation at
    ``vllm_importance_sampling_clip_max``) or ``rollout_mask_bounds`` (``(clip_min or 0, clip_max or inf)``);
    the batch's ``sampling_per_token_logps`` become ``rollout_log_probs``."""
    args = trainer.args
    reasons = []
    if trainer.loss_type not in _LOSS_TYPES:
        return {}, [f"loss_type={trainer.loss_type!r}"]
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
    if trainer.top_entropy_quantile < 1.0:
        if trainer.importance_sampling_level == "sequence" and loss_type != "vespo":
            reasons.append("top_entropy_quantile < 1 with importance_sampling_level='sequence'")
        if trainer._entropy_bonus_enabled and trainer.beta != 0.0:
            reasons.append("top_entropy_quantile < 1 with an entropy bonus and beta != 0")
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
    if trainer.aux_loss_enabled:
        reasons.append("a MoE aux loss")
    return options, reasons


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


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      strategy: str = "fast") -> None:
    """Patch ``model`` (after TRL's ``add_fused_lm_head``) so that ``model(..., labels=labels,
    fused_lm_head=True)`` computes its per-token log-probs and entropies with
    ``rl_losses.linear_token_log_probs``, and so that ``rl_losses_head=fn`` returns ``fn(hidden, weight, bias,
    labels)`` on the shifted last hidden state (the trainer's fused loss). ``cast_lm_head_to_fp32``: the head runs
    in float32 outside autocast, as TRL's. ``strategy``: the op's (``linear_token_log_probs``). A model whose config
    scales or softcaps its logits keeps TRL's head for the log-probs."""
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
        # would), else in the weight's; cast_lm_head_to_fp32 runs it in float32 with autocast off (TRL's GEMMs
        # too), its hidden states cast up and their gradient cast back.
        device_type = weight.device.type
        head_context = contextlib.nullcontext()
        if cast_lm_head_to_fp32:
            dtype, head_context = torch.float32, torch.autocast(device_type, enabled=False)
        elif torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = weight.dtype
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        hidden = hidden.to(device=weight.device, dtype=dtype)
        labels = labels.to(weight.device)
        with head_context:
            if rl_losses_head is not None:
                return rl_losses_head(hidden, weight, bias, labels)
            mask = labels != -100
            # Only the labelled positions are projected (the prompt's are not), as TRL's own head does.
            # One host synchronisation (nonzero); the gathers and scatters index with its result, and the op
            # is told that every row it gets is labelled (skip_unlabelled=False: it does not count them again).
            at = mask.nonzero(as_tuple=True)
            lp, entropy = rl_losses.linear_token_log_probs(hidden[at], weight, labels[at], bias=bias,
                                                           temperature=temperature, compute_entropy=True,
                                                           strategy=strategy, skip_unlabelled=False)
        log_probs = lp.new_zeros(mask.shape).index_put(at, lp)
        entropy = entropy.new_zeros(mask.shape).index_put(at, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                   label_mask=mask)

    model.forward = types.MethodType(forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with its loss from rl_losses' fused lm_head ops (see the module docstring). Same
    constructor, same config (``trl.GRPOConfig``), same logged metric names, plus the keyword
    ``lm_head_strategy``: "fast" (default) or "lean", the ``strategy`` of every lm_head op (``rl_losses.
    linear_grpo_loss``'s: "lean" holds at most 256 MiB beyond the gradients, for one more GEMM)."""

    def __init__(self, *args, lm_head_strategy: str = "fast", **kwargs):
        if lm_head_strategy not in LINEAR_STRATEGIES:
            raise ValueError(f"GRPOTrainer: lm_head_strategy must be one of {LINEAR_STRATEGIES}, "
                             f"got {lm_head_strategy!r}")
        super().__init__(*args, **kwargs)
        self.lm_head_strategy = lm_head_strategy
        self._rl_losses_warned = set()
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        head = dict(temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                    strategy=lm_head_strategy)
        add_fused_lm_head(model, **head)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model, **head)

    @property
    def _rl_losses_fallback(self) -> str | None:
        """Why this configuration keeps TRL's formula (None: the loss is fused). Read at each step (a few
        attribute checks), so that options changed on the trainer are followed."""
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return ", ".join(self._fallback_reasons(model)) or None

    # ---- which path ------------------------------------------------------------------------------------------
    def _fallback_reasons(self, model) -> list[str]:
        """Why the fused loss cannot express this configuration (empty: it can)."""
        _, reasons = op_options(self)
        scaling = _unsupported_scaling(model)
        return reasons + ([f"the model's {scaling}"] if scaling is not None else [])

    def _compute_loss(self, model, inputs):
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        reasons = self._fallback_reasons(base)
        if any(inputs.get(k) is not None for k in ("pixel_values", "token_type_ids", "mm_token_type_ids")):
            reasons.append("multimodal inputs")
        mode = "train" if self.model.training else "eval"
        if reasons:
            for reason in reasons:
                if reason not in self._rl_losses_warned:  # once per trainer and reason
                    self._rl_losses_warned.add(reason)
                    logger.warning("rl_losses GRPOTrainer: %s has no fused form; the loss keeps TRL's formula over "
                                   "rl_losses' per-token log-probs (%s). rl_losses/fused_loss logs 0 for such steps.",
                                   reason, FALLBACK_COST)
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

    def _token_masks(self, inputs, mask, current, sampling):
        """(keep, high): where a token's surrogate counts (TRL's off-policy sequence mask times its high-entropy
        token mask) and the high-entropy mask alone (None without top_entropy_quantile < 1), from the pre-pass's
        current log-probs and entropies and the sampling policy's log-probs, through TRL's own functions."""
        keep = high = None
        if self.off_policy_mask_threshold is not None:
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            keep = self.get_off_policy_mask(advantages, current[0], sampling, mask,
                                            self.off_policy_mask_threshold).float()
        if self.top_entropy_quantile < 1.0:
            high = self.get_high_entropy_mask(current[1], mask, 1 - self.top_entropy_quantile).float()
            keep = high if keep is None else keep * high
        return keep, high

    def _fused_loss(self, model, inputs, mode: str):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        keep = completion_ids.size(1)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        target = completion_ids.masked_fill(mask == 0, -100)
        rows = mask != 0

        def clean(t):  # padding may hold NaN or inf: 0 there, never read into a result
            return None if t is None else torch.where(rows, t, 0.0)

        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mask).float()
        old = clean(inputs.get("old_per_token_logps"))
        ref = clean(inputs.get("ref_per_token_logps")) if self.beta != 0.0 else None
        sampling = clean(inputs.get("sampling_per_token_logps"))
        weights, divisor, weighting = self._aggregation(mask, inputs, mode)
        options, _ = op_options(self)
        sequence = self.importance_sampling_level == "sequence" and options["loss_type"] != "vespo"
        coefficient = options.pop("entropy_coefficient", None)
        if coefficient is not None and self.loss_type in ("grpo", "sapo"):
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
            rollout = torch.where(torch.isnan(sampling), old, sampling).float()
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        options.update(divisor=divisor, compute_entropy=True, logits_scale_factor=1.0 / self.temperature,
                       strategy=self.lm_head_strategy, skip_unlabelled=False, rollout_log_probs=rollout,
                       ref_log_probs=None if ref is None else ref.float())
        masks = self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0
        maskf = mask.float()
        # Only the labelled positions are projected (not the completions' padding), as TRL's own head does; each
        # keeps its sequence for the options that sum over one (vespo, a sequence-level rollout correction).
        # The labelled positions (b, k): the step's one host synchronisation (nonzero); every gather and scatter
        # below indexes with them, and the ops get only labelled rows (skip_unlabelled=False: no second count).
        at = rows.nonzero(as_tuple=True)
        sequence_of = at[0]
        summed = options["loss_type"] == "vespo" or options.get("rollout_correction", "").startswith("sequence")
        if summed and not sequence:  # (the GSPO op takes the sequences anyway)
            options.update(document_index=sequence_of, num_documents=mask.shape[0])
        for name in ("rollout_log_probs", "ref_log_probs"):
            options[name] = None if options[name] is None else options[name][at]

        def scatter(values):  # (labelled,) -> (B, K), 0 elsewhere
            return values.new_zeros(mask.shape).index_put(at, values)

        def head(hidden, weight, bias, _labels):
            hidden, labels = hidden[:, -keep:][at], target[at]  # the completion's labelled positions
            current = None
            if masks:
                # One forward GEMM per chunk, no gradient: the current log-probs (the old ones on-policy) and
                # entropies that the masks read before the loss.
                with torch.no_grad():
                    lp, entropy = rl_losses.linear_token_log_probs(hidden, weight, labels, bias=bias,
                                                                   temperature=self.temperature,
                                                                   compute_entropy=self.top_entropy_quantile < 1.0,
                                                                   strategy=self.lm_head_strategy,
                                                                   skip_unlabelled=False)
                current = (scatter(lp), None if entropy is None else scatter(entropy))
            if old is not None:
                old_lp = old.float()
            elif current is not None:
                old_lp = current[0].float()
            else:  # on-policy without the masks: the op takes old_log_probs=None (ratio 1, gradient A·∇lp)
                old_lp = None
            token_keep, high = (self._token_masks(inputs, mask, current, old_lp if sampling is None else sampling)
                                if masks else (None, None))
            adv, w, bonus_mask = op_advantages, weights, maskf  # bonus_mask: TRL's effective_mask of the bonus
            if token_keep is not None:
                adv = adv * token_keep  # a masked surrogate, not its KL or bonus (TRL's order)
            if coefficient is not None and high is not None:
                w, bonus_mask = w * high, maskf * high  # TRL's bonus acts on the high-entropy tokens only
            extra = {}
            if coefficient is not None:
                # TRL subtracts c·Σ e·H / (Σ e · ga) over its effective mask e; the op c'·Σ w·H / D, w = e here.
                extra["entropy_coefficient"] = coefficient * divisor / (float(bonus_mask.sum().clamp(min=1)) * ga)
            old_rows = None if old_lp is None else old_lp[at]
            if sequence:
                out = rl_losses.linear_gspo_loss(hidden, weight, labels, adv[at], old_rows, sequence_of,
                                                 bias=bias, num_documents=mask.shape[0], weighting=weighting,
                                                 **options, **extra)
            else:
                out = rl_losses.linear_grpo_loss(hidden, weight, labels, adv[at], old_rows, bias=bias,
                                                 loss_weights=w[at], **options, **extra)
            log_probs = scatter(out.log_probs)
            if old_lp is None:  # on-policy: the old log-probs are the current ones, detached
                old_lp = log_probs.detach().float()
            bonus_entropy = None
            if coefficient is not None:  # Σ e·H: the bonus's entropy sum (the op's mean is over every token)
                bonus_entropy = out.entropy.detach() * maskf.sum() if high is None else (current[1] * bonus_mask).sum()
            return out._replace(log_probs=log_probs), old_lp, extra.get("entropy_coefficient"), \
                bonus_entropy, bonus_mask

        out, old_lp, applied, bonus_entropy, bonus_mask = model(input_ids=input_ids, attention_mask=attention_mask,
                                                                 labels=input_ids, fused_lm_head=True,
                                                                 rl_losses_head=head)
        self._log_metrics(out, old_lp, ref, advantages[:, :1], mask, mode, sequence, inputs)
        if coefficient is not None:  # TRL's metrics of the bonus: the loss without it, and c
            policy_loss = out.loss.detach() + applied * bonus_entropy / divisor
            if self.loss_type not in ("cispo", "dapo", "vespo"):
                policy_loss = policy_loss * ga  # TRL logs these before its division by the accumulation steps
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._update_entropy_coef(bonus_entropy, bonus_mask.sum())
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
        """TRL's metric names and definitions, from the op's detached per-token log-probs. Masked positions are
        never read (padding may hold NaN)."""
        maskb, maskf = mask.bool(), mask.float()

        def global_masked_mean(x):
            if x.shape[1] == 1:
                local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                local_sum, local_count = torch.where(maskb, x, 0.0).sum(), maskf.sum()
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else torch.where(maskb, x, 0.0).sum(-1) / maskf.sum(-1)

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
            coef = ratio if self.args.delta is None else ratio.clamp(max=self.args.delta)  # TRL's coef_1 after δ
            low = ((coef < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((coef > 1 + self.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
            metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())
