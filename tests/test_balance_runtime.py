"""Balanced training keeps reference semantics (docs/architecture.md principle 1).

Each case runs one iteration on 2 or 4 gloo processes through the production path: the
`Dispatcher` gathers metadata, every rank computes the same `BatchLayout` under the policy,
payloads move with one ``all_to_all_single`` per phase, encoder outputs go straight to their
LLM microbatch along routed edges (with Entrain's split backward), and the loss and every
parameter's gradient must equal the single-process model's on the same global batch. The
workers also report which samples each of their microbatches held, so the parent can count
them: every sample exactly once per phase.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.balance.policy import BalanceConfig
from loom.cost.arch_from_model import arch_from_model
from loom.data.collate import collate
from loom.data.demo import DemoConfig
from loom.model.zoo import AudioConfig, LlamaConfig, VisionConfig
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.runtime.dispatch import Dispatcher
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.schedule.generators import build_schedule
from loom.train.build import bubble_filler, build_data, build_model, num_targets, token_counters
from loom.train.config import ModelConfig, TrainConfig
from reference import assert_matches_reference, save_rank

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
SEED = 5
TOKEN_BUDGET = 180  # the skewed batch's LLM lengths: 97 186 10 70 8 170 165 49
# skewed: a few samples carry several images, many carry none
SKEWED = {"text": 0.35, "image": 0.25, "multi_image": 0.4}


def _config(case: str) -> tuple[TrainConfig, BalanceConfig]:
    small = dict(hidden_size=32, num_layers=2, num_heads=2)
    model = ModelConfig(
        vision=VisionConfig(**small),
        audio=None,
        llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64),
    )
    demo = DemoConfig(num_samples=64, seed=SEED, mix=SKEWED)
    layout, policy = case.rsplit("-", 1)
    # data.microbatch_tokens: microbatches cut by a token budget (6 here, one sample over the budget)
    budget = TOKEN_BUDGET if layout.endswith("tokens") else 0
    layout = layout.removesuffix("tokens")
    pack = layout.endswith("packed")  # LLM microbatches as one packed row each
    layout = layout.removesuffix("packed")
    eager = 2 if layout.endswith("eager") else 0  # Entrain's eager forward: a deeper encoder warmup
    layout = layout.removesuffix("eager")
    zero_bubble = layout.endswith("zb")  # plan.schedule = "zb-h1": split backwards on routed stages
    layout = layout.removesuffix("zb")
    if layout == "pipe2":  # vision -> LLM, one rank each: a pipeline, no DP
        plan = Plan([ModuleSpec("vision"), ModuleSpec("llm")], num_microbatches=4)
    elif layout == "dp2":  # LLM only, two replicas: DP, no pipeline
        model = dataclasses.replace(model, vision=None)
        demo = dataclasses.replace(demo, mix={"text": 1.0})
        plan = Plan([ModuleSpec("llm", data_parallel=2)], num_microbatches=4)
    elif layout == "pipe2dp2":  # vision x2 -> LLM x2: pipelines and DP
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2)], num_microbatches=4)
    elif layout == "mixed":  # vision x2 -> one 2-stage LLM pipeline (rounds of 2 slots)
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=2)], num_microbatches=4)
    elif layout == "deep":  # 2-stage vision -> 2-stage LLM: a split backward feeds an earlier encoder stage
        plan = Plan([ModuleSpec("vision", num_stages=2), ModuleSpec("llm", num_stages=2)], num_microbatches=4)
    elif layout == "interleaved":  # vision and audio -> a 2-position LLM of 2 chunks each (interleaved 1F1B)
        model = dataclasses.replace(model, audio=AudioConfig(**small))
        demo = dataclasses.replace(demo, mix={"text": 0.2, "multi_image": 0.3, "audio": 0.3, "image_audio": 0.2})
        plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=4, virtual_stages=2)],
                    num_microbatches=4)
    elif layout == "colocated":  # a vision replica on each rank of a 2-stage LLM (OrchMLLM's every module on every rank)
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=2)], num_microbatches=4,
                    placement="colocated")
    elif layout == "colocdp2":  # vision and LLM replicas on both ranks (OrchMLLM's setup): every rank sends
        # encoder rows to the other's LLM and receives from it on the same edge
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2)], num_microbatches=4,
                    placement="colocated")
    elif layout == "firststage":  # vision inside the first stage of each of 2 LLM pipelines (Megatron-LM's layout)
        plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=2, data_parallel=2)],
                    num_microbatches=4, placement="first_stage")
    elif layout in ("optimus", "optimuschunks"):  # vision and audio replicas on both ranks of a 2-stage LLM,
        # their work moved into its bubbles; optimuschunks: vision cut in 2 chunks the fill moves one by one
        model = dataclasses.replace(model, audio=AudioConfig(**small))
        demo = dataclasses.replace(demo, mix={"text": 0.2, "multi_image": 0.3, "audio": 0.3, "image_audio": 0.2})
        chunks = 2 if layout == "optimuschunks" else 1
        plan = Plan([ModuleSpec("vision", data_parallel=2, num_stages=chunks, virtual_stages=chunks),
                     ModuleSpec("audio", data_parallel=2), ModuleSpec("llm", num_stages=2)], num_microbatches=4,
                    placement="colocated", bubble_fill="optimus")
    elif layout == "omni":  # vision and audio encoders -> 2-stage LLM, frozen LLM, trainable projectors
        model = dataclasses.replace(model, audio=AudioConfig(**small), freeze=["vision.encoder", "llm"])
        demo = dataclasses.replace(demo, mix={"text": 0.2, "multi_image": 0.3, "audio": 0.3, "image_audio": 0.2})
        plan = Plan([ModuleSpec("vision"), ModuleSpec("audio"), ModuleSpec("llm", num_stages=2)], num_microbatches=4)
    else:
        raise KeyError(case)
    if zero_bubble:
        plan = dataclasses.replace(plan, schedule="zb-h1")
    cfg = TrainConfig(model=model, plan=plan)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo, pack_sequences=pack,
                                   microbatch_tokens=budget)
    # min_gain = -inf: take the policy's layout even where its cost model predicts no gain (the
    # production default keeps the given layout then), so every case really rearranges
    return cfg, BalanceConfig(default=policy, eager_forward=eager, min_gain=float("-inf"))


def _worker(rank: int, world_size: int, case: str, out: str) -> None:
    for c in [case, *FOLDED.get(case, [])]:  # one launch runs its folded cases too
        _run_case(rank, c, Path(out) / (f"rank{rank}.pt" if c == case else f"{c}_rank{rank}.pt"))


def _run_case(rank: int, case: str, path: Path) -> None:
    cfg, balance = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    arch = arch_from_model(model)
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    engine.eager_forward = balance.eager_forward
    if cfg.plan.bubble_fill != "none":  # as loom train sets it (loom.train.rank.build_rank)
        engine.schedule_transform = bubble_filler(cfg, model, dataset, engine.plan)
    dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, token_counters(model), arch, balance, torch.device("cpu"),
                            pack=cfg.data.pack_sequences, microbatch_tokens=cfg.data.microbatch_tokens)
    # two steps on the same batch without an optimizer: the first sets each channel's shape rule
    # (messages with a header), the second sends activations and gradients without headers
    for step in range(2):
        for p in engine.named_parameters().values():
            p.grad = None
        got = dispatcher.dispatch(list(range(GLOBAL_BATCH)))
        result = engine.step(got.batches, got.num_targets, step, layout=got.layout, rows=got.rows)
    loss = torch.tensor([result.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    engine.close()
    # the order the engine ran differs from the generator's where a bubble fill moved work
    built = build_schedule(engine.plan, engine.trainable, layout=got.layout)
    reordered = engine.schedule_for(got.layout).actions[rank] != built.actions[rank]
    assert sorted(map(repr, engine.schedule_for(got.layout).actions[rank])) == sorted(map(repr, built.actions[rank]))
    # per phase whose first stage this rank runs, the samples of the batches it really ran
    ran: dict[str, list[int]] = {}
    for module, stage, replica in cfg.plan.stages_of(rank):
        dp = cfg.plan.spec(module).data_parallel
        for j in range(got.layout.num_microbatches) if stage == 0 else ():
            if j % dp == replica:
                ran.setdefault(module, []).extend(got.batches.get((module, j), got.batches.get(j)).sample_ids)
    save_rank(path, float(loss), engine.named_parameters(), role=cfg.plan.role_of(rank), ran=ran,
              # every action is timed from its own start (wall-clock epoch seconds) to its end
              reordered=reordered, eager_forward=got.layout.eager_forward, timeline_ok=all(e.start_s > 1e9 and 0 <= e.duration_s < 600 for e in result.timeline))


def _reference(case: str):
    cfg, _ = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    indices = list(range(GLOBAL_BATCH))
    batch = collate([dataset[i] for i in indices], tokenizer, token_counters(model))
    loss = model.loss(batch, sum(num_targets(dataset.meta(i)) for i in indices))
    loss.backward()
    return model, float(loss.detach()), [dataset.meta(i).sample_id for i in indices]


CASES = {
    "pipe2-none": 2,
    "pipe2packed-entrain": 2,  # packed LLM rows: deferral pays (padded rows: it raises the padded cost)
    "pipe2-disttrain": 2,
    "dp2-orchmllm": 2,
    "pipe2dp2-none": 4,
    "pipe2dp2-orchmllm": 4,
    "pipe2dp2-disttrain": 4,
    "pipe2dp2-entrain": 4,
    "mixed-orchmllm": 4,
    "omni-entrain": 4,
    "deeppacked-entrain": 4,
    "pipe2dp2packed-orchmllm": 4,  # the reference stays padded: packing must not change the math
    "pipe2eager-entrain": 2,  # Entrain's eager forward (a deeper encoder warmup)
}


# cases run inside another case's launch (same world size): the suite's time is in the launches
# mixedzb: zb-h1 with routed rows into split LLM stages; interleaved: Entrain's deferral into an
# interleaved LLM
# optimus: Optimus's bubble fill (plan.bubble_fill) of colocated vision and audio encoders (optimuschunks:
# vision in 2 chunks per rank, filled chunk by chunk); firststage:
# DistTrain's layout (a sample of every module per microbatch) with the encoders inside the LLM's first stage
# pipe2dp2tokens: data.microbatch_tokens cuts the batch into 6 microbatches instead of the plan's 4
# pipe2-entrain: the encoders' deeper warmup Entrain's policy chooses itself (the layout's eager_forward)
FOLDED = {"pipe2dp2-none": ["pipe2dp2tokens-none"], "mixed-orchmllm": ["mixedzb-orchmllm"], "omni-entrain": ["interleavedpacked-entrain"],
          "pipe2-disttrain": ["colocated-orchmllm"], "dp2-orchmllm": ["colocdp2-orchmllm"], "pipe2-none": ["optimus-none"],
          "pipe2packed-entrain": ["optimus-orchmllm"], "pipe2dp2-disttrain": ["firststage-disttrain"],
          "pipe2eager-entrain": ["optimuschunks-orchmllm", "pipe2-entrain"]}


@pytest.mark.parametrize("case", list(CASES))
def test_balanced_step_matches_single_process(case: str, tmp_path: Path) -> None:
    run_local(_worker, CASES[case], case, str(tmp_path))
    for c in [case, *FOLDED.get(case, [])]:
        _check(c, CASES[case], tmp_path, "" if c == case else f"{c}_")


def _check(case: str, world: int, out: Path, prefix: str) -> None:
    results = [torch.load(out / f"{prefix}rank{r}.pt", weights_only=True) for r in range(world)]
    model, ref_loss, sample_ids = _reference(case)

    assert_matches_reference(results, model, ref_loss)
    assert all(r["timeline_ok"] for r in results), "a timeline event with a bogus start or duration"
    if case == "pipe2-entrain":  # Entrain chose its own eager forward (balance.eager_forward is 0 here)
        assert all(r["eager_forward"] > 0 for r in results), "the policy kept 1F1B's warmup: no deeper schedule ran"
    if case.startswith("optimus"):  # the fill really moved encoder work (else this is the colocated case again)
        assert any(r["reordered"] for r in results), "the bubble fill left every rank's order as built"

    # every sample exactly once in each phase, counted over what the first stages really ran
    cfg, _ = _config(case)
    if cfg.data.microbatch_tokens:  # the budget really cut the batch otherwise than the plan's count
        ran = sum(len(r["ran"].get(LLM, [])) > 0 for r in results)
        assert ran and _budget_layout(cfg).num_microbatches == 6 != cfg.plan.num_microbatches
    for phase in cfg.plan.module_names:
        counted = Counter(s for r in results for s in r["ran"].get(phase, []))
        assert counted == Counter(sample_ids), f"{phase}: samples dropped or duplicated: {counted}"


def test_balancing_really_rearranges(tmp_path: Path) -> None:
    """The reference comparisons above would pass trivially if every policy returned the
    unbalanced layout; on the skewed batch the balanced ones do move samples."""
    from loom.balance.policy import make_layout, sample_costs

    for case, expect_routes in [("pipe2dp2-orchmllm", True), ("pipe2packed-entrain", True), ("pipe2dp2-disttrain", False),
                                ("mixed-orchmllm", True), ("deeppacked-entrain", True), ("omni-entrain", True),
                                ("colocated-orchmllm", True), ("colocdp2-orchmllm", True), ("optimus-orchmllm", True),
                                ("firststage-disttrain", False)]:
        cfg, balance = _config(case)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED)
        cfg.plan.resolve(model.layer_counts())
        costs = sample_costs(arch_from_model(model), [dataset.meta(i) for i in range(GLOBAL_BATCH)])
        layout = make_layout(balance, cfg.plan, costs, "packed" if cfg.data.pack_sequences else "padded")
        unbalanced = make_layout(BalanceConfig(), cfg.plan, costs)
        assert layout.slots != unbalanced.slots, case
        assert (not layout.is_identity()) == expect_routes, case
        if LLM in layout.slots and case.startswith("pipe2dp2-orchmllm"):
            # post-balancing lowers the slowest replica of the encoder phase in round 0
            def worst(lay):
                return max(sum(costs.work["vision"][s] for s in lay.slots["vision"][j]) for j in (0, 1))
            assert worst(layout) < worst(unbalanced)


def _budget_layout(cfg: TrainConfig):
    from loom.balance.policy import make_layout, sample_costs

    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    cfg.plan.resolve(model.layer_counts())
    costs = sample_costs(arch_from_model(model), [dataset.meta(i) for i in range(GLOBAL_BATCH)])
    layout = make_layout(BalanceConfig(), cfg.plan, costs, "padded", cfg.data.microbatch_tokens)
    for slot in layout.slots[LLM]:  # within the budget, but for a sample longer than it alone
        assert sum(costs.llm_lengths[list(slot)]) <= cfg.data.microbatch_tokens or len(slot) == 1
    return layout
