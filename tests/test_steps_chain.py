"""GSPO's and DPO's O(N + S) steps between their passes run on CUDA as one single-block launch where every step has at
most 1024 items (CudaRunner::chain), else as a launch per step: both sides of that bound, in tokens and in documents,
against the float64 references (on the CPU the runner takes the steps one by one)."""
import pytest
import torch

import helpers_gspo as gspo
from test_dpo import check as check_dpo
from test_dpo import make_inputs as dpo_inputs


@pytest.mark.parametrize("n_tokens, n_documents, num_documents",
                         [(1024, 9, 9), (1025, 9, 9), (600, 300, 1030)], ids=["chain", "per_step", "many_documents"])
def test_gspo_either_side_of_the_bound(n_tokens, n_documents, num_documents, device):
    doc = gspo.document_index_from_lengths(gspo.random_lengths(n_tokens, n_documents), n_tokens, device)
    logits, target, advantages, old = gspo.make_inputs((n_tokens,), 50, torch.float32, device, doc)
    gspo.check(logits, target, advantages, old, doc, num_documents=num_documents)


@pytest.mark.parametrize("n_pairs", [100, 160])  # ~800 and ~1280 tokens: a chain, then a launch per step
def test_dpo_either_side_of_the_bound(n_pairs, device):
    inputs = dpo_inputs(n_pairs, 40, torch.float32, device, prompt=1, padding=1)
    assert (inputs[0].shape[0] <= 1024) == (n_pairs == 100)
    check_dpo(inputs, beta=0.2)
