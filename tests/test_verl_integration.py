"""rl_losses.integrations.verl against verl's own PyTorch implementation of its fused log-prob/entropy
function (verl.utils.experimental.torch_functional.FusedLinearForPPOFunction) when verl imports, else against
that function's formula reproduced below (verl 0.9.1, verl/utils/experimental/torch_functional.py:
_fused_linear_for_ppo_fwd/_bwd), and both against the float64 reference."""
import pytest
import torch

from rl_losses import reference
from rl_losses.integrations import verl as rl_verl

try:
    from verl.utils.experimental import torch_functional as verl_functional
except ImportError:
    verl_functional = None


def _verl_formula(hidden, weight, ids, temperature):
    """verl 0.9.1's _fused_linear_for_ppo_fwd, written out: logits / T in fp32, entropy = lse − Σ p·logits,
    log-prob = log_softmax(logits)[id] (autograd gives its _fused_linear_for_ppo_bwd)."""
    logits = ((hidden @ weight.t()) / temperature).float()
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    log_probs = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy.to(hidden.dtype)


def verl_forward(hidden, weight, ids, temperature, chunk_size):
    if verl_functional is not None:
        return verl_functional.FusedLinearForPPOFunction.apply(hidden, weight, ids, temperature, chunk_size)
    return _verl_formula(hidden, weight, ids, temperature)


def _inputs(shape, hidden_size, vocab):
    hidden = torch.randn(*shape, hidden_size)
    weight = torch.randn(vocab, hidden_size) * hidden_size**-0.5 * 2
    ids = torch.randint(0, vocab, shape)
    return hidden, weight, ids


@pytest.mark.parametrize("shape", [(13,), (3, 7)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("which", ["both", "log_probs", "entropy"])
def test_fused_linear_for_ppo_matches_verl(shape, temperature, which):
    hidden, weight, ids = _inputs(shape, 16, 301)
    g_lp, g_h = torch.randn(shape), torch.randn(shape)
    results = []
    for fn in (lambda *a: rl_verl.FusedLinearForPPO(chunk_size=5)(*a, temperature=temperature),
               lambda *a: verl_forward(*a, temperature, 5)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, ids)
        loss = {"both": (lp * g_lp).sum() + (ent * g_h).sum(), "log_probs": (lp * g_lp).sum(),
                "entropy": (ent * g_h).sum()}[which]
        loss.backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rent = reference.linear_token_log_probs(h64, w64, ids, logits_scale_factor=1 / temperature,
                                                 compute_entropy=True)
    ({"both": (rlp * g_lp.double()).sum() + (rent * g_h.double()).sum(), "log_probs": (rlp * g_lp.double()).sum(),
      "entropy": (rent * g_h.double()).sum()}[which]).backward()
    expected = (rlp.detach(), rent.detach(), h64.grad, w64.grad)
    ours, theirs = results
    assert ours[0].dtype == theirs[0].dtype == torch.float32 and ours[1].dtype == theirs[1].dtype
    for name, a, b, e in zip(("log_probs", "entropy", "grad hidden", "grad weight"), ours, theirs, expected):
        scale = e.abs().max().item()
        torch.testing.assert_close(a.double() / scale, b.double() / scale, rtol=2e-5, atol=2e-5, msg=name)
        torch.testing.assert_close(a.double() / scale, e / scale, rtol=2e-5, atol=2e-5, msg=name)


def test_chunk_functions_match_verl_formula():
    hidden, weight, ids = _inputs((9,), 8, 57)
    lp, ent = rl_verl.fused_linear_for_ppo_fwd(hidden, weight, ids, 0.8)
    ref_lp, ref_ent = _verl_formula(hidden, weight, ids, 0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=2e-5, atol=2e-6)
    g_lp, g_h = torch.randn(9), torch.randn(9)
    dh, dw = rl_verl.fused_linear_for_ppo_bwd(g_lp, g_h, hidden, weight, ids, 0.8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    a, b = _verl_formula(h, w, ids, 0.8)
    ((a * g_lp).sum() + (b * g_h).sum()).backward()
    torch.testing.assert_close(dh, h.grad, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(dw, w.grad, rtol=2e-5, atol=2e-6)
    dh_lp_only, _ = rl_verl.fused_linear_for_ppo_bwd(g_lp, None, hidden, weight, ids, 0.8)
    h = hidden.clone().requires_grad_()
    (_verl_formula(h, weight, ids, 0.8)[0] * g_lp).sum().backward()
    torch.testing.assert_close(dh_lp_only, h.grad, rtol=2e-5, atol=2e-6)


def test_linear_cross_entropy_reductions():
    hidden, weight, ids = _inputs((2, 6), 8, 41)
    lp, ent = rl_verl.linear_cross_entropy(hidden, weight, ids, 1.0, "none")
    assert lp.shape == ent.shape == (12,)  # flattened, as verl's Triton kernel returns them
    ref_lp, ref_ent = (x.reshape(-1) for x in _verl_formula(hidden, weight, ids, 1.0))
    torch.testing.assert_close(lp, ref_lp, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=2e-5, atol=2e-6)
    s_lp, s_ent = rl_verl.linear_cross_entropy(hidden, weight, ids, 1.0, "mean")
    torch.testing.assert_close(s_lp, ref_lp.mean(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(s_ent, ref_ent.mean(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case,message", [
    ("reduction", "reduction must be 'none', 'sum' or 'mean'"),
    ("shape", "input_ids has shape"),
    ("backend", "unsupported impl_backend"),
])
def test_bad_input_raises(case, message):
    hidden, weight, ids = _inputs((5,), 4, 11)
    calls = {
        "reduction": lambda: rl_verl.linear_cross_entropy(hidden, weight, ids, 1.0, "max"),
        "shape": lambda: rl_verl.FusedLinearForPPO()(hidden, weight, ids[:4]),
        "backend": lambda: rl_verl.FusedLinearForPPO(impl_backend="cuda-magic"),
    }
    with pytest.raises(ValueError, match=message):
        calls[case]()


def test_vocabulary_parallel_group_goes_back_to_verls_kernel(monkeypatch, caplog):
    """Megatron passes its tensor-parallel group: with one rank rl_losses' kernel runs; with more (a vocabulary
    shard per rank) verl's own, saved by install(), with one warning; without it, a clear error."""
    hidden, weight, ids = _inputs((6,), 8, 41)
    group = object()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 1)
    lp, _ = rl_verl.linear_cross_entropy(hidden, weight, ids, 1.0, "none", group)
    torch.testing.assert_close(lp, _verl_formula(hidden, weight, ids, 1.0)[0], rtol=2e-5, atol=2e-6)
    calls = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    monkeypatch.setitem(rl_verl._VERL_KERNELS, "linear_cross_entropy", lambda *args: calls.append(args) or "verl")
    monkeypatch.setattr(rl_verl, "_WARNED", set())
    with caplog.at_level("WARNING", logger=rl_verl.logger.name):
        for _ in range(2):
            assert rl_verl.linear_cross_entropy(hidden, weight, ids, 0.7, "none", group) == "verl"
    assert len(calls) == 2 and calls[0][3:] == (0.7, "none", group)
    assert len([r for r in caplog.records if "verl's own kernel runs" in r.getMessage()]) == 1
    monkeypatch.delitem(rl_verl._VERL_KERNELS, "linear_cross_entropy")
    with pytest.raises(ValueError, match="needs verl's own kernel"):
        rl_verl.linear_cross_entropy(hidden, weight, ids, 1.0, "none", group)


@pytest.mark.skipif(verl_functional is None, reason="verl does not import here")
def test_install_replaces_verls_kernels():
    import verl.utils.kernel.linear_cross_entropy as triton_functional

    assert rl_verl.INSTALLED
    assert verl_functional.FusedLinearForPPO is rl_verl.FusedLinearForPPO
    assert triton_functional.linear_cross_entropy is rl_verl.linear_cross_entropy
    assert rl_verl._VERL_KERNELS["linear_cross_entropy"] is not rl_verl.linear_cross_entropy  # verl's, kept
