"""Tensor parallelism with sequence parallelism (issue 9 point 3, `loom.runtime.tensor_parallel`)
on pipeline units of several ranks (`loom.runtime.unit`): on gloo, the loss and every gradient
(gathered from the TP shards) equal the single-process model's on the same global batch, fp32.

One launch per case, several checks each: the LLM alone under TP 2 (selective recompute);
TP 2 x PP 2 (full recompute) with gradient clipping active (the norm counts every shard once and every replicated parameter once per unit);
the audio encoder under TP 2 (head-wise qkv) feeding an LLM in two stages, in the same launch;
a vision encoder in two stages under TP 2 (rank-to-rank messages between its stages) feeding an
LLM in two stages (its output from the unit's leader, gradients back to every encoder rank); a
frozen encoder with a trainable projector under TP 2 x DP 2 with ZeRO 3 (FSDP2 over the TP
shards) feeding an LLM at TP 2 (the leader sends to every rank of the receiving unit), clipped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from loom.data.demo import DemoConfig
from loom.model.zoo import AudioConfig, LlamaConfig, VisionConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.runtime.unit import is_sharded
from loom.train.build import bubble_filler, build_data, build_model
from loom.train.config import ModelConfig, TrainConfig
from reference import assert_matches_reference, identity_step, reference_backward

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
SEED = 5
MAX_NORM = 0.05  # below the batch's gradient norm (checked), so clipping scales the gradients


def _config(case: str) -> TrainConfig:
    llm = LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model = ModelConfig(vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=2), audio=None, llm=llm,
                        projector="mlp")
    demo = DemoConfig(num_samples=64, seed=SEED, mix={"text": 0.4, "image": 0.6})
    if case == "llm_tp2":
        model = dataclasses.replace(model, vision=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        plan = Plan([ModuleSpec("llm", tensor_parallel=2, recompute="selective")], num_microbatches=2)
    elif case == "llm_tp2_pp2_clip":
        model = dataclasses.replace(model, vision=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        plan = Plan([ModuleSpec("llm", num_stages=2, tensor_parallel=2, recompute="full")], num_microbatches=4)
    elif case == "llm_tp2_pp2_zb-h1_clip":  # ZB-H1's split backward on DTensor stages, recompute, loss
        model = dataclasses.replace(model, vision=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        plan = Plan([ModuleSpec("llm", num_stages=2, tensor_parallel=2, recompute="full")], num_microbatches=4,
                    schedule="zb-h1")
    elif case == "llm_tp2_pp2v2_clip":  # interleaved 1F1B over TP units: 2 positions x 2 chunks
        model = dataclasses.replace(model, vision=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        plan = Plan([ModuleSpec("llm", num_stages=4, virtual_stages=2, tensor_parallel=2, recompute="full")],
                    num_microbatches=4)
    elif case == "first_stage_tp2":  # the vision encoder inside the LLM's TP 2 unit (Megatron-LM's layout)
        plan = Plan([ModuleSpec("vision", tensor_parallel=2), ModuleSpec("llm", tensor_parallel=2)],
                    num_microbatches=2, placement="first_stage")
    elif case == "colocated_tp2_clip":  # a vision replica at TP 2 on each TP 2 unit of a 2-stage LLM, the fill on
        plan = Plan([ModuleSpec("vision", data_parallel=2, tensor_parallel=2),
                     ModuleSpec("llm", num_stages=2, tensor_parallel=2)], num_microbatches=4,
                    placement="colocated", bubble_fill="optimus")
    elif case == "colocated_lanes":  # vision at TP 1 x DP 4, one replica per rank, beside an LLM TP 2 x PP 2
        plan = Plan([ModuleSpec("vision", data_parallel=4), ModuleSpec("llm", num_stages=2, tensor_parallel=2)],
                    num_microbatches=4, placement="colocated", bubble_fill="optimus")
    elif case == "vision_tp2":
        plan = Plan([ModuleSpec("vision", num_stages=2, stage_boundaries=[0, 2, 5], tensor_parallel=2),
                     ModuleSpec("llm", num_stages=2)],
                    num_microbatches=4)
    elif case == "audio_tp2":
        model = dataclasses.replace(model, vision=None, audio=AudioConfig(hidden_size=32, num_layers=2, num_heads=2))
        demo = dataclasses.replace(demo, mix={"text": 0.3, "audio": 0.7})
        plan = Plan([ModuleSpec("audio", tensor_parallel=2), ModuleSpec("llm", num_stages=2)], num_microbatches=4)
    elif case == "frozen_tp_zero3_clip":
        model = dataclasses.replace(model, freeze=["vision.encoder"])
        plan = Plan([ModuleSpec("vision", data_parallel=2, tensor_parallel=2, zero_stage=3),
                     ModuleSpec("llm", tensor_parallel=2)], num_microbatches=4)
    else:
        raise KeyError(case)
    cfg = TrainConfig(model=model, plan=plan)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


# one launch per world size (its cases run one after another in the same processes)
LAUNCHES = {"llm_tp2": (2, ["llm_tp2", "first_stage_tp2"]), "llm_tp2_pp2_clip+audio_tp2": (4, ["llm_tp2_pp2_clip", "audio_tp2", "llm_tp2_pp2_zb-h1_clip",
                                                           "llm_tp2_pp2v2_clip", "colocated_tp2_clip",
                                                           "colocated_lanes"]),
            "vision_tp2": (6, ["vision_tp2"]), "frozen_tp_zero3_clip": (6, ["frozen_tp_zero3_clip"])}


def _full_grads(named: dict[str, torch.nn.Parameter]) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """Gradients gathered from the TP shards (a collective over the unit: every rank of it
    calls this with the same parameters), the names without one, how many parameters are
    sharded."""
    grads = {}
    sharded = sum(is_sharded(p) for p in named.values())
    for name, p in named.items():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            grads[name] = p.grad.full_tensor().clone()
        else:
            grads[name] = p.grad.clone()
    return grads, sorted(n for n, p in named.items() if p.grad is None), sharded


def _worker(rank: int, world_size: int, cases: list[str], out: str) -> None:
    for case in cases:
        cfg = _config(case)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        clip = MAX_NORM if case.endswith("clip") else 0.0
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"), max_grad_norm=clip)
        if cfg.plan.bubble_fill != "none":  # as loom train sets it
            engine.schedule_transform = bubble_filler(cfg, model, dataset, engine.plan)
        # two steps: the second reuses what the first taught each channel (headers dropped)
        for step in range(2):
            for p in engine.named_parameters().values():
                p.grad = None
            result, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH, step)
        named = engine.named_parameters()
        grads, no_grad, sharded = _full_grads(named)
        meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in named.values() if is_sharded(p)})
        torch.save({"loss": loss, "grads": grads, "no_grad": no_grad, "sharded": sharded,
                    "grad_norm": result.grad_norm, "module": engine.stage.module, "meshes": meshes},
                   Path(out) / f"{case}.rank{rank}.pt")
        engine.close()


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_tensor_parallel_matches_single_process(launch: str, tmp_path: Path) -> None:
    world, cases = LAUNCHES[launch]
    run_local(_worker, world, cases, str(tmp_path))
    for case in cases:
        _check(case, world, tmp_path)


def _check(case: str, world: int, out: Path) -> None:
    cfg = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    ref_loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    results = [torch.load(out / f"{case}.rank{r}.pt", weights_only=True) for r in range(world)]
    if case.endswith("clip"):
        trainable = [p for p in model.parameters() if p.requires_grad]
        norm = float(torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM))
        assert norm > 2 * MAX_NORM  # clipping is active
        for r, res in enumerate(results):
            assert res["grad_norm"] == pytest.approx(norm, rel=1e-5), f"rank {r} grad_norm"
    assert_matches_reference(results, model, ref_loss)
    # the TP modules' ranks really hold shards (a rank hosting several modules: any of them at TP > 1)
    cfg.plan.resolve(build_model(cfg.model, tokenizer, device="meta").layer_counts())
    for r, res in enumerate(results):
        tp = any(cfg.plan.spec(m).tensor_parallel > 1 for m, _, _ in cfg.plan.stages_of(r))
        assert (res["sharded"] > 0) == tp, f"rank {r} shards"
    if case == "colocated_lanes":  # the encoder at TP 1 in lanes: its parameters whole on every rank
        assert all(any(n.startswith("encoders.vision") for n in res["grads"]) for res in results)
    if case == "frozen_tp_zero3_clip":  # the frozen encoder has no gradient, its projector does
        vision = [res for res in results if res["module"] == "vision"]
        assert all(any(".projector." in n for n in res["grads"]) for res in vision)
        assert all(not any(".encoder." in n for n in res["grads"]) for res in vision)
        # the vision ranks hold FSDP shards of TP shards on a 2-D (dp, tp) mesh, and FSDP shards
        # over dp of what TP leaves whole (the patch embedding, norms, the projector)
        assert all(res["meshes"] == ["('dp', 'tp')", "('dp',)"] for res in vision), [res["meshes"] for res in vision]
    if case == "audio_tp2":
        audio = [res for res in results if res["module"] == "audio"]
        assert len(audio) == 2 and all(any(".blocks." in n and "qkv" in n for n in res["grads"]) for res in audio)


def _count_collectives(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from loom.model.layers import Layer
    from loom.model.zoo.llama import DecoderLayer, rope_tables
    from loom.model.zoo.vision import EncoderBlock
    from loom.runtime.tensor_parallel import llama_projection_styles, parallelize_encoder_layer, parallelize_llama_layer

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    block = DecoderLayer(config)
    parallelize_llama_layer(Layer("model.layers.1", block, None), mesh, llama_projection_styles(block))
    cos, sin = rope_tables(torch.arange(8)[None], 8, config.rope_theta)
    encoder = EncoderBlock(32, 2, 4.0, 1e-6)
    parallelize_encoder_layer(Layer("blocks.0", encoder, None), mesh)
    runs = {"llm": lambda: block(torch.randn(2, 4, 32, requires_grad=True), cos, sin),  # a sequence shard of 8
            "encoder": lambda: encoder(torch.randn(10, 32, requires_grad=True), [6, 4])}
    counts = {}
    for name, run in runs.items():
        for phase in ("forward", "both"):
            # CommDebugMode traces a backward only inside the context of its forward
            mode = CommDebugMode()
            with mode:
                y = run()
                if phase == "both":
                    y.sum().backward()
            counts[name, phase] = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    torch.save(counts, Path(out) / f"counts{rank}.pt")


def test_collectives_per_block_are_what_the_cost_model_prices(tmp_path: Path) -> None:
    """The collectives a TP block issues (`CommDebugMode`) are those `loom.cost.analytic`
    prices (tests/test_cost.py checks the prices): the LLM's block under sequence parallelism
    all-gathers and reduce-scatters twice per pass, an encoder block all-reduces twice."""
    run_local(_count_collectives, 2, str(tmp_path))
    counts = torch.load(tmp_path / "counts0.pt", weights_only=True)
    assert counts["llm", "forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert counts["llm", "both"] == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}
    assert counts["encoder", "forward"] == {"all_reduce": 2}
    assert counts["encoder", "both"] == {"all_reduce": 4}
