"""Oobleck's inputs from loom's cost models: per-layer forward and backward times at each stage
GPU count (`LayerTimes`, oobleck.md §3.3's ``F_{l,d}``, ``B_{l,d}``) and the memory minimum ``n0``
(§3.2).

Per-layer costs come from a cost model's ``module_layer_costs`` (the partitioner's input,
`loom.planner.partition`, `loom.sim.scenario.Scenario.layer_costs`): `AnalyticCostModel` at a
one-stage plan of each TP degree (loom's TP scaling: sharded GEMMs, TP collectives, sequence
parallelism), or a `ProfiledCostModel`, which measured TP 1 only (`layer_times_of_models` takes
whichever models it is given, one per GPU count). The costs are frozen-aware (a frozen layer has
no weight gradient) and include recomputation, as those models price them. A multimodal model
is the LLM's layer chain with the encoders hosted by the pipeline's first stage
(``placement = "first_stage"``): their whole forward and backward is added to the first stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loom.cost.model import MicrobatchWork, Workload
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.planner.oobleck import OobleckError, memory_min_nodes
from loom.planner.oobleck_templates import LayerTimes
from loom.sim.scenario import Scenario


def layer_times_of_models(models: Mapping[int, Any], work: MicrobatchWork, encoders: Sequence[str] = ()) -> LayerTimes:
    """`LayerTimes` from one cost model per stage GPU count (``models[g]`` prices TP ``g``; any
    model with ``module_layer_costs(module, workload)``) for the microbatch ``work``: the LLM's
    layers, and the ``encoders``' total as the first stage's extra."""
    forward, backward, first = {}, {}, {}
    for g, model in models.items():
        llm = model.module_layer_costs(LLM, work.get(LLM, Workload()))
        forward[g] = [c.forward for c in llm]
        backward[g] = [c.backward for c in llm]
        first[g] = sum(c.forward + c.backward for e in encoders
                       for c in model.module_layer_costs(e, work.get(e, Workload())))
    return LayerTimes(forward, backward, first)


def mean_microbatch(scenario: Scenario, microbatch_size: int) -> MicrobatchWork:
    """The mean workload of a microbatch of ``microbatch_size`` samples of the scenario's first
    global batch (each module's tokens, attention and segments averaged)."""
    metas = scenario.metas()
    if not 1 <= microbatch_size <= len(metas):
        raise OobleckError(f"microbatch_size = {microbatch_size}: must be between 1 and the global batch "
                           f"{len(metas)}")
    work = scenario.microbatch_work(metas, len(metas) // microbatch_size)
    return {name: Workload(*(round(sum(getattr(w.get(name, Workload()), f) for w in work) / len(work))
                             for f in ("tokens", "attn_sq", "segments")))
            for name in scenario.arch.module_names}


def stage_gpu_counts(scenario: Scenario) -> list[int]:
    """The TP degrees a stage may run: up to a node's GPUs, dividing every block's heads (as
    `AnalyticCostModel` requires)."""
    heads = [layer.heads for name in [*scenario.arch.encoder_names, LLM]
             for layer in scenario.arch.module(name).layers if layer.kind == "block"]
    return [g for g in range(1, scenario.cluster.gpus_per_node + 1) if all(h % g == 0 for h in heads)]


def one_stage_plan(scenario: Scenario, tensor_parallel: int, recompute: str | None = None) -> Plan:
    """A one-stage, one-replica plan of the scenario's model at ``tensor_parallel``, the encoders
    in the first stage (the plan a template's costs are read from)."""
    if scenario.arch.generator_names:
        raise OobleckError(f"the model has generators {scenario.arch.generator_names}: Oobleck templates cover the "
                           f"encoders and the LLM only")
    mode = recompute or scenario.degrees.recompute
    names = scenario.arch.module_names
    plan = Plan([ModuleSpec(n, tensor_parallel=tensor_parallel, recompute=mode) for n in names],
                num_microbatches=1, placement="first_stage" if len(names) > 1 else "disaggregated")
    return plan.resolve(scenario.arch.layer_counts(), generators=scenario.arch.generator_names)


def layer_times(scenario: Scenario, microbatch_size: int, gpu_counts: Sequence[int] | None = None,
                recompute: str | None = None) -> LayerTimes:
    """`LayerTimes` of the scenario's model from the analytic cost model, one TP degree per stage
    GPU count (default `stage_gpu_counts`), for its mean microbatch of ``microbatch_size``."""
    counts = list(gpu_counts) if gpu_counts is not None else stage_gpu_counts(scenario)
    models = {g: scenario.cost_model(one_stage_plan(scenario, g, recompute)) for g in counts}
    return layer_times_of_models(models, mean_microbatch(scenario, microbatch_size), scenario.arch.encoder_names)


def scenario_min_nodes(scenario: Scenario, microbatch_size: int, recompute: str | None = None) -> int:
    """`memory_min_nodes` of the scenario's model: loom's memory model's static bytes (fp32
    parameters, gradients and Adam states of every module) plus one microbatch's activations
    through every layer, over the nodes' GPU memory."""
    plan = one_stage_plan(scenario, 1, recompute)
    model = scenario.cost_model(plan)
    work = mean_microbatch(scenario, microbatch_size)
    static = sum(model.static_memory(m.name, 0) for m in plan.modules)
    activations = sum(model.activation_memory(m.name, 0, work.get(m.name, Workload())) for m in plan.modules)
    return memory_min_nodes(static, activations, scenario.memory_capacity(), scenario.cluster.gpus_per_node)
