"""skip_unlabelled's three values on every fused lm_head op (docs/performance.md): None, the default, counts the
labelled rows where that pays (csrc/linear/linear_source.h: on the CPU; on a GPU from N·V·H = 2^32,
kCountLabelledMinMacs, outside a graph capture), True always and False never. Whether a call counted them changes
no result: with half the rows unlabelled, each value gives the loss, the gradients and the per-row outputs of the
float64 reference on fresh inputs, an unlabelled row's per-row outputs being 0 with None and True
(linear_cross_entropy's lse too) and its lse its own with False. On a GPU the small case runs None without the count
and the large one (N·V·H = 2^32) with it; tests/test_linear_modes_contract.py captures the default in a graph."""
import pytest
import torch

import rl_losses
from rl_losses import _schema, reference, reference_topk

from conftest import assert_close
from helpers import make_target, requires_cuda
from helpers_linear import assert_linear_grad_close, grad_magnitudes, leaves, make_linear, ref_logits

OPS = ["ce", "grpo", "gspo", "token_log_probs", "token_log_probs_entropy", "topk_distillation"]
LINEAR_OPS = ["linear_cross_entropy", "linear_grpo", "linear_gspo", "linear_token_log_probs",
              "linear_topk_distillation"]
VALUES = [None, True, False]
SMALL = (40, 16, 53)  # N, H, V: N·V·H far below 2^32
LARGE = (1024, 128, 32768)  # N·V·H = 2^32, where None counts on a GPU too
DOCS, K = 4, 5
CE = dict(logits_scale_factor=0.7, label_smoothing=0.1, z_loss_factor=1e-3)


def make_case(device, n, h, v):
    """float64 inputs of every op, half the labels negative; documents with padding; a teacher's top-K."""
    hidden, weight, bias = make_linear((n,), h, v, torch.float64, device, bias=True)
    target = make_target((n,), v, device, masked=0.5)
    lp = torch.log_softmax(ref_logits(hidden, weight, bias), -1).gather(-1, target.clamp_min(0)[:, None])[:, 0]
    noise = torch.randn(4, n, device=device, dtype=torch.float64)
    teacher = torch.log_softmax(hidden @ weight.T + 2 * torch.randn(n, v, device=device, dtype=torch.float64), -1)
    ids = teacher.topk(K, dim=-1).indices
    doc = torch.arange(n, device=device) * DOCS // n
    doc[-3:] = -1
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, advantages=noise[0],
                old=lp + 0.3 * noise[1], ref=lp + 0.2 * noise[2], g_lp=noise[3], g_h=torch.randn_like(noise[3]),
                doc=doc, ids=ids, teacher=teacher.gather(-1, ids))


def run(op, h, w, b, x, skip=None, logits=None):
    """(loss, per-row outputs) of `op` with skip_unlabelled=`skip`, or of the reference on the float64 `logits`."""
    t, ours = x["target"], logits is None
    options = dict(skip_unlabelled=skip)
    if op == "ce":
        if ours:
            loss, lse = torch.ops.rl_losses.linear_cross_entropy(h, w, t, bias=b, **CE, **options)
            return loss, {"lse": lse}
        return reference.cross_entropy(logits, t, **CE), {"lse": torch.logsumexp(CE["logits_scale_factor"] * logits,
                                                                                 -1).detach()}
    if op.startswith("token_log_probs"):
        entropy = op.endswith("entropy")
        lp, ent = (rl_losses.linear_token_log_probs(h, w, t, bias=b, compute_entropy=entropy, **options) if ours
                   else reference.token_log_probs(logits, t, compute_entropy=entropy))
        loss = (x["g_lp"] * lp).sum() + ((x["g_h"] * ent).sum() if entropy else 0)
        return loss, {"log_probs": lp, **({"entropy": ent} if entropy else {})}
    if op == "topk_distillation":
        out = (rl_losses.linear_topk_distillation_loss(h, w, t, x["ids"], x["teacher"], bias=b, tail="tail",
                                                       **options) if ours
               else reference_topk.topk_distillation_loss(logits, t, x["ids"], x["teacher"], tail="tail"))
        return out.loss, {k: getattr(out, k) for k in ("divergence", "student_mass", "teacher_mass")}
    adv, old = x["advantages"], x["old"]
    if op == "gspo":
        kw = dict(num_documents=DOCS, compute_entropy=True)
        out = (rl_losses.linear_gspo_loss(h, w, t, adv, old, x["doc"], bias=b, **kw, **options) if ours
               else reference.gspo_loss(logits, t, adv, old, x["doc"], **kw))
    else:
        kw = dict(ref_log_probs=x["ref"], beta=0.05, compute_entropy=True)
        out = (rl_losses.linear_grpo_loss(h, w, t, adv, old, bias=b, **kw, **options) if ours
               else reference.grpo_loss(logits, t, adv, old, **kw))
    return out.loss, {k: getattr(out, k) for k in ("log_probs", "new_logprobs", "entropy", "kl_old", "ratio_mean",
                                                   "document_ratios") if getattr(out, k) is not None}


def check(op, device, shape):
    x = make_case(device, *shape)
    unlabelled = x["target"] < 0
    (h64, w64, b64) = leaves(x["hidden"], x["weight"], x["bias"])[1]
    logits64 = ref_logits(h64, w64, b64)
    ref_loss, ref_outputs = run(op, None, None, None, x, logits=logits64)
    ref_loss.backward()
    magnitudes = grad_magnitudes(logits64, h64, w64)
    for skip in VALUES:
        (h, w, b), _ = leaves(x["hidden"], x["weight"], x["bias"])
        loss, outputs = run(op, h, w, b, x, skip)
        assert_close(loss, ref_loss.detach(), torch.float64, msg=f"loss, skip_unlabelled={skip}")
        for key, expected in ref_outputs.items():
            got = outputs[key].detach()
            if key == "lse" and skip is not False:  # 0 on an unlabelled row, counted or not
                assert torch.equal(got[unlabelled], torch.zeros_like(got[unlabelled])), f"lse, {skip}"
                expected = torch.where(unlabelled, 0.0, expected)
            assert_close(got, expected.detach(), torch.float64, msg=f"{key}, skip_unlabelled={skip}")
        loss.backward()
        for name, ours, want, m in zip(("hidden", "weight", "bias"), (h, w, b), (h64, w64, b64), magnitudes):
            assert_linear_grad_close(f"{name} (skip_unlabelled={skip})", ours.grad, want.grad, m, torch.float64)
        if op != "token_log_probs_entropy":  # an unlabelled row's entropy has a gradient
            assert torch.count_nonzero(h.grad[unlabelled]) == 0, "an unlabelled row's grad_hidden is 0"


@pytest.mark.parametrize("op", OPS)
def test_every_value_gives_the_reference(device, op):
    check(op, device, SMALL)


@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_every_value_gives_the_reference_where_none_counts_on_a_gpu(op):
    check(op, "cuda", LARGE)


def _counts(fn):
    """Whether fn() counted the labelled rows (aten::nonzero, the count the fused lm_head reads on the host)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.name == "aten::nonzero" for e in prof.events())


def _call(device, shape, **options):
    x = make_case(device, *shape)
    (h, w, b), _ = leaves(x["hidden"], x["weight"], x["bias"])
    return lambda: run("grpo", h, w, b, x, **options)[0].backward()


def test_who_counts_on_the_cpu():
    """On the CPU the default counts: no synchronisation there, and the unlabelled rows' GEMM work is saved."""
    assert _counts(_call("cpu", SMALL, skip=None))
    assert _counts(_call("cpu", SMALL, skip=True))
    assert not _counts(_call("cpu", SMALL, skip=False))


@requires_cuda
def test_who_counts_on_a_gpu():
    """On a GPU the default counts only where the GEMMs are large enough for the synchronisation to be small."""
    assert not _counts(_call("cuda", SMALL, skip=None))
    assert _counts(_call("cuda", SMALL, skip=True))
    assert _counts(_call("cuda", LARGE, skip=None))
    assert not _counts(_call("cuda", LARGE, skip=False))


@pytest.mark.parametrize("op", LINEAR_OPS)
def test_schema_is_an_optional_bool_defaulting_to_none(op):
    (arg,) = [a for a in _schema.schema(op).arguments if a.name == "skip_unlabelled"]
    assert str(arg.type) == "Optional[bool]" and _schema.default(op, "skip_unlabelled") is None


def test_a_value_that_is_no_bool_is_refused():
    x = make_case("cpu", *SMALL)
    with pytest.raises(RuntimeError, match="Expected a value of type 'Optional.bool.' for argument 'skip_unlabelled'"):
        rl_losses.linear_cross_entropy(x["hidden"], x["weight"], x["target"], skip_unlabelled="auto")
