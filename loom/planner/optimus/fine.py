"""Optimus's fine-grained bubble exploitation at layer granularity (optimus.md §3.2 Algorithm
2's OptimizeSchedule, findCritical and ScheduleKernels, §3.5), starting from the coarse
schedule of `loom.planner.optimus.coarse`.

loom's LLM timeline (`loom.planner.optimus.timeline`) is at action granularity: its bubbles
between LLM compute are the pipeline bubbles ("PP other", §1.2), not the sub-millisecond TP
bubbles inside a layer, so the unit placed here is an encoder *layer* (the runtime's unit, as
the issue asks of the runtime), not a kernel; a layer never straddles LLM compute (optimus.md
§7 point 6: no straddling). Encoder communication kernels under LLM compute (§2.4) need a
kernel-level timeline and are not modelled.

Times are relative to the LLM's start (the LLM runs at ``[0, llm_end]``, shifted by ``shift``
on the absolute clock of the coarse schedule). Each device (an encoder stage's ``TP_enc``
ranks) has three regions: before its LLM stage's first compute (the coarse forwards, from
absolute time 0), between its first compute and its last backward (the *interleaved* bubbles
this module fills) and after it (the coarse backwards).

``OptimizeSchedule(FWD)`` then ``OptimizeSchedule(BWD)`` (Algorithm 2 lines 7-8), each a loop:

- **findCritical, forward** [interp, optimus.md §3.5]: the pipeline whose coarse forwards need
  the most shift: the largest of its devices' ``forward end - LLM first compute`` and of its
  outputs' ``EF - F_i`` in the global ordering (ties: the lowest pipeline);
- **ScheduleKernels, forward**: that pipeline's last coarse forward microbatch (Fig. 10 moves
  "microbatch 8") leaves the pre-LLM region and is placed layer by layer, upstream stage to
  downstream, each layer at the earliest free time of its device's interleaved region (first
  fit) after the previous layer and, across stages, the transfer; it fails if a layer does not
  fit before the device's last LLM backward. The shift is then the least for which the global
  ordering holds (`_least_shift`: feasibility is monotone in the shift);
- **findCritical, backward**: the pipeline whose coarse backwards end last, when that is later
  than the LLM's end (otherwise the backward is not critical and the loop stops);
- **ScheduleKernels, backward** [interp, §7 point 5: the paper does not say which microbatch]:
  that pipeline's coarse backward whose gradient arrives first moves, layer by layer from the
  last stage down (each stage's layers last first), into the interleaved regions after its
  gradient arrives;
- a move is kept only if the dependencies still hold (``EF_i <= F_i``, ``EB_i >= B_i`` by the
  mapping, checked on the *new* schedule: optimus.md §7 point 7) and the latency strictly
  drops (§3.5 [interp]: "also stop if S2.lat >= S.lat"); otherwise the loop returns the current
  schedule. So the latency never rises over the iterations, and never exceeds the coarse one.

The backward phase keeps the forward phase's mapping of encoder microbatches to LLM
microbatches (the backward does not change arrivals).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from loom.planner.optimus.coarse import (
    _EPS,
    BACKWARD,
    FORWARD,
    BubbleSchedule,
    EncoderBlock,
    _Coarse,
    coarse_ranking,
    coarse_schedule,
    fill,
)
from loom.planner.optimus.model_planner import EncoderCandidate, EncoderStageTimes, OptimusPlanError
from loom.planner.optimus.timeline import LLMTimeline


class _Device:
    """Occupied intervals of one device (relative time): the LLM's compute and the encoder
    layers moved there; sorted, disjoint."""

    def __init__(self, starts: list[float], ends: list[float]) -> None:
        self.starts, self.ends = starts, ends

    def copy(self) -> _Device:
        return _Device(list(self.starts), list(self.ends))

    def fit(self, t: float, d: float) -> float:
        """The earliest start >= ``t`` of ``d`` free seconds."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.ends[i] > t:
            t = self.ends[i]
        i += 1
        while i < len(self.starts) and t + d > self.starts[i] + _EPS:
            t = max(t, self.ends[i])
            i += 1
        return t

    def add(self, lo: float, hi: float) -> None:
        i = bisect.bisect_left(self.starts, lo)
        self.starts.insert(i, lo)
        self.ends.insert(i, hi)


@dataclass
class _State:
    pre: list[int]  # per pipeline: microbatches 0 .. pre[j] - 1 still forward in the pre-LLM region
    devices: dict[tuple[int, int], _Device]  # (pipeline, stage) -> its device
    # moved work: (direction, pipeline, microbatch) -> ([(stage, layer, start, end)], EF or EB)
    moved: dict[tuple[str, int, int], tuple[list[tuple[int, int, float, float]], float]] = field(default_factory=dict)
    order: list[tuple[str, int, int]] = field(default_factory=list)

    def copy(self) -> _State:
        return _State(list(self.pre), dict(self.devices), dict(self.moved), list(self.order))


class _Fine:
    def __init__(self, timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes) -> None:
        self.c = _Coarse(timeline, candidate, times)
        self.tl, self.cand, self.times = timeline, candidate, times
        self.g = candidate.group_size

    # -- the forward arrivals and the least shift ----------------------------------------------
    def arrivals(self, st: _State) -> tuple[list[tuple[float, int, int]], list[tuple[float, int, int]], float]:
        """Pre-region arrivals (absolute), moved arrivals (relative), and the devices' bound
        on the shift."""
        c, S = self.c, self.c.S
        pre, moved, device = [], [], 0.0
        for j, nj in enumerate(st.pre):
            a = j // self.g
            if nj:
                row = c.fend[nj - 1]
                device = max(device, max(row[s] - c.cstart[a][s] for s in range(S)))
            pre.extend((c.fend[k][S - 1] + c.to_llm[a], j, k) for k in range(nj))
        for (d, j, k), (_, ef) in st.moved.items():
            if d == FORWARD:
                moved.append((ef, j, k))
        return pre, moved, device

    def _feasible(self, pre: list[tuple[float, int, int]], moved: list[tuple[float, int, int]], x: float) -> bool:
        merged = sorted([(t - x, j, k) for t, j, k in pre] + moved)
        return all(t <= f + _EPS for (t, _, _), f in zip(merged, self.c.F))

    def least_shift(self, st: _State) -> tuple[float, list[tuple[float, int, int]]] | None:
        """The least shift for which every device's coarse forwards end by its first LLM compute
        and the global ordering holds (None: no shift does), and the arrivals sorted (relative)."""
        pre, moved, device = self.arrivals(st)
        lo = max(0.0, device)
        # feasibility only changes where a pre-region arrival crosses some F_i
        points = sorted({lo} | {t - f for t, _, _ in pre for f in self.c.F if t - f > lo})
        if not self._feasible(pre, moved, points[-1]):
            return None
        a, b = 0, len(points) - 1
        while a < b:
            mid = (a + b) // 2
            if self._feasible(pre, moved, points[mid]):
                b = mid
            else:
                a = mid + 1
        x = points[a]
        return x, sorted([(t - x, j, k) for t, j, k in pre] + moved)

    # -- the coarse backwards (relative) --------------------------------------------------------
    def post(self, st: _State, arrivals: list[tuple[float, int, int]],
             record: list | None = None) -> tuple[list[float], dict[int, float]]:
        """Per pipeline the end of its coarse backwards (relative; its region start when it has
        none), and ``EB`` of each LLM microbatch they feed."""
        c, S, times = self.c, self.c.S, self.times
        pp = self.cand.encoder.pipeline_parallel
        jobs: list[list[tuple[float, int, int]]] = [[] for _ in st.pre]
        for i, (_, j, k) in enumerate(arrivals):
            if (BACKWARD, j, k) not in st.moved:
                jobs[j].append((c.B[i] + c.to_llm[j // self.g], i, k))
        finish, eb = [], {}
        for j, js in enumerate(jobs):
            js.sort()
            a = j // self.g
            prev = [c.cend[a][s] for s in range(S)]
            for release, i, k in js:
                ready = release
                for s in range(S - 1, -1, -1):
                    start = c._place(a * pp + s, 0.0, max(ready, prev[s]), times.backward[s])
                    prev[s] = start + times.backward[s]
                    if s == S - 1:
                        eb[i] = start
                    if record is not None:
                        record.append((j, k, i, s, start, prev[s]))
                    ready = prev[s] + times.transfer
            finish.append(prev[0])
        return finish, eb

    def latency(self, x: float, finish: Sequence[float]) -> float:
        return x + max([self.tl.end, *finish])

    # -- ScheduleKernels ------------------------------------------------------------------------
    def place(self, st: _State, direction: str, j: int, k: int, ready: float) -> _State | None:
        """``st`` with microbatch ``k`` of pipeline ``j`` moved into the interleaved regions,
        layer by layer from ``ready`` (None: a layer does not fit)."""
        c, S, times = self.c, self.c.S, self.times
        a = j // self.g
        new = st.copy()
        blocks = []
        stages = range(S) if direction == FORWARD else range(S - 1, -1, -1)
        first = None
        for s in stages:
            dev = new.devices[(j, s)].copy()
            new.devices[(j, s)] = dev
            t = max(ready, c.cstart[a][s])
            n = len(times.layers(direction, s))
            for idx, d in enumerate(times.layers(direction, s)):
                start = dev.fit(t, d)
                if start + d > c.cend[a][s] + _EPS:
                    return None
                dev.add(start, start + d)
                layer = idx if direction == FORWARD else n - 1 - idx
                blocks.append((s, layer, start, start + d))
                if first is None:
                    first = start
                t = start + d
            ready = t + times.transfer
        point = (ready - times.transfer + c.to_llm[a]) if direction == FORWARD else first
        new.moved[(direction, j, k)] = (blocks, point)
        new.order.append((direction, j, k))
        return new

    # -- OptimizeSchedule -----------------------------------------------------------------------
    def optimize(self, parts: Sequence[int]) -> tuple[_State, float, list[tuple[float, int, int]], float]:
        c = self.c
        devices = {}
        for j in range(len(parts)):
            for s in range(c.S):
                busy = self.tl.stages[self.cand.llm_stage(j, s)].busy
                devices[(j, s)] = _Device([lo for lo, _ in busy], [hi for _, hi in busy])
        st = _State(list(parts), devices)
        found = self.least_shift(st)
        assert found is not None  # the coarse schedule always has a shift
        x, arrivals = found
        lat = coarse = self.latency(x, self.post(st, arrivals)[0])
        # FWD
        while True:
            contrib = [float("-inf")] * len(parts)
            for j, nj in enumerate(st.pre):
                if nj:
                    a = j // self.g
                    contrib[j] = max(c.fend[nj - 1][s] - c.cstart[a][s] for s in range(c.S))
            for i, (t, j, k) in enumerate(arrivals):
                if k < st.pre[j]:
                    contrib[j] = max(contrib[j], t + x - c.F[i])
            j = max(range(len(parts)), key=lambda q: (contrib[q], -q))
            if contrib[j] == float("-inf") or x <= _EPS:
                break
            new = self.place(st, FORWARD, j, st.pre[j] - 1, c.cstart[j // self.g][0])
            if new is None:
                break
            new.pre[j] -= 1
            found = self.least_shift(new)
            if found is None:
                break
            nx, narr = found
            nlat = self.latency(nx, self.post(new, narr)[0])
            if nlat >= lat - _EPS:
                break
            st, x, arrivals, lat = new, nx, narr, nlat
        # BWD
        while True:
            finish, _ = self.post(st, arrivals)
            j = max(range(len(parts)), key=lambda q: (finish[q], -q))
            if finish[j] <= self.tl.end + _EPS:
                break
            pending = sorted((c.B[i], i, k) for i, (_, jj, k) in enumerate(arrivals)
                             if jj == j and (BACKWARD, j, k) not in st.moved)
            if not pending:
                break
            b, i, k = pending[0]
            new = self.place(st, BACKWARD, j, k, b + c.to_llm[j // self.g])
            if new is None:
                break
            nlat = self.latency(x, self.post(new, arrivals)[0])
            if nlat >= lat - _EPS:
                break
            st, lat = new, nlat
        return st, x, arrivals, coarse

    def build(self, parts: Sequence[int]) -> BubbleSchedule:
        c, cand, times = self.c, self.cand, self.times
        st, x, arrivals, coarse = self.optimize(parts)
        record: list[tuple[int, int, int, int, float, float]] = []
        finish, eb = self.post(st, arrivals, record)
        feed_of = {(j, k): i for i, (_, j, k) in enumerate(arrivals)}
        blocks = []
        for j, nj in enumerate(st.pre):
            for k in range(nj):
                for s in range(c.S):
                    end = c.fend[k][s]
                    blocks.append(EncoderBlock(FORWARD, j, k, feed_of[(j, k)], s, cand.llm_stage(j, s),
                                               cand.ranks(j, s), end - times.forward[s], end))
        for j, k, i, s, start, end in record:
            blocks.append(EncoderBlock(BACKWARD, j, k, i, s, cand.llm_stage(j, s), cand.ranks(j, s), start + x,
                                       end + x))
        for (d, j, k), (layers, point) in st.moved.items():
            i = feed_of[(j, k)]
            for s, layer, start, end in layers:
                blocks.append(EncoderBlock(d, j, k, i, s, cand.llm_stage(j, s), cand.ranks(j, s), start + x, end + x,
                                           layer))
            if d == BACKWARD:
                eb[i] = point
        llm_end = self.tl.end + x
        bubble, filled, work = fill(blocks, self.tl, cand, x)
        return BubbleSchedule(
            candidate=cand, partition=tuple(parts), shift=x, latency=self.latency(x, finish), llm_end=llm_end,
            feeds=tuple((j, k) for _, j, k in arrivals), encoder_forward_end=tuple(t + x for t, _, _ in arrivals),
            encoder_backward_start=tuple(eb[i] + x for i in range(len(arrivals))), blocks=tuple(blocks),
            bubble_time=bubble, filled_time=filled, encoder_time=work, moved=tuple(st.order), coarse_latency=coarse,
        )


def fine_schedule(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes,
                  partition: Sequence[int]) -> BubbleSchedule:
    """The coarse schedule of ``partition`` improved by OptimizeSchedule(FWD) then (BWD)
    (module docstring)."""
    coarse_schedule(timeline, candidate, times, partition)  # checks the partition's shape
    return _Fine(timeline, candidate, times).build(tuple(partition))


def best_fine_schedule(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes,
                       top: int = 8, max_partitions: int | None = 4096) -> tuple[BubbleSchedule | None, int]:
    """Algorithm 2 (optimus.md §3.2) with the fine step applied to the ``top`` partitions of
    lowest coarse latency (`loom.planner.optimus.coarse.coarse_ranking`), not to every one
    (decided: the fine step costs a re-evaluation per move; the coarse latency bounds the fine
    one from above, so the best coarse partitions are the natural ones to refine). Returns the
    lowest fine latency (ties: the better coarse rank) and how many partitions were ranked."""
    if top < 1:
        raise OptimusPlanError(f"top = {top}: refine at least one partition")
    ranked, count = coarse_ranking(timeline, candidate, times, top, max_partitions=max_partitions)
    engine = _Fine(timeline, candidate, times)
    best: BubbleSchedule | None = None
    for _, parts in ranked:
        sched = engine.build(parts)
        if best is None or sched.latency < best.latency - _EPS:
            best = sched
    return best, count

