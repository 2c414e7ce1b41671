"""clip_cov and kl_cov in the fused lm_head (linear_grpo) read the logits once: the loss pass runs with no token
selected and the few rows that may hold a selected token are revisited (csrc/linear/linear_source.h, RowRevisit):
where one chunk holds every row, before its GEMMs; after a sweep of several chunks, as the changed rows' difference
added to grad_weight's fp32 sum (the op's accumulator or weight_main_grad); between lean mode's two sweeps. Against
the float64 reference on the op's rounded logits, in every mode, with the unlabelled rows skipped or not, with
either gradient alone or none, with fp32 logits; a subset bound past what a revisit takes (a small chunk) keeps the
statistics pass first. The GEMM work stays plain linear_grpo's plus the sub-batch's (no statistics pass).
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import label_log_probs64, make_target, param_id as _id
from helpers_linear import assert_linear_grad_close, grad_magnitudes, leaves, make_linear, ref_logits

N, H, V = 96, 12, 53
# Bound ⌊0.05·96⌋ = 4 rows: chunks of 11 revisit them (one chunk of every row by default); chunks of 5 hold fewer
# than two sub-batches, so the statistics pass comes first. clip_cov's band holds nearly every token: k of many.
CASES = {"clip_cov": dict(epsilon_low=0.15, epsilon_high=0.25, clip_cov_ratio=0.05, clip_cov_lb=-50.0,
                          clip_cov_ub=50.0),
         "kl_cov": dict(kl_cov_ratio=0.05, ppo_kl_coef=0.4)}
MODES = {"fast": ("fast", False), "lean": ("lean", False), "fast+main_grad": ("fast", True),
         "lean+main_grad": ("lean", True)}
CHUNKS = {"one_chunk": None, "chunks": 11, "statistics_first": 5}
FIELDS = ("log_probs", "clipped_fraction_low", "clipped_fraction_high", "ratio_mean", "kl_old", "kl", "entropy")


def make_case(device, dtype, masked=0.25):
    hidden, weight, bias = make_linear((N,), H, V, dtype, device, bias=True)
    target = make_target((N,), V, device, masked=masked)
    lp = label_log_probs64(hidden.double() @ weight.double().T + bias.double(), target)
    noise = torch.randn(2, N, device=device, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, advantages=torch.randn(N, device=device),
                old=(lp + 0.3 * noise[0]).float(), ref=(lp + 0.2 * noise[1]).float(),
                weights=torch.rand(N, device=device))


def check(device, dtype, name, mode="fast", chunk=None, skip=True, head_dtype="weight", requires=(True, True),
          masked=0.25, **extra):
    """One linear_grpo call against reference.grpo_loss on the same logits (rounded to the weight's dtype unless
    head_dtype is float32), both drawing clip_cov's keys from the same state of the device's generator."""
    x = make_case(device, dtype, masked)
    strategy, into_buffer = MODES[mode]
    (h, w, b), (h64, w64, b64) = leaves(x["hidden"], x["weight"], x["bias"])
    h.requires_grad_(requires[0])
    w.requires_grad_(requires[1])
    b.requires_grad_(requires[1])
    buffer = 1e-3 * torch.randn(V, H, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    start = buffer.clone()
    options = dict(CASES[name], ref_log_probs=x["ref"], beta=0.05, compute_entropy=True, entropy_coefficient=0.01,
                   loss_weights=x["weights"], **extra)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    with torch.set_grad_enabled(any(requires)):
        ours = rl_losses.linear_grpo_loss(h, w, x["target"], x["advantages"], x["old"], bias=b, loss_type=name,
                                          strategy=strategy, chunk_size=chunk, skip_unlabelled=skip,
                                          head_dtype=head_dtype, weight_main_grad=buffer if into_buffer else None,
                                          **options)
    logits64 = ref_logits(h64, w64, b64)
    rounded = logits64 if head_dtype == "float32" else logits64 + (logits64.to(dtype).double() - logits64).detach()
    torch.manual_seed(seed)
    theirs = reference.grpo_loss(rounded, x["target"], x["advantages"].double(), x["old"].double(), loss_type=name,
                                 **{k: v.double() if torch.is_tensor(v) else v for k, v in options.items()})
    low = dtype == torch.bfloat16
    tolerance = torch.float32 if head_dtype == "float32" else dtype
    assert_close(ours.loss, theirs.loss.detach(), tolerance, scale=2.0 if low else 1.0, msg="loss")
    for field in FIELDS:
        if getattr(theirs, field) is not None:
            assert_close(getattr(ours, field), getattr(theirs, field).detach(), tolerance,
                         scale=2.0 if low else 1.0, msg=field)
    if not any(requires):
        return
    ours.loss.backward()
    theirs.loss.backward()
    magnitudes = grad_magnitudes(logits64, h64, w64)
    grad_dtype = torch.bfloat16 if head_dtype == "float32" else dtype  # the gradient rounded once for the GEMMs
    scale = 2.0 if grad_dtype == torch.bfloat16 else 1.0
    if requires[0]:
        assert_linear_grad_close("hidden", h.grad, h64.grad, magnitudes[0], grad_dtype, scale=scale)
    if requires[1]:
        assert_linear_grad_close("bias", b.grad, b64.grad, magnitudes[2], grad_dtype, scale=scale)
        weight_grad = buffer - start if into_buffer else w.grad
        assert_linear_grad_close("weight", weight_grad, w64.grad, magnitudes[1], grad_dtype, scale=scale)
    if into_buffer:
        assert w.grad is None
    else:
        assert torch.equal(buffer, start)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "all_rows"])
@pytest.mark.parametrize("chunk", list(CHUNKS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_mode_matches_reference(device, name, mode, chunk, skip):
    check(device, torch.float64, name, mode, CHUNKS[chunk], skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("chunk", ["one_chunk", "chunks"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_mode_matches_reference_low_precision(device, name, mode, chunk, dtype):
    check(device, dtype, name, mode, CHUNKS[chunk])


@pytest.mark.parametrize("chunk", ["one_chunk", "chunks"])
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("name", list(CASES))
def test_float32_logits(device, name, mode, chunk):
    """head_dtype='float32': the revisited rows' fp32 gradient replaces or offsets the sweep's before its one
    rounding to bf16."""
    check(device, torch.bfloat16, name, mode, CHUNKS[chunk], head_dtype="float32")


@pytest.mark.parametrize("requires", [(True, False), (False, True), (False, False)],
                         ids=["hidden_only", "weight_only", "no_grad"])
@pytest.mark.parametrize("chunk", ["one_chunk", "chunks"])
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("name", list(CASES))
def test_either_gradient_or_none(device, name, mode, chunk, requires):
    check(device, torch.float64, name, mode, CHUNKS[chunk], requires=requires)


@pytest.mark.parametrize("masked", [0.0, 0.9], ids=["every_row_labelled", "few_rows_labelled"])
@pytest.mark.parametrize("mode", ["fast", "lean+main_grad"])
@pytest.mark.parametrize("name", list(CASES))
def test_labelled_share(device, name, mode, masked):
    """Few labelled rows: the bound (from all N rows) past an eighth of them keeps the statistics pass first."""
    check(device, torch.float64, name, mode, CHUNKS["chunks"], masked=masked)


@pytest.mark.parametrize("chunk", ["one_chunk", "chunks"])
@pytest.mark.parametrize("name", list(CASES))
def test_sampler_floors(device, name, chunk):
    """top_k: the sub-batch's floors computed from its recomputed logits, at the batch's rows."""
    check(device, torch.float64, name, "fast", CHUNKS[chunk], top_k=20)


def gemm_flops(step):
    """Σ m·k·n over the CPU GEMMs (aten::mm, aten::addmm) of one call of `step`."""
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    total = 0
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm"):  # mm(a, b[, out]), addmm(input, a, b, beta, alpha[, out])
            a, b = e.input_shapes[:2] if e.name == "aten::mm" else e.input_shapes[1:3]
            total += a[0] * a[1] * b[1]
    return total


@pytest.mark.parametrize("chunk", [None, 100])
@pytest.mark.parametrize("mode", ["fast", "lean", "fast+main_grad"])
def test_no_statistics_pass(mode, chunk):
    """fwd+bwd GEMM work of clip_cov and kl_cov within 5% of plain linear_grpo's (N = 400, a bound of 4 rows: their
    sub-batch's few GEMM rows), where a statistics pass first would add a third (a fourth in lean mode)."""
    n = 400
    hidden, weight, _ = make_linear((n,), 16, 64, torch.float32, "cpu")
    target = make_target((n,), 64, "cpu", masked=0.1)
    adv, old = torch.randn(n), torch.randn(n) - 4
    strategy, into_buffer = MODES[mode]
    flops = {}
    for name, options in {"plain": {}, **{k: dict(v, kl_cov_ratio=0.01, clip_cov_ratio=0.01)
                                          for k, v in CASES.items()}}.items():
        (h, w), _ = leaves(hidden, weight)
        buffer = torch.zeros(64, 16) if into_buffer else None
        flops[name] = gemm_flops(lambda: rl_losses.linear_grpo_loss(
            h, w, target, adv, old, strategy=strategy, chunk_size=chunk, weight_main_grad=buffer,
            loss_type="ppo_clip" if name == "plain" else name, **options).loss.backward())
    for name in CASES:
        assert flops["plain"] < flops[name] <= 1.05 * flops["plain"], flops


@pytest.mark.usefixtures("batch_invariant_mode")
@pytest.mark.parametrize("chunk", ["one_chunk", "chunks"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_batch_invariant_mode(device, name, mode, chunk):
    """The batch-invariant mode's GEMMs take whole pieces of rows: the sub-batch's too (its logits then the sweep's
    bits)."""
    check(device, torch.float32, name, mode, CHUNKS[chunk])
