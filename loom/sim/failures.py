"""Failure traces and the throughput they leave (oobleck.md §4.2, §6.2): a trace of node losses,
a generator of them at a given failure frequency, and the accounting of two ways through it,
Oobleck's reconfiguration without restart and restart from a checkpoint (Varuna, Megatron-LM,
torchtitan). The step times of each phase come from the caller (`loom.planner.oobleck_failures`
prices them with the simulator over Oobleck's templates); this module only counts seconds and
samples, so its figures can be checked by hand.

**Trace format.** JSON::

    {"num_nodes": 30, "duration_s": 86400,
     "events": [{"time_s": 3600.0, "nodes": [7]}, {"time_s": 5400.0, "nodes": [2, 11]}]}

or CSV with a header ``time_s,node`` and one lost node per row (rows of one time are one event);
a CSV has no header fields for the cluster, so ``num_nodes`` and ``duration_s`` come from the
caller (``loom simulate --failures``: the scenario's nodes; the last event's time plus the mean
gap). Node ids are ``0 .. num_nodes - 1``; a node fails once; times increase from 0.

**Accounting** (one global batch of ``B`` samples per step; the phases between events):

- Oobleck: each phase after a failure starts with its recovery (detection, re-forming the
  pipelines, copying missing layers), then runs whole steps; the step in flight at a failure
  is lost ("lose at most one iteration", §4.5).
- Restart: each phase after a failure starts with a restart (initialisation and loading the
  last checkpoint), then runs steps with a synchronous checkpoint every ``checkpoint_every``
  steps; a failure loses the steps since the last finished checkpoint (§4.5's fallback).
- The trace's last phase ends at ``duration_s`` with no failure: its finished steps all count.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A failure trace that is malformed; the message names the file, the event and the fix."""


@dataclass(frozen=True)
class FailureEvent:
    time_s: float
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class FailureTrace:
    num_nodes: int
    duration_s: float
    events: tuple[FailureEvent, ...]

    def __post_init__(self) -> None:
        check_trace(self)

    def phases(self) -> list[tuple[float, float, tuple[int, ...]]]:
        """``(start, end, nodes alive)`` between events, the first from 0."""
        alive = list(range(self.num_nodes))
        out, start = [], 0.0
        for e in self.events:
            out.append((start, e.time_s, tuple(alive)))
            alive = [n for n in alive if n not in e.nodes]
            start = e.time_s
        out.append((start, self.duration_s, tuple(alive)))
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps({"num_nodes": self.num_nodes, "duration_s": self.duration_s,
                           "events": [{"time_s": e.time_s, "nodes": list(e.nodes)} for e in self.events]}, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text


def check_trace(trace: FailureTrace, where: str = "failure trace") -> None:
    if not isinstance(trace.num_nodes, int) or trace.num_nodes < 1:
        raise TraceError(f"{where}: num_nodes = {trace.num_nodes!r} must be a positive integer")
    seen: set[int] = set()
    last = 0.0
    for i, e in enumerate(trace.events):
        if not math.isfinite(e.time_s) or e.time_s < last:
            raise TraceError(f"{where}: events[{i}].time_s = {e.time_s}: times must be finite, from 0, increasing")
        if not e.nodes:
            raise TraceError(f"{where}: events[{i}] at {e.time_s} s loses no node; list at least one")
        for n in e.nodes:
            if not isinstance(n, int) or not 0 <= n < trace.num_nodes:
                raise TraceError(f"{where}: events[{i}] names node {n!r}; nodes are 0 .. {trace.num_nodes - 1}")
            if n in seen:
                raise TraceError(f"{where}: events[{i}] loses node {n} again; a node fails once")
            seen.add(n)
        last = e.time_s
    if not trace.duration_s >= last:
        raise TraceError(f"{where}: duration_s = {trace.duration_s} ends before the last event at {last} s")


def read_trace(path: str | Path, num_nodes: int | None = None, duration_s: float | None = None) -> FailureTrace:
    """A trace file (module docstring): JSON, or CSV with ``num_nodes`` and (optionally)
    ``duration_s`` from the caller. ``num_nodes`` given with a JSON trace must match it."""
    p = Path(path)
    where = f"--failures {str(p)!r}"
    if not p.is_file():
        raise TraceError(f"{where}: no such file; give a JSON or CSV failure trace (docs/elastic.md)")
    try:
        if p.suffix == ".csv":
            events: dict[float, list[int]] = {}
            with open(p, newline="") as f:
                rows = list(csv.DictReader(f))
            for i, row in enumerate(rows):
                if set(row) != {"time_s", "node"}:
                    raise TraceError(f"{where}: the header must be 'time_s,node'; got {sorted(row)}")
                events.setdefault(float(row["time_s"]), []).append(int(row["node"]))
            if num_nodes is None:
                raise TraceError(f"{where}: a CSV trace needs the cluster's node count from the caller")
            times = sorted(events)
            end = duration_s if duration_s is not None else (times[-1] if times else 0.0)
            return FailureTrace(num_nodes, float(end),
                                tuple(FailureEvent(t, tuple(events[t])) for t in times))
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or set(data) - {"num_nodes", "duration_s", "events"} or "events" not in data:
            raise TraceError(f"{where}: a JSON trace is an object with num_nodes, duration_s and events")
        n = int(data.get("num_nodes", num_nodes or 0))
        if num_nodes is not None and n != num_nodes:
            raise TraceError(f"{where}: num_nodes = {n} but the cluster has {num_nodes} nodes; make them agree")
        events_ = tuple(FailureEvent(float(e["time_s"]), tuple(int(x) for x in e["nodes"])) for e in data["events"])
        end = data.get("duration_s", duration_s if duration_s is not None else (events_[-1].time_s if events_ else 0))
        return FailureTrace(n, float(end), events_)
    except TraceError as e:
        raise TraceError(str(e).replace("failure trace:", f"{where}:", 1)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: not a valid trace ({e}); see docs/elastic.md for the format") from e


def generate_trace(num_nodes: int, mean_interval_s: float, *, stop_below: int | None = None, seed: int = 0,
                   exponential: bool = True) -> FailureTrace:
    """One node lost at a time, chosen uniformly among the live ones, every ``mean_interval_s``
    on average (exponential gaps: failures as a Poisson process; ``exponential=False``: exactly
    that gap), monotonically, until fewer than ``stop_below`` nodes would remain (default half,
    oobleck.md §4.2: "until less than half of the nodes remain"); the trace ends at the time the
    next failure would come, so its last phase runs at ``stop_below`` nodes."""
    if mean_interval_s <= 0:
        raise TraceError(f"mean failure interval = {mean_interval_s} s: must be positive")
    floor_ = num_nodes // 2 if stop_below is None else stop_below
    if not 1 <= floor_ <= num_nodes:
        raise TraceError(f"stop_below = {floor_}: must be between 1 and num_nodes = {num_nodes}")
    rng = random.Random(seed)
    alive, t, events = list(range(num_nodes)), 0.0, []
    gap = (lambda: rng.expovariate(1 / mean_interval_s)) if exponential else (lambda: mean_interval_s)
    while True:
        t += gap()
        if len(alive) - 1 < floor_:
            return FailureTrace(num_nodes, t, tuple(events))
        node = alive.pop(rng.randrange(len(alive)))
        events.append(FailureEvent(t, (node,)))


# ---- accounting ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseRun:
    """One phase: ``step_s`` per step (``inf``: no training), ``recovery_s`` before the first."""

    start_s: float
    end_s: float
    nodes: int
    step_s: float
    recovery_s: float


@dataclass(frozen=True)
class TraceRun:
    """Steps finished and kept over a trace, and throughput against the failure-free rate."""

    system: str
    phases: tuple[PhaseRun, ...]
    steps: int
    lost_steps: int
    global_batch: int
    duration_s: float

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.global_batch / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def failure_free_samples_per_s(self) -> float:
        return self.global_batch / self.phases[0].step_s

    @property
    def fraction_of_failure_free(self) -> float:
        return self.samples_per_s / self.failure_free_samples_per_s


def _whole(x: float) -> int:
    return int(math.floor(x + 1e-9))  # a step that ends exactly at the failure finished


def play_oobleck(phases: Sequence[PhaseRun], global_batch: int) -> TraceRun:
    """Oobleck through the phases (module docstring): whole steps after each recovery; the step in
    flight at a failure is lost."""
    steps = lost = 0
    for k, ph in enumerate(phases):
        available = ph.end_s - ph.start_s - (ph.recovery_s if k else 0.0)
        if available <= 0 or not math.isfinite(ph.step_s):
            continue
        steps += _whole(available / ph.step_s)
        lost += 1 if k < len(phases) - 1 and available / ph.step_s % 1 > 1e-9 else 0
    return TraceRun("oobleck", tuple(phases), steps, lost, global_batch, phases[-1].end_s)


def play_restart(phases: Sequence[PhaseRun], global_batch: int, checkpoint_every: int,
                 checkpoint_s: float) -> TraceRun:
    """Restart from a checkpoint through the phases (module docstring): each phase after a
    failure starts with its ``recovery_s`` (the restart), checkpoints every ``checkpoint_every``
    steps take ``checkpoint_s``, and a failure loses the steps since the last checkpoint."""
    if checkpoint_every < 1 or checkpoint_s < 0:
        raise ValueError(f"checkpoint every {checkpoint_every} steps taking {checkpoint_s} s: need >= 1 and >= 0")
    steps = lost = 0
    for k, ph in enumerate(phases):
        available = ph.end_s - ph.start_s - (ph.recovery_s if k else 0.0)
        if available <= 0 or not math.isfinite(ph.step_s):
            continue
        cycle = checkpoint_every * ph.step_s + checkpoint_s
        cycles = _whole(available / cycle)
        tail = min(checkpoint_every, _whole((available - cycles * cycle) / ph.step_s))
        if k == len(phases) - 1:  # the trace ends without a failure: every finished step counts
            steps += cycles * checkpoint_every + tail
        else:
            steps += cycles * checkpoint_every
            lost += tail
    return TraceRun("restart", tuple(phases), steps, lost, global_batch, phases[-1].end_s)
