"""ZeRO 1-3 and hybrid sharding (issue 9 point 5, `loom.runtime.zero`) against the single
process, fp32 (docs/architecture.md principle 1): per case, the loss and every gradient (FSDP's
sharded gradients gathered whole) without an optimizer, then the parameters after one
optimizer step (SGD with momentum: the step is the gradient's scale, which Adam would hide),
clipping included where the case sets a threshold below the batch's norm. One launch per world
size runs several cases; the 4-process one includes ZeRO 3 and ZeRO 1 with TP 2 on the same
module (FSDP2 on the (dp, tp) mesh; `ShardedStateOptimizer` over TP shards)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.runtime.zero import check_zero
from loom.train.build import build_data, build_model
from reference import assert_matches_reference, identity_step, reference_backward
from test_parallel_reference import GLOBAL_BATCH, SEED, _config

LR, MOMENTUM = 0.5, 0.9
MAX_NORM = 0.05  # below the batch's gradient norm (checked in the parent): clipping scales


def _case(case: str):
    """(config, max_grad_norm) of a case."""
    if case.startswith("dp2_zero"):  # LLM only, one stage, 2 replicas
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", data_parallel=2, zero_stage=int(case[-1]))], num_microbatches=4)
        return cfg, 0.0
    if case == "hybrid_2x2":  # 4 replicas: 2 shard groups of 2
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", data_parallel=4, zero_stage=3, shard_degree=2)], num_microbatches=4)
        return cfg, 0.0
    if case in ("pp2_dp2_zero3_clip", "pp2_dp2_zero3_zb-h1_clip", "pp2_dp2_zero2_zb-h1"):
        # zb-h1: the last stage splits its backward; FSDP reduces after its last weight pass
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", num_stages=2, data_parallel=2, zero_stage=3 if "zero3" in case else 2)],
                        num_microbatches=4, schedule="zb-h1" if "zb-h1" in case else "1f1b")
        return cfg, MAX_NORM if case.endswith("clip") else 0.0
    if case == "hybrid_tp2":  # hybrid sharding over TP shards: 2 shard groups of 1 replica, each TP 2
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", data_parallel=2, tensor_parallel=2, zero_stage=3, shard_degree=1)],
                        num_microbatches=4)
        return cfg, MAX_NORM
    if case == "pp2v2_dp2_zero1_clip":  # interleaved: one sharded optimizer over both chunks of a position
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", num_stages=4, virtual_stages=2, data_parallel=2, zero_stage=1)],
                        num_microbatches=4)
        return cfg, MAX_NORM
    if case.startswith("tp2_dp2_zero"):  # ZeRO over the TP shards of the same module, clipped
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", data_parallel=2, tensor_parallel=2, zero_stage=int(case[-1]))],
                        num_microbatches=4)
        return cfg, MAX_NORM
    if case == "frozen_encoder_zero3":  # vision encoder frozen, its projector trainable, both sharded
        cfg = _config("multimodal_1f1b")
        cfg.model = dataclasses.replace(cfg.model, audio=None, freeze=["vision.encoder"])
        cfg.data = dataclasses.replace(cfg.data, demo=dataclasses.replace(cfg.data.demo, mix={"text": 0.3, "image": 0.7}))
        cfg.plan = Plan([ModuleSpec("vision", data_parallel=2, zero_stage=3),
                         ModuleSpec("llm", data_parallel=2, zero_stage=2)], num_microbatches=4)
        return cfg, 0.0
    if case == "frozen_stage_zero3":  # the whole vision module frozen: its stage forwards only (no_grad)
        cfg, _ = _case("frozen_encoder_zero3")
        cfg.model = dataclasses.replace(cfg.model, freeze=["vision"])
        return cfg, 0.0
    raise KeyError(case)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole (a collective over its mesh), a plain one as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker(rank: int, world_size: int, cases: list[str], out: str) -> None:
    for case in cases:
        cfg, max_norm = _case(case)
        tokenizer, dataset = build_data(cfg)
        # gradients: no optimizer, so they stay for the check
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
        _, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
        named = engine.named_parameters()
        grads = {n: _whole(p.grad) for n, p in named.items() if p.grad is not None}
        engine.close()
        # one optimizer step (clipped where the case says)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"), _sgd, max_grad_norm=max_norm)
        result, _ = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
        params = {n: _whole(p.detach()).clone() for n, p in engine.named_parameters().items()}
        # ZeRO 1: how many parameters this rank's optimizer keeps state for (its own share)
        state = sum(1 for v in engine.optimizer.state.values() if v) if engine.optimizer is not None else 0
        optimizer = type(engine.optimizer).__name__
        engine.close()
        torch.save({"loss": loss, "grads": grads, "no_grad": sorted(n for n in named if n not in grads),
                    "params": params, "grad_norm": result.grad_norm,
                    "fsdp": any(isinstance(p, DTensor) for p in named.values()),
                    "meshes": sorted({str(p.device_mesh.mesh_dim_names) for p in named.values()
                                      if isinstance(p, DTensor)}),
                    "trainable": sum(p.requires_grad for p in named.values()), "state": state,
                    "optimizer": optimizer},
                   Path(out) / f"{case}.rank{rank}.pt")


def _check(case: str, world: int, out: Path) -> None:
    cfg, max_norm = _case(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    ref_loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    results = [torch.load(out / f"{case}.rank{r}.pt", weights_only=True) for r in range(world)]
    assert_matches_reference(results, model, ref_loss)
    if case == "frozen_stage_zero3":
        assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("vision")), \
            "the vision module should be frozen whole"
    zero = {m.name: m.zero_stage for m in cfg.plan.modules}
    if max(zero.values()) >= 2:
        assert any(r["fsdp"] for r in results), f"{case}: no rank's parameters are FSDP-sharded"
    if case == "hybrid_tp2":  # hybrid sharding over TP shards: 2 shard groups of 1 replica, each TP 2
        cfg = _config("llm_only_1f1b")
        cfg.plan = Plan([ModuleSpec("llm", data_parallel=2, tensor_parallel=2, zero_stage=3, shard_degree=1)],
                        num_microbatches=4)
        return cfg, MAX_NORM
    if case.startswith("tp2_dp2_zero"):
        # TP shards (and FSDP's on top of them under ZeRO 3) on the module's own mesh
        expected = ["('dp', 'tp')"] if case.endswith("3") else ["('tp',)"]
        assert all(r["meshes"] == expected for r in results), [r["meshes"] for r in results]
    if case == "hybrid_tp2":  # HSDP over TP shards: FSDP2's 3-D mesh from the hybrid mesh
        assert all(r["meshes"] == ["('dp_replicate', 'dp_shard', 'tp')"] for r in results), [r["meshes"] for r in results]
    if case == "tp2_dp2_zero1":  # optimizer state sharded over dp: each rank of a dp pair holds part of it
        assert {r["optimizer"] for r in results} == {"ShardedStateOptimizer"}
        for tp in (0, 1):  # ranks (tp, tp + 2) form a dp group (rank layout: dp outer, tp inner)
            pair = [results[tp], results[tp + 2]]
            assert sum(r["state"] for r in pair) == pair[0]["trainable"], [r["state"] for r in pair]
            assert all(0 < r["state"] < r["trainable"] for r in pair), [r["state"] for r in pair]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if max_norm:
        norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_norm))
        assert norm > max_norm, f"{case}: the batch's gradient norm {norm} is not above the threshold"
        for r, res in enumerate(results):
            assert res["grad_norm"] == pytest.approx(norm, rel=1e-5), f"{case} rank {r} grad norm"
    torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM).step()
    ref = dict(model.named_parameters())
    for r, res in enumerate(results):
        for name, value in res["params"].items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{case} rank {r} {name} after the step: {m}")


@pytest.mark.multiprocess
def test_zero_1_2_3_with_dp2_match_the_single_process(tmp_path: Path) -> None:
    cases = ["dp2_zero1", "dp2_zero2", "dp2_zero3"]
    run_local(_worker, 2, cases, str(tmp_path))
    for case in cases:
        _check(case, 2, tmp_path)


@pytest.mark.multiprocess
def test_hybrid_pipelined_clipped_frozen_and_tp_zero_match_the_single_process(tmp_path: Path) -> None:
    cases = ["hybrid_2x2", "pp2_dp2_zero3_clip", "frozen_encoder_zero3", "frozen_stage_zero3", "tp2_dp2_zero3",
             "tp2_dp2_zero1", "hybrid_tp2", "pp2_dp2_zero3_zb-h1_clip", "pp2_dp2_zero2_zb-h1", "pp2v2_dp2_zero1_clip"]
    run_local(_worker, 4, cases, str(tmp_path))
    for case in cases:
        _check(case, 4, tmp_path)


def test_zero_with_tp_on_one_module_is_accepted() -> None:
    """ZeRO 1-3 and hybrid sharding over a module's TP shards pass the check (and run: the cases
    above); hybrid sharding still needs ZeRO 2/3 (`loom.runtime.zero.check_zero`)."""
    for stage in (1, 2, 3):
        check_zero(ModuleSpec("llm", data_parallel=2, tensor_parallel=2, zero_stage=stage))
    check_zero(ModuleSpec("llm", data_parallel=4, tensor_parallel=2, zero_stage=3, shard_degree=2))
    with pytest.raises(PlanError, match=r"plan.modules\['llm'\].shard_degree = 2 needs zero_stage 2 or 3"):
        check_zero(ModuleSpec("llm", data_parallel=4, tensor_parallel=2, zero_stage=1, shard_degree=2))
