"""Temporary probe: does the data (random vs constant) change the speed of the copy and of the CE step, and
what do the SM clock and the board power do meanwhile? Prints WINDOW lines (name, wall-clock span in ms,
median ms per call); `--aggregate SMI_CSV WINDOWS...` joins them with nvidia-smi's samples."""
import statistics, sys, time
from datetime import datetime


def run():
    import torch
    sys.path.insert(0, "benchmarks")
    import cases
    n, v = 16384, 128256
    op = cases.OPS["ce"]
    prov = cases.RlLosses(False)
    s = prov.prepare(op, cases.make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0))
    randn = s["base"].detach().clone()
    dst = torch.empty_like(randn)

    def ce():
        cases.GradSink.last = None
        prov.loss(op, s, cases.head_output(s["base"])).backward()

    def copy():
        dst.copy_(s["base"].detach())

    for data in ["random", "const"]:
        with torch.no_grad():
            if data == "random":
                s["base"].copy_(randn)
            else:
                s["base"].fill_(0.5)
        for name, fn in [("copy", copy), ("ce", ce)]:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.time() * 1e3
            ts = []
            for _ in range(4):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(201)]
                ev[0].record()
                for i in range(200):
                    fn()
                    ev[i + 1].record()
                torch.cuda.synchronize()
                ts += [a.elapsed_time(b) for a, b in zip(ev, ev[1:])]
            t1 = time.time() * 1e3
            ms = statistics.median(ts)
            print(f"WINDOW torch_{name}/{data} {t0:.0f} {t1:.0f} {ms:.4f} {2 * n * v * 2 / ms / 1e6:.0f}", flush=True)


def aggregate(smi_csv, windows):
    rows = []
    for line in open(smi_csv):
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp() * 1e3
            rows.append((t, f[1:]))
        except (ValueError, IndexError):
            continue
    print(f"{'window':24s} {'ms/call':>8s} {'GB/s':>6s} {'samples':>7s} {'SM MHz':>7s} {'mem MHz':>7s} {'W':>6s} "
          f"{'temp':>5s}  throttle reasons seen")
    for path in windows:
        for line in open(path):
            if not line.startswith("WINDOW"):
                continue
            _, name, t0, t1, ms, gbps = line.split()
            t0, t1 = float(t0) + 300, float(t1)  # skip the first 0.3 s: clocks settle
            sel = [r for t, r in rows if t0 <= t <= t1]
            if not sel:
                print(f"{name:24s} {float(ms):8.4f} {gbps:>6s} no samples")
                continue
            num = lambda k: statistics.mean(float(r[k]) for r in sel)
            reasons = sorted({r[5] for r in sel})
            print(f"{name:24s} {float(ms):8.4f} {gbps:>6s} {len(sel):7d} {num(0):7.0f} {num(1):7.0f} {num(2):6.1f} "
                  f"{num(4):5.1f}  {' '.join(reasons)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--aggregate":
        aggregate(sys.argv[2], sys.argv[3:])
    else:
        run()
