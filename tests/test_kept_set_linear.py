"""linear_kept_token_log_probs (docs/consistency.md): the kept-set log-probs and entropies from hidden states,
against a float64 reference written here (the full logits, a V-wide mask and log_softmax), over several chunks of
rows, against linear_token_log_probs' own sampler filters fed the kept set they make; bad inputs."""
import pytest
import torch

import rl_losses
from rl_losses import kept_set, reference_sampler

from conftest import assert_close
from helpers import param_id as _id
from helpers_linear import assert_linear_grad_close, grad_magnitudes
from test_kept_set import ids_of, reference

VOCAB, HIDDEN = 300, 24


def linear_inputs(shape, dtype, device, with_bias):
    hidden = torch.randn(*shape, HIDDEN, device=device).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device=device) / HIDDEN ** 0.5 * 2).to(dtype)
    bias = torch.randn(VOCAB, device=device).to(dtype) if with_bias else None
    labels = torch.randint(0, VOCAB, shape, device=device)
    labels[torch.rand(shape, device=device) < 0.25] = -100
    return hidden, weight, bias, labels


def run(hidden, weight, bias, labels, kept_ids, g_lp, g_h, temperature):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    lp, entropy = rl_losses.linear_kept_token_log_probs(*leaves[:2], labels, kept_ids, bias=leaves[2] if bias is not None
                                                        else None, temperature=temperature, compute_entropy=True)
    torch.autograd.backward([lp, entropy], [g_lp.to(lp.dtype), g_h.to(entropy.dtype)])
    return lp.detach(), entropy.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("chunk_values", [1 << 24, 200], ids=["one_chunk", "chunks"])
def test_matches_float64_reference(dtype, with_bias, chunk_values, device, monkeypatch):
    """chunk_values=200: a chunk of rows per ~200 logits over the union, so the 21 positions run in several chunks."""
    monkeypatch.setattr(kept_set, "_CHUNK_VALUES", chunk_values)
    hidden, weight, bias, labels = linear_inputs((3, 7), dtype, device, with_bias)
    mask = torch.rand(*labels.shape, VOCAB, device=device) < 0.03
    mask[0, 0] = False  # a position with no listed id
    kept_ids = ids_of(mask)
    g_lp, g_h = torch.randn(labels.shape, device=device), torch.randn(labels.shape, device=device)
    temperature = 0.7
    lp, entropy, grads = run(hidden, weight, bias, labels, kept_ids, g_lp, g_h, temperature)

    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if with_bias else 0)
    if dtype != torch.float64:  # the op's logits are the GEMM's, rounded to the dtype (their rounding is not the op's)
        logits = logits + (logits.detach().to(dtype).double() - logits.detach())
    x, ref_lp, ref_entropy = reference(logits, labels, kept_ids, temperature)
    torch.autograd.backward([ref_lp, ref_entropy], [g_lp.double(), g_h.double()])
    logits.backward(x.grad)
    assert lp.shape == entropy.shape == labels.shape
    assert_close(lp, ref_lp.detach(), dtype, msg="log_probs")
    assert_close(entropy, ref_entropy.detach(), dtype, msg="entropy")
    scale = 2.0 if dtype == torch.bfloat16 else 1.0  # as the linear ops' tests: bf16 GEMMs round dL/dlogits too
    for grad, leaf, magnitude, name in zip(grads, leaves, grad_magnitudes(x, leaves[0], leaves[1]),
                                           ("hidden", "weight", "bias")):
        assert grad.dtype == dtype, name
        assert_linear_grad_close(name, grad, leaf.grad, magnitude, dtype, scale=scale)
    # Only the union's rows of the weight get a gradient.
    union = torch.zeros(VOCAB, dtype=torch.bool, device=device)
    union[kept_ids[kept_ids >= 0]] = True
    union[labels[labels >= 0]] = True
    assert (grads[1][~union] == 0).all()


@pytest.mark.parametrize("sampler", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_equals_linear_token_log_probs_given_its_kept_set(sampler, device):
    """The kept set top_k / top_p / min_p make from the full logits (float64), handed over as ids, gives
    linear_token_log_probs' log-probs, entropies and gradients with those filters."""
    hidden, weight, bias, labels = linear_inputs((4, 9), torch.float64, device, False)
    temperature = 0.8
    kept = reference_sampler.kept((hidden @ weight.t()) / temperature, labels, **sampler)
    g_lp, g_h = torch.randn(labels.shape, device=device), torch.randn(labels.shape, device=device)
    lp, entropy, (g_hidden, g_weight) = run(hidden, weight, None, labels, ids_of(kept), g_lp, g_h, temperature)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want_lp, want_entropy = rl_losses.linear_token_log_probs(h, w, labels, temperature=temperature,
                                                             compute_entropy=True, **sampler)
    torch.autograd.backward([want_lp, want_entropy], [g_lp.double(), g_h.double()])
    for a, b, name in ((lp, want_lp, "log_probs"), (entropy, want_entropy, "entropy"), (g_hidden, h.grad, "hidden"),
                       (g_weight, w.grad, "weight")):
        assert_close(a, b.detach(), torch.float64, msg=name)


def test_nothing_kept_nor_labelled(device):
    """Every id padding and every position unlabelled: no union to gather, log-probs and entropies 0 as the logits
    form gives them."""
    hidden, weight, _, _ = linear_inputs((3,), torch.float64, device, False)
    labels, kept_ids = torch.full((3,), -100, device=device), torch.full((3, 2), -1, device=device)
    lp, entropy = rl_losses.linear_kept_token_log_probs(hidden, weight, labels, kept_ids, compute_entropy=True)
    want = rl_losses.kept_token_log_probs(hidden @ weight.t(), labels, kept_ids, compute_entropy=True)
    assert torch.equal(lp, want[0]) and torch.equal(entropy, want[1]) and not lp.any()


@pytest.mark.parametrize("case,message", [
    ("range", "kept_ids must lie in [0, 6) or be -1"),
    ("label", "labels must be < the vocabulary size 6, got 6"),
    ("repeat", "kept_ids lists a token more than once at position (1,)"),
    ("shape", "labels must have the hidden states' leading shape (3,)"),
    ("hidden", "hidden must be a floating-point (..., H) tensor"),
    ("weight", "weight must be (V, 4) in the hidden states' dtype torch.float32, got (6, 5) torch.float32"),
    ("bias", "bias must be (6,) in torch.float32, got (5,) torch.float32"),
    ("temperature", "temperature must be > 0, got -1.0"),
])
def test_bad_inputs(case, message, device):
    """Checked on a GPU too, without RL_LOSSES_CHECK_INPUTS: the ids are read on the host for the union anyway."""
    hidden, weight, bias = torch.randn(3, 4, device=device), torch.randn(6, 4, device=device), None
    labels, kept_ids = torch.tensor([1, 2, 3], device=device), torch.tensor([[0, 1], [2, 3], [4, 5]], device=device)
    temperature = 1.0
    if case == "range":
        kept_ids[0, 0] = 6
    elif case == "label":
        labels[2] = 6
    elif case == "repeat":
        kept_ids[1] = 3
    elif case == "shape":
        kept_ids = kept_ids[:2]
    elif case == "hidden":
        hidden = hidden.long()
    elif case == "weight":
        weight = torch.randn(6, 5, device=device)
    elif case == "bias":
        bias = torch.randn(5, device=device)
    elif case == "temperature":
        temperature = -1.0
    with pytest.raises(ValueError, match=f"linear_kept_token_log_probs: .*{__import__('re').escape(message)}"):
        rl_losses.linear_kept_token_log_probs(hidden, weight, labels, kept_ids, bias=bias, temperature=temperature)
