"""Inputs, float64 references and comparisons shared by the GSPO tests (test_gspo*.py).

Two float64 references: `loop_reference` below, which walks the documents one at a time in plain Python
(independent of any vectorised aggregation), and rl_losses.reference.gspo_loss; `check` compares the op with
both.
"""
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close, label_log_probs64, make_logits, make_target, to64

DOC_METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean")


# ---- the explicit per-document reference ------------------------------------------------------------------
def loop_reference(logits, target, advantages, old_log_probs, document_index, *, num_documents=None,
                   label_counts=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, weighting="document",
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

    def cap(r):  # the two-sided clip: min(r, δ) in the unclipped term
        return r if delta is None else torch.clamp(r, max=delta)

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
            f = (u * -torch.minimum(cap(tok_ratio) * adv_s, clipped * adv_s)).sum()
        else:
            f = -torch.minimum(cap(ratio) * mean_adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * mean_adv)
        if weighting == "token":
            f = f * n[0]
        doc_losses.append(f)
        r = ratio.detach()
        doc_ratios.append(r)
        doc_mean_lp.append((u * lp).sum().detach())
        # TRL's flags, on its coef_1 after the two-sided clip
        low.append(cap(r).item() < 1 - epsilon_low and mean_adv.item() < 0)
        high.append(cap(r).item() > 1 + epsilon_high and mean_adv.item() > 0)
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


def packed(device, shape=(8, 16)):
    """Seven documents of 4 to 30 tokens filling a (8, 16) batch, or five random ones for another shape."""
    n_tokens = shape[0] * shape[1]
    lengths = [11, 30, 4, 25, 19, 22, 17] if shape == (8, 16) else random_lengths(n_tokens, 5)
    return document_index_from_lengths(lengths, n_tokens, device).view(shape)


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


def run_loop_reference(logits, target, advantages, old_log_probs, document_index, upstream=1.0, **kwargs):
    x = logits.detach().double().requires_grad_()
    out = loop_reference(x, target, advantages, old_log_probs, document_index, **kwargs)
    (out["loss"] * upstream).backward()
    return out, x.grad


def run_vectorised_reference(logits, target, advantages, old_log_probs, document_index, upstream=1.0,
                             **kwargs):
    x = logits.detach().double().requires_grad_()
    out = reference.gspo_loss(x, target.long(), advantages.double(), old_log_probs.double(), document_index,
                              **{k: to64(v) for k, v in kwargs.items()})
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
