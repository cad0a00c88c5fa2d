"""Optimus's fine-grained bubble exploitation at layer granularity (optimus.md §3.2 Algorithm
2's OptimizeSchedule, findCritical and ScheduleKernels, §3.5), starting from the coarse
schedule of `loom.planner.optimus.coarse`.

Two granularities, set by the inputs:

- **layer** (an action-granularity `LLMTimeline`, `EncoderStageTimes` with layers): the bubbles
  between LLM compute are the pipeline bubbles ("PP other", §1.2) and the unit placed is an
  encoder *layer*, the unit the runtime's fill moves (`loom.sim.bubble_fill`);
- **kernel** (a kernel-granularity `LLMTimeline` and `EncoderStageTimes.kernel_forward`, both
  from `loom.cost.kernels`): the LLM's compute actions are cut into kernels, so the TP bubbles
  inside its layers (the compute stream idles during its TP collectives, §1.2) are free time
  too, and the unit placed is an encoder *kernel* (ScheduleKernels, §3.5). An encoder compute
  kernel takes free compute time; an encoder collective takes free link time (not during the
  LLM's TP collectives: §2.4 puts encoder communication under LLM compute, never in TP
  bubbles), and may overlap LLM compute.

A unit never straddles LLM work (optimus.md §7 point 6: no straddling).

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
  mapping, checked on the *new* schedule: optimus.md §7 point 7) and the latency does not rise
  (§3.5 [interp] says "stop if S2.lat >= S.lat"; decided: a tie continues, because pipelines
  with equal parts are critical together and only moving one microbatch from each lowers the
  latency; every move takes one microbatch out of a coarse region, so the loop ends). Each
  phase returns its lowest-latency schedule (ties: the fewest moves), so the latency never
  exceeds the coarse one.

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
    """Occupied intervals of one resource of a device (relative time), the compute stream or the
    link: the LLM's and the encoder units moved there; sorted, disjoint. Never changed in
    place: `with_added` makes a new one, so states share devices."""

    def __init__(self, starts: list[float], ends: list[float]) -> None:
        self.starts, self.ends = starts, ends

    def cursor(self, t: float) -> int:
        """The first interval ending after ``t``."""
        return bisect.bisect_right(self.ends, t)

    def fit(self, i: int, t: float, d: float) -> tuple[float, int]:
        """The earliest start >= ``t`` of ``d`` free seconds, searching from interval ``i`` (a
        `cursor` at or before ``t``), and the cursor after it: successive fits of later units
        walk the intervals once."""
        starts, ends, n = self.starts, self.ends, len(self.starts)
        while i < n and ends[i] <= t:
            i += 1
        while i < n and t + d > starts[i] + _EPS:
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t, i

    def with_added(self, added: list[tuple[float, float]]) -> _Device:
        """This device with the disjoint ``added`` intervals (sorted) occupied too."""
        if not added:
            return self
        # two sorted runs: sorting merges them in linear time; disjoint intervals keep their
        # ends in the order of their starts
        return _Device(sorted(self.starts + [lo for lo, _ in added]), sorted(self.ends + [hi for _, hi in added]))


@dataclass
class _State:
    pre: list[int]  # per pipeline: microbatches 0 .. pre[j] - 1 still forward in the pre-LLM region
    devices: dict[tuple[int, int], _Device]  # (pipeline, stage) -> its device's compute stream
    links: dict[tuple[int, int], _Device]  # (pipeline, stage) -> its device's link (kernel granularity)
    # moved work: (direction, pipeline, microbatch) -> ([(stage, layer, kernel, comm, start, end)], EF or EB)
    moved: dict[tuple[str, int, int], tuple[list[tuple[int, int, int, bool, float, float]], float]] = \
        field(default_factory=dict)
    order: list[tuple[str, int, int]] = field(default_factory=list)

    def copy(self) -> _State:
        return _State(list(self.pre), dict(self.devices), dict(self.links), dict(self.moved), list(self.order))


class _Fine:
    def __init__(self, timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes) -> None:
        self.c = _Coarse(timeline, candidate, times)
        self.tl, self.cand, self.times = timeline, candidate, times
        self.g = candidate.group_size
        self.units = {(d, s): times.units(d, s) for d in (FORWARD, BACKWARD) for s in range(times.num_stages)}
        # per LLM stage: its compute stream and its link, as every partition starts from them
        self.busy = [_Device([lo for lo, _ in st.busy], [hi for _, hi in st.busy]) for st in timeline.stages]
        self.link = [_Device([lo for lo, _ in st.link], [hi for _, hi in st.link]) for st in timeline.stages]

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
        unit by unit (layers or kernels) from ``ready`` (None: a unit does not fit)."""
        c, S, times = self.c, self.c.S, self.times
        a = j // self.g
        new = st.copy()
        blocks = []
        stages = range(S) if direction == FORWARD else range(S - 1, -1, -1)
        kernel = times.kernel_level
        first = None
        for s in stages:
            devices = (new.devices[(j, s)], new.links[(j, s)])
            added: tuple[list, list] = ([], [])
            t = max(ready, c.cstart[a][s])
            cursors = [devices[0].cursor(t), devices[1].cursor(t)]
            limit = c.cend[a][s] + _EPS
            for idx, (d, comm, layer) in enumerate(self.units[(direction, s)]):
                # each unit starts after the previous one ends, so none of this pass's earlier
                # units lies after t: fitting against the devices as they were is exact
                start, cursors[comm] = devices[comm].fit(cursors[comm], t, d)
                t = start + d
                if t > limit:
                    return None
                added[comm].append((start, t))
                blocks.append((s, layer, idx if kernel else -1, comm, start, t))
                if first is None:
                    first = start
            new.devices[(j, s)] = devices[0].with_added(added[0])
            new.links[(j, s)] = devices[1].with_added(added[1])
            ready = t + times.transfer
        point = (ready - times.transfer + c.to_llm[a]) if direction == FORWARD else first
        new.moved[(direction, j, k)] = (blocks, point)
        new.order.append((direction, j, k))
        return new

    # -- OptimizeSchedule -----------------------------------------------------------------------
    def optimize(self, parts: Sequence[int]) -> tuple[_State, float, list[tuple[float, int, int]], float]:
        c = self.c
        devices, links = {}, {}
        for j in range(len(parts)):
            for s in range(c.S):
                devices[(j, s)] = self.busy[self.cand.llm_stage(j, s)]
                links[(j, s)] = self.link[self.cand.llm_stage(j, s)]
        st = _State(list(parts), devices, links)
        found = self.least_shift(st)
        assert found is not None  # the coarse schedule always has a shift
        x, arrivals = found
        lat = coarse = self.latency(x, self.post(st, arrivals)[0])
        best = (st, x, arrivals, lat)  # the lowest latency seen (ties: the fewest moves)
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
            if nlat > lat + _EPS:
                break
            st, x, arrivals, lat = new, nx, narr, nlat
            if lat < best[3] - _EPS:
                best = (st, x, arrivals, lat)
        st, x, arrivals, lat = best
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
            if nlat > lat + _EPS:
                break
            st, lat = new, nlat
            if lat < best[3] - _EPS:
                best = (st, x, arrivals, lat)
        return best[0], x, arrivals, coarse

    def build(self, parts: Sequence[int], optimized: tuple | None = None) -> BubbleSchedule:
        """The schedule of ``parts`` (``optimized``: its `optimize` result, if known)."""
        c, cand, times = self.c, self.cand, self.times
        st, x, arrivals, coarse = self.optimize(parts) if optimized is None else optimized
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
        for (d, j, k), (units, point) in st.moved.items():
            i = feed_of[(j, k)]
            for s, layer, kernel, comm, start, end in units:
                blocks.append(EncoderBlock(d, j, k, i, s, cand.llm_stage(j, s), cand.ranks(j, s), start + x, end + x,
                                           layer, kernel, comm))
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


def latency_bound(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes) -> float:
    """A lower bound on the latency of every schedule of ``candidate``, coarse or fine: the
    LLM's end plus the shift the first LLM microbatch forces. Its encoder output cannot come
    from a moved forward (those start at or after their device's first LLM compute, which is
    not before ``F_0``), so it comes from a first forward chain run from time 0:
    ``shift >= chain + to_llm - F_0``."""
    return _bound(_Coarse(timeline, candidate, times))


def _bound(c: _Coarse) -> float:
    return c.timeline.end + max(0.0, c.fend[0][c.S - 1] + min(c.to_llm) - c.F[0])


def best_fine_schedule(timeline: LLMTimeline, candidate: EncoderCandidate, times: EncoderStageTimes,
                       top: int = 8, max_partitions: int | None = 4096,
                       beat: float = float("inf")) -> tuple[BubbleSchedule | None, int]:
    """Algorithm 2 (optimus.md §3.2) with the fine step applied to the ``top`` partitions of
    lowest coarse latency (`loom.planner.optimus.coarse.coarse_ranking`), not to every one
    (decided: the fine step costs a re-evaluation per move; the coarse latency bounds the fine
    one from above, so the best coarse partitions are the natural ones to refine). Returns the
    lowest fine latency (ties: the better coarse rank) and how many partitions were ranked.

    Refining stops once a schedule reaches `latency_bound` (no partition can do better), and
    does not start when the bound is not below ``beat`` (another candidate's latency, which
    this one cannot then beat): the best coarse schedule is returned then."""
    if top < 1:
        raise OptimusPlanError(f"top = {top}: refine at least one partition")
    ranked, count = coarse_ranking(timeline, candidate, times, top, max_partitions=max_partitions)
    engine = _Fine(timeline, candidate, times)
    bound = _bound(engine.c)
    if ranked and bound >= beat - _EPS:
        return engine.c.build(ranked[0][1]), count
    best: tuple[float, tuple[int, ...], tuple] | None = None
    for _, parts in ranked:
        if best is not None and best[0] <= bound + _EPS:
            break
        optimized = engine.optimize(parts)
        st, x, arrivals, _ = optimized
        lat = engine.latency(x, engine.post(st, arrivals)[0])
        if best is None or lat < best[0] - _EPS:
            best = (lat, parts, optimized)
    # only the winner's blocks are built
    return (None if best is None else engine.build(best[1], best[2])), count

