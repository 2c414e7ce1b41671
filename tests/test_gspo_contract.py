"""Tests of the GSPO op's contract: one backward per forward, gradcheck, opcheck, torch.compile, CPU == CUDA,
and a clear error for each bad input (values and gradients: test_gspo.py)."""
import pytest
import torch

import rl_losses

from conftest import assert_close
from helpers import (DTYPES, assert_compiled_matches_eager, assert_grad_close, forward_options, gradcheck_fresh,
                     label_log_probs64, param_id as _id, requires_cuda)
from helpers_gspo import DOC_METRICS, document_index_from_lengths, make_inputs, packed as _packed, run_op

_ops = torch.ops.rl_losses


# ---- autograd contract, gradcheck, opcheck, compile -------------------------------------------------------
def test_second_backward_raises(device):
    doc = _packed(device, (4, 16))
    logits, target, advantages, old = make_inputs(doc.shape, 20, torch.float32, device, doc)
    x = logits.clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old, doc)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


@pytest.mark.parametrize("case", ["document", "token", "token_advantages"])
def test_gradcheck(case, device):
    # Three documents of a (2, 4) batch (the second crosses the row boundary) whose ratios sit well away from
    # the clip bounds [0.8, 1.2] (1.49, 1.0, 0.61), with advantages of the sign that keeps the gradient on.
    shape, vocab = (2, 4), 5
    logits = torch.randn(*shape, vocab, dtype=torch.float64, device=device)
    target = torch.tensor([[1, 3, -100, 0], [2, 4, 1, 0]], device=device)
    doc = torch.tensor([[0, 0, 1, 1], [1, 2, 2, -1]], device=device)
    lp = label_log_probs64(logits, target)
    shift = torch.tensor([[0.4, 0.4, 0.0, 0.0], [0.0, -0.5, -0.5, 0.0]], dtype=torch.float64, device=device)
    old = lp - shift + torch.tensor([[0.1, -0.1, 0.0, 0.02], [-0.02, 0.05, -0.05, 0.0]], dtype=torch.float64,
                                    device=device)
    # Constant within each document, so that GSPO-token's gradient (through each token's own log-prob only)
    # is the derivative of its loss value too, as gradcheck requires.
    advantages = torch.tensor([[-0.8, -0.8, 0.5, 0.5], [0.5, 0.9, 0.9, 2.0]], dtype=torch.float64,
                              device=device)
    kwargs = {"document": {}, "token": {"weighting": "token"}, "token_advantages": {"token_advantages": True}}[case]
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.gspo_loss(t, target, advantages, old, doc, num_documents=3,
                                                         **kwargs).loss, x)


def _opcheck_cases(device):
    doc = document_index_from_lengths([3, 5, 4], 12, device).view(6, 2)
    logits, target, advantages, old = make_inputs((6, 2), 11, torch.float32, device, doc, masked=0.3)
    leaf = logits.clone().requires_grad_()
    counts = torch.full_like(advantages, 4.0)
    options = forward_options("gspo", num_documents=3, epsilon_high=0.25, delta=1.5, logits_scale_factor=1.1,
                              compute_entropy=True)
    return {
        "gspo": (_ops.gspo.default, (leaf, target, advantages, old, doc), dict(num_documents=3)),
        "gspo_options": (_ops.gspo.default, (leaf, target, advantages, old, doc),
                         dict(num_documents=4, label_counts=counts, weighting="token", token_advantages=True,
                              divisor=2.0, logits_scale_factor=0.9, compute_entropy=True, delta=1.3)),
        "gspo_inferred_num_documents": (_ops.gspo.default, (leaf, target, advantages, old, doc), {}),
        "gspo_no_grad": (_ops.gspo.default, (logits, target, advantages, old, doc), dict(num_documents=3)),
        # Without autograd: inplace_backward refuses the leaves that opcheck's autograd tests need.
        "gspo_inplace": (_ops.gspo.default, (logits.clone(), target, advantages, old, doc),
                         dict(num_documents=3, inplace_backward=True)),
        "_gspo_forward": (_ops._gspo_forward.default, (logits, target, advantages, old, doc),
                          dict(options, compute_grad=True)),
        "_gspo_forward_no_grad": (_ops._gspo_forward.default, (logits, target, advantages, old, doc),
                                  dict(options, compute_grad=False)),
        "_gspo_forward_inplace": (_ops._gspo_forward_inplace.default, (logits.clone(), target, advantages, old, doc),
                                  options),
        "gspo_document_sums": (_ops.gspo_document_sums.default,
                               (label_log_probs64(logits, target).float(), target, advantages, old, doc, counts, 3),
                               {}),
    }


@pytest.mark.parametrize("case", ["gspo", "gspo_options", "gspo_inferred_num_documents", "gspo_no_grad",
                                  "gspo_inplace", "_gspo_forward", "_gspo_forward_no_grad",
                                  "_gspo_forward_inplace", "gspo_document_sums"])
def test_opcheck(case, device):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend, device):
    doc = _packed(device)
    n_docs = int(doc.max()) + 1

    def fn(x, target, advantages, old, document_index):
        out = rl_losses.gspo_loss(x * 2, target, advantages, old, document_index, num_documents=n_docs,
                                  logits_scale_factor=0.5, weighting="token", delta=1.3)
        return out.loss, out.kl_old, out.document_ratios

    logits, target, advantages, old = make_inputs(doc.shape, 129, torch.float32, device, doc)
    assert_compiled_matches_eager(fn, logits, target, advantages, old, doc, backend=backend)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_cpu_matches_cuda(dtype):
    doc = _packed("cpu")
    logits, target, advantages, old = make_inputs(doc.shape, 1000, dtype, "cpu", doc)
    kwargs = dict(weighting="token", compute_entropy=True, logits_scale_factor=1.1, delta=1.3)
    cpu, cpu_grad = run_op(logits, target, advantages, old, doc, 1.3, **kwargs)
    gpu, gpu_grad = run_op(logits.cuda(), target.cuda(), advantages.cuda(), old.cuda(), doc.cuda(), 1.3, **kwargs)
    for metric in ("loss",) + DOC_METRICS + ("entropy", "document_ratios", "log_probs"):
        assert_close(getattr(gpu, metric).detach(), getattr(cpu, metric).detach(), dtype, msg=metric)
    assert_grad_close(gpu_grad.cpu(), cpu_grad.cpu(), dtype)


# ---- bad input --------------------------------------------------------------------------------------------
def _bad_call(case, device):
    """(callable, regex the message must match: the argument and, where there is one, the bad value)."""
    doc = document_index_from_lengths([5, 7], 12, device).view(4, 3)
    logits, target, advantages, old = make_inputs((4, 3), 7, torch.float32, device, doc, masked=0.0)
    gspo = rl_losses.gspo_loss
    cases = {
        "doc_id_too_large": (lambda: gspo(logits, target, advantages, old, doc, num_documents=1), "num_documents"),
        "doc_index_shape": (lambda: gspo(logits, target, advantages, old, doc[:, :2]), "document_index has shape"),
        "doc_index_float": (lambda: gspo(logits, target, advantages, old, doc.float()),
                            "document_index must be an integer tensor"),
        "weighting": (lambda: gspo(logits, target, advantages, old, doc, weighting="sequence"),
                      "weighting.*sequence"),
        "epsilon_low_negative": (lambda: gspo(logits, target, advantages, old, doc, epsilon_low=-0.1),
                                 r"epsilon_low.*-0\.1"),
        "epsilon_low_one": (lambda: gspo(logits, target, advantages, old, doc, epsilon_low=1.0), "epsilon_low"),
        "epsilon_high_negative": (lambda: gspo(logits, target, advantages, old, doc, epsilon_high=-0.1),
                                  r"epsilon_high.*-0\.1"),
        "advantages_shape": (lambda: gspo(logits, target, advantages[:, :2], old, doc), "advantages has shape"),
        "old_log_probs_shape": (lambda: gspo(logits, target, advantages, old[:, :2], doc),
                                "old_log_probs has shape"),
        "label_counts_shape": (lambda: gspo(logits, target, advantages, old, doc, label_counts=old[:, :2]),
                               r"label_counts.*shape"),
        "advantages_int": (lambda: gspo(logits, target, advantages.long(), old, doc),
                           "advantages must be a floating-point tensor"),
        "target_shape": (lambda: gspo(logits, target[:, :2], advantages, old, doc), "target has shape"),
        "scale_negative": (lambda: gspo(logits, target, advantages, old, doc, logits_scale_factor=-1.0),
                           "logits_scale_factor must be finite and > 0, got -1"),
        "divisor_zero": (lambda: gspo(logits, target, advantages, old, doc, divisor=0.0),
                         "divisor must be finite and > 0, got 0"),
        "num_documents_negative": (lambda: gspo(logits, target, advantages, old, doc, num_documents=-1),
                                   "num_documents"),
        "delta_zero": (lambda: gspo(logits, target, advantages, old, doc, epsilon_high=0.3, delta=0.0),
                       r"gspo: delta must be > 0 \(it caps .* delta > 1 \+ epsilon_high = 1.3\), got 0"),
        "delta_infinite": (lambda: gspo(logits, target, advantages, old, doc, delta=float("inf")),
                           r"gspo: delta must be finite \(leave it unset for no cap\), got inf"),
        "delta_sapo": (lambda: gspo(logits, target, advantages, old, doc, delta=2.0, loss_type="sapo"),
                       r"gspo: delta \(the two-sided clip\) applies to loss_type 'ppo_clip' only, got loss_type "
                       r"'sapo' with delta = 2"),
        "linear_delta_negative": (lambda: rl_losses.linear_gspo_loss(logits, torch.randn(5, 7, device=device),
                                                                     target.clamp(max=4), advantages, old, doc,
                                                                     delta=-1.1),
                                  r"linear_gspo: delta must be > 0 .*got -1.1"),
    }
    return cases[case]


BAD_CASES = ["doc_id_too_large", "doc_index_shape", "doc_index_float", "weighting", "epsilon_low_negative",
             "epsilon_low_one", "epsilon_high_negative", "advantages_shape", "old_log_probs_shape",
             "label_counts_shape", "advantages_int", "target_shape", "scale_negative", "divisor_zero",
             "num_documents_negative", "delta_zero", "delta_infinite", "delta_sapo", "linear_delta_negative"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(case, device):
    if case == "doc_id_too_large" and device != "cpu":
        pytest.skip("document ids are range-checked on the CPU (on CUDA: RL_LOSSES_CHECK_INPUTS, tested below)")
    call, message = _bad_call(case, device)
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


@requires_cuda
def test_document_id_out_of_range_cuda_opt_in_check(monkeypatch):
    monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    call, _ = _bad_call("doc_id_too_large", "cuda")
    with pytest.raises(ValueError, match="document_index holds 1 but num_documents is 1"):
        call()


def test_label_out_of_range_cpu():
    doc = document_index_from_lengths([2, 2], 4, "cpu")
    logits, target, advantages, old = make_inputs((4,), 7, torch.float32, "cpu", doc, masked=0.0)
    target[1] = 9
    with pytest.raises(RuntimeError, match="label 9 .*out of range for vocab_size 7"):
        rl_losses.gspo_loss(logits.requires_grad_(), target, advantages, old, doc)
