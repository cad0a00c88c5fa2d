"""Throughput under failures at cluster scale (oobleck.md §4.2, §6.2): a failure trace played over
Oobleck's templates and over restart-from-checkpoint, each phase priced by loom's simulator.
What ``loom simulate --failures`` runs; every figure is simulated.

- **Oobleck** (loom's ``loom.elastic``): templates for ``n0 .. N - f n0`` nodes
  (`node_specification`, `plan_templates`), the best instantiation at the start
  (`best_instantiation`), `reinstantiate` at each failure (the template combination is not
  re-optimised, as in the artifact), Eq. 2.6's distribution of the global batch. A phase's step
  is the slowest pipeline's simulated iteration (`Scenario.run` of its `template_plan` on its
  samples) plus the layer-wise gradient all-reduce across the pipelines (§3.9: per layer, its
  fp32 gradient over one rank of each pipeline, on the inter-node link, not overlapped with the
  backward, so an upper bound). A failure costs ``reconfigure_s`` (detection and re-forming
  process groups) plus copying the missing layers (`layer_copies`: fp32 weights and Adam
  moments, 12 bytes a parameter, each receiving rank over its inter-node link, in parallel),
  and the step in flight.
- **Restart** (Varuna's checkpoint-restart, Megatron-LM, torchtitan): the job restarts at the
  nodes that remain, as a grid of equal pipelines (the fastest ``d`` copies of one template
  with ``d n <= N'``; the other nodes idle), after ``restart_s`` (initialisation plus loading the
  checkpoint), and checkpoints every ``checkpoint_every`` steps at ``checkpoint_s`` each; a
  failure loses the steps since the last checkpoint. Both systems run the same templates and
  simulator, so the ratio isolates the recovery strategy.

Defaults: a checkpoint every 10 iterations (Varuna's policy in Oobleck's evaluation, §4.1);
the checkpoint (12 bytes a parameter) written and read at ``storage_bytes_per_s`` = 10 GB/s
(§4.1's six NVMe storage nodes on 200 Gbps InfiniBand, about half of one node's link); 60 s of
restart initialisation and 10 s of Oobleck reconfiguration besides the copies: assumptions,
since oobleck.md omits the measured values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from loom.cost import comm
from loom.cost.memory import MASTER_BYTES
from loom.plan.plan import LLM
from loom.planner.oobleck import (
    Instantiation, OobleckError, best_instantiation, instantiate, layer_copies, layer_holders, node_specification,
    pipelines_of, reinstantiate, template_plan,
)
from loom.planner.oobleck_costs import layer_times, one_stage_plan, scenario_min_nodes
from loom.planner.oobleck_templates import PipelineTemplate, plan_templates
from loom.sim.failures import FailureTrace, PhaseRun, TraceRun, play_oobleck, play_restart
from loom.sim.scenario import Scenario

STATE_BYTES_PER_PARAM = 12  # fp32 weights and Adam's two moments: what a copy or a checkpoint moves


@dataclass(frozen=True)
class FailureSettings:
    """``loom simulate --failures`` flags (module docstring's defaults)."""

    fault_tolerance: int = 1
    microbatch_size: int = 2
    min_nodes: int | None = None  # n0; default the memory minimum
    checkpoint_every: int = 10
    storage_bytes_per_s: float = 10e9
    restart_init_s: float = 60.0
    reconfigure_s: float = 10.0


@dataclass
class FailureReport:
    """Both systems through one trace (simulated)."""

    scenario: str
    trace: FailureTrace
    settings: FailureSettings
    template_sizes: tuple[int, ...]
    oobleck: TraceRun
    restart: TraceRun
    checkpoint_s: float
    restart_s: float
    stopped: str | None = None  # why Oobleck stopped early, if it did
    layouts: list[str] = field(default_factory=list)  # Oobleck's pipelines per phase

    @property
    def ratio(self) -> float:
        """Oobleck's samples/s over restart's (higher is better)."""
        return self.oobleck.samples_per_s / self.restart.samples_per_s if self.restart.samples_per_s else math.inf

    def summary(self) -> dict:
        def side(run: TraceRun) -> dict:
            return {"samples_per_s": run.samples_per_s, "fraction_of_failure_free": run.fraction_of_failure_free,
                    "failure_free_samples_per_s": run.failure_free_samples_per_s, "steps": run.steps,
                    "lost_steps": run.lost_steps,
                    "phases": [{"start_s": p.start_s, "end_s": p.end_s, "nodes": p.nodes, "step_s": p.step_s,
                                "recovery_s": p.recovery_s} for p in run.phases]}

        return {"scenario": self.scenario, "simulated": True, "num_nodes": self.trace.num_nodes,
                "failures": len(self.trace.events), "duration_s": self.trace.duration_s,
                "template_sizes": list(self.template_sizes), "settings": self.settings.__dict__,
                "checkpoint_s": self.checkpoint_s, "restart_s": self.restart_s,
                "oobleck": side(self.oobleck), "restart": side(self.restart), "oobleck_over_restart": self.ratio,
                "oobleck_stopped": self.stopped, "oobleck_pipelines": self.layouts}


class FailurePricer:
    """Templates and simulated step times of one scenario, cached (module docstring)."""

    def __init__(self, scenario: Scenario, settings: FailureSettings) -> None:
        self.scenario, self.settings = scenario, settings
        cluster = scenario.cluster
        self.N, self.M = cluster.num_nodes, cluster.gpus_per_node
        b = settings.microbatch_size
        memory = scenario_min_nodes(scenario, b)
        n0 = settings.min_nodes if settings.min_nodes is not None else memory
        self.spec = node_specification(self.N, settings.fault_tolerance, n0, memory)
        self.templates: dict[int, PipelineTemplate] = plan_templates(layer_times(scenario, b), self.spec.template_sizes,
                                                                     self.M)
        self.base = one_stage_plan(scenario, 1)
        self.metas = scenario.metas()
        self.batch = scenario.global_batch_size
        arch = scenario.arch
        # per LLM layer, its trainable parameters; the hosted encoders' sit with layer 0 (first stage)
        self.layer_params = [float(l.params) if l.trainable else 0.0 for l in arch.module(LLM).layers]
        self.layer_params[0] += sum(float(l.params) for e in arch.encoder_names for l in arch.module(e).layers
                                    if l.trainable)
        self.state_bytes = STATE_BYTES_PER_PARAM * sum(
            float(l.params) for name in arch.module_names for l in arch.module(name).layers)
        self.link = comm.inter_node_link(cluster)
        self._pipeline_time = lru_cache(maxsize=None)(self._simulate_pipeline)

    # ---- step times ------------------------------------------------------------------------
    def _simulate_pipeline(self, nodes: int, samples: int) -> float:
        """One pipeline of the ``nodes``-node template on ``samples`` samples, simulated."""
        b = self.settings.microbatch_size
        count = -(-samples // b)
        plan = template_plan(self.templates[nodes], self.base, count, self.scenario.arch.layer_counts())
        work = self.scenario.microbatch_work(self.metas[:samples], count)
        return self.scenario.run(plan, work).iteration_time

    def sync_time(self, sizes: tuple[int, ...]) -> float:
        """Layer-wise gradient all-reduce across ``len(sizes)`` pipelines (§3.9): every rank
        all-reduces each of its stage's layers in turn, the ranks in parallel."""
        x = len(sizes)
        if x <= 1:
            return 0.0
        worst = 0.0
        for n in set(sizes):
            t = self.templates[n]
            for s in range(t.num_stages):
                lo, hi = t.stage_boundaries[s], t.stage_boundaries[s + 1]
                per_rank = [p * MASTER_BYTES / t.stage_gpus[s] for p in self.layer_params[lo:hi]]
                worst = max(worst, sum(comm.all_reduce_time(bytes_, x, self.link) for bytes_ in per_rank))
        return worst

    def step_time(self, inst: Instantiation) -> float:
        """The slowest pipeline's simulated iteration on its share, plus the gradient sync."""
        slowest = max(self._pipeline_time(n, s) for n, s in zip(inst.pipeline_sizes, inst.distribution.samples))
        return slowest + self.sync_time(inst.pipeline_sizes)

    def instantiate(self, sizes: tuple[int, ...]) -> Instantiation:
        return instantiate(self.templates, sizes, self.batch, self.settings.microbatch_size, sync_time=self.sync_time)

    # ---- recovery --------------------------------------------------------------------------
    def copy_time(self, before: list[list[int]], after: list[list[int]], lost: set[int]) -> float:
        """Copying the missing layers (`layer_copies`): each receiving rank's bytes over its link."""
        L = len(self.layer_params)
        old = layer_holders(pipelines_of(before, self.templates), L)
        new = layer_holders(pipelines_of(after, self.templates), L)
        lost_ranks = {n * self.M + g for n in lost for g in range(self.M)}
        per_rank: dict[int, float] = {}
        for c in layer_copies(old, new, lost_ranks):
            for r in c.receivers:
                per_rank[r] = per_rank.get(r, 0.0) + self._layer_state_bytes(c.layer) / len(c.receivers)
        return max((comm.p2p_time(b, self.link) for b in per_rank.values()), default=0.0)

    def _layer_state_bytes(self, layer: int) -> float:
        arch = self.scenario.arch
        params = float(arch.module(LLM).layers[layer].params)
        if layer == 0:
            params += sum(float(l.params) for e in arch.encoder_names for l in arch.module(e).layers)
        return STATE_BYTES_PER_PARAM * params

    def restart_grid(self, nodes: int) -> tuple[int, int] | None:
        """The fastest grid of equal pipelines on ``nodes`` nodes (template size, copies), by the
        templates' own model; ``None`` if no template fits."""
        best = None
        for n in self.templates:
            d = nodes // n
            if d < 1:
                continue
            inst = self.instantiate((n,) * d)
            if best is None or inst.throughput > best[0]:
                best = (inst.throughput, n, d)
        return None if best is None else (best[1], best[2])


def simulate_failures(scenario: Scenario, trace: FailureTrace, settings: FailureSettings = FailureSettings(),
                      pricer: FailurePricer | None = None) -> FailureReport:
    """Play ``trace`` over Oobleck and over restart-from-checkpoint (module docstring)."""
    pricer = pricer or FailurePricer(scenario, settings)
    if trace.num_nodes != pricer.N:
        raise OobleckError(f"the failure trace has {trace.num_nodes} nodes but the scenario's cluster has {pricer.N} "
                           f"(cluster.num_gpus / cluster.gpus_per_node); make them agree")
    checkpoint_s = pricer.state_bytes / settings.storage_bytes_per_s
    restart_s = settings.restart_init_s + checkpoint_s
    f = settings.fault_tolerance
    sizes = tuple(sorted(pricer.templates))
    best = best_instantiation(pricer.templates, pricer.N, f, pricer.batch, settings.microbatch_size,
                              sync_time=pricer.sync_time)
    node_lists = [list(p.nodes) for p in best.pipelines(pricer.templates, list(range(pricer.N)))]
    oobleck_phases, restart_phases, layouts = [], [], []
    stopped = None
    phases = trace.phases()
    for k, (start, end, alive) in enumerate(phases):
        recovery = 0.0
        if k and stopped is None:
            lost = set(trace.events[k - 1].nodes)
            try:
                after = reinstantiate(node_lists, lost, sizes, f)
                recovery = settings.reconfigure_s + pricer.copy_time(node_lists, after, lost)
                node_lists = after
            except OobleckError as e:  # fewer than f + 1 replicas: Oobleck saves and exits (§2.5)
                stopped = f"at {start:.0f} s: {e}"
        if stopped is None:
            inst = pricer.instantiate(tuple(len(p) for p in node_lists))
            step = pricer.step_time(inst)
            layouts.append("+".join(str(len(p)) for p in node_lists))
        else:
            step = math.inf
        oobleck_phases.append(PhaseRun(start, end, len(alive), step, recovery))
        grid = pricer.restart_grid(len(alive))
        restart_step = math.inf if grid is None else pricer.step_time(pricer.instantiate((grid[0],) * grid[1]))
        restart_phases.append(PhaseRun(start, end, len(alive), restart_step, restart_s))
    return FailureReport(scenario.name, trace, settings, sizes, play_oobleck(oobleck_phases, pricer.batch),
                         play_restart(restart_phases, pricer.batch, settings.checkpoint_every, checkpoint_s),
                         checkpoint_s, restart_s, stopped, layouts)
