"""rl_losses.policy_token_loss (the policy losses' per-token math on per-token log-probs) against the float64
reference's per-token terms (rl_losses.reference), its gradient against autograd through the reference, its
agreement with the fused grpo_loss on the same tokens, its argument checks (the fake kernel's too), opcheck and
torch.compile, and CPU/CUDA parity when a GPU is present."""
import math
import re

import pytest
import torch

import rl_losses
from rl_losses import reference as ref_impl

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CASES = {  # options of policy_token_loss
    "ppo_clip": dict(),
    "ppo_clip-delta": dict(delta=1.4, epsilon_low=0.1, epsilon_high=0.25),
    # TRL's delta below 1 + ε_h (it then caps the ratio where A > 0) and below 1 - ε_l
    "ppo_clip-delta-inside": dict(delta=1.1, epsilon_low=0.2, epsilon_high=0.2),
    "ppo_clip-delta-low": dict(delta=0.7, epsilon_low=0.2, epsilon_high=0.2),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=1.4),
    "kl-k3": dict(beta=0.1, with_ref=True),
    "kl-k2-weighted": dict(beta=0.2, with_ref=True, kl_estimator="k2", kl_importance_weighted=True),
    "kl-k1-no-beta": dict(with_ref=True, kl_estimator="k1"),
    "rollout-truncate": dict(rollout_correction="token_truncate", rollout_cap=1.3),
    "rollout-mask": dict(rollout_correction="token_mask", rollout_mask_bounds=(0.8, 1.25), beta=0.05, with_ref=True),
    "on-policy": dict(on_policy=True, beta=0.1, with_ref=True, kl_importance_weighted=True),
    # verl's per-token losses
    "gpg": dict(loss_type="gpg", rollout_correction="token_truncate", rollout_cap=1.3),
    "dro": dict(loss_type="dro", dro_beta=0.7, beta=0.1, with_ref=True),
    "dro-on-policy": dict(loss_type="dro", dro_beta=0.7, on_policy=True),
    "dppo_tv": dict(loss_type="dppo_tv", epsilon_low=0.05, epsilon_high=0.08, clip_ratio_c=1.4),
    "dppo_kl": dict(loss_type="dppo_kl", epsilon_low=0.01, epsilon_high=0.02, clip_ratio_c=1.4,
                    rollout_correction="token_mask", rollout_mask_bounds=(0.8, 1.25)),
}


def make_inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    old = lp + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(shape[:1], generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (lp, old, adv, ref, rollout)]


def reference_terms(lp, old, adv, ref, rollout, o):
    """Per-token ℓ_t (differentiable w.r.t. lp) and the flags, from the reference's pieces, in float64."""
    p = ref_impl.Policy(**{k: v for k, v in o.items() if k in ref_impl.Policy._fields})
    adv = adv.unsqueeze(-1).expand_as(lp)
    old = lp.detach() if old is None else old
    ratio = torch.exp(lp - old)
    s = ref_impl._surrogate(p, ratio, adv, lp, o.get("epsilon_low", 0.2), o.get("epsilon_high", 0.2), o.get("delta"),
                            old)
    weight = torch.ones_like(lp)
    if p.rollout_correction:
        _, weight = ref_impl._rollout_weight(p, old - rollout)
    loss = s * weight.detach()
    kl = torch.zeros_like(lp)
    if ref is not None:
        kl = ref_impl._kl_estimate(p.kl_estimator, lp, ref)
        if p.kl_importance_weighted:
            kl = kl * ratio
        loss = loss + o.get("beta", 0.0) * kl
    low, high = ref_impl._clip_flags(p, ratio, adv, o.get("epsilon_low", 0.2), o.get("epsilon_high", 0.2),
                                     o.get("delta"), old, lp.detach())
    return loss, ratio, low, high, kl, weight


def call(lp, old, adv, ref, rollout, o):
    o = dict(o)
    with_ref, on_policy = o.pop("with_ref", False), o.pop("on_policy", False)
    if not o.get("rollout_correction"):
        rollout = None
    return rl_losses.policy_token_loss(lp, None if on_policy else old, adv, ref_log_probs=ref if with_ref else None,
                                       rollout_log_probs=rollout, **o)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype, device):
    o = CASES[case]
    lp, old, adv, ref, rollout = make_inputs((6, 37), dtype, device, seed=hash(case) % 1000)
    lp.requires_grad_(True)
    out = call(lp, old, adv, ref, rollout, o)
    upstream = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(device)
    (grad,) = torch.autograd.grad((out.loss.double() * upstream).sum(), lp)
    x = lp.detach().double().requires_grad_(True)
    d = [t.double() for t in (old, adv, ref, rollout)]
    loss, ratio, low, high, kl, weight = reference_terms(
        x, None if o.get("on_policy") else d[0], d[1], d[2] if o.get("with_ref") else None, d[3], o)
    (expected_grad,) = torch.autograd.grad((loss * upstream).sum(), x)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.loss.double(), loss.detach(), **tol)
    torch.testing.assert_close(grad.double(), expected_grad, **tol)
    assert grad.dtype == dtype
    torch.testing.assert_close(out.ratio.double(), ratio.detach(), **tol)
    torch.testing.assert_close(out.kl.double(), kl.detach(), **tol)
    torch.testing.assert_close(out.rollout_weight.double(), weight.detach(), **tol)
    assert torch.equal(out.clipped_low.bool(), low) and torch.equal(out.clipped_high.bool(), high)
    if case in ("ppo_clip", "cispo", "rollout-mask", "dppo_tv", "dppo_kl"):  # the clipped / corrected regions
        assert (out.clipped_low + out.clipped_high).sum() > 0 or (out.rollout_weight != out.ratio).any()


@pytest.mark.parametrize("case", ["ppo_clip-delta", "sapo", "kl-k2-weighted", "rollout-mask", "gpg", "dro",
                                  "dppo_tv", "dppo_kl"])
def test_agrees_with_fused_grpo(case):
    """Σ ℓ_t / N from the log-probs equals grpo_loss on the logits (same options), gradient included."""
    o = dict(CASES[case])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, 23, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 23, (4, 9), generator=g)
    _, old, adv, ref, rollout = make_inputs((4, 9), torch.float64, "cpu", seed=4)
    with_ref = o.pop("with_ref", False)
    kwargs = dict(o, ref_log_probs=ref if with_ref else None,
                  rollout_log_probs=rollout if o.get("rollout_correction") else None)
    fused = rl_losses.grpo_loss(logits, target, adv, old, **kwargs)
    (g_fused,) = torch.autograd.grad(fused.loss, logits)
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    out = rl_losses.policy_token_loss(lp, old, adv, **kwargs)
    (g_token,) = torch.autograd.grad(out.loss.mean(), logits)
    torch.testing.assert_close(out.loss.mean(), fused.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_token, g_fused, rtol=1e-10, atol=1e-13)


BAD = [
    (dict(epsilon_low=1.0), "epsilon_low must be in [0, 1), got 1"),
    (dict(delta=0.0), "delta must be > 0 (it caps the ratio r = exp(lp - old) > 0; the usual two-sided clip takes "
                      "delta > 1 + epsilon_high = 1.2), got 0"),
    (dict(delta=math.inf), "delta must be finite (leave it unset for no cap), got inf"),
    (dict(loss_mask=torch.ones(3, 5)), "loss_mask must be a bool or integer tensor, got Float"),
    (dict(loss_mask=torch.ones(3, 4, dtype=torch.bool)), "loss_mask has shape [3, 4] but log_probs has shape [3, 5]"),
    (dict(beta=0.5), "beta = 0.5 > 0 needs ref_log_probs"),
    (dict(loss_type="vanilla"), "loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', 'dro', 'dppo_tv', "
                                "'dppo_kl', 'geo_mean', 'clip_cov' or 'kl_cov', got 'vanilla'"),
    (dict(loss_type="vespo"), "loss_type 'vespo' weighs a token by the rest of its sequence, which only the fused ops"),
    (dict(loss_type="geo_mean"), "loss_type 'geo_mean' weighs a token by the rest of its sequence"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be a finite value > 0, got 0"),
    (dict(kl_estimator="k4"), "kl_estimator must be 'k1', 'k2' or 'k3', got 'k4'"),
    (dict(rollout_correction="sequence_mask"), "rollout_correction must be None, 'token_truncate' or 'token_mask'"),
    (dict(rollout_correction="token_mask"), "rollout_correction = 'token_mask' needs rollout_log_probs"),
    (dict(old_log_probs=torch.zeros(3, 4)), "old_log_probs has shape [3, 4] but target has shape [3, 5]"),
    (dict(advantages=torch.zeros(4)), "advantages has shape [4] but target has shape [3, 5]"),
    (dict(log_probs=torch.zeros(3, 5, dtype=torch.long)), "log_probs must be a floating-point tensor, got"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bad,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_inputs(bad, message, device):
    bad = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}  # (a copy per device)
    args = dict(log_probs=torch.zeros(3, 5), old_log_probs=torch.zeros(3, 5), advantages=torch.zeros(3))
    args.update({k: bad.pop(k) for k in list(bad) if k in args})
    args = {k: v.to(device) for k, v in args.items()}
    with pytest.raises((RuntimeError, ValueError), match=re.escape(message)):
        rl_losses.policy_token_loss(args["log_probs"], args["old_log_probs"], args["advantages"], **bad)


def test_opcheck_and_compile():
    lp, old, adv, ref, rollout = make_inputs((3, 8), torch.float32, "cpu", seed=9)
    lp.requires_grad_(True)
    kwargs = dict(beta=0.1, rollout_correction="token_mask", rollout_mask_bounds=[0.5, 2.0],
                  kl_importance_weighted=True)
    torch.library.opcheck(torch.ops.rl_losses.policy_token_loss, (lp, old, adv, ref, rollout), kwargs)
    torch.library.opcheck(torch.ops.rl_losses.policy_token_loss, (lp, None, adv), dict(loss_type="sapo"))

    def f(lp):
        out = rl_losses.policy_token_loss(lp, old, adv, ref_log_probs=ref, beta=0.1, loss_type="cispo",
                                          epsilon_high=1.2)
        return (out.loss * out.rollout_weight).sum() / math.pi

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (g1,) = torch.autograd.grad(compiled(lp), lp)
    (g2,) = torch.autograd.grad(f(lp), lp)
    torch.testing.assert_close(g1, g2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    for case, o in CASES.items():
        outs = []
        for device in ("cpu", "cuda"):
            inputs = make_inputs((64, 513), torch.float32, device, seed=11)
            inputs[0].requires_grad_(True)
            out = call(*inputs, o)
            (grad,) = torch.autograd.grad(out.loss.sum(), inputs[0])
            outs.append([t.cpu() for t in (*out, grad)])
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=lambda m: f"{case}: {m}")
