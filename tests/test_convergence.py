"""The demo model learns: a short deterministic single-process run on the demo data lowers the
loss. Model, data and optimizer settings are those of ``configs/demo.toml`` (AdamW with betas
(0.9, 0.95), linear warmup then cosine decay, from `loom.train.rank` as every rank of a run builds them); only the number
of steps and the batch size are cut, so it runs in seconds on one CPU thread."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.train.config import load_config
from reference import single_process_losses

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
STEPS = 20
BATCH = 8
TARGET = 0.7  # final loss at most this fraction of the first


def test_demo_model_loss_falls_to_at_most_0_7_of_its_start():
    cfg = load_config(DEMO, [f"run.steps={STEPS}", f"data.global_batch_size={BATCH}"])
    torch.manual_seed(cfg.run.seed)
    losses = single_process_losses(cfg)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # the end: the mean of the last 5 steps (different batches), so one easy batch cannot pass it
    end = sum(losses[-5:]) / 5
    assert end <= TARGET * losses[0], f"loss {losses[0]:.3f} -> {end:.3f} (last 5 steps); {losses}"
