"""Pack variable-length RL documents (prompt + completion) into the flat batch the loss modules take.

Shift convention (the usual causal-LM one, and Fast-LLM's): the model reads ``input_ids[t]`` and its logits at
position t predict the *next* token, so ``labels[t] = input_ids[t + 1]`` when t + 1 is in the same document and
is a completion token with mask 1, and ``-100`` otherwise. Hence the prompt's tokens (except the last, which
predicts the first completion token), masked completion tokens' predecessors and the last token of every
document carry ``-100``. The per-token ``old_log_probabilities`` of a completion token (the log-prob the
sampler gave it) sit at the same position as its label, one to its left. Example, prompt [a, b], completion
[c, d]:

    input_ids      a     b     c     d
    labels      -100     c     d  -100
    old_lp         0   lp(c) lp(d)    0
    document_index 0     0     0     0
    position_ids   0     1     2     3

``advantages`` repeat the document's advantage on every token; ``label_counts`` repeat its number of labels.
Padding (``pad_to``) goes at the end with ``document_index = -1``, ``labels = -100`` and zeros elsewhere. With
``sequence_length=T`` the documents are packed whole into (B, T) rows instead, each row padded at its end.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

IGNORE_INDEX = -100


@dataclasses.dataclass
class Document:
    """One sampled sequence.

    prompt: token ids (at least one: the first completion token is predicted from the last prompt token).
    completion: token ids sampled by the policy (may be empty).
    advantage: the sequence's advantage (e.g. its group-normalised reward).
    completion_mask: 1/True for completion tokens that get a loss (default all); e.g. 0 for tool outputs.
    old_log_probs: per completion token, the log-prob the sampling policy gave it (default: not packed).
    """

    prompt: Sequence[int]
    completion: Sequence[int]
    advantage: float
    completion_mask: Sequence[bool] | None = None
    old_log_probs: Sequence[float] | None = None


def _as_document(doc: Document | Mapping, i: int) -> Document:
    if isinstance(doc, Document):
        return doc
    if isinstance(doc, Mapping):
        return Document(**doc)
    raise TypeError(f"pack_documents: documents[{i}] must be a Document or a mapping, got {type(doc).__name__}")


def _check_length(i: int, name: str, values, expected: int) -> None:
    if values is not None and len(values) != expected:
        raise ValueError(f"pack_documents: documents[{i}].{name} has {len(values)} entries but the completion has "
                         f"{expected} tokens")


def pack_documents(documents: Sequence[Document | Mapping], *, pad_to: int | None = None,
                   sequence_length: int | None = None, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX,
                   device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """Pack ``documents`` (``Document`` objects or dicts with the same keys) into one batch.

    Args:
        pad_to: total length N of a flat packed batch (>= the documents' total length); default: no padding.
        sequence_length: instead, pack into rows of T = sequence_length tokens, shape (B, T): documents are
            placed in order and kept whole (a document that does not fit in the current row starts the next
            one), each row padded at its end. Attention then stays within a row (B·T² work instead of N²).
        pad_token_id: input id of the padding tokens. ignore_index: the negative "no label" value.
        device, dtype: where the tensors go; the float dtype of advantages / old log-probs.
    Returns: a dict of (N,) (or (B, T)) tensors ``input_ids``, ``position_ids`` (restarting at 0 per
        document), ``labels``, ``document_index`` (int64; 0-based over the whole batch, -1 on padding),
        ``label_counts`` (int64), ``advantages`` (dtype) and, when every document has them,
        ``old_log_probabilities`` (dtype); and ints ``num_documents`` (the number of documents: the per-document
        buffer size), ``num_documents_in_batch`` (documents with at least one label: the document-mean divisor)
        and ``num_labels_in_batch`` (the token-mean divisor).
    """
    if ignore_index >= 0:
        raise ValueError(f"pack_documents: ignore_index must be negative, got {ignore_index}")
    if pad_to is not None and sequence_length is not None:
        raise ValueError(f"pack_documents: give pad_to ({pad_to}) or sequence_length ({sequence_length}), not both")
    if sequence_length is not None and sequence_length < 1:
        raise ValueError(f"pack_documents: sequence_length must be >= 1, got {sequence_length}")
    docs = [_as_document(d, i) for i, d in enumerate(documents)]
    with_old = [d.old_log_probs is not None for d in docs]
    all_old = bool(docs) and all(with_old)
    if any(with_old) and not all_old:
        raise ValueError(f"pack_documents: old_log_probs given for {sum(with_old)} of {len(docs)} documents; give "
                         f"them for all or none")
    # One list per per-token field, with its padding value.
    pads = {"input_ids": pad_token_id, "position_ids": 0, "labels": ignore_index, "document_index": -1,
            "label_counts": 0, "advantages": 0.0}
    if all_old:
        pads["old_log_probabilities"] = 0.0
    fields = {key: [] for key in pads}

    def pad(n: int) -> None:
        for key, value in pads.items():
            fields[key] += [value] * n

    num_labelled_documents = 0
    for i, d in enumerate(docs):
        if len(d.prompt) == 0:
            raise ValueError(f"pack_documents: documents[{i}].prompt is empty; it needs at least one token (e.g. "
                             f"BOS) to predict the first completion token from")
        n_p, n_c = len(d.prompt), len(d.completion)
        _check_length(i, "completion_mask", d.completion_mask, n_c)
        _check_length(i, "old_log_probs", d.old_log_probs, n_c)
        n = n_p + n_c
        if sequence_length is not None:
            if n > sequence_length:
                raise ValueError(f"pack_documents: documents[{i}] has {n} tokens, more than sequence_length="
                                 f"{sequence_length}")
            used = len(fields["input_ids"]) % sequence_length
            if used and used + n > sequence_length:
                pad(sequence_length - used)  # close the row: documents stay whole
        mask = [True] * n_c if d.completion_mask is None else [bool(m) for m in d.completion_mask]
        n_labels = sum(mask)
        num_labelled_documents += n_labels > 0
        fields["input_ids"] += list(d.prompt) + list(d.completion)
        # Position t predicts token t + 1: the prompt's last position predicts completion[0]; the document's
        # last position has no next token in the document.
        fields["labels"] += ([ignore_index] * (n_p - 1) + [c if m else ignore_index for c, m in zip(d.completion, mask)]
                             + [ignore_index])
        fields["document_index"] += [i] * n
        fields["position_ids"] += range(n)
        fields["advantages"] += [float(d.advantage)] * n
        fields["label_counts"] += [n_labels] * n
        if all_old:
            fields["old_log_probabilities"] += [0.0] * (n_p - 1) + [float(x) for x in d.old_log_probs] + [0.0]

    length = len(fields["input_ids"])
    if pad_to is not None:
        if pad_to < length:
            raise ValueError(f"pack_documents: pad_to={pad_to} but the documents hold {length} tokens")
        pad(pad_to - length)
    if sequence_length is not None:
        pad(-length % sequence_length)
    shape = (-1,) if sequence_length is None else (-1, sequence_length)

    batch = {key: torch.tensor(values, dtype=dtype if isinstance(pads[key], float) else torch.long,
                               device=device).view(shape) for key, values in fields.items()}
    batch.update(num_documents=len(docs), num_documents_in_batch=num_labelled_documents,
                 num_labels_in_batch=sum(y >= 0 for y in fields["labels"]))
    return batch
