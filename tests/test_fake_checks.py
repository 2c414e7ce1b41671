"""The fake (meta) kernels check what the real ops check (python/rl_losses/_checks.py mirrors csrc/): every bad input
here runs on the CPU (the real kernel), on meta tensors and under FakeTensorMode, with the same message; and every
TORCH_CHECK of csrc/ has such an input (here or in test_fake_checks_distill_dpo_head.py) or sits on the short list of
checks no fake kernel can make (NOT_FAKE: data, two devices, autograd, internal errors)."""
import math
import pathlib
import re

import pytest
import torch

from helpers import assert_fake_rejects_like_real, forward_options
from test_fake_checks_distill_dpo_head import BAD_INPUTS as HEAD_BAD_INPUTS
from test_topk_distillation import BAD_INPUTS as TOPK_BAD_INPUTS
from test_sampler import BAD_INPUTS as SAMPLER_BAD_INPUTS
from test_scatter_rows import BAD_INPUTS as SCATTER_ROWS_BAD_INPUTS

ops = torch.ops.rl_losses
CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"


def _z(d, *shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=d)


def _labels(d, n=4):
    return torch.zeros(n, dtype=torch.long, device=d)


def ce(d, logits=None, target=None, **kw):
    logits = torch.randn(4, 7, device=d) if logits is None else logits
    return ops.cross_entropy(logits, _labels(d, logits.shape[0]) if target is None else target, **kw)


def ce_inplace(d, logits):
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=d)
    return ops._cross_entropy_forward_inplace(logits, target, **forward_options("cross_entropy"))


def grpo(d, adv=None, **kw):
    return ops.grpo(torch.randn(4, 7, device=d), _labels(d), _z(d, 4) if adv is None else adv, _z(d, 4), **kw)


def gspo(d, doc=None, adv=None, **kw):
    doc = _labels(d) if doc is None else doc
    return ops.gspo(torch.randn(4, 7, device=d), _labels(d), _z(d, 4) if adv is None else adv, _z(d, 4), doc, **kw)


def rollout(d, **kw):
    return grpo(d, rollout_log_probs=_z(d, 4), **kw)


def lin(d, hidden=None, weight=None, **kw):
    hidden = torch.randn(4, 5, device=d) if hidden is None else hidden
    weight = torch.randn(7, 5, device=d) if weight is None else weight
    return ops.linear_cross_entropy(hidden, weight, _labels(d, hidden.shape[0] if hidden.dim() else 4), **kw)


def lin_grad(d, **kw):
    args = forward_options("linear_cross_entropy", output_mask=[True, False, False], **kw)
    return ops._linear_cross_entropy_forward(torch.randn(4, 5, device=d), torch.randn(7, 5, device=d), _labels(d),
                                             **args)


def sums(d, **kw):
    t = _labels(d)
    return ops.gspo_document_sums(_z(d, 4), t, _z(d, 4), _z(d, 4), t, torch.ones(4, device=d), 1, **kw)


def token(d, log_probs=None, **kw):
    lp = _z(d, 4) if log_probs is None else log_probs
    return ops.policy_token_loss(lp, _z(d, 4), _z(d, 4), **kw)


def _bad_inputs():
    """(name, call(device), expected message fragment): bad inputs the real kernels reject without their data."""
    long = dict(dtype=torch.long)
    return [
        # the labels and the logits (common/checks.cpp)
        ("int_logits", lambda d: ce(d, logits=_z(d, 4, 7, **long)), "logits must be a floating-point tensor"),
        ("0dim_logits", lambda d: ce(d, logits=_z(d), target=_z(d, dtype=torch.long)),
         "logits must have at least 1 dimension"),
        ("float_target", lambda d: ce(d, target=_z(d, 4)), "target must be an integer tensor"),
        ("short_target", lambda d: ce(d, target=_z(d, 4, dtype=torch.int16)), "target must be int32 or int64, got Short"),
        ("target_shape", lambda d: ce(d, target=_labels(d, 3)), r"target has shape \[3\] but logits has batch shape"),
        ("vocab_stride", lambda d: ce(d, logits=torch.randn(7, 4, device=d).t()), "unit stride"),
        ("empty_vocab", lambda d: ce(d, logits=_z(d, 4, 0)), "logits has an empty vocabulary dimension"),
        ("vocab_start", lambda d: ce(d, vocab_start=-1), "vocab_start must be >= 0, got -1"),
        ("vocab_size", lambda d: ce(d, vocab_start=4, vocab_size=10), "vocab_size 10 is smaller than"),
        ("row_stats_shape", lambda d: ce(d, row_stats=_z(d, 4, 4)), r"row_stats must have shape \(4, 5\)"),
        ("row_stats_dtype", lambda d: ce(d, row_stats=_z(d, 4, 5, dtype=torch.float64)), "row_stats must be float32"),
        ("row_stats_layout", lambda d: ce(d, row_stats=_z(d, 5, 4).t()), "row_stats must be contiguous"),
        ("scale", lambda d: ce(d, logits_scale_factor=0.0), "logits_scale_factor must be finite and > 0, got 0"),
        ("inplace_flatten", lambda d: ce_inplace(d, torch.randn(2, 2, 7, device=d).transpose(0, 1)),
         "inplace_backward needs logits whose batch dimensions flatten to one row stride"),
        ("inplace_overlap", lambda d: ce_inplace(d, torch.randn(7, device=d).expand(4, 7)),
         "inplace_backward needs logits whose rows do not overlap in memory"),
        # cross-entropy
        ("reduction", lambda d: ce(d, reduction="avg"), "reduction must be"),
        ("label_smoothing", lambda d: ce(d, label_smoothing=1.0), r"label_smoothing must be in \[0, 1\), got 1"),
        ("z_loss_factor", lambda d: ce(d, z_loss_factor=-1.0), "z_loss_factor must be >= 0, got -1"),
        ("label_weight", lambda d: ce(d, label_weight=-1.0), "label_weight must be finite"),
        ("divisor_none", lambda d: ce(d, reduction="none", divisor=2.0), "divisor has no meaning"),
        ("linear_none_grad", lambda d: lin_grad(d, reduction="none"), "reduction='none' cannot be differentiated"),
        # the fused lm_head (linear/linear_source.cpp)
        ("int_hidden", lambda d: lin(d, hidden=_z(d, 4, 5, **long)), "hidden must be a floating-point tensor"),
        ("0dim_hidden", lambda d: lin(d, hidden=_z(d)), "hidden must have at least 1 dimension"),
        ("weight_dim", lambda d: lin(d, weight=torch.randn(7, device=d)), "weight must be a 2-D"),
        ("weight_hidden_size", lambda d: lin(d, weight=torch.randn(7, 6, device=d)), "weight has hidden size 6"),
        ("weight_dtype", lambda d: lin(d, weight=torch.randn(7, 5, device=d, dtype=torch.float64)),
         "weight is Double but hidden is Float"),
        ("weight_empty", lambda d: lin(d, weight=_z(d, 0, 5)), "weight has an empty vocabulary dimension"),
        ("bias_shape", lambda d: lin(d, bias=_z(d, 6)), r"bias must have shape \(7,\), got \[6\]"),
        ("bias_dtype", lambda d: lin(d, bias=_z(d, 7, dtype=torch.float64)), "bias must be Float on"),
        ("chunk_size", lambda d: lin(d, chunk_size=0), "chunk_size must be >= 1"),
        ("strategy", lambda d: lin(d, strategy="small"), "strategy must be 'fast' or 'lean', got 'small'"),
        ("head_dtype", lambda d: lin(d, head_dtype="bfloat16"),
         "head_dtype must be 'weight' or 'float32', got 'bfloat16'"),
        ("main_grad_dtype", lambda d: lin(d, weight_main_grad=_z(d, 7, 5, dtype=torch.float64)),
         r"weight_main_grad must be Float \(the accumulation dtype of a Float weight\), got Double"),
        ("main_grad_shape", lambda d: lin(d, weight_main_grad=_z(d, 7, 4)),
         r"weight_main_grad must have the weight's shape \[7, 5\], got \[7, 4\]"),
        ("main_grad_layout", lambda d: lin(d, weight_main_grad=_z(d, 5, 7).t()), "weight_main_grad must be contiguous"),
        # the clipped objective and the per-token inputs (grpo)
        ("epsilon_low", lambda d: grpo(d, epsilon_low=1.0), r"epsilon_low must be in \[0, 1\), got 1"),
        ("epsilon_high", lambda d: grpo(d, epsilon_high=math.inf), "epsilon_high must be finite"),
        ("delta_inf", lambda d: grpo(d, delta=math.inf), r"delta must be finite \(leave it unset for no cap\)"),
        ("delta", lambda d: grpo(d, delta=0.0), r"delta must be > 0 \(it caps the ratio .*\), got 0"),
        ("beta_negative", lambda d: grpo(d, beta=-1.0), "beta must be >= 0, got -1"),
        ("beta", lambda d: grpo(d, beta=0.1), "beta = 0.1 > 0 needs ref_log_probs"),
        ("divisor", lambda d: grpo(d, divisor=-1.0), "divisor must be finite and > 0, got -1"),
        ("advantages_shape", lambda d: grpo(d, adv=_z(d, 5)), "advantages has shape"),
        ("advantages_dtype", lambda d: grpo(d, adv=_z(d, 4, **long)), "advantages must be a floating-point tensor"),
        ("ref_shape_beta_0", lambda d: grpo(d, ref_log_probs=_z(d, 5)), r"ref_log_probs has shape \[5\]"),
        ("label_counts", lambda d: grpo(d, label_counts=_z(d, 5)), "label_counts must have the target's shape"),
        ("grpo_document_index", lambda d: grpo(d, document_index=_labels(d)),
         "document_index groups the tokens of a sequence-level rollout_correction, of loss_type 'vespo', of a "
         "sequence rollout_rs mode or of a sequence aggregation"),
        ("grpo_num_documents", lambda d: grpo(d, num_documents=2), "num_documents = 2 counts the ids of document_index"),
        ("vespo_document_index", lambda d: grpo(d, loss_type="vespo", document_index=_z(d, 4)),
         "document_index must be an integer tensor shaped like target"),
        ("vespo_sequences", lambda d: grpo(d, loss_type="vespo"), "loss_type 'vespo' needs the sequences"),
        # the policy family (common/policy.cpp)
        ("loss_type", lambda d: grpo(d, loss_type="ppo"),
         "loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', 'dro', 'dppo_tv', 'dppo_kl', 'geo_mean', "
         "'clip_cov' or 'kl_cov'"),
        ("grpo_geo_mean", lambda d: grpo(d, loss_type="geo_mean"),
         "grpo: loss_type 'geo_mean' takes the geometric mean of a sequence's clipped ratios: use gspo"),
        ("dro_no_beta", lambda d: grpo(d, loss_type="dro"), r"loss_type 'dro' needs dro_beta \(verl's"),
        ("dro_beta_other", lambda d: grpo(d, loss_type="gpg", dro_beta=0.5),
         "dro_beta applies to loss_type 'dro' only, got loss_type 'gpg' with dro_beta = 0.5"),
        ("dro_beta_value", lambda d: grpo(d, loss_type="dro", dro_beta=0.0),
         "dro_beta must be a finite value > 0, got 0"),
        ("clip_ratio_c", lambda d: grpo(d, loss_type="dppo_tv", clip_ratio_c=-1.0),
         r"clip_ratio_c \(dppo_tv's and dppo_kl's cap of the ratio\) must be a finite value > 0, got -1"),
        ("clip_cov_ratio", lambda d: grpo(d, loss_type="clip_cov", clip_cov_ratio=0.0),
         r"clip_cov_ratio \(clip_cov's share of the tokens\) must be a finite value > 0, got 0"),
        ("clip_cov_band", lambda d: token(d, loss_type="clip_cov", clip_cov_lb=2.0, clip_cov_ub=1.5),
         r"policy_token_loss: clip_cov_lb < clip_cov_ub must hold \(clip_cov's band of the covariance\), got 2 "
         r"and 1.5"),
        ("kl_cov_ratio", lambda d: grpo(d, loss_type="kl_cov", kl_cov_ratio=1.5),
         r"kl_cov_ratio \(kl_cov's share of the tokens\) must be in \(0, 1\], got 1.5"),
        ("ppo_kl_coef", lambda d: grpo(d, loss_type="kl_cov", ppo_kl_coef=math.inf),
         r"ppo_kl_coef \(kl_cov's penalty\) must be finite, got inf"),
        ("gspo_clip_cov", lambda d: gspo(d, loss_type="clip_cov", num_documents=1),
         "gspo: loss_type 'clip_cov' weighs each token's own log-prob ratio, not a sequence's"),
        ("delta_clip_cov", lambda d: grpo(d, loss_type="clip_cov", delta=2.0), "applies to loss_type 'ppo_clip' only"),
        ("delta_sapo", lambda d: grpo(d, loss_type="sapo", delta=2.0), "applies to loss_type 'ppo_clip' only"),
        ("cispo_cap", lambda d: grpo(d, loss_type="cispo", epsilon_high=0.0), "loss_type 'cispo' caps the ratio"),
        ("sapo_temperature", lambda d: grpo(d, sapo_temperature_pos=0.0), "sapo_temperature_pos must be a finite"),
        ("vespo_k", lambda d: grpo(d, vespo_k_pos=math.inf), "vespo_k_pos must be finite, got inf"),
        ("vespo_lambda", lambda d: grpo(d, vespo_lambda_neg=-1.0), "vespo_lambda_neg must be a finite value >= 0"),
        ("kl_estimator", lambda d: grpo(d, kl_estimator="k4"), "kl_estimator must be 'k1', 'k2' or 'k3'"),
        ("rollout_mode", lambda d: rollout(d, rollout_correction="both"), "rollout_correction must be None, 'token_"),
        ("rollout_tensor", lambda d: grpo(d, rollout_correction="token_mask"), "needs rollout_log_probs"),
        ("rollout_cap", lambda d: rollout(d, rollout_correction="token_truncate", rollout_cap=0.0),
         "rollout_cap must be a finite value > 0"),
        ("rollout_bounds_truncate", lambda d: rollout(d, rollout_correction="token_truncate",
                                                      rollout_mask_bounds=[0.5, 2.0]),
         r"rollout_mask_bounds apply to the '\*_mask' modes"),
        ("rollout_bounds_length", lambda d: rollout(d, rollout_correction="token_mask", rollout_mask_bounds=[1.0]),
         r"rollout_mask_bounds must be \(lo, hi\), got 1 values"),
        ("rollout_bounds_order", lambda d: rollout(d, rollout_correction="token_mask", rollout_mask_bounds=[2.0, 1.0]),
         "rollout_mask_bounds must satisfy lo < hi"),
        ("rollout_without_mode", lambda d: rollout(d), "rollout_log_probs given without rollout_correction .*, "
         "rollout_rs or bypass_mode"),
        ("bounds_without_mode", lambda d: grpo(d, rollout_mask_bounds=[0.5, 2.0]),
         r"rollout_mask_bounds given without a '\*_mask' rollout_correction"),
        ("entropy_coefficient", lambda d: grpo(d, entropy_coefficient=math.nan), "entropy_coefficient must be finite"),
        # verl's rollout rejection (common/policy_rejection.cpp) and grpo's aggregation
        ("rs_mode", lambda d: rollout(d, rollout_rs="token_k4", rollout_rs_threshold="2"),
         "rollout_rs mode 'token_k4' is not one of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3"),
        ("rs_empty", lambda d: rollout(d, rollout_rs=" , ", rollout_rs_threshold="2"),
         "rollout_rs must name at least one mode, got ' , '"),
        ("rs_no_threshold", lambda d: rollout(d, rollout_rs="token_k2"), "rollout_rs = 'token_k2' needs "
         "rollout_rs_threshold"),
        ("rs_threshold_alone", lambda d: grpo(d, rollout_rs_threshold="2"),
         "rollout_rs_threshold = '2' given without rollout_rs"),
        ("rs_no_rollout", lambda d: grpo(d, rollout_rs="token_k2", rollout_rs_threshold="2"),
         "rollout_rs = 'token_k2' needs rollout_log_probs"),
        ("rs_on_policy", lambda d: ops.grpo(torch.randn(4, 7, device=d), _labels(d), _z(d, 4), None,
                                            rollout_log_probs=_z(d, 4), rollout_rs="token_k2",
                                            rollout_rs_threshold="2"),
         r"rollout_rs = 'token_k2' needs old_log_probs \(it judges old against rollout\), or bypass_mode = True"),
        ("bypass_no_rollout", lambda d: grpo(d, bypass_mode=True, rollout_rs="token_k2", rollout_rs_threshold="2"),
         r"bypass_mode needs rollout_log_probs \(the old side of the ratio"),
        ("bypass_correction", lambda d: rollout(d, bypass_mode=True, rollout_correction="token_truncate"),
         r"bypass_mode takes no rollout_correction \(old is the rollout.*got 'token_truncate'"),
        ("gspo_bypass_no_rollout", lambda d: gspo(d, bypass_mode=True), "bypass_mode needs rollout_log_probs"),
        ("rs_count", lambda d: rollout(d, rollout_rs="token_k2,seq_sum_k3", rollout_rs_threshold="1,2,3"),
         r"rollout_rs_threshold = '1,2,3' must hold one threshold for all modes or one per mode \(2 in"),
        ("rs_number", lambda d: rollout(d, rollout_rs="token_k2", rollout_rs_threshold="two"),
         "rollout_rs_threshold 'two' for rollout_rs mode 'token_k2' is not a number"),
        # The numbers' grammar is the op's own on both sides (Python's float() would take "1_2" and "0x" would be
        # C's): a decimal number or "inf".
        ("rs_number_underscore", lambda d: rollout(d, rollout_rs="token_k1", rollout_rs_threshold="0.5_1_2"),
         "rollout_rs_threshold '0.5_1_2' for rollout_rs mode 'token_k1' is not a number"),
        ("rs_number_hex", lambda d: rollout(d, rollout_rs="token_k2", rollout_rs_threshold="0x1p-1"),
         "rollout_rs_threshold '0x1p-1' for rollout_rs mode 'token_k2' is not a number"),
        ("rs_k1_positive", lambda d: rollout(d, rollout_rs="seq_sum_k1", rollout_rs_threshold="0_2"),
         "rollout_rs_threshold '0_2' for mode 'seq_sum_k1' must be positive ratio bounds, got lower 0 and upper 2"),
        ("rs_k1_order", lambda d: rollout(d, rollout_rs="token_k1", rollout_rs_threshold="1.5_0.5"),
         "rollout_rs_threshold '1.5_0.5' for mode 'token_k1' must be ordered, lower <= upper, got lower 1.5 and "
         "upper 0.5"),
        ("rs_k3_pair", lambda d: rollout(d, rollout_rs="seq_max_k3", rollout_rs_threshold="0.1_2"),
         r"rollout_rs_threshold '0.1_2' for mode 'seq_max_k3' takes one upper bound \(no '_'"),
        ("rs_k2_positive", lambda d: rollout(d, rollout_rs="token_k2", rollout_rs_threshold="-1"),
         "rollout_rs_threshold '-1' for mode 'token_k2' must be positive, got -1"),
        ("rs_vespo", lambda d: rollout(d, loss_type="vespo", rollout_rs="token_k2", rollout_rs_threshold="2"),
         "grpo: rollout_rs does not apply to loss_type 'vespo'"),
        ("rs_sequences", lambda d: rollout(d, rollout_rs="seq_mean_k2", rollout_rs_threshold="2"),
         r"rollout_rs \(its sequence modes, or label_counts recounted\) needs the sequences"),
        ("rs_document_sums", lambda d: gspo(d, rollout_log_probs=_z(d, 4), rollout_rs="token_k2",
                                            rollout_rs_threshold="2", document_sums=_z(d, 1, 6)),
         r"gspo: rollout_rs with document_sums \(sequences split over ranks\) is not fused"),
        ("aggregation", lambda d: grpo(d, aggregation="seq-mean-token-mean"),
         "aggregation must be None, 'token_mean', 'sequence_mean_token_mean', 'sequence_sum_constant' or 'luspo', "
         "got 'seq-mean-token-mean'"),
        ("aggregation_sequences", lambda d: grpo(d, aggregation="luspo"), "a sequence aggregation needs the sequences"),
        ("aggregation_constant", lambda d: grpo(d, aggregation="sequence_sum_constant", document_index=_labels(d)),
         r"aggregation 'sequence_sum_constant' over document_index needs divisor \(B·max_completion_length\)"),
        # GSPO
        ("weighting", lambda d: gspo(d, weighting="sequence", num_documents=1), "weighting must be"),
        ("float_doc", lambda d: gspo(d, doc=_z(d, 4), num_documents=1), "document_index must be an integer tensor"),
        ("doc_shape", lambda d: gspo(d, doc=_labels(d, 5), num_documents=1),
         r"document_index has shape \[5\] but target has shape \[4\]"),
        ("num_documents", lambda d: gspo(d, num_documents=2**40), r"num_documents must be in \[0, 2147483648\]"),
        ("gspo_delta", lambda d: gspo(d, delta=-0.5, num_documents=1), r"delta must be > 0 .*got -0.5"),
        ("gspo_delta_sapo", lambda d: gspo(d, delta=2.0, loss_type="sapo", num_documents=1), "applies to loss_type"),
        ("gspo_beta", lambda d: gspo(d, beta=0.1, num_documents=1), "beta = 0.1 > 0 needs ref_log_probs"),
        ("gspo_gpg", lambda d: gspo(d, loss_type="gpg", num_documents=1),
         "gspo: loss_type 'gpg' weighs each token's own log-prob ratio, not a sequence's: use grpo"),
        ("sums_dppo", lambda d: sums(d, loss_type="dppo_kl"), "gspo_document_sums: loss_type 'dppo_kl' weighs each"),
        ("geo_mean_token_advantages", lambda d: gspo(d, loss_type="geo_mean", token_advantages=True, num_documents=1),
         "gspo: loss_type 'geo_mean' takes its document's mean advantage, got token_advantages = True"),
        ("geo_mean_rollout", lambda d: gspo(d, loss_type="geo_mean", rollout_correction="token_mask",
                                            rollout_log_probs=_z(d, 4), num_documents=1),
         "gspo: loss_type 'geo_mean' takes no rollout_correction, got 'token_mask'"),
        ("sums_epsilon", lambda d: sums(d, epsilon_low=1.5), r"gspo_document_sums: epsilon_low must be in \[0, 1\)"),
        ("gspo_ref_shape", lambda d: gspo(d, ref_log_probs=_z(d, 5), num_documents=1), "ref_log_probs has shape"),
        ("gspo_advantages", lambda d: gspo(d, adv=_z(d, 2, 2), num_documents=1), "advantages has shape"),
        ("document_sums", lambda d: gspo(d, document_sums=_z(d, 1, 4)), r"document_sums must be \(1, 6\) Float"),
        ("sums_beta", lambda d: sums(d, beta=-1.0), "gspo_document_sums: beta must be >= 0"),
        ("sums_advantages", lambda d: ops.gspo_document_sums(_z(d, 4), _labels(d), _z(d, 1), None, _labels(d),
                                                             torch.ones(4, device=d), 1),
         r"gspo_document_sums: advantages has shape \[1\]"),
        # policy_token_loss
        ("token_int", lambda d: token(d, log_probs=_z(d, 4, **long)), "log_probs must be a floating-point tensor"),
        ("token_vespo", lambda d: token(d, loss_type="vespo"),
         "loss_type 'vespo' weighs a token by the rest of its sequence, which only the fused ops"),
        ("token_sequence", lambda d: token(d, rollout_log_probs=_z(d, 4), rollout_correction="sequence_mask"),
         "rollout_correction must be None, 'token_truncate' or 'token_mask'"),
        ("token_beta", lambda d: token(d, beta=0.5), "policy_token_loss: beta = 0.5 > 0 needs ref_log_probs"),
        ("token_mask_dtype", lambda d: token(d, loss_mask=_z(d, 4)), "loss_mask must be a bool or integer tensor"),
        ("token_mask_shape", lambda d: token(d, loss_mask=_z(d, 5, dtype=torch.bool)),
         r"loss_mask has shape \[5\] but log_probs has shape \[4\]"),
        # token_log_probs
        ("tlp_row_stats", lambda d: ops.token_log_probs(torch.randn(4, 7, device=d), _labels(d),
                                                        row_stats=_z(d, 4, 3)),
         r"token_log_probs: row_stats must have shape \(4, 5\)"),
        ("tlp_backward_grad", lambda d: ops._token_log_probs_backward(
            torch.randn(4, 7, device=d), _labels(d), _z(d, 4, 5), _z(d, 3), None, logits_scale_factor=1.0,
            top_k=None, top_p=None, min_p=None, vocab_start=0, vocab_size=-1), "grad_log_probs has shape"),
        ("row_stats_op", lambda d: ops.row_stats(torch.randn(4, 7, device=d), _labels(d), logits_scale_factor=-1.0),
         "row_stats: logits_scale_factor must be finite"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_fake_and_real_reject_alike(name, call, message):
    assert_fake_rejects_like_real(call, message)


# ---- every check of csrc/ has a bad input --------------------------------------------------------------------------
def _call_arguments(text, start):
    """The top-level arguments of the call whose '(' is at text[start]."""
    depth, i, args, cur = 0, start, [], []
    while True:
        c = text[i]
        if c in "\"'":  # a literal, escapes and all
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur))
                return args
        elif c == "," and depth == 1:
            args.append("".join(cur))
            cur = []
            i += 1
            continue
        if depth >= 1 and not (depth == 1 and c == "("):
            cur.append(c)
        i += 1


def _unescape(s):
    return s.encode().decode("unicode_escape").encode("latin-1").decode()


def _escape(text):
    # re.escape without the spaces, so that the patterns read as the messages do.
    return re.sub(r"([.^$*+?{}\[\]\\|()-])", r"\\\1", text)


def csrc_checks():
    """(file:line, pattern) of every TORCH_CHECK in csrc/: its message's literal pieces in order, anything between."""
    out = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
            continue
        text = path.read_text()
        for m in re.finditer(r"\bTORCH_CHECK\(", text):
            pieces = []
            for arg in _call_arguments(text, m.end() - 1)[1:]:
                literals = re.findall(r'"((?:[^"\\]|\\.)*)"', arg)
                if literals and re.fullmatch(r'\s*("(?:[^"\\]|\\.)*"\s*)+', arg):
                    pieces.append(_escape(_unescape("".join(literals))))
                elif not pieces or pieces[-1] != ".*":
                    pieces.append(".*")
            where = f"{path.relative_to(CSRC)}:{text[:m.start()].count(chr(10)) + 1}"
            out.append((where, "".join(pieces) + ("" if pieces and pieces[-1] == ".*" else "$")))
    return out


# Checks no fake kernel makes, by file:line's message (the patterns' first words): why, for each group.
NOT_FAKE = {
    # The data's: label ids, document ids and DPO's pairing are read by the real kernel (the CPU's before any
    # pass; CUDA's on the device), never by a fake one.
    "document_index holds", "holds document", "is in pairs", "target: label ", "must hold values in",
    # The teacher's top-K ids and log-probs (test_topk_distillation.py: test_bad_teacher_values).
    "teacher_ids: id ", "more than once", "teacher_log_probs: NaN", "the probabilities of row",
    # _scatter_rows' ids (test_scatter_rows.py: test_ids_out_of_range).
    "is outside [-1, ",
    # Two devices: on the CPU every tensor is on the one device (the CUDA tests pass a CPU tensor to a GPU op).
    " is on ",
    # Autograd's: they run above every kernel (common/autograd.h, token_log_probs_autograd.cpp), on meta tensors too.
    "backward was already run", "double backward", "inplace_backward=True overwrites",
    # Internal: an undefined tensor never comes from Python; the row pass's own invariants; _scale_grad_, called by
    # the losses' backward with its own shapes; CUDA's library errors.
    " is undefined", "internal error", "_scale_grad_", "cublasGemmEx", "libcublas", "cublasGetMathMode",
    # CUDA graph capture's: a stream being captured is the CUDA back-end's state, not an input's.
    "skip_unlabelled=True counts the labelled rows",
    # The machine's: a build in place run on a CPU without the vector width it compiled (common/cpu_isa.h).
    "which this CPU lacks",
}


def _not_fake(pattern):
    return any(key in pattern.replace("\\", "") for key in NOT_FAKE)


def test_every_check_has_a_bad_input():
    messages = []
    for _, call, _ in BAD_INPUTS + HEAD_BAD_INPUTS + SAMPLER_BAD_INPUTS + TOPK_BAD_INPUTS + SCATTER_ROWS_BAD_INPUTS:
        with pytest.raises(RuntimeError) as e:
            call("cpu")
        messages.append(str(e.value))
    missing = [(where, pattern) for where, pattern in csrc_checks()
               if not _not_fake(pattern) and not any(re.search(pattern, m, re.S) for m in messages)]
    assert not missing, "TORCH_CHECKs without a bad input in the fake-check tests:\n" + "\n".join(
        f"  {w}: {p}" for w, p in missing)


def test_the_check_list_is_read():
    checks = csrc_checks()
    assert len(checks) > 100
    assert any("epsilon_low must be in" in p for _, p in checks)
