"""_scatter_rows (csrc/kept_set/), the dense gradient rows of kept_token_log_probs: against a float64 scatter_add_
written here, on fresh random rows with padding (-1), masked copies of a real id (value 0, as kept_set.py's padding at
id 0 and a listed label), zero values, K > V, no rows, K = 0, odd V (rows not 16-byte aligned on a GPU) and
non-contiguous inputs; opcheck and torch.compile; bad inputs on the real op, on meta tensors and under
FakeTensorMode."""
import math

import pytest
import torch

from helpers import assert_fake_rejects_like_real
from helpers import param_id as _id

ops = torch.ops.rl_losses


def random_rows(shape, k, vocab, dtype, device):
    """(ids, values) of shape (*shape, k): each row's ids distinct among its nonzero values, with padding (-1, any
    value), copies of the row's first id with the value 0 (as kept_set.py masks) and a few zero values."""
    n = math.prod(shape)
    real = min(k, vocab)
    ids = torch.full((n, k), -1, dtype=torch.int64, device=device)
    if real:
        ids[:, :real] = torch.rand(n, vocab, device=device).argsort(-1)[:, :real]
    values = torch.randn(n, k, device=device).to(dtype)
    if k > 1:
        copy = torch.rand(n, k, device=device) < 0.15
        copy[:, 0] = False
        ids = torch.where(copy, ids[:, :1], ids)
        values = values.masked_fill(copy, 0.0)
    values = values.masked_fill(torch.rand(n, k, device=device) < 0.05, 0.0)
    ids = ids.masked_fill(torch.rand(n, k, device=device) < 0.15, -1)
    # The columns in a random order per row, so that a masked copy may come before or after its real id.
    order = torch.rand(n, k, device=device).argsort(-1)
    return ids.gather(-1, order).reshape(*shape, k), values.gather(-1, order).reshape(*shape, k)


def reference(ids, values, vocab):
    """float64: zeros plus every non-padding value at its id."""
    out = torch.zeros(*ids.shape[:-1], vocab, dtype=torch.float64, device=ids.device)
    return out.scatter_add_(-1, ids.clamp_min(0), torch.where(ids >= 0, values.double(), 0.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("shape,k,vocab", [
    ((5,), 9, 37), ((2, 3), 17, 1001), ((4,), 40, 8), ((3,), 0, 11), ((0,), 5, 13), ((6,), 1, 1),
    ((2,), 1025, 4099), ((3,), 64, 128256),
], ids=lambda v: _id(v) if isinstance(v, tuple) else str(v))
def test_matches_float64_reference(shape, k, vocab, dtype, device):
    ids, values = random_rows(shape, k, vocab, dtype, device)
    got = ops._scatter_rows(ids, values, vocab)
    assert got.shape == (*shape, vocab) and got.dtype == dtype and got.is_contiguous()
    # Each value lands unrounded (at most one nonzero value per id and row): equal, not close.
    assert torch.equal(got.double(), reference(ids, values, vocab))


def test_noncontiguous_inputs(device):
    ids, values = random_rows((7,), 12, 50, torch.float32, device)
    ids_t = ids.t().contiguous().t()  # column-major
    values_s = torch.stack([values, torch.randn_like(values)], -1)[..., 0]  # a stride of 2 along K
    assert not ids_t.is_contiguous() and not values_s.is_contiguous()
    assert torch.equal(ops._scatter_rows(ids_t, values_s, 50).double(), reference(ids, values, 50))


def test_zero_copies_never_override_the_real_value(device):
    """An id listed with the value 0 before and after its real entry (masked copies) keeps the real value, on a GPU
    too, where the order of two stores to one address is arbitrary; -1 padding is skipped whatever its value."""
    ids = torch.tensor([[3, 3, 3, -1, 0], [0, 2, 0, 0, -1]], device=device).repeat(512, 1)
    values = torch.tensor([[0.0, 2.5, -0.0, 7.0, 0.0], [0.0, 1.0, -4.0, 0.0, 9.0]], device=device).repeat(512, 1)
    got = ops._scatter_rows(ids, values, 5)
    want = torch.tensor([[0.0, 0.0, 0.0, 2.5, 0.0], [-4.0, 0.0, 1.0, 0.0, 0.0]], device=device).repeat(512, 1)
    assert torch.equal(got, want)


def test_opcheck(device):
    ids, values = random_rows((4, 3), 6, 19, torch.float32, device)
    torch.library.opcheck(ops._scatter_rows.default, (ids, values, 19))


def test_compiled_matches_eager(device):
    ids, values = random_rows((6,), 8, 33, torch.bfloat16, device)

    def fn(ids, values):
        return ops._scatter_rows(ids, values * 2, 33) + 1

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)
    assert torch.equal(compiled(ids, values), fn(ids, values))


@pytest.mark.parametrize("bad", [5, -2])
def test_ids_out_of_range(bad):
    """The ids' range is the data's: checked by the real op on the CPU before it writes (a GPU asserts on the
    device), not by the fake kernel."""
    ids = torch.tensor([[0, 1], [bad, 2]])
    with pytest.raises(RuntimeError, match=rf"_scatter_rows: ids: id {bad} at row 1, position 0 is outside "
                                           r"\[-1, 5\) \(-1: padding\)"):
        ops._scatter_rows(ids, torch.ones(2, 2), 5)


def _call(ids=None, values=None, vocab=5):
    def call(d):
        i = torch.zeros(3, 2, dtype=torch.int64, device=d) if ids is None else ids(d)
        v = torch.zeros(3, 2, device=d) if values is None else values(d)
        return ops._scatter_rows(i, v, vocab)
    return call


BAD_INPUTS = [
    ("int32_ids", _call(ids=lambda d: torch.zeros(3, 2, dtype=torch.int32, device=d)),
     "_scatter_rows: ids must be an int64 tensor, got Int"),
    ("float_ids", _call(ids=lambda d: torch.zeros(3, 2, device=d)), "ids must be an int64 tensor, got Float"),
    ("int_values", _call(values=lambda d: torch.zeros(3, 2, dtype=torch.int64, device=d)),
     "_scatter_rows: values must be float32, float64, bfloat16 or float16, got Long"),
    ("shapes", _call(values=lambda d: torch.zeros(3, 3, device=d)),
     r"_scatter_rows: ids and values must have one shape \(\.\.\., K\), got ids \[3, 2\] and values \[3, 3\]"),
    ("0dim", _call(ids=lambda d: torch.zeros((), dtype=torch.int64, device=d),
                   values=lambda d: torch.zeros((), device=d)),
     r"ids and values must have one shape \(\.\.\., K\), got ids \[\] and values \[\]"),
    ("vocab", _call(vocab=-1), "_scatter_rows: vocab_size must be >= 0, got -1"),
]


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_fake_like_real(name, call, message):
    assert_fake_rejects_like_real(call, message)
