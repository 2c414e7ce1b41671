"""A masked position is never read into a result: NaN, +inf or -inf in every per-token input at the positions
that do not count (a negative label, document −1, loss_mask 0) leave each op's loss, metrics and gradient
equal to the float64 reference on the cleaned inputs (zeros there), the gradient of those positions an exact 0.
The logits rows of those positions are poisoned too wherever the op does not read them (every op but
token_log_probs, whose entropy is defined on every row; and the linear ops, whose hidden states enter the
weight's gradient GEMM)."""
import math

import pytest
import torch

import rl_losses
from rl_losses import reference

N, V = 40, 23
POISONS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _inputs(seed):
    """Clean float64 inputs: logits, labels (a quarter unlabelled), documents of 5 tokens (the last 4 tokens
    padding), per-token float inputs near the current log-probs, and the masked positions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < 0.25] = -100
    doc = torch.arange(N) // 5
    doc[-4:] = -1
    lp = reference.token_log_probs(logits, target)[0]
    x = dict(logits=logits, target=target, doc=doc,
             advantages=torch.randn(N, generator=g, dtype=torch.float64),
             old=lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64),
             ref=lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64),
             rollout=lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64),
             weights=torch.rand(N, generator=g, dtype=torch.float64),
             teacher=torch.randn(N, V, generator=g, dtype=torch.float64))
    masked = (target < 0) | (doc < 0)
    # each token's document's labelled tokens (whole documents: a smaller count is a document split over ranks)
    per_doc = torch.zeros(8, dtype=torch.float64).index_add(0, doc.clamp(min=0), (~masked).double())
    x["counts"] = per_doc[doc.clamp(min=0)]
    for name in ("advantages", "old", "ref", "rollout", "weights", "counts"):
        x[name] = x[name].masked_fill(masked, 0.0)
    x["logits"] = x["logits"].masked_fill(masked.unsqueeze(-1), 0.0)
    x["teacher"] = x["teacher"].masked_fill(masked.unsqueeze(-1), 0.0)
    x["target"] = target.masked_fill(masked, -100)
    return x, masked


def _grpo(x, op, **extra):
    options = dict(ref_log_probs=x["ref"], beta=0.1, loss_weights=x["weights"], label_counts=x["counts"],
                   rollout_log_probs=x["rollout"], rollout_correction="token_truncate", rollout_cap=1.2,
                   compute_entropy=True, delta=1.1)
    options.update(extra)
    return op(x["logits"], x["target"], x["advantages"], x["old"], **options)


def _gspo(x, op, **extra):
    options = dict(ref_log_probs=x["ref"], beta=0.1, label_counts=x["counts"], rollout_log_probs=x["rollout"],
                   rollout_correction="sequence_mask", rollout_mask_bounds=(0.5, 2.0), compute_entropy=True,
                   num_documents=8, kl_importance_weighted=True)
    options.update(extra)
    return op(x["logits"], x["target"], x["advantages"], x["old"], x["doc"], **options)


PAIRS = torch.arange(8).view(4, 2)  # DPO: documents 2k and 2k + 1 are pair k's chosen and rejected
REF = torch.tensor([[-9.0, -11.0, -10.0, -8.5], [-10.0, -9.5, -12.0, -9.0]], dtype=torch.float64)

# op name -> (the op's call, the reference's call, per-token inputs to poison; "logits" for the unread rows)
CASES = {
    "cross_entropy": (lambda x: rl_losses.cross_entropy(x["logits"], x["target"], label_smoothing=0.1),
                      lambda x: reference.cross_entropy(x["logits"], x["target"], label_smoothing=0.1),
                      ["logits"]),
    "grpo": (lambda x: _grpo(x, rl_losses.grpo_loss), lambda x: _grpo(x, reference.grpo_loss),
             ["logits", "advantages", "old", "ref", "rollout", "weights", "counts"]),
    "grpo-vespo-sequence": (
        lambda x: _grpo(x, rl_losses.grpo_loss, loss_type="vespo", delta=None, rollout_correction="sequence_mask",
                        rollout_mask_bounds=(0.5, 2.0), document_index=x["doc"], entropy_coefficient=0.05),
        lambda x: _grpo(x, reference.grpo_loss, loss_type="vespo", delta=None, rollout_correction="sequence_mask",
                        rollout_mask_bounds=(0.5, 2.0), document_index=x["doc"], entropy_coefficient=0.05),
        ["logits", "advantages", "old", "ref", "rollout", "weights", "counts"]),
    "gspo": (lambda x: _gspo(x, rl_losses.gspo_loss), lambda x: _gspo(x, reference.gspo_loss),
             ["logits", "advantages", "old", "ref", "rollout", "counts"]),
    "gspo-token-sapo": (
        lambda x: _gspo(x, rl_losses.gspo_loss, loss_type="sapo", token_advantages=True, weighting="token",
                        rollout_correction="token_mask"),
        lambda x: _gspo(x, reference.gspo_loss, loss_type="sapo", token_advantages=True, weighting="token",
                        rollout_correction="token_mask"),
        ["logits", "advantages", "old", "ref", "rollout", "counts"]),
    "fused_head": (
        lambda x: rl_losses.fused_head_loss(x["logits"], x["target"], label_weight=0.5, grpo_weight=1.5,
                                            advantages=x["advantages"], old_log_probs=x["old"],
                                            ref_log_probs=x["ref"], beta=0.1, loss_weights=x["weights"]),
        lambda x: reference.fused_head_loss(x["logits"], x["target"], label_weight=0.5, grpo_weight=1.5,
                                            advantages=x["advantages"], old_log_probs=x["old"],
                                            ref_log_probs=x["ref"], beta=0.1, loss_weights=x["weights"]),
        ["logits", "advantages", "old", "ref", "weights"]),
    "fused_head-gspo": (
        lambda x: rl_losses.fused_head_loss(x["logits"], x["target"], label_weight=0.5, gspo_weight=1.5,
                                            advantages=x["advantages"], old_log_probs=x["old"],
                                            document_index=x["doc"], label_counts=x["counts"], num_documents=8),
        lambda x: reference.fused_head_loss(x["logits"], x["target"], label_weight=0.5, gspo_weight=1.5,
                                            advantages=x["advantages"], old_log_probs=x["old"],
                                            document_index=x["doc"], label_counts=x["counts"], num_documents=8),
        ["logits", "advantages", "old", "counts"]),
    "dpo": (lambda x: rl_losses.dpo_loss(x["logits"], x["target"], x["doc"], PAIRS, REF[0], REF[1], beta=0.5),
            lambda x: reference.dpo_loss(x["logits"], x["target"], x["doc"], PAIRS, REF[0], REF[1], beta=0.5),
            ["logits"]),
    "distillation": (
        lambda x: rl_losses.distillation_loss(x["logits"], x["teacher"], kind="jsd", loss_mask=x["target"] >= 0),
        lambda x: reference.distillation_loss(x["logits"], x["teacher"], kind="jsd", loss_mask=x["target"] >= 0),
        ["logits", "teacher"]),
}


def _poisoned(x, masked, names, value):
    dirty = dict(x)
    for name in names:
        where = masked.unsqueeze(-1) if x[name].dim() == 2 else masked
        dirty[name] = x[name].masked_fill(where, value)
    return dirty


def _results(out):
    """The loss and every tensor metric of an op's result, by field name."""
    if isinstance(out, torch.Tensor):
        return {"loss": out}
    fields = out._asdict() if hasattr(out, "_asdict") else dict(enumerate(out))
    return {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("case", list(CASES))
def test_masked_positions_are_not_read(case, poison):
    op, ref_op, names = CASES[case]
    x, masked = _inputs(seed=len(case))
    dirty = _poisoned(x, masked, names, POISONS[poison])
    logits = dirty["logits"].clone().requires_grad_(True)
    out = _results(op(dict(dirty, logits=logits)))
    (grad,) = torch.autograd.grad(out["loss"], logits)
    clean = x["logits"].clone().requires_grad_(True)
    expected = _results(ref_op(dict(x, logits=clean)))
    (expected_grad,) = torch.autograd.grad(expected["loss"], clean)
    for name, value in expected.items():
        if name in out and out[name].shape == value.shape:
            torch.testing.assert_close(out[name].detach(), value.detach(), rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[masked]) == 0
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("poison", list(POISONS))
def test_policy_token_loss_mask(poison):
    """policy_token_loss reads no input where loss_mask is 0 (every output 0 there, the gradient too)."""
    x, masked = _inputs(seed=3)
    lp = reference.token_log_probs(x["logits"], x["target"])[0]
    names = ["lp", "old", "advantages", "ref", "rollout"]
    clean = dict(x, lp=lp)
    dirty = _poisoned(clean, masked, names, POISONS[poison])
    options = dict(beta=0.1, rollout_correction="token_mask", rollout_mask_bounds=(0.7, 1.4), delta=1.1)
    results = []
    for inputs, mask in ((dirty, ~masked), (clean, None)):
        log_probs = inputs["lp"].clone().requires_grad_(True)
        out = rl_losses.policy_token_loss(log_probs, inputs["old"], inputs["advantages"], ref_log_probs=inputs["ref"],
                                          rollout_log_probs=inputs["rollout"], loss_mask=mask, **options)
        (grad,) = torch.autograd.grad(out.loss.sum(), log_probs)
        results.append((out, grad))
    (out, grad), (full, full_grad) = results
    for name, value in out._asdict().items():
        assert torch.equal(value[masked], torch.zeros_like(value[masked])), name
        torch.testing.assert_close(value[~masked], getattr(full, name)[~masked], rtol=0, atol=0)
    assert torch.equal(grad[masked], torch.zeros_like(grad[masked]))
    torch.testing.assert_close(grad[~masked], full_grad[~masked], rtol=0, atol=0)
