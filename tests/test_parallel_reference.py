"""Reference semantics (docs/architecture.md principle 1): a parallel run on several gloo processes gives
the same loss and the same gradient for every parameter as the single-process
`MultimodalModel` on the same global batch; frozen parameters get no gradient at all.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loom.data.demo import DemoConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine
from loom.train.build import bubble_filler, build_data, build_model
from loom.train.config import ModelConfig, TrainConfig
from loom.model.zoo import AudioConfig, LlamaConfig, VisionConfig

from loom.runtime.local import run_local as run_distributed
from reference import assert_matches_reference, identity_step, reference_backward, save_rank

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
SEED = 3


def _config(case: str) -> TrainConfig:
    """Tiny model and plan per case; every case uses the same global batch of demo samples."""
    small = dict(hidden_size=32, num_layers=2, num_heads=2)
    model = ModelConfig(
        vision=VisionConfig(**small),
        audio=AudioConfig(**small),
        llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64),
        projector="mlp",
    )
    demo = DemoConfig(num_samples=64, seed=SEED)
    enc = [ModuleSpec("vision"), ModuleSpec("audio")]
    llm2 = ModuleSpec("llm", num_stages=2)
    if case.startswith("llm_only"):
        model = dataclasses.replace(model, vision=None, audio=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        if case == "llm_only_interleaved":  # 2 positions x 2 chunks, one layer each (optimus.md §3.11)
            plan = Plan([ModuleSpec("llm", num_stages=4, virtual_stages=2)], num_microbatches=4)
        else:
            plan = Plan([llm2], num_microbatches=4, schedule=case.split("_")[-1])
    elif case == "first_stage":  # Megatron-LM's layout: the encoders inside the LLM's first stage
        plan = Plan([*enc, llm2], num_microbatches=4, placement="first_stage")
    elif case == "first_stage_dp2_interleaved":  # 2 replicas of 2 positions, 2 chunks each
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("audio", data_parallel=2),
                     ModuleSpec("llm", num_stages=4, virtual_stages=2, data_parallel=2)], num_microbatches=4,
                    placement="first_stage")
    elif case == "colocated_interleaved":  # one vision replica on each rank of an interleaved 2-position LLM
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=4, virtual_stages=2)],
                    num_microbatches=4, placement="colocated")
        model = dataclasses.replace(model, audio=None)
        demo = dataclasses.replace(demo, mix={"text": 0.3, "image": 0.4, "multi_image": 0.3})
    elif case == "colocated_dp2":  # vision and audio DP 4 on the ranks of an LLM PP 2 x DP 2
        plan = Plan([ModuleSpec("vision", data_parallel=4), ModuleSpec("audio", data_parallel=4),
                     ModuleSpec("llm", num_stages=2, data_parallel=2)], num_microbatches=4, placement="colocated")
    elif case == "colocated_tp2_dp2":  # issue 10's example: vision TP 1 x DP 8 (in lanes) and audio TP 2 x DP 4
        # on an LLM TP 2 x PP 2 x DP 2, the fill on
        plan = Plan([ModuleSpec("vision", data_parallel=8),
                     ModuleSpec("audio", data_parallel=4, tensor_parallel=2),
                     ModuleSpec("llm", num_stages=2, data_parallel=2, tensor_parallel=2)], num_microbatches=4,
                    placement="colocated", bubble_fill="optimus")
    elif case == "multimodal_interleaved":
        plan = Plan([*enc, ModuleSpec("llm", num_stages=4, virtual_stages=2)], num_microbatches=4)
    elif case in ("multimodal_1f1b", "multimodal_gpipe", "multimodal_zb-h1"):
        plan = Plan([*enc, llm2], num_microbatches=4, schedule=case.split("_")[-1])
    elif case == "frozen_encoders_zb-h1":
        # frozen encoders with trainable projectors: the encoders' backward stays whole, the
        # LLM stages split theirs into input and weight passes (tests/test_zero_bubble.py)
        model = dataclasses.replace(model, freeze=["vision.encoder", "audio.encoder"])
        plan = Plan([*enc, llm2], num_microbatches=4, schedule="zb-h1")
    elif case == "multimodal_dp2":
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("audio", data_parallel=2),
                     ModuleSpec("llm", num_stages=2, data_parallel=2)], num_microbatches=4)
    elif case == "frozen":
        model = dataclasses.replace(model, freeze=["vision.encoder", "audio.encoder", "llm"])
        plan = Plan([*enc, llm2], num_microbatches=4)
    elif case == "missing_modality":
        # no audio anywhere in the global batch: the audio encoder still runs (on nothing) and its
        # trainable parameters get zero gradients on both sides
        demo = dataclasses.replace(demo, mix={"text": 0.3, "image": 0.7})
        plan = Plan([*enc, llm2], num_microbatches=4)
    elif case == "mixed_dp":
        # vision in 2 stages with 2 replicas feeding one LLM pipeline: explicit routing per microbatch
        plan = Plan([ModuleSpec("vision", num_stages=2, data_parallel=2), ModuleSpec("audio"), llm2],
                    num_microbatches=4)
    else:
        raise KeyError(case)
    cfg = TrainConfig(model=model, plan=plan)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _worker(rank: int, world_size: int, case: str, out: str) -> None:
    for c in [case, *FOLDED.get(case, [])]:  # one launch runs its folded cases too
        cfg = _config(c)
        tokenizer, dataset = build_data(cfg)
        # built on meta: the rank materialises its own stage only, from per-layer seeds
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
        if cfg.plan.bubble_fill != "none":  # as loom train sets it
            engine.schedule_transform = bubble_filler(cfg, model, dataset, engine.plan)
        # two steps without an optimizer: the second sends what the first taught both sides of a
        # channel without headers
        for step in range(2):
            for p in engine.named_parameters().values():
                p.grad = None
            _, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH, step)
        save_rank(Path(out) / (f"rank{rank}.pt" if c == case else f"{c}_rank{rank}.pt"), loss,
                  engine.named_parameters())
        engine.close()


def _reference(case: str):
    cfg = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    return model, reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)


CASES = {
    "llm_only_1f1b": 2,
    "multimodal_1f1b": 4,
    "multimodal_dp2": 8,
    "mixed_dp": 7,
}


# cases run inside another case's launch (same world size): the suite's time is in the launches
FOLDED = {"multimodal_1f1b": ["multimodal_gpipe", "frozen", "missing_modality", "multimodal_zb-h1",
                              "frozen_encoders_zb-h1", "multimodal_interleaved", "first_stage_dp2_interleaved",
                              "colocated_dp2"],
          "multimodal_dp2": ["colocated_tp2_dp2"],
          "llm_only_1f1b": ["llm_only_gpipe", "llm_only_interleaved", "first_stage", "colocated_interleaved"]}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_matches_single_process(case: str, tmp_path: Path) -> None:
    world = CASES[case]
    run_distributed(_worker, world, case, str(tmp_path))
    for c in [case, *FOLDED.get(case, [])]:
        model, ref_loss = _reference(c)
        results = [torch.load(tmp_path / (f"rank{r}.pt" if c == case else f"{c}_rank{r}.pt"), weights_only=True)
                   for r in range(world)]
        assert_matches_reference(results, model, ref_loss)
