"""Does a bad-input error from the extension reach Python as an exception on this machine (CPU and CUDA)?
Each probe runs in a subprocess so that a crash is reported instead of ending the script."""
import subprocess
import sys

PROBE = """
import torch, rl_losses
dev = sys.argv[1]
try:
    torch.ops.rl_losses.cross_entropy(torch.randn(2, 3, device=dev), torch.zeros(2, dtype=torch.long, device=dev),
                                      logits_scale_factor=-1.0)
    print("no error raised")
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0][:100])
"""
for dev in ["cpu", "cuda"]:
    r = subprocess.run([sys.executable, "-c", "import sys\n" + PROBE, dev], capture_output=True, text=True)
    print(f"{dev}: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[-300:] if r.returncode else ''}")
