"""The fused head's policy terms with the policy family's per-token options (loss types, the rollout-engine
correction with rollout_log_probs: token_truncate, token_mask with IcePop's bounds, the decoupled three-policy form;
the KL estimators; verl's rollout rejection rollout_rs, token and sequence modes; GSPO's term the sequence-level
correction and geo_mean too): the head equals grpo_loss /
gspo_loss with the same options beside CE and the z-loss, and the float64 reference; what a term cannot take is
refused by the real op and by its fake kernel with the same message."""
import math

import pytest
import torch

import rl_losses
from rl_losses import reference
from rl_losses.fused_head import fused_head_loss

from conftest import assert_close
from helpers import assert_fake_rejects_like_real, assert_grad_close, label_log_probs64, make_logits, make_target

_ops = torch.ops.rl_losses
WEIGHTS = dict(label_weight=0.7, z_loss_weight=0.3)

# The options of each case (rollout_log_probs: the behaviour policy's, given where a correction is named).
GRPO_CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "gpg": dict(loss_type="gpg"),
    "dro": dict(loss_type="dro", dro_beta=0.7),
    "dppo_tv": dict(loss_type="dppo_tv", epsilon_low=0.03, epsilon_high=0.025, clip_ratio_c=1.5),
    "dppo_kl": dict(loss_type="dppo_kl", epsilon_low=0.004, epsilon_high=0.003, clip_ratio_c=1.5),
    "token_truncate": dict(rollout_correction="token_truncate", rollout_cap=1.1),
    "icepop": dict(rollout_correction="token_mask", rollout_mask_bounds=(0.8, 1.25)),
    "decoupled": dict(rollout_correction="token_mask", rollout_mask_bounds=(0.0, 1.3), delta=2.0),
    "kl_k2_weighted": dict(kl_estimator="k2", kl_importance_weighted=True, beta=0.05),
    "kl_k1_cispo_truncate": dict(loss_type="cispo", epsilon_high=2.0, kl_estimator="k1", beta=0.1,
                                 rollout_correction="token_truncate", rollout_cap=1.05),
    "rs_token_k1": dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25", loss_weights=True),
    # a sequence mode over the rows of the (B, T) labels, beside IcePop's mask
    "rs_seq_mean_k2_icepop": dict(rollout_rs="seq_mean_k2", rollout_rs_threshold="0.05",
                                  rollout_correction="token_mask", rollout_mask_bounds=(0.7, 1.4)),
}
GSPO_CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.5),
    "sapo": dict(loss_type="sapo"),
    "geo_mean": dict(loss_type="geo_mean", epsilon_low=0.1, epsilon_high=0.12),
    "token_truncate": dict(rollout_correction="token_truncate", rollout_cap=1.1),
    "sequence_truncate": dict(rollout_correction="sequence_truncate", rollout_cap=1.2),
    "sequence_mask": dict(rollout_correction="sequence_mask", rollout_mask_bounds=(0.5, 1.5)),
    "kl_weighted": dict(kl_estimator="k2", kl_importance_weighted=True, beta=0.05),
    "rs_token_k3": dict(rollout_rs="token_k3", rollout_rs_threshold="0.02"),
    "rs_seq_sum_k1_truncate": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.2_5.0",
                                   rollout_correction="sequence_truncate", rollout_cap=1.5),
}


def make_inputs(shape, vocab, dtype, device, documents=4):
    """Logits and labels (30% unlabelled), advantages, old / reference / rollout log-probs near the current ones
    (the rollout ratios reach the cases' bounds), packed documents over the flattened tokens (the last two padding)."""
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=0.3)
    lp = label_log_probs64(logits, target)
    near = lambda scale: (lp + scale * torch.randn(shape, device=device, dtype=torch.float64)).float()  # noqa: E731
    n = target.numel()
    doc = (torch.arange(n, device=device) * documents // (n - 2)).clamp_max(documents - 1)
    doc[-2:] = -1
    return dict(logits=logits, target=target, advantages=torch.randn(shape, device=device), old_log_probs=near(0.2),
                ref_log_probs=near(0.2), rollout=near(0.25), document_index=doc.view(shape),
                weights=torch.rand(shape, device=device))


def _policy(inputs, options):
    """The case's options with the tensors it names."""
    out = dict(options)
    if "rollout_correction" in out or "rollout_rs" in out:
        out["rollout_log_probs"] = inputs["rollout"]
    if out.pop("loss_weights", False):
        out["loss_weights"] = inputs["weights"]
    if out.get("beta"):
        out["ref_log_probs"] = inputs["ref_log_probs"]
    return out


def _separate(mod, x, i, term, options, documents):
    """label_weight·CE + z_loss_weight·Z + the policy op with the options (rl_losses or its float64 reference)."""
    t = i["target"]
    total = WEIGHTS["label_weight"] * mod.cross_entropy(x, t) + WEIGHTS["z_loss_weight"] * mod.z_loss(x)
    if term == "grpo":
        policy = mod.grpo_loss(x, t, i["advantages"], i["old_log_probs"], **options)
    else:
        policy = mod.gspo_loss(x, t, i["advantages"], i["old_log_probs"], i["document_index"],
                               num_documents=documents, **options)
    return total + 1.4 * policy.loss, policy.loss


def _to64(options):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in options.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("term,case", [("grpo", c) for c in GRPO_CASES] + [("gspo", c) for c in GSPO_CASES])
def test_equals_the_policy_op_with_the_same_options(term, case, dtype, device):
    documents = 4
    i = make_inputs((3, 41), 97, dtype, device, documents)
    options = _policy(i, (GRPO_CASES if term == "grpo" else GSPO_CASES)[case])
    head_options = dict(options, **{f"{term}_weight": 1.4}, advantages=i["advantages"],
                        old_log_probs=i["old_log_probs"], **WEIGHTS)
    if term == "gspo":
        head_options.update(document_index=i["document_index"], num_documents=documents)
    x = i["logits"].clone().requires_grad_()
    out = fused_head_loss(x, i["target"], **head_options)
    (grad,) = torch.autograd.grad(out.loss, x)
    # The separate ops on the same values in fp32 (in bf16 their gradient would be a sum of rounded terms, which
    # may cancel) and the float64 reference.
    y = i["logits"].float().requires_grad_()
    total, policy = _separate(rl_losses, y, i, term, options, documents)
    (expected,) = torch.autograd.grad(total, y)
    assert_close(getattr(out, f"{term}_loss"), policy.detach(), torch.float32, scale=4.0)
    assert_close(out.loss.detach(), total.detach(), torch.float32, scale=4.0)
    assert_grad_close(grad, expected, dtype, scale=2.0)
    z = i["logits"].double().requires_grad_()
    total64, policy64 = _separate(reference, z, _to64(i), term, _to64(options), documents)
    ref = reference.fused_head_loss(i["logits"].double(), i["target"], **_to64(head_options))
    torch.testing.assert_close(ref.loss, total64.detach(), rtol=1e-12, atol=1e-12)  # the reference's own two forms
    (grad64,) = torch.autograd.grad(total64, z)
    assert_close(getattr(out, f"{term}_loss"), policy64.detach(), dtype, scale=4.0)
    assert_close(out.loss.detach(), total64.detach(), dtype, scale=4.0)
    assert_grad_close(grad, grad64, dtype, scale=8.0 if dtype == torch.bfloat16 else 2.0)


@pytest.mark.parametrize("mode", ["seq_mean_k2", "seq_max_k3"])
def test_grpo_sequence_rejection_over_packed_documents(mode, device):
    """A packed 1-D batch: the GRPO term's sequence rejection groups its tokens by document_index, as grpo_loss and
    the float64 reference do (not by rows)."""
    documents = 4
    i = make_inputs((123,), 97, torch.float32, device, documents)
    # A threshold between the documents' statistics (k2 = δ²/2, k3 = e^δ − 1 − δ, δ = old − rollout): half of them
    # are rejected, and one document over the whole batch would be judged otherwise.
    delta = (i["old_log_probs"] - i["rollout"]).double()
    per_token = 0.5 * delta**2 if mode.endswith("k2") else torch.exp(delta) - 1 - delta
    labelled = i["target"] >= 0
    stats = sorted(float(per_token[labelled & (i["document_index"] == d)].mean() if mode.startswith("seq_mean")
                         else per_token[labelled & (i["document_index"] == d)].max()) for d in range(documents))
    options = dict(rollout_rs=mode, rollout_rs_threshold=f"{(stats[1] + stats[2]) / 2:.6g}",
                   rollout_log_probs=i["rollout"])
    docs = dict(document_index=i["document_index"], num_documents=documents)
    x = i["logits"].clone().requires_grad_()
    out = fused_head_loss(x, i["target"], grpo_weight=1.0, advantages=i["advantages"],
                          old_log_probs=i["old_log_probs"], **docs, **options)
    (grad,) = torch.autograd.grad(out.loss, x)
    y = i["logits"].clone().requires_grad_()
    policy = rl_losses.grpo_loss(y, i["target"], i["advantages"], i["old_log_probs"], **docs, **options)
    (expected,) = torch.autograd.grad(policy.loss, y)
    assert_close(out.grpo_loss, policy.loss.detach(), torch.float32)
    assert_grad_close(grad, expected, torch.float32)
    ref = reference.fused_head_loss(i["logits"].double(), i["target"], grpo_weight=1.0, **_to64(dict(
        advantages=i["advantages"], old_log_probs=i["old_log_probs"], **docs, **options)))
    assert_close(out.grpo_loss, ref.grpo_loss, torch.float32)
    one = dict(docs, document_index=i["document_index"].clamp_max(0))  # one document (and the padding)
    other = fused_head_loss(i["logits"], i["target"], grpo_weight=1.0, advantages=i["advantages"],
                            old_log_probs=i["old_log_probs"], **one, **options)
    assert float(other.grpo_loss) != float(out.grpo_loss)  # the grouping matters on these inputs


def test_the_options_change_the_term(device):
    """The cases reach their options: each term differs from the plain one (ppo_clip, no correction)."""
    i = make_inputs((3, 41), 97, torch.float32, device)
    plain = {}
    for term, cases in (("grpo", GRPO_CASES), ("gspo", GSPO_CASES)):
        for case, options in cases.items():
            kwargs = dict(advantages=i["advantages"], old_log_probs=i["old_log_probs"], **{f"{term}_weight": 1.0})
            if term == "gspo":
                kwargs.update(document_index=i["document_index"], num_documents=4)
            if term not in plain:
                plain[term] = float(getattr(fused_head_loss(i["logits"], i["target"], **kwargs), f"{term}_loss"))
            got = float(getattr(fused_head_loss(i["logits"], i["target"], **kwargs, **_policy(i, options)),
                                f"{term}_loss"))
            assert math.isfinite(got) and got != plain[term], (term, case)


def _bad(d):
    t = dict(advantages=torch.zeros(4, device=d), old_log_probs=torch.zeros(4, device=d),
             document_index=torch.tensor([0, 0, 1, 1], device=d))
    return torch.randn(4, 10, device=d), torch.tensor([1, 2, -100, 3], device=d), t


BAD = [
    (dict(grpo_weight=1.0, loss_type="vespo"), "loss_type 'vespo' weighs a sequence with vespo_k_\\* and "
     "vespo_lambda_\\*, options of grpo_loss and gspo_loss, not of the fused head"),
    (dict(gspo_weight=1.0, loss_type="vespo"), "loss_type 'vespo' weighs a sequence with vespo_k_"),
    (dict(grpo_weight=1.0, loss_type="kl_cov"), "the GRPO term takes the per-token options; rollout_correction "
     "'None' with loss_type 'kl_cov' needs a sequence's or the batch's log-probs first"),
    (dict(grpo_weight=1.0, rollout_correction="sequence_mask", rollout_log_probs=lambda d: torch.zeros(4, device=d)),
     "rollout_correction 'sequence_mask' with loss_type 'ppo_clip' needs a sequence's"),
    (dict(grpo_weight=1.0, loss_type="geo_mean"), "loss_type 'geo_mean' takes the geometric mean"),
    (dict(gspo_weight=1.0, loss_type="gpg"), "loss_type 'gpg' weighs each token's own log-prob ratio"),
    (dict(gspo_weight=1.0, loss_type="geo_mean", rollout_correction="token_mask",
          rollout_log_probs=lambda d: torch.zeros(4, device=d)), "loss_type 'geo_mean' takes no rollout_correction"),
    (dict(grpo_weight=1.0, rollout_correction="token_truncate"), "rollout_correction = 'token_truncate' needs "
     "rollout_log_probs"),
    (dict(grpo_weight=1.0, rollout_log_probs=lambda d: torch.zeros(4, device=d)), "rollout_log_probs given without "
     "rollout_correction"),
    (dict(grpo_weight=1.0, rollout_correction="token_mask", rollout_log_probs=lambda d: torch.zeros(3, device=d)),
     r"rollout_log_probs has shape \[3\] but target has shape \[4\]"),
    (dict(gspo_weight=1.0, rollout_correction="sequence_mask", rollout_log_probs=lambda d: torch.zeros(5, device=d)),
     r"rollout_log_probs has shape \[5\] but target has shape \[4\]"),
    (dict(grpo_weight=1.0, loss_type="dro"), r"loss_type 'dro' needs dro_beta"),
    (dict(grpo_weight=1.0, rollout_correction="token_mask", rollout_log_probs=lambda d: torch.zeros(4, device=d),
          rollout_mask_bounds=[2.0, 1.0]), r"rollout_mask_bounds must satisfy lo < hi"),
    (dict(grpo_weight=1.0, rollout_rs="token_k1", rollout_log_probs=lambda d: torch.zeros(4, device=d)),
     "rollout_rs = 'token_k1' needs rollout_rs_threshold"),
    (dict(grpo_weight=1.0, rollout_rs="token_k2", rollout_rs_threshold="0.1"), "rollout_rs = 'token_k2' needs "
     "rollout_log_probs"),
    (dict(gspo_weight=1.0, rollout_rs="seq_max_k3", rollout_rs_threshold="0.1", old_log_probs=None,
          rollout_log_probs=lambda d: torch.zeros(4, device=d)), "rollout_rs = 'seq_max_k3' needs old_log_probs"),
    (dict(grpo_weight=1.0, rollout_rs="seq_sum_k2", rollout_rs_threshold="0.1", document_index=None,
          rollout_log_probs=lambda d: torch.zeros(4, device=d)), r"rollout_rs \(its sequence modes\) needs the "
     "sequences"),
    (dict(grpo_weight=1.0, rollout_rs="token_k3", rollout_rs_threshold="0.1",
          rollout_log_probs=lambda d: torch.zeros(2, device=d)), r"rollout_log_probs has shape \[2\]"),
    (dict(gspo_weight=1.0, rollout_rs="token_k3", rollout_rs_threshold="0.1",
          rollout_log_probs=lambda d: torch.zeros(2, device=d)), r"rollout_log_probs has shape \[2\]"),
    (dict(grpo_weight=1.0, rollout_rs_threshold="0.1"), "rollout_rs_threshold = '0.1' given without rollout_rs"),
]


def _bad_kwargs(t, bad, d):
    return {**t, **{k: v(d) if callable(v) else v for k, v in bad.items()}}


@pytest.mark.parametrize("bad,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(bad, message):
    logits, target, t = _bad("cpu")
    with pytest.raises(RuntimeError, match="fused_head: .*" + message):
        fused_head_loss(logits, target, **_bad_kwargs(t, bad, "cpu"))


@pytest.mark.parametrize("bad,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_fake_rejects_alike(bad, message):
    def call(d):
        logits, target, t = _bad(d)
        return _ops.fused_head(logits, target, **_bad_kwargs(t, bad, d))

    assert_fake_rejects_like_real(call, message)


@pytest.mark.parametrize("policy,fused", [
    ({"type": "grpo", "loss_type": "cispo", "epsilon_high": 1.2, "rollout_correction": "token_mask",
      "rollout_mask_bounds": [0.8, 1.25]}, True),
    ({"type": "grpo", "loss_type": "dro", "dro_beta": 0.5, "kl_estimator": "k2", "beta": 0.05}, True),
    ({"type": "gspo", "loss_type": "sapo", "rollout_correction": "sequence_truncate", "rollout_cap": 1.2}, True),
    ({"type": "grpo", "rollout_correction": "sequence_truncate"}, False),  # the GRPO term's: not fused
    ({"type": "grpo", "loss_type": "kl_cov"}, False),
    ({"type": "gspo", "loss_type": "vespo"}, False),
], ids=["grpo_cispo_icepop", "grpo_dro_k2", "gspo_sapo_sequence", "grpo_sequence", "grpo_kl_cov", "gspo_vespo"])
def test_head_config_passes_the_policy_options(policy, fused, device, monkeypatch):
    """The ``fused_head`` config passes its policy loss's options to the head by name (or runs the loss on its own
    where the head's term does not take them): the sum of the separate modules either way."""
    from helpers_head import head_equals_separate_modules

    import rl_losses.fused_head as module
    calls = []
    monkeypatch.setattr(module, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    i = make_inputs((48,), 40, torch.float32, device, documents=4)
    batch = {"labels": i["target"], "advantages": i["advantages"], "old_log_probabilities": i["old_log_probs"],
             "ref_log_probs": i["ref_log_probs"], "rollout_log_probs": i["rollout"],
             "document_index": i["document_index"], "num_documents": 4}
    losses = {"ce": {"type": "label", "weight": 0.5}, "z": {"type": "z_loss", "weight": 0.1},
              "pg": {"weight": 2.0, **policy}}
    head_equals_separate_modules(losses, i["logits"], batch)
    term = f"{policy['type']}_weight"
    assert len(calls) == 1 and bool(calls[0].get(term)) == fused
    if fused:
        assert calls[0]["loss_type"] == policy["loss_type"]
