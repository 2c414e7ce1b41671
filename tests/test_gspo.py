"""Tests of the GSPO op over packed documents (docs/math.md): loss, gradient and metrics against two float64
references (helpers_gspo.py).

The convention is checked against TRL's importance_sampling_level="sequence", loss_type="grpo", written out in
the test. The autograd contract, opcheck, torch.compile, CPU == CUDA and bad input are in
test_gspo_contract.py.
"""
import pytest
import torch

import rl_losses

from conftest import assert_close
from helpers import DTYPES, assert_grad_close, label_log_probs64, make_logits, make_target, param_id as _id
from helpers_gspo import (DOC_METRICS, check, document_index_from_lengths, make_inputs, natural_scale,
                          packed as _packed, random_lengths, run_loop_reference, run_op)

_ops = torch.ops.rl_losses


# ---- Fast-LLM's grid --------------------------------------------------------------------------------------
OPTIONS = {
    "plain": ({}, 1.0),
    "scaled": ({"logits_scale_factor": 0.6}, 1.7),
    "epsilons_entropy": ({"epsilon_low": 0.1, "epsilon_high": 0.3, "compute_entropy": True}, -0.8),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("segments", [1, 4, 16])
@pytest.mark.parametrize("vocab", [256, 500])
def test_matches_references(vocab, segments, dtype, option, device):
    kwargs, upstream = OPTIONS[option]
    shape = (16, 8)  # the documents cross row boundaries
    doc = document_index_from_lengths(random_lengths(128, segments), 128, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, vocab, dtype, device, doc,
                                                  logits_scale_factor=kwargs.get("logits_scale_factor", 1.0))
    check(logits, target, advantages, old, doc, upstream, **kwargs)


@pytest.mark.parametrize("weighting", ["document", "token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_uneven_documents_across_rows(dtype, weighting, device):
    # Documents of 17, 31, 58 and 94 tokens packed into a (8, 25) batch: every one crosses a row boundary.
    shape = (8, 25)
    doc = document_index_from_lengths([17, 31, 58, 94], 200, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, 300, dtype, device, doc)
    check(logits, target, advantages, old, doc, 1.3, weighting=weighting, compute_entropy=True)


@pytest.mark.parametrize("weighting", ["document", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_padding_documents(dtype, weighting, device):
    """Negative document ids are padding: ignored by the loss, the metrics and the default divisor, even
    where their tokens carry valid labels."""
    shape = (6, 20)
    doc = document_index_from_lengths([13, 40, 7, 29], 120, device)  # tokens 89.. are padding (-1)
    doc[20:25] = -5  # padding inside the packed batch, with another negative id
    doc = doc.view(shape)
    logits, target, advantages, old = make_inputs(shape, 200, dtype, device, doc, masked=0.3)
    assert (target[doc < 0] >= 0).any()
    out, grad = check(logits, target, advantages, old, doc, 0.9, weighting=weighting)
    assert torch.count_nonzero(grad[doc < 0]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_document_without_labels(dtype, device):
    """A document whose tokens are all masked contributes nothing and is not counted in the default
    divisor (nor in the per-document metrics): never NaN."""
    shape = (4, 16)
    doc = document_index_from_lengths([10, 14, 20, 20], 64, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, 128, dtype, device, doc, masked=0.2)
    target[doc == 1] = -100
    target[doc == 3] = -1
    out, grad = check(logits, target, advantages, old, doc, 1.0, compute_entropy=True)
    assert torch.count_nonzero(grad[(doc == 1) | (doc == 3)]) == 0
    # Dropping the empty documents (renumbering the others) changes nothing.
    kept = torch.tensor([0, -1, 1, -1], device=device)[doc]
    renumbered, _ = run_op(logits, target, advantages, old, kept)
    assert_close(renumbered.loss.detach(), out.loss.detach(), dtype)


@pytest.mark.parametrize("weighting", ["document", "token"])
def test_all_masked(weighting, device):
    shape = (4, 16)
    doc = document_index_from_lengths([10, 14, 20, 20], 64, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, 64, torch.float32, device, doc, masked=1.0)
    out, grad = run_op(logits, target, advantages, old, doc, 1.5, weighting=weighting, compute_entropy=True)
    assert out.loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    for name in DOC_METRICS + ("entropy", "document_ratios"):
        assert torch.isfinite(getattr(out, name)).all(), name


def test_ten_thousand_documents(device):
    lengths = torch.randint(1, 6, (10_000,)).tolist()
    n_tokens = sum(lengths) + 7
    doc = document_index_from_lengths(lengths, n_tokens, device)
    logits, target, advantages, old = make_inputs((n_tokens,), 32, torch.float32, device, doc, masked=0.3)
    check(logits, target, advantages, old, doc, 1.2)


# ---- clip range -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_tiny_clip_range(dtype, device):
    """GSPO's recommended ε_l = 3e-4, ε_h = 4e-4, with document ratios placed on both sides of each bound
    (1e-4 to 8e-4 away): the clip decisions follow from the design alone."""
    eps_low, eps_high = 3e-4, 4e-4
    designed = [1 - 1e-3, 1 - 2e-4, 1 + 3e-4, 1 + 1.2e-3]
    lengths = [9, 12, 5, 14, 7, 11, 10, 8, 6, 13, 9, 16]
    n_docs, n_tokens = len(lengths), sum(lengths)
    doc = document_index_from_lengths(lengths, n_tokens, device)
    logits = make_logits((n_tokens,), 200, dtype, device)
    target = make_target((n_tokens,), 200, device, masked=0.3)
    starts = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)
    target[starts] = torch.randint(0, 200, (n_docs,), device=device)  # every document has a labelled token
    doc_ratio = torch.tensor(designed * (n_docs // len(designed)), dtype=torch.float64, device=device)
    doc_adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0], device=device).repeat(2) * 0.7
    advantages = doc_adv[doc]
    # old = lp - log(R_s) from the op's own detached log-probs: its mean log-ratio lands on log(R_s).
    with torch.no_grad():
        lp = rl_losses.gspo_loss(logits, target, advantages, torch.zeros_like(advantages), doc).log_probs
    old = (lp.double() - doc_ratio.log()[doc]).float()
    kwargs = dict(epsilon_low=eps_low, epsilon_high=eps_high)

    out, grad = check(logits, target, advantages, old, doc, 1.0, **kwargs)
    low = (doc_ratio < 1 - eps_low) & (doc_adv < 0)
    high = (doc_ratio > 1 + eps_high) & (doc_adv > 0)
    assert low.any() and high.any() and not (low | high).all()
    assert out.clipped_fraction_low.item() == pytest.approx(low.sum().item() / n_docs)
    assert out.clipped_fraction_high.item() == pytest.approx(high.sum().item() / n_docs)
    torch.testing.assert_close(out.document_ratios.double().cpu(), doc_ratio.cpu(), rtol=2e-5, atol=0)
    labelled = target >= 0
    has_grad = grad.double().abs().sum(-1) > 0
    assert torch.equal(has_grad, labelled & ~(low | high)[doc])


# ---- options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["document", "token", "token_advantages"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
def test_delta(case, dtype, device):
    """The two-sided clip δ of R_s (TRL's delta at importance_sampling_level="sequence"): seven documents with
    designed ratios on both sides of the clip range and of δ = 1.4, two of them above δ with Ā_s < 0 (the
    region where δ matters: loss −δ·Ā_s, no gradient), against both references; without δ they differ."""
    delta, designed = 1.4, torch.tensor([0.7, 0.95, 1.1, 1.25, 1.5, 2.0, 1.45], dtype=torch.float64)
    doc = _packed(device)
    logits, target, _, _ = make_inputs(doc.shape, 256, dtype, device, doc, masked=0.3)
    signs = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0], device=device)
    advantages = (signs * 0.8)[doc.clamp_min(0)] + 0.1 * torch.randn(doc.shape, device=device)
    # old = lp − log R_s + noise that sums to zero over each document: its mean log-ratio lands on log R_s.
    noise = 0.05 * torch.randn(doc.shape, dtype=torch.float64, device=device)
    lab = ((target >= 0) & (doc >= 0)).double()
    per_doc = torch.zeros(8, dtype=torch.float64, device=device).index_add_(0, doc.clamp_min(0).flatten(),
                                                                             (noise * lab).flatten())
    count = torch.zeros(8, dtype=torch.float64, device=device).index_add_(0, doc.clamp_min(0).flatten(), lab.flatten())
    noise = (noise - (per_doc / count.clamp_min(1))[doc.clamp_min(0)]) * lab
    old = (label_log_probs64(logits, target) - designed.to(device).log()[doc.clamp_min(0)] + noise).to(dtype)
    kwargs = {"document": {}, "token": {"weighting": "token"}, "token_advantages": {"token_advantages": True}}[case]
    out, grad = check(logits, target, advantages, old, doc, 1.2, delta=delta, **kwargs)
    assert_close(out.document_ratios[:7], designed.to(device), dtype, msg="designed ratios")
    capped = (doc == 4) | (doc == 5)
    labelled = target >= 0
    assert torch.count_nonzero(grad[capped & labelled]) == 0 and torch.count_nonzero(grad[~capped & labelled]) > 0
    plain, plain_grad = run_op(logits, target, advantages, old, doc, 1.2, **kwargs)
    assert (out.loss - plain.loss).abs() > 1e-3 and torch.count_nonzero(plain_grad[capped & labelled]) > 0
    for metric in DOC_METRICS:  # the metrics read the uncapped R_s
        assert_close(getattr(out, metric), getattr(plain, metric), dtype, msg=metric)


@pytest.mark.parametrize("weighting", ["document", "token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_token_advantages_with_constant_advantages_equals_gspo(dtype, weighting, device):
    doc = _packed(device)
    logits, target, _, old = make_inputs(doc.shape, 256, dtype, device, doc)
    advantages = torch.randn(int(doc.max()) + 1, device=device)[doc.clamp_min(0)]
    plain, plain_grad = run_op(logits, target, advantages, old, doc, 1.4, weighting=weighting)
    token, token_grad = run_op(logits, target, advantages, old, doc, 1.4, weighting=weighting,
                               token_advantages=True)
    assert_close(token.loss.detach(), plain.loss.detach(), dtype)
    for metric in DOC_METRICS:
        assert_close(getattr(token, metric), getattr(plain, metric), dtype, msg=metric)
    assert_grad_close(token_grad, plain_grad.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_token_advantages(dtype, device):
    doc = _packed(device)
    logits, target, advantages, old = make_inputs(doc.shape, 256, dtype, device, doc)
    check(logits, target, advantages, old, doc, 0.8, token_advantages=True)


def _whole_document_counts(target, doc, n_docs, dtype):
    """label_counts as a caller gives them: each token's N_t, the labelled tokens of its whole document."""
    labelled = ((target >= 0) & (doc >= 0)).to(dtype)
    return torch.zeros(n_docs, device=doc.device, dtype=dtype).index_add_(0, doc.flatten(), labelled.flatten())[doc]


@pytest.mark.parametrize("weighting", ["document", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_explicit_counts_and_divisor(dtype, weighting, device):
    """num_documents larger than needed (documents 7-9 are empty), label_counts given (each token's whole
    document's labelled count) and an explicit divisor."""
    doc = _packed(device)
    logits, target, advantages, old = make_inputs(doc.shape, 256, dtype, device, doc)
    label_counts = _whole_document_counts(target, doc, 10, torch.float32)
    check(logits, target, advantages, old, doc, 1.1, num_documents=10, label_counts=label_counts, divisor=12.5,
          weighting=weighting)


@pytest.mark.parametrize("weighting", ["document", "token"])
def test_split_documents_sum_to_the_whole(weighting, device):
    """Sequence-data parallelism (docs/distributed.md) at the op level: a batch cut in two "ranks" (rows 0-3
    and 4-7, documents crossing the cut), each given the whole documents' label_counts and the summed
    per-document sums (gspo_document_sums), gives losses that add up to the single-call loss, and gradients
    that are its two halves."""
    doc = _packed(device)
    n_docs = int(doc.max()) + 1
    logits, target, advantages, old = make_inputs(doc.shape, 256, torch.float64, device, doc)
    label_counts = _whole_document_counts(target, doc, n_docs, torch.float64)
    whole, whole_grad = run_loop_reference(logits, target, advantages, old, doc, 1.0, weighting=weighting)
    halves = [slice(0, 4), slice(4, 8)]
    with torch.no_grad():
        sums = sum(_ops.gspo_document_sums(label_log_probs64(logits[h], target[h]), target[h], advantages[h],
                                           old[h], doc[h], label_counts[h], n_docs) for h in halves)
    losses, grads = [], []
    for h in halves:
        x = logits[h].clone().requires_grad_()
        out = _ops.gspo(x, target[h], advantages[h], old[h], doc[h], num_documents=n_docs,
                        label_counts=label_counts[h], document_sums=sums, weighting=weighting)
        out[0].backward()
        losses.append(out[0].detach())
        grads.append(x.grad)
        assert_close(out[12][[r is not None for r in whole["document_ratios"]]],
                     torch.stack([r for r in whole["document_ratios"] if r is not None]), torch.float64)
    assert_close(losses[0] + losses[1], whole["loss"].detach(), torch.float64)
    assert_grad_close(torch.cat(grads), whole_grad, torch.float64)


def test_document_sums_without_label_counts(device):
    """document_sums given without label_counts: each token's count N_t is then its document's labelled
    tokens in this call. With the whole batch in one call, that is the plain loss."""
    doc = _packed(device)
    n_docs = int(doc.max()) + 1
    logits, target, advantages, old = make_inputs(doc.shape, 256, torch.float64, device, doc)
    label_counts = _whole_document_counts(target, doc, n_docs, torch.float64)
    # A strided view: label_counts are read at their strides.
    strided = torch.stack([label_counts, torch.full_like(label_counts, 1000.0)], -1)[..., 0]
    assert not strided.is_contiguous()
    whole, whole_grad = run_loop_reference(logits, target, advantages, old, doc, 1.0)
    with torch.no_grad():
        sums = _ops.gspo_document_sums(label_log_probs64(logits, target), target, advantages, old, doc, strided,
                                       n_docs)
    x = logits.clone().requires_grad_()
    out = _ops.gspo(x, target, advantages, old, doc, num_documents=n_docs, document_sums=sums)
    out[0].backward()
    assert_close(out[0].detach(), whole["loss"].detach(), torch.float64)
    assert_grad_close(x.grad, whole_grad, torch.float64)


def test_float64(device):
    doc = _packed(device)
    logits, target, advantages, old = make_inputs(doc.shape, 300, torch.float64, device, doc,
                                                  logits_scale_factor=1.2)
    check(logits, target, advantages, old, doc, 0.6, logits_scale_factor=1.2, compute_entropy=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_inplace_backward(dtype, device):
    doc = _packed(device)
    logits, target, advantages, old = make_inputs(doc.shape, 300, dtype, device, doc)
    leaf = logits.clone().requires_grad_()
    work = leaf.clone()  # a non-leaf copy that the op may overwrite
    out = rl_losses.gspo_loss(work, target, advantages, old, doc, inplace_backward=True)
    (out.loss * 1.9).backward()
    loop, loop_grad = run_loop_reference(logits, target, advantages, old, doc, 1.9)
    assert_close(out.loss.detach(), loop["loss"].detach(), dtype)
    assert_grad_close(leaf.grad, loop_grad, dtype, natural_scale=natural_scale(target, advantages, doc, 1.9))
    assert torch.equal(work.detach(), leaf.grad)  # the gradient lives in the logits' storage


# ---- convention of TRL ------------------------------------------------------------------------------------
def test_trl_sequence_level_grpo(device):
    """TRL's GRPOTrainer with importance_sampling_level="sequence" and loss_type="grpo": the log-ratio is
    averaged over each sequence's completion tokens, exp'd to one ratio per sequence, clipped against the
    sequence's advantage, and the per-token loss (constant along the sequence) is averaged per sequence and
    then over the B sequences. The op gives it with one document per sequence, weighting "document", divisor B
    (beta = 0)."""
    batch, length, vocab = 6, 12, 64
    eps_low, eps_high = 3e-4, 4e-4
    logits = make_logits((batch, length), vocab, torch.float64, device)
    completion_ids = torch.randint(0, vocab, (batch, length), device=device)
    lengths = torch.tensor([12, 9, 1, 5, 0, 11], device=device)  # sequence 4 is empty
    completion_mask = (torch.arange(length, device=device) < lengths[:, None]).double()
    advantages = torch.randn(batch, device=device, dtype=torch.float64)
    lp_now = label_log_probs64(logits, completion_ids)
    # Sequence log-ratios of 2e-3, 1e-4, -2e-3, -1e-4, (empty), 5e-3: on both sides of the clip range.
    shift = torch.tensor([2e-3, 1e-4, -2e-3, -1e-4, 0.0, 5e-3], device=device, dtype=torch.float64)
    old = lp_now - shift[:, None] + 1e-6 * torch.randn(batch, length, device=device, dtype=torch.float64)

    # The TRL formula, written out.
    x = logits.detach().clone().requires_grad_()
    per_token_logps = torch.log_softmax(x, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    log_ratio = per_token_logps - old
    log_importance_weights = (log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_importance_weights.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    trl_loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    trl_loss.backward()
    clipped = (coef_1.squeeze(-1) < 1 - eps_low) | (coef_1.squeeze(-1) > 1 + eps_high)
    assert clipped[lengths > 0].any() and not clipped[lengths > 0].all()  # both regimes are exercised

    target = torch.where(completion_mask > 0, completion_ids, -100)
    document_index = torch.arange(batch, device=device)[:, None].expand(batch, length).contiguous()
    y = logits.detach().clone().requires_grad_()
    out = rl_losses.gspo_loss(y, target, advantages[:, None].expand(batch, length).contiguous(), old,
                              document_index, epsilon_low=eps_low, epsilon_high=eps_high, weighting="document",
                              divisor=float(batch))
    out.loss.backward()
    assert_close(out.loss.detach(), trl_loss.detach(), torch.float64)
    assert_grad_close(y.grad, x.grad, torch.float64)
