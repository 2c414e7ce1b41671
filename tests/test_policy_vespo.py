"""loss_type="vespo" (docs/policy_losses.md): TRL's and Liger's VESPO, φ(w) = exp(λ + k·log w − λ·w) of the
sequence's summed, clamped log-ratios, through grpo_loss (sequences = document_index or the rows of (B, T)
labels) and gspo_loss (sequences = documents), against

* TRL's own ``GRPOTrainer.get_gamma_weights`` (a static method: called directly) and Liger's
  ``get_gamma_weights`` / ``ppo_loss_fn(loss_type="vespo")``, in fp32 to 1e-6 relative;
* the float64 reference (rl_losses.reference), every option, CPU and CUDA, fp32 and bf16;
* the fused lm_head forms, opcheck, torch.compile(fullgraph=True) and the argument checks (fake kernels too).
"""
import math

import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import DEVICES, assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, label_log_probs64,
                     make_logits, param_id as _id, requires_cuda)

_ops = torch.ops.rl_losses

VESPO = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.7)
ROLLOUT_MODES = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def make_batch(b, t, vocab, dtype, device, *, spread=0.05, min_length=2):
    """A padded (B, T) batch: logits, labels (-100 on padding), per-sequence advantages of both signs, old, rollout
    and reference log-probs near the current ones (sequence sums of a few tenths: φ away from its clamps)."""
    logits = make_logits((b, t), vocab, dtype, device)
    lengths = torch.randint(min_length, t + 1, (b,), device=device)
    lengths[0] = t
    mask = torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    target = torch.where(mask, torch.randint(0, vocab, (b, t), device=device), -100)
    lp = label_log_probs64(logits, target)
    advantages = torch.randn(b, device=device)
    advantages[0], advantages[-1] = abs(advantages[0]) + 0.1, -abs(advantages[-1]) - 0.1
    old = (lp + spread * torch.randn(b, t, dtype=torch.float64, device=device)).float()
    rollout = (old.double() + spread * torch.randn(b, t, dtype=torch.float64, device=device)).float()
    ref = (lp + 0.2 * torch.randn(b, t, dtype=torch.float64, device=device)).float()
    return logits, target, mask, advantages, old, rollout, ref


def rel_err(actual, expected):
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


def per_token_logps(x, target):
    lp = torch.log_softmax(x, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target >= 0, lp, 0.0)


# ---- TRL: GRPOTrainer.get_gamma_weights, called directly --------------------------------------------------------
def _trl_gamma_weights():
    trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    return trainer.GRPOTrainer.get_gamma_weights  # a @staticmethod: no trainer needed


def _trl_is_ratio(old, rollout, mask, mode, cap, bounds):
    # grpo_trainer.py (trl 1.16.0), _generate_and_score_completions: the token-level ratio TRL passes to vespo.
    ratio = torch.exp(torch.nan_to_num((old - rollout) * mask, nan=0.0))
    if mode == "token_truncate":
        return ratio.clamp(max=cap)
    lo, hi = bounds
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("on_policy", [False, True], ids=["old", "on_policy"])
@pytest.mark.parametrize("mode", [None, "token_truncate", "token_mask"])
def test_matches_trl_get_gamma_weights(mode, on_policy):
    """TRL's _compute_loss for loss_type="vespo" (dapo-style token mean), with its get_gamma_weights itself, fp32.
    TRL allows only token-level corrections with vespo."""
    gamma_weights = _trl_gamma_weights()
    logits, target, mask, advantages, old, rollout, _ = make_batch(5, 12, 97, torch.float32, "cpu", spread=0.15)
    if on_policy:
        rollout = (label_log_probs64(logits, target) + 0.15 * torch.randn(target.shape, dtype=torch.float64)).float()
    cap, bounds = 1.3, (0.8, 1.25)
    x = logits.clone().requires_grad_()
    lp = per_token_logps(x, target)
    old_t = lp.detach() if on_policy else old
    is_ratio = None if mode is None else _trl_is_ratio(old_t, rollout, mask, mode, cap, bounds)
    phi = gamma_weights(advantages=advantages.unsqueeze(1), log_ratio_per_token=lp - old_t, mask=mask.float(),
                        importance_sampling_ratio=is_ratio, k_pos=VESPO["vespo_k_pos"],
                        lambda_pos=VESPO["vespo_lambda_pos"], k_neg=VESPO["vespo_k_neg"],
                        lambda_neg=VESPO["vespo_lambda_neg"])
    per_token = -phi * advantages.unsqueeze(1) * lp
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()

    y = logits.clone().requires_grad_()
    options = dict(loss_type="vespo", **VESPO)
    if mode is not None:
        options.update(rollout_log_probs=rollout, rollout_correction=mode,
                       **(dict(rollout_cap=cap) if mode.endswith("truncate") else dict(rollout_mask_bounds=bounds)))
    out = rl_losses.grpo_loss(y, target, advantages, None if on_policy else old, **options)
    out.loss.backward()
    # The loss sums −φ·A·lp of both signs: it cancels a digit or so more than 1e-6 of its value (as cispo's, in
    # test_policy_peers.py); the gradient's entries and φ do not.
    assert rel_err(out.loss.detach(), expected.detach()) <= 1e-5
    assert rel_err(y.grad, x.grad) <= 1e-6
    # TRL logs global_masked_mean of the (B, 1) weights: their mean over the sequences.
    assert rel_err(out.trl_metrics()["vespo/phi_seq_mean"], phi.mean()) <= 1e-6
    assert "clip_ratio/low_mean" not in out.trl_metrics()


def test_trl_gamma_weights_at_the_clamps():
    """Sequences whose summed log-ratios hit TRL's clamps (per token ±20, log w in [log 1e-8, 20]) and a masked
    token whose log-ratio would dominate: φ as TRL's, to 1e-6."""
    gamma_weights = _trl_gamma_weights()
    b, t, vocab = 4, 6, 31
    logits = make_logits((b, t), vocab, torch.float32, "cpu")
    target = torch.randint(0, vocab, (b, t))
    target[2, 4:] = -100
    mask = target >= 0
    lp = label_log_probs64(logits, target).float()
    shift = torch.tensor([[25.0, 0, 0, 0, 0, 0], [-3.0] * 6, [0.5, 0.2, -0.1, 0.3, 80.0, 80.0], [0.01] * 6])
    old = lp - shift  # row 0: one token beyond +20; row 1: log w = -18 (near the floor); row 2: masked outliers
    advantages = torch.tensor([0.7, -1.2, 0.0, -0.3])
    phi = gamma_weights(advantages=advantages.unsqueeze(1), log_ratio_per_token=torch.where(mask, lp - old, 0.0),
                        mask=mask.float(), importance_sampling_ratio=None)
    x = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old, loss_type="vespo")
    out.loss.backward()
    expected = torch.where(mask, -phi * advantages.unsqueeze(1), 0.0)  # −∂ℓ/∂lp per token, before /D
    # The label column's gradient is coef·(p_y − 1)/D: recover φ·A per row from it.
    p = torch.softmax(logits.double(), -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    coef = x.grad.double().gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask.sum() / (p - 1)
    assert rel_err(torch.where(mask, coef, 0.0), -expected.double()) <= 1e-5
    assert rel_err(out.vespo_phi_seq_mean, phi.mean()) <= 1e-5


# ---- Liger-Kernel: get_gamma_weights and ppo_loss_fn(loss_type="vespo") ------------------------------------------
@pytest.mark.parametrize("mode", [None, "token_truncate", "sequence_truncate", "sequence_mask"])
def test_matches_liger_vespo(mode):
    """Liger's chunked-loss vespo, fp32: its vllm_is_ratio may be (B, T) (token modes) or (B, 1) (one weight per
    sequence, folded into log w once: our sequence-level modes; TRL refuses those with vespo)."""
    liger = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")
    logits, target, mask, advantages, old, rollout, ref = make_batch(4, 10, 89, torch.float32, "cpu", spread=0.1)
    cap, bounds = 1.2, (0.85, 1.2)
    diff = (old - rollout) * mask
    is_ratio = None
    if mode is not None:
        log_rho = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
        rho = torch.exp(log_rho)
        is_ratio = rho.clamp(max=cap) if mode.endswith("truncate") else torch.where(
            (rho >= bounds[0]) & (rho <= bounds[1]), rho, 0.0)
    x = logits.clone().requires_grad_()
    expected, metrics = liger.LigerFusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps(x, target), mask.float(), advantages, mask.float(), ref_per_token_logps=ref,
        old_per_token_logps=old, beta=0.04, loss_type="vespo", vllm_is_ratio=is_ratio, use_bias_correction_kl=True,
        **VESPO)
    expected.backward()
    y = logits.clone().requires_grad_()
    options = dict(loss_type="vespo", ref_log_probs=ref, beta=0.04, kl_importance_weighted=True, **VESPO)
    if mode is not None:
        options.update(rollout_log_probs=rollout, rollout_correction=mode,
                       **(dict(rollout_cap=cap) if mode.endswith("truncate") else dict(rollout_mask_bounds=bounds)))
    out = rl_losses.grpo_loss(y, target, advantages, old, **options)
    out.loss.backward()
    # Two fp32 computations of the same formula, in different orders: Liger's φ, KL terms exp(ref − lp) − (ref − lp)
    # − 1 (a cancellation of about 1 each) and loss (−φ·A·lp of both signs) round ten or more times apiece, so they
    # part by 1.1–1.3e-6 on some draws; 1e-5 still fails any wrong term. The float64 reference holds ours to 1e-6.
    assert rel_err(out.loss.detach(), expected.detach()) <= 1e-5
    assert rel_err(y.grad, x.grad) <= 1e-5
    assert rel_err(out.kl, metrics[0]) <= 1e-5
    phi = liger.get_gamma_weights(advantages, torch.where(mask, per_token_logps(logits, target) - old, 0.0),
                                  mask.float(), is_ratio, VESPO["vespo_k_pos"], VESPO["vespo_lambda_pos"],
                                  VESPO["vespo_k_neg"], VESPO["vespo_lambda_neg"])
    assert rel_err(out.vespo_phi_seq_mean, phi.mean()) <= 1e-5


@requires_cuda
def test_matches_liger_triton_vespo_cuda():
    """Liger's Triton kernel (triton_grpo_loss, loss_type="vespo") on the GPU: its (B, L+1, V) logits layout."""
    triton_grpo = pytest.importorskip("liger_kernel.transformers.grpo_loss").triton_grpo_loss
    b, t, vocab = 4, 33, 1000
    logits, target, mask, advantages, old, rollout, _ = make_batch(b, t, vocab, torch.float32, "cuda", spread=0.1)
    target = torch.where(mask, target, 0)  # Liger reads every id; the mask removes the padding
    full = torch.cat([logits, torch.randn(b, 1, vocab, device="cuda")], 1)
    x = full.clone().requires_grad_()
    loss, _ = triton_grpo(x, old, None, target, advantages, mask.int(), temperature=1.0, beta=0.0, inplace=False,
                          loss_type="vespo", reduce=True, **VESPO)
    loss.backward()
    y = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(y, torch.where(mask, target, -100), advantages, old, loss_type="vespo", **VESPO)
    out.loss.backward()
    assert rel_err(out.loss.detach(), loss.detach()) <= 1e-5
    assert rel_err(y.grad, x.grad[:, :-1]) <= 1e-5


# ---- the float64 reference: every option, CPU and CUDA -------------------------------------------------------------
@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _options(mode, rollout, ref, kl, entropy):
    options = dict(loss_type="vespo", entropy_coefficient=entropy, **VESPO)
    if mode is not None:
        options.update(rollout_log_probs=rollout, rollout_correction=mode)
        options.update(rollout_cap=1.15) if mode.endswith("truncate") else options.update(
            rollout_mask_bounds=(0.9, 1.1))
    if kl:
        options.update(ref_log_probs=ref, beta=0.06, kl_estimator="k2", kl_importance_weighted=True)
    return options


def _double(options):
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in options.items()}


CASES = [(mode, on_policy, kl, entropy) for mode in ROLLOUT_MODES for on_policy in (False, True)
         for kl, entropy in [(False, 0.0), (True, 0.03)]]


@pytest.mark.parametrize("mode,on_policy,kl,entropy", CASES,
                         ids=[f"{m}-{'onpol' if o else 'old'}-{'kl' if k else 'nokl'}-{e}" for m, o, k, e in CASES])
def test_grpo_vespo_matches_reference(mode, on_policy, kl, entropy, device):
    logits, target, mask, advantages, old, rollout, ref = make_batch(4, 9, 53, torch.float32, device)
    options = _options(mode, rollout, ref, kl, entropy)
    old_arg = None if on_policy else old
    x = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old_arg, **options)
    (1.7 * out.loss).backward()
    x64 = logits.double().requires_grad_()
    expected = reference.grpo_loss(x64, target, advantages.double(), None if on_policy else old.double(),
                                   **_double(options))
    (1.7 * expected.loss).backward()
    assert_close(out.loss.detach(), expected.loss.detach(), torch.float32)
    assert_grad_close(x.grad, x64.grad, torch.float32)
    for name in ("vespo_phi_seq_mean", "ratio_mean", "kl", "entropy", "rollout_ratio_mean", "rollout_weight_mean",
                 "rollout_corrected_fraction", "clipped_fraction_low", "clipped_fraction_high"):
        a, e = getattr(out, name), getattr(expected, name)
        assert (a is None) == (e is None), name
        if a is not None:
            assert_close(a, e, torch.float32, msg=name)
    assert out.trl_metrics().keys() == expected.trl_metrics().keys()
    assert torch.count_nonzero(x.grad[target < 0]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
def test_grpo_vespo_low_precision(dtype, device):
    logits, target, mask, advantages, old, rollout, ref = make_batch(3, 11, 517, dtype, device)
    options = _options("token_truncate", rollout, ref, True, 0.02)
    x = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old, **options)
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    expected = reference.grpo_loss(x64, target, advantages.double(), old.double(), **_double(options))
    expected.loss.backward()
    assert_close(out.loss.detach(), expected.loss.detach(), dtype)
    assert_grad_close(x.grad, x64.grad, dtype)
    assert_close(out.vespo_phi_seq_mean, expected.vespo_phi_seq_mean, dtype)


def test_grpo_vespo_documents(device):
    """Packed documents (document_index), one spanning two rows, padding, per-token advantages of both signs:
    φ per token by the sign of its own advantage (TRL with (B, T) advantages)."""
    logits, target, _, _, old, rollout, _ = make_batch(3, 8, 50, torch.float32, device)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2], device=device)
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(3, 8, device=device)
    for mode in (None, "token_mask", "sequence_truncate"):
        options = _options(mode, rollout, None, False, 0.0)
        x = logits.clone().requires_grad_()
        out = rl_losses.grpo_loss(x, target, advantages, old, document_index=doc, **options)
        out.loss.backward()
        x64 = logits.double().requires_grad_()
        expected = reference.grpo_loss(x64, target, advantages.double(), old.double(), document_index=doc,
                                       **_double(options))
        expected.loss.backward()
        assert_close(out.loss.detach(), expected.loss.detach(), torch.float32)
        assert_grad_close(x.grad, x64.grad, torch.float32)
        assert_close(out.vespo_phi_seq_mean, expected.vespo_phi_seq_mean, torch.float32)


def test_vespo_gradcheck():
    # φ is a stop-gradient weight of the logits, which finite differences would see move: on-policy without a
    # correction φ ≡ 1, the one setting where the loss is a plain function of the logits (−A·lp + β·KL − c·H;
    # not the importance-weighted KL, whose on-policy ratio is 1 at every point finite differences take).
    logits, target, _, advantages, _, _, ref = make_batch(2, 5, 7, torch.float64, "cpu")
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.grpo_loss(
        t, target, advantages, None, loss_type="vespo", ref_log_probs=ref.double(), beta=0.1, kl_estimator="k2",
        entropy_coefficient=0.2).loss, x)


def test_vespo_on_policy_equals_old_at_the_current_log_probs(device):
    logits, target, _, advantages, _, _, _ = make_batch(4, 9, 64, torch.float64, device)
    old = label_log_probs64(logits, target)
    results = []
    for old_arg in (None, old):
        x = logits.clone().requires_grad_()
        out = rl_losses.grpo_loss(x, target, advantages, old_arg, loss_type="vespo")
        out.loss.backward()
        results.append((out.loss.detach(), x.grad, out.vespo_phi_seq_mean))
    for a, b in zip(*results):
        assert_close(a, b, torch.float64)
    assert_close(results[0][2], torch.tensor(1.0, dtype=torch.float64), torch.float64)  # φ(1) = 1


def test_vespo_lambda_is_raised_to_1e_4_as_trl():
    logits, target, _, advantages, old, _, _ = make_batch(3, 6, 40, torch.float64, "cpu")
    a = rl_losses.grpo_loss(logits, target, advantages, old, loss_type="vespo", vespo_lambda_pos=0.0,
                            vespo_lambda_neg=0.0)
    b = rl_losses.grpo_loss(logits, target, advantages, old, loss_type="vespo", vespo_lambda_pos=1e-4,
                            vespo_lambda_neg=1e-4)
    assert torch.equal(a.loss, b.loss)


@requires_cuda
@pytest.mark.parametrize("mode,on_policy", [(None, False), ("token_mask", True), ("sequence_truncate", False),
                                            ("sequence_mask", True)])
def test_vespo_cpu_equals_cuda(mode, on_policy):
    logits, target, _, advantages, old, rollout, ref = make_batch(6, 40, 3001, torch.float32, "cpu")
    options = _options(mode, rollout, ref, True, 0.01)
    results = {}
    for dev in ("cpu", "cuda"):
        x = logits.detach().to(dev, copy=True).requires_grad_()
        opts = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        out = rl_losses.grpo_loss(x, target.to(dev), advantages.to(dev), None if on_policy else old.to(dev), **opts)
        out.loss.backward()
        results[dev] = (out.loss.detach().cpu(), x.grad.cpu(), out.vespo_phi_seq_mean.cpu())
    # φ's log w sums 40 token log-probs of |lp| ~ 8 (and φ moves by (k − λ·w)·δ log w): the two devices' fp32
    # log-probs, a few ulps apart each, move φ by up to ~1e-4 relative. Hence 10× the fp32 tolerance.
    assert_close(results["cuda"][0], results["cpu"][0], torch.float32, scale=10.0)
    assert_grad_close(results["cuda"][1], results["cpu"][1].double(), torch.float32, scale=10.0)
    assert_close(results["cuda"][2], results["cpu"][2], torch.float32, scale=10.0)


# ---- GSPO: the documents are the sequences ---------------------------------------------------------------------------
GSPO_CASES = {
    "document": dict(),
    "token_weighting_sequence_mask": dict(weighting="token", rollout="sequence_mask"),
    "token_advantages_token_truncate_on_policy": dict(token_advantages=True, rollout="token_truncate",
                                                       on_policy=True),
    "per_document_advantages_kl_entropy": dict(per_document_advantages=True, kl=True, entropy=0.03),
    "label_counts_sequence_truncate": dict(label_counts=True, rollout="sequence_truncate", kl=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("name", list(GSPO_CASES))
def test_gspo_vespo_matches_reference(name, dtype, device):
    case = GSPO_CASES[name]
    logits, target, _, _, old, rollout, ref = make_batch(3, 8, 211, dtype, device)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2], device=device)
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(4, device=device) if case.get("per_document_advantages") else torch.randn(
        3, 8, device=device)
    options = _options(case.get("rollout"), rollout, ref, case.get("kl", False), case.get("entropy", 0.0))
    options.update(weighting=case.get("weighting", "document"), token_advantages=case.get("token_advantages", False),
                   num_documents=4)
    if case.get("label_counts"):
        on = ((target >= 0) & (doc >= 0)).double().view(-1)
        counts = torch.zeros(4, dtype=torch.float64, device=device).index_add_(0, doc.clamp_min(0).view(-1), on)
        options["label_counts"] = counts[doc.clamp_min(0)].float()
    old_arg = None if case.get("on_policy") else old
    x = logits.clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old_arg, doc, **options)
    (1.3 * out.loss).backward()
    x64 = logits.double().requires_grad_()
    expected = reference.gspo_loss(x64, target, advantages.double(), None if old_arg is None else old.double(), doc,
                                   **_double(options))
    (1.3 * expected.loss).backward()
    scale = 1.0 if dtype == torch.float32 else 3.0
    assert_close(out.loss.detach(), expected.loss.detach(), dtype)
    assert_grad_close(x.grad, x64.grad, dtype)
    for name in ("vespo_phi_seq_mean", "kl", "rollout_weight_mean", "entropy"):
        a, e = getattr(out, name), getattr(expected, name)
        assert (a is None) == (e is None), name
        if a is not None:
            assert_close(a, e, dtype, scale=scale, msg=name)
    assert_close(out.document_ratios, expected.document_ratios, dtype)


# ---- the fused lm_head ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_linear_vespo(chunk_size, device):
    # Chunks of 7 rows cut through the sequences of 9 tokens: the statistics of a sequence come from two chunks.
    b, t, h_dim, vocab = 3, 9, 16, 41
    hidden = torch.randn(b, t, h_dim, dtype=torch.float64, device=device)
    weight = torch.randn(vocab, h_dim, dtype=torch.float64, device=device) * 0.5
    logits = hidden @ weight.T
    _, target, _, advantages, old, rollout, ref = make_batch(b, t, vocab, torch.float64, device)
    target = torch.where(target >= 0, target.clamp_max(vocab - 1), target)
    old = (label_log_probs64(logits, target) + 0.1 * torch.randn(b, t, dtype=torch.float64, device=device))
    options = _double(_options("token_mask", rollout, ref, True, 0.02))
    for fn, ref_fn, extra in ((rl_losses.linear_grpo_loss, reference.grpo_loss, {}),
                              (rl_losses.linear_gspo_loss, reference.gspo_loss, None)):
        args = (target, advantages.double(), old)
        if extra is None:
            doc = torch.arange(b * t, device=device).view(b, t) // 5
            doc = torch.where(target >= 0, doc, -1)
            args = args + (doc,)
            extra = dict(num_documents=int(doc.max()) + 1)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(hh, ww, *args, chunk_size=chunk_size, **options, **extra)
        out.loss.backward()
        x = logits.clone().requires_grad_()
        expected = ref_fn(x, *args, **options, **extra)
        expected.loss.backward()
        assert_close(out.loss, expected.loss, torch.float64)
        assert_close(out.vespo_phi_seq_mean, expected.vespo_phi_seq_mean, torch.float64)
        assert_close(hh.grad, x.grad @ weight, torch.float64)
        assert_close(ww.grad, x.grad.reshape(-1, vocab).T @ hidden.reshape(-1, h_dim), torch.float64)


# ---- opcheck, torch.compile, bad options -----------------------------------------------------------------------------
OPCHECK = {
    "grpo_token_truncate": (dict(rollout_correction="token_truncate"), False),
    "grpo_on_policy_sequence_mask_rows": (dict(rollout_correction="sequence_mask"), True),
    "grpo_documents_kl_entropy": (dict(document_index=True, beta=0.1, kl_importance_weighted=True,
                                       entropy_coefficient=0.05), False),
    "gspo_sequence_truncate": (dict(gspo=True, rollout_correction="sequence_truncate"), False),
    "gspo_on_policy_iw_kl": (dict(gspo=True, beta=0.1, kl_importance_weighted=True), True),
}


@pytest.mark.parametrize("case", list(OPCHECK))
def test_opcheck(case, device):
    logits, target, _, advantages, old, rollout, ref = make_batch(3, 5, 11, torch.float32, device)
    kwargs, on_policy = dict(OPCHECK[case][0]), OPCHECK[case][1]
    kwargs.update(loss_type="vespo", **VESPO)
    if "rollout_correction" in kwargs:
        kwargs["rollout_log_probs"] = rollout
    if kwargs.get("beta"):
        kwargs["ref_log_probs"] = ref
    doc = torch.tensor([[0, 0, 0, 1, 1], [1, 2, 2, 2, 2], [3, 3, 3, 3, -1]], device=device)
    args = (logits.clone().requires_grad_(), target, advantages, None if on_policy else old)
    if kwargs.pop("gspo", False):
        torch.library.opcheck(_ops.gspo.default, args + (doc,), dict(kwargs, num_documents=4))
    else:
        if kwargs.pop("document_index", False):
            kwargs["document_index"] = doc
        torch.library.opcheck(_ops.grpo.default, args, kwargs)


def test_compile_fullgraph(device):
    logits, target, _, advantages, old, rollout, ref = make_batch(3, 6, 40, torch.float32, device)

    def fn(x, target, advantages, old, rollout):
        out = rl_losses.grpo_loss(x, target, advantages, old, loss_type="vespo", rollout_log_probs=rollout,
                                  rollout_correction="token_mask", entropy_coefficient=0.01, **VESPO)
        return out.loss, out.vespo_phi_seq_mean, out.rollout_weight_mean

    assert_compiled_matches_eager(fn, logits, target, advantages, old, rollout, backend="aot_eager")


BAD = {
    "k_pos": (dict(vespo_k_pos=math.inf), "vespo_k_pos must be finite, got inf"),
    "k_neg": (dict(vespo_k_neg=math.nan), "vespo_k_neg must be finite, got nan"),
    "lambda_pos": (dict(vespo_lambda_pos=-1.0), r"vespo_lambda_pos must be a finite value >= 0 \(TRL raises it to "
                                                r"1e-4\), got -1"),
    "lambda_neg": (dict(vespo_lambda_neg=math.inf), "vespo_lambda_neg must be a finite value >= 0"),
    "delta": (dict(delta=1.5), "delta .* applies to loss_type 'ppo_clip' only"),
    "loss_type": (dict(loss_type="vespo2"), "loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', 'dro', "
                                            "'dppo_tv', 'dppo_kl', 'geo_mean', 'clip_cov' or 'kl_cov', got 'vespo2'"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("meta", [False, True], ids=["real", "fake"])
def test_bad_options(name, meta):
    """Each bad argument is refused with the same message by the op and by its fake kernel (meta tensors)."""
    dev = "meta" if meta else "cpu"
    logits, target, _, advantages, old, _, _ = make_batch(2, 4, 10, torch.float32, "cpu")
    kwargs, message = BAD[name]
    kwargs = dict(dict(loss_type="vespo"), **kwargs)
    with pytest.raises((RuntimeError, ValueError), match=message):
        _ops.grpo(logits.to(dev), target.to(dev), advantages.to(dev), old.to(dev), **kwargs)


def test_vespo_needs_the_sequences():
    logits, target, _, advantages, old, _, _ = make_batch(2, 4, 10, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="loss_type 'vespo' needs the sequences: pass document_index"):
        rl_losses.grpo_loss(logits.reshape(8, 10), target.reshape(-1), advantages.repeat_interleave(4),
                            old.reshape(-1), loss_type="vespo")
