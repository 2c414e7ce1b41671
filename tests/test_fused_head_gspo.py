"""Tests of the fused head's GSPO term (docs/distillation_dpo.md): with label cross-entropy and the z-loss beside
it, the loss, each term and the gradient equal the weighted sum of the separate ops (rl_losses.gspo_loss,
cross_entropy, z_loss) and the float64 reference; documents split across rows, padding, masking; opcheck,
gradcheck, torch.compile, inplace_backward, given statistics, the ``head`` config, bad input."""
import itertools

import pytest
import torch

import rl_losses
import rl_losses.fused_head
from rl_losses import reference
from rl_losses.fused_head import fused_head_loss
from rl_losses.outputs import FusedHeadOutput

from conftest import assert_close
from helpers import (assert_compiled_matches_eager, assert_fake_rejects_like_real, assert_grad_close, gradcheck_fresh,
                     label_log_probs64, make_logits, make_target, param_id as _id, to64)
from helpers_head import (WEIGHTS, assert_terms_close, head_equals_separate_modules, head_equals_separate_ops,
                          other_term_kwargs)

_ops = torch.ops.rl_losses
OTHERS = ("label", "z_loss")
COMBINATIONS = [("gspo",) + c for r in (0, 1, 2) for c in itertools.combinations(OTHERS, r)]
NUM_DOCUMENTS = 6  # the last one holds no token: an empty document counts nowhere


def make_inputs(shape, vocab, dtype, device):
    """Packed documents in equal runs over the flattened tokens, so that they cross the rows of (B, T), the
    last tokens padding (document -1); labels, advantages, old and reference log-probs near the current ones."""
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=0.3)
    n = target.numel()
    doc = (torch.arange(n, device=device) * (NUM_DOCUMENTS - 1) // (n - 2)).clamp_max(NUM_DOCUMENTS - 2)
    doc[-2:] = -1
    lp = label_log_probs64(logits, target)
    advantages = torch.randn(shape, device=device)
    old = (lp + 0.3 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    ref = (lp + 0.2 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    return logits, target, doc.view(shape), advantages, old, ref


def head_kwargs(terms, inputs, options):
    _, target, doc, advantages, old, ref = inputs
    kwargs = other_term_kwargs(terms, target, options)
    counts = None
    if options.get("label_counts"):
        # Each token's whole-document count, given (a part of a document, as under sequence-data parallelism,
        # is the gspo op's own case: its gradient is that of the whole document's loss, not of the part's share).
        on = ((target >= 0) & (doc >= 0)).reshape(-1).float()
        per_doc = torch.zeros(NUM_DOCUMENTS, device=target.device).index_add_(0, doc.reshape(-1).clamp_min(0), on)
        counts = per_doc[doc.reshape(-1).clamp_min(0)].view(target.shape).long()
    kwargs.update(gspo_weight=WEIGHTS["gspo"], advantages=advantages,
                  old_log_probs=None if options.get("on_policy") else old, document_index=doc,
                  num_documents=NUM_DOCUMENTS, label_counts=counts, epsilon_low=0.15, epsilon_high=0.25,
                  beta=options.get("beta", 0.0), ref_log_probs=ref if options.get("beta") else None,
                  weighting=options.get("weighting", "document"), gspo_divisor=options.get("gspo_divisor"))
    return kwargs


def reference_of(logits, target, kwargs):
    z = logits.detach().double().requires_grad_()
    return z, reference.fused_head_loss(z, target, **{k: to64(v) for k, v in kwargs.items()})


OPTIONS = {
    "plain": {},
    "options": {"logits_scale_factor": 0.8, "label_smoothing": 0.1, "beta": 0.05, "z_loss_mask": True,
                "weighting": "token"},
    "counts_on_policy": {"label_counts": True, "on_policy": True, "beta": 0.1},
    "divisors": {"label_divisor": 7.0, "z_loss_divisor": 3.0, "gspo_divisor": 2.5},
}
TERM_NAMES = ("loss", "label_loss", "z_loss", "grpo_loss", "gspo_loss", "log_probs")


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769])
@pytest.mark.parametrize("terms", COMBINATIONS, ids="+".join)
def test_equals_the_sum_of_the_separate_ops(terms, vocab, dtype, option, device):
    inputs = make_inputs((3, 7), vocab, dtype, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(terms, inputs, OPTIONS[option])
    out, grad = head_equals_separate_ops(logits, target, kwargs, dtype, len(terms))
    z, ref = reference_of(logits, target, kwargs)
    (ref.loss * 1.3).backward()
    assert_terms_close(out, ref, TERM_NAMES, dtype)
    assert_grad_close(grad, z.grad, dtype)
    assert out.gspo_loss != 0 and out.grpo_loss is None  # weight 0: not computed
    if "z_loss" not in terms:  # unlabelled rows get no gradient (padding rows with a label get CE's only)
        assert torch.count_nonzero(grad[target < 0]) == 0


@pytest.mark.parametrize("z_mask", ["labels", "random", "none"])
def test_reads_only_the_rows_its_terms_use(z_mask, device):
    """A row with neither a label nor the z-loss is read by neither pass (NaN logits there change nothing, and
    its gradient is 0); the z-loss's unlabelled rows are read and get their gradient."""
    inputs = make_inputs((4, 9), 97, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "gspo"), inputs, {"z_loss_mask": z_mask == "random",
                                                              "label_smoothing": 0.1})
    if z_mask == "labels":
        kwargs["z_loss_mask"] = target >= 0
    z_rows = kwargs["z_loss_mask"] if kwargs["z_loss_mask"] is not None else torch.ones_like(target, dtype=bool)
    unused = (target < 0) & ~z_rows
    x = logits.masked_fill(unused[..., None], float("nan")).requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    (out.loss * 0.9).backward()
    z, ref = reference_of(logits, target, kwargs)
    (ref.loss * 0.9).backward()
    assert_terms_close(out, ref, TERM_NAMES, torch.float32)
    assert_grad_close(x.grad, z.grad, torch.float32)
    assert torch.count_nonzero(x.grad[unused]) == 0
    assert torch.count_nonzero(x.grad[(target < 0) & z_rows]) == ((target < 0) & z_rows).sum() * 97


def test_given_statistics_and_a_shard(device):
    """The tensor-parallel hooks: statistics given (as the all-reduce leaves them) give the same loss and the
    same gradient columns as the whole row, also for a shard of the columns (the document sums come from the
    statistics, so every shard computes the same ones)."""
    inputs = make_inputs((2, 8), 40, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "gspo"), inputs, OPTIONS["options"])
    stats = _ops.row_stats(logits, target, logits_scale_factor=kwargs["logits_scale_factor"],
                           smoothing=True).reshape(-1, 5)
    z, ref = reference_of(logits, target, kwargs)
    ref.loss.backward()
    for cols in (slice(0, 40), slice(0, 17), slice(17, 40)):
        x = logits[..., cols].clone().requires_grad_()
        out = _ops.fused_head(x, target, row_stats=stats, vocab_start=cols.start, vocab_size=40, **kwargs)
        out[0].backward()
        assert_terms_close(FusedHeadOutput._make(out), ref, TERM_NAMES, torch.float32, msg_prefix=f"{cols} ")
        assert_grad_close(x.grad, z.grad[..., cols], torch.float32, natural_scale=1 / target.numel())


def test_inplace_backward_matches(device):
    inputs = make_inputs((4, 5), 97, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "gspo"), inputs, OPTIONS["options"])
    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    out.loss.backward()
    y = logits.clone().requires_grad_()
    out_inplace = fused_head_loss(y * 1.0, target, inplace_backward=True, **kwargs)
    out_inplace.loss.backward()
    for a, b in zip(out_inplace, out):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(y.grad, x.grad)


def test_gradcheck(device):
    inputs = make_inputs((2, 4), 6, torch.float64, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "gspo"), inputs, OPTIONS["options"])
    kwargs = {k: to64(v) for k, v in kwargs.items()}
    gradcheck_fresh(lambda x: fused_head_loss(x, target, **kwargs).loss, logits.clone().requires_grad_())


def test_opcheck(device):
    inputs = make_inputs((2, 5), 11, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "gspo"), inputs, OPTIONS["options"])
    torch.library.opcheck(_ops.fused_head, (logits.clone().requires_grad_(), target), kwargs)
    stats = _ops.row_stats(logits, target, logits_scale_factor=kwargs["logits_scale_factor"],
                           smoothing=True).reshape(-1, 5)
    torch.library.opcheck(_ops.fused_head, (logits[..., 4:].clone().requires_grad_(), target),
                          dict(kwargs, row_stats=stats, vocab_start=4, vocab_size=11))


def test_compile_fullgraph(device):
    inputs = make_inputs((3, 4), 30, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "gspo"), inputs, OPTIONS["plain"])

    def fn(x, t):
        out = fused_head_loss(x, t, **kwargs)
        return out.loss, out.label_loss, out.gspo_loss

    assert_compiled_matches_eager(fn, logits, target, backend="aot_eager")


def _bad(device):
    logits = torch.randn(4, 10, device=device)
    target = torch.tensor([1, 2, -100, 3], device=device)
    t = dict(advantages=torch.zeros(4, device=device), old_log_probs=torch.zeros(4, device=device),
             document_index=torch.tensor([0, 0, 1, 1], device=device))
    return logits, target, t


BAD = [
    (dict(grpo_weight=1.0), "grpo_weight = 1 and gspo_weight = 2 are both > 0; the head fuses one policy term"),
    (dict(gspo_weight=-1.0), "gspo_weight must be finite and >= 0, got -1"),
    (dict(delta=1.5), "delta is the GRPO term's two-sided clip; the GSPO term has none, got delta = 1.5"),
    (dict(loss_weights=lambda d: torch.ones(4, device=d)),
     "loss_weights weigh the GRPO term's tokens; the GSPO term weighs them"),
    (dict(weighting="sequence"), "weighting must be 'document' or 'token', got 'sequence'"),
    (dict(document_index=None), "gspo_weight = 2 > 0 needs advantages and document_index"),
    (dict(advantages=None), "gspo_weight = 2 > 0 needs advantages and document_index"),
    (dict(beta=0.1), "beta = 0.1 > 0 needs ref_log_probs"),
    (dict(epsilon_low=1.0), r"epsilon_low must be in \[0, 1\)"),
    (dict(gspo_divisor=0.0), "divisor must be finite and > 0"),
    (dict(advantages=lambda d: torch.zeros(3, device=d)), r"advantages has shape \[3\] but target has shape \[4\]"),
    (dict(document_index=lambda d: torch.zeros(4, device=d)), "document_index must be an integer tensor"),
    (dict(label_counts=lambda d: torch.ones(5, device=d)), r"label_counts must have the target's shape \[4\]"),
    (dict(num_documents=-1), r"num_documents must be in \[0, "),
    (dict(num_documents=1), "document_index holds 1 but num_documents is 1"),
]


def _bad_kwargs(t, bad, device):
    # Tensors made on the device asked for (lambdas), so that FakeTensorMode sees its own.
    return {**t, "gspo_weight": 2.0, **{k: v(device) if callable(v) else v for k, v in bad.items()}}


@pytest.mark.parametrize("bad,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(bad, message):
    logits, target, t = _bad("cpu")
    with pytest.raises(RuntimeError, match=message):
        fused_head_loss(logits, target, **_bad_kwargs(t, bad, "cpu"))


@pytest.mark.parametrize("bad,message", BAD[:-1], ids=[str(i) for i in range(len(BAD) - 1)])
def test_fake_rejects_alike(bad, message):
    """The fake kernel (python/rl_losses/_checks_heads.py) refuses with the C++ message, on meta tensors and under
    FakeTensorMode (the last case, the document ids beyond num_documents, is the data's, which only the real
    kernel reads)."""
    def call(d):
        logits, target, t = _bad(d)
        return _ops.fused_head(logits, target, **_bad_kwargs(t, bad, d))

    assert_fake_rejects_like_real(call, message)


def test_fake_outputs_match():
    logits, target, t = _bad("cpu")
    real = _ops.fused_head(logits, target, gspo_weight=1.0, label_weight=1.0, **t)
    fake = _ops.fused_head(logits.to("meta"), target.to("meta"), gspo_weight=1.0, label_weight=1.0,
                                **{k: v.to("meta") for k, v in t.items()})
    assert len(real) == len(fake) == 7
    assert [r is None for r in real] == [f is None for f in fake] == [False, False, True, True, False, False, True]
    for r, f in zip(real, fake):
        assert r is None or (f.shape == r.shape and f.dtype == r.dtype), (f, r)


def _config_batch(device, extras):
    inputs = make_inputs((2, 9), 40, torch.float32, device)
    logits, target, doc, advantages, old, ref = inputs
    batch = {"labels": target, "advantages": advantages, "old_log_probabilities": old, "document_index": doc,
             "num_documents": NUM_DOCUMENTS, "ref_log_probs": ref,
             "loss_mask": torch.rand(target.shape, device=device) > 0.2}
    if extras:
        batch.update(label_counts=head_kwargs(("gspo",), inputs, {"label_counts": True})["label_counts"],
                     num_documents_in_batch=4)
    return logits, batch


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "counts_divisor"])
def test_head_config_fuses_gspo_and_matches_the_separate_modules(extras, device, monkeypatch):
    calls = []
    monkeypatch.setattr(rl_losses.fused_head, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    logits, batch = _config_batch(device, extras)
    losses = {"ce": {"type": "label", "weight": 0.5, "label_smoothing": 0.1}, "z": {"type": "z_loss", "weight": 0.1},
              "pg": {"type": "gspo", "weight": 2.0, "epsilon_high": 0.3, "beta": 0.05, "weighting": "token"}}
    head_equals_separate_modules(losses, logits, batch)
    assert len(calls) == 1 and calls[0]["gspo_weight"] == 2.0 and calls[0]["label_weight"] == 0.5
    assert calls[0]["z_loss_weight"] == 0.1 and not calls[0].get("grpo_weight")


def test_head_config_runs_what_it_cannot_fuse_on_its_own(device, monkeypatch):
    """One policy term per pass (the GRPO one here; GSPO then runs alone), and a GSPO loss with an option the head
    does not fuse (GSPO-token's token_advantages) runs alone too; the head's loss, gradient and metrics are the sums
    all the same."""
    calls = []
    monkeypatch.setattr(rl_losses.fused_head, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    logits, batch = _config_batch(device, False)
    losses = {"ce": {"type": "label"}, "pg": {"type": "grpo", "weight": 0.5}, "sq": {"type": "gspo", "weight": 2.0}}
    head_equals_separate_modules(losses, logits, batch)
    assert len(calls) == 1 and calls[0]["grpo_weight"] == 0.5 and not calls[0].get("gspo_weight")
    calls.clear()
    losses = {"ce": {"type": "label"}, "sq": {"type": "gspo", "token_advantages": True}}
    head_equals_separate_modules(losses, logits, batch)
    assert not calls
