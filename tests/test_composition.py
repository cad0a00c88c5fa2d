"""Parallelisms composed across modules (issue 9, Acceptance) against the single process, fp32
(docs/architecture.md principle 1): a vision encoder at TP 2 x DP 2 (4 ranks, tensor
parallelism through `loom.runtime.tensor_parallel`) feeding an LLM at PP 2 x DP 2 with ZeRO 3
(4 ranks, FSDP2 through `loom.runtime.zero`), 8 gloo processes in one launch, one step: the
loss and every gradient (TP shards and FSDP shards gathered whole) equal the single-process
model's on the same global batch. ZeRO on one module beside TP on another; ZeRO with TP on the
same module is tests/test_zero.py's and tests/test_tensor_parallel.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from reference import assert_matches_reference, identity_step, reference_backward
from torch.distributed.tensor import DTensor

from loom.data.demo import DemoConfig
from loom.model.zoo import LlamaConfig, VisionConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.runtime.unit import is_sharded
from loom.train.build import build_data, build_model
from loom.train.config import ModelConfig, TrainConfig

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
SEED = 5
WORLD = 8


def _config() -> TrainConfig:
    model = ModelConfig(vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=2), audio=None,
                        llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                        intermediate_size=64),
                        projector="mlp")
    plan = Plan([ModuleSpec("vision", data_parallel=2, tensor_parallel=2),
                 ModuleSpec("llm", num_stages=2, data_parallel=2, zero_stage=3)], num_microbatches=4)
    cfg = TrainConfig(model=model, plan=plan)
    demo = DemoConfig(num_samples=64, seed=SEED, mix={"text": 0.3, "image": 0.7})
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A TP or FSDP shard gathered whole (a collective over its mesh: every rank of it calls
    this for the same parameters in the same order), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _worker(rank: int, world_size: int, out: str) -> None:
    cfg = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    _, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
    named = engine.stage.named_parameters()
    torch.save({"loss": loss, "grads": {n: _whole(p.grad) for n, p in named.items() if p.grad is not None},
                "no_grad": sorted(n for n, p in named.items() if p.grad is None),
                "module": engine.stage.module, "sharded": sum(is_sharded(p) for p in named.values()),
                "meshes": sorted({str(p.device_mesh.mesh_dim_names) for p in named.values() if is_sharded(p)})},
               Path(out) / f"rank{rank}.pt")
    engine.close()


def test_vision_tp2_dp2_feeding_llm_pp2_dp2_zero3_matches_the_single_process(tmp_path: Path) -> None:
    run_local(_worker, WORLD, str(tmp_path))
    cfg = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    ref_loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert_matches_reference(results, model, ref_loss)
    # every rank runs a module of the plan and holds it sharded the way its spec says
    modules = [res["module"] for res in results]
    assert modules.count("vision") == 4 and modules.count("llm") == 4, modules
    expected = {"vision": ["('tp',)"], "llm": ["('dp',)"]}  # TP shards on the encoder, FSDP shards on the LLM
    for r, res in enumerate(results):
        assert res["sharded"] > 0, f"rank {r}: its {res['module']} stage holds no shard"
        assert res["meshes"] == expected[res["module"]], f"rank {r} ({res['module']}) shards over {res['meshes']}"
