"""`loom.train.rank`: the builder `loom train` and the benchmarks share. Two ranks (an LLM in two
pipeline stages) run `RankRun.step` twice; the losses of both steps and the parameters after
them equal one process training the same model on the same batches with the run's optimizer
(AdamW with ``optim.weight_decay`` and betas 0.9/0.95) and LR schedule, so the step holds the
dispatch, the optimizer and the scheduler exactly once each. A second run of the same config
evaluates its held-out split (``data.eval_samples``) before, between and after the steps:
its evaluation losses equal the one-process model's on that split, and its training equals the
first run's bit for bit (an evaluation changes no state)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.data.collate import collate
from loom.data.demo import DemoConfig
from loom.model.zoo import LlamaConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model, num_targets, token_counters
from loom.train.config import ModelConfig, TrainConfig
from loom.train.rank import ADAM_BETAS, build_rank, lr_lambda, make_lr_scheduler, make_optimizer

pytestmark = pytest.mark.multiprocess

WORLD = 2
STEPS = 2
EVAL = 8  # data.eval_samples


def _config() -> TrainConfig:
    model = ModelConfig(vision=None, audio=None, llm=LlamaConfig(hidden_size=32, num_layers=2, num_heads=4,
                                                                 num_kv_heads=2, intermediate_size=64))
    cfg = TrainConfig(model=model, plan=Plan([ModuleSpec("llm", num_stages=WORLD)], num_microbatches=4))
    cfg.run = dataclasses.replace(cfg.run, seed=3, steps=4)
    # weight decay and a warmup of 2 steps: a step that left out either would change the second step
    cfg.optim = dataclasses.replace(cfg.optim, lr=1e-2, weight_decay=0.1, warmup_steps=2)
    # the last 8 samples held out (run.eval_every): the sampler draws from the first 56
    cfg.run = dataclasses.replace(cfg.run, eval_every=1)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=8, eval_samples=EVAL,
                                   demo=DemoConfig(num_samples=64, seed=3, mix={"text": 1.0}))
    return cfg.check()


def _worker(rank: int, world_size: int, out: str) -> None:
    cfg = _config()
    run = build_rank(cfg, torch.device("cpu"))
    steps = [run.step(i) for i in range(STEPS)]
    group = run.optimizer.param_groups[0] if run.optimizer is not None else {}
    evaluated = build_rank(cfg, torch.device("cpu"))  # the same run, evaluated around every step
    evals = [evaluated.evaluate(0)]
    steps_e = []
    for i in range(STEPS):
        steps_e.append(evaluated.step(i))
        evals.append(evaluated.evaluate(i))
    torch.save({
        "evals": [e["llm"] for e in evals],
        "losses_e": [s.loss for s in steps_e],
        "params_e": {n: p.detach().clone() for n, p in evaluated.engine.stage.named_parameters().items()},
        "losses": [s.loss for s in steps],
        "indices": [[int(i) for i in s.indices] for s in steps],
        "lr": group.get("lr"), "betas": group.get("betas"), "weight_decay": group.get("weight_decay"),
        "params": {n: p.detach().clone() for n, p in run.engine.stage.named_parameters().items()},
    }, Path(out) / f"rank{rank}.pt")
    evaluated.close()
    run.close()


def test_rank_steps_match_one_process_with_the_runs_optimizer_and_schedule(tmp_path: Path) -> None:
    run_local(_worker, WORLD, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    cfg = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    optimizer = make_optimizer(cfg.optim)([p for p in model.parameters() if p.requires_grad])
    scheduler = make_lr_scheduler(cfg, optimizer)
    held_out = list(range(64 - EVAL, 64))
    assert not set(held_out) & {i for step in results[0]["indices"] for i in step}, "the split is never trained on"

    def evaluate() -> float:
        with torch.no_grad():
            batch = collate([dataset[i] for i in held_out], tokenizer, token_counters(model))
            return float(model.loss(batch, sum(num_targets(dataset.meta(i)) for i in held_out)))

    losses, evals = [], [evaluate()]
    for indices in results[0]["indices"]:
        batch = collate([dataset[i] for i in indices], tokenizer, token_counters(model))
        loss = model.loss(batch, sum(num_targets(dataset.meta(i)) for i in indices))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        evals.append(evaluate())

    ref = dict(model.named_parameters())
    seen = set()
    for r, res in enumerate(results):
        assert res["losses"] == pytest.approx(losses, rel=1e-5), f"rank {r}: the global loss of each step"
        assert res["evals"] == pytest.approx(evals, rel=1e-5), f"rank {r}: the split's mean token loss"
        assert res["losses_e"] == res["losses"], f"rank {r}: an evaluation changed the training's losses"
        for name, p in res["params"].items():
            assert torch.equal(res["params_e"][name], p), f"rank {r} {name}: an evaluation changed the training"
        assert res["betas"] == ADAM_BETAS and res["weight_decay"] == cfg.optim.weight_decay
        assert res["lr"] == pytest.approx(cfg.optim.lr * lr_lambda(cfg)(STEPS)), "one scheduler step per step"
        for name, p in res["params"].items():
            # atol 1e-5: Adam divides by sqrt(v), so an element whose gradient is near 0 moves by up
            # to lr x its rounding noise's sign; a wrong step moves elements by ~lr = 1e-2
            torch.testing.assert_close(p, ref[name].detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(ref), f"parameters no rank holds: {sorted(set(ref) - seen)}"
    assert results[0]["indices"] == results[1]["indices"]  # the seeded sampler, the same on every rank
