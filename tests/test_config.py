"""rl_losses.config: dict / YAML round-trips, the type registry, building modules, and every validation error."""
import dataclasses

import pytest

from rl_losses import losses
from rl_losses.config import (
    LanguageModelDistillationLossConfig,
    LanguageModelGRPOLossConfig,
    LanguageModelGSPOLossConfig,
    LanguageModelLabelEntropyLossConfig,
    LanguageModelLossConfig,
    LanguageModelPolicyGradientLossConfig,
    LanguageModelZLossConfig,
)

# One non-default config of every type.
EXAMPLES = [
    {"type": "label", "weight": 0.5, "logits_scale_factor": 2.0, "use_cuda_kernel": False, "label_smoothing": 0.1,
     "z_loss_factor": 1e-4},
    {"type": "z_loss", "weight": 1e-3, "use_cuda_kernel": True},
    {"type": "grpo", "epsilon_low": 0.1, "epsilon_high": 0.28, "delta": 2.0, "beta": 0.04, "metrics": "basic",
     "loss_normalization": "dr_grpo", "max_completion_length": 512, "logits_scale_factor": 1 / 0.7},
    {"type": "gspo", "epsilon_low": 3e-4, "epsilon_high": 4e-4, "delta": 1.5, "weighting": "token",
     "token_advantages": True, "metrics": "with_entropy"},
]
CLASSES = {"label": LanguageModelLabelEntropyLossConfig, "z_loss": LanguageModelZLossConfig,
           "grpo": LanguageModelGRPOLossConfig, "gspo": LanguageModelGSPOLossConfig}
CLASSES_WITH_DISTILLATION = {**CLASSES, "distillation": LanguageModelDistillationLossConfig}
MODULES = {"label": losses.LanguageModelLabelEntropyLoss, "z_loss": losses.LanguageModelZLoss,
           "grpo": losses.LanguageModelGRPOLoss, "gspo": losses.LanguageModelGSPOLoss}


@pytest.mark.parametrize("d", EXAMPLES, ids=lambda d: d["type"])
def test_round_trip(d):
    cfg = LanguageModelLossConfig.from_dict(d)
    assert type(cfg) is CLASSES[d["type"]]
    out = cfg.to_dict()
    assert out["type"] == d["type"]
    assert {k: out[k] for k in d} == d  # every given value is kept
    assert LanguageModelLossConfig.from_dict(out) == cfg
    assert CLASSES[d["type"]].from_dict(out) == cfg  # also from the concrete class
    assert LanguageModelLossConfig.from_dict(cfg) == cfg  # a config is accepted too


@pytest.mark.parametrize("d", EXAMPLES, ids=lambda d: d["type"])
def test_defaults_round_trip(d):
    cfg = LanguageModelLossConfig.from_dict({"type": d["type"]})
    assert cfg == CLASSES[d["type"]]()
    assert cfg.weight == 1.0 and cfg.logits_scale_factor == 1.0 and cfg.use_cuda_kernel is None
    assert LanguageModelLossConfig.from_dict(cfg.to_dict()) == cfg


def test_documented_defaults():  # docs/api.md
    grpo = LanguageModelGRPOLossConfig()
    assert (grpo.epsilon_low, grpo.epsilon_high, grpo.delta, grpo.beta) == (0.2, 0.2, None, 0.0)
    assert grpo.loss_normalization == "token" and grpo.metrics == "none"
    gspo = LanguageModelGSPOLossConfig()
    assert (gspo.weighting, gspo.token_advantages, gspo.delta) == ("document", False, None)
    assert isinstance(gspo, LanguageModelPolicyGradientLossConfig)


def test_ints_become_floats():
    cfg = LanguageModelLossConfig.from_dict({"type": "grpo", "delta": 3, "weight": 2})
    assert cfg.delta == 3.0 and isinstance(cfg.delta, float) and isinstance(cfg.weight, float)


def test_yaml(tmp_path):
    yaml = pytest.importorskip("yaml")
    text = "type: gspo\nepsilon_low: 0.0003\nepsilon_high: 0.0004\nweighting: token\nuse_cuda_kernel: null\n"
    cfg = LanguageModelLossConfig.from_yaml(text)
    assert cfg == LanguageModelGSPOLossConfig(epsilon_low=3e-4, epsilon_high=4e-4, weighting="token")
    path = tmp_path / "loss.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert LanguageModelLossConfig.from_yaml(path) == cfg
    assert LanguageModelLossConfig.from_yaml(str(path)) == cfg


def test_use_triton_alias():
    assert LanguageModelLossConfig.from_dict({"type": "label", "use_triton": False}).use_cuda_kernel is False
    with pytest.raises(ValueError, match="either 'use_triton'.*or 'use_cuda_kernel'"):
        LanguageModelLossConfig.from_dict({"type": "label", "use_triton": False, "use_cuda_kernel": True})


FAST_LLM_DISTILLATION = {"distillation_model": ("reference_model", "big"),
                         "distillation_loss_implementation": ("loss_type", "reverse_kl"),
                         "teacher_softmax_temperature": ("temperature", 0.5), "use_triton": ("use_cuda_kernel", False)}


@pytest.mark.parametrize("alias", FAST_LLM_DISTILLATION)
def test_fast_llm_distillation_aliases(alias):
    """Fast-LLM's older head fields of distillation build the same config as the fields' own names, serialise
    under those names, and may not be given twice."""
    name, value = FAST_LLM_DISTILLATION[alias]
    cfg = LanguageModelLossConfig.from_dict({"type": "distillation", alias: value})
    assert cfg == LanguageModelDistillationLossConfig(**{name: value}) != LanguageModelDistillationLossConfig()
    assert alias not in cfg.to_dict() and cfg.to_dict()[name] == value
    with pytest.raises(ValueError, match=f"either '{alias}'.*or '{name}'"):
        LanguageModelLossConfig.from_dict({"type": "distillation", alias: value, name: value})
    if alias != "use_triton":  # the other types do not take distillation's names
        with pytest.raises(ValueError, match=f"unknown field.*'{alias}'"):
            LanguageModelLossConfig.from_dict({"type": "grpo", alias: value})


@pytest.mark.parametrize("type_name", ["label", "distillation"])
def test_fast_llm_retired_implementation(type_name):
    """Fast-LLM dropped ``implementation`` from these two types and ignores it with a warning: so does from_dict."""
    with pytest.warns(UserWarning, match="'implementation' is no longer supported"):
        cfg = LanguageModelLossConfig.from_dict({"type": type_name, "implementation": "fused", "weight": 0.5})
    assert cfg == CLASSES_WITH_DISTILLATION[type_name](weight=0.5)
    with pytest.raises(ValueError, match=r"unknown field.*'implementation'"):
        LanguageModelLossConfig.from_dict({"type": "z_loss", "implementation": "fused"})


@pytest.mark.parametrize("d", EXAMPLES, ids=lambda d: d["type"])
def test_get_loss(d):
    cfg = LanguageModelLossConfig.from_dict(d)
    module = cfg.get_loss()
    assert type(module) is MODULES[d["type"]]
    assert module.name == d["type"] and module.config is cfg
    assert cfg.get_loss(name="policy").name == "policy"
    assert "config=" in repr(module)


def test_frozen_and_replace_validates():
    cfg = LanguageModelGRPOLossConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 1.0
    assert dataclasses.replace(cfg, beta=0.5).beta == 0.5
    with pytest.raises(ValueError, match=r"LanguageModelGRPOLossConfig\.beta must be .*>= 0.0, got -1"):
        dataclasses.replace(cfg, beta=-1)


# (dict, exception, message): every validation path, with a message naming the class/field and the value.
ERRORS = [
    ({}, ValueError, r"from_dict: missing key 'type' \(one of \['distillation', 'dpo', 'fused_head', 'grpo', 'gspo', "
                     r"'label', 'topk_distillation', 'z_loss'\]\)"),
    ({"type": "ppo"}, ValueError, r"unknown type 'ppo'"),
    ({"type": "grpo", "epsilon": 0.2}, ValueError, r"GRPOLossConfig: unknown field\(s\) \['epsilon'\]"),
    ({"type": "label", "weight": -1.0}, ValueError,
     r"LanguageModelLabelEntropyLossConfig\.weight must be a finite number >= 0.0, got -1.0"),
    ({"type": "label", "weight": "1"}, TypeError, r"\.weight must be a number, got '1'"),
    ({"type": "z_loss", "weight": True}, TypeError, r"LanguageModelZLossConfig\.weight must be a number, got True"),
    ({"type": "z_loss", "weight": float("inf")}, ValueError, r"\.weight must be a finite number >= 0.0, got inf"),
    ({"type": "label", "logits_scale_factor": 0.0}, ValueError,
     r"\.logits_scale_factor must be a finite number > 0.0, got 0.0"),
    ({"type": "label", "logits_scale_factor": None}, TypeError, r"\.logits_scale_factor must be a number, got None"),
    ({"type": "label", "use_cuda_kernel": "yes"}, TypeError,
     r"\.use_cuda_kernel must be True, False or None, got 'yes'"),
    ({"type": "label", "loss_type": "forward_kl"}, ValueError,
     r"\.loss_type must be one of \['cross_entropy'\], got 'forward_kl'"),
    ({"type": "label", "label_smoothing": 1.0}, ValueError,
     r"\.label_smoothing must be a finite number >= 0.0 and < 1.0, got 1.0"),
    ({"type": "label", "z_loss_factor": -0.1}, ValueError, r"\.z_loss_factor must be a finite number >= 0.0, got -0.1"),
    ({"type": "grpo", "epsilon_low": 1.0}, ValueError,
     r"GRPOLossConfig\.epsilon_low must be a finite number >= 0.0 and < 1.0, got 1.0"),
    ({"type": "gspo", "epsilon_low": -0.1}, ValueError, r"GSPOLossConfig\.epsilon_low must be .*, got -0.1"),
    ({"type": "grpo", "epsilon_high": -0.2}, ValueError, r"\.epsilon_high must be a finite number >= 0.0, got -0.2"),
    ({"type": "grpo", "epsilon_high": float("nan")}, ValueError, r"\.epsilon_high must be .*, got nan"),
    ({"type": "grpo", "metrics": "all"}, ValueError,
     r"\.metrics must be one of \['none', 'basic', 'with_entropy'\], got 'all'"),
    ({"type": "grpo", "delta": 0.0}, ValueError, r"\.delta must be a finite number > 0.0, got 0.0"),
    ({"type": "grpo", "delta": "2"}, TypeError, r"\.delta must be a number or None, got '2'"),
    ({"type": "grpo", "beta": -0.01}, ValueError, r"\.beta must be a finite number >= 0.0, got -0.01"),
    ({"type": "grpo", "loss_normalization": "dapo"}, ValueError,
     r"\.loss_normalization must be one of \['token', 'sequence', 'document', 'dr_grpo'\], got 'dapo'"),
    ({"type": "grpo", "loss_normalization": "dr_grpo"}, ValueError,
     r"\.max_completion_length must be a positive int when loss_normalization='dr_grpo', got None"),
    ({"type": "grpo", "max_completion_length": 0}, ValueError,
     r"\.max_completion_length must be a positive int or None, got 0"),
    ({"type": "grpo", "max_completion_length": 1.5}, ValueError,
     r"\.max_completion_length must be a positive int or None, got 1.5"),
    ({"type": "gspo", "weighting": "sequence"}, ValueError,
     r"\.weighting must be one of \['document', 'token'\], got 'sequence'"),
    ({"type": "gspo", "token_advantages": 1}, TypeError, r"\.token_advantages must be True or False, got 1"),
    ({"type": "gspo", "delta": float("inf")}, ValueError,
     r"GSPOLossConfig\.delta must be a finite number > 0.0, got inf"),
    ({"type": "gspo", "delta": 2.0, "loss_type": "sapo"}, ValueError,
     r"GSPOLossConfig\.delta must be None with loss_type='sapo'"),
    ({"type": "gspo", "loss_normalization": "token"}, ValueError,
     r"GSPOLossConfig: unknown field\(s\) \['loss_normalization'\]"),
]


@pytest.mark.parametrize("d, error, match", ERRORS, ids=[str(e[0]) for e in ERRORS])
def test_validation_errors(d, error, match):
    with pytest.raises(error, match=match):
        LanguageModelLossConfig.from_dict(d)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match=r"LanguageModelGRPOLossConfig\.delta must be a finite number > 0.0, got -1"):
        LanguageModelGRPOLossConfig(epsilon_high=0.5, delta=-1.0)
    assert LanguageModelGRPOLossConfig(epsilon_high=0.5, delta=1.4).delta == 1.4  # TRL's delta <= 1 + ε_h too


@pytest.mark.parametrize("cls", [LanguageModelLossConfig, LanguageModelPolicyGradientLossConfig])
def test_abstract_configs(cls):
    with pytest.raises(TypeError, match=f"{cls.__name__} is abstract; use one of the types"):
        cls()


def test_from_dict_type_mismatch_and_bad_input():
    with pytest.raises(ValueError, match="type 'gspo' builds a LanguageModelGSPOLossConfig, which is not a "
                                         "LanguageModelGRPOLossConfig"):
        LanguageModelGRPOLossConfig.from_dict({"type": "gspo"})
    assert LanguageModelGRPOLossConfig.from_dict({"beta": 0.1}).beta == 0.1  # type implied by the class
    assert isinstance(LanguageModelPolicyGradientLossConfig.from_dict({"type": "gspo"}), LanguageModelGSPOLossConfig)
    with pytest.raises(TypeError, match="from_dict expects a dict, got list"):
        LanguageModelLossConfig.from_dict([("type", "grpo")])
