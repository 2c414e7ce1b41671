"""Property-based tests: every op against the float64 reference on drawn shapes, dtypes, layouts, masks,
documents, extreme values and options.

What is asserted, for each output (loss, metrics, gradients):
  * where the float64 reference is finite and within the output dtype's range, the op's value is finite and
    close to it (the tolerance of the logits dtype, widened by the rounding of logits as large as those drawn);
  * where the reference is not finite (a NaN or inf input in a row that counts), the op's loss is not finite
    either: a non-finite input never yields a finite, wrong loss;
  * tokens that do not count (unlabelled, padding, a zero loss weight, a clipped ratio, A = 0) contribute exact
    zeros, also with non-finite logits or an overflowed ratio, in the op and in the reference alike;
  * where the reference overflows the output dtype (a ratio of e^100 times a negative advantage), nothing is
    asserted of that value, which cannot be represented, nor of the gradient rows of such tokens.
Inputs are drawn so that no ratio sits within 1e-3 of a clip boundary, where a rounding difference between the
fp32 op and the float64 reference would flip a clip and with it the gradient.

Profiles (environment variable RL_LOSSES_HYPOTHESIS_PROFILE): "ci" (the default: 25 examples per test,
derandomised, no example database) and "gpu" (400 examples per test, random, also on CUDA when available).
"""
import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rl_losses
from rl_losses import reference

from conftest import DEVICES, TOLERANCES
from helpers import label_log_probs64

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_HEALTH)
settings.register_profile("gpu", max_examples=400, deadline=None, database=None, suppress_health_check=_HEALTH)
PROFILE = os.environ.get("RL_LOSSES_HYPOTHESIS_PROFILE", "ci")
SETTINGS = settings(settings.get_profile(PROFILE))
DRAWN_DEVICES = DEVICES if PROFILE == "gpu" else ["cpu"]
MAX_ELEMENTS = 400_000  # N·V of one drawn problem (the float64 reference materialises a few N×V tensors)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


# ---- drawing ------------------------------------------------------------------------------------------------------
@st.composite
def problems(draw, *, max_rows=100_000, max_vocab=262_144):
    """(N, V), dtype, device, the logits (possibly a non-contiguous view) and the labels."""
    regime = draw(st.sampled_from(["tall", "wide", "small"]))
    if regime == "tall":
        v = draw(st.integers(1, 4))
        n = draw(st.integers(1, min(max_rows, MAX_ELEMENTS // v)))
    elif regime == "wide":
        v = draw(st.integers(1, max_vocab))
        n = draw(st.integers(1, max(1, min(3, MAX_ELEMENTS // v))))
    else:
        n, v = draw(st.integers(1, 64)), draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    device = draw(st.sampled_from(DRAWN_DEVICES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    values = draw(st.sampled_from(["normal", "large", "spiky", "neg_inf", "nan", "pos_inf"]))
    x = torch.randn(n, v, generator=gen, dtype=torch.float64) * 2.0
    if values == "large":
        x = x * 5e3  # logits up to about ±1e4 (±65504 caps fp16)
    elif values in ("spiky", "neg_inf", "nan", "pos_inf"):
        special = {"spiky": 1e4, "neg_inf": -math.inf, "nan": math.nan, "pos_inf": math.inf}[values]
        hit = torch.rand(n, v, generator=gen) < 0.05
        hit[torch.randint(0, n, (1,), generator=gen), torch.randint(0, v, (1,), generator=gen)] = True
        x = torch.where(hit, torch.tensor(special, dtype=torch.float64), x)
    layout = draw(st.sampled_from(["contiguous", "row_slice", "every_other_row", "batch_3d"]))
    if layout == "row_slice":  # rows of a wider buffer: row stride > V
        buf = torch.zeros(n, v + 3, dtype=dtype, device=device)
        logits = buf[:, 1:v + 1]
        logits.copy_(x)
    elif layout == "every_other_row":
        buf = torch.zeros(2 * n, v, dtype=dtype, device=device)
        logits = buf[::2]
        logits.copy_(x)
    elif layout == "batch_3d" and n % 2 == 0:  # (2, N/2, V) with its batch dims swapped: not flattenable
        logits = x.to(dtype).reshape(n // 2, 2, v).transpose(0, 1).to(device)
    else:
        logits = x.to(dtype).to(device)
    masked = draw(st.sampled_from([0.0, 0.3, 1.0]))
    target = torch.randint(0, v, logits.shape[:-1], generator=gen)
    target = torch.where(torch.rand(target.shape, generator=gen) < masked, -100, target).to(device)
    scale = draw(st.sampled_from([1.0, 0.5, 2.0]))
    return logits, target, scale, gen


def _magnitude(logits, scale):
    finite = logits.double()[torch.isfinite(logits.double())]
    return scale * (finite.abs().max().item() if finite.numel() else 0.0)


def _shifts(draw, count, gen, epsilon_low, epsilon_high, delta, magnitude):
    """Log-ratios lp - old for `count` tokens or documents: small, or beyond e^±100, away from the clips (by more
    than the fp32 rounding of log-probs computed from logits of the given magnitude)."""
    bounds = [1 - epsilon_low, 1 + epsilon_high] + ([delta] if delta is not None else [])
    extreme = draw(st.sampled_from([0.0, 0.1, 0.5]))
    d = torch.randn(count, generator=gen, dtype=torch.float64) * 0.3
    far = torch.rand(count, generator=gen) < extreme
    d = torch.where(far, torch.sign(d) * (100 + 50 * torch.rand(count, generator=gen, dtype=torch.float64)), d)
    r = d.exp()
    near = torch.zeros(count, dtype=torch.bool)
    for b in bounds:
        near |= (r - b).abs() < 1e-3 + 2.5e-7 * magnitude
    return torch.where(near, torch.zeros_like(d), d)  # r = 1 is inside every clip range drawn here


# ---- comparing --------------------------------------------------------------------------------------------------
def _check_value(ours, ref, dtype, magnitude, what, natural_scale=0.0, skip_rows=None):
    """ours vs the float64 reference, elementwise, under the rules of the module docstring. Errors are measured
    relative to the largest reference value, or to `natural_scale` where that is larger (see
    helpers.assert_grad_close: a cross-entropy gradient p - onehot that cancels to ~0, as at V = 1)."""
    limit = torch.finfo(ours.dtype).max  # the output's own dtype: the gradient's is the logits'
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    ok = torch.isfinite(ref) & (ref.abs() < limit / 4)
    if skip_rows is not None:  # rows of a gradient whose coefficient overflows (see _check_loss)
        ok &= ~skip_rows.cpu().unsqueeze(-1)
    if not ok.any():
        return
    norm = max(ref[ok].abs().max().item(), natural_scale, 1e-30)
    rtol, atol = TOLERANCES[dtype]
    # Logits of size M carry a rounding of M·2^-24 in fp32 arithmetic; it reaches the loss and the gradient's
    # probabilities. (Values beyond this bound are the large-|s·z| precision question, tested elsewhere.)
    # A loss or metric is a sum of terms of size up to ~1 each, which may cancel: its floor is absolute.
    acc_eps = 2.0**-52 if dtype == torch.float64 else 2.0**-24
    slack = 8 * acc_eps * max(magnitude, 1.0)
    floor = norm if what == "grad" else max(norm, 1.0)
    assert torch.isfinite(ours[ok]).all(), f"{what}: non-finite where the reference is finite"
    err = (ours[ok] - ref[ok]).abs()
    bound = (atol + slack) * floor + rtol * ref[ok].abs() + rtol * norm * (what == "grad")
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{what}: |{ours[ok][worst].item()} - {ref[ok][worst].item()}| > "
                                  f"{bound[worst].item()}")


def _check_loss(ours, ref, dtype, magnitude):
    """Checks the loss; returns whether its gradient is defined in the op's dtypes. It is not where the loss
    overflows them: a token's loss and its gradient coefficient are of one size (r·A/D, β·e^d/D), so an
    unclipped ratio beyond e^88 that overflows one overflows the other, and even gradient entries whose exact
    value is small (p_j·r·A with p_j tiny, or 0 at V = 1) come out of inf·p as inf or NaN. (Where a NaN input
    already makes the loss NaN, the policy tests leave out such tokens' rows themselves.)"""
    if not torch.isfinite(ref).all():
        assert not torch.isfinite(ours.detach()).all(), "finite loss where the reference is not"
    _check_value(ours, ref, dtype, magnitude, "loss")
    return not (torch.isfinite(ref) & (ref.abs() >= torch.finfo(ours.dtype).max / 4)).any()


def _flattenable(logits):
    try:
        logits.view(-1, logits.shape[-1])
        return True
    except RuntimeError:
        return False


def _run(fn, logits, inplace=False):
    """fn(x) -> [loss, extras...] on a differentiable tensor with logits' values and exact layout (shape, strides,
    offset in its buffer); returns the outputs and the gradient with respect to x."""
    base = logits._base if logits._base is not None else logits
    leaf = base.detach().clone().requires_grad_()  # clone keeps a dense tensor's strides
    x = (leaf * 1.0).as_strided(logits.shape, logits.stride(), logits.storage_offset())
    if not inplace:
        x.retain_grad()
    out = fn(x)
    out[0].backward()
    return out, x.detach() if inplace else x.grad  # in place: x's memory holds its gradient


def _ref_run(fn, logits):
    x = logits.detach().double().cpu().requires_grad_()
    out = fn(x)
    out[0].backward()
    return out, x.grad


# ---- the properties ---------------------------------------------------------------------------------------------
@SETTINGS
@given(problem=problems(), data=st.data())
def test_cross_entropy_property(problem, data):
    logits, target, scale, _ = problem
    options = dict(logits_scale_factor=scale,
                   label_smoothing=data.draw(st.sampled_from([0.0, 0.1])),
                   z_loss_factor=data.draw(st.sampled_from([0.0, 1e-4])),
                   reduction=data.draw(st.sampled_from(["mean", "sum", "none"])))
    if options["reduction"] != "none":
        options["divisor"] = data.draw(st.sampled_from([None, 7.0]))
    inplace = data.draw(st.booleans()) and _flattenable(logits)
    out, grad = _run(lambda x: (rl_losses.cross_entropy(x, target, inplace_backward=inplace, **options).sum(),),
                     logits, inplace)
    ref, ref_grad = _ref_run(lambda x: (reference.cross_entropy(x, target.cpu(), **options).sum(),), logits)
    m = _magnitude(logits, scale)
    _check_loss(out[0], ref[0], logits.dtype, m)
    divisor = options.get("divisor") or (max(int((target >= 0).sum()), 1) if options["reduction"] == "mean" else 1)
    _check_value(grad, ref_grad, logits.dtype, m, "grad", natural_scale=scale / divisor)


@SETTINGS
@given(problem=problems(max_vocab=4096), data=st.data())
def test_z_loss_property(problem, data):
    logits, target, scale, _ = problem
    mask = target >= 0
    divisor = data.draw(st.sampled_from([None, 3.0]))
    out, grad = _run(lambda x: (rl_losses.z_loss(x, loss_mask=mask, logits_scale_factor=scale, divisor=divisor),),
                     logits)
    ref, ref_grad = _ref_run(lambda x: (reference.z_loss(x, loss_mask=mask.cpu(), logits_scale_factor=scale,
                                                         divisor=divisor),), logits)
    m = _magnitude(logits, scale)
    _check_loss(out[0], ref[0], logits.dtype, m)
    _check_value(grad, ref_grad, logits.dtype, m, "grad")


def _policy_metrics(out):
    return [out.loss, out.new_logprobs, out.clipped_fraction_low, out.clipped_fraction_high, out.kl_old,
            out.log_probs, out.ratio_mean] + ([out.entropy] if out.entropy is not None else [])


def _policy_grad_scale(target, adv, shift, scale, options, beta):
    """s·max_t |w_t|·(|A_t|·r_t + β·e^{d_t})/D over the labelled tokens with ratios near 1 (|log r| <= 3 here; the
    others are clipped, overflowing or vanishing): the size of a token's gradient coefficient before its parts
    cancel. A rounding of lp (δ ~ 2^-24 times the logits' size) moves the coefficient by about this much times
    δ, however small the coefficient itself ends up (β·expm1(d) with d near 0)."""
    mask = (target >= 0).cpu() & (shift.abs() < 50).cpu()
    w = options.get("loss_weights")
    w = torch.ones(target.shape) if w is None else w.double().cpu().abs()
    parts = w * (adv.double().cpu().abs() * shift.cpu().clamp(max=3).exp() + beta * 2)
    divisor = options.get("divisor") or max(int((target >= 0).sum()), 1)
    return scale * (parts[mask].max().item() if mask.any() else 0.0) / divisor


@SETTINGS
@given(problem=problems(max_vocab=65536), data=st.data())
def test_grpo_property(problem, data):
    logits, target, scale, gen = problem
    n = target.numel()
    el, eh = data.draw(st.sampled_from([(0.2, 0.2), (0.1, 0.3)]))
    delta = data.draw(st.sampled_from([None, 2.0]))
    beta = data.draw(st.sampled_from([0.0, 0.05]))
    lp = label_log_probs64(logits.reshape(n, -1).cpu(), target.reshape(-1).cpu(), scale).reshape(target.shape)
    shift = _shifts(data.draw, n, gen, el, eh, delta, _magnitude(logits, scale)).reshape(target.shape)
    dev = logits.device
    adv = torch.randn(target.shape, generator=gen).to(dev)
    if data.draw(st.booleans()):
        adv = torch.where(torch.rand(target.shape, generator=gen).to(dev) < 0.2, 0.0, adv)
    old = (lp - shift).float().to(dev)
    options = dict(epsilon_low=el, epsilon_high=eh, delta=delta, beta=beta, logits_scale_factor=scale,
                   compute_entropy=data.draw(st.booleans()))
    if beta:
        options["ref_log_probs"] = (lp + 0.1 * torch.randn(target.shape, generator=gen, dtype=torch.float64)).float()
    if data.draw(st.booleans()):
        options["loss_weights"] = torch.where(torch.rand(target.shape, generator=gen) < 0.2, 0.0,
                                              torch.rand(target.shape, generator=gen)).to(dev)
    if data.draw(st.booleans()):
        options["divisor"] = 5.0
    dev_options = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    cpu_options = {k: v.double().cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    inplace = data.draw(st.booleans()) and _flattenable(logits)
    out, grad = _run(lambda x: _policy_metrics(rl_losses.grpo_loss(x, target, adv, old, inplace_backward=inplace,
                                                                   **dev_options)), logits, inplace)
    ref, ref_grad = _ref_run(lambda x: _policy_metrics(reference.grpo_loss(x, target.cpu(), adv.double().cpu(),
                                                                           old.double().cpu(), **cpu_options)),
                             logits)
    m = _magnitude(logits, scale)
    grad_defined = _check_loss(out[0], ref[0], logits.dtype, m)
    for name, o, r in zip(["new_logprobs", "low", "high", "kl_old", "log_probs", "ratio_mean", "entropy"], out[1:],
                          ref[1:]):
        _check_value(o, r, logits.dtype, m, name)
    if grad_defined:
        # An unclipped, uncapped token with A < 0 and r beyond e^80: its coefficient overflows fp32.
        overflow = (adv < 0) & (shift.to(dev) > 80) if delta is None else None
        _check_value(grad, ref_grad, logits.dtype, m, "grad", skip_rows=overflow,
                     natural_scale=_policy_grad_scale(target, adv, shift, scale, options, beta))


@SETTINGS
@given(problem=problems(max_vocab=65536), data=st.data())
def test_gspo_property(problem, data):
    logits, target, scale, gen = problem
    n = target.numel()
    dev = logits.device
    n_docs = data.draw(st.integers(1, max(1, min(n, 50))))
    doc = torch.sort(torch.randint(0, n_docs, (n,), generator=gen)).values
    doc = torch.where(torch.rand(n, generator=gen) < 0.1, -1, doc)  # padding
    el, eh = data.draw(st.sampled_from([(0.2, 0.2), (0.1, 0.3)]))
    lp = label_log_probs64(logits.reshape(n, -1).cpu(), target.reshape(-1).cpu(), scale)
    # One log-ratio per document.
    shift = _shifts(data.draw, n_docs, gen, el, eh, None, _magnitude(logits, scale))[doc.clamp_min(0)]
    adv = torch.randn(n, generator=gen)
    old = (lp - shift).float()
    options = dict(epsilon_low=el, epsilon_high=eh, logits_scale_factor=scale, num_documents=n_docs,
                   weighting=data.draw(st.sampled_from(["document", "token"])),
                   token_advantages=data.draw(st.booleans()), compute_entropy=data.draw(st.booleans()))
    shape = target.shape
    args = [t.reshape(shape) for t in (adv, old, doc)]
    inplace = data.draw(st.booleans()) and _flattenable(logits)
    out, grad = _run(lambda x: _policy_metrics(rl_losses.gspo_loss(x, target, *[a.to(dev) for a in args],
                                                                   inplace_backward=inplace, **options)),
                     logits, inplace)
    ref, ref_grad = _ref_run(lambda x: _policy_metrics(reference.gspo_loss(x, target.cpu(), args[0].double(),
                                                                           args[1].double(), args[2], **options)),
                             logits)
    m = _magnitude(logits, scale)
    grad_defined = _check_loss(out[0], ref[0], logits.dtype, m)
    for o, r in zip(out[1:], ref[1:]):
        _check_value(o, r, logits.dtype, m, "metric")
    if grad_defined:
        # Documents with R beyond e^80: their tokens' coefficients overflow fp32 unless a clip zeroes them.
        labelled = (target.reshape(-1).cpu() >= 0) & (doc >= 0)
        counts = torch.zeros(n_docs).index_add_(0, doc.clamp_min(0), labelled.float())
        n_labelled_docs = max(int((counts > 0).sum()), 1)
        smallest = counts[counts > 0].min().item() if (counts > 0).any() else 1.0
        kappa = 1.0 if options["weighting"] == "token" else 1.0 / smallest
        natural = scale * 5.0 * adv.abs().max().item() * kappa / n_labelled_docs
        _check_value(grad, ref_grad, logits.dtype, m, "grad", skip_rows=(shift > 80).reshape(shape),
                     natural_scale=natural)


@SETTINGS
@given(data=st.data())
def test_linear_ops_property(data):
    n, h, v = data.draw(st.integers(1, 48)), data.draw(st.integers(1, 16)), data.draw(st.integers(1, 64))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    device = data.draw(st.sampled_from(DRAWN_DEVICES))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * data.draw(st.sampled_from([0.1, 1.0, 30.0]))
    target = torch.where(torch.rand(n, generator=gen) < 0.3, -100, torch.randint(0, v, (n,), generator=gen))
    op = data.draw(st.sampled_from(["cross_entropy", "grpo", "gspo"]))
    chunk = data.draw(st.sampled_from([None, 1, 7]))
    lp = label_log_probs64(hidden @ weight.T, target)
    adv = torch.randn(n, generator=gen)
    old = (lp - 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    doc = torch.arange(n) * 3 // max(n, 1)

    def ours(hd, wt):
        t, a, o, d = (x.to(device) for x in (target, adv, old, doc))
        if op == "cross_entropy":
            return [rl_losses.linear_cross_entropy(hd, wt, t, chunk_size=chunk)]
        if op == "grpo":
            return [rl_losses.linear_grpo_loss(hd, wt, t, a, o, chunk_size=chunk).loss]
        return [rl_losses.linear_gspo_loss(hd, wt, t, a, o, d, num_documents=3, chunk_size=chunk).loss]

    def ref(hd, wt):
        x = hd @ wt.T
        if op == "cross_entropy":
            return [reference.cross_entropy(x, target)]
        if op == "grpo":
            return [reference.grpo_loss(x, target, adv.double(), old.double()).loss]
        return [reference.gspo_loss(x, target, adv.double(), old.double(), doc, num_documents=3).loss]

    hd, wt = (t.to(dtype).to(device).requires_grad_() for t in (hidden, weight))
    loss = ours(hd, wt)[0]
    loss.backward()
    h64, w64 = (t.to(dtype).double().requires_grad_() for t in (hidden, weight))
    ref_loss = ref(h64, w64)[0]
    ref_loss.backward()
    m = (hidden.abs().sum(1).max() * weight.abs().max()).item()
    _check_loss(loss, ref_loss, dtype, m)
    # The size of a row's gradient coefficient (1 for the cross-entropy, |A|·r for the policy losses; r ~ 1 here)
    # over D, through the GEMMs: the floor of gradients whose p - onehot cancels (a dominant logit).
    labelled = target >= 0
    d = max(int(labelled.sum()), 1) if op != "gspo" else max(int(torch.unique(doc[labelled]).numel()), 1)
    coef = 1.0 if op == "cross_entropy" else 1.5 * adv.abs().max().item()
    _check_value(hd.grad, h64.grad, dtype, m, "grad", natural_scale=coef * weight.abs().max().item() / d)
    _check_value(wt.grad, w64.grad, dtype, m, "grad", natural_scale=coef * hidden.abs().max().item() / d)
