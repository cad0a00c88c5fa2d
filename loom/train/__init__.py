"""The training loop (the torchrun target) and its configuration."""
