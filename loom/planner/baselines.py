"""The plans ``loom simulate --compare`` sets side by side for a `Scenario`.

- **Megatron-style** (disttrain.md §2): every encoder is one extra first pipeline stage and every
  generator one extra last stage with the LLM's TP and DP (a generator whole on each TP rank,
  which runs a share of the images, as Megatron-LM retrofitted for MLLMs runs it), and the LLM's layers are split evenly
  over the remaining stages;
- **first-stage** (Megatron-LM's own layout): every rank in the LLM's pipeline, the encoders
  inside its first position;
- **optimus** (optimus.md §2.3, §3.4 to §3.6): every rank in the LLM's pipeline, one replica of
  each encoder on every pipeline unit at the LLM's TP (``colocated``), the encoders' work moved
  into the LLM's bubbles (``bubble_fill = "optimus"``, `loom.sim.bubble_fill`), without ZeRO
  (the colocated runtime runs none); scenarios with CP get no such plan;
- **frozen-aware**: the loosely-coupled search of cornstarch.md §2.6 (Algorithm 1) picks each
  module's stage count for the device budget by simulated iteration time, and the stage
  boundaries come from the frozen-aware partitioning DP (cornstarch.md §3.2.2, eq. 3.5) over
  per-layer costs ``F + B_w + B_d (+ recompute)`` of a typical microbatch.
"""

from __future__ import annotations

import math
from typing import Any

from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.planner.partition import loosely_coupled_search, plan_with_stage_counts
from loom.sim.scenario import Scenario, ScenarioError


def megatron_plan(scenario: Scenario) -> Plan:
    """Encoders as extra first stages and generators as extra last stages at the LLM's TP and DP,
    the LLM split evenly (disttrain.md §2)."""
    d, arch, cluster = scenario.degrees, scenario.arch, scenario.cluster
    # encoders and generators take TP x DP ranks per stage (no CP); the LLM's stages take TP x CP x DP
    encoder_ranks = len(arch.encoder_names + arch.generator_names) * d.tensor_parallel * d.data_parallel
    llm_stages = (cluster.num_gpus - encoder_ranks) // (d.tensor_parallel * d.context_parallel * d.data_parallel)
    if llm_stages < 1:
        raise ScenarioError(f"{cluster.num_gpus} GPUs leave no pipeline stage for the LLM "
                            f"at TP {d.tensor_parallel} x DP {d.data_parallel}")
    return _even_plan(scenario, llm_stages, "disaggregated")


def _even_plan(scenario: Scenario, positions: int, placement: str) -> Plan:
    """Each encoder one stage at the LLM's TP and DP, the LLM's layers split evenly over
    ``positions`` pipeline positions (each of ``virtual_stages`` chunks under interleaved 1F1B)."""
    d, arch = scenario.degrees, scenario.arch
    encoders = [ModuleSpec(n, data_parallel=d.data_parallel, num_stages=1, tensor_parallel=d.tensor_parallel,
                           zero_stage=d.zero_stage, recompute=d.recompute) for n in arch.encoder_names]
    llm = ModuleSpec(LLM, data_parallel=d.data_parallel, num_stages=positions * d.virtual_stages,
                     tensor_parallel=d.tensor_parallel, context_parallel=d.context_parallel, zero_stage=d.zero_stage,
                     recompute=d.recompute, virtual_stages=d.virtual_stages)
    generators = [ModuleSpec(n, data_parallel=d.data_parallel, num_stages=1, tensor_parallel=d.tensor_parallel,
                             zero_stage=d.zero_stage, recompute=d.recompute) for n in arch.generator_names]
    plan = Plan([*encoders, llm, *generators], num_microbatches=d.microbatches_per_pipeline * d.data_parallel,
                schedule=d.schedule, placement=placement)
    return plan.resolve(arch.layer_counts(), scenario.cluster.num_gpus, generators=arch.generator_names)


def first_stage_plan(scenario: Scenario) -> Plan:
    """Megatron-LM's own layout (issue 10's ``first_stage``, cornstarch.md §3.1's baseline):
    every rank goes to the LLM's pipeline, split evenly, and the encoders run whole inside its
    first position, at its TP and DP."""
    d, cluster = scenario.degrees, scenario.cluster
    per_position = d.tensor_parallel * d.context_parallel * d.data_parallel
    positions = cluster.num_gpus // per_position
    if positions < 1 or positions * per_position != cluster.num_gpus:
        raise ScenarioError(f"cluster.num_gpus = {cluster.num_gpus} is not a multiple of TP {d.tensor_parallel} x CP "
                            f"{d.context_parallel} x DP {d.data_parallel}: the first_stage plan gives every rank to the "
                            f"LLM's pipeline; change the degrees or the GPU count")
    return _even_plan(scenario, positions, "first_stage")


def optimus_plan(scenario: Scenario) -> Plan:
    """Optimus's layout as loom runs it (module docstring): the LLM split evenly over
    ``num_gpus / (TP x DP)`` pipeline positions at the scenario's TP and DP, each encoder one
    replica per pipeline unit at the LLM's TP, the bubble fill on, no ZeRO. A `ScenarioError`
    names what rules it out."""
    d, arch, cluster = scenario.degrees, scenario.arch, scenario.cluster
    if arch.generator_names:
        raise ScenarioError(f"the model has generators {arch.generator_names}, which run on ranks of their own: the "
                            f"colocated placement has none")
    if d.context_parallel != 1:
        raise ScenarioError(f"parallel.context_parallel = {d.context_parallel}: the colocated placement runs the LLM "
                            f"without context parallelism; set it to 1 for an Optimus plan")
    per_position = d.tensor_parallel * d.data_parallel
    positions = cluster.num_gpus // per_position
    if positions < 1 or positions * per_position != cluster.num_gpus:
        raise ScenarioError(f"cluster.num_gpus = {cluster.num_gpus} is not a multiple of TP {d.tensor_parallel} x DP "
                            f"{d.data_parallel}: the Optimus plan gives every rank to the LLM's pipeline")
    units = positions * d.data_parallel
    encoders = [ModuleSpec(n, data_parallel=units, tensor_parallel=d.tensor_parallel, recompute=d.recompute)
                for n in arch.encoder_names]
    llm = ModuleSpec(LLM, data_parallel=d.data_parallel, num_stages=positions * d.virtual_stages,
                     tensor_parallel=d.tensor_parallel, recompute=d.recompute, virtual_stages=d.virtual_stages)
    plan = Plan([*encoders, llm], num_microbatches=d.microbatches_per_pipeline * d.data_parallel,
                schedule=d.schedule, placement="colocated", bubble_fill="optimus")
    try:
        return plan.resolve(arch.layer_counts(), cluster.num_gpus, generators=arch.generator_names)
    except PlanError as e:
        raise ScenarioError(f"the Optimus plan does not fit this scenario: {e}") from e


def frozen_aware_plan(scenario: Scenario) -> tuple[Plan, Any]:
    """Algorithm 1 (cornstarch.md §2.6) over the device budget, boundaries by the frozen-aware DP."""
    d, arch, cluster = scenario.degrees, scenario.arch, scenario.cluster
    etp = d.encoder_tensor_parallel or d.tensor_parallel
    template = Plan(
        [ModuleSpec(n, data_parallel=d.data_parallel, tensor_parallel=etp, zero_stage=d.zero_stage,
                    recompute=d.recompute) for n in arch.encoder_names]
        + [ModuleSpec(LLM, data_parallel=d.data_parallel, tensor_parallel=d.tensor_parallel,
                      context_parallel=d.context_parallel, zero_stage=d.zero_stage, recompute=d.recompute,
                      virtual_stages=d.virtual_stages)]
        # a generator at the encoders' TP, after the LLM; the search gives it stages as it does an encoder
        + [ModuleSpec(n, data_parallel=d.data_parallel, tensor_parallel=etp, zero_stage=d.zero_stage,
                      recompute=d.recompute) for n in arch.generator_names],
        num_microbatches=d.microbatches_per_pipeline * d.data_parallel, schedule=d.schedule,
    )
    work = scenario.microbatch_work(scenario.metas(), template.num_microbatches)
    costs = scenario.layer_costs(template, work)
    ranks = {m.name: m.data_parallel * m.ranks_per_unit for m in template.modules}

    def chunked(stage_counts: dict[str, int]) -> Plan:
        # the search counts the LLM's pipeline positions (devices); interleaving cuts each
        # position into virtual_stages chunks
        return plan_with_stage_counts(template, {**stage_counts, LLM: stage_counts[LLM] * d.virtual_stages}, costs)

    def iteration_time(stage_counts: dict[str, int]) -> float:
        if d.virtual_stages > 1:
            try:
                plan = chunked(stage_counts).resolve(arch.layer_counts(), generators=arch.generator_names)
            except PlanError:  # this depth cannot interleave (too few positions or layers): not a candidate
                return math.inf
            return scenario.run(plan, work).iteration_time
        return scenario.run(chunked(stage_counts), work).iteration_time

    result = loosely_coupled_search(
        costs[LLM], {n: costs[n] for n in arch.encoder_names + arch.generator_names}, cluster.num_gpus, iteration_time,
        ranks_per_stage=ranks,
    )
    if result.iteration_time is None or math.isinf(result.iteration_time):
        raise ScenarioError(f"parallel.virtual_stages = {d.virtual_stages}: no LLM depth the search tried can "
                            f"interleave (each needs 2 or more pipeline positions, microbatches_per_pipeline a "
                            f"multiple of the positions, and a layer per chunk); lower virtual_stages or change "
                            f"microbatches_per_pipeline")
    return chunked(result.stage_counts), result
