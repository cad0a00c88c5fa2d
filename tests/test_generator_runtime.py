"""Generators in the runtime keep reference semantics (issue 11; disttrain.md §1).

Each case runs through the production path (the `Dispatcher` moves targets to the generator's
ranks with their noise seeds, `ParallelEngine.step` runs the schedule whose edges go from the
LLM's last stage to the generator and back) on gloo processes, and the loss and every
parameter's gradient must equal the single-process `MultimodalModel` on the same global batch
at the same step (the noise depends on it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.balance.policy import BalanceConfig
from loom.cost.arch_from_model import arch_from_model
from loom.data.collate import GenerationSpec, collate
from loom.data.demo import DemoConfig
from loom.model.zoo import LlamaConfig, VisionConfig
from loom.model.zoo.diffusion import DiffusionConfig
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.dispatch import DispatchError, Dispatcher
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model, generation_specs, num_targets, token_counters
from loom.train.config import ModelConfig, TrainConfig
from reference import assert_matches_reference, save_rank

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
SEED = 7
STEP = 1  # the step whose gradients are compared (the first teaches each channel its shapes)
MIX = {"text": 0.2, "image": 0.3, "generate": 0.5}


def _config(case: str) -> tuple[TrainConfig, BalanceConfig]:
    layout, policy = case.rsplit("-", 1)
    model = ModelConfig(
        vision=VisionConfig(hidden_size=32, num_layers=2, num_heads=2),
        audio=None,
        llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64),
        generator=DiffusionConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=2,
                                  cond_tokens=4),
        generator_loss_weight=0.5,
    )
    vision, gen = ModuleSpec("vision"), ModuleSpec("image")
    if layout == "pp":  # vision -> 2-stage LLM -> generator, a rank each
        plan = Plan([vision, ModuleSpec("llm", num_stages=2), gen], num_microbatches=4)
    elif layout == "frozen":  # a frozen generator with a trainable output projector
        model = dataclasses.replace(model, freeze=["image.generator"])
        plan = Plan([vision, ModuleSpec("llm", num_stages=2), gen], num_microbatches=4)
    elif layout == "frozenllm":  # frozen vision encoder and LLM: only the projectors and the generator train
        model = dataclasses.replace(model, freeze=["vision.encoder", "llm"])
        plan = Plan([vision, ModuleSpec("llm"), ModuleSpec("image", num_stages=2)], num_microbatches=4)
    elif layout == "genpp":  # the generator in 2 stages, GPipe
        plan = Plan([vision, ModuleSpec("llm"), ModuleSpec("image", num_stages=2)], num_microbatches=4,
                    schedule="gpipe")
    elif layout == "llmdp2":  # the LLM at data parallelism 2, the generator at 1: the LLM's replicas share it
        plan = Plan([vision, ModuleSpec("llm", num_stages=2, data_parallel=2), gen], num_microbatches=4)
    elif layout == "dp2":  # every module at data parallelism 2 (the balancing policies' rounds)
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2),
                     ModuleSpec("image", data_parallel=2)], num_microbatches=4)
    elif layout == "zero":  # ZeRO-2 on the generator's replicas, the LLM at 1F1B over 2 stages
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=2),
                     ModuleSpec("image", data_parallel=2, zero_stage=2)], num_microbatches=4)
    elif layout == "gentp":  # the generator at TP 2: a whole replica on each TP rank, the images shared
        plan = Plan([vision, ModuleSpec("llm"), ModuleSpec("image", tensor_parallel=2)], num_microbatches=4)
    elif layout == "gentp2stage":  # ... in 2 stages
        plan = Plan([vision, ModuleSpec("llm"), ModuleSpec("image", num_stages=2, tensor_parallel=2)],
                    num_microbatches=4)
    elif layout == "llmtp":  # the LLM at TP 2 (sequence parallel): its last stage gathers the states' shards
        plan = Plan([vision, ModuleSpec("llm", tensor_parallel=2), gen], num_microbatches=4)
    elif layout == "llmtppp":  # the LLM at TP 2 x PP 2, the generator at TP 1 x DP 1
        plan = Plan([vision, ModuleSpec("llm", num_stages=2, tensor_parallel=2), gen], num_microbatches=4)
    elif layout == "llmcp":  # the LLM at CP 2: its last stage gathers every CP rank's tokens of the states
        plan = Plan([vision, ModuleSpec("llm", context_parallel=2), gen], num_microbatches=4)
    elif layout == "llmtpcp":  # the LLM at TP 2 x CP 2: the sequence shards, then the CP ranks' tokens
        plan = Plan([vision, ModuleSpec("llm", tensor_parallel=2, context_parallel=2), gen], num_microbatches=4)
    else:
        raise KeyError(case)
    cfg = TrainConfig(model=model, plan=plan)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH,
                                   demo=DemoConfig(num_samples=64, seed=SEED, mix=MIX))
    # min_gain = -inf: take the policy's layout even where it predicts no gain, so it really rearranges
    return cfg.check(), BalanceConfig(default=policy, min_gain=float("-inf"))


def _worker(rank: int, world_size: int, case: str, out: str) -> None:
    for c in [case, *FOLDED.get(case, [])]:  # one launch runs its folded cases too
        cfg, balance = _config(c)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
        dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, token_counters(model), arch_from_model(model), balance,
                                torch.device("cpu"), generations=generation_specs(model))
        for step in range(STEP + 1):
            for p in engine.named_parameters().values():
                p.grad = None
            got = dispatcher.dispatch(list(range(GLOBAL_BATCH)), step)
            result = engine.step(got.batches, got.num_targets, step, layout=got.layout, rows=got.rows,
                                 num_generations=got.num_generations)
        losses = torch.tensor([result.loss, result.module_losses.get("image", 0.0)], dtype=torch.float64)
        dist.all_reduce(losses)
        engine.close()
        save_rank(Path(out) / f"{c}_rank{rank}.pt", float(losses[0]), engine.named_parameters(),
                  generator_loss=float(losses[1]), items=got.num_generations["image"],
                  policy=got.layout.policy["image"],
                  same_slots=got.layout.slots["image"] == got.layout.slots["llm"])
    if case == "pp-none":
        _bad_requests(rank, out)


def _bad_requests(rank: int, out: str) -> None:
    """Generation requests the model cannot serve fail every rank with the same message, naming
    the sample and the field: a model without a generator, a generator of another image size."""
    cfg, balance = _config("pp-none")
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
    plan = Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=3)], num_microbatches=4)
    plan.resolve({"vision": model.layer_counts()["vision"], "llm": model.layer_counts()["llm"]}, 4)
    wrong = {"image": GenerationSpec(4, (3, 8, 8))}
    for name, p, generations in (("none", plan, {}), ("size", cfg.plan, wrong)):
        d = Dispatcher(p, dataset, tokenizer, token_counters(model), arch_from_model(model), balance,
                       torch.device("cpu"), generations=generations)
        try:
            d.dispatch(list(range(GLOBAL_BATCH)))
        except DispatchError as e:
            Path(out, f"bad_{name}{rank}.txt").write_text(str(e))


def _reference(case: str):
    cfg, _ = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    indices = list(range(GLOBAL_BATCH))
    batch = collate([dataset[i] for i in indices], tokenizer, token_counters(model),
                    generations=generation_specs(model), step=STEP)
    loss = model.loss(batch, sum(num_targets(dataset.meta(i)) for i in indices))
    loss.backward()
    return model, float(loss.detach()), batch.num_generations("image")


CASES = {"pp-none": 4, "llmdp2-none": 6}
# cases run inside another case's launch (same world size): the suite's time is in the launches
FOLDED = {"pp-none": ["frozen-none", "frozenllm-none", "genpp-none", "gentp-none", "llmtp-none", "llmcp-none"],
          "llmdp2-none": ["dp2-orchmllm", "dp2-disttrain", "dp2-entrain", "zero-none", "gentp2stage-none",
                          "llmtppp-none", "llmtpcp-none"]}


@pytest.mark.parametrize("case", list(CASES))
def test_generator_step_matches_single_process(case: str, tmp_path: Path) -> None:
    world = CASES[case]
    run_local(_worker, world, case, str(tmp_path))
    for c in [case, *FOLDED.get(case, [])]:
        results = [torch.load(tmp_path / f"{c}_rank{r}.pt", weights_only=True) for r in range(world)]
        model, ref_loss, items = _reference(c)
        assert items > 0, f"{c}: the global batch asks the generator for nothing"
        assert_matches_reference(results, model, ref_loss)
        assert all(r["items"] == items for r in results), c
        policy = c.rsplit("-", 1)[1]
        assert results[0]["policy"] == policy
        if policy in ("none", "disttrain"):  # the generator runs the LLM's microbatches
            assert all(r["same_slots"] for r in results), f"{c}: the generator's slots are not the LLM's"
        else:  # a phase of its own: rearranged by its own cost, its states routed by sample
            assert not results[0]["same_slots"], f"{c}: the generator kept the LLM's slots"
        assert 0 < results[0]["generator_loss"] < results[0]["loss"], c
    if case == "pp-none":  # every rank refused the same sample, naming the field and the fix
        for name, field, fix in (("none", "meta.generations[0] asks generator 'image'", "has no generator 'image'"),
                                 ("size", "meta.generations[0] is a [3, 16, 16] image", "makes [3, 8, 8]")):
            texts = {(tmp_path / f"bad_{name}{r}.txt").read_text() for r in range(world)}
            assert len(texts) == 1, texts
            (text,) = texts
            assert field in text and fix in text and "sample " in text, text

