"""Drop-ins for RL trainers: ``rl_losses.integrations.trl`` (TRL's GRPOTrainer) and
``rl_losses.integrations.verl`` (verl's fused log-prob/entropy kernel and policy-loss registry). Each imports
its trainer only when imported itself; docs/integrations/ says how to turn them on."""
