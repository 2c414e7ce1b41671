"""The sampler's distribution (top_k, top_p, min_p; docs/consistency.md): the float64 reference against a literal
re-implementation of vLLM's filtering, and every op that takes the options against the reference: log-probs,
entropies, losses and gradients, scalar and per-row options, ties, rows where one token holds all the mass, labels
outside the kept set; bad inputs on the real op and the fake kernel."""
import pytest
import torch

import rl_losses
from rl_losses import reference
from rl_losses.reference_sampler import kept

from conftest import assert_close
from helpers import assert_fake_rejects_like_real, assert_grad_close, param_id, requires_cuda

ops = torch.ops.rl_losses
INF = float("inf")


def vllm_kept(x, top_k, top_p, min_p):
    """vLLM v1's sampler filters as its code reads (temperature already applied): min_p's mask, then
    apply_top_k_top_p's ascending sort, k-th value threshold and cumulative-sum mask."""
    x = x.clone()
    if min_p is not None:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), -INF)
    logits_sort, idx = x.sort(dim=-1, descending=False)
    if top_k is not None:
        threshold = logits_sort.gather(1, (logits_sort.size(1) - top_k).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, -INF)
    if top_p is not None:
        cumulative = logits_sort.softmax(-1).cumsum(-1)
        mask = cumulative <= 1 - top_p[:, None]
        mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(mask, -INF)
    return logits_sort.scatter(-1, idx, logits_sort) > -INF


def _options(n, vocab, gen_kind):
    k = torch.randint(1, vocab, (n,))
    p = torch.rand(n) * 0.9 + 0.05
    m = torch.rand(n) * 0.2
    return {"both": dict(top_k=k, top_p=p), "k": dict(top_k=k), "p": dict(top_p=p), "min_p": dict(min_p=m),
            "all": dict(top_k=k, top_p=p, min_p=m)}[gen_kind]


def _moved(o, f):
    """The options with top_p (at most 1) and min_p times f."""
    out = dict(o)
    if "top_p" in o:
        out["top_p"] = torch.as_tensor(o["top_p"] * f).clamp(max=1.0)
    if "min_p" in o:
        out["min_p"] = o["min_p"] * f
    return out


def _clear_options(x, n, vocab, kind, per_row):
    """Options whose kept sets do not change when top_p and min_p move by 0.1% (the ops sum fp32 exponentials in
    fixed point: a decision that close to its edge is the rounding's), drawn again until so."""
    unlabelled = torch.full((n,), -1)
    for _ in range(200):
        o = _options(n, vocab, kind)
        if not per_row:
            o = {name: value[0].item() for name, value in o.items()}
        keep = kept(x, unlabelled, **o)
        if all(torch.equal(keep, kept(x, unlabelled, **_moved(o, f))) for f in (0.999, 1.001)):
            return o, keep
    raise AssertionError("no options clear of the edges were drawn")


def _sample(x, keep):
    """Labels drawn from the filtered distribution: what the engine would have sampled."""
    return torch.multinomial(x.masked_fill(~keep, -INF).softmax(-1), 1).squeeze(1)


@pytest.mark.parametrize("kind", ["k", "p", "min_p", "both", "all"])
def test_reference_is_vllms_filter(kind):
    n, vocab = 64, 300
    x = torch.randn(n, vocab, dtype=torch.float64) * 3
    o = _options(n, vocab, kind)
    expected = vllm_kept(x, o.get("top_k"), o.get("top_p"), o.get("min_p"))
    assert torch.equal(kept(x, _sample(x, expected), **o), expected)


def test_reference_keeps_a_tie_whole():
    # Coarse logits: many ties. vLLM keeps the part of a tie group its sort puts last; the reference keeps the group
    # whole, and nothing else more.
    n, vocab = 64, 200
    x = torch.round(torch.randn(n, vocab, dtype=torch.float64) * 2)
    o = _options(n, vocab, "both")
    theirs = vllm_kept(x, o["top_k"], o["top_p"], None)
    ours = kept(x, _sample(x, theirs), **o)
    assert (ours >= theirs).all()
    extra = ours & ~theirs
    for r, c in extra.nonzero().tolist():
        assert (theirs[r] & (x[r] == x[r, c])).any(), "an extra token that ties no kept one"
    assert extra.any(), "no tie at the edge: the case tests nothing"


def _inputs(device, dtype, n, vocab, kind, per_row, scale=1.0):
    """Logits with a row of all the mass and a row of ties, options (per row or scalars), labels sampled from the
    filtered distribution but a few outside it and a few unlabelled."""
    x = (torch.randn(n, vocab, dtype=torch.float64) * 2).to(dtype).double()  # the values the op sees
    x[0, 3] = 60.0  # one token holds all the mass
    x[1] = torch.round(x[1])  # ties
    o, keep = _clear_options(x * scale, n, vocab, kind, per_row)
    target = _sample(x, keep)
    target[2] = int(torch.where(keep[2], INF, x[2]).argmin())  # outside the kept set where there is one
    target[5] = -100
    logits = x.to(dtype).to(device)
    options = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in o.items()}
    return logits, target.to(device), options


def _for_reference(options):
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in options.items()}


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("kind", ["k", "p", "min_p", "all"])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
def test_token_log_probs(device, dtype, kind, per_row):
    n, vocab, temperature = 24, 333, 0.8
    logits, target, o = _inputs(device, dtype, n, vocab, kind, per_row, 1 / temperature)
    logits.requires_grad_()
    lp, h = rl_losses.token_log_probs(logits, target, temperature=temperature, compute_entropy=True, **o)
    up = torch.randn(2, n, device=device)
    ((lp * up[0]).sum() + (h * up[1]).sum()).backward()
    x = logits.detach().double().cpu().requires_grad_()
    ref_lp, ref_h = reference.token_log_probs(x, target.cpu(), logits_scale_factor=1 / temperature,
                                              compute_entropy=True, **_for_reference(o))
    ((ref_lp * up[0].double().cpu()).sum() + (ref_h * up[1].double().cpu()).sum()).backward()
    scale = 10 if dtype == torch.bfloat16 else 1
    assert_close(lp, ref_lp.detach(), dtype, scale=scale)
    assert_close(h, ref_h.detach(), dtype, scale=scale)
    # scale: in a row whose kept set is its top token alone the gradient is 0 up to ulp(s·z)·|g| (CUDA's fp32
    # exponent of p = 1 is s·z − round(s·z)).
    assert_grad_close(logits.grad, x.grad, dtype, natural_scale=1 / temperature, scale=3)
    # The kept set is what changed: the unfiltered log-probs differ.
    full, _ = rl_losses.token_log_probs(logits.detach(), target, temperature=temperature)
    assert not torch.equal(full, lp.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_top_k_over_a_wide_vocabulary(device, dtype):
    """Rows wide enough that every thread of the CUDA selection reads several vectors of each (V = 20000), every
    top_k from 1 to past the kernel's 4096 group maxima (where it selects over the row), rows with ties, and min_p
    floors above and below the top_k edge."""
    n, vocab = 13, 20000
    k = torch.tensor([1, 2, 7, 50, 1000, 1023, 1024, 1025, 4000, 1024, 3, 600, 5000])
    unlabelled = torch.full((n,), -1)
    for _ in range(50):
        x = (torch.randn(n, vocab, dtype=torch.float64) * 2).to(dtype).double()
        x[1] = torch.round(x[1])  # ties
        min_p = torch.zeros(n, dtype=torch.float64)
        min_p[9:12] = torch.tensor([0.001, 0.2, 1e-6])  # a floor below, above and far below the bound
        o = dict(top_k=k, min_p=min_p)
        keep = kept(x, unlabelled, **o)
        if all(torch.equal(keep, kept(x, unlabelled, **_moved(o, f))) for f in (0.999, 1.001)):
            break
    _check_kept_set(device, dtype, x, keep, o, scale=10 if dtype == torch.bfloat16 else 1)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_top_p_over_rows_past_a_million_tokens(dtype):
    """Rows of more than 2^20 tokens, where the CUDA selection sums each bin's top_p mass with 64-bit atomics rather
    than two 32-bit sums, alone and after top_k (the CPU's selection has one path for every length)."""
    device = "cuda"
    n, vocab = 3, (1 << 20) + 3
    unlabelled = torch.full((n,), -1)
    o = dict(top_p=torch.tensor([0.5, 0.95, 0.9], dtype=torch.float64), top_k=torch.tensor([0, 0, 1000]))
    for _ in range(20):
        # 5000 tokens hold the mass; the rest lie ~30 below, where a token's fixed-point mass is 0 (their float64
        # mass, ~1e-7 of the row's, moves no decision).
        x = torch.randn(n, vocab, dtype=torch.float64) - 30
        top = torch.randint(0, vocab, (n, 5000))
        x.scatter_(1, top, torch.randn(n, 5000, dtype=torch.float64) * 2)
        x = x.to(dtype).double()
        keep = kept(x, unlabelled, **o)
        if all(torch.equal(keep, kept(x, unlabelled, **_moved(o, f))) for f in (0.999, 1.001)):
            break
    # fp32 sums over a million kept tokens: their rounding (~sqrt(V) ulps) sets the tolerance.
    _check_kept_set(device, dtype, x, keep, o, scale=10)


@requires_cuda
def test_top_k_with_more_candidates_than_the_kernel_keeps():
    """Rows of ties (values -2..2) 300000 long: the CUDA selection's candidates for top_k = 1000 and 1024 (the logits
    at or above the k-th largest of its group maxima, here 1) outnumber its room for them, and it reads the row
    instead; for top_k = 1 and 5 they fit."""
    n, vocab = 4, 300000
    unlabelled = torch.full((n,), -1)
    x = torch.round(torch.randn(n, vocab, dtype=torch.float64) * 0.5)
    o = dict(top_k=torch.tensor([1, 5, 1000, 1024]))
    _check_kept_set("cuda", torch.bfloat16, x, kept(x, unlabelled, **o), o, scale=10)


def _check_kept_set(device, dtype, x, keep, o, scale):
    """token_log_probs with options `o` over x (float64 values of `dtype`) against the reference, on labels drawn
    from the kept sets `keep`, whose tokens are exactly those with a nonzero gradient."""
    target = _sample(x, keep)
    logits = x.to(dtype).to(device).requires_grad_()
    options = {name: value.to(device) for name, value in o.items()}
    lp, _ = rl_losses.token_log_probs(logits, target.to(device), **options)
    lp.sum().backward()
    ref = x.clone().requires_grad_()
    ref_lp, _ = reference.token_log_probs(ref, target, **o)
    ref_lp.sum().backward()
    assert_close(lp, ref_lp.detach(), dtype, scale=scale)
    assert_grad_close(logits.grad, ref.grad, dtype, scale=3)
    # The kept sets are the reference's: the gradient is nonzero exactly there (the labels were drawn from them;
    # a set of one token has a gradient of 0 up to rounding).
    wide = keep.sum(-1) > 1
    assert torch.equal((logits.grad.cpu() != 0)[wide], keep[wide])


def _policy(op, logits, target, o, *, document_index=None, linear=None):
    n, device = target.shape[0], target.device
    g = torch.Generator().manual_seed(n)
    adv = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    old = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).to(device)
    args = (adv, old) if op == "grpo" else (adv, old, document_index)
    kw = dict(epsilon_low=0.2, epsilon_high=0.28, compute_entropy=True, beta=0.0)
    if linear is None:
        return getattr(rl_losses, f"{op}_loss")(logits, target, *args, **kw, **o), args, kw
    hidden, weight = linear
    out = getattr(rl_losses, f"linear_{op}_loss")(hidden, weight, target, *args, chunk_size=7, **kw, **o)
    return out, args, kw


@pytest.mark.parametrize("op", ["grpo", "gspo"])
@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("kind", ["p", "all"])
def test_policy_ops(device, op, dtype, kind):
    n, vocab = 20, 257
    logits, target, o = _inputs(device, dtype, n, vocab, kind, True)
    doc = torch.arange(n, device=device) // 5
    logits.requires_grad_()
    out, args, kw = _policy(op, logits, target, o, document_index=doc)
    out.loss.backward()
    x = logits.detach().double().cpu().requires_grad_()
    ref = getattr(reference, f"{op}_loss")(x, target.cpu(), *(a.cpu().double() if a.is_floating_point() else a.cpu()
                                                                for a in args), **kw, **_for_reference(o))
    ref.loss.backward()
    scale = 10 if dtype == torch.bfloat16 else 1
    assert_close(out.loss, ref.loss.detach(), dtype, scale=scale)
    assert_close(out.log_probs, ref.log_probs, dtype, scale=scale)
    assert_close(out.entropy, ref.entropy.detach(), dtype, scale=scale)
    assert_grad_close(logits.grad, x.grad, dtype)


@pytest.mark.parametrize("op", ["token_log_probs", "grpo", "gspo"])
def test_linear_forms(device, op):
    n, hidden_size, vocab = 30, 16, 211
    hidden = torch.randn(n, hidden_size, dtype=torch.float64, device=device, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, dtype=torch.float64, device=device) * 0.5).requires_grad_()
    x = (hidden @ weight.t()).detach().cpu()
    o, keep = _clear_options(x, n, vocab, "all", True)
    target = _sample(x, keep)
    target[4] = -1
    target, dev_o = target.to(device), {k: v.to(device) for k, v in o.items()}
    if op == "token_log_probs":
        lp, h = rl_losses.linear_token_log_probs(hidden, weight, target, compute_entropy=True, chunk_size=7, **dev_o)
        loss = (lp * torch.arange(n, device=device)).sum() + h.sum()
        ref_lp, ref_h = reference.linear_token_log_probs(hidden.detach().cpu().requires_grad_(), weight.detach().cpu(),
                                                         target.cpu(), compute_entropy=True, **o)
        assert_close(lp, ref_lp.detach(), torch.float64)
    else:
        doc = torch.arange(n, device=device) // 6
        out, _, _ = _policy(op, None, target, dev_o, document_index=doc, linear=(hidden, weight))
        loss = out.loss
    loss.backward()
    hh, ww = hidden.detach().cpu().requires_grad_(), weight.detach().cpu().requires_grad_()
    logits = hh @ ww.t()
    if op == "token_log_probs":
        ref_lp, ref_h = reference.token_log_probs(logits, target.cpu(), compute_entropy=True, **o)
        ref_loss = (ref_lp * torch.arange(n)).sum() + ref_h.sum()
    else:
        doc = torch.arange(n) // 6
        ref_out, _, _ = _policy(op, logits, target.cpu(), o, document_index=doc)
        ref_loss = ref_out.loss
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), torch.float64)
    assert_close(hidden.grad, hh.grad, torch.float64)
    assert_close(weight.grad, ww.grad, torch.float64)


@requires_cuda
def test_top_k_room_only_where_top_k_acts():
    """The CUDA selection's room for top_k's candidates (32768 logits per block) is allocated only where top_k may
    act: top_p and min_p alone, or top_k given as the number 0, take none; the kept sets stay the reference's."""
    n, vocab = 64, 1000
    unlabelled = torch.full((n,), -1)
    room = n * 32768 * 2  # bf16, a block per row at this size
    for o, has_room in [(dict(top_p=0.9), False), (dict(min_p=0.05, top_k=0), False), (dict(top_k=10), True),
                        (dict(top_k=torch.tensor([0] * n), top_p=0.9), True)]:
        for _ in range(50):  # rows whose kept sets do not sit on a rounding edge
            x = (torch.randn(n, vocab, dtype=torch.float64) * 2).to(torch.bfloat16).double()
            keep = kept(x, unlabelled, **o)
            if all(torch.equal(keep, kept(x, unlabelled, **_moved(o, f))) for f in (0.999, 1.001)):
                break
        logits = x.to("cuda", torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in o.items()}
        rl_losses.token_log_probs(logits, torch.zeros(n, dtype=torch.long, device="cuda"), **on_gpu)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - start
        assert (extra >= room) == has_room, (o, extra)
        _check_kept_set("cuda", torch.bfloat16, x, keep, {k: torch.as_tensor(v) for k, v in o.items()}, scale=10)


def test_options_off_change_nothing(device):
    # top_k = 0, top_p = 1 and min_p = 0 (as numbers) filter nothing: the plain op's bits.
    logits = torch.randn(9, 50, device=device)
    target = torch.randint(0, 50, (9,), device=device)
    plain = rl_losses.token_log_probs(logits, target, compute_entropy=True)
    off = rl_losses.token_log_probs(logits, target, compute_entropy=True, top_k=0, top_p=1.0, min_p=0.0)
    assert torch.equal(plain[0], off[0]) and torch.equal(plain[1], off[1])


def test_opcheck():
    logits = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (6,))
    kwargs = dict(top_k=torch.tensor(5), top_p=torch.full((6,), 0.7, dtype=torch.float64), compute_entropy=True)
    torch.library.opcheck(ops.token_log_probs, (logits, target), kwargs)
    adv, old = torch.randn(6, dtype=torch.float64), -torch.rand(6, dtype=torch.float64)
    torch.library.opcheck(ops.grpo, (logits, target, adv, old), dict(min_p=torch.tensor(0.05)))


def _tlp(d, **kw):
    return ops.token_log_probs(torch.randn(4, 7, device=d), torch.zeros(4, dtype=torch.long, device=d), **kw)


def _lin(d, **kw):
    return ops.linear_token_log_probs(torch.randn(4, 5, device=d), torch.randn(7, 5, device=d),
                                      torch.zeros(4, dtype=torch.long, device=d), **kw)


def _t(d, value, dtype=None):
    return torch.tensor(value, dtype=dtype, device=d)


# Bad inputs the fake kernels reject as the real op does (tests/test_fake_checks.py runs them).
BAD_INPUTS = [
    ("float_top_k", lambda d: _tlp(d, top_k=_t(d, 2.0)), "top_k must be an integer tensor, got Float"),
    ("int_top_p", lambda d: _tlp(d, top_p=_t(d, 1)), "top_p must be a floating-point tensor, got Long"),
    ("shape", lambda d: _tlp(d, min_p=torch.zeros(3, device=d)),
     r"min_p must be 0-dim \(every row\) or shaped like the target \[4\], got shape \[3\]"),
    ("row_stats", lambda d: _tlp(d, top_p=_t(d, 0.5), row_stats=torch.zeros(4, 5, device=d)),
     "not available with row_stats"),
    ("shard", lambda d: _tlp(d, top_p=_t(d, 0.5), vocab_size=20), "not available with a vocabulary shard"),
    ("lean", lambda d: _lin(d, top_k=_t(d, 2), strategy="lean"), "strategy='lean' does not hold"),
    ("grpo", lambda d: ops.grpo(torch.randn(4, 7, device=d), torch.zeros(4, dtype=torch.long, device=d),
                                torch.zeros(4, device=d), None, top_k=_t(d, 1.5)), "top_k must be an integer"),
]


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_fake_like_real(name, call, message):
    assert_fake_rejects_like_real(call, message)


@pytest.mark.parametrize("name,value,message", [
    ("top_k", -1, r"top_k must hold values in \[0, 1e\+09\], got -1"),
    ("top_p", 0.0, r"top_p must hold values in \(0, 1\], got 0"),
    ("top_p", 1.5, r"top_p must hold values in \(0, 1\], got 1.5"),
    ("min_p", 1.01, r"min_p must hold values in \[0, 1\], got 1.01"),
    ("min_p", -0.1, r"min_p must hold values in \[0, 1\], got -0.1"),
    ("top_p", float("nan"), r"top_p must hold values in \(0, 1\], got -?nan"),
])
def test_values_out_of_range(device, name, value, message):
    logits, target = torch.randn(4, 7, device=device), torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises((RuntimeError, ValueError), match=message):
        rl_losses.token_log_probs(logits, target, **{name: value})
    per_row = torch.tensor([0.5, value, 0.5, 0.5] if name != "top_k" else [1, value, 1, 1], device=device)
    with pytest.raises(RuntimeError, match=message):
        ops.token_log_probs(logits, target, **{name: per_row})
