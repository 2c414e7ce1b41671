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


# Configs whose forward calls the op's C++ function itself (rl_losses._calls._Bound.op), with batch entries that the
# call passes on (converted as the wrapper converts them) or that the config requires.
_DIRECT_CASES = [
    ({"type": "label", "label_smoothing": 0.1, "weight": 0.5}, {"num_labels_in_batch": 11}),
    ({"type": "grpo", "epsilon_high": 0.28}, {"num_labels_in_batch": torch.tensor(13.0), "label_counts": "counts"}),
    ({"type": "grpo", "beta": 0.04, "weight": 2.0}, {"ref_log_probs": "ref"}),
    ({"type": "gspo"}, {"num_documents_in_batch": 4}),
    ({"type": "gspo", "rollout_correction": "token_truncate"}, {"rollout_log_probs": "ref"}),
]


@pytest.mark.parametrize("config, entries", _DIRECT_CASES, ids=[str(c) for c, _ in _DIRECT_CASES])
def test_direct_op_call_matches_the_wrapper_and_the_reference(config, entries, monkeypatch):
    """The op called from forward gives the wrapper's loss, metrics and gradient (the wrapper runs where the opt-in
    checks are on), and the pure-PyTorch reference's in float64."""
    logits, batch = _inputs()
    counts = torch.bincount(batch["document_index"], (batch["labels"] >= 0).long())[batch["document_index"]]
    extra = {"counts": counts, "ref": -torch.rand(logits.shape[0]) - 2.0}
    batch.update({key: extra.get(value, value) if isinstance(value, str) else value for key, value in entries.items()})
    module = LanguageModelLossConfig.from_dict(config).get_loss()
    module(logits, batch)
    bound, wrapped = module._bound_of[False], []
    assert bound.op is not None
    bound.function = lambda *args, _function=bound.function, **kwargs: wrapped.append(1) or _function(*args, **kwargs)
    results = []
    for checks in (False, True):
        if checks:
            monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
        x = logits.detach().requires_grad_()
        loss, metrics = module(x, batch)
        loss.backward()
        results.append((loss, metrics, x.grad))
        assert len(wrapped) == checks
    (loss, metrics, grad), (wrapper_loss, wrapper_metrics, wrapper_grad) = results
    assert metrics.keys() == wrapper_metrics.keys()
    assert all(torch.equal(metrics[k], wrapper_metrics[k]) for k in metrics)
    assert torch.equal(loss, wrapper_loss) and torch.equal(grad, wrapper_grad)
    assert not any(m.requires_grad for m in metrics.values())
    reference_module = LanguageModelLossConfig.from_dict({**config, "use_cuda_kernel": False}).get_loss()
    x64 = logits.detach().double().requires_grad_()
    batch64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    expected_loss, expected_metrics = reference_module(x64, batch64)
    expected_loss.backward()
    assert metrics.keys() == expected_metrics.keys()
    for key in metrics:
        assert_close(metrics[key], expected_metrics[key], torch.float32)
    assert_close(loss, expected_loss, torch.float32)
    assert_close(grad, x64.grad, torch.float32)


@pytest.mark.parametrize("kind, missing", [("label", "labels"), ("grpo", "advantages"), ("gspo", "document_index")])
def test_direct_op_call_names_a_missing_batch_entry(kind, missing):
    module = LanguageModelLossConfig.from_dict({"type": kind}).get_loss()
    logits, batch = _inputs()
    del batch[missing]
    with pytest.raises(ValueError, match=f"the batch has no '{missing}'"):
        module(logits, batch)


def test_verl_module_refuses_a_temperature_of_zero():
    ppo = verl.FusedLinearForPPO(chunk_size=None)
    with pytest.raises(ValueError, match="linear_token_log_probs: temperature must be > 0, got 0.0"):
        ppo(torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,)), temperature=0.0)
