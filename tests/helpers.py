"""Helpers shared by the loss tests: random inputs, float64 label log-probs, gradient comparison, a gradcheck
that works with the ops' one-backward-per-forward contract, and a gloo world of processes."""
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_losses
from rl_losses import _schema, reference

from conftest import DEVICES, assert_close


def forward_options(op: str, **options) -> dict:
    """The keyword arguments of `op`'s `_forward` ops beyond its positional tensors: the public op's defaults, then
    `options` (inplace_backward is the public op's alone)."""
    args = {k: v for k, v in _schema.defaults(op).items() if k != "inplace_backward"}
    args.update(options)
    return args

# The logits dtypes of the op tests' grids (float64 is tested on its own, with the reference's tolerance).
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

requires_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the extension's CUDA kernels")


def param_id(value):
    """Readable test ids: float32, 16x8, ..."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return None


def to64(value):
    """A floating-point tensor in float64 (any other value as it is): an op's options, for the reference."""
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def make_logits(shape, vocab, dtype, device, *, std=2.0):
    return (torch.randn(*shape, vocab, device=device) * std).to(dtype)


def make_target(shape, vocab, device, *, masked=0.5, dtype=torch.int64):
    """Labels in [0, V) with a fraction `masked` replaced by assorted negative values (all mean "no label")."""
    target = torch.randint(0, vocab, shape, device=device)
    negatives = torch.tensor([-100, -1, -7, -100], device=device)
    drop = torch.rand(shape, device=device) < masked
    target = torch.where(drop, negatives[torch.randint(0, len(negatives), shape, device=device)], target)
    return target.to(dtype)


def label_log_probs64(logits, target, logits_scale_factor=1.0):
    """float64 log-probability of each token's label (0 where unlabelled), from the logits as given."""
    logp = torch.log_softmax(logits.detach().double() * logits_scale_factor, dim=-1)
    lp = logp.gather(-1, target.long().clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target >= 0, lp, 0.0)


def policy_inputs(logits, num_documents, masked=0.25):
    """For (N, V) logits: labels (each negative, i.e. unlabelled, with probability `masked`), advantages, old
    log-probs near the current ones (so that some ratios clip) and document ids of num_documents equal runs,
    on the logits' device."""
    n, v = logits.shape
    target = make_target((n,), v, logits.device, masked=masked)
    adv = torch.randn(n, device=logits.device)
    old = (label_log_probs64(logits, target) + 0.1 * torch.randn(n, device=logits.device)).float()
    doc = torch.arange(n, device=logits.device) * num_documents // n
    return target, adv, old, doc


def op_loss(op, logits, target, adv, old, doc, num_documents, **options):
    """The loss of rl_losses' cross_entropy, grpo_loss or gspo_loss (`op`), with default options but these."""
    if op == "cross_entropy":
        return rl_losses.cross_entropy(logits, target, **options)
    if op == "grpo":
        return rl_losses.grpo_loss(logits, target, adv, old, **options).loss
    return rl_losses.gspo_loss(logits, target, adv, old, doc, num_documents=num_documents, **options).loss


def op_reference(op, logits, target, adv, old, doc, num_documents):
    """The float64 reference of op_loss: the loss and its gradient with respect to the logits."""
    x = logits.detach().double().requires_grad_()
    if op == "cross_entropy":
        loss = reference.cross_entropy(x, target)
    elif op == "grpo":
        loss = reference.grpo_loss(x, target, adv.double(), old.double()).loss
    else:
        loss = reference.gspo_loss(x, target, adv.double(), old.double(), doc, num_documents=num_documents).loss
    loss.backward()
    return loss.detach(), x.grad


def assert_grad_close(actual, expected, dtype, *, natural_scale=0.0, scale=1.0):
    """Compare a gradient with the float64 reference, relative to max(largest reference entry, natural_scale).

    Gradients scale with s·g/D; comparing them relative to their size makes one tolerance per dtype mean the
    same thing at every vocabulary size, divisor and upstream gradient. `natural_scale` (s·|g|/D for the
    cross-entropy) is the floor where the reference entries are all much smaller than that size (V = 1, where
    p - onehot = 0 and only the z-loss part is left), so that fp32 cancellation of order ulp(s·g/D) passes.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == dtype, f"gradient dtype {actual.dtype}, expected the logits dtype {dtype}"
    assert torch.isfinite(actual.double()).all(), "non-finite gradient"
    norm = max(expected.abs().max().item() if expected.numel() else 0.0, natural_scale, 1e-300)
    assert_close(actual.double().cpu() / norm, expected.double().cpu() / norm, dtype, scale=scale)


class _FreshGraphPerBackward(torch.autograd.Function):
    """Runs `fn` again (forward and backward) for every backward call.

    The ops compute their gradient in the forward and scale it in place in the backward, so they refuse a
    second backward through one graph (a documented RuntimeError), while gradcheck computes its analytical
    Jacobian with repeated backwards through one output. Through this wrapper gradcheck's finite differences
    still run on the op's forward and its analytical Jacobian still comes from the op's own backward, with one
    fresh graph per vector-Jacobian product.
    """

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            fresh = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(ctx.fn(fresh), fresh, grad_output)
        return grad, None


def gradcheck_fresh(fn, x):
    """torch.autograd.gradcheck of fn at x (float64), one graph per backward (see _FreshGraphPerBackward)."""
    return torch.autograd.gradcheck(lambda t: _FreshGraphPerBackward.apply(t, fn), (x,), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


def assert_compiled_matches_eager(fn, logits, *args, backend):
    """fn(x, *args) returns the loss, or a tuple whose first item is the loss; under torch.compile
    (fullgraph, static shapes) its outputs and the gradient of 1.7·loss w.r.t. x must match eager's."""
    compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)
    results = []
    for f in (fn, compiled):
        x = logits.clone().requires_grad_()
        out = f(x, *args)
        loss, *rest = out if isinstance(out, tuple) else (out,)
        (loss * 1.7).backward()
        results.append((loss.detach(), *rest, x.grad))
    for eager, comp in zip(*results):
        assert_close(comp, eager, torch.float32)


def gspo_token_shares(case, inputs: dict, expected: dict) -> torch.Tensor:
    """Each token's share κ_t·f(R_s, A)/D of the single-process GSPO loss of a distributed test case (float64),
    from the single-process document ratios: a rank's loss must be the sum of its tokens' shares."""
    o = case.options
    doc = inputs["document_index"].reshape(-1)
    mask = ((inputs["target"].reshape(-1) >= 0) & (doc >= 0)).double()
    safe = doc.clamp_min(0)
    n_docs = expected["document_ratios"].numel()
    counts = torch.zeros(n_docs, dtype=torch.float64).index_add_(0, safe, mask)[safe]
    u = mask / counts.clamp_min(1)
    adv = inputs["advantages"].reshape(-1).double()
    adv = adv if o.get("token_advantages") else torch.zeros(n_docs, dtype=torch.float64).index_add_(
        0, safe, u * adv)[safe]
    ratio = expected["document_ratios"].double()[safe]
    logp = torch.log_softmax(inputs["logits"].double() * o.get("logits_scale_factor", 1.0), -1).reshape(-1, case.vocab)
    lp = torch.where(mask > 0, logp.gather(-1, inputs["target"].reshape(-1, 1).clamp_min(0)).squeeze(-1), 0.0)
    # The policy family's per-token terms: ρ per token or per document (the sum over the whole document), and
    # VESPO's φ of the document's sums.
    mode = o.get("rollout_correction")
    old = lp if o.get("on_policy") else inputs["old_log_probs"].reshape(-1).double()
    log_rho = None if mode is None else old - inputs["rollout_log_probs"].reshape(-1).double()
    p = reference.Policy(**{k: v for k, v in o.items() if k in reference.Policy._fields})
    defaults = _schema.defaults("gspo")
    if p.loss_type == "vespo":
        phi, _ = reference._vespo_weights(p, lp, old, adv, mask > 0, doc, log_rho, bool(o.get("on_policy")))
        f = -phi * adv * lp
    else:
        f = reference._surrogate(p, ratio, adv, lp, o.get("epsilon_low", defaults["epsilon_low"]),
                                 o.get("epsilon_high", defaults["epsilon_high"]), o.get("delta"))
        if mode is not None:
            if mode.startswith("sequence"):
                log_rho = reference._sequence_sum(log_rho, mask > 0, doc)
            f = f * reference._rollout_weight(p, log_rho)[1]
    if o.get("beta"):
        kl = reference._kl_estimate(p.kl_estimator, lp, inputs["ref_log_probs"].reshape(-1).double())
        f = f + o["beta"] * (kl * ratio if p.kl_importance_weighted else kl)
    f = f - p.entropy_coefficient * reference._entropy(logp)
    kappa = mask if o.get("weighting") == "token" else u
    divisor = o.get("divisor") or max(int((torch.zeros(n_docs, dtype=torch.float64).index_add_(
        0, safe, mask) > 0).sum()), 1)
    return (kappa * f / divisor).view(inputs["target"].shape)


def _gloo_worker(rank, compute, world, path, out_dir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections on the loopback interface only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(compute(rank), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither rank closes its connections while the other still uses them
    finally:
        dist.destroy_process_group()


def gloo_world_results(compute, world=2):
    """Each rank's `compute(rank)` (a module-level function returning tensors), run in `world` gloo processes
    on the CPU whose group is dist.group.WORLD; returns the list of the ranks' results."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_worker, args=(compute, world, os.path.join(tmp, "store"), tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def assert_fake_rejects_like_real(call, message):
    """`call(device)` raises `message` on the CPU (the real kernel); the fake kernel raises the same text on meta
    tensors (up to the device's name) and under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(RuntimeError, match=message) as real:
        call("cpu")
    with pytest.raises(RuntimeError) as fake:
        call("meta")
    assert str(fake.value).replace("meta", "cpu") == str(real.value)
    with FakeTensorMode(), pytest.raises(RuntimeError) as fake_mode:
        call("cpu")
    assert str(real.value) in str(fake_mode.value)


def config_paths(cfg, logits, batch, metrics=()):
    """A config's module run on the extension's op (use_cuda_kernel=None) and on the reference (False): for each,
    (loss, the named metrics..., the gradient w.r.t. the logits)."""
    from rl_losses.config import LanguageModelLossConfig

    results = []
    for use_kernel in (None, False):
        module = LanguageModelLossConfig.from_dict({**cfg.to_dict(), "use_cuda_kernel": use_kernel}).get_loss()
        x = logits.clone().requires_grad_()
        loss, values = module(x, batch)
        loss.backward()
        results.append((loss.detach(), *(values[m] for m in metrics), x.grad))
    return results


def cuda_kernels(fn):
    """The names of the CUDA kernels one call of fn launches (skips the test where the profiler records none in
    this process)."""
    fn()  # outside the profile: the first call's one-time work
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler recorded no CUDA kernels in this process")
    return kernels


def kernel_launches(fn, name):
    """How many CUDA kernels whose name contains `name` one call of fn launches."""
    return sum(name in k for k in cuda_kernels(fn))
