"""The planner's fast analytic estimate of a plan (issue 12, item 2): an iteration time and a
peak memory per pipeline position from the cost model's stage times on the mean microbatch,
without building a schedule. The search prunes with it; the simulator decides among the best.

The pipeline is the chain of positions a microbatch crosses: each encoder's stages on ranks of
their own, the LLM's positions (each with the stages it hosts: its virtual chunks, and under
``first_stage`` or ``colocated`` the encoders' stages it runs), then any generator's. Position
``k`` costs ``t_k``: forward plus backward of its stages for one LLM microbatch (a module whose
replicas take more microbatches than the LLM's count proportionally more). With ``m``
microbatches per LLM pipeline (Narayanan et al. 2021 §2.2; Qi et al. 2024 §3 for ZB-H1):

    T = m max_k t_k + f (sum_k t_k - max_k t_k) + sync

where ``f`` is the bubble's share: 1 for 1F1B and GPipe, ``1 / v`` for interleaved 1F1B with
``v`` chunks, 1/3 for ZB-H1 (its bubble ``(p-1)(T_F + T_B - T_W)`` against 1F1B's
``(p-1)(T_F + T_B + T_W)`` with the three parts equal), and ``sync`` the slowest position's
gradient synchronisation and optimizer step. Colocated encoders under Optimus's bubble fill
run in the LLM's bubbles: ``T`` is the larger of the LLM's own ``T`` and the busiest unit's
total work.

Memory per position: its stages' static memory, plus the activations it holds at 1F1B's peak,
``min(m, K - k)`` microbatches in flight at position ``k`` of ``K`` (interleaved: Megatron-LM's
warm-up, ``2 (p - k - 1) + (v - 1) p + 1`` chunks of ``1/v`` of the position's layers), plus one
layer's backward working set. The simulator's peak memory (`loom.sim.memory`, from the real
schedule) is the check the search applies to what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.analytic import AnalyticCostModel
from loom.cost.model import Workload
from loom.plan.plan import LLM, Plan

BUBBLE_SHARE = {"1f1b": 1.0, "gpipe": 1.0, "zb-h1": 1 / 3}


@dataclass(frozen=True)
class Estimate:
    """An iteration time (seconds) and the peak memory of the fullest position (bytes per rank)."""

    iteration_time: float
    peak_memory: float
    bottleneck: str  # the slowest position, e.g. "llm.0 (+vision)"


def estimate(plan: Plan, cost: AnalyticCostModel, mean: dict[str, Workload]) -> Estimate:
    """`Estimate` of a resolved ``plan`` priced by ``cost`` with ``mean[module]`` the mean
    microbatch's workload (module docstring)."""
    llm = plan.spec(LLM)
    m = max(1, len(plan.microbatches_of(LLM, 0)))
    chain: list[tuple[str, float, float, float]] = []  # (label, seconds, hosted-encoder seconds, memory)
    fill = plan.bubble_fill == "optimus"
    depth = 0
    for name in plan.module_names:
        if plan.hosted_by_llm(name):
            continue
        spec = plan.spec(name)
        positions = spec.pipeline_depth
        for position in range(positions):
            unit = plan.unit_of(name, spec.hosted_stages(position)[0], 0)
            seconds = guest = 0.0
            held = static = transient = 0.0
            for module, stage, replica in plan.stages_of_unit(unit):
                share = len(plan.microbatches_of(module, replica)) / m
                w = mean.get(module, Workload())
                t = (cost.stage_time(module, stage, "forward", w) + cost.stage_time(module, stage, "backward", w)) * share
                if module != name:
                    guest += t
                else:
                    seconds += t
                static += cost.static_memory(module, stage)
                transient = max(transient, cost.transient_memory(module, stage, w))
                held += cost.activation_memory(module, stage, w) * _in_flight(plan, module, position, m, depth)
            label = f"{name}.{position}" + (" (+" + ",".join(sorted({g for g, _, _ in plan.stages_of_unit(unit)
                                                                     if g != name})) + ")" if guest else "")
            chain.append((label, seconds, guest, static + held + transient))
        depth += positions
    if not fill:
        chain = [(label, s + g, 0.0, mem) for label, s, g, mem in chain]
    times = [s for _, s, _, _ in chain]
    share = BUBBLE_SHARE.get(plan.schedule, 1.0) / max(1, llm.virtual_stages)
    slowest = max(range(len(times)), key=times.__getitem__)
    total = m * times[slowest] + share * (sum(times) - times[slowest])
    if fill:  # the encoders' work in the LLM's bubbles (module docstring)
        total = max(total, max(m * s + g * m for _, s, g, _ in chain))
    sync = max((cost.grad_sync_time(n, s) + cost.optimizer_time(n, s)
                for n in plan.module_names for s in range(plan.spec(n).num_stages)), default=0.0)
    return Estimate(total + sync, max(mem for *_, mem in chain), chain[slowest][0])


def _in_flight(plan: Plan, module: str, position: int, m: int, first_position: int) -> float:
    """Microbatches (in units of a whole stage's activations) a stage of ``module`` holds at its
    peak (module docstring); ``first_position``: the module's place along the chain."""
    total = sum(plan.spec(n).pipeline_depth for n in plan.module_names if not plan.hosted_by_llm(n))
    if plan.hosted_by_llm(module):  # on the LLM's units: in flight as the LLM's stage there
        module, first_position = LLM, _chain_offset(plan, LLM)
    spec = plan.spec(module)
    k = first_position + position
    if module == LLM and spec.virtual_stages > 1:
        p, v = spec.pipeline_depth, spec.virtual_stages
        return min(m * v, 2 * (p - position - 1) + (v - 1) * p + 1) / v
    return min(m, total - k)


def _chain_offset(plan: Plan, module: str) -> int:
    offset = 0
    for n in plan.module_names:
        if n == module:
            return offset
        if not plan.hosted_by_llm(n):
            offset += plan.spec(n).pipeline_depth
    return offset
