"""Runnable examples: ``python -m rl_losses.examples.train`` trains a small policy with GRPO or GSPO."""
