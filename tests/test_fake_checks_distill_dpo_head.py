"""The fake (meta) kernels of distillation, DPO and the fused head refuse the bad inputs the C++ ops refuse, with
the same message (python/rl_losses/_checks_heads.py mirrors the C++ checks): each bad input runs on the CPU, on meta
tensors and under FakeTensorMode, and the messages are compared."""
import math

import pytest
import torch

from helpers import assert_fake_rejects_like_real, forward_options

_ops = torch.ops.rl_losses


def _distill(d, logits=None, teacher=None, **kw):
    logits = torch.randn(4, 7, device=d) if logits is None else logits
    teacher = torch.randn(4, 7, device=d) if teacher is None else teacher
    return _ops.distillation(logits, teacher, **kw)


def _distill_fwd(d, inplace=False, logits=None, **kw):
    logits = torch.randn(4, 7, device=d) if logits is None else logits
    teacher = torch.randn(logits.shape, device=d)
    if inplace:
        return _ops._distillation_forward_inplace(logits, teacher, **forward_options("distillation", **kw))
    return _ops._distillation_forward(logits, teacher, **forward_options("distillation", compute_grad=True, **kw))


def _dpo(d, pairs=None, ref_c=None, doc=None, target=None, **kw):
    logits = torch.randn(6, 9, device=d)
    target = torch.tensor([1, 2, 3, -100, 4, 5], device=d) if target is None else target
    doc = torch.tensor([0, 0, 1, 1, 2, 3], device=d) if doc is None else doc
    pairs = torch.tensor([[0, 1], [3, 2]], device=d) if pairs is None else pairs
    ref_c = torch.zeros(2, device=d) if ref_c is None else ref_c
    return _ops.dpo(logits, target, doc, pairs, ref_c, torch.zeros(2, device=d), **kw)


def _head(d, logits=None, **kw):
    logits = torch.randn(4, 7, device=d) if logits is None else logits
    return _ops.fused_head(logits, torch.tensor([1, 2, -100, 3], device=d), **kw)


def _grpo_head(d, **kw):
    t = dict(advantages=torch.zeros(4, device=d), old_log_probs=torch.zeros(4, device=d))
    t.update(kw)
    return _head(d, grpo_weight=1.0, **t)


def _gspo_head(d, **kw):
    t = dict(advantages=torch.zeros(4, device=d), document_index=torch.zeros(4, dtype=torch.long, device=d))
    t.update(kw)
    return _head(d, gspo_weight=1.0, **t)


def _distill_head(d, teacher=None, **kw):
    teacher = torch.randn(4, 7, device=d) if teacher is None else teacher
    return _head(d, **{"distillation_weight": 1.0, "teacher_logits": teacher, **kw})


def _bad_inputs():
    """(name, call(device), expected message fragment)."""
    long = dict(dtype=torch.long)
    return [
        # distillation
        ("distill_int_logits", lambda d: _distill(d, logits=torch.zeros(4, 7, device=d, **long)),
         "distillation: logits must be a floating-point tensor"),
        ("distill_int_teacher", lambda d: _distill(d, teacher=torch.zeros(4, 7, device=d, **long)),
         "distillation: teacher_logits must be a floating-point tensor"),
        ("distill_0dim", lambda d: _distill(d, logits=torch.zeros((), device=d), teacher=torch.zeros((), device=d)),
         "at least 1 dimension"),
        ("distill_empty_vocab", lambda d: _distill(d, logits=torch.zeros(4, 0, device=d)),
         "empty vocabulary dimension"),
        ("distill_stride", lambda d: _distill(d, logits=torch.randn(7, 4, device=d).t()), "unit stride"),
        ("distill_vocab_mismatch", lambda d: _distill(d, teacher=torch.randn(4, 8, device=d)),
         r"teacher_logits has shape \[4, 8\] but logits has shape \[4, 7\] \(the vocabularies differ\)"),
        ("distill_rows_mismatch", lambda d: _distill(d, teacher=torch.randn(3, 7, device=d)),
         r"teacher_logits has shape \[3, 7\] but logits has shape \[4, 7\]$"),
        ("distill_beta_high", lambda d: _distill(d, kind="jsd", beta=1.5), r"beta must be in \[0, 1\], got 1.5"),
        ("distill_beta_nan", lambda d: _distill(d, kind="jsd", beta=math.nan), r"beta must be in \[0, 1\]"),
        ("distill_temperature_0", lambda d: _distill(d, temperature=0.0), "temperature must be finite and > 0, got 0"),
        ("distill_temperature_neg", lambda d: _distill(d, temperature=-2.5), "temperature must be finite and > 0"),
        ("distill_temperature_inf", lambda d: _distill(d, temperature=math.inf), "got inf"),
        ("distill_scale", lambda d: _distill(d, logits_scale_factor=0.0), "logits_scale_factor must be finite"),
        ("distill_divisor", lambda d: _distill(d, divisor=-1.0), "divisor must be finite and > 0, got -1"),
        ("distill_kind", lambda d: _distill(d, kind="kl"), "kind must be 'forward_kl'"),
        ("distill_mask_dtype", lambda d: _distill(d, loss_mask=torch.ones(4, device=d)),
         "loss_mask must be a bool or integer tensor, got Float"),
        ("distill_mask_shape", lambda d: _distill(d, loss_mask=torch.ones(3, dtype=torch.bool, device=d)),
         r"loss_mask has shape \[3\] but logits has batch shape \[4\]"),
        ("distill_row_stats", lambda d: _distill(d, row_stats=torch.zeros(4, 5, device=d)),
         r"row_stats must hold \(4, 7\) values"),
        ("distill_row_stats_dtype", lambda d: _distill(d, row_stats=torch.zeros(4, 7, device=d, dtype=torch.float64)),
         "row_stats must be Float"),
        ("distill_jsd_sums_alone", lambda d: _distill(d, kind="jsd", jsd_sums=torch.zeros(4, 2, device=d)),
         "jsd_sums needs row_stats"),
        ("distill_jsd_sums_shape", lambda d: _distill(d, kind="jsd", row_stats=torch.zeros(4, 7, device=d),
                                                      jsd_sums=torch.zeros(4, 3, device=d)),
         r"jsd_sums must hold \(4, 2\) values"),
        ("distill_fwd_beta", lambda d: _distill_fwd(d, kind="jsd", beta=-0.5), r"beta must be in \[0, 1\]"),
        ("distill_inplace_view", lambda d: _distill_fwd(d, inplace=True, logits=torch.randn(2, 2, 7, device=d)
                                                        .transpose(0, 1)),
         "inplace_backward needs logits whose batch dimensions flatten to one row stride"),
        ("distill_stats_temperature", lambda d: _ops.distillation_stats(torch.randn(4, 7, device=d),
                                                                        torch.randn(4, 7, device=d),
                                                                        temperature=0.0),
         "temperature must be finite and > 0"),
        ("distill_jsd_sums_beta", lambda d: _ops.distillation_jsd_sums(torch.randn(4, 7, device=d),
                                                                       torch.randn(4, 7, device=d),
                                                                       torch.zeros(4, 7, device=d), beta=0.0),
         "the JSD sums need 0 < beta < 1, got 0"),
        ("distill_jsd_sums_stats", lambda d: _ops.distillation_jsd_sums(torch.randn(4, 7, device=d),
                                                                        torch.randn(4, 7, device=d),
                                                                        torch.zeros(4, 6, device=d)),
         r"row_stats must hold \(4, 7\) values"),
        # DPO
        ("dpo_int_logits", lambda d: _ops.dpo(torch.zeros(6, 9, dtype=torch.long, device=d),
                                              torch.zeros(6, dtype=torch.long, device=d),
                                              torch.zeros(6, dtype=torch.long, device=d),
                                              torch.tensor([[0, 1]], device=d), torch.zeros(1, device=d),
                                              torch.zeros(1, device=d)),
         "dpo: logits must be a floating-point tensor"),
        ("dpo_target_shape", lambda d: _dpo(d, target=torch.zeros(5, dtype=torch.long, device=d)),
         "dpo: target has shape"),
        ("dpo_beta", lambda d: _dpo(d, beta=0.0), "beta must be finite and > 0, got 0"),
        ("dpo_scale", lambda d: _dpo(d, logits_scale_factor=-1.0), "logits_scale_factor must be finite"),
        ("dpo_divisor", lambda d: _dpo(d, divisor=0.0), "divisor must be finite and > 0"),
        ("dpo_pairs_dtype", lambda d: _dpo(d, pairs=torch.zeros(2, 2, device=d)),
         "pairs must be an integer tensor of \\(chosen, rejected\\) document ids, got Float"),
        ("dpo_pairs_shape", lambda d: _dpo(d, pairs=torch.tensor([0, 1, 2, 3], device=d)),
         r"pairs must have shape \(num_pairs, 2\), got \[4\]"),
        ("dpo_no_pairs", lambda d: _dpo(d, pairs=torch.zeros(0, 2, dtype=torch.long, device=d),
                                        doc=torch.full((6,), -1, device=d)),
         "pairs is empty"),
        ("dpo_ref_shape", lambda d: _dpo(d, ref_c=torch.zeros(3, device=d)),
         r"reference_chosen_log_probs must have shape \(2,\) \(one value per pair\), got \[3\]"),
        ("dpo_ref_dtype", lambda d: _dpo(d, ref_c=torch.zeros(2, dtype=torch.long, device=d)),
         "reference_chosen_log_probs must be a floating-point tensor"),
        ("dpo_doc_dtype", lambda d: _dpo(d, doc=torch.zeros(6, device=d)), "document_index must be an integer"),
        ("dpo_doc_shape", lambda d: _dpo(d, doc=torch.zeros(5, dtype=torch.long, device=d)),
         r"document_index has shape \[5\] but target has shape \[6\]"),
        ("dpo_row_stats", lambda d: _dpo(d, row_stats=torch.zeros(6, 4, device=d)),
         r"row_stats must have shape \(6, 5\), got \[6, 4\]"),
        ("dpo_vocab_size", lambda d: _dpo(d, vocab_start=4, vocab_size=10), "vocab_size 10 is smaller than"),
        # the fused head
        ("head_row_stats", lambda d: _head(d, row_stats=torch.zeros(4, 5, dtype=torch.float64, device=d)),
         "row_stats must be float32"),
        ("head_vocab_start", lambda d: _head(d, vocab_start=-1), "vocab_start must be >= 0"),
        ("head_int_logits", lambda d: _head(d, logits=torch.zeros(4, 7, dtype=torch.long, device=d)),
         "fused_head: logits must be a floating-point tensor"),
        ("head_scale", lambda d: _head(d, logits_scale_factor=math.nan), "logits_scale_factor must be finite"),
        ("head_label_weight", lambda d: _head(d, label_weight=-1.0), "label_weight must be finite and >= 0, got -1"),
        ("head_z_weight", lambda d: _head(d, z_loss_weight=math.inf), "z_loss_weight must be finite and >= 0"),
        ("head_smoothing", lambda d: _head(d, label_weight=1.0, label_smoothing=1.0),
         r"label_smoothing must be in \[0, 1\), got 1"),
        ("head_divisor", lambda d: _head(d, label_weight=1.0, z_loss_divisor=0.0), "divisor must be finite and > 0"),
        ("head_grpo_inputs", lambda d: _head(d, grpo_weight=2.0),
         "grpo_weight = 2 > 0 needs advantages and old_log_probs"),
        ("head_epsilon", lambda d: _grpo_head(d, epsilon_low=1.0), r"epsilon_low must be in \[0, 1\)"),
        ("head_bypass", lambda d: _grpo_head(d, bypass_mode=True), "bypass_mode .* is grpo_loss's and gspo_loss's, "
         "not the fused head's"),
        ("head_delta", lambda d: _grpo_head(d, delta=-1.0),
         r"delta must be > 0 \(it caps the ratio .* delta > 1 \+ epsilon_high = 1.2\), got -1"),
        ("head_beta", lambda d: _grpo_head(d, beta=0.1), "beta = 0.1 > 0 needs ref_log_probs"),
        ("head_beta_neg", lambda d: _grpo_head(d, beta=-0.1), "beta must be >= 0"),
        ("head_adv_shape", lambda d: _grpo_head(d, advantages=torch.zeros(3, device=d)),
         r"advantages has shape \[3\] but target has shape \[4\]"),
        ("head_old_dtype", lambda d: _grpo_head(d, old_log_probs=torch.zeros(4, dtype=torch.long, device=d)),
         "old_log_probs must be a floating-point tensor, got Long"),
        ("head_weights_shape", lambda d: _grpo_head(d, loss_weights=torch.zeros(2, 2, device=d)),
         "loss_weights has shape"),
        ("head_both_policy_terms", lambda d: _head(d, grpo_weight=1.0, gspo_weight=1.0), "are both > 0"),
        ("head_gspo_inputs", lambda d: _head(d, gspo_weight=1.0),
         "gspo_weight = 1 > 0 needs advantages and document_index"),
        ("head_gspo_delta", lambda d: _gspo_head(d, delta=2.0), "delta is the GRPO term's two-sided clip"),
        ("head_gspo_weights", lambda d: _gspo_head(d, loss_weights=torch.zeros(4, device=d)),
         "loss_weights weigh the GRPO term's tokens"),
        # the policy terms' options (more in test_fused_head_policy.py)
        ("head_vespo", lambda d: _gspo_head(d, loss_type="vespo"), "loss_type 'vespo' weighs a sequence with "
         r"vespo_k_\* and vespo_lambda_\*, options of grpo_loss and gspo_loss, not of the fused head"),
        ("head_grpo_per_token", lambda d: _grpo_head(d, loss_type="clip_cov"), "the GRPO term takes the per-token "
         "options; rollout_correction 'None' with loss_type 'clip_cov' needs a sequence's or the batch's"),
        ("head_grpo_rollout_shape", lambda d: _grpo_head(d, rollout_correction="token_truncate",
                                                         rollout_log_probs=torch.zeros(3, device=d)),
         r"rollout_log_probs has shape \[3\] but target has shape \[4\]"),
        ("head_z_mask_dtype", lambda d: _head(d, z_loss_weight=1.0, z_loss_mask=torch.ones(4, device=d)),
         "z_loss_mask must be a bool or integer tensor, got Float"),
        ("head_z_mask_shape", lambda d: _head(d, z_loss_weight=1.0, z_loss_mask=torch.ones(5, dtype=torch.bool,
                                                                                           device=d)),
         r"z_loss_mask must have the target's shape \[4\] and device cpu, got \[5\] on cpu"),
        # the distillation term
        ("head_distill_weight", lambda d: _distill_head(d, distillation_weight=float("nan")),
         "fused_head: distillation_weight must be finite and >= 0, got nan"),
        ("head_distill_no_teacher", lambda d: _head(d, distillation_weight=1.0),
         "fused_head: distillation_weight = 1 > 0 needs teacher_logits"),
        ("head_distill_gspo", lambda d: _gspo_head(d, distillation_weight=1.0,
                                                   teacher_logits=torch.randn(4, 7, device=d)),
         "fused_head: distillation_weight = 1 and gspo_weight = 1 are both > 0"),
        ("head_distill_tp", lambda d: _distill_head(d, row_stats=torch.zeros(4, 5, device=d)),
         r"fused_head: distillation_weight = 1 > 0 runs without tensor parallelism \(row_stats given\)"),
        ("head_distill_divisor", lambda d: _distill_head(d, distillation_divisor=0.0),
         "fused_head: divisor must be finite and > 0, got 0"),
        ("head_distill_teacher_shape", lambda d: _distill_head(d, teacher=torch.randn(4, 8, device=d)),
         r"fused_head: teacher_logits has shape \[4, 8\] but logits has shape \[4, 7\] \(the vocabularies differ\)"),
        ("head_distill_teacher_dtype",
         lambda d: _distill_head(d, teacher=torch.zeros(4, 7, dtype=torch.long, device=d)),
         "fused_head: teacher_logits must be a floating-point tensor"),
        ("head_distill_beta", lambda d: _distill_head(d, kind="jsd", distillation_beta=-0.5),
         r"fused_head: distillation_beta must be in \[0, 1\], got -0.5"),
        ("head_distill_temperature", lambda d: _distill_head(d, temperature=0.0),
         "fused_head: temperature must be finite and > 0, got 0"),
        ("head_distill_kind", lambda d: _distill_head(d, kind="tvd"),
         "fused_head: kind must be 'forward_kl', 'reverse_kl', 'cross_entropy' or 'jsd', got 'tvd'"),
        ("head_distill_mask_dtype", lambda d: _distill_head(d, distillation_mask=torch.ones(4, device=d)),
         "fused_head: distillation_mask must be a bool or integer tensor"),
        ("head_distill_mask_shape", lambda d: _distill_head(d, distillation_mask=torch.ones(5, dtype=torch.bool,
                                                                                                device=d)),
         r"fused_head: distillation_mask has shape \[5\] but logits has batch shape \[4\]"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_fake_and_real_reject_alike(name, call, message):
    assert_fake_rejects_like_real(call, message)


@pytest.mark.parametrize("call", [
    lambda d: _distill(d, kind="jsd", beta=0.3, loss_mask=torch.ones(4, dtype=torch.bool, device=d)),
    lambda d: _dpo(d, beta=0.5, divisor=2.0),
    lambda d: _grpo_head(d, label_weight=1.0, z_loss_weight=0.5, z_loss_mask=torch.ones(4, dtype=torch.long,
                                                                                        device=d)),
    lambda d: _distill_head(d, label_weight=1.0, kind="jsd", distillation_beta=0.3,
                            distillation_mask=torch.ones(4, dtype=torch.bool, device=d)),
], ids=["distillation", "dpo", "head", "head_distillation"])
def test_fake_accepts_what_the_real_op_accepts(call):
    real = call("cpu")
    fake = call("meta")
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        assert (f is None) == (r is None), (f, r)  # the fused head's terms of weight 0
        assert r is None or (f.shape == r.shape and f.dtype == r.dtype), (f, r)
