"""Tests of distillation from a sparse teacher (docs/distillation_dpo.md): topk_distillation's loss, per-token
results and the student's gradient against the float64 reference (rl_losses.reference_topk), for every tail mode,
logits dtype and shape (K = 1 to V, unsorted ids, unlabelled tokens); verl's compute_forward_kl_topk; the fused
lm_head form; opcheck, torch.compile; bad input; the sampled-token KL estimators against verl's kl_penalty."""
import types

import pytest
import torch

import rl_losses
from rl_losses import reference_topk

from conftest import assert_close
from helpers import (DTYPES, assert_compiled_matches_eager, assert_grad_close, config_paths, forward_options,
                     gradcheck_fresh, param_id as _id)

TAILS = ["none", "renormalize", "tail"]
_ops = torch.ops.rl_losses


def make_inputs(shape, vocab, k, dtype, device, *, unlabelled=0.3, std=2.0):
    """Student logits, labels (a fraction `unlabelled` of them -100) and a teacher near the student: its top-K ids
    in a random order per row, with their log-probs (float32, as inference engines return them)."""
    logits = (torch.randn(*shape, vocab, device=device) * std).to(dtype)
    teacher = torch.log_softmax(logits.double() + torch.randn(*shape, vocab, device=device) * std, dim=-1)
    ids = teacher.topk(k, dim=-1).indices
    order = torch.rand(ids.shape, device=device).argsort(dim=-1)
    ids = ids.gather(-1, order)
    log_probs = teacher.gather(-1, ids).float()
    target = torch.randint(0, vocab, shape, device=device)
    target[torch.rand(shape, device=device) < unlabelled] = -100
    return logits, target, ids, log_probs


def run_op(logits, target, ids, lp, upstream=1.0, **options):
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.topk_distillation_loss(x, target, ids, lp, **options)
    (out.loss * upstream).backward()
    return out, x.grad


def run_reference(logits, target, ids, lp, upstream=1.0, **options):
    x = logits.detach().double().requires_grad_()
    out = reference_topk.topk_distillation_loss(x, target, ids, lp.double(), **options)
    (out.loss * upstream).backward()
    return out, x.grad


def check(logits, target, ids, lp, upstream=1.0, scale=1.0, **options):
    dtype = logits.dtype
    out, grad = run_op(logits, target, ids, lp, upstream, **options)
    ref, ref_grad = run_reference(logits, target, ids, lp, upstream, **options)
    assert out.loss.dim() == 0 and out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for name in ("divergence", "student_mass", "teacher_mass"):
        value = getattr(out, name)
        assert not value.requires_grad and value.shape == target.shape, name
        assert_close(value, getattr(ref, name), dtype, scale=scale, msg=name)
    assert_close(out.loss.detach(), ref.loss.detach(), dtype, scale=scale, msg="loss")
    n = int((target >= 0).sum())
    natural = options.get("logits_scale_factor", 1.0) * abs(upstream) / (options.get("divisor") or max(n, 1))
    assert_grad_close(grad, ref_grad, dtype, natural_scale=natural, scale=scale)
    assert torch.count_nonzero(grad[target < 0]) == 0, "unlabelled tokens must get a zero gradient"
    return out, grad


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab,k", [(7, 1), (7, 3), (7, 6), (769, 1), (769, 20), (769, 768), (1000, 256)])
@pytest.mark.parametrize("tail", TAILS)
def test_matches_reference(tail, vocab, k, dtype, device):
    shape = (5, 3)
    logits, target, ids, lp = make_inputs(shape, vocab, k, dtype, device)
    check(logits, target, ids, lp, -1.3, tail=tail, logits_scale_factor=0.8)


@pytest.mark.parametrize("tail", ["none", "renormalize"])
def test_whole_vocabulary(tail, device):
    """K = V: "none" and "renormalize" are the full forward KL (the tail's 1 − Q is 0 there: not a case)."""
    logits, target, ids, lp = make_inputs((9,), 33, 33, torch.float32, device)
    check(logits, target, ids, lp, tail=tail)


@pytest.mark.parametrize("tail", TAILS)
def test_float64_is_exact(tail, device):
    logits, target, ids, lp = make_inputs((4, 5), 65, 9, torch.float64, device)
    check(logits, target, ids, lp.double(), 0.7, tail=tail, logits_scale_factor=1.5, divisor=3.0)


@pytest.mark.parametrize("tail", TAILS)
def test_large_vocab(tail, device):
    logits, target, ids, lp = make_inputs((3,), 50257, 64, torch.bfloat16, device)
    check(logits, target, ids, lp, tail=tail, scale=4.0)


def test_ragged_and_all_unlabelled(device):
    logits, target, ids, lp = make_inputs((6, 4), 129, 8, torch.float32, device, unlabelled=0.7)
    # An unlabelled row's teacher entries are not read: anything there passes.
    ids[target < 0] = -5
    lp[target < 0] = float("nan")
    for tail in TAILS:
        check(logits, target, ids, lp, tail=tail)
    out, grad = run_op(logits, torch.full_like(target, -100), ids, lp)
    assert out.loss.item() == 0 and torch.count_nonzero(grad) == 0


def test_inplace_backward_matches(device):
    logits, target, ids, lp = make_inputs((4, 6), 129, 16, torch.float16, device)
    for tail in TAILS:
        out, grad = run_op(logits, target, ids, lp, tail=tail)
        x = logits.clone().requires_grad_()
        y = x * 1.0  # a non-leaf whose storage may be overwritten
        out_inplace = rl_losses.topk_distillation_loss(y, target, ids, lp, tail=tail, inplace_backward=True)
        (out_inplace.loss * 1.0).backward()
        torch.testing.assert_close(out_inplace.loss, out.loss)
        torch.testing.assert_close(x.grad, grad)


def test_float16_small_gradients_keep_precision(device):
    """fp16 gradient rows are stored pre-scaled (the values at the teacher's ids included): a large divisor leaves
    the forward's gradient (for an upstream gradient of 1) far below fp16's range, yet after a loss scale's
    upstream gradient it matches the reference relative to its size."""
    logits, target, ids, lp = make_inputs((8,), 300, 32, torch.float16, device, unlabelled=0.0)
    for tail in TAILS:
        check(logits, target, ids, lp, 1e4, tail=tail, divisor=1e6)


@pytest.mark.parametrize("tail", TAILS)
def test_gradcheck(tail, device):
    logits, target, ids, lp = make_inputs((3,), 6, 3, torch.float64, device, unlabelled=0.0)
    gradcheck_fresh(lambda x: rl_losses.topk_distillation_loss(x, target, ids, lp, tail=tail,
                                                               logits_scale_factor=1.2).loss,
                    logits.clone().requires_grad_())


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_opcheck(kind, beta, device):
    logits, target, ids, lp = make_inputs((4,), 12, 5, torch.float32, device)
    x = logits.clone().requires_grad_()
    kwargs = dict(tail="tail", kind=kind, beta=beta, logits_scale_factor=1.1)
    torch.library.opcheck(_ops.topk_distillation, (x, target, ids, lp), kwargs)
    torch.library.opcheck(_ops._topk_distillation_forward, (logits, target, ids, lp),
                          forward_options("topk_distillation", compute_grad=True, **kwargs))
    hidden = torch.randn(4, 8, device=device, requires_grad=True)
    weight = torch.randn(12, 8, device=device, requires_grad=True)
    torch.library.opcheck(_ops.linear_topk_distillation, (hidden, weight, target, ids, lp), kwargs)


def test_compile_fullgraph(device):
    logits, target, ids, lp = make_inputs((4, 3), 70, 7, torch.float32, device)

    def fn(x, t, i, p):
        out = rl_losses.topk_distillation_loss(x, t, i, p, tail="renormalize")
        return out.loss, out.divergence, out.student_mass

    assert_compiled_matches_eager(fn, logits, target, ids, lp, backend="aot_eager")


# ---- verl --------------------------------------------------------------------------------------------------------
def test_matches_verl_forward_kl_topk(device):
    """verl's compute_forward_kl_topk (fsdp/losses.py; its clamp off) is tail "none": per-token loss and masses."""
    losses = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    logits, target, ids, lp = make_inputs((10,), 300, 16, torch.float32, device, unlabelled=0.0)
    nested = lambda t: torch.nested.nested_tensor([t[:4], t[4:]], layout=torch.jagged)  # noqa: E731
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(use_chunked_topk=False,
                                                                           log_prob_min_clamp=None, topk=16))
    verl = losses.compute_forward_kl_topk(logits.unsqueeze(0), nested(lp), nested(ids), config, "thd")
    out = rl_losses.topk_distillation_loss(logits, target, ids, lp)
    for ours, theirs in ((out.divergence, "distillation_losses"), (out.student_mass, "student_mass"),
                         (out.teacher_mass, "teacher_mass")):
        assert_close(ours, verl[theirs][0], torch.float32, scale=5.0, msg=theirs)
    assert_close(out.loss, verl["distillation_losses"].mean(), torch.float32, scale=5.0)


@pytest.mark.parametrize("estimator", reference_topk.KL_ESTIMATORS)
def test_sampled_kl_matches_verl_kl_penalty(estimator, device):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logits = torch.randn(5, 7, 40, device=device, dtype=torch.float64)
    labels = torch.randint(0, 40, (5, 7), device=device)
    labels[torch.rand(5, 7, device=device) < 0.3] = -100
    teacher = torch.log_softmax(torch.randn(5, 7, 40, device=device, dtype=torch.float64), -1)
    teacher_lp = teacher.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    x = logits.clone().requires_grad_()
    out = rl_losses.sampled_kl_loss(x, labels, teacher_lp, estimator=estimator)
    out.loss.backward()
    keep = labels >= 0
    xr = logits.clone().requires_grad_()
    student_lp = torch.log_softmax(xr, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    verl = core_algos.kl_penalty(student_lp, teacher_lp, estimator)
    ref = reference_topk.sampled_kl(student_lp, teacher_lp, estimator)
    torch.testing.assert_close(torch.where(keep, verl, 0), torch.where(keep, ref, 0))
    (torch.where(keep, ref, 0).sum() / keep.sum()).backward()
    torch.testing.assert_close(out.kl, torch.where(keep, verl, 0).detach())
    torch.testing.assert_close(out.loss, torch.where(keep, verl, 0).sum() / keep.sum())
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(out.advantages, torch.where(keep, teacher_lp - student_lp, 0).detach())


def test_linear_sampled_kl_matches_logits_form(device):
    hidden = torch.randn(2, 5, 16, device=device, dtype=torch.float64)
    weight = torch.randn(30, 16, device=device, dtype=torch.float64)
    labels = torch.randint(0, 30, (2, 5), device=device)
    labels[0, 1] = -100
    teacher_lp = -torch.rand(2, 5, device=device, dtype=torch.float64) * 3
    a = rl_losses.linear_sampled_kl_loss(hidden, weight, labels, teacher_lp, estimator="k3")
    b = rl_losses.sampled_kl_loss(hidden @ weight.t(), labels, teacher_lp, estimator="k3")
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.kl, b.kl)


# ---- the fused lm_head ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("skip_unlabelled", [True, False])
@pytest.mark.parametrize("strategy,chunk_size", [("fast", None), ("fast", 4), ("lean", 4)])
@pytest.mark.parametrize("tail", TAILS)
def test_linear_matches_reference(tail, strategy, chunk_size, skip_unlabelled, device):
    hidden = torch.randn(3, 5, 16, device=device, dtype=torch.float64)
    weight = torch.randn(97, 16, device=device, dtype=torch.float64) * 0.5
    logits, target, ids, lp = make_inputs((3, 5), 97, 11, torch.float64, device)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rl_losses.linear_topk_distillation_loss(h, w, target, ids, lp, tail=tail, strategy=strategy,
                                                  chunk_size=chunk_size, skip_unlabelled=skip_unlabelled,
                                                  logits_scale_factor=0.9)
    (out.loss * 1.4).backward()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference_topk.topk_distillation_loss(hr @ wr.t(), target, ids, lp.double(), tail=tail,
                                                logits_scale_factor=0.9)
    (ref.loss * 1.4).backward()
    for name in ("loss", "divergence", "student_mass", "teacher_mass"):
        assert_close(getattr(out, name).detach(), getattr(ref, name).detach(), torch.float64, msg=name)
    assert_close(h.grad, hr.grad, torch.float64, msg="grad_hidden")
    assert_close(w.grad, wr.grad, torch.float64, msg="grad_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_linear_matches_logits_op(dtype, device):
    hidden = torch.randn(12, 32, device=device).to(dtype)
    weight = (torch.randn(300, 32, device=device) * 0.3).to(dtype)
    logits, target, ids, lp = make_inputs((12,), 300, 20, dtype, device)
    out = rl_losses.linear_topk_distillation_loss(hidden, weight, target, ids, lp, tail="tail")
    ref = rl_losses.topk_distillation_loss((hidden @ weight.t()), target, ids, lp, tail="tail")
    assert_close(out.loss, ref.loss, dtype, scale=2.0)
    assert_close(out.divergence, ref.divergence, dtype, scale=2.0)


# ---- bad input -----------------------------------------------------------------------------------------------------
def _topk(d, logits=None, target=None, ids=None, lp=None, **kw):
    logits = torch.randn(4, 7, device=d) if logits is None else logits
    target = torch.tensor([1, 2, -100, 3], device=d) if target is None else target
    ids = torch.tensor([[0, 1, 2]] * 4, device=d) if ids is None else ids
    lp = torch.full((4, 3), -2.0, device=d) if lp is None else lp
    return _ops.topk_distillation(logits, target, ids, lp, **kw)


def _linear_topk(d, k, **kw):
    return _ops.linear_topk_distillation(torch.randn(4, 5, device=d), torch.randn(7, 5, device=d),
                                         torch.tensor([1, 2, -100, 3], device=d),
                                         torch.zeros(4, k, dtype=torch.long, device=d), torch.zeros(4, k, device=d),
                                         **kw)


BAD_INPUTS = [
    ("topk_shard", lambda d: _topk(d, vocab_start=7, vocab_size=14),
     r"topk_distillation: a vocabulary shard \(vocab_start=7, vocab_size=14\) needs row_stats and student_at_ids"),
    ("topk_hooks_half", lambda d: _topk(d, row_stats=torch.zeros(4, 5, device=d)),
     "row_stats and student_at_ids are a vocabulary shard's hooks: give both or neither"),
    ("topk_hooks_stats_shape", lambda d: _topk(d, vocab_start=7, vocab_size=14, row_stats=torch.zeros(4, 4, device=d),
                                               student_at_ids=torch.zeros(4, 3, device=d)),
     r"topk_distillation: row_stats must have shape \(4, 5\), got \[4, 4\]"),
    ("topk_hooks_x_shape", lambda d: _topk(d, vocab_start=7, vocab_size=14, row_stats=torch.zeros(4, 5, device=d),
                                           student_at_ids=torch.zeros(4, 2, device=d)),
     r"topk_distillation: student_at_ids has shape \[4, 2\] but teacher_ids has \[4, 3\]"),
    ("topk_hooks_x_dtype", lambda d: _topk(d, row_stats=torch.zeros(4, 5, device=d),
                                           student_at_ids=torch.zeros(4, 3, dtype=torch.float64, device=d)),
     r"student_at_ids must be float32 \(float64 for float64 logits\), got Double"),
    ("topk_tail", lambda d: _topk(d, tail="rest"), "tail must be 'none', 'renormalize' or 'tail', got 'rest'"),
    ("topk_kind", lambda d: _topk(d, kind="cross_entropy"),
     "topk_distillation: kind must be 'forward_kl', 'reverse_kl' or 'jsd', got 'cross_entropy'"),
    ("topk_beta_above", lambda d: _topk(d, kind="jsd", beta=1.5),
     r"topk_distillation: beta must be in \[0, 1\], got 1.5"),
    ("topk_beta_below", lambda d: _topk(d, beta=-0.25), r"beta must be in \[0, 1\], got -0.25"),
    ("topk_beta_nan", lambda d: _topk(d, kind="jsd", beta=float("nan")), r"beta must be in \[0, 1\], got nan"),
    ("topk_linear_kind", lambda d: _linear_topk(d, 3, kind="jsd_"),
     "linear_topk_distillation: kind must be 'forward_kl', 'reverse_kl' or 'jsd', got 'jsd_'"),
    ("topk_scale", lambda d: _topk(d, logits_scale_factor=0.0), "logits_scale_factor must be finite and > 0"),
    ("topk_divisor", lambda d: _topk(d, divisor=-1.0), "divisor must be finite and > 0, got -1"),
    ("topk_ids_dtype", lambda d: _topk(d, ids=torch.zeros(4, 3, dtype=torch.int32, device=d)),
     "teacher_ids must be int64, got Int"),
    ("topk_lp_dtype", lambda d: _topk(d, lp=torch.zeros(4, 3, dtype=torch.long, device=d)),
     "teacher_log_probs must be a floating-point tensor, got Long"),
    ("topk_ids_shape", lambda d: _topk(d, ids=torch.zeros(3, 3, dtype=torch.long, device=d)),
     r"teacher_ids must have shape \(batch..., K\) with batch shape \[4\], got \[3, 3\]"),
    ("topk_ids_flat", lambda d: _topk(d, ids=torch.zeros(4, dtype=torch.long, device=d)),
     r"teacher_ids must have shape \(batch..., K\) with batch shape \[4\], got \[4\]"),
    ("topk_lp_shape", lambda d: _topk(d, lp=torch.zeros(4, 2, device=d)),
     r"teacher_log_probs has shape \[4, 2\] but teacher_ids has \[4, 3\]"),
    ("topk_k_above_v", lambda d: _topk(d, ids=torch.zeros(4, 8, dtype=torch.long, device=d),
                                       lp=torch.zeros(4, 8, device=d)),
     "teacher_ids must hold 1 <= K <= vocab_size ids per row, got K = 8 with vocab_size 7"),
    ("topk_k_zero", lambda d: _topk(d, ids=torch.zeros(4, 0, dtype=torch.long, device=d),
                                    lp=torch.zeros(4, 0, device=d)), "got K = 0 with vocab_size 7"),
    ("topk_linear_k_above_v", lambda d: _linear_topk(d, 9),
     "linear_topk_distillation: teacher_ids must hold 1 <= K <= vocab_size ids per row, got K = 9"),
]


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_fake_and_real_reject_alike(name, call, message):
    from helpers import assert_fake_rejects_like_real

    assert_fake_rejects_like_real(call, message)


def _with(t, row, col, value):
    t = t.clone()
    t[row, col] = value
    return t


def test_bad_teacher_values(device, monkeypatch):
    """The teacher's values of the labelled rows are checked on the host (row 2 is unlabelled: not read): always on
    the CPU, with RL_LOSSES_CHECK_INPUTS=1 on a GPU."""
    monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    ids = torch.tensor([[0, 1, 2]] * 4, device=device)
    lp = torch.full((4, 3), -2.0, device=device)
    cases = [
        (dict(ids=_with(ids, 3, 1, 7)), "topk_distillation: teacher_ids: id 7 at row 3, position 1 is out of range "
                                        "for vocab_size 7"),
        (dict(ids=_with(ids, 1, 2, -1)), "teacher_ids: id -1 at row 1, position 2 is out of range"),
        (dict(ids=_with(ids, 0, 2, 0)), r"teacher_ids: row 0 holds id 0 more than once \(a row's K ids must be "
                                        "distinct\\)"),
        (dict(lp=_with(lp, 3, 0, float("nan"))), "teacher_log_probs: NaN at row 3, position 0"),
        (dict(lp=_with(lp, 1, 0, -0.01)), r"teacher_log_probs: the probabilities of row 1 sum to 1.26.*, above 1 \+ "
                                          "0.001"),
    ]
    for kw, message in cases:
        with pytest.raises(RuntimeError, match=message):
            _topk(device, **kw)
    # Anything in an unlabelled row passes.
    _topk(device, ids=_with(ids, 2, 0, 99), lp=_with(lp, 2, 1, float("nan")))
    # A mass just above 1 (the engine's rounding) passes.
    _topk(device, lp=torch.full((4, 3), -1.0986, device=device))


# ---- the `topk_distillation` config ---------------------------------------------------------------------------------
def test_config_module_matches_the_reference_path(device):
    from rl_losses.config import LanguageModelLossConfig

    logits, target, ids, lp = make_inputs((6,), 80, 9, torch.float32, device)
    batch = {"labels": target, "reference_topk_ids": {"teacher": ids}, "reference_topk_log_probs": {"teacher": lp}}
    cfg = LanguageModelLossConfig.from_dict({"type": "topk_distillation", "tail": "tail", "weight": 0.5,
                                             "logits_scale_factor": 0.9})
    assert LanguageModelLossConfig.from_dict(cfg.to_dict()) == cfg
    results = config_paths(cfg, logits, batch, ["topk_distillation_student_mass", "topk_distillation_teacher_mass"])
    for kernel, ref in zip(*results):
        assert_close(kernel, ref, torch.float32, scale=4.0)
    ref = reference_topk.topk_distillation_loss(logits.double(), target, ids, lp.double(), tail="tail",
                                                logits_scale_factor=0.9)
    assert_close(results[0][0], 0.5 * ref.loss, torch.float32, scale=4.0)


def test_config_validation():
    from rl_losses.config import LanguageModelLossConfig

    with pytest.raises(ValueError, match="tail must be one of"):
        LanguageModelLossConfig.from_dict({"type": "topk_distillation", "tail": "rest"})
    with pytest.raises(ValueError, match="kind must be one of"):
        LanguageModelLossConfig.from_dict({"type": "topk_distillation", "kind": "cross_entropy"})
    with pytest.raises(ValueError, match="beta"):
        LanguageModelLossConfig.from_dict({"type": "topk_distillation", "kind": "jsd", "beta": 1.2})
    module = LanguageModelLossConfig.from_dict({"type": "topk_distillation", "reference_model": "big"}).get_loss()
    with pytest.raises(ValueError, match=r"batch\['reference_topk_ids'\] has no 'big'"):
        module(torch.randn(2, 5), {"labels": torch.zeros(2, dtype=torch.long),
                                   "reference_topk_ids": {"teacher": torch.zeros(2, 1, dtype=torch.long)},
                                   "reference_topk_log_probs": {"teacher": torch.zeros(2, 1)}})
