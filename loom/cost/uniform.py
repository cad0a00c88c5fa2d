"""`UniformCostModel`: constant per-stage costs, for closed-form tests and examples.

Every forward of a stage takes the same time whatever the microbatch holds, and likewise every
backward, transfer, gradient sync and optimizer step. Pipeline schedules have closed forms under
such costs (an S-stage chain with M microbatches runs 1F1B or GPipe in ``(M + S - 1)(F + B)``),
which is what the simulator's tests check against. A real plan uses the analytic or profiled
model instead.

Each cost is a number, or a mapping keyed by ``(module, stage)`` or by ``module`` (the
``(module, stage)`` key wins), so different modules and stages can cost different amounts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

from loom.cost.model import CostModel, MicrobatchWork, StageKind, Workload
from loom.plan.plan import Plan

# A constant, or per-module / per-stage constants: {"llm": 2.0, ("llm", 0): 3.0}.
Constant = Union[float, Mapping[Union[str, tuple[str, int]], float]]


def _lookup(value: Constant, module: str, stage: int, what: str) -> float:
    if isinstance(value, (int, float)):  # the common case first: an ABC check per call is slow
        return float(value)
    if not isinstance(value, Mapping):
        return float(value)
    if (module, stage) in value:
        return float(value[(module, stage)])
    if module in value:
        return float(value[module])
    raise KeyError(f"UniformCostModel.{what} has no entry for {module}.{stage}: give ({module!r}, {stage}) or {module!r}")


@dataclass
class UniformCostModel(CostModel):
    """Constant costs per stage; the workload is ignored.

    - ``forward``, ``backward``: seconds of one microbatch's forward / backward on the stage;
    - ``backward_weight``: the weight-gradient part of ``backward`` (ZB-H1's split backward
      prices ``backward_input`` at ``backward - backward_weight``); ``None``: not given, and a
      split backward is refused;
    - ``transfer``: seconds to move one activation (or its gradient) along an edge, keyed by the
      stage whose output it is;
    - ``grad_sync``: seconds of the stage's gradient all-reduce; as the `CostModel` contract says,
      a stage with a single replica has nothing to synchronise and gets 0;
    - ``optimizer``: seconds of the stage's optimizer step;
    - ``static``, ``activation``: bytes per rank held for the run / kept per microbatch in flight;
    - ``flops_per_microbatch``, ``peak_flops``: the MFU numerator per microbatch and the peak
      FLOP/s of one rank. With ``flops_per_microbatch = peak_flops * Σ_stages ranks_per_unit *
      (F + B)``, MFU equals the fraction of GPU time spent computing.
    """

    plan: Plan
    forward: Constant = 1.0
    backward: Constant = 2.0
    backward_weight: Constant | None = None
    transfer: Constant = 0.0
    grad_sync: Constant = 0.0
    optimizer: Constant = 0.0
    static: Constant = 0.0
    activation: Constant = 0.0
    flops_per_microbatch: float = 0.0
    peak_flops: float = 1.0

    def stage_time(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        if kind == "forward":
            return _lookup(self.forward, module, stage, "forward")
        if kind == "backward":
            return _lookup(self.backward, module, stage, "backward")
        if kind in ("backward_input", "backward_weight"):
            if self.backward_weight is None:
                raise ValueError(f"UniformCostModel.backward_weight is not set: a {kind} action (plan.schedule = "
                                 f"'zb-h1') needs the weight part of the backward; give backward_weight")
            w = _lookup(self.backward_weight, module, stage, "backward_weight")
            return w if kind == "backward_weight" else _lookup(self.backward, module, stage, "backward") - w
        raise ValueError(f"stage_time kind {kind!r}: choose 'forward', 'backward', 'backward_input' or "
                         f"'backward_weight'")

    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        return _lookup(self.transfer, module, stage, "transfer")

    def condition_transfer_time(self, src_unit: int, dst_unit: int, generator: str, work: Workload) -> float:
        return _lookup(self.transfer, generator, -1, "transfer")  # keyed (generator, -1): its input

    def grad_sync_time(self, module: str, stage: int) -> float:
        if self.plan.spec(module).data_parallel <= 1:
            return 0.0
        return _lookup(self.grad_sync, module, stage, "grad_sync")

    def optimizer_time(self, module: str, stage: int) -> float:
        return _lookup(self.optimizer, module, stage, "optimizer")

    def static_memory(self, module: str, stage: int) -> float:
        return _lookup(self.static, module, stage, "static")

    def activation_memory(self, module: str, stage: int, work: Workload) -> float:
        return _lookup(self.activation, module, stage, "activation")

    def model_flops(self, work: MicrobatchWork) -> float:
        return float(self.flops_per_microbatch)

    def peak_flops_per_rank(self) -> float:
        return float(self.peak_flops)
