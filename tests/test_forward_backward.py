"""rl_losses.forward_backward (the loss and its gradient in one call, without autograd): for every loss op of the
logits and of the hidden states (the lm_head's, with a bias and weight_main_grad), the result and the gradient
against the float64 reference (rl_losses.reference's loss, differentiated by autograd) and bit for bit against the
op's own autograd path; the upstream gradient (a number, per token); meta tensors; and what it refuses (tp_group,
inplace_backward, a wrapper without a fused gradient, one calling two loss ops, a loss other than the op's own, loss
modules, torch.compile, a grad_output of the wrong shape, a nested call), on CPU and CUDA."""
import pytest
import torch

import rl_losses
from rl_losses import reference
from rl_losses.reference_topk import topk_distillation_loss as topk_reference

from conftest import assert_close
from helpers import assert_grad_close, make_logits, policy_inputs, to64

N, V = 24, 40


def _cases(device):
    """(name, wrapper, tensors after the logits, options, the float64 reference's loss of (x64, *tensors64))."""
    logits = make_logits((N,), V, torch.float32, device)
    target, adv, old, doc = policy_inputs(logits, 3)
    teacher = make_logits((N,), V, torch.float32, device)
    ids = torch.stack([torch.randperm(V, device=device)[:5] for _ in range(N)])
    top = torch.log_softmax(torch.randn(N, 5, device=device), -1)
    pairs, doc4 = torch.tensor([[0, 1], [3, 2]], device=device), torch.arange(N, device=device) * 4 // N
    ref_c, ref_r = torch.randn(2, device=device), torch.randn(2, device=device)
    return logits, [
        ("cross_entropy", rl_losses.cross_entropy, (target,), dict(label_smoothing=0.1, z_loss_factor=1e-3),
         lambda x: reference.cross_entropy(x, target, label_smoothing=0.1, z_loss_factor=1e-3)),
        ("z_loss", rl_losses.z_loss, (), dict(loss_mask=target >= 0),
         lambda x: reference.z_loss(x, loss_mask=target >= 0)),
        ("grpo_loss", rl_losses.grpo_loss, (target, adv, old), dict(epsilon_high=0.28, beta=0.04, ref_log_probs=old),
         lambda x: reference.grpo_loss(x, target, to64(adv), to64(old), epsilon_high=0.28, beta=0.04,
                                       ref_log_probs=to64(old)).loss),
        ("gspo_loss", rl_losses.gspo_loss, (target, adv, old, doc), dict(num_documents=3),
         lambda x: reference.gspo_loss(x, target, to64(adv), to64(old), doc, num_documents=3).loss),
        ("distillation_loss", rl_losses.distillation_loss, (teacher,), dict(kind="jsd", beta=0.3),
         lambda x: reference.distillation_loss(x, to64(teacher), kind="jsd", beta=0.3).loss),
        ("dpo_loss", rl_losses.dpo_loss, (target, doc4, pairs, ref_c, ref_r), dict(beta=0.5),
         lambda x: reference.dpo_loss(x, target, doc4, pairs, to64(ref_c), to64(ref_r), beta=0.5).loss),
        ("fused_head_loss", rl_losses.fused_head_loss, (target,),
         dict(label_weight=1.0, z_loss_weight=1e-3, grpo_weight=0.5, advantages=adv, old_log_probs=old),
         lambda x: reference.fused_head_loss(x, target, label_weight=1.0, z_loss_weight=1e-3, grpo_weight=0.5,
                                             advantages=to64(adv), old_log_probs=to64(old)).loss),
        ("topk_distillation_loss", rl_losses.topk_distillation_loss, (target, ids, top), dict(tail="tail"),
         lambda x: topk_reference(x, target, ids, to64(top), tail="tail").loss),
    ]


def _loss(result):
    return result if isinstance(result, torch.Tensor) else result.loss


@pytest.mark.parametrize("index", range(8))
def test_equals_the_reference_and_the_autograd_path(device, index):
    logits, cases = _cases(device)
    name, fn, tensors, options, ref = cases[index]
    result, grad = rl_losses.forward_backward(fn, logits, *tensors, **options)
    x64 = logits.detach().double().requires_grad_()
    expected = ref(x64)
    expected.backward()
    assert_close(_loss(result), expected.detach(), torch.float32, msg=name)
    assert_grad_close(grad, x64.grad, torch.float32)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype and not grad.requires_grad
    assert not _loss(result).requires_grad and torch.is_grad_enabled()
    # The op's autograd path computes the same gradient in its forward: the same bits.
    x = logits.detach().clone().requires_grad_()
    _loss(fn(x, *tensors, **options)).backward()
    assert torch.equal(grad, x.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_upstream_gradient(device, dtype):
    """A number scales the gradient as an upstream gradient would; reduction "none" takes one per token (fp16: the
    rows stored pre-scaled, unscaled by the same step as autograd's backward)."""
    logits = make_logits((N,), V, dtype, device)
    target, adv, old, _ = policy_inputs(logits, 3)
    upstream = torch.rand(N, device=device) + 0.5
    for options, g in ((dict(), 3.0), (dict(reduction="none"), upstream), (dict(reduction="none"), None),
                       (dict(reduction="none"), 2.0), (dict(reduction="none"), torch.tensor(0.25))):
        loss, grad = rl_losses.forward_backward(rl_losses.cross_entropy, logits, target, grad_output=g, **options)
        up = torch.as_tensor(1.0 if g is None else g, device=device)
        x64 = logits.detach().double().requires_grad_()
        (reference.cross_entropy(x64, target, **options) * to64(up)).sum().backward()
        assert_grad_close(grad, x64.grad, dtype)
        x = logits.detach().clone().requires_grad_()
        rl_losses.cross_entropy(x, target, **options).backward(up.to(loss.dtype).expand_as(loss))
        assert torch.equal(grad, x.grad)
    result, grad = rl_losses.forward_backward(rl_losses.grpo_loss, logits, target, adv, old, grad_output=0.5)
    x64 = logits.detach().double().requires_grad_()
    (0.5 * reference.grpo_loss(x64, target, to64(adv), to64(old)).loss).backward()
    assert_grad_close(grad, x64.grad, dtype)


def test_meta_tensors():
    """On meta tensors the op's fake kernel gives the shapes: the gradient has the logits' shape and dtype."""
    logits = torch.empty(N, V, device="meta", dtype=torch.bfloat16)
    target = torch.empty(N, device="meta", dtype=torch.int64)
    adv, old = torch.empty(N, device="meta"), torch.empty(N, device="meta")
    result, grad = rl_losses.forward_backward(rl_losses.grpo_loss, logits, target, adv, old)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype and grad.device.type == "meta"
    assert result.loss.shape == ()


def test_refused(device):
    logits = make_logits((N,), V, torch.float32, device)
    target, adv, old, _ = policy_inputs(logits, 3)
    fb = rl_losses.forward_backward
    with pytest.raises(ValueError, match="tp_group and sdp_group are not supported"):
        fb(rl_losses.cross_entropy, logits, target, tp_group=object())
    with pytest.raises(ValueError, match="tp_group and sdp_group are not supported"):
        fb(rl_losses.gspo_loss, logits, target, adv, old, torch.zeros_like(target), sdp_group=object())
    with pytest.raises(TypeError, match="takes a functional wrapper .* not a loss module"):
        fb(rl_losses.LanguageModelLossConfig.from_dict({"type": "label"}).get_loss(), logits, {"labels": target})
    with pytest.raises(TypeError, match="returned a loss other than its op's"):
        fb(lambda x, t: 0.5 * rl_losses.cross_entropy(x, t), logits, target)
    with pytest.raises(TypeError, match="returned a loss other than its op's"):  # scaled in place
        fb(lambda x, t: rl_losses.cross_entropy(x, t).div_(4), logits, target)
    with pytest.raises(TypeError, match="returned a loss other than its op's"):  # a view: another order of values
        fb(lambda x, t: rl_losses.cross_entropy(x, t, reduction="none")[:3], logits, target)
    with pytest.raises(RuntimeError, match="not supported under torch.compile"):
        torch.compile(lambda x, t: fb(rl_losses.cross_entropy, x, t)[1], backend="eager", fullgraph=True)(logits,
                                                                                                            target)
    with pytest.raises(ValueError, match="inplace_backward is not supported"):
        fb(rl_losses.cross_entropy, logits, target, inplace_backward=True)
    with pytest.raises(TypeError, match="the op token_log_probs does not compute its gradient in the forward"):
        fb(rl_losses.token_log_probs, logits, target)
    with pytest.raises(TypeError, match="called 2 loss ops, not one"):
        fb(lambda x, t: rl_losses.cross_entropy(x, t) + rl_losses.z_loss(x), logits, target)
    with pytest.raises(TypeError, match="called 0 loss ops, not one"):
        fb(lambda x, t: x.sum(), logits, target)
    with pytest.raises(ValueError, match=r"grad_output must have the loss's shape \(\) \(or be a number\), got \(2,\)"):
        fb(rl_losses.cross_entropy, logits, target, grad_output=torch.ones(2, device=device))
    grid = target.reshape(4, 6)
    with pytest.raises(ValueError, match=r"grad_output must have the loss's shape \(4, 6\) \(or be a number\), got "
                                         r"\(6, 4\)"):
        fb(rl_losses.cross_entropy, logits.reshape(4, 6, V), grid, reduction="none", grad_output=torch.ones(6, 4))
    with pytest.raises(RuntimeError, match="called inside another forward_backward's loss_fn"):
        fb(lambda x, t: fb(rl_losses.cross_entropy, x, t)[0], logits, target)
    # A refusal leaves grad mode and the next call as they were.
    assert torch.is_grad_enabled()
    loss, grad = fb(rl_losses.cross_entropy, logits, target)
    assert torch.isfinite(loss) and grad.shape == logits.shape


def _linear_inputs(device):
    g = torch.Generator(device="cpu").manual_seed(7)
    hidden = torch.randn(N, 16, generator=g).to(device)
    weight = (torch.randn(V, 16, generator=g) / 4).to(device)
    bias = torch.randn(V, generator=g).to(device)
    return hidden, weight, bias


@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_grpo_loss", "linear_gspo_loss",
                                  "linear_topk_distillation_loss"])
def test_lm_head_ops(device, name):
    """The lm_head ops: (grad_hidden, grad_weight, grad_bias) against the float64 reference of the logits' loss
    through hidden @ weight.T + bias, and bit for bit against the op's autograd path; a number as grad_output."""
    hidden, weight, bias = _linear_inputs(device)
    logits, cases = _cases(device)
    index = {"linear_cross_entropy": 0, "linear_grpo_loss": 2, "linear_gspo_loss": 3,
             "linear_topk_distillation_loss": 7}[name]
    _, _, tensors, options, ref = cases[index]
    fn = getattr(rl_losses, name)
    for upstream in (None, 0.5):
        result, grads = rl_losses.forward_backward(fn, hidden, weight, *tensors, bias=bias, grad_output=upstream,
                                                   **options)
        h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
        expected = ref(h64 @ w64.T + b64) * (1.0 if upstream is None else upstream)
        expected.backward()
        assert_close(_loss(result), expected.detach() / (1.0 if upstream is None else upstream), torch.float32)
        for got, want in zip(grads, (h64.grad, w64.grad, b64.grad)):
            assert_grad_close(got, want, torch.float32)
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = _loss(fn(leaves[0], leaves[1], *tensors, bias=leaves[2], **options))
        loss.backward(None if upstream is None else torch.tensor(upstream, device=device, dtype=loss.dtype))
        for got, leaf in zip(grads, leaves):
            assert torch.equal(got, leaf.grad), name


def test_lm_head_into_main_grad(device):
    """weight_main_grad: the weight's gradient added to the caller's fp32 buffer (as the autograd path adds it),
    none returned; a grad_output is refused then (what was added cannot be scaled)."""
    hidden, weight, _ = _linear_inputs(device)
    target = policy_inputs(make_logits((N,), V, torch.float32, device), 3)[0]
    buffer, autograd_buffer = torch.ones(V, 16, device=device), torch.ones(V, 16, device=device)
    result, (grad_hidden, grad_weight, grad_bias) = rl_losses.forward_backward(
        rl_losses.linear_cross_entropy, hidden, weight, target, weight_main_grad=buffer)
    assert grad_weight is None and grad_bias is None
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rl_losses.linear_cross_entropy(h, w, target, weight_main_grad=autograd_buffer).backward()
    assert torch.equal(buffer, autograd_buffer) and torch.equal(grad_hidden, h.grad) and w.grad is None
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    reference.cross_entropy(h64 @ w64.T, target).backward()
    assert_grad_close(buffer - 1, w64.grad, torch.float32)
    with pytest.raises(ValueError, match="with weight_main_grad the weight's gradient is added to the buffer"):
        rl_losses.forward_backward(rl_losses.linear_cross_entropy, hidden, weight, target, weight_main_grad=buffer,
                                   grad_output=2.0)
    # An upstream gradient of 1, as autograd's backward accepts it: the same as none.
    _, (again, _, _) = rl_losses.forward_backward(rl_losses.linear_cross_entropy, hidden, weight, target,
                                                  weight_main_grad=buffer, grad_output=1.0)
    assert torch.equal(again, grad_hidden)
