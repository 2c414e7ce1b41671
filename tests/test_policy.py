"""Tests of the policy-loss family on the GRPO op (docs/policy_losses.md): loss types, rollout correction, KL
estimators, entropy bonus, on-policy mode and per-sequence advantages, each against the float64 reference
(rl_losses.reference.grpo_loss), with every metric; the option grid is covered pairwise, not as a product.
"""
import itertools

import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import DEVICES, assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, label_log_probs64,
                     make_logits, param_id as _id)

_ops = torch.ops.rl_losses


@pytest.fixture(autouse=True, params=DEVICES)
def device(request):
    """Every test on every device: the tensors it creates default to that device."""
    with torch.device(request.param):
        yield request.param


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "log_probs", "ratio_mean",
           "entropy", "kl", "rollout_ratio_mean", "rollout_weight_mean", "rollout_corrected_fraction")

# ---- the option grid ----------------------------------------------------------------------------------------
# Every value of each factor, and every pair of values of two factors, appears in at least one case.
FACTORS = {
    "loss_type": ["ppo_clip", "cispo", "sapo", "vespo"],
    "rollout": [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
    "kl": [None, "k1", "k2", "k3", "k3_weighted"],
    "on_policy": [False, True],
    "entropy": [0.0, 0.03],
    "preset": ["token_mean", "sequence_mean_token_mean", "sequence_sum_constant", "luspo"],
}


def _pairwise(factors: dict) -> list:
    """A small set of cases holding every pair of values of every two factors (greedy, deterministic)."""
    names = list(factors)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    cases = []
    while uncovered:
        best, best_gain = None, -1
        # Candidates: each uncovered pair completed greedily factor by factor.
        for a, va, b, vb in sorted(uncovered, key=str)[:40]:
            case = {a: va, b: vb}
            for n in names:
                if n in case:
                    continue
                case[n] = max(factors[n], key=lambda v: sum(
                    (m, case[m], n, v) in uncovered or (n, v, m, case[m]) in uncovered for m in case))
            gain = sum((x, case[x], y, case[y]) in uncovered for x, y in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = case, gain
        cases.append(best)
        uncovered -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(names, 2)}
    return cases


CASES = _pairwise(FACTORS)


def _case_id(case):
    return "-".join(f"{v}" for v in case.values())


def make_batch(b, t, vocab, dtype, *, per_sequence_advantages=True, spread=0.3):
    """A padded (B, T) batch: logits, labels (-100 on padding), per-sequence advantages (B,), and old, rollout
    and reference log-probs near the current ones so that the ratios fall on both sides of every bound."""
    logits = make_logits((b, t), vocab, dtype, torch.get_default_device())
    lengths = torch.randint(1, t + 1, (b,))
    lengths[0] = t
    pad = torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)
    target = torch.where(pad, -100, torch.randint(0, vocab, (b, t)))
    lp = label_log_probs64(logits, target)
    advantages = torch.randn(b) if per_sequence_advantages else torch.randn(b, t)
    old = (lp + spread * torch.randn(b, t, dtype=torch.float64)).float()
    rollout = (old.double() + spread * torch.randn(b, t, dtype=torch.float64)).float()
    ref = (lp + 0.2 * torch.randn(b, t, dtype=torch.float64)).float()
    return logits, target, advantages, old, rollout, ref


def case_options(case, target, old, rollout, ref, max_length):
    opts = dict(loss_type=case["loss_type"], entropy_coefficient=case["entropy"])
    if case["loss_type"] == "cispo":
        opts["epsilon_high"] = 1.1  # TRL's cap is epsilon_high itself: put it inside the ratios' range
    if case["loss_type"] == "sapo":
        opts.update(sapo_temperature_pos=1.3, sapo_temperature_neg=0.7)
    if case["loss_type"] == "vespo":
        opts.update(vespo_k_pos=1.6, vespo_lambda_pos=2.2, vespo_k_neg=2.7, vespo_lambda_neg=1.4)
    if case["rollout"] is not None:
        opts.update(rollout_log_probs=rollout, rollout_correction=case["rollout"], rollout_cap=1.2)
        if case["rollout"].endswith("mask"):
            opts["rollout_mask_bounds"] = (0.8, 1.25)
    if case["kl"] is not None:
        opts.update(ref_log_probs=ref, beta=0.07, kl_estimator=case["kl"][:2],
                    kl_importance_weighted=case["kl"].endswith("weighted"))
    weights, divisor = rl_losses.aggregation.aggregation_weights(
        case["preset"], completion_mask=target >= 0, max_completion_length=max_length)
    opts.update(loss_weights=weights, divisor=divisor)
    return opts, (None if case["on_policy"] else old)


def run_both(logits, target, advantages, old, upstream=1.0, **opts):
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old, **opts)
    (out.loss * upstream).backward()
    x64 = logits.detach().double().requires_grad_()
    opts64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in opts.items()}
    ref = reference.grpo_loss(x64, target, advantages.double(), None if old is None else old.double(), **opts64)
    (ref.loss * upstream).backward()
    return out, x.grad, ref, x64.grad


def assert_matches(out, grad, ref, ref_grad, dtype, *, metric_scale=1.0):
    assert_close(out.loss.detach(), ref.loss.detach(), dtype, msg="loss")
    for name in METRICS:
        actual, expected = getattr(out, name), getattr(ref, name)
        assert (actual is None) == (expected is None), (name, actual, expected)
        if actual is not None:
            assert not actual.requires_grad, f"{name} must be detached"
            assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
            assert_close(actual, expected, dtype, scale=metric_scale, msg=f"metric {name}")
    assert_grad_close(grad, ref_grad, dtype)
    assert out.trl_metrics().keys() == ref.trl_metrics().keys()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_option_grid_matches_reference(case):
    logits, target, advantages, old, rollout, ref = make_batch(5, 13, 300, torch.float32)
    opts, old_arg = case_options(case, target, old, rollout, ref, max_length=13)
    out, grad, expected, ref_grad = run_both(logits, target, advantages, old_arg, upstream=1.7, **opts)
    assert_matches(out, grad, expected, ref_grad, torch.float32)
    assert torch.count_nonzero(grad[target < 0]) == 0, "padding tokens must get a zero gradient"


# Low precision: one case per loss type with most options on.
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "cispo", "sapo", "vespo"])
def test_dtypes(loss_type, dtype):
    logits, target, advantages, old, rollout, ref = make_batch(3, 11, 517, dtype)
    case = dict(loss_type=loss_type, rollout="token_truncate", kl="k3_weighted", on_policy=False, entropy=0.02,
                preset="sequence_mean_token_mean")
    opts, old_arg = case_options(case, target, old, rollout, ref, max_length=11)
    out, grad, expected, ref_grad = run_both(logits, target, advantages, old_arg, **opts)
    # The clip/cap decisions of tokens near a bound may flip between a rounded and a float64 ratio: the
    # fractions of such tokens move by 1/N.
    assert_matches(out, grad, expected, ref_grad, dtype, metric_scale=1.0 if dtype == torch.float32 else 3.0)


def test_on_policy_is_the_old_ratio_at_one():
    # old_log_probs=None equals passing the current log-probs as old (same loss, gradient A·∇lp).
    logits, target, advantages, _, _, _ = make_batch(4, 9, 64, torch.float64)
    old = label_log_probs64(logits, target)
    for loss_type in ("ppo_clip", "cispo", "sapo", "vespo"):
        a = run_both(logits, target, advantages, None, loss_type=loss_type)
        b = run_both(logits, target, advantages, old, loss_type=loss_type)
        assert_close(a[0].loss, b[0].loss, torch.float64)
        assert_close(a[1], b[1], torch.float64)
        assert_close(a[0].ratio_mean, torch.tensor(1.0, dtype=torch.float64), torch.float64)


def test_documents_split_rows_sequence_rollout():
    # Sequence-level correction over packed documents (document_index), a document spanning two rows.
    logits, target, advantages, old, rollout, _ = make_batch(3, 8, 50, torch.float32, per_sequence_advantages=False)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2])
    target = torch.where(doc < 0, -100, target)
    for mode in ("sequence_truncate", "sequence_mask"):
        out, grad, expected, ref_grad = run_both(
            logits, target, advantages, old, rollout_log_probs=rollout, rollout_correction=mode, rollout_cap=1.1,
            document_index=doc)
        assert_matches(out, grad, expected, ref_grad, torch.float32)


def test_entropy_bonus_gradcheck():
    logits, target, advantages, old, rollout, ref = make_batch(2, 5, 7, torch.float64)
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.grpo_loss(
        t, target, advantages, old, loss_type="sapo", entropy_coefficient=0.3, ref_log_probs=ref, beta=0.1,
        kl_estimator="k2").loss, x)


def test_overflowing_ratio_gives_finite_gradient():
    # A token whose ratio overflows fp32 and is clipped (A > 0), capped, or gated contributes an exact zero.
    logits = make_logits((4,), 16, torch.float32, torch.get_default_device())
    target = torch.tensor([1, 2, 3, 4])
    lp = label_log_probs64(logits, target).float()
    old = lp - torch.tensor([200.0, 0.0, 0.0, 0.0])  # r = exp(200) = inf in fp32 for the first token
    advantages = torch.tensor([1.0, 0.5, -0.5, 1.0])
    for loss_type in ("ppo_clip", "sapo"):
        x = logits.clone().requires_grad_()
        rl_losses.grpo_loss(x, target, advantages, old, loss_type=loss_type).loss.backward()
        assert torch.isfinite(x.grad).all(), loss_type
        assert torch.count_nonzero(x.grad[0]) == 0, loss_type


# ---- bad options ------------------------------------------------------------------------------------------------
def _errors(target, old, rollout):
    return {
        "loss_type": (dict(loss_type="grpo"), "loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', 'dro', "
                                              "'dppo_tv', 'dppo_kl', 'geo_mean', 'clip_cov' or 'kl_cov', got 'grpo'"),
        "sapo_temperature_pos": (dict(loss_type="sapo", sapo_temperature_pos=0.0),
                                 "sapo_temperature_pos must be a finite value > 0, got 0"),
        "sapo_temperature_neg": (dict(loss_type="sapo", sapo_temperature_neg=-1.0),
                                 "sapo_temperature_neg must be a finite value > 0, got -1"),
        "cispo_delta": (dict(loss_type="cispo", delta=1.5), "delta .* applies to loss_type 'ppo_clip' only"),
        "rollout_without_logprobs": (dict(rollout_correction="token_truncate"),
                                     "rollout_correction = 'token_truncate' needs rollout_log_probs"),
        "rollout_mode": (dict(rollout_correction="tokens", rollout_log_probs=rollout),
                         "rollout_correction must be None, 'token_truncate'"),
        "logprobs_without_rollout": (dict(rollout_log_probs=rollout), "rollout_log_probs given without"),
        "bounds_order": (dict(rollout_correction="token_mask", rollout_log_probs=rollout,
                              rollout_mask_bounds=(2.0, 0.5)), r"lo < hi, got \(2, 0.5\)"),
        "bounds_with_truncate": (dict(rollout_correction="token_truncate", rollout_log_probs=rollout,
                                      rollout_mask_bounds=(0.5, 2.0)), "apply to the '\\*_mask' modes"),
        "rollout_cap": (dict(rollout_correction="token_truncate", rollout_log_probs=rollout, rollout_cap=0.0),
                        "rollout_cap must be a finite value > 0, got 0"),
        "kl_estimator": (dict(kl_estimator="k4"), "kl_estimator must be 'k1', 'k2' or 'k3', got 'k4'"),
        "entropy_coefficient": (dict(entropy_coefficient=float("nan")), "entropy_coefficient must be finite"),
        "sequence_without_rows": (dict(rollout_correction="sequence_mask", rollout_log_probs=rollout.reshape(-1)),
                                  "needs the sequences: pass document_index"),
        "document_index_without_sequence": (dict(document_index=torch.zeros_like(target)),
                                            "document_index groups the tokens of a sequence-level rollout_correction, "
                                            "of loss_type 'vespo'"),
        "rollout_shape": (dict(rollout_correction="token_mask", rollout_log_probs=rollout[:, :3]),
                          "rollout_log_probs has shape"),
        "advantages_shape": (dict(advantages=torch.randn(3)), "advantages has shape"),
    }


@pytest.mark.parametrize("name", list(_errors(torch.zeros(1), None, torch.zeros(1, 4))))
def test_bad_options(name):
    logits, target, advantages, old, rollout, _ = make_batch(2, 4, 10, torch.float32)
    kwargs, message = _errors(target, old, rollout)[name]
    advantages = kwargs.pop("advantages", advantages)
    if name == "sequence_without_rows":
        logits, target, advantages, old = logits.reshape(8, 10), target.reshape(-1), advantages.repeat(4), \
            old.reshape(-1)
    with pytest.raises((RuntimeError, ValueError), match=message):
        rl_losses.grpo_loss(logits, target, advantages, old, **kwargs)


# ---- opcheck and torch.compile -----------------------------------------------------------------------------------
OPCHECK = {
    "cispo_rollout": dict(loss_type="cispo", epsilon_high=1.1, rollout_correction="token_truncate"),
    "sapo_kl_entropy": dict(loss_type="sapo", beta=0.1, kl_estimator="k1", kl_importance_weighted=True,
                            entropy_coefficient=0.05),
    "on_policy_sequence_mask": dict(rollout_correction="sequence_mask", rollout_mask_bounds=[0.5, 1.5],
                                    on_policy=True),
}


@pytest.mark.parametrize("case", list(OPCHECK))
def test_opcheck(case):
    logits, target, advantages, old, rollout, ref = make_batch(3, 5, 11, torch.float32)
    kwargs = dict(OPCHECK[case])
    if kwargs.pop("on_policy", False):
        old = None
    if "rollout_correction" in kwargs:
        kwargs["rollout_log_probs"] = rollout
    if kwargs.get("beta"):
        kwargs["ref_log_probs"] = ref
    torch.library.opcheck(_ops.grpo.default, (logits.clone().requires_grad_(), target, advantages, old), kwargs)


def test_compile_fullgraph():
    logits, target, advantages, old, rollout, ref = make_batch(3, 6, 40, torch.float32)

    def fn(x, target, advantages, rollout, ref):
        out = rl_losses.grpo_loss(x, target, advantages, None, loss_type="sapo", rollout_log_probs=rollout,
                                  rollout_correction="token_mask", ref_log_probs=ref, beta=0.05,
                                  kl_estimator="k2", entropy_coefficient=0.01)
        return out.loss, out.kl, out.rollout_weight_mean, out.entropy

    assert_compiled_matches_eager(fn, logits, target, advantages, rollout, ref, backend="aot_eager")


# ---- GSPO: the family at the sequence ratio ------------------------------------------------------------------------
GSPO_CASES = {
    "cispo_token_rollout_k1": dict(loss_type="cispo", epsilon_high=1.05, rollout="token_truncate", kl="k1"),
    "sapo_sequence_mask_entropy": dict(loss_type="sapo", rollout="sequence_mask", entropy=0.04,
                                       weighting="token"),
    "ppo_on_policy_k3_weighted": dict(loss_type="ppo_clip", on_policy=True, kl="k3_weighted", entropy=0.02,
                                      rollout="sequence_truncate"),
    "ppo_k2_document_advantages": dict(kl="k2", per_document_advantages=True, rollout="token_mask",
                                       token_advantages=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("name", list(GSPO_CASES))
def test_gspo_matches_reference(name, dtype):
    case = GSPO_CASES[name]
    logits, target, _, old, rollout, ref = make_batch(3, 8, 211, dtype)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2])
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(4) if case.get("per_document_advantages") else torch.randn(3, 8)
    opts = dict(loss_type=case.get("loss_type", "ppo_clip"), entropy_coefficient=case.get("entropy", 0.0),
                weighting=case.get("weighting", "document"), token_advantages=case.get("token_advantages", False),
                num_documents=4)
    if "epsilon_high" in case:
        opts["epsilon_high"] = case["epsilon_high"]
    if case.get("rollout"):
        opts.update(rollout_log_probs=rollout, rollout_correction=case["rollout"], rollout_cap=1.15)
    if case.get("kl"):
        opts.update(ref_log_probs=ref, beta=0.08, kl_estimator=case["kl"][:2],
                    kl_importance_weighted=case["kl"].endswith("weighted"))
    old_arg = None if case.get("on_policy") else old
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old_arg, doc, **opts)
    (1.3 * out.loss).backward()
    x64 = logits.detach().double().requires_grad_()
    opts64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in opts.items()}
    expected = reference.gspo_loss(x64, target, advantages.double(), None if old_arg is None else old.double(), doc,
                                   **opts64)
    (1.3 * expected.loss).backward()
    assert_matches(out, x.grad, expected, x64.grad, dtype, metric_scale=1.0 if dtype == torch.float32 else 3.0)
    assert_close(out.document_ratios, expected.document_ratios, dtype)


# ---- the fused lm_head ops take the same options ---------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_linear_grpo_options(chunk_size):
    # Chunks of 7 rows cut through the sequences of 9 tokens: the on-policy sequence-level correction reads the
    # statistics of a sequence's rows from two chunks.
    b, t, h_dim, vocab = 3, 9, 16, 41
    hidden = torch.randn(b, t, h_dim, dtype=torch.float64)
    weight = torch.randn(vocab, h_dim, dtype=torch.float64) * 0.5
    logits = hidden @ weight.T
    _, target, advantages, old, rollout, ref = make_batch(b, t, vocab, torch.float64)
    target = torch.where(target >= 0, target.clamp_max(vocab - 1), target)
    opts = dict(loss_type="sapo", rollout_log_probs=rollout, rollout_correction="sequence_truncate", rollout_cap=1.1,
                ref_log_probs=ref, beta=0.05, kl_estimator="k1", kl_importance_weighted=True, entropy_coefficient=0.03)
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rl_losses.linear_grpo_loss(hh, ww, target, advantages, None, chunk_size=chunk_size, **opts)
    out.loss.backward()
    x = logits.clone().requires_grad_()
    expected = reference.grpo_loss(x, target, advantages.double(), None, **opts)
    expected.loss.backward()
    assert_close(out.loss, expected.loss, torch.float64)
    for name in ("kl", "rollout_weight_mean", "rollout_corrected_fraction", "entropy"):
        assert_close(getattr(out, name), getattr(expected, name), torch.float64, msg=name)
    assert_close(hh.grad, x.grad @ weight, torch.float64)
    assert_close(ww.grad, x.grad.reshape(-1, vocab).T @ hidden.reshape(-1, h_dim), torch.float64)


def test_linear_gspo_options():
    n, h_dim, vocab = 23, 12, 37
    doc = torch.tensor([0] * 7 + [1] * 9 + [2] * 4 + [-1] * 3)
    hidden = torch.randn(n, h_dim, dtype=torch.float64)
    weight = torch.randn(vocab, h_dim, dtype=torch.float64) * 0.5
    logits = hidden @ weight.T
    target = torch.where(doc < 0, -100, torch.randint(0, vocab, (n,)))
    lp = label_log_probs64(logits, target)
    old = lp + 0.1 * torch.randn(n, dtype=torch.float64)
    rollout = old + 0.2 * torch.randn(n, dtype=torch.float64)
    opts = dict(loss_type="cispo", epsilon_high=1.05, rollout_log_probs=rollout, rollout_correction="token_mask",
                rollout_mask_bounds=(0.8, 1.2), entropy_coefficient=0.02, num_documents=3)
    advantages = torch.randn(3, dtype=torch.float64)  # per document
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rl_losses.linear_gspo_loss(hh, ww, target, advantages, old, doc, chunk_size=5, **opts)
    out.loss.backward()
    x = logits.clone().requires_grad_()
    expected = reference.gspo_loss(x, target, advantages, old, doc, **opts)
    expected.loss.backward()
    assert_close(out.loss, expected.loss, torch.float64)
    assert_close(out.rollout_weight_mean, expected.rollout_weight_mean, torch.float64)
    assert_close(hh.grad, x.grad @ weight, torch.float64)
