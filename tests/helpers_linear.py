"""What the fused lm_head tests share: inputs, float64 reference logits and the gradient comparison."""
import torch

from conftest import TOLERANCES


def make_linear(batch, hidden_size, vocab, dtype, device, *, bias=False):
    """hidden (batch..., H), weight (V, H), bias (V,) or None, scaled so that the logits have std ~2."""
    hidden = torch.randn(*batch, hidden_size, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device) * (2.0 / hidden_size**0.5)).to(dtype)
    b = (torch.randn(vocab, device=device) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def leaves(*tensors):
    """Fresh leaves requiring grad: the op's inputs, and their float64 copies for the reference."""
    ours = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    ref = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    return ours, ref


def ref_logits(hidden64, weight64, bias64):
    logits = hidden64 @ weight64.T
    logits = logits if bias64 is None else logits + bias64
    if logits.requires_grad:
        logits.retain_grad()  # dL/dlogits sets the error scale of the gradients (check_grads)
    return logits


def grad_magnitudes(ref_logits64, h64, w64):
    """The scale of each gradient's rounding error. Each gradient is a sum over tokens or vocabulary entries of
    dL/dlogits times an input, so its error is relative to the same sum of magnitudes, not to the (possibly
    cancelled) result: for grad_hidden |dL/dlogits| @ |weight|, for grad_weight |dL/dlogits|.T @ |hidden|, for
    grad_bias Σ_t |dL/dlogits| (ref_logits64 after the reference's backward)."""
    g = ref_logits64.grad.reshape(-1, ref_logits64.shape[-1]).abs()
    return g @ w64.detach().abs(), g.T @ h64.detach().reshape(-1, h64.shape[-1]).abs(), g.sum(0)


def assert_linear_grad_close(name, actual, expected, magnitude, dtype, *, scale=1.0):
    """|actual - expected| <= rtol·magnitude + atol·max|expected| with the tolerances of `dtype`."""
    rtol, atol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    err = (actual.double() - expected).abs().reshape(magnitude.shape)
    bound = rtol * scale * magnitude + atol * scale * expected.abs().max()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"grad_{name}: error {err.flatten()[worst]:.3g} > bound "
                                  f"{bound.flatten()[worst]:.3g} at flat index {int(worst)}")


def check_grads(ours, ref, loss, ref_loss, ref_logits64, dtype, *, scale=1.0):
    """Backward through both losses and compare the gradients of every input given (assert_linear_grad_close,
    grad_magnitudes)."""
    loss.backward()
    ref_loss.backward()
    h64, w64, _ = ref
    for name, a, b, m in zip(("hidden", "weight", "bias"), ours, ref, grad_magnitudes(ref_logits64, h64, w64)):
        if a is None:
            continue
        assert a.grad is not None, f"no gradient for {name}"
        assert a.grad.dtype == dtype, name
        assert_linear_grad_close(name, a.grad, b.grad, m, dtype, scale=scale)
