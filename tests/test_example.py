"""The training example (rl_losses.examples.train) runs a few steps on the CPU and writes its outputs.

Its reward trend is checked by the full default run (about two minutes), recorded in the report, not here.
"""
import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_losses import Document, LanguageModelLossConfig, pack_documents
from rl_losses.examples import train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-prompts", "8", "--quiet"]


def _has_cpu_kernel(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_losses::_{op}_forward", "CPU")
    except RuntimeError:
        return False


@pytest.mark.parametrize("use_cuda_kernel", ["auto", "false"])
@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_runs_and_writes_outputs(tmp_path, loss, use_cuda_kernel):
    if use_cuda_kernel == "auto" and not _has_cpu_kernel(loss):
        pytest.skip(f"rl_losses::_{loss}_forward has no CPU kernel in this build yet")
    result = train.main(SMALL + ["--loss", loss, "--use-cuda-kernel", use_cuda_kernel, "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for key in ("reward_mean", loss, f"{loss}_new_logprobs", f"{loss}_clipped_ratio_fraction", f"{loss}_kl_new_old"):
        assert all(torch.isfinite(torch.tensor(float(r[key]))) for r in rows), key
    assert 0.0 <= result["start_reward"] <= 1.0 and 0.0 <= result["end_eval"] <= 1.0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "reward.png").stat().st_size > 0


def test_use_cuda_kernel_true_on_cpu_fails_clearly(tmp_path):
    with pytest.raises(RuntimeError, match="use_cuda_kernel=True requires the CUDA kernel"):
        train.main(SMALL + ["--use-cuda-kernel", "--out", str(tmp_path)])


def test_sampled_log_probs_are_the_training_log_probs():
    """The sampler's per-token log-probs, packed as old_log_probabilities, equal the packed training forward's:
    the first update's importance ratios are exactly 1 (checks the model's packed masks and the label shift)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = train.TinyCausalLM(max_len=12).eval()
    prompts = train.make_prompts(12, 2, 5, gen)
    completions, log_probs = train.generate(model, prompts, gen, torch.device("cpu"))
    assert [len(c) for c in completions] == [len(p) - 2 for p in prompts]
    batch = pack_documents([Document(p, c, 1.0, old_log_probs=lp) for p, c, lp in zip(prompts, completions, log_probs)],
                           sequence_length=32)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_index"])
    module = LanguageModelLossConfig.from_dict({"type": "grpo", "metrics": "basic",
                                                "use_cuda_kernel": False}).get_loss()
    _, metrics = module(logits, batch)
    mask = batch["labels"] >= 0
    lp = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp_min(0)[..., None]).squeeze(-1)
    torch.testing.assert_close(lp[mask], batch["old_log_probabilities"][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["grpo_ratio_new_old"].item(), 1.0, rtol=1e-5, atol=1e-5)
    assert metrics["grpo_clipped_ratio_fraction"].item() == 0.0


def test_reward_and_advantages():
    assert train.reward([train.BOS, 3, 1, 2, train.SEP], [1, 2, 3]) == 1.0
    assert train.reward([train.BOS, 3, 1, 2, train.SEP], [1, 3, 2]) == pytest.approx(1 / 3)
    adv = train.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0  # equal rewards in a group carry no signal


def test_launcher_script(tmp_path):
    """examples/train_policy.py is a thin launcher of the same main()."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_policy.py"), "--steps", "1",
                          "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4", "--quiet",
                          "--use-cuda-kernel", "false", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "greedy reward on 4 held-out prompts" in out.stdout
    assert (tmp_path / "metrics.csv").exists()
