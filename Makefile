# The two commands of the README's quick start. Each sets everything up first (scripts/setup.sh).
.PHONY: setup train test

setup:
	bash scripts/setup.sh

# The main job: a small policy trained with GRPO on a verifiable task (see examples/train_policy.py).
train: setup
	.venv/bin/python examples/train_policy.py

test: setup
	.venv/bin/python -m pytest tests -q
