"""What the batch-invariance tests share (test_batch_invariance*.py): their cases' ids, per-row inputs, the
sub-batches a batch's rows are run in, and the bitwise comparison of rows."""
import torch

from helpers import make_target


def case_id(case):
    """(device, sizes...) as "cpu-37x1001"."""
    return f"{case[0]}-" + "x".join(str(size) for size in case[1:])


def leaf(x):
    return x.detach().requires_grad_()


def row_inputs(n, vocab, device):
    target = make_target((n,), vocab, device, masked=0.2)
    return {"target": target, "adv": torch.randn(n, device=device), "old": -torch.rand(n, device=device) * 8,
            "ref": -torch.rand(n, device=device) * 8, "g_lp": torch.randn(n, device=device),
            "g_h": torch.randn(n, device=device),
            # The sampler's options, one value per row (docs/consistency.md).
            "top_k": torch.randint(1, vocab + 1, (n,), device=device),
            "top_p": 0.5 + 0.5 * torch.rand(n, device=device), "min_p": 0.1 * torch.rand(n, device=device)}


_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16}


def bits(t):
    """The bits of a floating-point tensor, as integers of its width (-0.0 and 0.0 differ; a NaN equals itself)."""
    return t.contiguous().view(_SAME_WIDTH_INT[t.dtype])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_rows_equal(part, whole, rows, what):
    """Each of `part`'s results (first dimension: rows) has the bits of `whole`'s at `rows`."""
    for name, value in part.items():
        expected = whole[name][rows]
        assert value.shape == expected.shape and value.dtype == expected.dtype, (what, name)
        differ = (bits(value) != bits(expected)).reshape(len(value), -1).any(dim=1)
        first = rows.cpu()[differ.cpu()][:10].tolist()
        assert not differ.any(), f"{what}: {name} differs in rows {first} (the first 10) of {len(value)}"


def sub_batches(n, device):
    """(name, rows) of batches made of the whole batch's rows: permuted, one row dropped, split in two, and the
    rows of a random half."""
    perm = torch.randperm(n, device=device)
    half = torch.randperm(n, device=device)[: n // 2].sort().values
    rows = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    return [("permuted", perm), ("first row dropped", rows(1, n)), ("first part", rows(0, n // 3)),
            ("last part", rows(n // 3, n)), ("random half", half), ("one row", rows(n // 2, n // 2 + 1))]
