"""Tests of the DPO op (docs/distillation_dpo.md): loss, metrics and gradient against the float64 reference
(rl_losses.reference.dpo_loss) over packed documents with prompts and padding; opcheck, gradcheck,
torch.compile, inplace_backward, Fast-LLM's spans, and bad input (spans without a pair)."""
import pytest
import torch

import rl_losses
from rl_losses import reference
from rl_losses.dpo import documents_from_spans

from conftest import assert_close
from helpers import assert_compiled_matches_eager, assert_grad_close, forward_options, gradcheck_fresh, param_id as _id

_ops = torch.ops.rl_losses
METRICS = ("rewards_chosen", "rewards_rejected", "accuracy", "margin", "log_probs", "document_log_probs")


def make_inputs(n_pairs, vocab, dtype, device, *, prompt=3, padding=2, shuffle=True):
    """A packed row of 2·n_pairs documents of random lengths, each a prompt (unlabelled) then a response,
    padding at the end; pairs of documents in a random order; reference log-probs near the policy's."""
    lengths = torch.randint(prompt + 1, prompt + 6, (2 * n_pairs,)).tolist()
    doc = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)] + [torch.full((padding,), -1)])
    n = doc.numel()
    target = torch.randint(0, vocab, (n,))
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    for s0 in starts.tolist():
        target[s0:s0 + prompt] = -100
    target[doc < 0] = -100
    order = torch.randperm(2 * n_pairs) if shuffle else torch.arange(2 * n_pairs)
    pairs = order.view(n_pairs, 2)
    logits = (torch.randn(n, vocab) * 2).to(dtype)
    ref_c = torch.randn(n_pairs) * 2 - 10
    ref_r = torch.randn(n_pairs) * 2 - 10
    return [t.to(device) for t in (logits, target, doc, pairs, ref_c, ref_r)]


def run(fn, logits, *args, upstream=1.0, **kwargs):
    x = logits.detach().clone().requires_grad_()
    out = fn(x, *args, **kwargs)
    (out.loss * upstream).backward()
    return out, x.grad


def check(inputs, upstream=1.0, **options):
    logits, target, doc, pairs, ref_c, ref_r = inputs
    dtype = logits.dtype
    out, grad = run(rl_losses.dpo_loss, logits, target, doc, pairs, ref_c, ref_r, upstream=upstream, **options)
    ref, ref_grad = run(reference.dpo_loss, logits.double(), target, doc, pairs, ref_c.double(), ref_r.double(),
                        upstream=upstream, **options)
    assert_close(out.loss.detach(), ref.loss.detach(), dtype, msg="loss")
    for name in METRICS:
        actual = getattr(out, name)
        assert not actual.requires_grad, name
        # Sums of up to 8 log-probs, and β times them in the rewards: a few ulps of the sum.
        assert_close(actual, getattr(ref, name), dtype, scale=4.0, msg=name)
    natural = options.get("logits_scale_factor", 1.0) * options.get("beta", 1.0) * abs(upstream) / (
        options.get("divisor") or pairs.shape[0])
    assert_grad_close(grad, ref_grad, dtype, natural_scale=natural)
    assert torch.count_nonzero(grad[target < 0]) == 0, "prompt and padding tokens must get a zero gradient"


OPTIONS = {
    "plain": ({}, 1.0),
    "beta": ({"beta": 0.1}, 1.0),
    "scaled_divisor": ({"beta": 0.5, "logits_scale_factor": 0.8, "divisor": 3.0}, -1.7),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769])
def test_matches_reference(vocab, dtype, option, device):
    options, upstream = OPTIONS[option]
    check(make_inputs(4, vocab, dtype, device), upstream, **options)


@pytest.mark.parametrize("vocab", [32000, 50257])
def test_large_vocab(vocab, device):
    check(make_inputs(1, vocab, torch.bfloat16, device, prompt=1, padding=1), beta=0.2)


def test_float64_and_single_token_documents(device):
    check(make_inputs(5, 33, torch.float64, device, prompt=0, padding=0), beta=0.3)


def test_accuracy_counts_the_pairs_the_policy_prefers(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(6, 11, torch.float64, device)
    out = rl_losses.dpo_loss(logits, target, doc, pairs, ref_c, ref_r, beta=0.5)
    sums = out.document_log_probs
    wins = ((sums[pairs[:, 0]] - ref_c) > (sums[pairs[:, 1]] - ref_r)).double().mean()
    torch.testing.assert_close(out.accuracy, wins)


def test_inplace_backward_matches(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(3, 50, torch.float32, device)
    out, grad = run(rl_losses.dpo_loss, logits, target, doc, pairs, ref_c, ref_r, beta=0.4)
    x = logits.clone().requires_grad_()
    out_inplace = rl_losses.dpo_loss(x * 1.0, target, doc, pairs, ref_c, ref_r, beta=0.4, inplace_backward=True)
    out_inplace.loss.backward()
    torch.testing.assert_close(out_inplace.loss, out.loss)
    torch.testing.assert_close(x.grad, grad)


def test_gradcheck(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(2, 5, torch.float64, device, prompt=1, padding=1)
    gradcheck_fresh(lambda x: rl_losses.dpo_loss(x, target, doc, pairs, ref_c.double(), ref_r.double(), beta=0.7,
                                                 logits_scale_factor=1.1).loss,
                    logits.clone().requires_grad_())


def test_opcheck(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(2, 9, torch.float32, device)
    torch.library.opcheck(_ops.dpo, (logits.clone().requires_grad_(), target, doc, pairs, ref_c, ref_r),
                          dict(beta=0.5))
    torch.library.opcheck(_ops._dpo_forward, (logits, target, doc, pairs, ref_c, ref_r),
                          forward_options("dpo", beta=0.5, compute_grad=True))
    # The tensor-parallel hooks: given statistics (as the all-reduce leaves them), a shard's columns.
    stats = _ops.row_stats(logits, target).reshape(-1, 5)
    torch.library.opcheck(_ops.dpo, (logits[:, 3:].clone().requires_grad_(), target, doc, pairs, ref_c, ref_r),
                          dict(beta=0.5, row_stats=stats, vocab_start=3, vocab_size=9))


def test_compile_fullgraph(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(2, 17, torch.float32, device)

    def fn(x, *args):
        out = rl_losses.dpo_loss(x, *args, beta=0.3)
        return out.loss, out.margin, out.document_log_probs

    assert_compiled_matches_eager(fn, logits, target, doc, pairs, ref_c, ref_r, backend="aot_eager")


def test_documents_from_spans(device):
    chosen = [[(1, 4)], [(0, 2), (6, 8)]]
    rejected = [[(5, 9)], [(3, 5), (9, 10)]]
    doc, pairs = documents_from_spans(chosen, rejected, (2, 10), device)
    expected = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, 1, 1, -1], [2, 2, -1, 3, 3, -1, 4, 4, -1, 5]])
    torch.testing.assert_close(doc.cpu(), expected)
    torch.testing.assert_close(pairs.cpu(), torch.tensor([[0, 1], [2, 3], [4, 5]]))
    with pytest.raises(ValueError, match="1 chosen but 0 rejected"):
        documents_from_spans([[(0, 2)]], [[]], (1, 4))
    with pytest.raises(ValueError, match="overlaps"):
        documents_from_spans([[(0, 2)]], [[(1, 3)]], (1, 4))


@pytest.mark.parametrize("pairs_on", ["cpu", "device, checked on the host"])
def test_bad_pairing(device, pairs_on, monkeypatch):
    # Pairs on the CPU are checked on the host at no cost; pairs on the device only when asked (a CUDA mistake
    # otherwise stops the kernel with a device-side assert, which a test process cannot survive).
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(2, 9, torch.float32, device)
    if pairs_on != "cpu":
        monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    where = "cpu" if pairs_on == "cpu" else device
    f = rl_losses.dpo_loss
    with pytest.raises(RuntimeError, match=r"document 1 is in pairs\[0\] and in pairs\[1\]"):
        f(logits, target, doc, torch.tensor([[0, 1], [1, 2]], device=where), ref_c, ref_r)
    with pytest.raises(RuntimeError, match=r"pairs\[1\] holds document 7, but 2 pairs cover the documents 0 \.\. 3"):
        f(logits, target, doc, torch.tensor([[0, 1], [2, 7]], device=where), ref_c, ref_r)
    # Valid pairs from the CPU give what pairs on the device give (up to the order of atomic additions).
    expected = f(logits, target, doc, pairs, ref_c, ref_r)
    got = f(logits, target, doc, pairs.cpu(), ref_c, ref_r)
    for e, g in zip(expected, got):
        assert_close(g, e, torch.float32)


def test_bad_input(device):
    logits, target, doc, pairs, ref_c, ref_r = make_inputs(2, 9, torch.float32, device)
    f = rl_losses.dpo_loss
    with pytest.raises(RuntimeError, match=r"pairs must have shape \(num_pairs, 2\)"):
        f(logits, target, doc, pairs.view(-1), ref_c, ref_r)
    with pytest.raises(RuntimeError, match=r"reference_rejected_log_probs must have shape \(2,\)"):
        f(logits, target, doc, pairs, ref_c, ref_r[:1])
    with pytest.raises(RuntimeError, match="beta must be finite and > 0, got 0"):
        f(logits, target, doc, pairs, ref_c, ref_r, beta=0.0)
    with pytest.raises(RuntimeError, match="document_index has shape"):
        f(logits, target, doc[:-1], pairs, ref_c, ref_r)
    if device == "cpu":  # CUDA reports it by a device-side assert
        with pytest.raises(RuntimeError, match=r"document_index holds 4 but 2 pairs cover the documents 0 \.\. 3"):
            f(logits, target, torch.where(doc == 3, 4, doc), pairs, ref_c, ref_r)


# ---- the `dpo` config ---------------------------------------------------------------------------------------
def test_config_module_from_spans_and_reference_logits(device):
    from rl_losses.config import LanguageModelLossConfig

    vocab = 23
    labels = torch.randint(0, vocab, (2, 12), device=device)
    chosen, rejected = [[(1, 5)], [(0, 3), (7, 9)]], [[(6, 11)], [(3, 6), (9, 12)]]
    logits = torch.randn(2, 12, vocab, device=device)
    ref_logits = logits + 0.5 * torch.randn(2, 12, vocab, device=device)
    batch = {"labels": labels, "chosen_spans": chosen, "rejected_spans": rejected,
             "reference_logits": {"reference": ref_logits}}
    cfg = {"type": "dpo", "beta": 0.3}
    results = []
    for use_kernel in (None, False):
        module = LanguageModelLossConfig.from_dict({**cfg, "use_cuda_kernel": use_kernel}).get_loss()
        x = logits.clone().requires_grad_()
        loss, metrics = module(x, batch)
        loss.backward()
        results.append((loss.detach(), metrics["dpo_margin"], metrics["dpo_accuracy"], x.grad))
    for kernel, ref in zip(*results):
        assert_close(kernel, ref, torch.float32, scale=4.0)
    # By hand: the reference's π from its own logits, the sigmoid per pair.
    doc, pairs = documents_from_spans(chosen, rejected, (2, 12), device)
    zeros = torch.zeros(3, device=device)
    lp = reference.dpo_loss(logits.double(), labels, doc, pairs, zeros, zeros).document_log_probs
    ref = reference.dpo_loss(ref_logits.double(), labels, doc, pairs, zeros, zeros).document_log_probs
    h = 0.3 * ((lp - ref)[pairs[:, 0]] - (lp - ref)[pairs[:, 1]])
    assert_close(results[0][0], -torch.nn.functional.logsigmoid(h).mean(), torch.float32, scale=4.0)
