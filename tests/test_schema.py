"""One home per option: every default of the wrappers, the distributed layer, the configs and the reference equals
its op's schema default (csrc/op_args.h); the named results are the schemas' results; the column layouts of
rl_losses._schema are the C++ ops' (each column checked against its definition)."""
import dataclasses
import inspect

import pytest
import torch

import rl_losses
from rl_losses import _schema, config, distributed, reference
from rl_losses._schema import DISTILL_STATS, GSPO_SUMS, ROW_STATS, column
from rl_losses.outputs import DistillationOutput, DpoOutput, FusedHeadOutput, PolicyLossOutput

WRAPPERS = {
    "cross_entropy": [rl_losses.cross_entropy, rl_losses.z_loss, rl_losses.linear_cross_entropy,
                      distributed.cross_entropy],
    "grpo": [rl_losses.grpo_loss, rl_losses.linear_grpo_loss, distributed.grpo_loss, rl_losses.policy_token_loss],
    "gspo": [rl_losses.gspo_loss, rl_losses.linear_gspo_loss, distributed.gspo_loss],
    "token_log_probs": [rl_losses.token_log_probs, rl_losses.linear_token_log_probs, distributed.token_log_probs],
    "distillation": [rl_losses.distillation_loss, rl_losses.linear_distillation_loss],
    "dpo": [rl_losses.dpo_loss],
    "fused_head": [rl_losses.fused_head_loss],
}
REFERENCES = {"cross_entropy": [reference.cross_entropy, reference.z_loss], "grpo": [reference.grpo_loss],
              "gspo": [reference.gspo_loss], "token_log_probs": [reference.token_log_probs],
              "distillation": [reference.distillation_loss], "dpo": [reference.dpo_loss],
              "fused_head": [reference.fused_head_loss]}
CONFIGS = {config.LanguageModelLabelEntropyLossConfig: "cross_entropy", config.LanguageModelGRPOLossConfig: "grpo",
           config.LanguageModelGSPOLossConfig: "gspo", config.LanguageModelDistillationLossConfig: "distillation",
           config.LanguageModelDPOLossConfig: "dpo"}
# The shard arguments of the distributed layer mean "even shards" at None, not the op's one-device 0 / -1.
SHARD = {"vocab_start", "vocab_size"}


def _defaults(fn):
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _assert_schema_defaults(op, defaults, owner):
    schema = _schema.defaults(op)
    shared = {name for name in defaults if name in schema and name not in SHARD}
    assert shared, owner
    for name in shared:
        assert defaults[name] == schema[name], f"{owner}: {name} = {defaults[name]!r}, the schema's {schema[name]!r}"


@pytest.mark.parametrize("op", sorted(WRAPPERS))
def test_wrapper_defaults_are_the_schemas(op):
    for fn in WRAPPERS[op]:
        _assert_schema_defaults(op, _defaults(fn), fn.__qualname__)


@pytest.mark.parametrize("op", sorted(REFERENCES))
def test_reference_defaults_are_the_schemas(op):
    for fn in REFERENCES[op]:
        _assert_schema_defaults(op, _defaults(fn), f"reference.{fn.__name__}")


def test_reference_policy_is_the_ops():
    """The reference's policy options (reference.Policy) are the policy ops' keyword options it does not take by
    name, with the schemas' defaults."""
    _assert_schema_defaults("grpo", reference.Policy._field_defaults, "reference.Policy")
    for op, fn in (("grpo", reference.grpo_loss), ("gspo", reference.gspo_loss)):
        named = set(inspect.signature(fn).parameters)
        options = set(_schema.keywords(op)) - {"inplace_backward", "row_stats", "vocab_start", "vocab_size",
                                                "document_sums"}
        assert options - named == set(reference.Policy._fields), op


@pytest.mark.parametrize("cls", list(CONFIGS), ids=lambda c: c.__name__)
def test_config_defaults_are_the_schemas(cls):
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    _assert_schema_defaults(CONFIGS[cls], defaults, cls.__name__)


def test_wrapper_options_are_the_ops():
    """Every keyword option of the policy wrappers is an argument of its op (the wrappers pass them on by name),
    and an unknown one is refused as Python refuses it."""
    names = set(inspect.signature(rl_losses.grpo_loss).parameters) - {"tp_group"}
    assert names <= set(_schema.arguments("grpo"))
    assert {"loss_type", "vespo_k_pos", "rollout_mask_bounds", "document_index"} <= names
    with pytest.raises(TypeError, match="grpo_loss\\(\\) got an unexpected keyword argument 'epsilon'"):
        rl_losses.grpo_loss(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), torch.zeros(3), None, epsilon=0.1)


def test_named_results_are_the_schemas():
    for op in ("grpo", "gspo", "linear_grpo", "linear_gspo"):
        assert set(_schema.results(op)) <= set(PolicyLossOutput._fields), op
    assert _schema.results("distillation") == DistillationOutput._fields
    assert _schema.results("dpo") == DpoOutput._fields
    assert _schema.results("fused_head") == FusedHeadOutput._fields
    assert set(rl_losses.PolicyTokenOutput._fields) <= set(_schema.results("policy_token_loss"))


def test_row_stats_columns():
    """ROW_STATS names row_stats' columns: each equals its definition in float64."""
    x = torch.randn(5, 9, dtype=torch.float64)
    t = torch.randint(0, 9, (5,))
    stats = torch.ops.rl_losses.row_stats(x, t, logits_scale_factor=0.7, entropy=True, smoothing=True)
    assert stats.shape == (5, len(ROW_STATS))
    s = 0.7 * x
    m = s.amax(-1)
    e = torch.exp(s - m[:, None])
    want = {"max": m, "sum_exp": e.sum(-1), "sum_exp_x": (e * s).sum(-1), "sum_x": s.sum(-1),
            "label_logit": s.gather(1, t[:, None]).squeeze(1)}
    for name, value in want.items():
        torch.testing.assert_close(stats[:, column(ROW_STATS, name)], value)


def test_distillation_stats_columns():
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    stats = torch.ops.rl_losses.distillation_stats(x, y)
    assert stats.shape == (4, len(DISTILL_STATS))
    ms, mt = x.amax(-1), y.amax(-1)
    es, et = torch.exp(x - ms[:, None]), torch.exp(y - mt[:, None])
    want = {"ms": ms, "ss": es.sum(-1), "mt": mt, "st": et.sum(-1), "wt": (et * (y - x)).sum(-1),
            "ws": (es * (x - y)).sum(-1), "hx": (et * x).sum(-1)}
    for name, value in want.items():
        torch.testing.assert_close(stats[:, column(DISTILL_STATS, name)], value)


def test_gspo_sums_columns():
    """GSPO_SUMS names gspo_document_sums' columns (w = 1 per token: label_counts of ones)."""
    lp, old = -torch.rand(6, dtype=torch.float64), -torch.rand(6, dtype=torch.float64)
    adv = torch.randn(6, dtype=torch.float64)
    t = torch.tensor([1, 2, -100, 3, 4, 5])
    doc = torch.tensor([0, 0, 0, 1, 1, -1])
    sums = torch.ops.rl_losses.gspo_document_sums(lp, t, adv, old, doc, torch.ones(6, dtype=torch.float64), 2)
    assert sums.shape == (2, len(GSPO_SUMS))
    m = ((t >= 0) & (doc >= 0)).double()
    per_doc = lambda v: torch.zeros(2, dtype=torch.float64).index_add_(0, doc.clamp_min(0), m * v)  # noqa: E731
    torch.testing.assert_close(sums[:, column(GSPO_SUMS, "log_ratio")], per_doc(lp - old))
    torch.testing.assert_close(sums[:, column(GSPO_SUMS, "advantage")], per_doc(adv))
    torch.testing.assert_close(sums[:, column(GSPO_SUMS, "count")], per_doc(torch.ones(6, dtype=torch.float64)))


@pytest.mark.parametrize("fn", [fn for fns in WRAPPERS.values() for fn in fns], ids=lambda fn: fn.__qualname__)
def test_documented_positional_parameters_are_the_functions_own(fn):
    """A wrapper's documented signature (set from the schema) lists the positional parameters its code takes, in
    its order: a tensor missing there is missing from help() too."""
    code = inspect.unwrap(fn).__code__
    own = list(code.co_varnames[:code.co_argcount])
    documented = [name for name, p in inspect.signature(fn).parameters.items()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert documented == own
