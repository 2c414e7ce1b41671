"""Read-only bandwidth on the device against GSPO's statistics pass (rl_losses.row_stats) at the headline."""
import statistics

import torch

import rl_losses  # noqa: F401  (registers the ops)

N, V = 16384, 128256
x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, V, (N,), device="cuda")
nb = x.numel() * x.element_size()


def ms(fn, reps=30):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


dst = torch.empty_like(x)
c = ms(lambda: dst.copy_(x))
print(f"copy            {c:.3f} ms  {2 * nb / c / 1e6:6.0f} GB/s (read + write)")
del dst
for name, fn in [("sum (fp32 acc)", lambda: x.sum(dtype=torch.float32)), ("amax", lambda: x.amax()),
                 ("row_stats", lambda: torch.ops.rl_losses.row_stats(x, t))]:
    m = ms(fn)
    print(f"{name:15s} {m:.3f} ms  {nb / m / 1e6:6.0f} GB/s (read)  {100 * (nb / m) / (2 * nb / c):5.1f}% of the copy's rate")
