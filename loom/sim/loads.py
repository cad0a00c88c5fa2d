"""How evenly a layout spreads work, per phase: the balancing figures of `loom simulate --policy`
and `benchmarks/balance_quality.py` (simulated, docs/architecture.md principle 6).

A slot's *load* in a phase is the compute the slot's workload costs that module under the cost
model: the forward plus the (frozen-aware) backward summed over the module's stages, i.e. what
one pipeline of the module spends on it. The load of a data-parallel replica of the phase is the
sum over the slots it runs (slot ``j`` of module ``m`` runs on replica ``j % dp_m``). Balance is
reported as max / mean, 1 being perfect: across the replicas (OrchMLLM's and DistTrain's
straggler, orchmllm.md §2, disttrain.md §3.3) and across the microbatch slots (the 1F1B
straggler, disttrain.md §3.4; Entrain's bottleneck, entrain.md §3.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from loom.schedule.layout import max_over_mean
from loom.cost.model import CostModel, MicrobatchWork, Workload
from loom.plan.plan import Plan


@dataclass(frozen=True)
class PhaseLoads:
    """Per phase (module name): ``slots[phase][j]`` seconds of slot ``j``, ``replicas[phase][r]``
    seconds of data-parallel replica ``r``."""

    slots: dict[str, list[float]]
    replicas: dict[str, list[float]]

    def dp_ratio(self, phase: str) -> float:
        return max_over_mean(self.replicas[phase])

    def microbatch_ratio(self, phase: str) -> float:
        return max_over_mean(self.slots[phase])

    def summary(self) -> dict[str, Any]:
        """``{"dp": {phase: max/mean}, "microbatch": {phase: max/mean}}``."""
        return {"dp": {p: self.dp_ratio(p) for p in self.slots},
                "microbatch": {p: self.microbatch_ratio(p) for p in self.slots}}


def phase_loads(plan: Plan, cost: CostModel, work: Sequence[MicrobatchWork]) -> PhaseLoads:
    """The loads of every phase of ``plan`` for per-slot workloads ``work`` (``work[j][m]``: slot
    ``j`` of module ``m``, as `simulate` takes them)."""
    slots: dict[str, list[float]] = {}
    replicas: dict[str, list[float]] = {}
    for spec in plan.modules:
        m = spec.name
        per_slot = []
        for w in work:
            load = w.get(m, Workload())
            per_slot.append(sum(cost.stage_time(m, s, "forward", load) + cost.stage_time(m, s, "backward", load)
                                for s in range(spec.num_stages)))
        dp = spec.data_parallel
        per_replica = [0.0] * dp
        for j, t in enumerate(per_slot):
            per_replica[j % dp] += t
        slots[m], replicas[m] = per_slot, per_replica
    return PhaseLoads(slots, replicas)
