"""rl_losses.packing.pack_documents on hand-checked cases, and each of its errors."""
import pytest
import torch

from rl_losses import Document, pack_documents

X = -100  # "no label"


def as_lists(batch):
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_docstring_example():
    b = as_lists(pack_documents([Document([1, 2], [3, 4], 0.5, old_log_probs=[-0.25, -0.75])]))
    assert b["input_ids"] == [1, 2, 3, 4]
    assert b["labels"] == [X, 3, 4, X]  # labels[t] = input_ids[t + 1]; prompt targets and the last token masked
    assert b["old_log_probabilities"] == [0.0, -0.25, -0.75, 0.0]  # at the position of the token's label
    assert b["document_index"] == [0, 0, 0, 0]
    assert b["position_ids"] == [0, 1, 2, 3]
    assert b["advantages"] == [0.5] * 4
    assert b["label_counts"] == [2] * 4
    assert (b["num_documents"], b["num_documents_in_batch"], b["num_labels_in_batch"]) == (1, 1, 2)


def test_two_documents_masks_and_padding():
    docs = [
        Document([7, 8, 9], [1, 2, 3], 1.0, completion_mask=[1, 0, 1], old_log_probs=[-1.0, -2.0, -3.0]),
        {"prompt": [5], "completion": [6], "advantage": -2.0, "old_log_probs": [-0.5]},  # a mapping works too
    ]
    b = as_lists(pack_documents(docs, pad_to=12, pad_token_id=11))
    #                        doc 0: 7  8  9  1  2  3 | doc 1: 5  6 | padding
    assert b["input_ids"] == [7, 8, 9, 1, 2, 3, 5, 6, 11, 11, 11, 11]
    assert b["labels"] == [X, X, 1, X, 3, X, 6, X, X, X, X, X]  # completion[1] = 2 is masked
    assert b["document_index"] == [0, 0, 0, 0, 0, 0, 1, 1, -1, -1, -1, -1]
    assert b["position_ids"] == [0, 1, 2, 3, 4, 5, 0, 1, 0, 0, 0, 0]
    assert b["label_counts"] == [2] * 6 + [1] * 2 + [0] * 4
    assert b["advantages"] == [1.0] * 6 + [-2.0] * 2 + [0.0] * 4
    assert b["old_log_probabilities"] == [0, 0, -1, -2, -3, 0, -0.5, 0, 0, 0, 0, 0]
    assert (b["num_documents"], b["num_documents_in_batch"], b["num_labels_in_batch"]) == (2, 2, 3)


def test_unlabelled_documents_and_no_old_log_probs():
    docs = [Document([1], [], 0.0), Document([1, 2], [3], 1.0, completion_mask=[False]), Document([4], [5, 6], 2.0)]
    b = as_lists(pack_documents(docs, ignore_index=-1))
    assert b["input_ids"] == [1, 1, 2, 3, 4, 5, 6]
    assert b["labels"] == [-1, -1, -1, -1, 5, 6, -1]  # custom ignore_index everywhere
    assert b["label_counts"] == [0, 0, 0, 0, 2, 2, 2]
    assert "old_log_probabilities" not in b  # none given: the caller computes them
    # All three are buffer slots; only the last holds a label, so only it counts in the divisor.
    assert (b["num_documents"], b["num_documents_in_batch"], b["num_labels_in_batch"]) == (3, 1, 2)


def test_rows_of_fixed_length():
    docs = [Document([1, 2], [3, 4], 1.0), Document([5], [6, 7], 2.0), Document([8, 9, 10], [11, 12], 3.0)]
    b = as_lists(pack_documents(docs, sequence_length=8, pad_token_id=0))
    # Row 0 holds documents 0 (4 tokens) and 1 (3 tokens); document 2 (5 tokens) does not fit and starts row 1.
    assert b["input_ids"] == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 0, 0, 0]]
    assert b["labels"] == [[X, 3, 4, X, 6, 7, X, X], [X, X, 11, 12, X, X, X, X]]
    assert b["document_index"] == [[0, 0, 0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 2, -1, -1, -1]]
    assert b["position_ids"] == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 0, 0]]
    assert b["label_counts"] == [[2, 2, 2, 2, 2, 2, 2, 0], [2, 2, 2, 2, 2, 0, 0, 0]]
    assert b["advantages"] == [[1.0] * 4 + [2.0] * 3 + [0.0], [3.0] * 5 + [0.0] * 3]
    assert (b["num_documents"], b["num_documents_in_batch"], b["num_labels_in_batch"]) == (3, 3, 6)
    # An exact fit needs no padding.
    assert pack_documents([Document([1], [2, 3], 0.0)] * 2, sequence_length=3)["input_ids"].shape == (2, 3)


def test_dtypes_and_device():
    b = pack_documents([Document([1], [2], 1)], pad_to=3, dtype=torch.float64, device="cpu")
    assert b["advantages"].dtype == torch.float64
    for key in ("input_ids", "position_ids", "labels", "document_index", "label_counts"):
        assert b[key].dtype == torch.int64 and b[key].shape == (3,)


def test_empty():
    b = pack_documents([], pad_to=2)
    assert b["document_index"].tolist() == [-1, -1] and b["labels"].tolist() == [X, X]
    assert (b["num_documents"], b["num_documents_in_batch"], b["num_labels_in_batch"]) == (0, 0, 0)


def test_packed_log_probs_line_up_with_the_labels():
    """A completion token's old log-prob sits where the logits predicting it are: log_softmax(logits[t])[labels[t]]."""
    torch.manual_seed(0)
    logits = torch.randn(9, 10)
    prompts, completions = [[1, 2], [3, 4, 5]], [[6, 7], [8]]
    starts = [0, 4]  # document offsets in the packed sequence
    old = [[torch.log_softmax(logits[s + len(p) - 1 + j], -1)[c[j]].item() for j in range(len(c))]
           for s, p, c in zip(starts, prompts, completions)]
    b = pack_documents([Document(p, c, 0.0, old_log_probs=o) for p, c, o in zip(prompts, completions, old)],
                       pad_to=9)
    mask = b["labels"] >= 0
    lp = torch.log_softmax(logits, -1).gather(-1, b["labels"].clamp_min(0)[:, None]).squeeze(-1)
    torch.testing.assert_close(lp[mask], b["old_log_probabilities"][mask])


@pytest.mark.parametrize("docs, kwargs, error, match", [
    ([Document([], [1], 0.0)], {}, ValueError, r"documents\[0\]\.prompt is empty"),
    ([Document([1], [2, 3], 0.0, completion_mask=[1])], {}, ValueError,
     r"documents\[0\]\.completion_mask has 1 entries but the completion has 2 tokens"),
    ([Document([1], [2], 0.0, old_log_probs=[0.0]), Document([1], [2, 3], 0.0, old_log_probs=[0.0])], {}, ValueError,
     r"documents\[1\]\.old_log_probs has 1 entries but the completion has 2 tokens"),
    ([Document([1], [2], 0.0, old_log_probs=[0.0]), Document([1], [2], 0.0)], {}, ValueError,
     r"old_log_probs given for 1 of 2 documents"),
    ([Document([1], [2], 0.0)], {"pad_to": 1}, ValueError, r"pad_to=1 but the documents hold 2 tokens"),
    ([Document([1], [2], 0.0)], {"ignore_index": 0}, ValueError, r"ignore_index must be negative, got 0"),
    ([Document([1, 2], [3], 0.0)], {"sequence_length": 2}, ValueError,
     r"documents\[0\] has 3 tokens, more than sequence_length=2"),
    ([Document([1], [2], 0.0)], {"sequence_length": 0}, ValueError, r"sequence_length must be >= 1, got 0"),
    ([Document([1], [2], 0.0)], {"sequence_length": 4, "pad_to": 4}, ValueError,
     r"give pad_to \(4\) or sequence_length \(4\), not both"),
    ([[1, 2]], {}, TypeError, r"documents\[0\] must be a Document or a mapping, got list"),
    ([{"prompt": [1], "completion": [2]}], {}, TypeError, r"advantage"),
])
def test_errors(docs, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_documents(docs, **kwargs)
