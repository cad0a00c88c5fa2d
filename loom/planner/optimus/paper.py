"""The configuration of optimus.md §4.6 / §4.9 that issue 10's acceptance times the scheduler
at: ViT-22B (§4.2, Table 8) with GPT-175B (Table 9) on 3072 H100 GPUs, the LLM at PP 8, TP 8,
DP 48 (the baselines' plan, Table 12), 32 microbatches per LLM pipeline (the issue's figure; the
paper's 3072-GPU row has 16 at global batch 1536, §4.9), microbatch size 2, sequence 2048.

The paper does not give image resolution or image tokens per sample (§4.1); decided here: the
encoder's sequence is 2048 tokens per sample too (optimus.md §4.6 [interp] and §7 point 11 take
s = 2048 for the ViT), one image of 32 x 64 patches of 14 pixels; loom's analytic model then
prices a ViT-22B layer at TP 8 at 1.44 ms forward and 2.43 ms backward for a microbatch of 2,
near the paper's 1.4 ms and 2.0 ms (§1.2). ViT-22B's published variant has other details (parallel layers, no
biases); Table 8's dimensions are what this uses, as a ViT-H-style block stack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch import LLM, ModelArch
from loom.cost.hardware import Cluster
from loom.cost.kernels import stage_kernels
from loom.cost.model import Workload
from loom.cost.model_configs import FrontendConfig, ModuleConfig, TransformerConfig, load_module_config
from loom.plan.plan import ModuleSpec, Plan
from loom.planner.optimus.model_planner import LLMParallel, PlannerResult, encoder_stage_times, plan_encoders
from loom.planner.optimus.search import OptimusResult, optimus_search
from loom.planner.optimus.timeline import LLMTimeline, llm_timeline_from_sim
from loom.schedule.generators import build_schedule
from loom.sim.simulator import simulate

SEQUENCE = 2048
MICROBATCH_SIZE = 2
IMAGE_TOKENS = 2048  # one 448 x 896 image at patch 14 per sample (module docstring)
NUM_GPUS = 3072
NUM_MICROBATCHES = 32
LLM_PLAN = LLMParallel(data_parallel=48, pipeline_parallel=8, tensor_parallel=8)


def vit_22b() -> ModuleConfig:
    """ViT-22B from optimus.md §4.2 Table 8: width 6144, depth 48, MLP 24576, 48 heads of 128."""
    return ModuleConfig(
        name="vit-22b", kind="vision", source="optimus.md §4.2 Table 8", published_params=22e9,
        transformer=TransformerConfig(hidden=6144, layers=48, heads=48, ffn=24576, qkv_bias=True, linear_bias=True),
        frontend=FrontendConfig(type="patch", in_channels=3, patch=14, positions=IMAGE_TOKENS),
    )


def paper_arch() -> ModelArch:
    """ViT-22B (with an MLP projector into the LLM's width) and GPT-175B."""
    llm = load_module_config("gpt3-175b")
    vision = vit_22b().module_arch("vision", "mlp", llm.transformer.hidden)
    return ModelArch({"vision": vision, "llm": llm.module_arch()})


def paper_workload() -> dict[str, Workload]:
    """One microbatch: 2 sequences of 2048 tokens, 2 images of 2048 tokens."""
    b = MICROBATCH_SIZE
    return {"llm": Workload(b * SEQUENCE, b * SEQUENCE * SEQUENCE, b),
            "vision": Workload(b * IMAGE_TOKENS, b * IMAGE_TOKENS * IMAGE_TOKENS, b)}


@dataclass(frozen=True)
class PaperRun:
    """`paper_search`'s answer: the LLM timeline, the planner's and the search's results, and
    CPU seconds (`time.process_time`) of the simulation that produced the timeline
    (``simulate_s``, the offline profile's stand-in), of the planner (``plan_s``) and of the
    coarse search with its stage pricing (``schedule_s``)."""

    timeline: LLMTimeline
    planned: PlannerResult
    result: OptimusResult
    simulate_s: float
    plan_s: float
    schedule_s: float


GRANULARITIES = ("kernel", "layer")


def paper_search(max_partitions: int | None = 4096, memory_limit: float = 80e9, recompute: str = "full",
                 num_microbatches: int = NUM_MICROBATCHES, refine: int = 0,
                 llm_plan: LLMParallel = LLM_PLAN, granularity: str = "kernel") -> PaperRun:
    """The model planner and the coarse bubble scheduler at the module docstring's
    configuration. The LLM's timeline is loom's simulation of GPT-175B alone at (DP 48, PP 8,
    TP 8), 1F1B, ZeRO-1, on 3072 H100 (replica 0's pipeline); ``recompute`` applies to the LLM
    and the encoder (Megatron's baselines at this scale recompute fully); ``refine`` as in
    `optimus_search`. ``llm_plan`` replaces the LLM's degrees, on as many GPUs as it spans (a
    smaller instance for tests). ``granularity`` is the fine schedule's (`loom.planner.optimus.fine`):
    ``"kernel"`` cuts the LLM's timeline and the encoder stages into kernels
    (`loom.cost.kernels`), ``"layer"`` keeps whole actions and places layers."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity = {granularity!r}: choose one of {GRANULARITIES}")
    kernels = granularity == "kernel"
    arch, work = paper_arch(), paper_workload()
    num_gpus = llm_plan.data_parallel * llm_plan.pipeline_parallel * llm_plan.tensor_parallel
    cluster = Cluster("h100", num_gpus)
    t0 = time.process_time()
    llm_only = ModelArch({LLM: arch.module(LLM)})
    plan = Plan([ModuleSpec(LLM, data_parallel=llm_plan.data_parallel, num_stages=llm_plan.pipeline_parallel,
                            tensor_parallel=llm_plan.tensor_parallel, zero_stage=1, recompute=recompute)],
                num_microbatches=num_microbatches * llm_plan.data_parallel)
    plan.resolve(llm_only.layer_counts(), num_gpus)
    cost = AnalyticCostModel(llm_only, plan, cluster)
    sim = simulate(build_schedule(plan), plan, cost, [{LLM: work[LLM]}] * plan.num_microbatches)
    timeline = llm_timeline_from_sim(
        sim, kernels=(lambda e: stage_kernels(cost, LLM, e.stage, e.kind, work[LLM])) if kernels else None)
    t1 = time.process_time()
    planned = plan_encoders(arch, llm_plan, num_microbatches, llm_tokens=work[LLM].tokens,
                            encoder_tokens={"vision": work["vision"].tokens}, memory_limit=memory_limit,
                            llm_recompute=recompute, encoder_recompute=recompute)
    t2 = time.process_time()
    result = optimus_search(planned, timeline, lambda c: encoder_stage_times(arch, c, cluster, work,
                                                                             recompute=recompute, kernels=kernels),
                            max_partitions=max_partitions, refine=refine)
    t3 = time.process_time()
    return PaperRun(timeline, planned, result, t1 - t0, t2 - t1, t3 - t2)
