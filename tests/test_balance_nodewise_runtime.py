"""A layout that node-wise rearrangement permuted trains exactly as the single-process model:
4 LLM replicas on 2 nodes of 2 ranks, OrchMLLM with ``balance.ranks_per_node = 2``, through the
dispatcher (which needs no change: the permutation is part of the layout)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.balance.config import BalanceConfig
from loom.balance.policy import make_layout, sample_costs
from loom.cost.arch_from_model import arch_from_model
from loom.data.collate import collate
from loom.data.demo import DemoConfig
from loom.model.zoo import LlamaConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.dispatch import Dispatcher
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model, num_targets, token_counters
from loom.train.config import ModelConfig, TrainConfig
from oracles import cross_node_send
from reference import assert_matches_reference, save_rank

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 16
SEED = 7
WORLD = 4


def _config() -> tuple[TrainConfig, BalanceConfig]:
    model = ModelConfig(vision=None, audio=None, llm=LlamaConfig(hidden_size=32, num_layers=2, num_heads=4,
                                                                 num_kv_heads=2, intermediate_size=64))
    cfg = TrainConfig(model=model, plan=Plan([ModuleSpec("llm", data_parallel=WORLD)], num_microbatches=WORLD))
    demo = DemoConfig(num_samples=64, seed=SEED, mix={"text": 1.0})
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg, BalanceConfig(default="orchmllm", min_gain=float("-inf"), ranks_per_node=2)


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    cfg, balance = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, token_counters(model), arch_from_model(model), balance,
                            torch.device("cpu"))
    got = dispatcher.dispatch(list(range(GLOBAL_BATCH)))
    result = engine.step(got.batches, got.num_targets, layout=got.layout, rows=got.rows)
    loss = torch.tensor([result.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    save_rank(Path(out) / f"rank{rank}.pt", float(loss), engine.stage.named_parameters(),
              role=cfg.plan.role_of(rank), samples={j: list(b.sample_ids) for j, b in got.batches.items()})


def test_permuted_layout_matches_single_process_and_saves_cross_node_bytes(tmp_path: Path) -> None:
    cfg, balance = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    cfg.plan.resolve(model.layer_counts())
    costs = sample_costs(arch_from_model(model), [dataset.meta(i) for i in range(GLOBAL_BATCH)])
    layout = make_layout(balance, cfg.plan, costs)
    rec = layout.nodewise["llm"]
    assert rec["rounds_permuted"] == 1, rec  # the case really permutes
    sent = [float(cross_node_send(cfg.plan, layout, "llm", costs.payload_bytes["llm"], 2, p).sum()) for p in (True, False)]
    assert sent[0] < sent[1] and sent == pytest.approx(rec["cross_node_bytes"][::-1])

    run_local(_worker, WORLD, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    batch = collate([dataset[i] for i in range(GLOBAL_BATCH)], tokenizer, token_counters(model))
    loss = model.loss(batch, sum(num_targets(dataset.meta(i)) for i in range(GLOBAL_BATCH)))
    loss.backward()
    assert_matches_reference(results, model, float(loss.detach()))
    # each rank ran the slots the permuted layout gave its replica
    for r in results:
        replica = r["role"][2]
        want = {j: [dataset.meta(s).sample_id for s in layout.slot("llm", j)] for j in range(WORLD) if j % WORLD == replica}
        assert {int(j): list(v) for j, v in r["samples"].items()} == want
