"""What the batch-invariance tests share (test_batch_invariance*.py, test_*_invariance.py): their cases' ids, per-row
inputs, the sub-batches a batch's rows are run in, the bitwise comparison of rows, and the processes of a group."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import make_logits, make_target


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


def assert_rows_invariant(run, logits, r):
    """`run(logits, r)` (per-row results and gradient rows) gives each row the same bits in every sub-batch (a slice
    where its rows are consecutive, so also at another alignment, else a gather) and re-packed after other rows."""
    n, vocab, device = logits.shape[0], logits.shape[-1], logits.device
    whole = run(logits, r)
    for what, rows in sub_batches(n, device):
        consecutive = bool((rows.diff() == 1).all()) if len(rows) > 1 else True
        part = logits[rows[0]: rows[-1] + 1] if consecutive else logits[rows]
        assert_rows_equal(run(part, {k: v[rows] for k, v in r.items()}), whole, rows, what)
    other = make_logits((n // 2 + 3,), vocab, logits.dtype, device)
    r_other = row_inputs(len(other), vocab, device)
    packed = run(torch.cat([other, logits]), {k: torch.cat([r_other[k], v]) for k, v in r.items()})
    assert_rows_equal({k: v[len(other):] for k, v in packed.items()}, whole, torch.arange(n, device=device), "repacked")


def join_group(backend: str, rank: int, store: str, world: int) -> torch.device:
    """In a process of run_ranks: joins the group of `world` ranks (gloo on CPU tensors, or nccl, a GPU per rank)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    return device


def run_ranks(worker, world: int) -> list:
    """Runs worker(rank, store, out) in `world` spawned processes; each saves its results to f"{out}.{rank}"."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(os.path.join(d, "store"), os.path.join(d, "out")), nprocs=world,
                           start_method="spawn")
        return [torch.load(os.path.join(d, f"out.{r}")) for r in range(world)]
