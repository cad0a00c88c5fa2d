"""Ranks that share a host's CPU cores: each kept on one core, their compute under processor
sharing of that core.

On a GPU cluster every rank computes on a device of its own, so an action's time does not depend
on what the other ranks do at that moment. Ranks that run as processes on one CPU host (loom's CPU
runs: the demo, the tests' and benchmarks' gloo processes) share its cores: with ``k`` ranks
computing at once on ``c`` cores, the scheduler gives each ``min(1, c / k)`` of a core, so an
action stretches by the sharing it meets. Which actions overlap depends on the pipeline: in 1F1B
the encoders' forwards run beside the LLM's warmup, while the LLM's steady phase often has the
host to itself. A profile taken with a fixed number of co-running processes charges every action
the same contention and so misprices both; under `CoreSharing` the profile is taken solo
(``loom profile --co-runners 0``) and the simulator prices the contention each action meets.

The play (`loom.sim.play`) evaluates the dataflow with fixed durations; sharing makes a duration
depend on what overlaps it. `simulate` finds the fixed point: play with the current stretch
factors, compute for every compute action the service it received, ``∫ min(1, c / k(t)) dt``
over its span (``k(t)``: the ranks of its host computing at time ``t``), and rescale its stretch
by solo time over service; repeat until every action receives its solo time (`converged`). A
rank waiting in a receive or a collective is taken to hold no core (gloo's waits block).

Which cores a rank runs on matters as much as how many there are. Linux keeps a run queue per
core and moves a task to another core only when the queues stay unbalanced, so a rank that
computes in bursts between receives stays on one core through a step: measured on the demo (4
ranks on 2 cores), each rank did 85-100 % of a step's compute CPU on one core, and the pairs
changed only between steps. A rank then shares its own core with the ranks placed on it, while
the other core may idle: processor sharing over the whole host (``placement="host"``) hands
the rank the idle core and under-prices the step (by 14 % against the measured steps' own CPU
times, 10 % with the ranks placed as the kernel placed them). Under ``placement="core"`` (the
default) `place_units` puts each host's ranks on its cores as the kernel's balancing does: the
same number of ranks per core (at most one more), the heaviest rank first onto the core with
the least compute so far (the pairing the kernel chose in 6 of 10 measured steps, the next-best
in 3), and each core is shared by processor sharing among its own ranks.

Sharing also costs CPU: co-running processes evict each other's caches at every context switch
and share the last-level cache and memory bandwidth, so a second of solo work takes more than a
second of CPU beside other busy ranks. ``slowdown[k - 1]`` is that factor with ``k`` ranks of the
host computing at once, measured by the profiler (`loom.profile.contention`, built into a table
by `contention_slowdown`); an action then needs ``solo x slowdown`` of core-time, and the fixed
point serves it at ``min(1, c / k) / slowdown(k)`` of its solo work per second.

Processor sharing hands a rank that wakes its share of a core at once. A real scheduler does
not: a rank blocked in a receive whose message arrives while every core of its host computes
waits for a computing process to be preempted (and gloo's thread that reads the message waits
too), about a scheduler slice. ``wake_s`` is that delay, measured by the profiler
(`loom.cost.profile_comm.Communication.wake_delay`); the fixed point adds it to every receive
that blocked and whose message arrived while ``c`` or more ranks of the host were computing
(`wake_delays`).

A rank that shares its core also finds the caches emptied by the others at each of its
actions: the same forward took 1.05 to 1.60 x its warm CPU inside the demo's pipeline, and most
of that extra (0.2 to 0.5 ms a forward) is the call re-run right after a cache eviction. The
profiler times each layer's cold start that way (`loom.profile.profiler.Profiler._cold_pass`);
with ``cold_start`` on, every compute action of a unit that shares its core (`shared_cores`)
needs its cost model's `cold_start_time` more of solo work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.cost.profile_file import Profile


class SharingError(ValueError):
    """A core-sharing description that cannot be used."""


PLACEMENTS = ("core", "host")


@dataclass(frozen=True)
class CoreSharing:
    """``cores`` CPU cores per host, shared by the ranks placed on it, ``ranks_per_host`` at a
    time in rank order (as torchrun places local ranks)."""

    cores: int
    ranks_per_host: int
    # CPU seconds per second of solo work with k ranks of the host computing at once, at index
    # k - 1 (past the end: the last entry; empty: 1, no cost beyond the time slicing)
    slowdown: tuple[float, ...] = ()
    # seconds a blocked receive loses when its message arrives with every core of the host
    # computing (the scheduler's wake-up latency; 0: none)
    wake_s: float = 0.0
    # "core": each rank keeps to one core, placed by `place_units`; "host": every core of the
    # host shared by all its ranks (see the module docstring)
    placement: str = "core"
    # whether a unit sharing its core pays its cost model's cold start at every compute action
    cold_start: bool = True

    def __post_init__(self) -> None:
        for name in ("cores", "ranks_per_host"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SharingError(f"{name} = {v!r}: give a positive integer (cores per host, ranks per host)")
        bad = [f for f in self.slowdown if not (isinstance(f, (int, float)) and np.isfinite(f) and f > 0)]
        if bad:
            raise SharingError(f"slowdown = {self.slowdown!r}: give positive finite CPU-time factors (1.0: none), "
                               f"not {bad}")
        if not (isinstance(self.wake_s, (int, float)) and np.isfinite(self.wake_s) and self.wake_s >= 0):
            raise SharingError(f"wake_s = {self.wake_s!r}: give the wake-up delay in seconds, 0 or more")
        if not isinstance(self.cold_start, bool):
            raise SharingError(f"cold_start = {self.cold_start!r}: give True (ranks sharing a core pay their "
                               f"actions' cold start) or False")
        if self.placement not in PLACEMENTS:
            raise SharingError(f"placement = {self.placement!r}: use one of {PLACEMENTS} (each rank on one core, "
                               f"or the host's cores shared by all)")

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def slowdown_at(self, busy: float) -> float:
        """The CPU slowdown with ``busy`` ranks of a host computing at once (rounded up)."""
        if not self.slowdown:
            return 1.0
        k = max(int(np.ceil(busy - 1e-9)), 1)
        return float(self.slowdown[min(k, len(self.slowdown)) - 1])

    def concurrent_stretch(self, ranks_on_host: int) -> float:
        """The stretch of an equal action that every rank of a host runs at once (the
        dispatch's decision, the same on every rank): the time slicing and the CPU slowdown."""
        busy = min(ranks_on_host, self.ranks_per_host)
        return max(1.0, busy / self.cores) * self.slowdown_at(busy)

    def concurrent_finish(self, work: "list[float] | tuple[float, ...]") -> float:
        """When the last of jobs that every rank starts at once ends (``work[r]``: rank ``r``'s
        solo seconds, the dispatcher's host work), each host's ranks sharing its cores: under
        processor sharing the jobs run at ``min(1, cores / active)`` until each is done, so
        the shortest finish first and free their share for the rest."""
        end = 0.0
        for host in range(-(-len(work) // self.ranks_per_host)):
            left = sorted(work[host * self.ranks_per_host:(host + 1) * self.ranks_per_host])
            t, done = 0.0, 0.0  # every active job has received `done` seconds of service by time `t`
            for i, w in enumerate(left):
                rate = min(1.0, self.cores / (len(left) - i))
                t += (w - done) / rate
                done = w
            end = max(end, t)
        return end


def profile_sharing(profile: Profile, cores: int, ranks_per_host: int, contention: bool = True) -> CoreSharing:
    """``ranks_per_host`` ranks sharing ``cores`` cores, priced from a `loom.cost.profile_file.Profile`:
    the CPU slowdown of its contention measurement (`contention_slowdown`; not with
    ``contention=False``) and the wake-up delay of its communication fits, where it has them."""
    c = profile.contention
    slowdown = (contention_slowdown(float(c["cpu_ratio"]), int(c["busy"]), ranks_per_host)
                if c and contention and ranks_per_host > 1 else ())
    wake = profile.comm.wake_delay() if profile.comm is not None else 0.0
    return CoreSharing(cores=cores, ranks_per_host=ranks_per_host, slowdown=slowdown, wake_s=wake)


def contention_slowdown(cpu_ratio: float, busy: int, ranks_per_host: int) -> tuple[float, ...]:
    """The `CoreSharing.slowdown` table for ``ranks_per_host`` ranks from one measurement: CPU
    time ``cpu_ratio`` times the solo time with ``busy`` processes computing at once
    (`loom.profile.contention`). One busy rank has no slowdown; between 1 and ``busy`` the
    factor grows linearly in the number of busy ranks (each co-runner adds the same share of
    cache and memory traffic), beyond ``busy`` it stays at the measured factor (only measured
    points, no extrapolation)."""
    if not isinstance(busy, int) or isinstance(busy, bool) or busy < 2:
        raise SharingError(f"busy = {busy!r}: a contention measurement has 2 or more processes computing at once")
    if not (isinstance(cpu_ratio, (int, float)) and np.isfinite(cpu_ratio) and cpu_ratio > 0):
        raise SharingError(f"cpu_ratio = {cpu_ratio!r}: give the measured positive CPU-time ratio (shared over solo)")
    return tuple(1.0 + (cpu_ratio - 1.0) * (min(k, busy) - 1) / (busy - 1) for k in range(1, ranks_per_host + 1))


# the fixed point is met when every compute action received its solo time within this fraction
TOLERANCE = 0.005
MAX_ROUNDS = 60


def units_by_host(sharing: CoreSharing, first_rank: list[int]) -> list[list[int]]:
    """The units of each host in order of first appearance, a unit by its first rank."""
    hosts: dict[int, list[int]] = {}
    for u, r in enumerate(first_rank):
        hosts.setdefault(sharing.host_of(r), []).append(u)
    return list(hosts.values())


def place_units(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int],
                load: list[float]) -> list[int] | None:
    """Per unit, the core of its host it computes on under ``placement="core"`` (None under
    ``"host"``): on each host, units by decreasing ``load`` (their compute seconds), each onto
    the core with the least load so far among those holding fewer than ``ceil(ranks / cores)``
    ranks (ties: the lower core). A host with a unit of several ranks (TP, CP: they compute on
    several cores at once) keeps processor sharing over its cores: its units get -1."""
    if sharing.placement == "host":
        return None
    out = [-1] * len(first_rank)
    for units in units_by_host(sharing, first_rank):
        if any(unit_ranks[u] > 1 for u in units):
            continue
        cap = -(-len(units) // sharing.cores)
        count, taken = [0] * sharing.cores, [0.0] * sharing.cores
        for u in sorted(units, key=lambda u: (-load[u], u)):
            core = min((c for c in range(sharing.cores) if count[c] < cap), key=lambda c: (taken[c], c))
            out[u] = core
            count[core] += 1
            taken[core] += load[u]
    return out


def shared_cores(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int],
                 core_of: list[int] | None) -> list[bool]:
    """Per unit, whether other ranks compute on its core between its actions: another unit
    placed on the same core (``core_of``, `place_units`), or, with processor sharing over the
    host (``core_of`` None or -1), more ranks on the host than cores. All False without
    ``sharing.cold_start``."""
    out = [False] * len(first_rank)
    if not sharing.cold_start:
        return out
    for units in units_by_host(sharing, first_rank):
        crowded = sum(unit_ranks[u] for u in units) > sharing.cores
        for u in units:
            if core_of is None or core_of[u] < 0:
                out[u] = crowded
            else:
                out[u] = sum(core_of[v] == core_of[u] for v in units) > 1
    return out


def service(spans: np.ndarray, weights: np.ndarray, cores: int, sharing: CoreSharing | None = None,
            background: tuple[np.ndarray, np.ndarray] | None = None,
            lanes: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Per span ``[start, end)`` of one host's compute actions (``weights``: ranks computing in
    it), the core-time it received under processor sharing: ``∫ min(1, cores / k(t)) dt``; given
    ``sharing`` with a slowdown, the solo work that core-time does: ``∫ min(1, cores / k(t)) /
    slowdown(k(t)) dt``. ``background`` (spans, loads in cores) is other work on the host's
    cores, the communicator threads' (`HostSpans`): it adds to ``k(t)`` for the time slicing.
    ``lanes`` (the core of each span, of each background span; `place_units`): each core is
    shared only by its own spans and background, ``min(1, 1 / k_core(t))``; the slowdown still
    counts the host's busy ranks (caches and memory are the host's)."""
    if len(spans) == 0:
        return np.zeros(0)
    has_background = background is not None and len(background[0]) > 0
    times = np.unique(np.concatenate([spans.ravel(), background[0].ravel()]) if has_background else spans.ravel())
    first, last = np.searchsorted(times, spans[:, 0]), np.searchsorted(times, spans[:, 1])

    def level(at: np.ndarray, w: np.ndarray) -> np.ndarray:  # the sum of w over the spans covering each segment
        delta = np.zeros(len(times))
        np.add.at(delta, np.searchsorted(times, at[:, 0]), w)
        np.add.at(delta, np.searchsorted(times, at[:, 1]), -w)
        return np.cumsum(delta)[:-1]

    def received(rate: np.ndarray, on: np.ndarray | slice = slice(None)) -> np.ndarray:
        got = np.concatenate(([0.0], np.cumsum(rate * np.diff(times))))
        return got[last[on]] - got[first[on]]

    busy = level(spans, weights)  # ranks computing in each segment between consecutive times
    slow = np.array([sharing.slowdown_at(k) for k in busy]) if sharing is not None and sharing.slowdown else 1.0
    if lanes is None:
        load = busy + level(*background) if has_background else busy
        return received(np.minimum(1.0, cores / np.maximum(load, 1e-12)) / slow)
    out = np.zeros(len(spans))
    for core in np.unique(lanes[0]):
        on = lanes[0] == core
        load = level(spans[on], weights[on])
        b = lanes[1] == core
        if has_background and b.any():
            load = load + level(background[0][b], background[1][b])
        out[on] = received(np.minimum(1.0, 1.0 / np.maximum(load, 1e-12)) / slow, on)
    return out


@dataclass
class HostSpans:
    """One host's units, their compute spans stacked ``[n, 2]`` in unit order with each span's
    weight (the ranks of its unit), the background load of the communicator threads: spans
    ``[m, 2]`` with their load in cores, and under ``placement="core"`` the core of each span
    and of each background span (None: the host's cores shared by all)."""

    units: list[int]
    spans: np.ndarray
    weights: np.ndarray
    background: tuple[np.ndarray, np.ndarray]
    lanes: tuple[np.ndarray, np.ndarray] | None = None


def host_spans(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int],
               spans: list[list[tuple[float, float]]],
               background: list[list[tuple[float, float, float]]] | None = None,
               core_of: list[int] | None = None) -> list[HostSpans]:
    """Per host, its `HostSpans`; ``background[u]``: unit ``u``'s communicator-thread work as
    ``(start, end, cpu seconds)`` (`loom.sim.play.Play.background`); ``core_of``: each unit's
    core (`place_units`; -1 or None: processor sharing over the host)."""
    out = []
    for units in units_by_host(sharing, first_rank):
        bg = [(b, u) for u in units for b in (background[u] if background is not None else ())]
        lanes = None
        if core_of is not None and all(core_of[u] >= 0 for u in units):
            lanes = (np.array([core_of[u] for u in units for _ in spans[u]], dtype=np.int64),
                     np.array([core_of[u] for _, u in bg], dtype=np.int64))
        out.append(HostSpans(
            units, np.array([sp for u in units for sp in spans[u]], dtype=np.float64).reshape(-1, 2),
            np.array([unit_ranks[u] for u in units for _ in spans[u]], dtype=np.float64),
            (np.array([(a, b) for (a, b, _), _ in bg], dtype=np.float64).reshape(-1, 2),
             np.array([c / (b - a) for (a, b, c), _ in bg], dtype=np.float64)), lanes))
    return out


def restretch(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int], solo: list[list[float]],
              spans: list[list[tuple[float, float]]], stretch: list[list[float]],
              background: list[list[tuple[float, float, float]]] | None = None,
              core_of: list[int] | None = None) -> tuple[list[list[float]], float]:
    """New stretch factors from one play: per unit, per compute action in order, the factor by
    which its span must change so that it receives its ``solo`` time (sharing the cores with
    the ``background`` work too, each unit on its core of ``core_of``); returns them with the
    largest relative shortfall or excess of service seen (0 at the fixed point)."""
    new = [list(s) for s in stretch]
    worst = 0.0
    for host in host_spans(sharing, first_rank, unit_ranks, spans, background, core_of):
        got = service(host.spans, host.weights, sharing.cores, sharing, host.background, host.lanes)
        need = np.array([d for u in host.units for d in solo[u]], dtype=np.float64)
        ok = need > 0
        ratio = np.ones_like(need)
        ratio[ok] = need[ok] / np.maximum(got[ok], 1e-15)
        if ok.any():
            worst = max(worst, float(np.abs(ratio[ok] - 1.0).max()))
        k = 0
        for u in host.units:
            n = len(spans[u])
            old = np.array(stretch[u][:n] + [1.0] * (n - len(stretch[u][:n])))
            # a damped step (the square root of the correction): overlaps shift as spans change
            new[u] = np.maximum(1.0, old * np.sqrt(ratio[k:k + n])).tolist()
            k += n
    return new, worst


def wake_delays(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int],
                spans: list[list[tuple[float, float]]], blocked: list[list[float | None]],
                core_of: list[int] | None = None) -> list[list[float]]:
    """Per unit, per receive in order, the wake-up delay it meets: ``sharing.wake_s`` where the
    receive blocked and its message arrived (``blocked[u][k]``, None where it did not block)
    while ranks of the unit's host filled every core (compute spans ``spans``, ``unit_ranks``
    ranks a unit), else 0; with ``core_of``, while ranks on the unit's own core computed."""
    out = [[0.0] * len(b) for b in blocked]
    if sharing.wake_s <= 0:
        return out
    for host in host_spans(sharing, first_rank, unit_ranks, spans, core_of=core_of):
        flat, weights = host.spans, host.weights
        owner = np.array([u for u in host.units for _ in spans[u]])
        for u in host.units:
            others = owner != u
            capacity = sharing.cores
            if host.lanes is not None:  # only the ranks on this unit's core
                others &= host.lanes[0] == core_of[u]
                capacity = 1
            for k, at in enumerate(blocked[u]):
                if at is None:
                    continue
                # the other units' ranks computing then (the receiver's own next action starts at it)
                busy = weights[(flat[:, 0] <= at) & (at < flat[:, 1]) & others].sum()
                if busy >= capacity:
                    out[u][k] = sharing.wake_s
    return out


def cpu_seconds(sharing: CoreSharing, first_rank: list[int], unit_ranks: list[int],
                spans: list[list[tuple[float, float]]],
                background: list[list[tuple[float, float, float]]] | None = None,
                core_of: list[int] | None = None) -> list[float]:
    """Per unit, the core-time (CPU seconds) its compute actions received over their spans
    ``spans[u]`` (at the fixed point, each action's solo time times the slowdown it met), with
    its communicator threads' CPU ``background[u]``: what its process's CPU clock counts."""
    out = [0.0] * len(spans)
    for host in host_spans(sharing, first_rank, unit_ranks, spans, background, core_of):
        got = service(host.spans, host.weights, sharing.cores, None, host.background, host.lanes)
        k = 0
        for u in host.units:
            n = len(spans[u])
            out[u] = float(got[k:k + n].sum()) + sum(c for *_, c in (background[u] if background else ()))
            k += n
    return out
