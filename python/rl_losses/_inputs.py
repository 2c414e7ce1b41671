"""Input handling shared by the functional wrappers (functional.py) and the distributed losses (distributed.py):
the opt-in host checks of label and document ids on CUDA, the divisor's normalisation and the named result of
the policy ops. Kept apart so that functional.py can route to distributed.py without an import cycle."""
from __future__ import annotations

import os

import torch

from rl_losses.reference import PolicyLossOutput


def _check_inputs_enabled() -> bool:
    # Opt-in host-side validation of label / document ids on CUDA (it synchronises with the device).
    # On the CPU the kernels always check; on CUDA an out-of-range label trips a device-side assert.
    return os.environ.get("RL_LOSSES_CHECK_INPUTS", "0") not in ("", "0")


def _check_labels(name: str, target: torch.Tensor, vocab_size: int | None) -> None:
    # The opt-in CUDA range check of labels against the (global) vocabulary size; None: the op reports the
    # shape error. It reads a value on the host, so it is skipped inside a compiled graph.
    if (vocab_size is not None and target.is_cuda and target.numel() > 0 and _check_inputs_enabled()
            and not torch.compiler.is_compiling()):
        high = int(target.max())
        if high >= vocab_size:
            raise ValueError(f"{name}: target holds label {high}, out of range for vocab_size {vocab_size}")


def _vocab_size(t: torch.Tensor, dim: int) -> int | None:
    return t.shape[dim] if t.dim() >= 1 else None


def _check_document_ids(name: str, document_index: torch.Tensor, num_documents: int | None) -> None:
    # The opt-in CUDA range check of document ids (the CPU kernels always check).
    if document_index.is_cuda and _check_inputs_enabled() and num_documents is not None and document_index.numel():
        high = int(document_index.max())
        if high >= num_documents:
            raise ValueError(f"{name}: document_index holds {high} but num_documents is {num_documents}")


def _divisor(divisor) -> float | None:
    if divisor is None:
        return None
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.item()
    return float(divisor)


# The number of outputs of the policy ops before GSPO's document_ratios (csrc/registration.cpp); the last output
# of every policy op is vespo_phi_mean.
POLICY_OUTPUTS = 12


def _policy_output(out, compute_entropy: bool, document_ratios=None, *, loss_type: str = "ppo_clip",
                   has_kl: bool = False, has_rollout: bool = False) -> PolicyLossOutput:
    loss, new_lp, low, high, kl_old, entropy, log_probs, ratio_mean, kl, rho, weight, corrected = out[:POLICY_OUTPUTS]
    return PolicyLossOutput(loss, new_lp, low, high, kl_old, entropy if compute_entropy else None, log_probs,
                            ratio_mean, document_ratios, kl if has_kl else None, rho if has_rollout else None,
                            weight if has_rollout else None, corrected if has_rollout else None,
                            out[-1] if loss_type == "vespo" else None, loss_type=loss_type)


def _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs, rollout_correction,
                   rollout_cap, rollout_mask_bounds, kl_estimator, kl_importance_weighted, entropy_coefficient,
                   vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0):
    # The policy family's options as the ops take them (csrc/registration.cpp: RL_LOSSES_POLICY_KWARGS).
    return dict(loss_type=loss_type, sapo_temperature_pos=float(sapo_temperature_pos),
                sapo_temperature_neg=float(sapo_temperature_neg), rollout_log_probs=rollout_log_probs,
                rollout_correction=rollout_correction, rollout_cap=float(rollout_cap),
                rollout_mask_bounds=None if rollout_mask_bounds is None else [float(b) for b in rollout_mask_bounds],
                kl_estimator=kl_estimator, kl_importance_weighted=bool(kl_importance_weighted),
                entropy_coefficient=float(entropy_coefficient), vespo_k_pos=float(vespo_k_pos),
                vespo_lambda_pos=float(vespo_lambda_pos), vespo_k_neg=float(vespo_k_neg),
                vespo_lambda_neg=float(vespo_lambda_neg))


def _grpo_output(out, compute_entropy, policy, ref_log_probs, document_ratios=None) -> PolicyLossOutput:
    # The named result of grpo/gspo: the optional metrics set where their option is on.
    return _policy_output(out, compute_entropy or policy["entropy_coefficient"] != 0.0, document_ratios,
                          loss_type=policy["loss_type"], has_kl=ref_log_probs is not None,
                          has_rollout=policy["rollout_correction"] is not None)
