"""kept_token_log_probs (docs/consistency.md): log-probs and entropies renormalised over the token ids an engine
kept, against a float64 reference written here (a V-wide mask and log_softmax), and against the ops' own sampler
filters (token_log_probs with top_k / top_p / min_p) fed the kept set those filters make; padding, a label
outside the listed ids, unlabelled positions; bad inputs."""
import pytest
import torch

import rl_losses
from rl_losses import reference_sampler

from conftest import assert_close
from helpers import param_id as _id
from helpers import assert_compiled_matches_eager, assert_grad_close


def ids_of(mask: torch.Tensor, extra: int = 2) -> torch.Tensor:
    """The True columns of a (..., V) mask as (..., K) ids in a random order, padded with -1 (and `extra` more
    padding columns)."""
    flat = mask.reshape(-1, mask.shape[-1])
    k = int(flat.sum(-1).max()) + extra
    out = torch.full((flat.shape[0], k), -1, dtype=torch.int64, device=mask.device)
    for r in range(flat.shape[0]):
        ids = flat[r].nonzero().view(-1)
        ids = ids[torch.randperm(ids.numel(), device=mask.device)]
        slots = torch.randperm(k, device=mask.device)[: ids.numel()]
        out[r, slots] = ids
    return out.reshape(*mask.shape[:-1], k)


def reference(logits, labels, kept_ids, temperature):
    """float64: log_softmax over the listed ids and the label, by a V-wide mask."""
    x = logits.detach().double().requires_grad_()
    # Counts, not a scatter of booleans: padding's -1 becomes id 0 here, and must not overwrite a listed 0.
    labelled = labels >= 0
    counts = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    counts.scatter_add_(-1, kept_ids.clamp_min(0), (kept_ids >= 0).long())
    counts.scatter_add_(-1, labels.clamp_min(0).unsqueeze(-1), labelled.long().unsqueeze(-1))
    mask = counts > 0
    log_p = torch.log_softmax((x / temperature).masked_fill(~mask, float("-inf")), -1)
    lp = torch.where(labelled, log_p.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = -torch.where(mask, log_p.exp() * log_p.masked_fill(~mask, 0.0), 0.0).sum(-1)
    return x, lp, entropy


def run(logits, labels, kept_ids, g_lp, g_h, temperature, fn=rl_losses.kept_token_log_probs, **options):
    x = logits.detach().clone().requires_grad_()
    lp, entropy = fn(x, labels, kept_ids, temperature=temperature, compute_entropy=True, **options)
    torch.autograd.backward([lp, entropy], [g_lp.to(lp.dtype), g_h.to(entropy.dtype)])
    return lp.detach(), entropy.detach(), x.grad


def inputs(shape, vocab, dtype, device):
    logits = (torch.randn(*shape, vocab, device=device) * 2).to(dtype)
    labels = torch.randint(0, vocab, shape, device=device)
    labels[torch.rand(shape, device=device) < 0.25] = -100
    g_lp, g_h = torch.randn(shape, device=device), torch.randn(shape, device=device)
    return logits, labels, g_lp, g_h


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_reference(dtype, temperature, device):
    logits, labels, g_lp, g_h = inputs((3, 7), 300, dtype, device)
    mask = torch.rand(logits.shape, device=device) < 0.05  # ~15 ids per position; labels mostly not among them
    mask[0, 0] = False  # a position with no listed id: its label alone (or nothing, unlabelled)
    kept_ids = ids_of(mask)
    lp, entropy, grad = run(logits, labels, kept_ids, g_lp, g_h, temperature)
    x, ref_lp, ref_entropy = reference(logits, labels, kept_ids, temperature)
    torch.autograd.backward([ref_lp, ref_entropy], [g_lp.double(), g_h.double()])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert lp.dtype == entropy.dtype == acc and lp.shape == labels.shape
    assert_close(lp, ref_lp.detach(), dtype, msg="log_probs")
    assert_close(entropy, ref_entropy.detach(), dtype, msg="entropy")
    assert_grad_close(grad, x.grad, dtype)
    assert (grad[~mask & (torch.arange(300, device=device) != labels.clamp_min(0).unsqueeze(-1))] == 0).all()


@pytest.mark.parametrize("sampler", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=40, top_p=0.9)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_equals_the_ops_sampler_given_its_kept_set(sampler, device):
    """The kept set top_k / top_p / min_p make (rl_losses.reference_sampler, float64) handed over as ids gives the
    log-probs, entropies and gradients of token_log_probs with those filters."""
    logits, labels, g_lp, g_h = inputs((4, 9), 257, torch.float64, device)
    temperature = 0.8
    kept = reference_sampler.kept(logits / temperature, labels, **sampler)
    got = run(logits, labels, ids_of(kept), g_lp, g_h, temperature)
    want = run(logits, labels, None, g_lp, g_h, temperature,
               fn=lambda x, t, _ids, **kw: rl_losses.token_log_probs(x, t, **kw), **sampler)
    for a, b, name in zip(got, want, ("log_probs", "entropy", "gradient")):
        assert_close(a, b, torch.float64, msg=name)


def test_padding_listed_label_and_unlabelled(device):
    logits = torch.randn(3, 6, dtype=torch.float64, device=device)
    kept_ids = torch.tensor([[2, -1, 4], [-1, -1, -1], [5, 0, -1]], device=device)
    labels = torch.tensor([4, -100, 3], device=device)  # listed; unlabelled with no ids; outside the listed ids
    lp, entropy = rl_losses.kept_token_log_probs(logits, labels, kept_ids, compute_entropy=True)
    assert lp[0] == torch.log_softmax(logits[0, [2, 4]], -1)[1]
    assert lp[1] == 0 and entropy[1] == 0
    assert torch.allclose(lp[2], torch.log_softmax(logits[2, [5, 0, 3]], -1)[2])


@pytest.mark.parametrize("case,message", [
    ("range", "kept_ids must lie in [0, 6) or be -1"),
    ("repeat", "kept_ids lists a token more than once at position (1,)"),
    ("shape", "labels must have the logits' leading shape (3,)"),
    ("dtype", "labels and kept_ids must be int32 or int64"),
    ("temperature", "temperature must be > 0, got 0.0"),
    ("label", "labels must be < the vocabulary size 6, got 6"),
])
def test_bad_inputs(case, message):
    logits, labels = torch.randn(3, 6), torch.tensor([1, 2, 3])
    kept_ids, temperature = torch.tensor([[0, 1], [2, 3], [4, 5]]), 1.0
    if case == "range":
        kept_ids[0, 0] = 6
    elif case == "repeat":
        kept_ids[1] = torch.tensor([3, 3])
    elif case == "shape":
        kept_ids = kept_ids[:2]
    elif case == "dtype":
        kept_ids = kept_ids.float()
    elif case == "temperature":
        temperature = 0.0
    elif case == "label":
        labels[2] = 6
    with pytest.raises(ValueError, match=f"kept_token_log_probs: .*{__import__('re').escape(message)}"):
        rl_losses.kept_token_log_probs(logits, labels, kept_ids, temperature=temperature)


def test_grpo_over_the_kept_set_through_policy_token_loss(device):
    """The policy terms over an engine's kept set: kept_token_log_probs into policy_token_loss, summed over the
    labelled tokens / their count, is grpo_loss with the top_k that made the set (loss and logits gradient)."""
    logits, labels, _, _ = inputs((6, 8), 200, torch.float64, device)
    advantages = torch.randn(labels.shape, dtype=torch.float64, device=device)
    old = -4 * torch.rand(labels.shape, dtype=torch.float64, device=device)
    kept_ids = ids_of(reference_sampler.kept(logits, labels, top_k=7))
    x = logits.clone().requires_grad_()
    lp, _ = rl_losses.kept_token_log_probs(x, labels, kept_ids)
    labelled = labels >= 0
    per_token = rl_losses.policy_token_loss(lp, old, advantages, loss_mask=labelled).loss
    (per_token.sum() / labelled.sum()).backward()
    y = logits.clone().requires_grad_()
    fused = rl_losses.grpo_loss(y, labels, advantages, old, top_k=7)
    fused.loss.backward()
    assert_close(per_token.sum().detach() / labelled.sum(), fused.loss.detach(), torch.float64, msg="loss")
    assert_close(x.grad, y.grad, torch.float64, msg="gradient")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=_id)
def test_padding_and_listed_labels_next_to_id_0(dtype, device):
    """Padding gathers id 0 and a listed label is masked at its own column; neither may change id 0's (or the
    label's) gradient: id 0 listed beside padding, as the label, unlisted with padding, and a row of padding."""
    logits = (torch.randn(6, 9, device=device) * 2).to(dtype)
    kept_ids = torch.tensor([[-1, 0, 4, -1], [0, -1, -1, 3], [-1, 5, -1, 2], [-1, -1, -1, -1], [2, -1, 0, 7],
                             [-1, 0, -1, -1]], device=device)  # the last: id 0 alone, p = 1
    labels = torch.tensor([0, 0, 0, -100, 8, -100], device=device)  # listed, listed, unlisted, none, unlisted, none
    g_lp, g_h = torch.randn(6, device=device), torch.randn(6, device=device)
    lp, entropy, grad = run(logits, labels, kept_ids, g_lp, g_h, 0.9)
    x, ref_lp, ref_entropy = reference(logits, labels, kept_ids, 0.9)
    torch.autograd.backward([ref_lp, ref_entropy], [g_lp.double(), g_h.double()])
    assert_close(lp, ref_lp.detach(), dtype, msg="log_probs")
    assert_close(entropy, ref_entropy.detach(), dtype, msg="entropy")
    assert_grad_close(grad, x.grad, dtype)
    assert (grad[[0, 1, 2, 4], 0] != 0).all() and (grad[[3, 5]] == 0).all() and lp[3] == 0 and entropy[3] == 0


@pytest.mark.parametrize("used", ["log_probs", "entropy"])
def test_one_output_used(used, device):
    """A backward through one of the two outputs (the other's gradient None) against the float64 reference."""
    logits, labels, g_lp, g_h = inputs((5, 4), 120, torch.float32, device)
    kept_ids = ids_of(torch.rand(logits.shape, device=device) < 0.1)
    x = logits.clone().requires_grad_()
    lp, entropy = rl_losses.kept_token_log_probs(x, labels, kept_ids, temperature=1.3, compute_entropy=True)
    y, ref_lp, ref_entropy = reference(logits, labels, kept_ids, 1.3)
    ((lp if used == "log_probs" else entropy) * g_lp).sum().backward()
    ((ref_lp if used == "log_probs" else ref_entropy) * g_lp.double()).sum().backward()
    assert_grad_close(x.grad, y.grad, torch.float32)


def test_gradcheck_float64(device):
    """Both outputs' gradients by finite differences, with padding, unlabelled positions and a temperature."""
    logits, labels, _, _ = inputs((4, 3), 40, torch.float64, device)
    mask = torch.rand(logits.shape, device=device) < 0.2
    mask[0, 0] = False
    kept_ids = ids_of(mask)
    assert torch.autograd.gradcheck(
        lambda t: rl_losses.kept_token_log_probs(t, labels, kept_ids, temperature=0.8, compute_entropy=True),
        (logits.clone().requires_grad_(),))


def test_no_grad_equals_grad_forward(device):
    """The no-grad call skips autograd: the same values as the differentiable one, nothing to backward through."""
    logits, labels, _, _ = inputs((6, 5), 200, torch.bfloat16, device)
    kept_ids = ids_of(torch.rand(logits.shape, device=device) < 0.05).int()
    want = rl_losses.kept_token_log_probs(logits.clone().requires_grad_(), labels.int(), kept_ids, compute_entropy=True)
    with torch.no_grad():
        got = rl_losses.kept_token_log_probs(logits.clone().requires_grad_(), labels.int(), kept_ids,
                                             compute_entropy=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b.detach()) and a.grad_fn is None


def test_compiled_matches_eager(device):
    logits, labels, _, _ = inputs((8,), 64, torch.float32, device)
    kept_ids = ids_of(torch.rand(logits.shape, device=device) < 0.1)

    def fn(x, labels, kept_ids):
        lp, entropy = rl_losses.kept_token_log_probs(x, labels, kept_ids, temperature=0.7, compute_entropy=True)
        return (lp + 0.3 * entropy).sum(), lp, entropy
    assert_compiled_matches_eager(fn, logits, labels, kept_ids, backend="aot_eager")


def test_no_second_derivative():
    """The backward forms the gradient from saved, detached probabilities: a second derivative raises rather than
    coming out as zero."""
    logits = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 4, -1])
    kept = torch.tensor([[1, 2, 3], [4, 5, -1], [0, 7, 9]])
    log_probs, _ = rl_losses.kept_token_log_probs(logits, labels, kept)
    (grad,) = torch.autograd.grad(log_probs.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|differentiate twice"):
        grad.pow(2).sum().backward()
