# The compiled library: importing it registers torch.ops.rl_losses.*; it exposes no Python names.
