"""Shared test settings: the devices to run on, per-dtype tolerances, and fresh random inputs.

Every test compares an op against the float64 pure-PyTorch reference (rl_losses.reference) on fresh random
inputs. CUDA cases run when a GPU is present and the extension has its CUDA kernels.
"""
import zlib

import pytest
import torch

import rl_losses


def _devices():
    devs = ["cpu"]
    if torch.cuda.is_available() and rl_losses.cuda_kernels_available():
        devs.append("cuda")
    return devs


DEVICES = _devices()

# (rtol, atol) of the loss / gradient against the float64 reference, by logits dtype. Low-precision inputs are
# rounded before the reference sees them, so the error left is the op's fp32 accumulation and the rounding
# of its output gradient to the logits dtype.
TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-5, 1e-6),
    torch.bfloat16: (2e-2, 2e-4),
    torch.float16: (5e-3, 5e-5),
}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def batch_invariant_mode():
    """The test runs in rl_losses' batch-invariant mode (docs/consistency.md)."""
    with rl_losses.batch_invariant():
        yield


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh inputs everywhere, failures still replayable.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def assert_close(actual, expected, dtype, *, scale=1.0, msg=""):
    """Compare against a float64 reference with the tolerance of `dtype`; `scale` widens it."""
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol * scale,
                               atol=atol * scale, msg=msg or None)
