"""Configuration classes of the loss heads, mirroring Fast-LLM's ``fast_llm/layers/language_model/loss/config.py``.

Each config is a frozen dataclass validated on construction (``ValueError``/``TypeError`` naming the class, the
field and the bad value; ``dataclasses.replace`` validates again), registered under a ``type`` name, buildable
from a dict / YAML with a ``type`` key and serialised back by ``to_dict()``; ``get_loss(name=...)`` builds the
``nn.Module`` of ``rl_losses.losses``.

    cfg = LanguageModelLossConfig.from_dict({"type": "grpo", "epsilon_high": 0.28, "beta": 0.04})
    loss_fn = cfg.get_loss(name="grpo")
    loss, metrics = loss_fn(logits, batch)

Differences from Fast-LLM, on purpose: ``use_triton`` is ``use_cuda_kernel`` (``use_triton`` in a dict is read as
an alias); GRPO and GSPO are two types (``grpo``, ``gspo``) rather than ``policy_loss`` inside one; a sampling
temperature T is ``logits_scale_factor = 1/T``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings
from typing import Any, ClassVar

from rl_losses import fused_head, losses
from rl_losses._checks import (GSPO_WEIGHTINGS, KL_ESTIMATORS, POLICY_LOSS_TYPES, ROLLOUT_MODES,
                               TOKEN_LOG_PROB_LOSS_TYPES)
from rl_losses._checks_heads import DISTILL_KINDS, TOPK_KINDS, TOPK_TAILS
from rl_losses._schema import default

# type name -> concrete config class, filled by ``LanguageModelLossConfig.__init_subclass__``.
_REGISTRY: dict[str, type[LanguageModelLossConfig]] = {}

METRICS_LEVELS = ("none", "basic", "with_entropy")
GRPO_NORMALIZATIONS = ("token", "sequence", "document", "dr_grpo")
ROLLOUT_CORRECTIONS = (None, *ROLLOUT_MODES)


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelLossConfig:
    """Base of every loss config (abstract: build a concrete one with ``from_dict`` or its class).

    weight: factor applied to the loss returned by the module (>= 0).
    logits_scale_factor: s > 0; the softmax is over s·logits (a sampling temperature T is s = 1/T).
    use_cuda_kernel: None: the extension's op whenever it supports the logits' device (the CPU always, CUDA when
        the extension was built with its CUDA kernels), else the pure-PyTorch reference; True: require the CUDA
        kernel (an error on CPU tensors or a CPU-only build); False: the pure-PyTorch reference.
    """

    type_name: ClassVar[str | None] = None  # the ``type`` key; None for abstract configs
    # Fast-LLM's names read by ``from_dict``: alias -> field; and the fields Fast-LLM dropped (a warning there too).
    aliases: ClassVar[dict[str, str]] = {"use_triton": "use_cuda_kernel"}
    retired: ClassVar[tuple[str, ...]] = ()

    weight: float = 1.0
    logits_scale_factor: float = default("cross_entropy", "logits_scale_factor")
    use_cuda_kernel: bool | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("type_name")
        if name is not None:
            _REGISTRY[name] = cls

    def __post_init__(self):
        if self.type_name is None:
            raise TypeError(f"{type(self).__name__} is abstract; use one of the types {sorted(_REGISTRY)} "
                            f"(e.g. LanguageModelLossConfig.from_dict({{'type': 'grpo'}}))")
        self._validate()

    # ---- validation -------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        self._check_float("weight", low=0.0)
        self._check_float("logits_scale_factor", low=0.0, low_inclusive=False)
        self._check_optional_bool("use_cuda_kernel")

    def _fail(self, field: str, expected: str, error: type[Exception] = ValueError) -> typing.NoReturn:
        raise error(f"{type(self).__name__}.{field} must be {expected}, got {getattr(self, field)!r}")

    def _check_float(self, field: str, *, low: float | None = None, high: float | None = None,
                     low_inclusive: bool = True, high_inclusive: bool = True, optional: bool = False) -> None:
        value = getattr(self, field)
        if value is None and optional:
            return
        # bool is an int subclass: reject it explicitly so that `weight: true` is not read as 1.0.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._fail(field, "a number" + (" or None" if optional else ""), TypeError)
        value = float(value)
        bounds = ([] if low is None else [f"{'>=' if low_inclusive else '>'} {low}"]) + (
            [] if high is None else [f"{'<=' if high_inclusive else '<'} {high}"])
        expected = " ".join(["a finite number", " and ".join(bounds)]).strip()
        if (not math.isfinite(value)
                or (low is not None and (value < low or (value == low and not low_inclusive)))
                or (high is not None and (value > high or (value == high and not high_inclusive)))):
            self._fail(field, expected)
        object.__setattr__(self, field, value)  # normalise ints to floats so to_dict() round-trips exactly

    def _check_optional_bool(self, field: str) -> None:
        if getattr(self, field) is not None and not isinstance(getattr(self, field), bool):
            self._fail(field, "True, False or None", TypeError)

    def _check_bool(self, field: str) -> None:
        if not isinstance(getattr(self, field), bool):
            self._fail(field, "True or False", TypeError)

    def _check_choice(self, field: str, choices: tuple[str, ...]) -> None:
        if getattr(self, field) not in choices:
            self._fail(field, f"one of {list(choices)}")

    # ---- (de)serialisation ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LanguageModelLossConfig:
        """Build a config from a dict holding a ``type`` key (optional when called on a concrete class)."""
        if isinstance(config, LanguageModelLossConfig):
            config = config.to_dict()
        if not isinstance(config, dict):
            raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(config).__name__}")
        config = dict(config)
        type_name = config.pop("type", cls.type_name)
        if type_name is None:
            raise ValueError(f"{cls.__name__}.from_dict: missing key 'type' (one of {sorted(_REGISTRY)})")
        if type_name not in _REGISTRY:
            raise ValueError(f"{cls.__name__}.from_dict: unknown type {type_name!r} (one of {sorted(_REGISTRY)})")
        target = _REGISTRY[type_name]
        if not issubclass(target, cls):
            raise ValueError(f"{cls.__name__}.from_dict: type {type_name!r} builds a {target.__name__}, "
                             f"which is not a {cls.__name__}")
        for alias, name in target.aliases.items():
            if alias in config:
                if name in config:
                    raise ValueError(f"{target.__name__}: give either {alias!r} (Fast-LLM's alias) or {name!r}, "
                                     f"not both")
                config[name] = config.pop(alias)
        for name in target.retired:  # as Fast-LLM does: a warning, and the key is dropped
            if name in config:
                warnings.warn(f"{target.__name__}: the field {name!r} is no longer supported; ignored", UserWarning,
                              stacklevel=2)
                del config[name]
        fields = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"{target.__name__}: unknown field(s) {unknown} (known: {sorted(fields)})")
        return target(**config)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike) -> LanguageModelLossConfig:
        """Build a config from a YAML file path or a YAML string (a mapping with a ``type`` key). Needs PyYAML."""
        try:
            import yaml
        except ImportError as e:
            raise ImportError("LanguageModelLossConfig.from_yaml needs PyYAML (pip install pyyaml)") from e
        if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                                and os.path.isfile(source)):
            with open(source) as f:
                source = f.read()
        return cls.from_dict(yaml.safe_load(source))

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict with its ``type`` key; ``from_dict(cfg.to_dict()) == cfg``."""
        return {"type": self.type_name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    # ---- building the module ----------------------------------------------------------------------------------
    @property
    def loss_class(self) -> type[losses.LanguageModelLoss]:
        """The ``nn.Module`` class of rl_losses.losses that this config builds."""
        raise NotImplementedError

    def get_loss(self, name: str | None = None, *, tp_group=None) -> losses.LanguageModelLoss:
        """The loss module; ``name`` prefixes its metrics (default: the type name).

        tp_group: vocabulary-parallel process group (the extension's path only; see rl_losses.distributed).
        """
        return self.loss_class(self, name=self.type_name if name is None else name, tp_group=tp_group)


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelLabelEntropyLossConfig(LanguageModelLossConfig):
    """Cross-entropy from labels (type ``label``); the math: docs/math.md.

    loss_type: only "cross_entropy" (Fast-LLM's forward/reverse KL need a teacher distribution, not labels).
    label_smoothing: ε in [0, 1). z_loss_factor: ζ >= 0 (adds ζ·lse² per labelled token).
    """

    type_name: ClassVar[str] = "label"
    retired: ClassVar[tuple[str, ...]] = ("implementation",)

    loss_type: str = "cross_entropy"
    label_smoothing: float = default("cross_entropy", "label_smoothing")
    z_loss_factor: float = default("cross_entropy", "z_loss_factor")

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("loss_type", ("cross_entropy",))
        self._check_float("label_smoothing", low=0.0, high=1.0, high_inclusive=False)
        self._check_float("z_loss_factor", low=0.0)

    @property
    def loss_class(self) -> type[losses.LanguageModelLabelEntropyLoss]:
        return losses.LanguageModelLabelEntropyLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelZLossConfig(LanguageModelLossConfig):
    """Z-loss alone (type ``z_loss``): Σ_t mask_t·lse_t² / Σ_t mask_t (mask: the batch's ``loss_mask``)."""

    type_name: ClassVar[str] = "z_loss"

    @property
    def loss_class(self) -> type[losses.LanguageModelZLoss]:
        return losses.LanguageModelZLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelPolicyGradientLossConfig(LanguageModelLossConfig):
    """Shared options of the policy-gradient losses (abstract).

    epsilon_low: ε_l in [0, 1): the ratio is clipped below at 1 - ε_l. epsilon_high: ε_h >= 0: clipped above at
        1 + ε_h (DAPO's clip-higher: ε_h > ε_l).
    delta: optional two-sided clip of the ratio (finite, > 0; usually > 1 + epsilon_high), TRL's ``delta``
        ("ppo_clip" only; GSPO: of the sequence ratio R_s).
    metrics: "none" (only ``<name>_new_logprobs``), "basic" (adds the clipped fractions, KL(new||old), ratio,
        advantage and token statistics; no extra pass over the vocabulary) or "with_entropy" (adds the mean
        entropy, fused into the kernel's pass).
    beta: KL penalty towards the reference policy, per token (>= 0; > 0 needs ``ref_log_probs`` in the batch).
    The policy family (docs/policy_losses.md; the options of rl_losses.grpo_loss / gspo_loss): loss_type
        ("ppo_clip", "cispo", "sapo", "vespo"; GRPO also verl's "gpg", "dro", "dppo_tv", "dppo_kl", "clip_cov",
        "kl_cov", GSPO its "geo_mean"), dro_beta ("dro" only, required there, > 0), clip_ratio_c (> 0, dppo's cap
        of the ratio), clip_cov_ratio (> 0), clip_cov_lb < clip_cov_ub, kl_cov_ratio (in (0, 1]) and ppo_kl_coef
        (finite; verl's names), sapo_temperature_pos /
        sapo_temperature_neg (> 0), vespo_k_pos /
        vespo_k_neg (finite) and vespo_lambda_pos / vespo_lambda_neg (>= 0; TRL's names), rollout_correction (None,
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"; needs ``rollout_log_probs`` in the
        batch), rollout_cap (> 0), rollout_mask_bounds ((lo, hi), lo < hi, "*_mask" modes), kl_estimator ("k1",
        "k2", "k3"), kl_importance_weighted, entropy_coefficient. Without ``old_log_probabilities`` in the batch
        the loss is on-policy (old = sg(lp)).
    """

    # The op's options keep the op's names and defaults (rl_losses.losses passes them on by name).
    epsilon_low: float = default("grpo", "epsilon_low")
    epsilon_high: float = default("grpo", "epsilon_high")
    delta: float | None = default("grpo", "delta")
    metrics: str = "none"
    loss_type: str = default("grpo", "loss_type")
    sapo_temperature_pos: float = default("grpo", "sapo_temperature_pos")
    sapo_temperature_neg: float = default("grpo", "sapo_temperature_neg")
    dro_beta: float | None = default("grpo", "dro_beta")
    clip_ratio_c: float = default("grpo", "clip_ratio_c")
    clip_cov_ratio: float = default("grpo", "clip_cov_ratio")
    clip_cov_lb: float = default("grpo", "clip_cov_lb")
    clip_cov_ub: float = default("grpo", "clip_cov_ub")
    kl_cov_ratio: float = default("grpo", "kl_cov_ratio")
    ppo_kl_coef: float = default("grpo", "ppo_kl_coef")
    rollout_correction: str | None = default("grpo", "rollout_correction")
    rollout_cap: float = default("grpo", "rollout_cap")
    rollout_mask_bounds: tuple[float, float] | None = default("grpo", "rollout_mask_bounds")
    kl_estimator: str = default("grpo", "kl_estimator")
    kl_importance_weighted: bool = default("grpo", "kl_importance_weighted")
    entropy_coefficient: float = default("grpo", "entropy_coefficient")
    vespo_k_pos: float = default("grpo", "vespo_k_pos")
    vespo_lambda_pos: float = default("grpo", "vespo_lambda_pos")
    vespo_k_neg: float = default("grpo", "vespo_k_neg")
    vespo_lambda_neg: float = default("grpo", "vespo_lambda_neg")
    beta: float = default("grpo", "beta")

    def _validate(self) -> None:
        super()._validate()
        self._check_float("epsilon_low", low=0.0, high=1.0, high_inclusive=False)
        self._check_float("epsilon_high", low=0.0)
        self._check_choice("metrics", METRICS_LEVELS)
        self._check_choice("loss_type", POLICY_LOSS_TYPES)
        if self.delta is not None and self.loss_type != "ppo_clip":
            self._fail("delta", f"None with loss_type={self.loss_type!r} (the two-sided clip is ppo_clip's)")
        self._check_float("delta", low=0.0, low_inclusive=False, optional=True)
        self._check_float("sapo_temperature_pos", low=0.0, low_inclusive=False)
        self._check_float("sapo_temperature_neg", low=0.0, low_inclusive=False)
        if (self.dro_beta is None) == (self.loss_type == "dro"):
            self._fail("dro_beta", "a value > 0 with loss_type='dro' (verl's policy_loss.dro_beta), None otherwise")
        self._check_float("dro_beta", low=0.0, low_inclusive=False, optional=True)
        self._check_float("clip_ratio_c", low=0.0, low_inclusive=False)
        self._check_float("clip_cov_ratio", low=0.0, low_inclusive=False)
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            self._check_float(name)
        if not self.clip_cov_lb < self.clip_cov_ub:
            self._fail("clip_cov_ub", f"a value > clip_cov_lb = {self.clip_cov_lb}")
        self._check_float("kl_cov_ratio", low=0.0, high=1.0, low_inclusive=False)
        for name in ("vespo_k_pos", "vespo_k_neg"):
            self._check_float(name)
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            self._check_float(name, low=0.0)
        self._check_choice("rollout_correction", ROLLOUT_CORRECTIONS)
        self._check_float("rollout_cap", low=0.0, low_inclusive=False)
        b = self.rollout_mask_bounds
        if b is not None:
            if (not isinstance(b, (tuple, list)) or len(b) != 2
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b) or not b[0] < b[1]):
                self._fail("rollout_mask_bounds", "None or (lo, hi) with lo < hi")
            if self.rollout_correction is None or not self.rollout_correction.endswith("_mask"):
                self._fail("rollout_mask_bounds", "None unless rollout_correction is a '*_mask' mode")
            object.__setattr__(self, "rollout_mask_bounds", (float(b[0]), float(b[1])))
        self._check_choice("kl_estimator", KL_ESTIMATORS)
        self._check_bool("kl_importance_weighted")
        self._check_float("entropy_coefficient")
        self._check_float("beta", low=0.0)


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelGRPOLossConfig(LanguageModelPolicyGradientLossConfig):
    """GRPO (type ``grpo``): per-token clipped importance ratio (docs/math.md).

    loss_normalization: how tokens are weighted and what divides the sum (the loss types of TRL / verl):
        "token"    w = mask,            D = num_labels_in_batch  (Fast-LLM, TRL dapo/bnpo, verl token-mean)
        "sequence" w = mask/|o_i|,      D = num_documents_in_batch (GRPO paper, TRL grpo, verl seq-mean-token-mean)
        "document" w = mask,            D = num_documents_in_batch (Fast-LLM's normalize_by_documents)
        "dr_grpo"  w = mask,            D = num_documents_in_batch · max_completion_length (Dr. GRPO)
    max_completion_length: the constant of "dr_grpo" (required there, unused otherwise).
    """

    type_name: ClassVar[str] = "grpo"

    loss_normalization: str = "token"
    max_completion_length: int | None = None

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("loss_normalization", GRPO_NORMALIZATIONS)
        if self.loss_type == "geo_mean":
            self._fail("loss_type", "not 'geo_mean' (the geometric mean of a sequence's ratios: type 'gspo')")
        m = self.max_completion_length
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            self._fail("max_completion_length", "a positive int or None")
        if self.loss_normalization == "dr_grpo" and m is None:
            self._fail("max_completion_length", "a positive int when loss_normalization='dr_grpo'")

    @property
    def loss_class(self) -> type[losses.LanguageModelGRPOLoss]:
        return losses.LanguageModelGRPOLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelGSPOLossConfig(LanguageModelPolicyGradientLossConfig):
    """GSPO (type ``gspo``): sequence-level geometric-mean ratio over packed documents (docs/math.md).

    weighting: "document" (each document weighs 1; Fast-LLM #517/#522) or "token" (each document weighs its
        labelled-token count; Fast-LLM #544). Either way D = num_documents_in_batch, as in Fast-LLM.
    token_advantages: GSPO-token (TRL's ``sequence_token``): each token's own advantage inside the sequence ratio.
    """

    type_name: ClassVar[str] = "gspo"

    weighting: str = default("gspo", "weighting")
    token_advantages: bool = default("gspo", "token_advantages")

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("weighting", GSPO_WEIGHTINGS)
        self._check_bool("token_advantages")
        if self.loss_type in TOKEN_LOG_PROB_LOSS_TYPES:
            self._fail("loss_type", "one of 'ppo_clip', 'cispo', 'sapo', 'vespo', 'geo_mean' (the sequence ratio's)")
        if self.loss_type == "geo_mean" and (self.token_advantages or self.rollout_correction is not None):
            self._fail("loss_type", "not 'geo_mean' with token_advantages or a rollout_correction (verl's takes the "
                       "mean advantage and no such correction)")

    @property
    def loss_class(self) -> type[losses.LanguageModelGSPOLoss]:
        return losses.LanguageModelGSPOLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelDistillationLossConfig(LanguageModelLossConfig):
    """Distillation against a teacher's logits (type ``distillation``, Fast-LLM's fields; docs/distillation_dpo.md).

    loss_type: "cross_entropy" (Fast-LLM's default: −Σ P log Q), "forward_kl", "reverse_kl" or "jsd".
    reference_model: the teacher's name; its logits are ``batch["reference_logits"][reference_model]``.
    temperature: T > 0 divides the teacher's logits. beta: JSD's β in [0, 1] (Liger-Kernel's generalised JSD).
    The divisor is ``num_labels_in_batch`` when the batch gives it, else the tokens of ``loss_mask`` (all tokens
    without one). Fast-LLM's older head fields are read as aliases: ``distillation_model`` (reference_model),
    ``distillation_loss_implementation`` (loss_type), ``teacher_softmax_temperature`` (temperature); its dropped
    ``implementation`` is ignored with a warning. Unlike Fast-LLM, logits_scale_factor s scales the student only:
    Fast-LLM's teacher softmax over s·z'/T is ``temperature = T / s`` here.
    """

    type_name: ClassVar[str] = "distillation"
    aliases: ClassVar[dict[str, str]] = {**LanguageModelLossConfig.aliases, "distillation_model": "reference_model",
                                         "distillation_loss_implementation": "loss_type",
                                         "teacher_softmax_temperature": "temperature"}
    retired: ClassVar[tuple[str, ...]] = ("implementation",)

    loss_type: str = "cross_entropy"
    reference_model: str = "teacher"
    temperature: float = default("distillation", "temperature")
    beta: float = default("distillation", "beta")

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("loss_type", DISTILL_KINDS)
        if not isinstance(self.reference_model, str) or not self.reference_model:
            self._fail("reference_model", "a non-empty string", TypeError)
        self._check_float("temperature", low=0.0, low_inclusive=False)
        self._check_float("beta", low=0.0, high=1.0)

    @property
    def loss_class(self) -> type[losses.LanguageModelDistillationLoss]:
        return losses.LanguageModelDistillationLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelTopkDistillationLossConfig(LanguageModelLossConfig):
    """Distillation from a teacher's top-K log-probs (type ``topk_distillation``; docs/distillation_dpo.md).

    tail: the teacher's remaining mass: "none" (verl's forward_kl_topk), "renormalize" or "tail".
    kind, beta: the divergence over the ids, "forward_kl", "reverse_kl" or "jsd" (β in [0, 1]), as distillation's.
    reference_model: the teacher's name, the key of its ids and log-probs in ``batch["reference_topk_ids"]`` and
    ``batch["reference_topk_log_probs"]`` ((..., K) each). Divisor: ``num_labels_in_batch``, else the labelled tokens.
    """

    type_name: ClassVar[str] = "topk_distillation"

    tail: str = default("topk_distillation", "tail")
    kind: str = default("topk_distillation", "kind")
    beta: float = default("topk_distillation", "beta")
    reference_model: str = "teacher"

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("tail", TOPK_TAILS)
        self._check_choice("kind", TOPK_KINDS)
        self._check_float("beta", low=0.0, high=1.0)
        if not isinstance(self.reference_model, str) or not self.reference_model:
            self._fail("reference_model", "a non-empty string", TypeError)

    @property
    def loss_class(self) -> type[losses.LanguageModelTopkDistillationLoss]:
        return losses.LanguageModelTopkDistillationLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelDPOLossConfig(LanguageModelLossConfig):
    """Direct Preference Optimization (type ``dpo``, Fast-LLM's fields; docs/distillation_dpo.md).

    beta: β > 0. reference_model: the reference policy's name: its per-pair log-probabilities come from
    ``batch["reference_logits"][reference_model]`` (or are given as ``reference_chosen_log_probs`` /
    ``reference_rejected_log_probs``). The batch gives the pairs as Fast-LLM's ``chosen_spans`` /
    ``rejected_spans``, or as ``document_index`` and ``dpo_pairs``.
    """

    type_name: ClassVar[str] = "dpo"

    beta: float = default("dpo", "beta")
    reference_model: str = "reference"

    def _validate(self) -> None:
        super()._validate()
        self._check_float("beta", low=0.0, low_inclusive=False)
        if not isinstance(self.reference_model, str) or not self.reference_model:
            self._fail("reference_model", "a non-empty string", TypeError)

    @property
    def loss_class(self) -> type[losses.LanguageModelDPOLoss]:
        return losses.LanguageModelDPOLoss


@dataclasses.dataclass(kw_only=True, frozen=True)
class LanguageModelFusedHeadLossConfig(LanguageModelLossConfig):
    """Several losses of one head (type ``fused_head``; Fast-LLM's monolithic loss): ``losses`` maps each loss's name to
    its config (or a dict with a ``type`` key). The module returns Σ weight·loss and every loss's metrics.
    Label cross-entropy (without its own z_loss_factor), z-loss, one policy term, token-normalised GRPO or plain
    GSPO (ppo_clip, k3 KL, per-token advantages; both with metrics "none"), and one distillation loss (not beside
    GSPO nor with a tp_group), sharing one logits_scale_factor run as one pass over the logits
    (rl_losses.fused_head_loss) when they use the extension; any other loss runs on its own, its gradient added.
    """

    type_name: ClassVar[str] = "fused_head"

    losses: dict = dataclasses.field(default_factory=dict)

    def _validate(self) -> None:
        super()._validate()
        if not isinstance(self.losses, dict):
            self._fail("losses", "a dict of name -> loss config", TypeError)
        if not self.losses:
            self._fail("losses", "a non-empty dict of name -> loss config")
        built = {}
        for name, cfg in self.losses.items():
            if not isinstance(name, str):
                self._fail("losses", "keyed by loss names (strings)", TypeError)
            cfg = cfg if isinstance(cfg, LanguageModelLossConfig) else LanguageModelLossConfig.from_dict(cfg)
            if isinstance(cfg, LanguageModelFusedHeadLossConfig):
                self._fail("losses", "free of nested 'fused_head' configs")
            built[name] = cfg
        object.__setattr__(self, "losses", built)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["losses"] = {name: cfg.to_dict() for name, cfg in self.losses.items()}
        return out

    @property
    def loss_class(self) -> type[fused_head.LanguageModelFusedHeadLoss]:
        return fused_head.LanguageModelFusedHeadLoss
