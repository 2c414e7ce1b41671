"""The benchmark cases and providers shared by bench_gpu.py and bench_cpu.py.

A *case* is an op (cross-entropy, GRPO with beta 0 or > 0, GSPO with long or short documents) at a shape
N x V and a dtype; its inputs are drawn from a seed, so every provider of a case sees the same numbers.
A *provider* is one way a user can compute that loss (this project's op, pure PyTorch eager, the same under
torch.compile, Liger-Kernel); each runs fwd + bwd exactly as a user would (``loss.backward()``), on the
same loss definition. Where a peer's definition or layout differs from ours, DEFINITION_NOTES says how the
benchmark maps one onto the other; the benchmark also checks that every provider's loss and first gradient
rows agree with the first provider's.
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS_LOW = 0.2
EPS_HIGH = 0.2
KL_BETA = 0.04  # TRL's and Liger's default beta


@dataclass(frozen=True)
class OpSpec:
    name: str
    label: str
    kind: str  # "ce", "grpo" or "gspo"
    passes: float  # minimal N x V passes: read the logits once per pass that needs them + write the gradient once
    seq_len: int  # tokens per sequence (GRPO: Liger's B x L layout) or per document (GSPO)
    beta: float = 0.0
    masked: float = 0.0  # the last fraction of every sequence has no label (target -100, Liger's mask 0)
    headline_only: bool = False  # not run over the grid of shapes


OPS = {
    "ce": OpSpec("ce", "cross-entropy", "ce", 2, 2048),
    "grpo": OpSpec("grpo", "GRPO beta=0", "grpo", 2, 2048),
    "grpo_kl": OpSpec("grpo_kl", f"GRPO beta={KL_BETA}", "grpo", 2, 2048, beta=KL_BETA),
    # Half of every sequence unlabelled (padding, or a prompt): a masked row needs no read, only its zero
    # gradient written, so the minimal traffic is 1.5 passes.
    "grpo_masked": OpSpec("grpo_masked", "GRPO beta=0, half masked", "grpo", 1.5, 2048, masked=0.5,
                          headline_only=True),
    # GSPO must read the logits twice (R_s needs every token of a document first), then write once.
    "gspo_2048": OpSpec("gspo_2048", "GSPO docs of 2048", "gspo", 3, 2048),
    "gspo_64": OpSpec("gspo_64", "GSPO docs of 64", "gspo", 3, 64),
    "gspo_masked": OpSpec("gspo_masked", "GSPO docs of 2048, half masked", "gspo", 2, 2048, masked=0.5,
                          headline_only=True),
}

DEFINITION_NOTES = [
    "All providers run fwd+bwd (loss.backward()) on the same inputs: every token labelled (except in "
    "grpo_masked and gspo_masked: the last half of every sequence has target -100, Liger's completion_mask 0 "
    "there), logits_scale_factor = 1 (Liger temperature = 1), eps_low = eps_high = 0.2, loss = token mean "
    "(CE, GRPO) or document mean (GSPO); advantages are drawn per sequence/document and broadcast to its "
    "tokens (Liger takes them per sequence, we take them per token: same loss).",
    "torch_eager / torch_compile: CE is F.cross_entropy(logits.float(), target) (the HF/TRL convention: fp32 "
    "math like ours); GRPO/GSPO are rl_losses.reference on the bf16 logits (it upcasts to fp32). "
    "torch_compile is the same function under torch.compile(dynamic=False); its first call (compile) is "
    "reported apart and not timed.",
    "liger CE: liger_kernel.transformers.functional.liger_cross_entropy(logits, target) "
    "(LigerCrossEntropyFunction). It always writes the gradient into the logits' storage during the forward "
    "(so it is compared with rl_losses_inplace), synchronises with the host each call (.item() of the "
    "non-ignored count and target-bounds asserts), and keeps per-row losses in the logits dtype (bf16): its loss "
    "agrees only to bf16 rounding.",
    "liger GRPO: liger_kernel.transformers.grpo_loss.triton_grpo_loss(logits, old_logp, ref_logp, "
    "completion_ids, advantages, completion_mask, temperature=1, beta, eps_low, eps_high, inplace, "
    "loss_type='bnpo', importance_sampling_level='token', reduce=True). loss_type 'bnpo' (= 'dapo' on one "
    "process) is sum(mask*loss)/sum(mask) = our default (w = m, D = sum m). Its k3 KL term is ours.",
    "liger GSPO: the same function with importance_sampling_level='sequence', loss_type='grpo' (mean over "
    "sequences of the token mean): ratio exp(mean_t(lp - old)) per sequence, clipped with the same gradient "
    "condition as our c(R, A); = our gspo_loss(weighting='document', divisor = #documents). Liger's documents "
    "are the rows of a padded (B, L+1, V) tensor, ours are packed (document_index).",
    "Liger's layout: logits (B, L+1, V) of which the last position of each sequence is dropped (HF's shifted "
    "logits), so it reads B extra rows (0.05% at L = 2048, 1.6% at L = 64); its gradient there is zeroed. "
    "GB/s and % of the ceiling count the same minimal bytes (N rows) for every provider.",
    "liger (GRPO/GSPO) runs with inplace=False (allocates the gradient like rl_losses); liger_inplace with its "
    "default inplace=True (gradient written into the logits, like rl_losses_inplace). Liger's token-level GRPO "
    "reads the logits twice (forward LSE pass, backward pass), its sequence level three times.",
]


def load_reference():
    """rl_losses.reference, or — when the package (its compiled library) does not import — the same file
    loaded on its own: the pure-PyTorch baselines must not depend on the build."""
    try:
        import rl_losses.reference as reference

        return reference
    except Exception:  # noqa: BLE001  (a broken build may raise anything at import)
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "rl_losses", "reference.py")
        spec = importlib.util.spec_from_file_location("rl_losses_reference_standalone", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------

@torch.no_grad()
def label_logprobs(logits: torch.Tensor, target: torch.Tensor, chunk_bytes: int = 32 << 20) -> torch.Tensor:
    """log_softmax(logits)[t, target_t] in fp32, a few rows at a time (no N x V fp32 temporary)."""
    n, v = logits.shape
    rows = max(1, chunk_bytes // (v * 4))
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for i in range(0, n, rows):
        x = logits[i:i + rows].float()
        out[i:i + rows] = x.gather(1, target[i:i + rows, None]).squeeze(1) - torch.logsumexp(x, 1)
    return out


def make_inputs(op: OpSpec, n: int, v: int, dtype: torch.dtype, device, seed: int, seq_len: int | None = None):
    """Fresh random inputs of one case, identical for every provider (same seed). Never zeros: logits
    N(0, 1), labels uniform, old/ref log-probs near the current ones so that a realistic fraction clips."""
    device = torch.device(device)
    seq_len = min(seq_len or op.seq_len, n)
    if n % seq_len:
        raise ValueError(f"{op.name}: N={n} is not a multiple of the sequence length {seq_len}")
    b = n // seq_len
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n, v, device=device, dtype=dtype, generator=g)
    target = torch.randint(0, v, (n,), device=device, generator=g)
    # The first rows, those the cross-provider check compares, get confident labels (p_y about 0, 1/2, 0.9,
    # 0.99, as in a trained model): with N(0, 1) logits alone p_y ~ 1/V and an error in the label term of
    # the gradient would not show.
    k = min(4, n)
    odds = torch.tensor([0.0, 1.0, 9.0, 99.0][:k], dtype=torch.float64)
    boost = torch.where(odds > 0, math.log(v) + 0.5 + odds.clamp_min(1e-300).log(), torch.zeros_like(odds))
    logits[torch.arange(k, device=device), target[:k]] += boost.to(device=device, dtype=dtype)
    if op.masked:
        target.view(b, seq_len)[:, seq_len - int(op.masked * seq_len):] = -100
    inp = {"logits": logits, "target": target, "n": n, "v": v, "seq_len": seq_len, "num_seqs": b}
    if op.kind != "ce":
        lp = label_logprobs(logits, target.clamp_min(0))
        noise = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
        inp["advantages_seq"] = noise(b)
        inp["advantages"] = inp["advantages_seq"].repeat_interleave(seq_len)
        # Per-token and per-sequence drift of the old policy: some tokens and some documents clip.
        inp["old_log_probs"] = lp + 0.1 * noise(n) + 0.1 * noise(b).repeat_interleave(seq_len)
        inp["ref_log_probs"] = lp + 0.1 * noise(n) if op.beta else None
        inp["document_index"] = torch.arange(n, device=device) // seq_len
    return inp


class GradSink(torch.autograd.Function):
    """Stands for the op that made the logits (the LM head): each step's logits are its output, a fresh tensor
    over the inputs' storage, and the gradient that reaches it is kept (``GradSink.last``), as the LM head's
    backward would hold it, without a copy. A leaf would not do: AccumulateGrad clones a gradient that aliases
    the leaf (in-place providers) and so would report memory that training never spends."""

    last = None

    @staticmethod
    def forward(ctx, x):
        # Not a view: autograd forbids in-place writes into views made inside a custom Function.
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx, grad):
        GradSink.last = grad
        return None


def head_output(base: torch.Tensor) -> torch.Tensor:
    """This step's logits: a non-leaf over `base`'s storage (see GradSink)."""
    return GradSink.apply(base)


def logits_restorer(provider, s: dict):
    """For a provider that writes its gradient into the logits: a function that puts the original logits
    back in `s["base"]` (a copy kept here), to run before each timed step, as a training step gets fresh
    logits from the LM head. None for the others."""
    if not provider.inplace:
        return None
    pristine = s["base"].detach().clone()

    def restore():
        with torch.no_grad():
            s["base"].copy_(pristine)

    return restore


# --------------------------------------------------------------------------------------------------------
# Providers: prepare(op, inp) -> state, whose "base" (requires grad) holds the logits; loss(op, state, logits)
# with logits = head_output(base), fresh each step; grad_rows(state, k) -> the gradient of the first k
# tokens (for the cross-provider check), read from GradSink.last after backward.
# --------------------------------------------------------------------------------------------------------

class Provider:
    name = "?"
    inplace = False  # writes the gradient into the logits' own storage
    bf16_loss = False  # returns its loss in the logits dtype (loose check)

    def supports(self, op: OpSpec) -> bool:
        return True

    def prepare(self, op: OpSpec, inp: dict) -> dict:
        s = dict(inp)
        s["base"] = s.pop("logits").requires_grad_(True)
        return s

    def loss(self, op: OpSpec, s: dict, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def grad_rows(self, s: dict, k: int) -> torch.Tensor | None:
        grad = GradSink.last
        return None if grad is None else grad.reshape(-1, grad.shape[-1])[:k].float().cpu()


class RlLosses(Provider):
    """`static_divisor`: CE and GRPO get their token count as a `divisor` (counted once, at prepare), as a
    trainer that knows its batch passes it; by default they count the labelled tokens on the device."""

    def __init__(self, inplace=False, static_divisor=False):
        import rl_losses

        self.rl = rl_losses
        self.inplace = inplace
        self.static_divisor = static_divisor
        self.name = "rl_losses_inplace" if inplace else "rl_losses"

    def prepare(self, op, inp):
        s = super().prepare(op, inp)
        s["divisor"] = float(max(int((s["target"] >= 0).sum()), 1)) if self.static_divisor else None
        return s

    def loss(self, op, s, logits):
        rl, ip = self.rl, self.inplace
        if op.kind == "ce":
            return rl.cross_entropy(logits, s["target"], inplace_backward=ip, divisor=s.get("divisor"))
        if op.kind == "grpo":
            return rl.grpo_loss(logits, s["target"], s["advantages"], s["old_log_probs"],
                                epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, ref_log_probs=s["ref_log_probs"],
                                beta=op.beta, divisor=s.get("divisor"), inplace_backward=ip).loss
        # num_documents and divisor given, as Fast-LLM does: no host sync for max(d)+1 or the document count.
        return rl.gspo_loss(logits, s["target"], s["advantages"], s["old_log_probs"], s["document_index"],
                            num_documents=s["num_seqs"], divisor=float(s["num_seqs"]), epsilon_low=EPS_LOW,
                            epsilon_high=EPS_HIGH, inplace_backward=ip).loss


def _eager_ce(logits, target):
    return F.cross_entropy(logits.float(), target)


class TorchEager(Provider):
    """F.cross_entropy (CE) or rl_losses.reference (GRPO/GSPO); `compiled` wraps the same under torch.compile."""

    def __init__(self, compiled=False):
        self.ref = load_reference()
        self.compiled = compiled
        self.name = "torch_compile" if compiled else "torch_eager"

    def make_fn(self, op, s):
        """The loss as a function of the tensors alone (options baked in, so torch.compile specialises on them)."""
        ref, beta, docs = self.ref, op.beta, s["num_seqs"]
        if op.kind == "ce":
            return _eager_ce
        if op.kind == "grpo":
            return lambda logits, target, adv, old, ref_lp, doc: ref.grpo_loss(
                logits, target, adv, old, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, ref_log_probs=ref_lp,
                beta=beta).loss
        return lambda logits, target, adv, old, ref_lp, doc: ref.gspo_loss(
            logits, target, adv, old, doc, num_documents=docs, divisor=docs, epsilon_low=EPS_LOW,
            epsilon_high=EPS_HIGH).loss

    def prepare(self, op, inp):
        s = super().prepare(op, inp)
        fn = self.make_fn(op, s)
        if self.compiled:
            torch._dynamo.reset()  # one fresh compile per case: no recompile limit, no dynamic-shape fallback
            fn = torch.compile(fn, dynamic=False)
        s["fn"] = fn
        return s

    def loss(self, op, s, logits):
        if op.kind == "ce":
            return s["fn"](logits, s["target"])
        return s["fn"](logits, s["target"], s["advantages"], s["old_log_probs"], s["ref_log_probs"],
                       s["document_index"])


class Reference(TorchEager):
    """rl_losses.reference for every op (the CPU section's 'eager PyTorch reference' for CE too)."""

    def __init__(self):
        super().__init__(compiled=False)
        self.name = "reference"

    def make_fn(self, op, s):
        if op.kind != "ce":
            return super().make_fn(op, s)
        ref = self.ref
        return lambda logits, target: ref.cross_entropy(logits, target)


def liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001
        return None


class Liger(Provider):
    """Liger-Kernel's Triton CE and GRPO/GSPO (see DEFINITION_NOTES for the mapping)."""

    def __init__(self, inplace=False):
        from liger_kernel.transformers.functional import liger_cross_entropy
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        self.ce, self.grpo = liger_cross_entropy, triton_grpo_loss
        self.inplace = inplace
        self.name = "liger_inplace" if inplace else "liger"

    def supports(self, op):
        # Liger's CE has no out-of-place mode: it is "liger" (in place) only.
        return not (op.kind == "ce" and self.inplace)

    def prepare(self, op, inp):
        if op.kind == "ce":
            s = super().prepare(op, inp)
            self.bf16_loss = s["base"].dtype in (torch.bfloat16, torch.float16)
            return s
        b, l, v = inp["num_seqs"], inp["seq_len"], inp["v"]
        logits = inp.pop("logits")
        # (B, L+1, V): Liger drops the last position of every sequence (HF's shifted logits).
        x = torch.empty(b, l + 1, v, dtype=logits.dtype, device=logits.device)
        x[:, :l].copy_(logits.view(b, l, v))
        x[:, l].copy_(logits.view(b, l, v)[:, 0])
        del logits
        target = inp["target"].view(b, l)
        s = {"base": x.requires_grad_(True), "ids": target.clamp_min(0), "adv": inp["advantages_seq"],
             "old": inp["old_log_probs"].view(b, l).contiguous(),
             "ref": None if inp.get("ref_log_probs") is None else inp["ref_log_probs"].view(b, l).contiguous(),
             "mask": (target >= 0).to(torch.int64), "seq_len": l}
        return s

    def loss(self, op, s, logits):
        if op.kind == "ce":
            return self.ce(logits, s["target"])
        level, loss_type = ("token", "bnpo") if op.kind == "grpo" else ("sequence", "grpo")
        loss, _metrics = self.grpo(logits, s["old"], s["ref"], s["ids"], s["adv"], s["mask"], temperature=1.0,
                                   beta=op.beta, eps_low=EPS_LOW, eps_high=EPS_HIGH, inplace=self.inplace,
                                   loss_type=loss_type, importance_sampling_level=level, reduce=True)
        return loss

    def grad_rows(self, s, k):
        grad = GradSink.last
        if grad is None:
            return None
        if grad.dim() == 3:  # (B, L+1, V): the first k tokens are rows 0..k-1 of sequence 0 (k <= L)
            grad = grad[0, :min(k, s["seq_len"])]
        return grad[:k].float().cpu()


PROVIDER_ORDER = ["rl_losses", "rl_losses_inplace", "torch_eager", "torch_compile", "reference", "liger",
                  "liger_inplace"]
# Peers that write the gradient in place are compared with rl_losses_inplace, the others with rl_losses.
COUNTERPART = {"liger_inplace": "rl_losses_inplace"}


def counterpart(provider: str, op: OpSpec) -> str:
    if provider == "liger" and op.kind == "ce":
        return "rl_losses_inplace"
    return COUNTERPART.get(provider, "rl_losses")


def build_provider(name: str) -> Provider:
    """The provider called `name`; raises (ImportError, ...) when it cannot be had here."""
    return {
        "rl_losses": lambda: RlLosses(False),
        "rl_losses_inplace": lambda: RlLosses(True),
        "torch_eager": lambda: TorchEager(False),
        "torch_compile": lambda: TorchEager(True),
        "reference": Reference,
        "liger": lambda: Liger(False),
        "liger_inplace": lambda: Liger(True),
    }[name]()


def check_agreement(loss: float, grad, ref_loss: float, ref_grad, loose: bool) -> tuple[bool, str]:
    """Does a provider compute the same function as the first one? Loss to 1e-3 relative (2e-2 when either
    side rounds its loss to bf16), the first gradient rows to 2e-2 relative norm (bf16 gradients)."""
    rtol = 2e-2 if loose else 1e-3
    ok = abs(loss - ref_loss) <= rtol * abs(ref_loss) + 1e-4 and loss == loss
    detail = f"loss {loss:.6g} vs {ref_loss:.6g}"
    if grad is not None and ref_grad is not None and grad.shape == ref_grad.shape:
        rel = float((grad - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30))
        ok = ok and rel <= 2e-2
        detail += f"; grad rel err {rel:.1e}"
    return ok, detail
