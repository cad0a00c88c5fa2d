"""Core sharing in the simulator (`loom.sim.sharing`): ranks on one CPU host whose compute
stretches by the contention it meets, solved as a fixed point of processor sharing."""

from __future__ import annotations

import numpy as np
import pytest

from loom.cost.model import Workload
from loom.cost.uniform import UniformCostModel
from loom.plan.plan import ModuleSpec, Plan
from loom.schedule import build_schedule
from loom.sim import simulate
from loom.sim.sharing import (TOLERANCE, CoreSharing, SharingError, contention_slowdown, cpu_seconds, place_units,
                              service, shared_cores)

from plans import multimodal


class TokenCost(UniformCostModel):
    """Forward costs the module's token count, backward twice that."""

    def stage_time(self, module, stage, kind, work):
        return float(work.tokens) * (1.0 if kind == "forward" else 2.0)


def test_service_integrates_processor_sharing():
    """Two cores; three spans over [0, 2) and one over [1, 3): 3 busy on [0, 1) (2/3 each),
    4 on [1, 2) (1/2 each), 1 on [2, 3)."""
    spans = np.array([[0, 2], [0, 2], [0, 2], [1, 3]], dtype=float)
    got = service(spans, np.ones(4), cores=2)
    assert got == pytest.approx([2 / 3 + 1 / 2] * 3 + [1 / 2 + 1])
    # a span weighted by 2 ranks (tensor parallel) counts twice in the contention
    assert service(np.array([[0.0, 1.0], [0.0, 1.0]]), np.array([2.0, 1.0]), cores=1) == pytest.approx([1 / 3, 1 / 3])


def test_two_replicas_on_one_core_match_the_processor_sharing_schedule():
    """One stage, two replicas on one core; replica 0's microbatch costs F=1, B=2, replica 1's
    F=3, B=6. Sharing the core: replica 0's forward ends at 2 and its backward at 6; replica 1
    has then received 3 (its forward), runs its backward alone and ends at 12; both leave the
    sync at 12 + g."""
    g = 0.5
    plan = Plan([ModuleSpec("llm", data_parallel=2)], num_microbatches=2).resolve({"llm": 4})
    cost = TokenCost(plan, grad_sync=g)
    work = [{"llm": Workload(1)}, {"llm": Workload(3)}]
    alone = simulate(build_schedule(plan), plan, cost, work)
    assert alone.iteration_time == pytest.approx(9 + g)
    shared = simulate(build_schedule(plan), plan, cost, work, sharing=CoreSharing(cores=1, ranks_per_host=2))
    assert shared.iteration_time == pytest.approx(12 + g, rel=2 * TOLERANCE)
    spans = {(e.rank, e.kind): (e.start_s, e.end_s) for e in shared.timeline if e.kind in ("forward", "backward")}
    assert spans[(0, "forward")] == pytest.approx((0, 2), abs=0.05)
    assert spans[(0, "backward")] == pytest.approx((2, 6), abs=0.05)
    assert spans[(1, "forward")] == pytest.approx((0, 6), abs=0.05)
    # on two hosts (or two cores) nothing is shared: exactly the plain play
    for sharing in (CoreSharing(cores=1, ranks_per_host=1), CoreSharing(cores=2, ranks_per_host=2)):
        same = simulate(build_schedule(plan), plan, cost, work, sharing=sharing)
        assert same.iteration_time == alone.iteration_time
        assert [(e.start_s, e.end_s) for e in same.timeline] == [(e.start_s, e.end_s) for e in alone.timeline]


def test_place_units_levels_counts_and_puts_the_heaviest_first():
    """Per host: equal rank counts per core (at most one more), heaviest unit first onto the
    core with the least compute so far. The demo's loads (vision 30, audio 25, LLM stages 125
    and 55) pair the first LLM stage with audio and the second with vision, as the kernel did
    in most measured steps."""
    sharing = CoreSharing(cores=2, ranks_per_host=4)
    assert place_units(sharing, [0, 1, 2, 3], [1, 1, 1, 1], [30.0, 25.0, 125.0, 55.0]) == [1, 0, 0, 1]
    assert place_units(CoreSharing(cores=2, ranks_per_host=3), [0, 1, 2], [1, 1, 1], [3.0, 2.0, 1.0]) == [0, 1, 1]
    # two hosts of 2 ranks on 1 core each: one core a host
    assert place_units(CoreSharing(cores=1, ranks_per_host=2), [0, 1, 2, 3], [1] * 4, [1.0] * 4) == [0, 0, 0, 0]
    # a unit of 2 ranks (TP) computes on 2 cores at once: its host keeps processor sharing
    assert place_units(sharing, [0, 2, 3], [2, 1, 1], [5.0, 1.0, 1.0]) == [-1, -1, -1]
    assert place_units(CoreSharing(cores=2, ranks_per_host=4, placement="host"), [0, 1], [1, 1], [1.0, 1.0]) is None
    with pytest.raises(SharingError, match="placement"):
        CoreSharing(cores=2, ranks_per_host=4, placement="numa")


def test_ranks_kept_on_their_cores_against_sharing_the_host():
    """Three replicas of one stage on 2 cores, solo compute 9, 6 and 3 s (F = tokens, B = twice
    that; no messages, so each computes from 0 without a pause). Kept on cores, replica 0 has a
    core to itself and ends at 9; replicas 1 and 2 share the other, 2 ends at 6 with half a
    core, then 1 runs alone and also ends at 9. Sharing the host, all three run at 2/3 of a
    core until replica 2 ends at 4.5, then 1 ends at 7.5 and 0 at 10.5."""
    g = 0.5
    plan = Plan([ModuleSpec("llm", data_parallel=3)], num_microbatches=3).resolve({"llm": 4})
    cost = TokenCost(plan, grad_sync=g)
    work = [{"llm": Workload(3)}, {"llm": Workload(2)}, {"llm": Workload(1)}]

    def iteration(placement: str, cores: int = 2) -> float:
        sharing = CoreSharing(cores=cores, ranks_per_host=3, placement=placement)
        return simulate(build_schedule(plan), plan, cost, work, sharing=sharing).iteration_time

    assert iteration("core") == pytest.approx(9 + g, rel=2 * TOLERANCE)
    assert iteration("host") == pytest.approx(10.5 + g, rel=2 * TOLERANCE)
    assert iteration("core", cores=3) == pytest.approx(simulate(build_schedule(plan), plan, cost, work).iteration_time)


class ColdTokenCost(TokenCost):
    """`TokenCost` with a cold start of 0.5 s for every compute action."""

    def cold_start_time(self, module, stage, kind):
        return 0.5


def test_shared_cores_are_those_with_another_rank():
    """A unit pays the cold start where another rank computes on its core: kept on cores, a
    core of two; sharing the host, a host with more ranks than cores; never with the cold start
    off."""
    sharing = CoreSharing(cores=2, ranks_per_host=3)
    assert shared_cores(sharing, [0, 1, 2], [1] * 3, [0, 1, 1]) == [False, True, True]
    assert shared_cores(sharing, [0, 1, 2], [1] * 3, None) == [True] * 3
    assert shared_cores(sharing, [0, 1], [1, 1], None) == [False, False]  # 2 ranks, 2 cores
    assert shared_cores(sharing, [0, 2], [2, 1], [-1, -1]) == [True, True]  # a TP unit of 2 and one more rank
    assert shared_cores(CoreSharing(cores=2, ranks_per_host=3, cold_start=False), [0, 1, 2], [1] * 3,
                        [0, 1, 1]) == [False] * 3


def test_cold_start_is_paid_by_the_units_sharing_a_core():
    """The replicas of `test_ranks_kept_on_their_cores_against_sharing_the_host` (9, 6 and 3 s)
    with a cold start of 0.5 s per compute action (a forward and a backward each). Kept on
    cores, replica 0 has a core to itself and pays none (9); replicas 1 and 2 need 7 and 4 on
    the shared core: 2 ends at 8, then 1 runs its last 3 alone and ends at 11. Sharing the host,
    all three pay it (10, 7, 4 at 2/3 of a core): 2 ends at 6, 1 at 9, 0 at 12."""
    g = 0.5
    plan = Plan([ModuleSpec("llm", data_parallel=3)], num_microbatches=3).resolve({"llm": 4})
    cost = ColdTokenCost(plan, grad_sync=g)
    work = [{"llm": Workload(3)}, {"llm": Workload(2)}, {"llm": Workload(1)}]

    def iteration(cores: int = 2, **kw) -> float:
        sharing = CoreSharing(cores=cores, ranks_per_host=3, **kw)
        return simulate(build_schedule(plan), plan, cost, work, sharing=sharing).iteration_time

    assert iteration() == pytest.approx(11 + g, rel=2 * TOLERANCE)
    assert iteration(placement="host") == pytest.approx(12 + g, rel=2 * TOLERANCE)
    assert iteration(cold_start=False) == pytest.approx(9 + g, rel=2 * TOLERANCE)
    # a core each: nobody pays it, the plain play
    assert iteration(cores=3) == pytest.approx(simulate(build_schedule(plan), plan, cost, work).iteration_time)


@pytest.mark.parametrize("placement", ["core", "host"])
@pytest.mark.parametrize("cores", [1, 2, 3])
def test_multimodal_pipeline_fixed_point(cores, placement):
    """Vision (2 stages), audio, a 2-stage LLM on one host: every compute action receives its solo
    time (the fixed point; under ``placement="core"`` from its rank's core, as `place_units`
    places the ranks by their compute), no action is faster than solo, the step is no shorter
    than without sharing, and no shorter than the host's whole compute spread over its cores."""
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=4)
    cost = UniformCostModel(plan, forward=1.0, backward=2.0, optimizer=0.25)
    schedule = build_schedule(plan)
    alone = simulate(schedule, plan, cost)
    sharing = CoreSharing(cores=cores, ranks_per_host=plan.world_size, placement=placement)
    shared = simulate(schedule, plan, cost, sharing=sharing)
    compute = [e for e in shared.timeline if e.kind in ("forward", "backward", "optimizer_step")]
    solo = {"forward": 1.0, "backward": 2.0, "optimizer_step": 0.25}
    lanes = None
    if placement == "core":
        ranks = sorted({e.rank for e in shared.timeline})
        load = [sum(solo[e.kind] for e in compute if e.rank == r) for r in ranks]
        core_of = place_units(sharing, ranks, [1] * len(ranks), load)
        lanes = (np.array([core_of[ranks.index(e.rank)] for e in compute]), np.zeros(0, dtype=np.int64))
    got = service(np.array([(e.start_s, e.end_s) for e in compute]), np.ones(len(compute)), cores, lanes=lanes)
    need = np.array([solo[e.kind] for e in compute])
    assert np.abs(got / need - 1).max() <= 2 * TOLERANCE
    assert all(e.end_s - e.start_s >= solo[e.kind] - 1e-9 for e in compute)
    assert shared.iteration_time >= alone.iteration_time - 1e-9
    assert shared.iteration_time >= need.sum() / cores * (1 - 2 * TOLERANCE)
    if cores >= plan.world_size:
        assert shared.iteration_time == pytest.approx(alone.iteration_time)


@pytest.mark.parametrize("field,value", [("cores", 0), ("ranks_per_host", -1), ("cores", 1.5), ("cores", True),
                                         ("cold_start", "yes")])
def test_bad_sharing_is_refused_naming_the_field(field, value):
    kwargs = {"cores": 2, "ranks_per_host": 4} | {field: value}
    with pytest.raises(SharingError, match=field):
        CoreSharing(**kwargs)


def test_ranks_host_work_finishes_under_processor_sharing():
    """Jobs started at once on one host: 4 ranks of 1, 2, 3, 4 s on 2 cores run at 1/2 each until
    the 1 s job is done at 2 s, then 3 at 2/3 (the 2 s job ends at 3.5), then 2 at full speed:
    the 4 s job ends at 5.5. With a core each, the longest job alone; on two hosts, the later."""
    sharing = CoreSharing(cores=2, ranks_per_host=4)
    assert sharing.concurrent_finish([4.0, 1.0, 3.0, 2.0]) == pytest.approx(5.5)
    assert CoreSharing(cores=4, ranks_per_host=4).concurrent_finish([4.0, 1.0, 3.0, 2.0]) == pytest.approx(4.0)
    assert CoreSharing(cores=1, ranks_per_host=2).concurrent_finish([1.0, 1.0, 3.0, 0.5]) == pytest.approx(3.5)


def test_dispatch_host_work_per_rank_is_priced_by_sharing():
    """The step pays the slowest rank's host work alone; with core sharing, every rank's work
    shares the cores (the processor-sharing finish), while the decision is stretched by the
    host's full contention."""
    from loom.cost.comm import Link
    from loom.sim.dispatch import DispatchModelError, Links, price_dispatch

    plan = Plan([ModuleSpec("llm", data_parallel=4)], num_microbatches=4).resolve({"llm": 4})
    cost = UniformCostModel(plan, forward=1.0, backward=2.0)
    links = Links.uniform(Link("test", 1e12, 0.0))
    dispatch = price_dispatch(4, links, metadata_bytes=0, decision_seconds=0.5, payload={},
                              host_seconds=[4.0, 1.0, 3.0, 2.0])
    assert dispatch.host == 4.0 and dispatch.total == pytest.approx(4.5)
    alone = simulate(build_schedule(plan), plan, cost, dispatch=dispatch)
    assert alone.dispatch == pytest.approx(4.5)
    shared = simulate(build_schedule(plan), plan, cost, dispatch=dispatch,
                      sharing=CoreSharing(cores=2, ranks_per_host=4))
    assert shared.dispatch_parts.host == pytest.approx(5.5) and shared.dispatch_parts.decide == pytest.approx(1.0)
    assert shared.dispatch == pytest.approx(6.5)
    with pytest.raises(DispatchModelError, match="host_seconds has 3 values for 4 ranks"):
        price_dispatch(4, links, metadata_bytes=0, decision_seconds=0.0, payload={}, host_seconds=[1.0, 1.0, 1.0])


# ---- the CPU slowdown of sharing (loom.profile.contention's measurement) ----------------------
def test_contention_slowdown_table_from_one_measurement():
    """Measured 1.3 x the solo CPU with 4 busy: linear from 1 at one busy rank; measured 1.2 at
    2 busy, held past it (no extrapolation)."""
    assert contention_slowdown(1.3, 4, 4) == pytest.approx((1.0, 1.1, 1.2, 1.3))
    assert contention_slowdown(1.2, 2, 4) == pytest.approx((1.0, 1.2, 1.2, 1.2))
    sharing = CoreSharing(cores=2, ranks_per_host=4, slowdown=contention_slowdown(1.3, 4, 4))
    assert [sharing.slowdown_at(k) for k in (0.5, 1, 1.5, 2, 4, 9)] == pytest.approx([1.0, 1.0, 1.1, 1.1, 1.3, 1.3])
    assert CoreSharing(cores=2, ranks_per_host=4).slowdown_at(4) == 1.0
    # every rank deciding at once: the time slicing (4 on 2 cores) and the slowdown at 4 busy
    assert sharing.concurrent_stretch(4) == pytest.approx(2 * 1.3)
    with pytest.raises(SharingError, match="busy"):
        contention_slowdown(1.3, 1, 4)
    with pytest.raises(SharingError, match="cpu_ratio"):
        contention_slowdown(float("nan"), 4, 4)


@pytest.mark.parametrize("value", [(1.0, 0.0), (1.0, float("inf")), (-1.0,)])
def test_bad_slowdown_is_refused_naming_the_field(value):
    with pytest.raises(SharingError, match="slowdown"):
        CoreSharing(cores=2, ranks_per_host=2, slowdown=value)


def test_slowdown_stretches_compute_that_overlaps_busy_ranks():
    """Two replicas on two cores (no time slicing) whose CPU work costs 1.5 x beside another busy
    rank. Replica 0 (F=1, B=2) runs beside replica 1 (F=3) throughout: forward [0, 1.5], backward
    [1.5, 4.5]; replica 1's forward receives 3 of solo work by 4.5, then its backward (6) runs
    alone: 10.5. CPU: replica 0 all at 1.5 x (4.5 s), replica 1 4.5 + 6."""
    g = 0.5
    plan = Plan([ModuleSpec("llm", data_parallel=2)], num_microbatches=2).resolve({"llm": 4})
    cost = TokenCost(plan, grad_sync=g)
    work = [{"llm": Workload(1)}, {"llm": Workload(3)}]
    plain = simulate(build_schedule(plan), plan, cost, work, sharing=CoreSharing(cores=2, ranks_per_host=2))
    assert plain.iteration_time == pytest.approx(9 + g)
    assert plain.cpu == pytest.approx({0: 3.0, 1: 9.0})  # no slowdown: CPU = solo work
    slow = simulate(build_schedule(plan), plan, cost, work,
                    sharing=CoreSharing(cores=2, ranks_per_host=2, slowdown=(1.0, 1.5)))
    assert slow.iteration_time == pytest.approx(10.5 + g, rel=2 * TOLERANCE)
    spans = {(e.rank, e.kind): (e.start_s, e.end_s) for e in slow.timeline if e.kind in ("forward", "backward")}
    assert spans[(0, "forward")] == pytest.approx((0, 1.5), abs=0.05)
    assert spans[(0, "backward")] == pytest.approx((1.5, 4.5), abs=0.05)
    assert spans[(1, "forward")] == pytest.approx((0, 4.5), abs=0.05)
    assert spans[(1, "backward")] == pytest.approx((4.5, 10.5), abs=0.05)
    assert slow.cpu == pytest.approx({0: 4.5, 1: 10.5}, rel=0.02)
    # without sharing the CPU is the solo compute
    alone = simulate(build_schedule(plan), plan, cost, work)
    assert alone.cpu == alone.compute


def test_cpu_seconds_is_the_core_time_received():
    """One core, ranks 0 and 1 on a host: [0, 2) and [1, 3) overlap on [1, 2) at 1/2 each."""
    got = cpu_seconds(CoreSharing(cores=1, ranks_per_host=2), [0, 1], [1, 1], [[(0.0, 2.0)], [(1.0, 3.0)]])
    assert got == pytest.approx([1.5, 1.5])


# ---- the communicator threads' CPU (CostModel.transfer_cpu) --------------------------------
class ThreadCost(UniformCostModel):
    """Messages that take 1 s and cost each end's communicator threads ``cpu`` CPU seconds."""

    def __init__(self, plan, cpu):
        super().__init__(plan, forward=1.0, backward=2.0, transfer=1.0)
        self.cpu = cpu

    def transfer_cpu(self, src_unit, dst_unit, module, stage, work):
        return self.cpu, self.cpu


@pytest.mark.parametrize("placement, end", [("host", 2.0 + 1 / 3), ("core", 2.5)])
def test_communicator_threads_take_cores_from_compute(placement, end):
    """A 2-stage LLM, 2 microbatches, F=1, B=2, messages of 1 s, both stages on a host of 2
    cores. Stage 0's first activation moves over [1, 2] while stage 0 computes its second
    forward, each end's threads using 1 CPU second over it. Sharing the host's 2 cores (3 cores
    of load), the forward gets 2/3 of a core until 2, then a core of its own: it ends at 2 + 1/3
    instead of 2. With each rank on a core of its own, the sender's threads share only stage 0's
    core: 1/2 until 2, ending at 2.5. The threads' CPU is in each process's CPU time; without
    sharing it is not priced."""
    plan = Plan([ModuleSpec("llm", num_stages=2)], num_microbatches=2).resolve({"llm": 4})
    sharing = CoreSharing(cores=2, ranks_per_host=2, placement=placement)

    def second_forward(cpu: float):
        r = simulate(build_schedule(plan), plan, ThreadCost(plan, cpu), sharing=sharing)
        f1 = next(e for e in r.timeline if e.rank == 0 and e.kind == "forward" and e.microbatch == 1)
        return (f1.start_s, f1.end_s), r

    assert second_forward(0.0)[0] == pytest.approx((1.0, 2.0), abs=0.01)
    span, threaded = second_forward(1.0)
    assert span == pytest.approx((1.0, end), abs=0.02)
    plain = second_forward(0.0)[1]
    # 4 messages, each costing its sender and its receiver 1 CPU second
    assert sum(threaded.cpu.values()) == pytest.approx(sum(plain.cpu.values()) + 8.0, rel=0.01)
    alone = simulate(build_schedule(plan), plan, ThreadCost(plan, 1.0))
    assert alone.cpu == alone.compute


def test_service_shares_the_cores_with_background_load():
    """One core: a compute span [0, 2) beside a background load of half a core on [0, 1)
    receives 1/1.5 on [0, 1) and 1 on [1, 2); the background does not count as a busy rank for
    the CPU slowdown."""
    spans, weights = np.array([[0.0, 2.0]]), np.ones(1)
    bg = (np.array([[0.0, 1.0]]), np.array([0.5]))
    assert service(spans, weights, 1, None, bg) == pytest.approx([1 / 1.5 + 1])
    slow = CoreSharing(cores=1, ranks_per_host=2, slowdown=(1.0, 2.0))
    assert service(spans, weights, 1, slow, bg) == pytest.approx([1 / 1.5 + 1])


# ---- the scheduler's wake-up delay (Communication.wake_delay) ---------------------------------
def test_wake_delay_is_added_to_blocked_receives_on_a_full_host():
    """A 2-stage LLM, F=1, B=2 per stage, free messages, on one core. Stage 1 waits for the
    first activation, which arrives at t=1. With two microbatches stage 0 goes straight on to
    the second forward, so the core is taken at the arrival and the receive ends ``wake_s``
    later; with one microbatch stage 0 then waits for the gradient, the core is free and the
    receive ends at the arrival. With a spare core nothing changes."""
    def first_receive_end(microbatches: int, cores: int, wake: float) -> tuple[float, float]:
        plan = Plan([ModuleSpec("llm", num_stages=2)], num_microbatches=microbatches).resolve({"llm": 4})
        cost = UniformCostModel(plan, forward=1.0, backward=2.0)
        r = simulate(build_schedule(plan), plan, cost,
                     sharing=CoreSharing(cores=cores, ranks_per_host=2, wake_s=wake))
        return next(e.end_s for e in r.timeline if e.rank == 1 and e.kind == "recv_act"), r.iteration_time

    assert first_receive_end(2, 1, 0.0)[0] == pytest.approx(1.0, abs=0.01)
    assert first_receive_end(2, 1, 0.25)[0] == pytest.approx(1.25, abs=0.01)
    assert first_receive_end(1, 1, 0.25)[0] == pytest.approx(1.0, abs=0.01)
    assert first_receive_end(2, 2, 0.25) == pytest.approx(first_receive_end(2, 2, 0.0))
    assert first_receive_end(1, 1, 0.25)[1] == pytest.approx(first_receive_end(1, 1, 0.0)[1])


def test_kept_on_cores_only_the_own_core_counts():
    """Units 0 and 1 on core 0, unit 2 on core 1 (2 cores). A receive of unit 1 whose message
    arrives while unit 0 computes waits ``wake_s``; one of unit 0 arriving while only unit 2
    computes on the other core does not. The core-time each unit's compute receives comes
    from its own core: units 0 and 1 share core 0 over [0, 1) (1/2 each), unit 2 has core 1."""
    from loom.sim.sharing import wake_delays

    sharing = CoreSharing(cores=2, ranks_per_host=3, wake_s=0.1)
    core_of = [0, 0, 1]
    spans = [[(0.0, 1.0)], [(0.0, 1.0)], [(1.0, 2.0)]]
    got = wake_delays(sharing, [0, 1, 2], [1, 1, 1], spans, [[1.5], [0.5], []], core_of)
    assert got == [[0.0], [0.1], []]
    # sharing the host's 2 cores instead, unit 0 alone computes beside unit 1: a core is free
    assert wake_delays(sharing, [0, 1, 2], [1, 1, 1], spans, [[1.5], [0.5], []]) == [[0.0], [0.0], []]
    assert cpu_seconds(sharing, [0, 1, 2], [1, 1, 1], spans, core_of=core_of) == pytest.approx([0.5, 0.5, 1.0])
    assert cpu_seconds(sharing, [0, 1, 2], [1, 1, 1], spans) == pytest.approx([1.0, 1.0, 1.0])


def test_wake_delays_count_the_ranks_computing_at_the_arrival():
    from loom.sim.sharing import wake_delays

    sharing = CoreSharing(cores=2, ranks_per_host=3, wake_s=0.1)
    spans = [[(0.0, 1.0)], [(0.5, 2.0)], []]  # units 0 and 1 compute; unit 2 waits
    got = wake_delays(sharing, [0, 1, 2], [1, 1, 1], spans, [[], [], [0.7, 0.2, None, 1.5]])
    assert got == [[], [], [0.1, 0.0, 0.0, 0.0]]  # both cores taken only on [0.5, 1.0)
    # a tensor-parallel unit of 2 ranks fills both cores alone
    assert wake_delays(sharing, [0, 2], [2, 1], [[(0.0, 1.0)], []], [[], [0.5]]) == [[], [0.1]]
    # on another host the busy ranks do not count
    other = CoreSharing(cores=1, ranks_per_host=1, wake_s=0.1)
    assert wake_delays(other, [0, 1], [1, 1], [[(0.0, 1.0)], []], [[], [0.5]]) == [[], [0.0]]
    with pytest.raises(SharingError, match="wake_s"):
        CoreSharing(cores=1, ranks_per_host=1, wake_s=-0.1)


def test_profile_sharing_and_the_measured_wake_delay():
    """`Communication.wake_delay`: the median over sizes of ``latency_full - latency`` (never
    negative; 0 without the measurement), carried into `CoreSharing` with the contention table."""
    from types import SimpleNamespace

    from loom.cost.profile_comm import Communication
    from loom.cost.profile_fit import LinearFit
    from loom.sim.sharing import profile_sharing

    line = LinearFit.fit([(0, 1e-4), (1e6, 6e-4)])
    comm = Communication(send_post=line, recv_ready=line, latency=line, all_reduce=line,
                         latency_full=LinearFit.fit([(0, 2.1e-3), (5e5, 2.35e-3), (1e6, 9e-3)]))
    assert comm.wake_delay() == pytest.approx(2.0e-3)
    assert Communication.from_dict(comm.to_dict()).wake_delay() == pytest.approx(2.0e-3)
    assert Communication(send_post=line, recv_ready=line, latency=line, all_reduce=line).wake_delay() == 0.0
    faster = Communication(send_post=line, recv_ready=line, latency=line, all_reduce=line,
                           latency_full=LinearFit.fit([(0, 0.5e-4), (1e6, 1e-4)]))
    assert faster.wake_delay() == 0.0
    profile = SimpleNamespace(comm=comm, contention={"busy": 4, "cpu_ratio": 1.3})
    sharing = profile_sharing(profile, cores=2, ranks_per_host=4)
    assert sharing.wake_s == pytest.approx(2.0e-3) and sharing.slowdown == pytest.approx((1.0, 1.1, 1.2, 1.3))
    assert profile_sharing(profile, 2, 4, contention=False).slowdown == ()
    assert profile_sharing(SimpleNamespace(comm=None, contention=None), 2, 1) == CoreSharing(2, 1)
