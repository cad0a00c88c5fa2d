"""Gradient clipping by the global norm (issue 9 point 8, `optim.max_grad_norm`): in a pipelined
plan with data parallelism and a frozen stage, the norm every rank reports equals
``torch.nn.utils.clip_grad_norm_``'s on the single-process model, and the parameters after one
optimizer step equal that model's after ``clip_grad_norm_`` and the same optimizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model
from loom.train.config import ConfigError, OptimConfig, TrainConfig
from reference import identity_step, reference_backward
from test_parallel_reference import GLOBAL_BATCH, SEED, _config

MAX_NORM = 0.05  # below the batch's gradient norm (checked), so clipping scales
LR = 0.5  # plain SGD: the step is the clipped gradient itself (Adam would hide the scale)


def _clip_config() -> TrainConfig:
    cfg = _config("multimodal_1f1b")
    # the vision encoder frozen and alone on its first stage: a rank with no optimizer step,
    # which still joins the norm's all-reduce; the LLM pipelined and data-parallel
    cfg.model = dataclasses.replace(cfg.model, freeze=["vision.encoder"])
    cfg.plan = Plan([ModuleSpec("vision", num_stages=2, stage_boundaries=[0, 4, 5]), ModuleSpec("audio"),
                     ModuleSpec("llm", num_stages=2, data_parallel=2)], num_microbatches=4)
    return cfg


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _worker(rank: int, world_size: int, out: str) -> None:
    cfg = _clip_config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"), _sgd, max_grad_norm=MAX_NORM)
    result, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
    torch.save({"loss": loss, "grad_norm": result.grad_norm, "steps": engine.optimizer is not None,
                "params": {n: p.detach().clone() for n, p in engine.stage.named_parameters().items()}},
               Path(out) / f"rank{rank}.pt")
    engine.close()


@pytest.mark.multiprocess
def test_clipping_in_a_pipelined_data_parallel_plan_matches_clip_grad_norm(tmp_path: Path) -> None:
    world = 7
    run_local(_worker, world, str(tmp_path))
    cfg = _clip_config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    trainable = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM))
    assert norm > 2 * MAX_NORM  # clipping is active: the step is scaled
    _sgd(trainable).step()
    ref = dict(model.named_parameters())
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    assert not all(res["steps"] for res in results)  # some rank (the frozen stage) has no optimizer step
    seen = set()
    for r, res in enumerate(results):
        assert res["loss"] == pytest.approx(loss, rel=1e-5)
        assert res["grad_norm"] == pytest.approx(norm, rel=1e-5), f"rank {r} grad_norm"
        for name, value in res["params"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
    assert seen == set(ref)


def test_max_grad_norm_is_checked():
    cfg = TrainConfig()
    assert cfg.optim.max_grad_norm == 0.0  # off by default
    for bad in (-1.0, float("nan"), float("inf")):
        cfg.optim = OptimConfig(max_grad_norm=bad)
        with pytest.raises(ConfigError, match=r"optim.max_grad_norm = .*use 0 for no clipping"):
            cfg.check()
    cfg.optim = OptimConfig(max_grad_norm=1.0)
    cfg.check()
