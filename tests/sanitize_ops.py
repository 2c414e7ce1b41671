"""Runs every op once on CUDA, over the kernel paths that matter to memory safety, for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_ops.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_ops.py

Odd shapes (rows that are not a multiple of a block, vocabularies that are not a multiple of a vector), rows
that are not 16-byte aligned (a sliced buffer: the split statistics + gradient path), in-place gradients, masked and padded tokens, every dtype,
upstream gradients other than 1 (the scaling kernel) and the fused-linear ops. Each result is also compared
with the float64 reference, so that a run that computes garbage without touching bad memory still fails.
Not a pytest module (nothing here is collected): it exists to be wrapped by the sanitizer.
"""
import os
import sys

import torch

import rl_losses
from rl_losses import reference


# cpu: a dry run of this script without a GPU.
DEVICE = os.environ.get("RL_LOSSES_SANITIZE_DEVICE", "cuda")


def _close(name, ours, ref, tol):
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    scale = max(ref.abs().max().item(), 1e-6)
    err = (ours - ref).abs().max().item() / scale
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3g} > {tol:g}")


def _logits(n, v, dtype, aligned=True):
    if aligned:
        return (torch.randn(n, v, device=DEVICE) * 2).to(dtype)
    buf = (torch.randn(n, v + 1, device=DEVICE) * 2).to(dtype)
    return buf[:, 1:]  # rows start one element in: not 16-byte aligned, row stride v + 1


def _target(n, v, masked=0.3):
    t = torch.randint(0, v, (n,), device=DEVICE)
    return torch.where(torch.rand(n, device=DEVICE) < masked, -100, t)


def _grad_of(fn, x, inplace, upstream):
    leaf = x.detach().clone().requires_grad_()
    y = leaf * 1.0 if inplace else leaf
    loss = fn(y, inplace)
    (loss * upstream).backward()
    return loss, (y.detach() if inplace else leaf.grad)


def _ref_grad(fn, x, upstream):
    x64 = x.detach().double().cpu().requires_grad_()
    loss = fn(x64)
    (loss * upstream).backward()
    return loss, x64.grad


def run_logits_ops(n, v, dtype, aligned, inplace, upstream):
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    x = _logits(n, v, dtype, aligned)
    t = _target(n, v)
    adv, old = torch.randn(n, device=DEVICE), torch.full((n,), -float(torch.log(torch.tensor(float(v)))), device=DEVICE)
    doc = torch.arange(n, device=DEVICE) * 5 // n
    doc = torch.where(torch.arange(n, device=DEVICE) % 11 == 10, -1, doc)  # padding tokens
    cases = {
        "cross_entropy": (lambda y, ip: rl_losses.cross_entropy(y, t, label_smoothing=0.1, z_loss_factor=1e-3,
                                                                inplace_backward=ip),
                          lambda y: reference.cross_entropy(y, t.cpu(), label_smoothing=0.1, z_loss_factor=1e-3)),
        "z_loss": (lambda y, ip: rl_losses.z_loss(y, loss_mask=t >= 0),
                   lambda y: reference.z_loss(y, loss_mask=(t >= 0).cpu())),
        "grpo": (lambda y, ip: rl_losses.grpo_loss(y, t, adv, old, delta=3.0, beta=0.05, ref_log_probs=old,
                                                   compute_entropy=True, inplace_backward=ip).loss,
                 lambda y: reference.grpo_loss(y, t.cpu(), adv.double().cpu(), old.double().cpu(), delta=3.0,
                                               beta=0.05, ref_log_probs=old.double().cpu()).loss),
        "gspo": (lambda y, ip: rl_losses.gspo_loss(y, t, adv, old, doc, num_documents=5, weighting="token",
                                                   compute_entropy=True, inplace_backward=ip).loss,
                 lambda y: reference.gspo_loss(y, t.cpu(), adv.double().cpu(), old.double().cpu(), doc.cpu(),
                                               num_documents=5, weighting="token").loss),
    }
    for name, (ours_fn, ref_fn) in cases.items():
        ip = inplace and name != "z_loss"
        loss, grad = _grad_of(ours_fn, x, ip, upstream)
        ref_loss, ref_grad = _ref_grad(ref_fn, x, upstream)
        label = f"{name} n={n} v={v} {dtype} aligned={aligned} inplace={ip} g={upstream}"
        _close(label + " loss", loss, ref_loss, tol)
        _close(label + " grad", grad, ref_grad, tol)
    # The statistics-only op and the sequence-data-parallel document sums.
    stats = torch.ops.rl_losses.row_stats(x, t, entropy=True, smoothing=True)
    lse = stats[:, 0] + stats[:, 1].log()
    _close("row_stats lse", lse, torch.logsumexp(x.double().cpu(), -1), tol)
    lp = rl_losses.grpo_loss(x, t, adv, old).log_probs
    counts = torch.full((n,), 3.0, device=DEVICE)
    torch.ops.rl_losses.gspo_document_sums(lp, t, adv, old, doc, counts, 5)
    # reduction="none": one upstream value per row.
    leaf = x.detach().clone().requires_grad_()
    rl_losses.cross_entropy(leaf, t, reduction="none").backward(torch.rand(n, device=DEVICE))


def run_linear_ops(n, h, v, dtype):
    tol = {torch.float32: 1e-3, torch.bfloat16: 5e-2}[dtype]
    hidden = torch.randn(n, h, device=DEVICE).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE) / h**0.5).to(dtype)
    t = _target(n, v)
    adv, old = torch.randn(n, device=DEVICE), torch.full((n,), -5.0, device=DEVICE)
    doc = torch.arange(n, device=DEVICE) * 3 // n
    a64, o64, t64, d64 = adv.double().cpu(), old.double().cpu(), t.cpu(), doc.cpu()
    cases = {
        "linear_cross_entropy": (lambda hd, w: rl_losses.linear_cross_entropy(hd, w, t, chunk_size=17),
                                 lambda x: reference.cross_entropy(x, t64)),
        "linear_grpo": (lambda hd, w: rl_losses.linear_grpo_loss(hd, w, t, adv, old, chunk_size=17).loss,
                        lambda x: reference.grpo_loss(x, t64, a64, o64).loss),
        "linear_gspo": (lambda hd, w: rl_losses.linear_gspo_loss(hd, w, t, adv, old, doc, num_documents=3,
                                                                 chunk_size=17).loss,
                        lambda x: reference.gspo_loss(x, t64, a64, o64, d64, num_documents=3).loss),
    }
    for name, (ours_fn, ref_fn) in cases.items():
        hd, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = ours_fn(hd, w)
        (loss * 2.5).backward()
        h64, w64 = hidden.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
        ref = ref_fn(h64 @ w64.T)
        (ref * 2.5).backward()
        _close(f"{name} {dtype} loss", loss, ref, tol)
        _close(f"{name} {dtype} grad_hidden", hd.grad, h64.grad, tol)
        _close(f"{name} {dtype} grad_weight", w.grad, w64.grad, tol)


def run_scatter_rows(n, k, v, dtype):
    """_scatter_rows (the kept-set gradient): padding, masked zero copies of a real id and odd V (unaligned rows)."""
    ids = torch.rand(n, v, device=DEVICE).argsort(-1)[:, :k]
    values = torch.randn(n, k, device=DEVICE).to(dtype)
    ids[:, 1::3], values[:, 2::3] = -1, 0.0
    ids[:, 2::3] = ids[:, :1]  # zero copies of column 0's id
    ours = torch.ops.rl_losses._scatter_rows(ids, values, v)
    ref = torch.zeros(n, v, dtype=torch.float64).scatter_add_(
        -1, ids.cpu().clamp_min(0), torch.where(ids >= 0, values, 0.0).double().cpu())
    _close(f"_scatter_rows {dtype}", ours, ref, 0.0)


def main():
    if DEVICE == "cuda" and not (torch.cuda.is_available() and rl_losses.cuda_kernels_available()):
        print("sanitize_ops: needs a GPU and the extension's CUDA kernels")
        return 1
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n, v in ((1, 1), (37, 1003), (5, 50257), (3, 131073)):
            for aligned in (True, False):
                for inplace in (False, True):
                    run_logits_ops(n, v, dtype, aligned, inplace, upstream=1.0 if inplace else 3.0)
    for dtype in (torch.float32, torch.bfloat16):
        run_linear_ops(45, 24, 513, dtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n, k, v in ((1, 1, 1), (37, 9, 1003), (5, 1025, 50257)):
            run_scatter_rows(n, k, v, dtype)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("sanitize_ops: every op ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
