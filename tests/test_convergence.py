"""The demo model learns: a short deterministic single-process run on the demo data lowers the
loss. Model, data and optimizer settings are those of ``configs/demo.toml`` (AdamW with betas
(0.9, 0.95), linear warmup then cosine decay, from `loom.train.rank` as every rank of a run builds them); only the number
of steps and the batch size are cut, so it runs in seconds on one CPU thread."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.data.collate import collate
from loom.data.sampler import GlobalBatchSampler
from loom.train.build import build_data, build_model, token_counters
from loom.train.config import load_config
from loom.train.rank import make_lr_scheduler, make_optimizer

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
STEPS = 20
BATCH = 8
TARGET = 0.7  # final loss at most this fraction of the first


def test_demo_model_loss_falls_to_at_most_0_7_of_its_start():
    cfg = load_config(DEMO, [f"run.steps={STEPS}", f"data.global_batch_size={BATCH}"])
    torch.manual_seed(cfg.run.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
        counts = token_counters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(cfg.optim)(params)
        scheduler = make_lr_scheduler(cfg, optimizer)
        sampler = GlobalBatchSampler(len(dataset), cfg.data.global_batch_size, seed=cfg.run.seed)
        losses = []
        for step in range(STEPS):
            batch = collate([dataset[i] for i in sampler.batch(step)], tokenizer, counts)
            loss = model.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # the end: the mean of the last 5 steps (different batches), so one easy batch cannot pass it
    end = sum(losses[-5:]) / 5
    assert end <= TARGET * losses[0], f"loss {losses[0]:.3f} -> {end:.3f} (last 5 steps); {losses}"
