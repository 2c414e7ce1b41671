"""The loss modules' and verl's FusedLinearForPPO's call (rl_losses._calls.DirectCallModule): straight to forward
where nothing hooks into it, nn.Module's call wherever it would do more (the module's hooks, every module's hooks,
``module.compile()``, an assigned forward), through copies, and under torch.compile(fullgraph=True).

The losses are compared with float64 cross-entropy written here and with the pure-PyTorch reference."""
import copy
import inspect
import pickle

import pytest
import torch
from conftest import assert_close

from rl_losses import LanguageModelLossConfig, reference
from rl_losses._calls import DirectCallModule
from rl_losses.integrations import verl


def _inputs(n=12, v=23):
    logits = torch.randn(n, v, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100
    batch = {"labels": labels, "advantages": torch.randn(n), "old_log_probabilities": -torch.rand(n) - 2.0,
             "document_index": torch.arange(n) // 4, "num_documents": 3}
    return logits, batch


def _cross_entropy(logits, labels):
    on = labels >= 0
    lp = torch.log_softmax(logits.detach().double(), -1)
    return -(lp[on].gather(-1, labels[on, None]).sum() / on.sum())


def _label_module(weight=0.5):
    return LanguageModelLossConfig.from_dict({"type": "label", "weight": weight}).get_loss(name="ce")


def test_direct_call_matches_the_loss():
    module = _label_module()
    logits, batch = _inputs()
    loss, metrics = module(logits, batch)
    expected = _cross_entropy(logits, batch["labels"])
    assert_close(metrics["ce"], expected, torch.float32)
    assert_close(loss, 0.5 * expected, torch.float32)
    assert not metrics["ce"].requires_grad and loss.requires_grad


def test_hooks_of_the_module_run():
    module = _label_module()
    logits, batch = _inputs()
    seen = []
    # A pre-hook that changes the input (the logits doubled) and a hook that changes the output (the weight undone).
    pre = module.register_forward_pre_hook(lambda m, args: (args[0] * 2.0, args[1]))
    post = module.register_forward_hook(lambda m, args, out: (out[0] / 0.5, out[1]))
    back = module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out))
    loss, metrics = module(logits, batch)
    expected = _cross_entropy(2.0 * logits, batch["labels"])
    assert_close(loss, expected, torch.float32)
    assert_close(metrics["ce"], expected, torch.float32)
    loss.backward()
    assert len(seen) == 1
    for handle in (pre, post, back):
        handle.remove()
    loss, _ = module(logits, batch)  # no hook left: the direct call again
    assert_close(loss, 0.5 * _cross_entropy(logits, batch["labels"]), torch.float32)


def test_hooks_of_every_module_run():
    module = _label_module()
    logits, batch = _inputs()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(m))
    try:
        module(logits, batch)
    finally:
        handle.remove()
    assert seen == [module]
    module(logits, batch)
    assert seen == [module]


def test_compiled_call_and_assigned_forward_are_nn_modules():
    module = _label_module()
    logits, batch = _inputs()
    calls = []

    def compiled(*args, **kwargs):  # stands for module.compile()'s compiled call
        calls.append(args)
        return module._call_impl(*args, **kwargs)

    module._compiled_call_impl = compiled
    loss, _ = module(logits, batch)
    assert len(calls) == 1
    assert_close(loss, 0.5 * _cross_entropy(logits, batch["labels"]), torch.float32)
    other = _label_module()
    other.forward = lambda logits, batch: "assigned"
    assert other(logits, batch) == "assigned"


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_a_copy_sees_its_own_hooks(clone):
    module = clone(_label_module())
    logits, batch = _inputs()
    seen = []
    module.register_forward_hook(lambda m, args, out: seen.append(out[1]["ce"]))
    loss, _ = module(logits, batch)
    assert len(seen) == 1
    assert_close(seen[0], _cross_entropy(logits, batch["labels"]), torch.float32)


def test_generated_call_takes_forwards_parameters():
    """The call is generated from forward's parameters: any kinds, defaults, and forward's own name for the module."""
    class Affine(DirectCallModule):
        def forward(this, x, *shifts, scale=2.0, **named):
            return x * scale + sum(shifts) + sum(named.values())

    assert str(inspect.signature(Affine.__call__)) == "(this, x, *shifts, scale=2.0, **named)"
    module = Affine()
    x = torch.randn(5, dtype=torch.float64)
    assert_close(module(x), 2.0 * x, torch.float64)
    assert_close(module(x, 1.5, 0.25, scale=-3.0, bias=0.5), -3.0 * x + 2.25, torch.float64)
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(len(args)))
    assert_close(module(x, 1.0), 2.0 * x + 1.0, torch.float64)
    assert seen == [2]


def test_verl_module_hooks_and_call():
    g = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(19, 8, generator=g)
    ids = torch.randint(0, 19, (6,), generator=g)
    ppo = verl.FusedLinearForPPO(chunk_size=None)
    logits = (hidden.detach().double() @ weight.double().T) / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    log_probs, _ = ppo(hidden, weight, ids, temperature=0.7)
    assert_close(log_probs, expected, torch.float32)
    seen = []
    ppo.register_forward_hook(lambda m, args, out: seen.append(args[3] if len(args) > 3 else None))
    log_probs, _ = ppo(hidden, weight, ids, 0.7)
    assert seen == [0.7]
    assert_close(log_probs, expected, torch.float32)


@pytest.mark.parametrize("kind", ["label", "grpo", "gspo"])
def test_compile_fullgraph_of_a_step(kind):
    """torch.compile(fullgraph=True) traces a step calling the module: the loss, metrics and gradient of eager."""
    module = LanguageModelLossConfig.from_dict({"type": kind, "weight": 0.5}).get_loss()
    logits, batch = _inputs()

    def step(logits, batch):
        loss, metrics = module(logits, batch)
        return loss * 1.7, metrics

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    loss, metrics = compiled(logits, batch)
    (grad,) = torch.autograd.grad(loss, logits)
    eager_loss, eager_metrics = step(logits, batch)
    (eager_grad,) = torch.autograd.grad(eager_loss, logits)
    assert metrics.keys() == eager_metrics.keys()
    for key in metrics:
        assert_close(metrics[key], eager_metrics[key], torch.float32)
    assert_close(loss, eager_loss, torch.float32)
    assert_close(grad, eager_grad, torch.float32)
    # Against the reference, in float64: the module's unweighted loss.
    args = [logits.detach().double(), batch["labels"]]
    if kind == "label":
        expected = reference.cross_entropy(*args)
    elif kind == "grpo":
        expected = reference.grpo_loss(*args, batch["advantages"].double(),
                                       batch["old_log_probabilities"].double()).loss
    else:
        expected = reference.gspo_loss(*args, batch["advantages"].double(), batch["old_log_probabilities"].double(),
                                       batch["document_index"], num_documents=3).loss
    assert_close(metrics[module.name], expected, torch.float32)
