"""compute_metrics=False on GRPO and GSPO: every metric but new_logprobs (and the entropy asked for) left out, on
every path (no gradient, autograd, in place, forward_backward, the fake kernel, the lm_head ops, the reference and
the loss modules), and nothing else changed: the loss, new_logprobs, log_probs, the entropy and the gradient have
the bits of a call with the metrics."""
import pytest
import torch

import rl_losses

from helpers_grpo import make_inputs

_ops = torch.ops.rl_losses
# Kept without the metrics: the loss, new_logprobs, the per-token log-probs and GSPO's document ratios (the entropy
# where compute_entropy asks for it); every other result is a metric.
_KEPT = ("loss", "new_logprobs", "log_probs", "document_ratios")


def _inputs(op, device, meta=False):
    logits, target, advantages, old, ref = make_inputs((8,), 20, torch.float32, device, masked=0.2)
    doc = torch.arange(8, device=device) // 4
    if meta:
        logits, target, advantages, old, ref, doc = (t.to("meta") for t in (logits, target, advantages, old, ref, doc))
    tail = (doc,) if op == "gspo" else ()
    # Every option metric on (but vespo's), an entropy bonus, and the documents' count given (meta: no data).
    options = dict(ref_log_probs=ref, beta=0.05, rollout_correction="token_truncate", rollout_log_probs=old - 0.1,
                   entropy_coefficient=0.01, **(dict(num_documents=2) if op == "gspo" else {}))
    return logits, (target, advantages, old, *tail), options


@pytest.mark.parametrize("op", ["grpo", "gspo"])
@pytest.mark.parametrize("path", ["no_grad", "autograd", "inplace", "meta"])
@pytest.mark.parametrize("entropy", [False, True])
def test_without_metrics_only_the_loss_and_log_probs_stay(op, path, entropy, device):
    logits, args, options = _inputs(op, device, meta=path == "meta")
    names = rl_losses._schema.results(op)

    def run(**more):
        x = logits if path in ("no_grad", "meta") else logits.clone().requires_grad_()
        if path == "inplace":
            out = getattr(_ops, op)(x * 1, *args, inplace_backward=True, **options, **more)
        else:
            out = getattr(_ops, op)(x, *args, **options, **more)
        grad = None
        if path in ("autograd", "inplace"):
            out[0].backward()
            grad = x.grad
        return dict(zip(names, out)), grad

    with_metrics, grad = run(compute_entropy=entropy)
    without, grad_without = run(compute_entropy=entropy, compute_metrics=False)
    for name in names:
        if name in _KEPT or (entropy and name == "entropy"):
            assert isinstance(without[name], torch.Tensor), name
            if path != "meta":
                assert torch.equal(without[name], with_metrics[name]), name
        else:
            assert without[name] is None, (name, without[name])
            assert name == "vespo_phi_seq_mean" or with_metrics[name] is not None, name
    if grad is not None:
        assert torch.equal(grad_without, grad)


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_wrappers_reference_and_forward_backward_agree(op, device):
    logits, args, options = _inputs(op, device)
    options["compute_metrics"] = False
    wrapper = getattr(rl_losses, f"{op}_loss")
    x = logits.clone().requires_grad_()
    out = wrapper(x, *args, **options)
    out.loss.backward()
    ref = getattr(rl_losses.reference, f"{op}_loss")(logits.double(), args[0], *(a.double() if a.is_floating_point()
                                                     else a for a in args[1:]),
                                                     **{k: v.double() if isinstance(v, torch.Tensor) else v
                                                        for k, v in options.items()})
    for name, value in out._asdict().items():
        expected = getattr(ref, name)
        if name == "loss_type":
            continue
        assert (value is None) == (expected is None), name
        if value is not None:
            torch.testing.assert_close(value.double(), expected.double(), rtol=1e-5, atol=1e-6, msg=name)
    assert out.trl_metrics() == {}
    fb_out, grad = rl_losses.forward_backward(wrapper, logits, *args, **options)
    assert fb_out.clipped_fraction_low is None and fb_out.kl is None
    torch.testing.assert_close(grad, x.grad)


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_lm_head_ops(op, device):
    # linear_grpo and linear_gspo may write weight_main_grad: their results stay plain tensors (empty where left
    # out) and the wrappers say None.
    _, args, options = _inputs(op, device)
    hidden = torch.randn(8, 16, device=device, requires_grad=True)
    weight = torch.randn(20, 16, device=device, requires_grad=True)
    out = dict(zip(rl_losses._schema.results(f"linear_{op}"),
                   getattr(_ops, f"linear_{op}")(hidden, weight, *args, **options, compute_metrics=False)))
    assert out["clipped_fraction_low"].shape == (0,) and out["kl"].shape == (0,)
    wrapped = getattr(rl_losses, f"linear_{op}_loss")(hidden, weight, *args, **options, compute_metrics=False)
    full = getattr(rl_losses, f"linear_{op}_loss")(hidden, weight, *args, **options)
    assert wrapped.clipped_fraction_low is None and wrapped.ratio_mean is None and wrapped.entropy is None
    assert torch.equal(wrapped.loss, full.loss) and torch.equal(wrapped.log_probs, full.log_probs)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_loss_modules_at_metrics_none_ask_for_none(loss_type, device, monkeypatch):
    # metrics="none" reports new_logprobs alone: its op call leaves the other metrics out.
    logits, (target, advantages, old, *tail), _ = _inputs(loss_type, device)
    batch = {"labels": target, "advantages": advantages, "old_log_probabilities": old}
    if tail:
        batch.update(document_index=tail[0], num_documents=2)
    seen = []
    packet = getattr(_ops, loss_type)

    class Spy:  # the op packet, as the module calls it (its C++ function, `_op`)
        def _op(self, *a, **k):
            seen.append(k.get("compute_metrics"))
            return packet._op(*a, **k)
        __call__ = _op

    monkeypatch.setattr(_ops, loss_type, Spy())
    module = rl_losses.LanguageModelLossConfig.from_dict({"type": loss_type}).get_loss()
    loss, metrics = module(logits, batch)
    assert seen == [False] and set(metrics) == {loss_type, f"{loss_type}_new_logprobs"}, (seen, metrics)
