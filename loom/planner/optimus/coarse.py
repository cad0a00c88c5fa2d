"""Optimus's coarse bubble schedule (optimus.md §3.2 Algorithm 2's InitSchedule, §3.4) with
the encoder-LLM dependency rules of §3.6, its checker, and the search over one encoder plan's
partitions (`coarse_ranking`, `best_coarse_schedule`; over plans: `loom.planner.optimus.search`).

**The schedule** of one partition (``parts[j]`` microbatches for encoder pipeline ``j``; the
colocation map of `loom.planner.optimus.model_planner`: every device, the ``TP_enc`` ranks an
encoder stage runs on, hosts one encoder stage of one pipeline):

1. Forwards, all before the LLM's compute on each device (§3.4): every pipeline runs its
   microbatches in order through its stages as soon as possible from time 0: forward ``k`` of
   stage ``s`` starts at ``max(end(k, s-1) + transfer, end(k-1, s))``. Its ``k``-th output
   reaches LLM stage 0 at ``EF = end(k, last) + to_llm``.
2. The LLM timeline is shifted rigidly by the smallest ``shift >= 0`` (the latency model of
   optimus.md §3.4 [interp], decided: a rigid shift, not a re-simulation; §7 point 4) such that
   every device's forwards end by its LLM stage's first compute (shifted), and the global
   ordering holds: with the encoder outputs sorted by arrival, the ``i``-th to arrive feeds LLM
   microbatch ``i`` (§3.6) and ``EF_i <= F_i + shift``. Sorting is the best assignment for the
   shift (an exchange argument; the tests check it by brute force).
3. Backwards, all after the LLM's compute on each device: encoder pipeline ``j`` back-propagates
   exactly the microbatches it forwarded (the mapping-based check of §7 point 8, not the
   paper's sort of ``EB``), in the order their gradients arrive, ``B_i + shift + to_llm``,
   through its stages in reverse; each block takes the earliest free time on its device after
   it is ready and after the device's last LLM backward, around the LLM's remaining compute
   (its optimizer step), so it may fill the data-parallel gradient synchronisation's bubble.
4. ``latency = max(llm_end + shift, last encoder backward's end)``. The encoder's own gradient
   synchronisation and optimizer step are not priced (optimus.md §7 point 10).

Within a pipeline all microbatches cost the same (per-stage times, §2.2's offline profile), so
the forward order does not matter and the backward order by arrival is optimal for the
pipeline's completion (the tests check it by brute force).

**Figures** (`BubbleSchedule`): ``bubble_fill_fraction``, the share of the LLM's bubble time,
``Σ_devices (llm_end - busy)`` over the shifted LLM window, that encoder work fills;
``encoder_in_bubbles``, the share of encoder work that lies inside that window (optimus.md
§5.3.2's efficiency ``Eff_coarse``).

**The search over partitions** (`coarse_ranking`): for every partition a candidate enumerates,
the coarse schedule; the lowest latency wins (ties: the first in enumeration order). A lower
bound skips partitions that cannot win: ``llm_end + shift``, and per
pipeline its last gradient's arrival plus its backward chain, and its first stage's region start
plus its backwards there.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loom.planner.optimus.model_planner import (
    EncoderCandidate,
    EncoderParallel,
    EncoderStageTimes,
    OptimusPlanError,
)
from loom.planner.optimus.timeline import LLMTimeline

FORWARD, BACKWARD = "forward", "backward"
_EPS = 1e-12  # float slack for comparisons of sums of the same durations


class ScheduleViolation(ValueError):
    """A coarse schedule that breaks a rule; the message names the microbatch or the device."""


@dataclass(frozen=True)
class EncoderBlock:
    """One encoder stage's forward or backward of one encoder microbatch: encoder ``pipeline``
    and its ``microbatch`` (0-based, in its forward order), feeding LLM microbatch
    ``llm_microbatch`` (0-based, in `LLMTimeline` order), on ``ranks`` (of LLM replica 0),
    hosted by ``llm_stage``."""

    direction: str
    pipeline: int
    microbatch: int
    llm_microbatch: int
    stage: int
    llm_stage: int
    ranks: tuple[int, ...]
    start: float
    end: float
    layer: int = -1  # -1: the whole stage at once; else the layer's index in the stage (forward order)
    # at kernel granularity: the kernel's index in the order its pass runs the stage's kernels,
    # and whether it is a collective (it holds the link, not the compute stream)
    kernel: int = -1
    comm: bool = False


@dataclass(frozen=True)
class BubbleSchedule:
    """The bubble schedule of one encoder plan and partition: the coarse one (module
    docstring) or one the fine schedule improved (`loom.planner.optimus.fine`).
    ``feeds[i] = (pipeline, microbatch)``: which encoder microbatch feeds LLM microbatch ``i``;
    ``encoder_forward_end[i]`` is its ``EF_i`` (arrival at LLM stage 0) and
    ``encoder_backward_start[i]`` its ``EB_i`` (start of its backward on the encoder's last
    stage); times are on the shifted clock (the LLM starts at ``shift``). ``moved`` lists the
    ``(direction, pipeline, microbatch)`` the fine schedule moved into the bubbles between LLM
    compute (their blocks are layers), ``coarse_latency`` the latency before it did."""

    candidate: EncoderCandidate
    partition: tuple[int, ...]
    shift: float
    latency: float
    llm_end: float
    feeds: tuple[tuple[int, int], ...]
    encoder_forward_end: tuple[float, ...]
    encoder_backward_start: tuple[float, ...]
    blocks: tuple[EncoderBlock, ...]
    bubble_time: float
    filled_time: float
    encoder_time: float
    moved: tuple[tuple[str, int, int], ...] = ()
    coarse_latency: float | None = None

    @property
    def encoder(self) -> EncoderParallel:
        return self.candidate.encoder

    @property
    def bubble_fill_fraction(self) -> float:
        return self.filled_time / self.bubble_time if self.bubble_time > 0 else 0.0

    @property
    def encoder_in_bubbles(self) -> float:
        return self.filled_time / self.encoder_time if self.encoder_time > 0 else 1.0

    def summary(self) -> dict[str, object]:
        e = self.encoder
        return {"encoder_plan": {"dp": e.data_parallel, "pp": e.pipeline_parallel, "tp": e.tensor_parallel},
                "m": self.candidate.m, "partition": list(self.partition), "shift_s": self.shift,
                "latency_s": self.latency, "llm_end_s": self.llm_end, "bubble_fill_fraction": self.bubble_fill_fraction,
                "encoder_in_bubbles": self.encoder_in_bubbles, "moved": len(self.moved),
                "coarse_latency_s": self.latency if self.coarse_latency is None else self.coarse_latency}


def _check_inputs(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes) -> None:
    if timeline.num_stages != candidate.llm.pipeline_parallel:
        raise OptimusPlanError(f"the LLM timeline has {timeline.num_stages} stages but the candidate's LLM plan has "
                               f"pipeline_parallel = {candidate.llm.pipeline_parallel}: simulate that plan")
    if times.num_stages != candidate.encoder.pipeline_parallel:
        raise OptimusPlanError(f"EncoderStageTimes has {times.num_stages} stages but the encoder plan has "
                               f"pipeline_parallel = {candidate.encoder.pipeline_parallel}")


class _Coarse:
    """What every partition of one candidate shares: the forward chain, the devices' regions and
    free time, the dependency points."""

    def __init__(self, timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes) -> None:
        _check_inputs(timeline, candidate, times)
        self.timeline, self.candidate, self.times = timeline, candidate, times
        n, S = timeline.num_microbatches, times.num_stages
        self.S = S
        # forward chain from time 0: fend[k][s] (the same for every pipeline: step 1)
        fend: list[list[float]] = []
        for k in range(n):
            row = []
            for s in range(S):
                ready = row[s - 1] + times.transfer if s else 0.0
                if k:
                    ready = max(ready, fend[k - 1][s])
                row.append(ready + times.forward[s])
            fend.append(row)
        self.fend = fend
        self.groups = candidate.groups
        self.to_llm = [times.to_llm_of(a) for a in range(self.groups)]
        # per group a, per encoder stage s: the hosting LLM stage's first compute / last backward
        pp = candidate.encoder.pipeline_parallel
        st = timeline.stages
        self.cstart = [[st[a * pp + s].compute_start for s in range(S)] for a in range(self.groups)]
        self.cend = [[st[a * pp + s].compute_end for s in range(S)] for a in range(self.groups)]
        # busy intervals after the last backward (the optimizer step), per LLM stage
        self.tail = [[iv for iv in stage.busy if iv[1] > stage.compute_end + _EPS] for stage in st]
        self.bwd_total = sum(times.backward) + (S - 1) * times.transfer
        self.F = timeline.forward_points
        self.B = timeline.backward_points

    # -- steps 1 and 2 ------------------------------------------------------------------------
    def forward(self, parts: Sequence[int]) -> tuple[float, list[tuple[float, int, int]]]:
        """The shift, and the encoder outputs sorted by arrival: ``(EF, pipeline, k)``."""
        g = self.candidate.group_size
        shift = 0.0
        arrivals: list[tuple[float, int, int]] = []
        last = self.S - 1
        for j, nj in enumerate(parts):
            a = j // g
            row = self.fend[nj - 1]
            cs = self.cstart[a]
            for s in range(self.S):
                shift = max(shift, row[s] - cs[s])
            t = self.to_llm[a]
            arrivals.extend((self.fend[k][last] + t, j, k) for k in range(nj))
        arrivals.sort()
        for (ef, _, _), f in zip(arrivals, self.F):
            shift = max(shift, ef - f)
        return shift, arrivals

    def lower_bound(self, parts: Sequence[int], shift: float, arrivals: list[tuple[float, int, int]]) -> float:
        g = self.candidate.group_size
        bound = self.timeline.end + shift
        release = [0.0] * len(parts)
        for i, (_, j, _) in enumerate(arrivals):
            release[j] = max(release[j], self.B[i])
        for j, nj in enumerate(parts):
            a = j // g
            bound = max(bound, release[j] + shift + self.to_llm[a] + self.bwd_total,
                        self.cend[a][0] + shift + nj * self.times.backward[0])
        return bound

    # -- step 3 -------------------------------------------------------------------------------
    def _place(self, p: int, shift: float, ready: float, d: float) -> float:
        """Earliest start >= ready of a block of ``d`` seconds on LLM stage ``p``'s device that
        overlaps none of its (shifted) remaining busy intervals."""
        t = ready
        for lo, hi in self.tail[p]:
            lo, hi = lo + shift, hi + shift
            if t + d <= lo + _EPS:
                break
            t = max(t, hi)
        return t

    def backward(self, parts: Sequence[int], shift: float, arrivals: list[tuple[float, int, int]],
                 record: list | None = None) -> tuple[float, list[float]]:
        """The latest backward end, and ``EB_i`` per LLM microbatch; ``record`` collects
        ``(pipeline, k, stage, start, end)``."""
        g, pp = self.candidate.group_size, self.candidate.encoder.pipeline_parallel
        S, times = self.S, self.times
        per_pipe: list[list[tuple[float, int, int]]] = [[] for _ in parts]  # (release, i, k)
        for i, (_, j, k) in enumerate(arrivals):
            per_pipe[j].append((self.B[i] + shift + self.to_llm[j // g], i, k))
        eb = [0.0] * len(arrivals)
        finish = 0.0
        for j, jobs in enumerate(per_pipe):
            jobs.sort()
            a = j // g
            prev_end = [self.cend[a][s] + shift for s in range(S)]  # the region starts after the LLM's backwards
            for release, i, k in jobs:
                ready = release
                for s in range(S - 1, -1, -1):
                    p = a * pp + s
                    start = self._place(p, shift, max(ready, prev_end[s]), times.backward[s])
                    end = start + times.backward[s]
                    if s == S - 1:
                        eb[i] = start
                    if record is not None:
                        record.append((j, k, i, s, start, end))
                    prev_end[s] = end
                    ready = end + times.transfer
                finish = max(finish, prev_end[0])
        return finish, eb

    # -- the whole schedule -------------------------------------------------------------------
    def latency(self, parts: Sequence[int], best: float = float("inf")) -> float | None:
        """The latency of ``parts``, or None when its lower bound cannot beat ``best``."""
        shift, arrivals = self.forward(parts)
        if self.lower_bound(parts, shift, arrivals) >= best:
            return None
        finish, _ = self.backward(parts, shift, arrivals)
        return max(self.timeline.end + shift, finish)

    def build(self, parts: Sequence[int]) -> BubbleSchedule:
        c, tl, times = self.candidate, self.timeline, self.times
        shift, arrivals = self.forward(parts)
        record: list[tuple[int, int, int, int, float, float]] = []
        finish, eb = self.backward(parts, shift, arrivals, record)
        feed_of = {(j, k): i for i, (_, j, k) in enumerate(arrivals)}
        blocks = []
        for j, nj in enumerate(parts):
            for k in range(nj):
                for s in range(self.S):
                    end = self.fend[k][s]
                    blocks.append(EncoderBlock(FORWARD, j, k, feed_of[(j, k)], s, c.llm_stage(j, s), c.ranks(j, s),
                                               end - times.forward[s], end))
        for j, k, i, s, start, end in record:
            blocks.append(EncoderBlock(BACKWARD, j, k, i, s, c.llm_stage(j, s), c.ranks(j, s), start, end))
        llm_end = tl.end + shift
        bubble, filled, work = fill(blocks, tl, c, shift)
        return BubbleSchedule(
            candidate=c, partition=tuple(parts), shift=shift, latency=max(llm_end, finish), llm_end=llm_end,
            feeds=tuple((j, k) for _, j, k in arrivals), encoder_forward_end=tuple(ef for ef, _, _ in arrivals),
            encoder_backward_start=tuple(eb), blocks=tuple(blocks), bubble_time=bubble, filled_time=filled,
            encoder_time=work,
        )


def fill(blocks: Sequence[EncoderBlock], timeline: LLMTimeline, candidate: EncoderCandidate,
         shift: float) -> tuple[float, float, float]:
    """The LLM's bubble time over its shifted window, summed over devices (``TP_enc`` ranks
    each), the encoder work inside that window (it never overlaps LLM compute), and all encoder
    work: `BubbleSchedule`'s ``bubble_time``, ``filled_time`` and ``encoder_time``. Encoder
    collectives at kernel granularity hold the link, not the compute stream: they fill no
    bubble and do not count as work."""
    bubble = candidate.group_size * sum(timeline.end - st.busy_time for st in timeline.stages)
    end = timeline.end + shift
    compute = [b for b in blocks if not b.comm]
    filled = sum(max(0.0, min(b.end, end) - max(b.start, shift)) for b in compute)
    return bubble, filled, sum(b.end - b.start for b in compute)


def coarse_schedule(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes,
                    partition: Sequence[int]) -> BubbleSchedule:
    """The coarse schedule of ``partition`` (module docstring)."""
    parts = tuple(partition)
    if len(parts) != candidate.m:
        raise OptimusPlanError(f"partition {list(parts)} has {len(parts)} parts; the encoder plan has m = "
                               f"{candidate.m} pipelines")
    if min(parts) < 1 or sum(parts) != timeline.num_microbatches:
        raise OptimusPlanError(f"partition {list(parts)}: parts must be >= 1 and sum to the LLM's "
                               f"{timeline.num_microbatches} microbatches")
    return _Coarse(timeline, candidate, times).build(parts)


def coarse_ranking(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes, top: int = 1,
                   partitions: Iterable[Sequence[int]] | None = None,
                   max_partitions: int | None = 4096) -> tuple[list[tuple[float, tuple[int, ...]]], int]:
    """The ``top`` lowest coarse latencies over ``partitions`` (default: the candidate's,
    `EncoderCandidate.partitions`) as ``(latency, partition)``, best first (ties: enumeration
    order), and how many partitions were considered."""
    engine = _Coarse(timeline, candidate, times)
    if partitions is None:
        partitions = candidate.partitions(timeline.num_microbatches, max_partitions)
    kept: list[tuple[float, int, tuple[int, ...]]] = []  # max-heap by (latency, order) via negation
    count = 0
    for parts in partitions:
        worst = -kept[0][0] if len(kept) >= top else float("inf")
        lat = engine.latency(parts, worst)
        if lat is not None and lat < worst:
            if len(kept) >= top:
                heapq.heappop(kept)
            heapq.heappush(kept, (-lat, -count, tuple(parts)))
        count += 1
    return [(lat, parts) for lat, _, parts in sorted((-nl, -nc, parts) for nl, nc, parts in kept)], count


def best_coarse_schedule(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes,
                         partitions: Iterable[Sequence[int]] | None = None,
                         max_partitions: int | None = 4096) -> tuple[BubbleSchedule | None, int]:
    """The lowest-latency coarse schedule over ``partitions`` (`coarse_ranking`), and how many
    partitions were considered."""
    ranked, count = coarse_ranking(timeline, candidate, times, 1, partitions, max_partitions)
    if not ranked:
        return None, count
    return _Coarse(timeline, candidate, times).build(ranked[0][1]), count


def check_bubble_schedule(schedule: BubbleSchedule, timeline: LLMTimeline, times: EncoderStageTimes) -> None:
    """Check every rule of a coarse schedule independently of how it was built; raise
    `ScheduleViolation` naming the first broken one:

    - every LLM microbatch is fed by exactly one encoder microbatch, and pipeline ``j`` runs
      ``partition[j]`` of them, forward and backward, on every stage;
    - ``EF_i <= F_i`` and ``EB_i >= B_i`` (shifted clock, with the transfer to and from the LLM),
      ``EB`` taken from the microbatch that fed ``i`` (optimus.md §3.6, §7 point 8);
    - encoder stage order: a forward of stage ``s`` starts after stage ``s - 1``'s of the same
      microbatch has ended and been sent; a backward of stage ``s`` after stage ``s + 1``'s;
    - each block lasts its stage's time, or (the fine schedule's, `loom.planner.optimus.fine`)
      each of a stage's layers (or, at kernel granularity, kernels) runs once, in order (a
      backward last layer first), lasting its time; compute blocks on a device do not overlap
      each other, nor the device's LLM busy intervals; collectives do not overlap each other
      nor the LLM's TP collectives (``StageTimeline.link``); whole-stage forwards end by the
      device's first LLM compute and whole-stage backwards start after its last LLM backward
      (the coarse regions)."""
    c, shift = schedule.candidate, schedule.shift
    g = c.group_size
    n = timeline.num_microbatches
    if sorted(schedule.feeds) != sorted((j, k) for j, nj in enumerate(schedule.partition) for k in range(nj)) \
            or len(schedule.feeds) != n:
        raise ScheduleViolation(f"the feeds {schedule.feeds[:6]}... do not give each of the {n} LLM microbatches "
                                f"exactly one encoder microbatch of partition {list(schedule.partition)}")
    parts: dict[tuple[str, int, int, int], list[EncoderBlock]] = {}
    for b in schedule.blocks:
        if b.llm_stage != c.llm_stage(b.pipeline, b.stage) or b.ranks != c.ranks(b.pipeline, b.stage):
            raise ScheduleViolation(f"pipeline {b.pipeline} stage {b.stage} runs off its colocated ranks")
        parts.setdefault((b.direction, b.pipeline, b.microbatch, b.stage), []).append(b)
    # per (pipeline, microbatch, stage): the (start, end) of its forward and of its backward
    fwd: dict[tuple[int, int, int], tuple[float, float]] = {}
    bwd: dict[tuple[int, int, int], tuple[float, float]] = {}
    for (direction, j, k, s), blocks in parts.items():
        where = f"{direction} of pipeline {j} microbatch {k} stage {s}"
        units = times.units(direction, s)
        if len(blocks) == 1 and blocks[0].layer < 0:  # the whole stage at once
            runs = [(blocks[0], sum(d for d, _, _ in units))]
        else:
            kernel = blocks[0].kernel >= 0
            order = sorted(blocks, key=lambda b: b.kernel if kernel else
                           (b.layer if direction == FORWARD else -b.layer))
            got = [(b.kernel, b.layer, b.comm) if kernel else b.layer for b in order]
            expected = [(x, layer, comm) if kernel else layer for x, (_, comm, layer) in enumerate(units)]
            if got != expected:
                raise ScheduleViolation(f"{where}: runs {'kernels' if kernel else 'layers'} {got[:8]}..., not each "
                                        f"of its {len(units)} once in order")
            runs = [(b, d) for b, (d, _, _) in zip(order, units)]
        for (x, _), (y, _) in zip(runs, runs[1:]):
            if y.start + _EPS < x.end:
                raise ScheduleViolation(f"{where}: layer {y.layer} (kernel {y.kernel}) starts before layer {x.layer} "
                                        f"(kernel {x.kernel}) ends")
        for b, dur in runs:
            if abs((b.end - b.start) - dur) > 1e-9 * max(1.0, dur):
                raise ScheduleViolation(f"{where} (layer {b.layer}, kernel {b.kernel}) lasts {b.end - b.start}, not "
                                        f"its {dur}")
        units = runs
        (fwd if direction == FORWARD else bwd)[(j, k, s)] = (units[0][0].start, units[-1][0].end)
    S = times.num_stages
    for i, (j, k) in enumerate(schedule.feeds):
        for s in range(S):
            if (j, k, s) not in fwd or (j, k, s) not in bwd:
                raise ScheduleViolation(f"LLM microbatch {i}: encoder pipeline {j} microbatch {k} lacks its "
                                        f"forward or backward on stage {s}")
        to_llm = times.to_llm_of(j // g)
        ef = fwd[(j, k, S - 1)][1] + to_llm
        if ef > timeline.forward_points[i] + shift + _EPS:
            raise ScheduleViolation(f"LLM microbatch {i}: EF_i = {ef:.6g} > F_i = "
                                    f"{timeline.forward_points[i] + shift:.6g} (its encoder output, from pipeline "
                                    f"{j} microbatch {k}, arrives after the LLM needs it)")
        eb = bwd[(j, k, S - 1)][0]
        if eb + _EPS < timeline.backward_points[i] + shift + to_llm:
            raise ScheduleViolation(f"LLM microbatch {i}: EB_i = {eb:.6g} < B_i = "
                                    f"{timeline.backward_points[i] + shift + to_llm:.6g} (pipeline {j} microbatch {k} "
                                    "starts its backward before the LLM's gradient arrives)")
        for s in range(1, S):
            if fwd[(j, k, s)][0] + _EPS < fwd[(j, k, s - 1)][1] + times.transfer:
                raise ScheduleViolation(f"pipeline {j} microbatch {k}: forward of stage {s} starts before stage "
                                        f"{s - 1}'s output arrives")
            if bwd[(j, k, s - 1)][0] + _EPS < bwd[(j, k, s)][1] + times.transfer:
                raise ScheduleViolation(f"pipeline {j} microbatch {k}: backward of stage {s - 1} starts before "
                                        f"stage {s}'s gradient arrives")
    by_device: dict[tuple[tuple[int, ...], bool], list[EncoderBlock]] = {}
    for b in schedule.blocks:
        by_device.setdefault((b.ranks, b.comm), []).append(b)
    for (ranks, comm), blocks in by_device.items():
        what = "collectives" if comm else "compute"
        blocks.sort(key=lambda b: (b.start, b.end))
        for x, y in zip(blocks, blocks[1:]):
            if y.start + _EPS < x.end:
                raise ScheduleViolation(f"ranks {ranks}: {x.direction} of pipeline {x.pipeline} microbatch "
                                        f"{x.microbatch} overlaps {y.direction} of microbatch {y.microbatch} "
                                        f"({what})")
        stage = timeline.stages[blocks[0].llm_stage]
        llm = stage.link if comm else stage.busy
        ends = [hi + shift for _, hi in llm]
        for b in blocks:
            if b.layer < 0 and b.direction == FORWARD and b.end > stage.compute_start + shift + _EPS:
                raise ScheduleViolation(f"ranks {ranks}: forward of pipeline {b.pipeline} microbatch {b.microbatch} "
                                        "ends after the LLM's first compute there (coarse: forwards before)")
            if b.layer < 0 and b.direction == BACKWARD and b.start + _EPS < stage.compute_end + shift:
                raise ScheduleViolation(f"ranks {ranks}: backward of pipeline {b.pipeline} microbatch "
                                        f"{b.microbatch} starts before the LLM's last backward there ends")
            first = bisect.bisect_right(ends, b.start + _EPS)  # the first LLM interval ending after b starts
            if first < len(llm) and llm[first][0] + shift + _EPS < b.end:
                lo, hi = llm[first]
                raise ScheduleViolation(f"ranks {ranks}: {b.direction} of pipeline {b.pipeline} microbatch "
                                        f"{b.microbatch} overlaps the LLM's {'TP collective' if comm else 'compute'} "
                                        f"[{lo + shift:.6g}, {hi + shift:.6g}]")
