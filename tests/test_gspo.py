"""Tests of the GSPO op over packed documents (docs/math.md): loss, gradient and metrics.

Two float64 references: `loop_reference` below, which walks the documents one at a time in plain Python
(independent of any vectorised aggregation), and rl_losses.reference.gspo_loss. The convention is checked
against TRL's importance_sampling_level="sequence", loss_type="grpo", written out in the test.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, label_log_probs64,
                     make_logits, make_target, param_id as _id, requires_cuda, POLICY_DEFAULTS)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ops = torch.ops.rl_losses
DOC_METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean")


# ---- the explicit per-document reference ------------------------------------------------------------------
def loop_reference(logits, target, advantages, old_log_probs, document_index, *, num_documents=None,
                   label_counts=None, epsilon_low=0.2, epsilon_high=0.2, weighting="document",
                   token_advantages=False, divisor=None, logits_scale_factor=1.0, compute_entropy=False):
    """GSPO (docs/math.md) in float64, one document at a time. `logits` may require grad (the loss is differentiable
    through the per-token log-probs).

    Returns a dict with the loss, the metrics, the per-token log-probs and the per-document
    ratios (None for documents without a labelled token, where R_s is left free).
    """
    vocab = logits.shape[-1]
    logp = torch.log_softmax(logits.reshape(-1, vocab).double() * logits_scale_factor, dim=-1)
    labels = target.reshape(-1).tolist()
    docs = document_index.reshape(-1).tolist()
    adv = advantages.reshape(-1).double()
    old = old_log_probs.reshape(-1).double()
    token_lp = logp.gather(1, target.reshape(-1, 1).long().clamp_min(0)).squeeze(1)
    if num_documents is None:
        num_documents = max(docs) + 1 if docs else 0
    tokens_of = [[] for _ in range(num_documents)]
    for t, d in enumerate(docs):
        if d >= 0 and labels[t] >= 0:
            tokens_of[d].append(t)

    # Each document's labelled tokens, gathered once and split per document (cheap to differentiate).
    order = torch.tensor([t for tokens in tokens_of for t in tokens], dtype=torch.long, device=logp.device)
    sizes = [len(tokens) for tokens in tokens_of]
    counts = (label_counts.reshape(-1).double() if label_counts is not None
              else torch.tensor([float(len(tokens_of[d])) if d >= 0 else 0.0 for d in docs], device=logp.device,
                                dtype=torch.float64))
    per_doc = zip(*(v[order].split(sizes) for v in (token_lp, old, adv, counts)))

    doc_losses, doc_ratios, doc_mean_lp, low, high, kl = [], [], [], [], [], []
    for s, (lp, old_s, adv_s, n) in enumerate(per_doc):
        if not sizes[s]:  # a document without a labelled token contributes nothing
            doc_ratios.append(None)
            continue
        u = 1.0 / n.clamp_min(1.0)
        log_ratio = (u * (lp - old_s)).sum()
        ratio = log_ratio.exp()
        mean_adv = (u * adv_s).sum()
        if token_advantages:
            # Each token's own advantage in the sequence ratio; its gradient flows through its own lp only.
            tok_ratio = (lp - lp.detach()).exp() * ratio.detach()
            clipped = tok_ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
            f = (u * -torch.minimum(tok_ratio * adv_s, clipped * adv_s)).sum()
        else:
            f = -torch.minimum(ratio * mean_adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * mean_adv)
        if weighting == "token":
            f = f * n[0]
        doc_losses.append(f)
        r = ratio.detach()
        doc_ratios.append(r)
        doc_mean_lp.append((u * lp).sum().detach())
        low.append(r.item() < 1 - epsilon_low and mean_adv.item() < 0)
        high.append(r.item() > 1 + epsilon_high and mean_adv.item() > 0)
        kl.append((-log_ratio).exp().detach() + log_ratio.detach() - 1)

    n_docs = len(doc_losses)
    if divisor is None:
        divisor = max(n_docs, 1)
    loss = torch.stack(doc_losses).sum() / divisor if doc_losses else logp.sum() * 0.0
    denominator = max(n_docs, 1)
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    out = {
        "loss": loss,
        "new_logprobs": sum(doc_mean_lp, zero) / denominator,
        "clipped_fraction_low": zero + sum(low) / denominator,
        "clipped_fraction_high": zero + sum(high) / denominator,
        "kl_old": sum(kl, zero) / denominator,
        "ratio_mean": sum((r for r in doc_ratios if r is not None), zero) / denominator,
        "document_ratios": doc_ratios,
        "log_probs": label_log_probs64(logits, target, logits_scale_factor),
    }
    if compute_entropy:
        counted = [t for t, (y, d) in enumerate(zip(labels, docs)) if y >= 0 and d >= 0]
        logp_counted = logp.detach()[counted]
        entropy = -(logp_counted.exp() * logp_counted).sum(-1)
        out["entropy"] = entropy.sum() / max(len(counted), 1)
    return out


# ---- inputs -----------------------------------------------------------------------------------------------
def document_index_from_lengths(lengths, n_tokens, device, *, padding=-1):
    """Documents of the given lengths packed one after another; the remaining tokens are padding."""
    index = torch.full((n_tokens,), padding, dtype=torch.long)
    start = 0
    for d, length in enumerate(lengths):
        index[start:start + length] = d
        start += length
    assert start <= n_tokens
    return index.to(device)


def random_lengths(n_tokens, n_documents):
    """n_documents positive lengths summing to n_tokens, cut at random points."""
    cuts = torch.randperm(n_tokens - 1)[:n_documents - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [n_tokens]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def make_inputs(shape, vocab, dtype, device, document_index, *, masked=0.5, logits_scale_factor=1.0,
                doc_spread=0.3, token_spread=0.1):
    """Logits, labels, per-token advantages, and old log-probs whose per-document mean log-ratio is
    N(0, doc_spread²): the document ratios fall on both sides of the default clip range."""
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=masked)
    lp = label_log_probs64(logits, target, logits_scale_factor)
    n_docs = int(document_index.max()) + 1 if document_index.numel() else 0
    offset = doc_spread * torch.randn(n_docs + 1, device=device, dtype=torch.float64)
    doc = document_index.reshape(shape)
    old = lp - offset[doc.clamp_min(0)] + token_spread * torch.randn(shape, device=device, dtype=torch.float64)
    advantages = torch.randn(shape, device=device)
    return logits, target, advantages, old.float()


# ---- runs and comparisons ---------------------------------------------------------------------------------
def run_op(logits, target, advantages, old_log_probs, document_index, upstream=1.0, **kwargs):
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old_log_probs, document_index, **kwargs)
    (out.loss * upstream).backward()
    return out, x.grad


def _to64(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def run_loop_reference(logits, target, advantages, old_log_probs, document_index, upstream=1.0, **kwargs):
    x = logits.detach().double().requires_grad_()
    out = loop_reference(x, target, advantages, old_log_probs, document_index, **kwargs)
    (out["loss"] * upstream).backward()
    return out, x.grad


def run_vectorised_reference(logits, target, advantages, old_log_probs, document_index, upstream=1.0,
                             **kwargs):
    x = logits.detach().double().requires_grad_()
    out = reference.gspo_loss(x, target.long(), advantages.double(), old_log_probs.double(), document_index,
                              **{k: _to64(v) for k, v in kwargs.items()})
    (out.loss * upstream).backward()
    return out, x.grad


def natural_scale(target, advantages, document_index, upstream, *, logits_scale_factor=1.0, divisor=None,
                  **_):
    """s·|g|·max|A|/D, D the number of documents with a labelled token: the size of a gradient row."""
    labelled_docs = document_index[(target >= 0) & (document_index >= 0)].unique().numel()
    if divisor is None:
        divisor = max(labelled_docs, 1)
    size = advantages.abs().max().item() if advantages.numel() else 0.0
    return logits_scale_factor * abs(upstream) * size / divisor


def check(logits, target, advantages, old_log_probs, document_index, upstream=1.0, **kwargs):
    """The op against both float64 references: loss, gradient, and every metric."""
    dtype = logits.dtype
    out, grad = run_op(logits, target, advantages, old_log_probs, document_index, upstream, **kwargs)
    loop, loop_grad = run_loop_reference(logits, target, advantages, old_log_probs, document_index, upstream,
                                         **kwargs)
    vec, vec_grad = run_vectorised_reference(logits, target, advantages, old_log_probs, document_index,
                                             upstream, **kwargs)
    scale = natural_scale(target, advantages, document_index, upstream, **kwargs)
    for name, expected, expected_grad in (("loop", loop, loop_grad), ("vectorised", vec, vec_grad)):
        get = expected.get if isinstance(expected, dict) else lambda key: getattr(expected, key)
        assert_close(out.loss.detach(), get("loss").detach(), dtype, msg=f"loss vs {name} reference")
        for metric in DOC_METRICS:
            assert_close(getattr(out, metric), get(metric), dtype, msg=f"{metric} vs {name} reference")
        assert_grad_close(grad, expected_grad, dtype, natural_scale=scale)
    # Per-token log-probs (0 where unlabelled), compared where the token belongs to a document.
    counted = document_index.reshape(target.shape) >= 0
    assert out.log_probs.shape == target.shape
    assert_close(out.log_probs[counted], loop["log_probs"][counted], dtype, msg="log_probs")
    assert torch.equal(out.log_probs[target < 0], torch.zeros_like(out.log_probs[target < 0]))
    # Per-document ratios where the document has a labelled token; finite everywhere.
    ratios = out.document_ratios
    assert ratios is not None and ratios.dim() == 1 and torch.isfinite(ratios).all()
    n_docs = kwargs.get("num_documents") or (int(document_index.max()) + 1)
    assert ratios.shape == (n_docs,)
    for s, r in enumerate(loop["document_ratios"]):
        if r is not None:
            assert_close(ratios[s], r, dtype, msg=f"document_ratios[{s}]")
    if kwargs.get("compute_entropy"):
        assert_close(out.entropy, loop["entropy"], dtype, msg="entropy")
    else:
        assert out.entropy is None
    # Padding and unlabelled tokens get an exactly zero gradient.
    ignored = (target < 0) | ~counted
    assert torch.count_nonzero(grad[ignored]) == 0
    return out, grad


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
def _packed(device, shape=(8, 16)):
    """Seven documents of 4 to 30 tokens filling a (8, 16) batch, or five random ones for another shape."""
    n_tokens = shape[0] * shape[1]
    lengths = [11, 30, 4, 25, 19, 22, 17] if shape == (8, 16) else random_lengths(n_tokens, 5)
    return document_index_from_lengths(lengths, n_tokens, device).view(shape)


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


# ---- autograd contract, gradcheck, opcheck, compile -------------------------------------------------------
def test_second_backward_raises(device):
    doc = _packed(device, (4, 16))
    logits, target, advantages, old = make_inputs(doc.shape, 20, torch.float32, device, doc)
    x = logits.clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old, doc)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


@pytest.mark.parametrize("case", ["document", "token", "token_advantages"])
def test_gradcheck(case, device):
    # Three documents of a (2, 4) batch (the second crosses the row boundary) whose ratios sit well away from
    # the clip bounds [0.8, 1.2] (1.49, 1.0, 0.61), with advantages of the sign that keeps the gradient on.
    shape, vocab = (2, 4), 5
    logits = torch.randn(*shape, vocab, dtype=torch.float64, device=device)
    target = torch.tensor([[1, 3, -100, 0], [2, 4, 1, 0]], device=device)
    doc = torch.tensor([[0, 0, 1, 1], [1, 2, 2, -1]], device=device)
    lp = label_log_probs64(logits, target)
    shift = torch.tensor([[0.4, 0.4, 0.0, 0.0], [0.0, -0.5, -0.5, 0.0]], dtype=torch.float64, device=device)
    old = lp - shift + torch.tensor([[0.1, -0.1, 0.0, 0.02], [-0.02, 0.05, -0.05, 0.0]], dtype=torch.float64,
                                    device=device)
    # Constant within each document, so that GSPO-token's gradient (through each token's own log-prob only)
    # is the derivative of its loss value too, as gradcheck requires.
    advantages = torch.tensor([[-0.8, -0.8, 0.5, 0.5], [0.5, 0.9, 0.9, 2.0]], dtype=torch.float64,
                              device=device)
    kwargs = {"document": {}, "token": {"weighting": "token"}, "token_advantages": {"token_advantages": True}}[case]
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.gspo_loss(t, target, advantages, old, doc, num_documents=3,
                                                         **kwargs).loss, x)


def _opcheck_cases(device):
    doc = document_index_from_lengths([3, 5, 4], 12, device).view(6, 2)
    logits, target, advantages, old = make_inputs((6, 2), 11, torch.float32, device, doc, masked=0.3)
    leaf = logits.clone().requires_grad_()
    counts = torch.full_like(advantages, 4.0)
    # _gspo_forward(logits, target, advantages, old, document_index, num_documents, label_counts, ε_l, ε_h,
    #               weighting, token_advantages, divisor, s, compute_entropy, row_stats, document_sums,
    #               vocab_start, vocab_size, ref_log_probs, beta, <the policy family's options>[, compute_grad])
    positional = (3, None, 0.2, 0.25, "document", False, None, 1.1, True, None, None, 0, -1, None, 0.0,
                  *POLICY_DEFAULTS)
    return {
        "gspo": (_ops.gspo.default, (leaf, target, advantages, old, doc), dict(num_documents=3)),
        "gspo_options": (_ops.gspo.default, (leaf, target, advantages, old, doc),
                         dict(num_documents=4, label_counts=counts, weighting="token", token_advantages=True,
                              divisor=2.0, logits_scale_factor=0.9, compute_entropy=True)),
        "gspo_inferred_num_documents": (_ops.gspo.default, (leaf, target, advantages, old, doc), {}),
        "gspo_no_grad": (_ops.gspo.default, (logits, target, advantages, old, doc), dict(num_documents=3)),
        # Without autograd: inplace_backward refuses the leaves that opcheck's autograd tests need.
        "gspo_inplace": (_ops.gspo.default, (logits.clone(), target, advantages, old, doc),
                         dict(num_documents=3, inplace_backward=True)),
        "_gspo_forward": (_ops._gspo_forward.default,
                          (logits, target, advantages, old, doc) + positional + (True,), {}),
        "_gspo_forward_no_grad": (_ops._gspo_forward.default,
                                  (logits, target, advantages, old, doc) + positional + (False,), {}),
        "_gspo_forward_inplace": (_ops._gspo_forward_inplace.default,
                                  (logits.clone(), target, advantages, old, doc) + positional, {}),
        "gspo_document_sums": (_ops.gspo_document_sums.default,
                               (label_log_probs64(logits, target).float(), target, advantages, old, doc, counts, 3),
                               {}),
    }


@pytest.mark.parametrize("case", ["gspo", "gspo_options", "gspo_inferred_num_documents", "gspo_no_grad",
                                  "gspo_inplace", "_gspo_forward", "_gspo_forward_no_grad",
                                  "_gspo_forward_inplace", "gspo_document_sums"])
def test_opcheck(case, device):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend, device):
    doc = _packed(device)
    n_docs = int(doc.max()) + 1

    def fn(x, target, advantages, old, document_index):
        out = rl_losses.gspo_loss(x * 2, target, advantages, old, document_index, num_documents=n_docs,
                                  logits_scale_factor=0.5, weighting="token")
        return out.loss, out.kl_old, out.document_ratios

    logits, target, advantages, old = make_inputs(doc.shape, 129, torch.float32, device, doc)
    assert_compiled_matches_eager(fn, logits, target, advantages, old, doc, backend=backend)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_cpu_matches_cuda(dtype):
    doc = _packed("cpu")
    logits, target, advantages, old = make_inputs(doc.shape, 1000, dtype, "cpu", doc)
    kwargs = dict(weighting="token", compute_entropy=True, logits_scale_factor=1.1)
    cpu, cpu_grad = run_op(logits, target, advantages, old, doc, 1.3, **kwargs)
    gpu, gpu_grad = run_op(logits.cuda(), target.cuda(), advantages.cuda(), old.cuda(), doc.cuda(), 1.3, **kwargs)
    for metric in ("loss",) + DOC_METRICS + ("entropy", "document_ratios", "log_probs"):
        assert_close(getattr(gpu, metric).detach(), getattr(cpu, metric).detach(), dtype, msg=metric)
    assert_grad_close(gpu_grad.cpu(), cpu_grad.cpu(), dtype)


# ---- bad input --------------------------------------------------------------------------------------------
def _bad_call(case, device):
    """(callable, regex the message must match: the argument and, where there is one, the bad value)."""
    doc = document_index_from_lengths([5, 7], 12, device).view(4, 3)
    logits, target, advantages, old = make_inputs((4, 3), 7, torch.float32, device, doc, masked=0.0)
    gspo = rl_losses.gspo_loss
    cases = {
        "doc_id_too_large": (lambda: gspo(logits, target, advantages, old, doc, num_documents=1), "num_documents"),
        "doc_index_shape": (lambda: gspo(logits, target, advantages, old, doc[:, :2]), "document_index has shape"),
        "doc_index_float": (lambda: gspo(logits, target, advantages, old, doc.float()),
                            "document_index must be an integer tensor"),
        "weighting": (lambda: gspo(logits, target, advantages, old, doc, weighting="sequence"),
                      "weighting.*sequence"),
        "epsilon_low_negative": (lambda: gspo(logits, target, advantages, old, doc, epsilon_low=-0.1),
                                 r"epsilon_low.*-0\.1"),
        "epsilon_low_one": (lambda: gspo(logits, target, advantages, old, doc, epsilon_low=1.0), "epsilon_low"),
        "epsilon_high_negative": (lambda: gspo(logits, target, advantages, old, doc, epsilon_high=-0.1),
                                  r"epsilon_high.*-0\.1"),
        "advantages_shape": (lambda: gspo(logits, target, advantages[:, :2], old, doc), "advantages has shape"),
        "old_log_probs_shape": (lambda: gspo(logits, target, advantages, old[:, :2], doc),
                                "old_log_probs has shape"),
        "label_counts_shape": (lambda: gspo(logits, target, advantages, old, doc, label_counts=old[:, :2]),
                               r"label_counts.*shape"),
        "advantages_int": (lambda: gspo(logits, target, advantages.long(), old, doc),
                           "advantages must be a floating-point tensor"),
        "target_shape": (lambda: gspo(logits, target[:, :2], advantages, old, doc), "target has shape"),
        "scale_negative": (lambda: gspo(logits, target, advantages, old, doc, logits_scale_factor=-1.0),
                           "logits_scale_factor must be finite and > 0, got -1"),
        "divisor_zero": (lambda: gspo(logits, target, advantages, old, doc, divisor=0.0),
                         "divisor must be finite and > 0, got 0"),
        "num_documents_negative": (lambda: gspo(logits, target, advantages, old, doc, num_documents=-1),
                                   "num_documents"),
    }
    return cases[case]


BAD_CASES = ["doc_id_too_large", "doc_index_shape", "doc_index_float", "weighting", "epsilon_low_negative",
             "epsilon_low_one", "epsilon_high_negative", "advantages_shape", "old_log_probs_shape",
             "label_counts_shape", "advantages_int", "target_shape", "scale_negative", "divisor_zero",
             "num_documents_negative"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(case, device):
    if case == "doc_id_too_large" and device != "cpu":
        pytest.skip("document ids are range-checked on the CPU (on CUDA: RL_LOSSES_CHECK_INPUTS, tested below)")
    call, message = _bad_call(case, device)
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


@requires_cuda
def test_document_id_out_of_range_cuda_opt_in_check(monkeypatch):
    monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    call, _ = _bad_call("doc_id_too_large", "cuda")
    with pytest.raises(ValueError, match="document_index holds 1 but num_documents is 1"):
        call()


def test_label_out_of_range_cpu():
    doc = document_index_from_lengths([2, 2], 4, "cpu")
    logits, target, advantages, old = make_inputs((4,), 7, torch.float32, "cpu", doc, masked=0.0)
    target[1] = 9
    with pytest.raises(RuntimeError, match="label 9 .*out of range for vocab_size 7"):
        rl_losses.gspo_loss(logits.requires_grad_(), target, advantages, old, doc)
