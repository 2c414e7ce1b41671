"""Loss modules (rl_losses.losses) against the functional ops and the float64 pure-PyTorch reference.

Every config runs with use_cuda_kernel None / False / True on each device: the module's loss, gradient and
metrics must match the reference on the same (rounded) inputs; True must fail clearly without a CUDA kernel.
The GRPO loss normalisations are also checked against a per-document loop written here.
"""
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_close

import rl_losses
from rl_losses import Document, LanguageModelLossConfig, functional, pack_documents, reference

VOCAB = 97
# Log-ratios (new - old) from a set far from every clip bound used below (ln 0.8, ln 1.2, ln 1.28, ±3e-4), so a
# clip decision never flips between float32 and float64.
LOG_RATIOS = torch.tensor([-0.5, -0.1, 0.0, 0.1, 0.5], dtype=torch.float64)

CONFIGS = [
    {"type": "label"},
    {"type": "label", "label_smoothing": 0.1, "z_loss_factor": 1e-3, "logits_scale_factor": 0.7, "weight": 0.5},
    {"type": "z_loss", "weight": 0.1},
    {"type": "grpo"},
    {"type": "grpo", "metrics": "basic", "epsilon_high": 0.28},
    {"type": "grpo", "metrics": "with_entropy", "delta": 1.4, "beta": 0.05, "logits_scale_factor": 1 / 0.7},
    {"type": "grpo", "metrics": "basic", "loss_normalization": "sequence"},
    {"type": "grpo", "loss_normalization": "document", "weight": 2.0},
    {"type": "grpo", "loss_normalization": "dr_grpo", "max_completion_length": 8},
    {"type": "gspo"},
    {"type": "gspo", "metrics": "basic", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    {"type": "gspo", "metrics": "with_entropy", "weighting": "token", "logits_scale_factor": 2.0},
    {"type": "gspo", "metrics": "basic", "token_advantages": True},
    {"type": "gspo", "metrics": "basic", "delta": 1.4},  # R_s = e^0.5 ≈ 1.65 is capped
]


def _ids(config):
    return "-".join(f"{k}={v}" if k != "type" else v for k, v in config.items())


def _skip_without_kernel(type_name: str, device: str):
    # While the extension is being written, an op may lack its kernel for a device; skip those cases then.
    op = {"label": "cross_entropy", "z_loss": "cross_entropy", "grpo": "grpo", "gspo": "gspo"}[type_name]
    try:
        found = torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_losses::_{op}_forward", device.upper())
    except RuntimeError:  # the op is not registered at all
        found = False
    if not found:
        pytest.skip(f"rl_losses::_{op}_forward has no {device} kernel in this build yet")


def make_batch(device, dtype, *, num_docs=7, pad=5):
    """Random packed documents, logits (N, V) in ``dtype`` and float64 inputs chosen from the rounded logits."""
    docs = []
    for i in range(num_docs):
        n_prompt, n_completion = torch.randint(1, 6, ()).item(), torch.randint(0 if i == 0 else 1, 9, ()).item()
        mask = (torch.rand(n_completion) > 0.2).tolist()
        docs.append(Document(torch.randint(0, VOCAB, (n_prompt,)).tolist(),
                             torch.randint(0, VOCAB, (n_completion,)).tolist(), torch.randn(()).item(), mask))
    length = sum(len(d.prompt) + len(d.completion) for d in docs)
    batch = pack_documents(docs, pad_to=length + pad, device=device)
    n = length + pad
    logits = (torch.randn(n, VOCAB, device=device) * 2).to(dtype)
    lp = reference._label_logprob(torch.log_softmax(logits.double(), -1), batch["labels"])
    doc = batch["document_index"].clamp_min(0)
    doc_ratio = LOG_RATIOS[torch.randint(0, len(LOG_RATIOS), (num_docs,))].to(device)[doc]
    jitter = torch.where(torch.arange(n, device=device) % 2 == 0, 0.02, -0.02)
    batch["_log_ratio"] = doc_ratio + jitter  # GRPO: per-token ratios; GSPO: per-document, within ±0.02
    # Per-token advantages: the document's, plus noise (GSPO-token sees it, the others average it away).
    batch["advantages"] = (batch["advantages"] + 0.3 * torch.randn(n, device=device)).float()
    batch["ref_log_probs"] = (lp + torch.where(torch.rand(n, device=device) > 0.5, 0.3, -0.3)).float()
    batch["loss_mask"] = torch.rand(n, device=device) > 0.3
    return logits, batch


def set_old_log_probs(batch, logits, scale):
    # old = new - log_ratio, with new computed at the config's scale, so the ratios are exactly LOG_RATIOS ± 0.02.
    lp = reference._label_logprob(torch.log_softmax(logits.double() * scale, -1), batch["labels"])
    batch["old_log_probabilities"] = (lp - batch["_log_ratio"]).float()


def expected_loss(cfg, logits, batch, ops=reference):
    """``ops`` (the reference or the functional ops) called with the options the module should pass, written
    independently of rl_losses.losses. Returns the loss and the PolicyLossOutput (None for label / z_loss)."""
    t, s = cfg.type_name, cfg.logits_scale_factor
    labels, adv, old = batch["labels"], batch["advantages"], batch.get("old_log_probabilities")
    if t == "label":
        return ops.cross_entropy(logits, labels, logits_scale_factor=s, label_smoothing=cfg.label_smoothing,
                                 z_loss_factor=cfg.z_loss_factor, divisor=batch["num_labels_in_batch"]), None
    if t == "z_loss":
        return ops.z_loss(logits, loss_mask=batch["loss_mask"], logits_scale_factor=s), None
    common = dict(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, logits_scale_factor=s,
                  compute_entropy=cfg.metrics == "with_entropy")
    n_docs = batch["num_documents_in_batch"]
    if t == "grpo":
        mask = labels >= 0
        weights, divisor = None, {"token": batch["num_labels_in_batch"], "sequence": n_docs, "document": n_docs,
                                  "dr_grpo": n_docs * (cfg.max_completion_length or 0)}[cfg.loss_normalization]
        if cfg.loss_normalization == "sequence":
            weights = mask / batch["label_counts"].clamp_min(1)
        out = ops.grpo_loss(logits, labels, adv, old, delta=cfg.delta, beta=cfg.beta,
                            ref_log_probs=batch["ref_log_probs"] if cfg.beta else None, loss_weights=weights,
                            divisor=divisor, label_counts=batch["label_counts"], **common)
    else:
        out = ops.gspo_loss(logits, labels, adv, old, batch["document_index"], num_documents=batch["num_documents"],
                            label_counts=batch["label_counts"], delta=cfg.delta, weighting=cfg.weighting,
                            token_advantages=cfg.token_advantages, divisor=n_docs, **common)
    return out.loss, out


def expected_metrics(cfg, out, batch, name):
    if out is None:
        return {}
    metrics = {f"{name}_new_logprobs": out.new_logprobs}
    if cfg.metrics == "none":
        return metrics
    labels, adv = batch["labels"], batch["advantages"].double()
    mask = (labels >= 0) & (batch["document_index"] >= 0)
    w = mask / batch["label_counts"].double().clamp_min(1)
    metrics.update({
        f"{name}_ratio_new_old": out.ratio_mean,
        f"{name}_kl_new_old": out.kl_old,
        f"{name}_clipped_ratio_fraction": out.clipped_fraction_low + out.clipped_fraction_high,
        f"{name}_clipped_ratio_fraction_low": out.clipped_fraction_low,
        f"{name}_clipped_ratio_fraction_high": out.clipped_fraction_high,
        f"{name}_old_logprobs": (w * batch["old_log_probabilities"].double()).sum() / w.sum(),
        f"{name}_advantage": (w * adv).sum() / w.sum(),
        f"{name}_max_advantage": adv[mask].max(),
        f"{name}_min_advantage": adv[mask].min(),
        f"{name}_num_tokens": mask.sum(),
    })
    if cfg.type_name == "gspo":
        metrics[f"{name}_num_segments"] = torch.tensor(batch["num_documents_in_batch"])
    if cfg.metrics == "with_entropy":
        metrics[f"{name}_entropy"] = out.entropy
    if getattr(cfg, "beta", 0.0) > 0:  # the mean KL towards the reference (docs/policy_losses.md)
        metrics[f"{name}_kl"] = out.kl
    return metrics


def _kernel_available_for(device) -> bool:
    return device == "cuda" and rl_losses.cuda_kernels_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use_cuda_kernel", [None, False, True], ids=lambda v: f"kernel={v}")
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_module_matches_reference(device, config, use_cuda_kernel, dtype):
    cfg = LanguageModelLossConfig.from_dict({**config, "use_cuda_kernel": use_cuda_kernel})
    module = cfg.get_loss(name="head")
    logits, batch = make_batch(device, dtype)
    set_old_log_probs(batch, logits, cfg.logits_scale_factor)
    if use_cuda_kernel is True and not _kernel_available_for(device):
        with pytest.raises(RuntimeError, match=r"use_cuda_kernel=True requires the CUDA kernel, but the logits are "
                                               r"on cpu, not a CUDA device"):
            module(logits, batch)
        return
    assert module.uses_kernel(logits) == (use_cuda_kernel is not False)
    if module.uses_kernel(logits):
        _skip_without_kernel(cfg.type_name, device)

    x = logits.detach().requires_grad_()
    loss, metrics = module(x, batch)
    loss.backward()
    x64 = logits.detach().double().requires_grad_()
    want, out = expected_loss(cfg, x64, batch)
    (want * cfg.weight).backward()

    assert loss.dtype == torch.float32
    assert_close(loss, want * cfg.weight, dtype, msg=f"loss of {cfg}")
    assert_close(x.grad, x64.grad, dtype, msg=f"gradient of {cfg}")
    assert_close(metrics["head"], want, dtype)
    want_metrics = expected_metrics(cfg, out, batch, "head")
    assert set(metrics) == {"head", *want_metrics}
    for key, value in want_metrics.items():
        assert value.shape == () and not metrics[key].requires_grad
        assert_close(metrics[key], value, dtype, scale=10.0 if "entropy" in key else 1.0, msg=key)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_module_matches_functional(device, config):
    """The default path is the extension's functional op, called with the options the config implies."""
    cfg = LanguageModelLossConfig.from_dict(config)
    _skip_without_kernel(cfg.type_name, device)
    logits, batch = make_batch(device, torch.float32)
    set_old_log_probs(batch, logits, cfg.logits_scale_factor)
    loss, metrics = cfg.get_loss(name="head")(logits, batch)
    want, out = expected_loss(cfg, logits, batch, ops=functional)
    torch.testing.assert_close(loss, want * cfg.weight, rtol=1e-6, atol=0)
    for key, value in expected_metrics(cfg, out, batch, "head").items():
        torch.testing.assert_close(metrics[key].double().cpu(), value.double().cpu(), rtol=1e-6, atol=1e-7, msg=key)


def test_config_and_name_set_anew(device):
    """What a module binds once (its op's options, the batch tensors its config needs, their owner's name) is bound
    again when its config or name is set."""
    cfg = LanguageModelLossConfig.from_dict(CONFIGS[5])  # beta > 0, delta, the entropy, a scale
    logits, batch = make_batch(device, torch.float32)
    set_old_log_probs(batch, logits, cfg.logits_scale_factor)
    module = LanguageModelLossConfig.from_dict({"type": "grpo"}).get_loss(name="head")
    module(logits, batch)
    module.config, module.name = cfg, "other"
    loss, metrics = module(logits, batch)
    want, out = expected_loss(cfg, logits, batch, ops=functional)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics["other_entropy"], out.entropy, rtol=1e-6, atol=1e-7)
    del batch["ref_log_probs"]
    with pytest.raises(ValueError, match=r"other \(beta > 0\): the batch has no 'ref_log_probs'"):
        module(logits, batch)
    quiet = LanguageModelLossConfig.from_dict({"type": "grpo", "metrics": "none"}).get_loss(name="head")
    quiet(logits, batch)
    quiet.name = "other"  # the one metric at metrics="none" follows the name too
    assert sorted(quiet(logits, batch)[1]) == ["other", "other_new_logprobs"]


@pytest.mark.parametrize("normalization", ["token", "sequence", "document", "dr_grpo"])
def test_grpo_normalizations(normalization):
    """Each loss_normalization against a loop over documents of the reference's per-document token mean."""
    cfg = LanguageModelLossConfig.from_dict({"type": "grpo", "loss_normalization": normalization,
                                             "max_completion_length": 8, "use_cuda_kernel": False})
    logits, batch = make_batch("cpu", torch.float64)
    set_old_log_probs(batch, logits, 1.0)
    loss, _ = cfg.get_loss()(logits, batch)
    doc_means, doc_sums = [], []
    for d in range(batch["num_documents"]):
        sel = (batch["document_index"] == d) & (batch["labels"] >= 0)
        if not sel.any():
            continue
        n = sel.sum()
        mean = reference.grpo_loss(logits[sel], batch["labels"][sel], batch["advantages"][sel],
                                   batch["old_log_probabilities"][sel]).loss
        doc_means.append(mean)
        doc_sums.append(mean * n)
    num_docs, total = len(doc_means), sum(doc_sums)
    want = {"token": total / batch["num_labels_in_batch"], "sequence": sum(doc_means) / num_docs,
            "document": total / num_docs, "dr_grpo": total / (num_docs * 8)}[normalization]
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)


def test_num_documents_fallbacks():
    """Without num_documents_in_batch, the document-mean divisor is counted from label_counts or document_index."""
    cfg = LanguageModelLossConfig.from_dict({"type": "grpo", "loss_normalization": "document",
                                             "use_cuda_kernel": False})
    logits, batch = make_batch("cpu", torch.float64)
    set_old_log_probs(batch, logits, 1.0)
    module = cfg.get_loss()
    want, _ = module(logits, batch)
    del batch["num_documents_in_batch"]
    torch.testing.assert_close(module(logits, batch)[0], want)
    del batch["label_counts"]
    torch.testing.assert_close(module(logits, batch)[0], want)
    del batch["document_index"]
    with pytest.raises(ValueError, match="give 'num_documents_in_batch', 'label_counts' or 'document_index'"):
        module(logits, batch)


@pytest.mark.parametrize("config, key", [
    ({"type": "label"}, "labels"),
    ({"type": "grpo"}, "advantages"),
    ({"type": "grpo", "beta": 0.1}, "ref_log_probs"),
    ({"type": "grpo", "rollout_correction": "token_mask"}, "rollout_log_probs"),
    ({"type": "grpo", "loss_normalization": "sequence"}, "label_counts"),
    ({"type": "gspo"}, "document_index"),
], ids=lambda v: v if isinstance(v, str) else v["type"])
def test_missing_batch_keys(config, key):
    module = LanguageModelLossConfig.from_dict({**config, "use_cuda_kernel": False}).get_loss(name="head")
    logits, batch = make_batch("cpu", torch.float32)
    set_old_log_probs(batch, logits, 1.0)
    batch.pop(key, None)
    with pytest.raises(ValueError, match=rf"head.*: the batch has no '{key}' \(keys given: \["):
        module(logits, batch)


@pytest.mark.parametrize("type_name", ["grpo", "gspo"])
def test_missing_old_log_probabilities_is_on_policy(type_name):
    # Without old_log_probabilities the policy losses are on-policy: old = sg(lp) (docs/policy_losses.md).
    module = LanguageModelLossConfig.from_dict({"type": type_name, "use_cuda_kernel": False}).get_loss(name="head")
    logits, batch = make_batch("cpu", torch.float32)
    # The current log-probs as old ones: the same loss.
    batch["old_log_probabilities"] = reference._label_logprob(torch.log_softmax(logits.double(), -1),
                                                              batch["labels"]).float()
    with_old, _ = module(logits, batch)
    del batch["old_log_probabilities"]
    on_policy, _ = module(logits, batch)
    assert_close(on_policy, with_old, torch.float32)


def test_use_cuda_kernel_true_without_cuda_build(monkeypatch):
    """A CPU-only build names itself in the error, whatever the device."""
    monkeypatch.setattr(functional, "cuda_kernels_available", lambda: False)
    module = LanguageModelLossConfig.from_dict({"type": "label", "use_cuda_kernel": True}).get_loss()
    with pytest.raises(RuntimeError, match="built without its CUDA kernels"):
        module.uses_kernel(torch.empty(0))
    # None: the reference for CUDA tensors when there is no CUDA kernel (only the device's flag is read: no GPU
    # needed), the extension on the CPU and on "meta".
    module = LanguageModelLossConfig.from_dict({"type": "label"}).get_loss()
    assert not module.uses_kernel(SimpleNamespace(is_cuda=True))
    assert module.uses_kernel(torch.empty(0)) and module.uses_kernel(torch.empty(0, device="meta"))
    monkeypatch.setattr(functional, "cuda_kernels_available", lambda: True)
    assert module.uses_kernel(SimpleNamespace(is_cuda=True))


def test_tp_group_needs_the_extension():
    cfg = LanguageModelLossConfig.from_dict({"type": "gspo", "use_cuda_kernel": False})
    with pytest.raises(ValueError, match="tp_group needs the extension's op, but use_cuda_kernel=False"):
        cfg.get_loss(tp_group=object())
