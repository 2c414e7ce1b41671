"""Does an error raised in C++ reach Python as an exception on this machine? Each probe runs in its own
subprocess (a crash is reported, not fatal), from the plainest layer up to the public op."""
import subprocess
import sys

PROBES = {
    "torch_native": "torch.mm(torch.randn(2, 3), torch.randn(2, 3))",
    "unboxed_op": "torch.ops.rl_losses.row_stats(x, y, logits_scale_factor=-1.0)",
    "forward_op": "torch.ops.rl_losses._cross_entropy_forward(x, y, -1.0, 0., 0., 1., 'mean', None, None, 0, -1, False)",
    "boxed_public_op": "torch.ops.rl_losses.cross_entropy(x, y, logits_scale_factor=-1.0)",
    "public_op_grad": "torch.ops.rl_losses.cross_entropy(x.requires_grad_(), y, logits_scale_factor=-1.0)",
}
for name, code in PROBES.items():
    src = ("import torch, rl_losses\nx = torch.randn(2, 3); y = torch.zeros(2, dtype=torch.long)\n"
           f"try:\n    {code}\n    print('no error')\nexcept RuntimeError as e:\n    print('raised', str(e)[:60])")
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
    print(f"{name:16s} rc={r.returncode} {r.stdout.strip()[:80]}")
