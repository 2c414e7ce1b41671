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
gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
distillation_async = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")

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


def loss_and_grad(fn, student, *args, wrt=(), **kwargs):
    """fn(student, *args, **kwargs)'s loss (TRL's: the first of a tuple; ours: .loss) and its gradients w.r.t.
    student and the tensors of ``wrt``."""
    loss = fn(student, *args, **kwargs)
    loss = loss[0] if isinstance(loss, tuple) and not hasattr(loss, "loss") else getattr(loss, "loss", loss)
    return loss.detach(), *torch.autograd.grad(loss, (student, *wrt))


def ours(student, teacher, labels, *, kind, beta, temperature, divisor=None):
    return rl_losses.distillation_loss(student, teacher, kind=kind, beta=beta, temperature=temperature,
                                       logits_scale_factor=1.0 / temperature, loss_mask=labels != -100,
                                       divisor=divisor)


def assert_same(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **(tol or F64))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("trainer", ["gkd", "iw_opd", "gold"])
def test_generalized_jsd_loss_batchmean(beta, temperature, trainer):
    fn = {"gkd": gkd.GKDTrainer, "iw_opd": iw_opd.IWOPDTrainer, "gold": gold.GOLDTrainer}[trainer].generalized_jsd_loss
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


def topk_inputs(student, teacher, labels, ids):
    """Our top-K op's inputs for a TRL support ``ids``: the teacher's full log-softmax gathered there, and the
    labels as targets (-100 < 0: not counted)."""
    return labels, ids, torch.log_softmax(teacher, -1).gather(-1, ids)


@pytest.mark.parametrize("alpha", BETAS)
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("k", [1, 5])
def test_self_distillation_topk(add_tail, k, alpha):
    """SDFT/SDPO's top-k loss (TRL's JSD at α over the student's top-k ids, with a tail bucket or renormalised) is
    our top-K distillation's kind "jsd" at β = α (and the named KL at α = 0 or 1) with the student's top-k ids as
    the support."""
    student, teacher, labels = make_inputs()
    mask = labels != -100
    topk = sdft.compute_topk_self_distillation_loss
    options = dict(distillation_topk=k, distillation_alpha=alpha, distillation_add_tail=add_tail)
    expected_tokens = topk(student, teacher, **options).detach()
    expected = loss_and_grad(lambda s: topk(s, teacher, **options)[mask].sum(), student)
    ids = student.detach().topk(k, dim=-1).indices
    args = topk_inputs(student, teacher, labels, ids)
    tail = "tail" if add_tail else "renormalize"
    for kind, beta in kind_and_beta(alpha):
        out = rl_losses.topk_distillation_loss(student, *args, tail=tail, kind=kind, beta=beta)
        torch.testing.assert_close(out.divergence[mask], expected_tokens[mask], **F64)
        got = loss_and_grad(rl_losses.topk_distillation_loss, student, *args, tail=tail, kind=kind, beta=beta,
                            divisor=1.0)
        assert_same(got, expected)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_iw_opd_topk(add_tail, temperature, beta):
    """IW-OPD's generalized_jsd_loss with top_k at β = 0 (the forward KL over the teacher's top-k ids of the
    tempered logits) and β = 1 (the reverse KL over the student's) is our top-K distillation with those ids,
    logits_scale_factor = 1/T. (Between them TRL takes the union of both supports: as many ids as the row has.)"""
    student, teacher, labels = make_inputs()
    k = 6
    expected = loss_and_grad(iw_opd.IWOPDTrainer.generalized_jsd_loss, student, teacher, labels=labels, beta=beta,
                             temperature=temperature, top_k=k, add_tail=add_tail)
    ids = (teacher if beta == 0.0 else student.detach()).topk(k, dim=-1).indices
    args = topk_inputs(student, teacher / temperature, labels, ids)
    for kind, b in kind_and_beta(beta):
        got = loss_and_grad(rl_losses.topk_distillation_loss, student, *args, kind=kind, beta=b,
                            tail="tail" if add_tail else "renormalize", logits_scale_factor=1.0 / temperature)
        assert_same(got, expected)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature,student_scale,teacher_scale", [(1.0, 1.0, 1.0), (0.7, 1.0, 1.0),
                                                                     (2.0, 0.5, 1.5)])
def test_distillation_trainer_chunked_divergence(beta, temperature, student_scale, teacher_scale):
    """DistillationTrainer's chunked loss over the lm_heads is our linear_distillation_loss with the teacher's
    logits h_t·W_tᵀ, temperature = T/s_t and logits_scale_factor = s_s/T. TRL projects in float32 (its
    hidden.float()), hence float32 tolerances against our float64."""
    _, _, labels = make_inputs(batch=2, seq=9, vocab=50)
    mask = labels != -100
    hidden_size = 16
    h_s = torch.randn(*labels.shape, hidden_size, dtype=torch.float64, requires_grad=True)
    w_s = (0.5 * torch.randn(50, hidden_size, dtype=torch.float64)).requires_grad_()
    h_t = torch.randn(*labels.shape, 24, dtype=torch.float64)
    w_t = 0.5 * torch.randn(50, 24, dtype=torch.float64)

    expected = loss_and_grad(distillation_trainer._chunked_divergence_loss, h_s, h_t, w_s, w_t, mask, beta,
                             student_logit_scale=student_scale, teacher_logit_scale=teacher_scale,
                             temperature=temperature, wrt=(w_s,))
    for kind, b in kind_and_beta(beta):
        got = loss_and_grad(rl_losses.linear_distillation_loss, h_s, w_s, h_t @ w_t.t(), kind=kind, beta=b,
                            temperature=temperature / teacher_scale, logits_scale_factor=student_scale / temperature,
                            loss_mask=mask, chunk_size=5, wrt=(w_s,))
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y.to(x.dtype), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("temperature,scale", [(1.0, 1.0), (0.7, 1.3)])
def test_async_distillation_chunked_topk_forward_kl(add_tail, temperature, scale):
    """AsyncDistillationTrainer's chunked loss at β = 0 (the forward KL over the teacher server's top-k ids, the
    student's logits s·h·Wᵀ/T) is our linear_topk_distillation_loss with logits_scale_factor = s/T and D = 1 (TRL
    returns the sum). TRL projects in float32, hence float32 tolerances."""
    n, hidden_size, vocab, k = 11, 16, 50, 7
    hidden = torch.randn(n, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = (0.5 * torch.randn(vocab, hidden_size, dtype=torch.float64)).requires_grad_()
    teacher = 2.0 * torch.randn(n, vocab, dtype=torch.float64)
    ids = teacher.topk(k, dim=-1).indices
    log_probs = torch.log_softmax(teacher, -1).gather(-1, ids)

    expected = loss_and_grad(distillation_async._chunked_jsd_loss, hidden, weight, None, scale, None, ids, log_probs,
                             torch.ones_like(ids, dtype=torch.bool), 0.0, temperature, add_tail, None, 1, 4,
                             wrt=(weight,))
    got = loss_and_grad(rl_losses.linear_topk_distillation_loss, hidden, weight, torch.zeros(n, dtype=torch.long),
                        ids, log_probs, tail="tail" if add_tail else "renormalize",
                        logits_scale_factor=scale / temperature, divisor=1.0, chunk_size=4, wrt=(weight,))
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y.to(x.dtype), rtol=2e-5, atol=2e-6)


def test_self_distillation_sampled_token():
    """SDFT/SDPO's sampled-token loss (α = 1) is the score-function surrogate d.detach()·log q(y), d = log q(y) −
    log p_teacher(y): not our k1 estimate (whose value is d and gradient ∇log q) but −advantages·log q(y) with
    sampled_kl_loss's advantages and token_log_probs' log q(y)."""
    student, teacher, labels = make_inputs()
    mask = labels != -100
    completion = labels.clamp_min(0)
    surrogate = sdft.compute_sampled_token_self_distillation_loss
    expected = loss_and_grad(lambda s: surrogate(s, teacher, completion, distillation_alpha=1.0)[mask].sum(),
                             student)
    teacher_log_probs = torch.log_softmax(teacher, -1).gather(-1, completion[..., None])[..., 0]

    def ours_surrogate(s):
        advantages = rl_losses.sampled_kl_loss(s, labels, teacher_log_probs).advantages
        log_probs, _ = rl_losses.token_log_probs(s, labels)
        return -(advantages * log_probs).sum()

    assert_same(loss_and_grad(ours_surrogate, student), expected)
