"""Train a small policy with GRPO or GSPO on digit sorting: a launcher for ``python -m rl_losses.examples.train``.

    python examples/train_policy.py --loss gspo --steps 150 --seed 0
"""
from rl_losses.examples.train import main

if __name__ == "__main__":
    main()
