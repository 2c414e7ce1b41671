"""rl_losses' distillation ops against TRL's own distillation losses (float64 on CPU, fresh random inputs).

The mapping (docs/distillation_dpo.md, "TRL's distillation losses"):
- TRL's β is ours (kind="jsd"): M = β·P_teacher + (1−β)·Q_student, β = 0 the forward KL, β = 1 the reverse KL;
  the student is TRL's ``student_logits`` and our ``logits``.
- TRL divides both sides' logits by its temperature T: ``temperature=T`` (the teacher) and
  ``logits_scale_factor=1/T`` (the student). A model's ``logit_scale`` s (DistillationTrainer) multiplies the logits
  before T: the student's s_s gives ``logits_scale_factor=s_s/T``, the teacher's s_t ``temperature=T/s_t``.
- labels == -100 is our ``loss_mask=False``; TRL's reductions are our divisor D: "batchmean" the unmasked tokens
  (at least 1; without labels: the batch size), "sum" 1, "mean" the unmasked tokens times V, and
  ``num_items_in_batch`` itself.
"""
import os

import pytest
import torch

import rl_losses

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
gkd = pytest.importorskip("trl.experimental.gkd")
iw_opd = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")
sdft = pytest.importorskip("trl.experimental.sdft.loss_utils")
distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")

BETAS = [0.0, 0.3, 0.5, 1.0]
TEMPERATURES = [0.7, 1.0, 2.0]
F64 = dict(rtol=1e-9, atol=1e-12)


def make_inputs(batch=3, seq=7, vocab=40, std=2.0):
    """Student and teacher logits of different spreads; labels with -100 on a ragged tail of each row and on one
    whole row (a fully truncated completion)."""
    student = (std * torch.randn(batch, seq, vocab, dtype=torch.float64)).requires_grad_()
    teacher = 1.5 * std * torch.randn(batch, seq, vocab, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, seq))
    lengths = torch.randint(1, seq + 1, (batch,))
    labels[torch.arange(seq) >= lengths[:, None]] = -100
    labels[torch.randint(0, batch, ())] = -100
    return student, teacher, labels


def kind_and_beta(beta):
    """Our JSD at β, and the named KL it equals at TRL's edge values (both are tested)."""
    return [("jsd", beta)] + ([("forward_kl", beta)] if beta == 0.0 else [("reverse_kl", beta)] if beta == 1.0 else [])


def loss_and_grad(fn, student, *args, **kwargs):
    student.grad = None
    loss = fn(student, *args, **kwargs)
    loss = getattr(loss, "loss", loss)
    loss.backward()
    return loss.detach(), student.grad.clone()


def ours(student, teacher, labels, *, kind, beta, temperature, divisor=None):
    return rl_losses.distillation_loss(student, teacher, kind=kind, beta=beta, temperature=temperature,
                                       logits_scale_factor=1.0 / temperature, loss_mask=labels != -100,
                                       divisor=divisor)


def assert_same(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **(tol or F64))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("trainer", ["gkd", "iw_opd"])
def test_generalized_jsd_loss_batchmean(beta, temperature, trainer):
    fn = (gkd.GKDTrainer if trainer == "gkd" else iw_opd.IWOPDTrainer).generalized_jsd_loss
    student, teacher, labels = make_inputs()
    expected = loss_and_grad(fn, student, teacher, labels=labels, beta=beta, temperature=temperature)
    for kind, b in kind_and_beta(beta):
        got = loss_and_grad(ours, student, teacher, labels, kind=kind, beta=b, temperature=temperature)
        assert_same(got, expected)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["sum", "mean", "num_items_in_batch", "batchmean_without_labels"])
def test_generalized_jsd_loss_reductions(beta, reduction):
    student, teacher, labels = make_inputs()
    temperature = 1.3
    counted = int((labels != -100).sum())
    options = dict(beta=beta, temperature=temperature, labels=labels)
    if reduction == "num_items_in_batch":
        options["num_items_in_batch"] = torch.tensor(counted + 5)
        divisor = counted + 5
    elif reduction == "batchmean_without_labels":
        options["labels"] = None
        labels = torch.zeros_like(labels)
        divisor = student.shape[0]  # TRL's batchmean over (B, T, V) without labels: jsd.size(0), the sequences
    else:
        options["reduction"] = reduction
        divisor = 1 if reduction == "sum" else counted * student.shape[-1]
    expected = loss_and_grad(gkd.GKDTrainer.generalized_jsd_loss, student, teacher, **options)
    for kind, b in kind_and_beta(beta):
        got = loss_and_grad(ours, student, teacher, labels, kind=kind, beta=b, temperature=temperature,
                            divisor=divisor)
        assert_same(got, expected)


def test_generalized_jsd_loss_all_masked():
    student, teacher, labels = make_inputs()
    labels[:] = -100
    expected = loss_and_grad(gkd.GKDTrainer.generalized_jsd_loss, student, teacher, labels=labels, beta=0.4)
    got = loss_and_grad(ours, student, teacher, labels, kind="jsd", beta=0.4, temperature=1.0)
    assert_same(got, expected)
    assert float(got[0]) == 0.0 and not got[1].any()


@pytest.mark.parametrize("alpha", BETAS)
def test_self_distillation_full_logit_divergence(alpha):
    """SDFT/SDPO's per-token divergence over the whole vocabulary (their α is our β, their temperature 1): our
    per-token divergence, and the gradient of its sum over the labelled tokens (our loss with D = 1)."""
    student, teacher, labels = make_inputs()
    mask = labels != -100
    divergence = sdft.compute_full_logit_self_distillation_loss
    expected_tokens = divergence(student, teacher, distillation_alpha=alpha).detach()
    expected = loss_and_grad(lambda s: divergence(s, teacher, distillation_alpha=alpha)[mask].sum(), student)
    for kind, b in kind_and_beta(alpha):
        out = rl_losses.distillation_loss(student, teacher, kind=kind, beta=b)
        torch.testing.assert_close(out.divergence, expected_tokens, **F64)
        got = loss_and_grad(rl_losses.distillation_loss, student, teacher, kind=kind, beta=b, loss_mask=mask,
                            divisor=1.0)
        assert_same(got, expected)
