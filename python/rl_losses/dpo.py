"""DPO over packed documents: the functional wrapper of ``torch.ops.rl_losses.dpo`` and a helper that builds its
document ids and pairs from Fast-LLM's chosen / rejected spans (docs/distillation_dpo.md)."""
from __future__ import annotations

import torch

from rl_losses import _schema, distributed
from rl_losses._inputs import _check_inputs_enabled, _direct, _options
from rl_losses.outputs import DpoOutput

_ops = torch.ops.rl_losses


def dpo_loss(logits: torch.Tensor, target: torch.Tensor, document_index: torch.Tensor, pairs: torch.Tensor,
             reference_chosen_log_probs: torch.Tensor, reference_rejected_log_probs: torch.Tensor, *, tp_group=None,
             vocab_start: int | None = None, vocab_size: int | None = None, **options) -> DpoOutput:
    """Fused DPO loss (Fast-LLM's ``dpo`` type) over a packed batch.

    Each document (the tokens sharing a ``document_index``) is the chosen or the rejected response of one pair;
    π_s is the sum of its labelled tokens' log-probabilities (one statistics pass over the logits). Per pair
    k = (c, r): h_k = β·((π_c − ref_c) − (π_r − ref_r)); L = −Σ_k log σ(h_k) / D.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64. target: (...) int labels, negative = not in a response
            (prompt, padding).
        document_index: (...) int, the document of each token, negative = padding.
        pairs: (P, 2) int (chosen, rejected) document ids; every document 0 .. 2P−1 must be in exactly one pair.
            On the CPU (also with CUDA logits) they are checked on the host, a clear error, and copied to the
            device; on the logits' device they are checked there without a synchronisation, a pairing mistake
            stopping the kernel with a device-side assert (with RL_LOSSES_CHECK_INPUTS=1 they are read back and
            checked on the host instead).
        reference_chosen_log_probs, reference_rejected_log_probs: (P,) float, the reference model's π of each
            pair's chosen / rejected document.
        beta: β > 0 (Fast-LLM's default 1). divisor: D (default: the number of pairs, the mean over pairs).
        inplace_backward: write the gradient into ``logits``.
        tp_group: vocabulary-parallel process group: ``logits`` hold this rank's columns (every rank the same
            tokens, labels, documents and pairs); the row statistics are all-reduced over the group before the
            op, which then reads its shard once, for the gradient. The loss and metrics are identical on every
            rank; the gradient is this rank's column block. vocab_start, vocab_size: this shard's first global
            column and the global V, for uneven shards (default: even shards).
    Returns: DpoOutput (``loss`` differentiable; rewards, accuracy, margin, log-probs detached).
    """
    options = _options("dpo_loss", options, _KEYWORDS)
    if pairs.is_cuda and _check_inputs_enabled() and not torch.compiler.is_compiling():
        pairs = pairs.cpu()  # the op's host check, then the copy back: a synchronisation the user asked for
    if tp_group is not None or vocab_start is not None or vocab_size is not None:  # else the op's defaults
        options["row_stats"], options["vocab_start"], options["vocab_size"] = distributed._tp_setup(
            "dpo", logits, target, tp_group, _schema.option("dpo", options, "logits_scale_factor"), vocab_start,
            vocab_size)
    op = _direct(_ops.dpo)
    out = op(logits, target, document_index, pairs, reference_chosen_log_probs, reference_rejected_log_probs, **options)
    return DpoOutput._make(_RESULTS(out))


_RESULTS = _schema.getter("dpo", DpoOutput._fields)
_KEYWORDS = distributed._shard_signature(dpo_loss, "dpo", extra={"tp_group": None}, returns=DpoOutput)


def documents_from_spans(chosen_spans, rejected_spans, shape, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast-LLM's preference spans as DPO documents: ``chosen_spans[b]`` and ``rejected_spans[b]`` list the
    (begin, end) token ranges of sample b (end exclusive); the i-th chosen span of a sample pairs with its i-th
    rejected span. Returns ``document_index`` (``shape``, -1 outside the spans) and ``pairs`` (P, 2)."""
    document_index = torch.full(shape, -1, dtype=torch.long)
    flat = document_index.view(len(chosen_spans), -1)
    pairs = []
    for b, (chosen, rejected) in enumerate(zip(chosen_spans, rejected_spans, strict=True)):
        if len(chosen) != len(rejected):
            raise ValueError(f"documents_from_spans: sample {b} has {len(chosen)} chosen but {len(rejected)} "
                             f"rejected spans; each chosen span needs a rejected one")
        for (cb, ce), (rb, re) in zip(chosen, rejected):
            c, r = 2 * len(pairs), 2 * len(pairs) + 1
            for doc, begin, end in ((c, cb, ce), (r, rb, re)):
                if not 0 <= begin < end <= flat.shape[1] or (flat[b, begin:end] >= 0).any():
                    raise ValueError(f"documents_from_spans: span ({begin}, {end}) of sample {b} is empty, out of "
                                     f"range or overlaps another span")
                flat[b, begin:end] = doc
            pairs.append((c, r))
    return document_index.to(device), torch.tensor(pairs, dtype=torch.long, device=device).view(-1, 2)
