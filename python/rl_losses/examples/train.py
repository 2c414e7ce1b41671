"""Train a small causal transformer with GRPO or GSPO on a task with a verifiable reward: sort digits.

The prompt is ``BOS d_1 … d_k SEP`` (k random digits, k varying per prompt); the policy must answer with the k
digits in ascending order; the reward is the fraction of answer positions that are right (a random policy
scores about 1/12). Each step samples a group of completions per prompt, normalises the rewards within each
group into advantages, packs the documents with ``rl_losses.pack_documents`` and optimises the loss module
built from ``rl_losses.config`` (``--updates-per-batch`` gradient steps per sampled batch, so the importance
ratios move away from 1 and the clipping matters).

    python -m rl_losses.examples.train --loss gspo --steps 300 --seed 0   # or: python examples/train_policy.py

Writes ``metrics.csv`` and ``reward.png`` (when matplotlib is importable) to ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rl_losses import Document, LanguageModelLossConfig, pack_documents

NUM_DIGITS = 10
BOS, SEP = 10, 11
VOCAB_SIZE = 12


# ---- the policy -------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, heads, t, head_dim)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, dim))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """A pre-norm GPT over packed rows: (B, T) token ids -> (B, T, V) logits, attending causally within each
    document only (a block-diagonal mask from ``document_index``; positions restart per document). Without
    ``document_index``/``position_ids`` each row is one sequence (used for sampling); (N,) inputs are one row."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size)

    def forward(self, input_ids, position_ids=None, document_index=None):
        packed = input_ids.dim() == 1
        if packed:
            input_ids, position_ids, document_index = input_ids[None], position_ids[None], document_index[None]
        t = input_ids.shape[1]
        idx = torch.arange(t, device=input_ids.device)
        mask = idx[None, :] <= idx[:, None]  # causal, (t, t)
        if position_ids is None:
            position_ids = idx.expand_as(input_ids)
        if document_index is not None:
            # Padding (index -1) attends to earlier padding only: never an empty row, so no NaN.
            mask = mask & (document_index[:, :, None] == document_index[:, None, :])
            mask = mask[:, None]  # (b, 1, t, t): the same for every head
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.norm(x))
        return logits[0] if packed else logits


# ---- the task ---------------------------------------------------------------------------------------------------
def make_prompts(n: int, min_len: int, max_len: int, generator: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator).tolist()
    return [[BOS] + torch.randint(0, NUM_DIGITS, (k,), generator=generator).tolist() + [SEP] for k in lengths]


def reward(prompt: list[int], completion: list[int]) -> float:
    """Fraction of answer positions holding the right digit of the sorted prompt."""
    target = sorted(prompt[1:-1])
    return sum(a == b for a, b in zip(completion, target)) / len(target)


@torch.no_grad()
def generate(model: TinyCausalLM, prompts: list[list[int]], generator: torch.Generator | None,
             device: torch.device) -> tuple[list[list[int]], list[list[float]]]:
    """Sample (or, with generator=None, greedily decode) len(prompt) - 2 tokens after each prompt.

    Returns the completions and the log-prob of each sampled token (the ``old_log_probs`` of the update). The
    prompts are batched by length (so no padding), and each step re-runs the whole prefix (no KV cache: the
    sequences are ~10 tokens long).
    """
    completions: list[list[int]] = [[] for _ in prompts]
    log_probs: list[list[float]] = [[] for _ in prompts]
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        tokens = torch.tensor([prompts[i] for i in rows], device=device)
        token_logps = []
        for _ in range(length - 2):
            logp = torch.log_softmax(model(tokens)[:, -1].float(), dim=-1)
            if generator is None:
                new = logp.argmax(-1)
            else:
                new = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(-1).to(device)
            token_logps.append(logp.gather(-1, new[:, None]))
            tokens = torch.cat([tokens, new[:, None]], dim=1)
        sampled = tokens[:, length:].tolist()
        sampled_logps = torch.cat(token_logps, dim=1).tolist()
        for j, i in enumerate(rows):
            completions[i], log_probs[i] = sampled[j], sampled_logps[j]
    return completions, log_probs


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std (+1e-4: equal rewards -> 0)."""
    grouped = rewards.view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def evaluate(model, prompts, device) -> float:
    completions, _ = generate(model, prompts, None, device)
    return sum(reward(p, c) for p, c in zip(prompts, completions)) / len(prompts)


# ---- output helpers ---------------------------------------------------------------------------------------------
def progress(iterable, total: int, disable: bool):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, disable=disable, dynamic_ncols=True)
    except ImportError:
        return _SimpleProgress(iterable, total, disable)


class _SimpleProgress:
    """Fallback when tqdm is missing: a line every ~10% of the steps."""

    def __init__(self, iterable, total, disable):
        self.iterable, self.total, self.disable, self.postfix = iterable, total, disable, ""

    def __iter__(self):
        every = max(1, self.total // 10)
        for i, item in enumerate(self.iterable):
            yield item
            if not self.disable and ((i + 1) % every == 0 or i + 1 == self.total):
                print(f"step {i + 1}/{self.total} {self.postfix}", flush=True)

    def set_postfix_str(self, text):
        self.postfix = text

    def close(self):
        pass


def plot_rewards(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the reward plot (pip install matplotlib)")
        return False
    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    window = max(1, len(rows) // 20)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.3, label="mean reward per step")
    ax.plot(steps, smooth, label=f"moving average ({window} steps)")
    ax.set(xlabel="step", ylabel="reward", title=title, ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- training -----------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--loss", choices=["grpo", "gspo"], default="grpo", help="policy loss")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model and the loss run")
    p.add_argument("--use-cuda-kernel", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                   help="auto: the extension's op wherever it runs; true (or the bare flag): require the CUDA "
                        "kernel; false: the pure-PyTorch reference")
    p.add_argument("--steps", type=int, default=300, help="sampling + update rounds")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the prompts and the sampling")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts (groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt")
    p.add_argument("--updates-per-batch", type=int, default=2, help="gradient steps per sampled batch")
    p.add_argument("--min-digits", type=int, default=2, help="shortest prompt")
    p.add_argument("--max-digits", type=int, default=5, help="longest prompt")
    p.add_argument("--sequence-length", type=int, default=64, help="tokens per packed row")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--epsilon-low", type=float, default=0.2, help="clip below at 1 - epsilon_low")
    p.add_argument("--epsilon-high", type=float, default=0.28, help="clip above at 1 + epsilon_high")
    p.add_argument("--eval-prompts", type=int, default=256, help="held-out prompts, decoded greedily")
    p.add_argument("--out", type=Path, default=Path("examples/out"), help="where metrics.csv and reward.png go")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads: the model is too small to gain from intra-op parallelism, and extra "
                        "threads slow it down badly when other work shares the cores")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return train(args)
    finally:
        torch.set_num_threads(threads)  # main() may be called from a larger program (or a test)


def train(args: argparse.Namespace) -> dict:
    """The training loop; returns the start/end rewards, the run time and the per-step metric rows."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    use_cuda_kernel = {"auto": None, "true": True, "false": False}[args.use_cuda_kernel]

    # The loss goes through the config layer, as a Fast-LLM user would write it in YAML.
    loss_config = LanguageModelLossConfig.from_dict({
        "type": args.loss, "epsilon_low": args.epsilon_low, "epsilon_high": args.epsilon_high,
        "metrics": "basic", "use_cuda_kernel": use_cuda_kernel})
    loss_fn = loss_config.get_loss(name=args.loss)
    model = TinyCausalLM(max_len=args.max_digits * 2 + 2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    eval_prompts = make_prompts(args.eval_prompts, args.min_digits, args.max_digits,
                                torch.Generator().manual_seed(args.seed + 1))
    start_eval = evaluate(model, eval_prompts, device)
    implementation = "extension op" if loss_fn.uses_kernel(torch.empty(0, device=device)) else "pure-PyTorch reference"
    print(f"{args.loss.upper()} on {device} ({implementation}), {sum(p.numel() for p in model.parameters())} "
          f"parameters, {args.steps} steps of {args.prompts_per_step}x{args.group_size} completions")

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.perf_counter()
    bar = progress(range(args.steps), args.steps, args.quiet)
    for step in bar:
        model.eval()
        prompts = [p for p in make_prompts(args.prompts_per_step, args.min_digits, args.max_digits, gen)
                   for _ in range(args.group_size)]
        completions, old_log_probs = generate(model, prompts, gen, device)
        rewards = torch.tensor([reward(p, c) for p, c in zip(prompts, completions)])
        advantages = group_advantages(rewards, args.group_size)
        # Rows of --sequence-length tokens: attention costs B·T² rather than N² for one flat row.
        batch = pack_documents([Document(p, c, a, old_log_probs=lp) for p, c, a, lp in
                                zip(prompts, completions, advantages.tolist(), old_log_probs)],
                               sequence_length=args.sequence_length, device=device)

        model.train()
        for _ in range(args.updates_per_batch):
            logits = model(batch["input_ids"], batch["position_ids"], batch["document_index"])
            loss, metrics = loss_fn(logits, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()

        row = {"step": step, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
               "time_s": time.perf_counter() - started}
        # Metrics of the last update: its ratio has moved from 1, so the clip fractions are informative.
        row.update({k: float(v) for k, v in metrics.items()})
        rows.append(row)
        bar.set_postfix_str(f"reward {row['reward_mean']:.3f} loss {row[args.loss]:+.4f}")
    bar.close()
    elapsed = time.perf_counter() - started
    end_eval = evaluate(model, eval_prompts, device)

    with open(args.out / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)
    plotted = plot_rewards(rows, args.out / "reward.png", f"{args.loss.upper()} on digit sorting") if rows else False

    window = max(1, min(10, len(rows) // 4))
    first = sum(r["reward_mean"] for r in rows[:window]) / max(1, len(rows[:window]))
    last = sum(r["reward_mean"] for r in rows[-window:]) / max(1, len(rows[-window:]))
    print(f"sampled reward: {first:.3f} (first {window} steps) -> {last:.3f} (last {window} steps)")
    print(f"greedy reward on {len(eval_prompts)} held-out prompts: {start_eval:.3f} -> {end_eval:.3f}")
    print(f"{elapsed:.1f} s; wrote {args.out / 'metrics.csv'}" + (f" and {args.out / 'reward.png'}" if plotted else ""))
    return {"start_reward": first, "end_reward": last, "start_eval": start_eval, "end_eval": end_eval,
            "seconds": elapsed, "rows": rows}


if __name__ == "__main__":
    main()
