"""The LLM pipeline timeline the bubble scheduler reads (optimus.md §2.2: "the LLM pipeline
training timeline" from offline profiling), as data, and its adapter from a `loom.sim` result.

Per LLM pipeline stage: the intervals its compute stream is busy (forwards, backwards, the
optimizer step), the first forward's start and the last backward's end. Per LLM microbatch
``i`` (in the order stage 0 runs their forwards): the dependency points of optimus.md §2.5,
``F_i``, when LLM stage 0 starts the forward of ``i`` (it needs the encoder output then), and
``B_i``, when LLM stage 0 ends the backward of ``i`` (the encoder output's gradient is ready;
under ZB-H1, when its input-gradient pass ends, if stage 0 runs one: the deferred
weight pass does not hold the encoder back).

What is *not* busy is a bubble encoder compute may fill: waiting on receives, the
data-parallel gradient synchronisation (optimus.md Table 1's DP bubbles are communication), and
the batch dispatch at the step's head (a collective and host work). All tensor-parallel ranks
of a stage share its timeline (the simulator plays a stage's TP group as one unit).

At action granularity each compute action is one busy interval. At kernel granularity
(`llm_timeline_from_sim` given ``kernels``, e.g. `loom.cost.kernels.stage_kernels`) each action
is cut into its kernels: the compute kernels are busy, the TP collectives between them are the
TP bubbles of optimus.md §1.2 (the compute stream idles) and go to ``link``, the intervals the
stage's TP link is busy, which encoder communication kernels must avoid (§2.4).

The adapter reads the schedules loom plays without virtual stages (GPipe, 1F1B, ZB-H1); it
takes each LLM stage as a device of its own, so it does not read an interleaved 1F1B timeline,
and the warm-up adjustment of §2.5 (Fig. 12) is not built: ``F_i`` and ``B_i`` are those of the
played schedule, unadjusted (optimus.md §7 points 9 and 19: without interleaving, stage 0
holds the whole first model chunk, so the paper's definitions carry over).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from collections.abc import Callable, Sequence

from loom.cost.arch import LLM
from loom.cost.kernels import Kernel
from loom.planner.optimus.model_planner import OptimusPlanError
from loom.schedule.timeline import TimelineEvent
from loom.sim.result import SimResult

# the compute stream's work (module docstring); ZB-H1 splits a backward into its input and
# weight passes (loom.schedule.ir.ActionKind)
BACKWARD_KINDS = ("backward", "backward_input", "backward_weight")
BUSY_KINDS = ("forward", *BACKWARD_KINDS, "optimizer_step")


@dataclass(frozen=True)
class StageTimeline:
    """One LLM stage: sorted, disjoint busy intervals ``(start, end)`` of its compute stream;
    ``compute_start`` is its first forward's start and ``compute_end`` its last backward's end;
    ``link``, at kernel granularity, the intervals its TP collectives hold the link (module
    docstring; empty at action granularity)."""

    busy: tuple[tuple[float, float], ...]
    compute_start: float
    compute_end: float
    link: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("busy", "link"):
            prev = float("-inf")
            for lo, hi in getattr(self, name):
                if hi < lo or lo < prev:
                    raise OptimusPlanError(f"StageTimeline.{name} = {getattr(self, name)[:4]}...: intervals must be "
                                           "sorted, disjoint and have end >= start")
                prev = hi
        if self.compute_end < self.compute_start:
            raise OptimusPlanError(f"StageTimeline: compute_end = {self.compute_end} precedes compute_start = "
                                   f"{self.compute_start}")

    @property
    def busy_time(self) -> float:
        return sum(hi - lo for lo, hi in self.busy)


@dataclass(frozen=True)
class LLMTimeline:
    """One LLM pipeline's iteration (module docstring): ``stages[p]``, the dependency points
    ``forward_points[i] = F_i`` and ``backward_points[i] = B_i`` of its ``N_mb`` microbatches in
    order, ``end`` the iteration's end, and ``microbatches[i]``, the simulator's id of the
    ``i``-th microbatch (for the data routing of §7 point 14)."""

    stages: tuple[StageTimeline, ...]
    forward_points: tuple[float, ...]
    backward_points: tuple[float, ...]
    end: float
    microbatches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.stages:
            raise OptimusPlanError("LLMTimeline.stages is empty: give one StageTimeline per LLM pipeline stage")
        if not self.forward_points or len(self.forward_points) != len(self.backward_points):
            raise OptimusPlanError(f"LLMTimeline: {len(self.forward_points)} forward points and "
                                   f"{len(self.backward_points)} backward points; give F_i and B_i for every "
                                   "microbatch")
        if list(self.forward_points) != sorted(self.forward_points):
            raise OptimusPlanError("LLMTimeline.forward_points must be in the order stage 0 runs the forwards")
        for i, (f, b) in enumerate(zip(self.forward_points, self.backward_points)):
            if b < f:
                raise OptimusPlanError(f"LLMTimeline: microbatch {i} has B_i = {b} before F_i = {f}")
        if self.microbatches and len(self.microbatches) != len(self.forward_points):
            raise OptimusPlanError("LLMTimeline.microbatches must name every microbatch (or be empty)")

    @property
    def num_microbatches(self) -> int:
        return len(self.forward_points)

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def _merge(intervals: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _kernel_intervals(e: TimelineEvent, kernels: Sequence[Kernel]) -> tuple[list, list]:
    """The compute and the communication intervals of event ``e`` cut into ``kernels`` (their
    times scaled to the event's span, which core sharing may stretch)."""
    total = sum(k.seconds for k in kernels)
    if total <= 0:
        return [(e.start_s, e.end_s)], []
    scale = (e.end_s - e.start_s) / total
    compute, link, t = [], [], e.start_s
    for k in kernels:
        end = t + k.seconds * scale
        (link if k.comm else compute).append((t, end))
        t = end
    return compute, link


def llm_timeline_from_sim(result: SimResult, replica: int = 0, module: str = LLM,
                          kernels: Callable[[TimelineEvent], Sequence[Kernel]] | None = None) -> LLMTimeline:
    """The `LLMTimeline` of LLM pipeline ``replica`` in a `loom.sim.SimResult` (module
    docstring). ``end`` is the simulated iteration time. A backward in several events (a
    balancing policy's split backward) ends with its last part. ``kernels(event)``, the kernels
    of a forward or backward event, gives the kernel-granularity timeline (module docstring)."""
    units = {u: role for u, role in result.roles.items() if role[0] == module and role[2] == replica}
    if not units:
        replicas = sorted({r for m, _, r in result.roles.values() if m == module})
        raise OptimusPlanError(f"llm_timeline_from_sim: no unit of module {module!r} replica {replica}; the result "
                               f"has replicas {replicas} of it")
    stage_of_rank = {result.first_rank[u]: role[1] for u, role in units.items()}
    num_stages = max(role[1] for role in units.values()) + 1
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    link: dict[int, list[tuple[float, float]]] = defaultdict(list)
    first_fwd: dict[int, float] = {}
    last_bwd: dict[int, float] = {}
    fwd0: dict[int, float] = {}
    bwd0: dict[int, float] = {}  # end of the whole backward of a microbatch on stage 0
    grad0: dict[int, float] = {}  # end of its input-gradient pass (ZB-H1), when split
    for e in result.timeline:
        s = stage_of_rank.get(e.rank)
        if s is None or e.module != module or e.kind not in BUSY_KINDS:
            continue
        if kernels is not None and e.kind != "optimizer_step":
            compute, comm = _kernel_intervals(e, kernels(e))
            busy[s] += compute
            link[s] += comm
        else:
            busy[s].append((e.start_s, e.end_s))
        if e.kind == "forward":
            first_fwd[s] = min(first_fwd.get(s, e.start_s), e.start_s)
            if s == 0:
                fwd0[e.microbatch] = min(fwd0.get(e.microbatch, e.start_s), e.start_s)
        elif e.kind in BACKWARD_KINDS:
            last_bwd[s] = max(last_bwd.get(s, e.end_s), e.end_s)
            if s == 0:
                bwd0[e.microbatch] = max(bwd0.get(e.microbatch, e.end_s), e.end_s)
                if e.kind == "backward_input":
                    grad0[e.microbatch] = max(grad0.get(e.microbatch, e.end_s), e.end_s)
    bwd0.update(grad0)
    missing = sorted(set(fwd0) - set(bwd0))
    if missing:
        raise OptimusPlanError(f"llm_timeline_from_sim: microbatches {missing[:8]} have no backward on LLM stage 0 "
                               "(a frozen LLM first stage?): Optimus needs B_i for every microbatch")
    stages = tuple(StageTimeline(_merge(busy[s]), first_fwd.get(s, 0.0), last_bwd.get(s, first_fwd.get(s, 0.0)),
                                 _merge(link[s])) for s in range(num_stages))
    order = sorted(fwd0, key=lambda j: (fwd0[j], j))
    return LLMTimeline(stages, tuple(fwd0[j] for j in order), tuple(bwd0[j] for j in order),
                       float(result.iteration_time), tuple(order))
