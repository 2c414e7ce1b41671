"""GSPO's fused CUDA form (csrc/gspo/gspo_cuda.cu): both row passes in one launch, the gradient of each row
after its document's statistics, against the float64 references; and the two-pass form beside it.

RL_LOSSES_GSPO_FUSED=1 / 0 forces either form (the default takes the fused one for short documents). Small
tiles (many per row) and no lag drive the schedule into its corners: gradients that wait for their document,
rows whose tiles finish on different workers. The document layouts include ones the schedule must not
deadlock on: documents spread over the whole batch, or in reverse order.
"""
import pytest
import torch

import rl_losses
from helpers import assert_grad_close, requires_cuda
from test_gspo import (_whole_document_counts, check, document_index_from_lengths, make_inputs, natural_scale,
                       random_lengths)

pytestmark = requires_cuda

MODES = {
    "fused": {"RL_LOSSES_GSPO_FUSED": "1"},
    "fused_tiny_tiles_no_lag": {"RL_LOSSES_GSPO_FUSED": "1", "RL_LOSSES_GSPO_TILE": "512", "RL_LOSSES_GSPO_LAG": "0"},
    "two_pass": {"RL_LOSSES_GSPO_FUSED": "0"},
}


@pytest.fixture(params=list(MODES))
def mode(request, monkeypatch):
    for key, value in MODES[request.param].items():
        monkeypatch.setenv(key, value)
    return request.param


def documents(layout, n):
    """(n,) document ids: packed runs with padding (-1) at the end, every document spread over the whole
    batch, packed runs in reverse order, or documents of 1-3 tokens."""
    if layout == "packed":
        return document_index_from_lengths(random_lengths(n - 7, 9), n, "cuda")
    if layout == "spread":
        return torch.arange(n, device="cuda") % 5
    if layout == "reversed":
        return document_index_from_lengths(random_lengths(n, 6), n, "cuda").flip(0)
    assert layout == "tiny"
    return torch.arange(n, device="cuda") // 2 + (torch.arange(n, device="cuda") % 7 == 0).long()


SHAPES = [(600, 1001, torch.bfloat16), (300, 4096, torch.float16), (256, 8, torch.float16),
          (200, 3000, torch.float32)]


@pytest.mark.parametrize("layout", ["packed", "spread", "reversed", "tiny"])
@pytest.mark.parametrize("n, v, dtype", SHAPES, ids=["bf16-1001", "fp16-4096", "fp16-8", "fp32-3000"])
def test_matches_references(mode, n, v, dtype, layout):
    doc = documents(layout, n)
    logits, target, advantages, old = make_inputs((n,), v, dtype, "cuda", doc, masked=0.3)
    check(logits, target, advantages, old, doc, 1.3)


OPTIONS = {
    "entropy_scale_epsilons": {"compute_entropy": True, "logits_scale_factor": 0.7, "epsilon_low": 0.1,
                               "epsilon_high": 0.25},
    "token_weighting_counts_divisor": {"weighting": "token", "label_counts": True, "divisor": 9.5,
                                       "num_documents": 12},
    "token_advantages": {"token_advantages": True},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_match_references(mode, option):
    kwargs = dict(OPTIONS[option])
    n, v, dtype = 500, 2048, torch.bfloat16
    doc = documents("packed", n)
    logits, target, advantages, old = make_inputs((n,), v, dtype, "cuda", doc, masked=0.3,
                                                  logits_scale_factor=kwargs.get("logits_scale_factor", 1.0))
    if kwargs.pop("label_counts", False):  # padding (-1) counted with document 0: its tokens are ignored
        kwargs["label_counts"] = _whole_document_counts(target, doc.clamp_min(0), kwargs["num_documents"],
                                                        torch.float32)
    check(logits, target, advantages, old, doc, -0.9, **kwargs)


@pytest.mark.parametrize("masked", [0.0, 0.95, 1.0])
def test_inplace_matches_out_of_place(mode, masked):
    """In place, a row's gradient overwrites its logits: only after its document's statistics are done."""
    n, v, dtype = 400, 4000, torch.bfloat16
    doc = documents("packed", n)
    logits, target, advantages, old = make_inputs((n,), v, dtype, "cuda", doc, masked=masked)
    _, grad = check(logits, target, advantages, old, doc, 1.0)
    leaf = logits.clone().requires_grad_()
    work = leaf.clone()  # a non-leaf copy that the op may overwrite
    out = rl_losses.gspo_loss(work, target, advantages, old, doc, inplace_backward=True)
    out.loss.backward()
    assert_grad_close(leaf.grad, grad.double(), dtype, natural_scale=natural_scale(target, advantages, doc, 1.0))
    assert torch.equal(work.detach(), leaf.grad)


def _launches(fn, name):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler recorded no CUDA kernels in this process")
    return sum(name in k for k in kernels)


def _gspo(n, v, n_docs, **kwargs):
    doc = torch.arange(n, device="cuda") * n_docs // n
    logits, target, advantages, old = make_inputs((n,), v, torch.bfloat16, "cuda", doc)
    x = logits.requires_grad_()
    return lambda: rl_losses.gspo_loss(x, target, advantages, old, doc, num_documents=n_docs, **kwargs)


def test_default_takes_the_fused_form_for_short_documents(monkeypatch):
    """Documents of at most 32 MB of logits on average: fused; longer ones, or the form forced off, or
    torch.use_deterministic_algorithms (the fused document sums are atomic): two passes."""
    monkeypatch.delenv("RL_LOSSES_GSPO_FUSED", raising=False)
    assert _launches(_gspo(512, 128256, 8), "gspo_fused_kernel") == 1  # 16 MB documents
    assert _launches(_gspo(512, 128256, 1), "gspo_fused_kernel") == 0  # 128 MB
    monkeypatch.setenv("RL_LOSSES_GSPO_FUSED", "0")
    assert _launches(_gspo(512, 128256, 8), "gspo_fused_kernel") == 0
    monkeypatch.setenv("RL_LOSSES_GSPO_FUSED", "1")
    assert _launches(_gspo(512, 128256, 1), "gspo_fused_kernel") == 1
    torch.use_deterministic_algorithms(True)
    try:
        assert _launches(_gspo(512, 128256, 8), "gspo_fused_kernel") == 0
    finally:
        torch.use_deterministic_algorithms(False)
