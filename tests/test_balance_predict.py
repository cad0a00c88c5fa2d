"""The predicted step time of a layout (`loom.balance.predict`): exact values on small pipelines
worked by hand, agreement with the reference 1F1B simulator, and `make_layout`'s rule that keeps
the given layout unless a policy's is predicted faster by ``balance.min_gain``."""

from __future__ import annotations

import numpy as np
import pytest

from loom.balance.costs import SampleCosts
from loom.balance.disttrain import simulate_1f1b
from loom.balance.policy import BalanceConfig, make_layout
from loom.balance.predict import pipeline_times, predict_step, predict_steps, slot_costs
from loom.plan.plan import ModuleSpec, Plan
from loom.schedule.layout import BatchLayout, contiguous_layout, identity_layout
from oracles import critical_load


def _plan(m: int, llm_stages: int = 1, dp: int = 1, encoders: tuple[str, ...] = ("vision",)) -> Plan:
    mods = [ModuleSpec(e, data_parallel=dp) for e in encoders] + [
        ModuleSpec("llm", data_parallel=dp, num_stages=llm_stages)]
    return Plan(mods, num_microbatches=m).resolve({**{e: 4 for e in encoders}, "llm": 4})


def _costs(vision, llm, lengths=None, **more) -> SampleCosts:
    """Hand-made costs: ``llm`` is each sample's packed cost; padded rows cost ``lengths``
    (alpha 1, beta 0) per row."""
    lengths = np.asarray(llm if lengths is None else lengths, dtype=np.int64)
    return SampleCosts({"vision": vision, "llm": llm, **more}, lengths, 1.0, 0.0)


def test_two_stage_pipeline_by_hand() -> None:
    # vision forwards 3 then 1, the LLM 1 then 3; backward 2x. Encoder (warmup 1): F0 0-3, F1
    # 3-4; LLM: F0 3-4, B0 4-6, F1 6-9, B1 9-15; encoder B0 max(4, 6)+6 = 12, B1 max(12, 15)+2 = 17
    plan = _plan(2)
    layout = identity_layout([[0], [1]], plan.module_names)
    assert predict_step(layout, plan, _costs([3.0, 1.0], [1.0, 3.0]), llm_padded=False).step == 17.0
    # the other pairing: F0 0-1, F1 1-4; LLM F0 1-4, B0 4-10, F1 10-11, B1 11-13; encoder B0 12, B1 19
    assert predict_step(layout, plan, _costs([1.0, 3.0], [3.0, 1.0]), llm_padded=False).step == 19.0


def test_encoders_in_parallel_feed_the_llm() -> None:
    # vision 2 and audio 3 in parallel; the LLM starts at 3: F 3-4, B 4-6; vision B 6-10, audio B 6-12
    plan = _plan(1, encoders=("vision", "audio"))
    layout = identity_layout([[0]], plan.module_names)
    costs = _costs([2.0], [1.0], audio=[3.0])
    assert predict_step(layout, plan, costs, llm_padded=False).step == 12.0


def test_equal_microbatches_give_the_pipeline_formula() -> None:
    # encoder + a 2-stage LLM, every stage 1 forward / 2 backward: (M + p - 1) x 3 with p = 3
    plan = _plan(4, llm_stages=2)
    costs = _costs([1.0] * 4, [2.0] * 4)  # the LLM's 2 split over its 2 stages
    layout = contiguous_layout(4, 4, plan.module_names)
    assert predict_step(layout, plan, costs, llm_padded=False).step == 18.0


@pytest.mark.parametrize("llm_stages", [1, 2, 3])
def test_agrees_with_the_reference_1f1b_simulator(llm_stages: int) -> None:
    rng = np.random.default_rng(llm_stages)
    m = 6
    plan = _plan(m, llm_stages=llm_stages)
    for _ in range(20):
        enc, llm = rng.lognormal(0, 0.8, m), rng.lognormal(0, 0.5, m)
        ends, _ = pipeline_times(plan, {"vision": enc[:, None], "llm": (llm / llm_stages)[:, None]})
        ref = simulate_1f1b(range(m), enc.tolist(), (llm / llm_stages).tolist(), 1 + llm_stages)
        assert ends[0] == pytest.approx(ref, rel=1e-12)


def test_the_slowest_replica_sets_the_step() -> None:
    # DP 2, slots 0 and 2 on replica 0 (all costs 1: (2 + 1) x 3 = 9), slots 1 and 3 on replica 1
    # (vision 1, LLM 3: F0 0-1, F1 1-2; LLM F0 1-4, B0 4-10, F1 10-13, B1 13-19; vision B1 19-21)
    plan = _plan(4, dp=2)
    layout = contiguous_layout(4, 4, plan.module_names)
    got = predict_step(layout, plan, _costs([1.0] * 4, [1.0, 3.0, 1.0, 3.0]), llm_padded=False)
    assert got.lanes.tolist() == [9.0, 21.0]
    assert got.step == 21.0


def test_padded_rows_cost_count_times_longest() -> None:
    # a free encoder: the step is 3 x the LLM's summed forward; slots [0, 1] and [2, 3]
    plan = _plan(2)
    costs = _costs([0.0] * 4, [4.0, 1.0, 1.0, 1.0])
    layout = contiguous_layout(4, 2, plan.module_names)
    assert slot_costs(layout, costs, llm_padded=True)["llm"].tolist() == [8.0, 2.0]
    assert predict_step(layout, plan, costs, llm_padded=True).step == 30.0  # 3 x (2 x 4 + 2 x 1)
    assert predict_step(layout, plan, costs, llm_padded=False).step == 21.0  # 3 x (5 + 2)


def test_evening_out_the_encoder_llm_coupling_is_predicted_faster() -> None:
    # two samples heavy in both phases (3, 3) and two light (1, 1). Together: vision [6, 2], LLM
    # [6, 2] (F0 0-6, F1 6-8; LLM F0 6-12, B0 12-24, F1 24-26, B1 26-30; vision B0 24-36, B1
    # 36-40); one of each per microbatch: every stage 4 forward, (2 + 1) x 12 = 36
    plan = _plan(2)
    costs = _costs([3.0, 3.0, 1.0, 1.0], [3.0, 3.0, 1.0, 1.0])
    together = identity_layout([[0, 1], [2, 3]], plan.module_names)
    mixed = identity_layout([[0, 2], [1, 3]], plan.module_names)
    a, b = predict_steps([together, mixed], plan, costs, llm_padded=False)
    assert (a.step, b.step) == (40.0, 36.0)
    # the per-round critical load cannot tell them apart at data-parallel degree 1
    assert critical_load(together, plan, costs, False) == critical_load(mixed, plan, costs, False)


def test_spreading_long_padded_rows_is_predicted_slower() -> None:
    # two long rows (8) and six short (1), 2 microbatches, a free encoder. Kept together:
    # padded [4 x 8, 4 x 1] = 36; spread: [4 x 8, 4 x 8] = 64. Packed they cost the same (22, 22).
    plan = _plan(2)
    lengths = [8.0, 8.0] + [1.0] * 6
    costs = _costs([0.0] * 8, lengths)
    kept = identity_layout([[0, 1, 2, 3], [4, 5, 6, 7]], plan.module_names)
    spread = identity_layout([[0, 2, 3, 4], [1, 5, 6, 7]], plan.module_names)
    k, s = predict_steps([kept, spread], plan, costs, llm_padded=True)
    assert (k.step, s.step) == (3 * 36.0, 3 * 64.0)
    kp, sp = predict_steps([kept, spread], plan, costs, llm_padded=False)
    assert kp.step == sp.step == 3 * 22.0


def test_layouts_side_by_side_match_one_by_one() -> None:
    rng = np.random.default_rng(3)
    plan = _plan(8, llm_stages=2, dp=2)
    n = 32
    costs = _costs(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n), lengths=rng.integers(1, 50, n))
    layouts = [identity_layout(np.array_split(rng.permutation(n), 8), plan.module_names) for _ in range(3)]
    together = predict_steps(layouts, plan, costs)
    for layout, got in zip(layouts, together):
        alone = predict_step(layout, plan, costs)
        assert got.step == alone.step and np.array_equal(got.lanes, alone.lanes)
        assert got.busy == alone.busy


def test_deferred_samples_wait_for_their_encoder_slot() -> None:
    # encoder slots [0, 1], [2]; LLM slots [0], [1, 2] (sample 1 deferred one microbatch):
    # vision F0 0-2, F1 2-3; LLM F0 2-4, B0 4-8, F1 max(8, 3)+2 = 10, B1 10-14; vision B0 of
    # sample 0 8-10, then (split backward) sample 1's part and B1 after LLM B1: 14-16-18
    plan = _plan(2)
    layout = BatchLayout({"vision": ((0, 1), (2,)), "llm": ((0,), (1, 2))})
    costs = _costs([1.0, 1.0, 1.0], [2.0, 1.0, 1.0])
    assert predict_step(layout, plan, costs, llm_padded=False).step == 18.0 == _play(plan, layout, costs)
    # a route to an LLM slot whose encoder slot comes later makes the LLM wait for it
    late = BatchLayout({"vision": ((1,), (0, 2)), "llm": ((0, 1), (2,))})
    aligned = identity_layout([[0, 1], [2]], plan.module_names)
    assert predict_step(late, plan, costs, llm_padded=False).step >= predict_step(aligned, plan, costs, False).step


def _coupled_batch() -> tuple[Plan, SampleCosts]:
    """8 microbatches of 2 at data-parallel degree 1; the first half of the batch is heavy in
    both phases, so the given contiguous layout pairs heavy with heavy."""
    rng = np.random.default_rng(0)
    n = 16
    heavy = np.arange(n) < n // 2
    vision = np.where(heavy, 5.0, 1.0) * rng.uniform(0.9, 1.1, n)
    llm = np.where(heavy, 5.0, 1.0) * rng.uniform(0.9, 1.1, n)
    return _plan(8), SampleCosts({"vision": vision, "llm": llm}, np.round(llm * 10).astype(np.int64), 0.1, 0.0)


@pytest.mark.parametrize("policy", ["disttrain", "entrain"])
def test_make_layout_uses_the_policy_layout_only_above_min_gain(policy: str) -> None:
    plan, costs = _coupled_batch()
    given = make_layout(BalanceConfig(), plan, costs, llm_batching="packed")
    own = make_layout(BalanceConfig(default=policy, min_gain=-1.0), plan, costs, llm_batching="packed")
    gain = own.predicted_gain["total"]
    before = predict_steps([given], plan, costs, llm_padded=False)[0]
    after = predict_steps([own], plan, costs, llm_padded=False, eager=own.eager_forward)[0]  # Entrain's own warmup
    assert gain == pytest.approx((before.step - after.step) / before.step, abs=1e-6)
    assert gain > 0.05, own.slots  # the policy pairs heavy with light: a real predicted gain
    used = make_layout(BalanceConfig(default=policy, min_gain=gain / 2), plan, costs, llm_batching="packed")
    assert not used.kept_given and used == own
    kept = make_layout(BalanceConfig(default=policy, min_gain=min(gain + 0.01, 0.99)), plan, costs,
                       llm_batching="packed")
    assert kept.kept_given and kept.is_identity()
    assert kept.predicted_gain["total"] == pytest.approx(gain)
    assert kept.arrays["llm"][0].tolist() == given.arrays["llm"][0].tolist()


def test_entrain_takes_the_eager_forward_its_prediction_finds_fastest() -> None:
    """Entrain's eager forward (entrain.md §3.6) as part of its policy: the encoders' extra
    warmup is the shallowest depth, within ``balance.entrain_eager_max`` beyond
    ``balance.eager_forward``, of those the 1F1B prediction finds fastest; the schedule built
    from the layout runs it."""
    from loom.schedule.generators import build_schedule

    rng = np.random.default_rng(3)
    # [vision] -> [llm], vision the busier rank, but a microbatch's LLM forward and backward
    # outlast the next vision forward: 1F1B leaves the vision rank waiting for its first gradient
    plan = _plan(8)
    deepened = 0
    for _ in range(6):
        n = 48
        costs = _costs(rng.lognormal(0, 0.5, n), 0.6 * rng.lognormal(0, 0.5, n))
        for base, cap in ((0, 2), (1, 1), (0, 0)):
            config = BalanceConfig(default="entrain", min_gain=-1.0, eager_forward=base, entrain_eager_max=cap)
            own = make_layout(config, plan, costs, llm_batching="packed")
            steps = [predict_steps([own], plan, costs, llm_padded=False, eager=e)[0].step
                     for e in range(base, base + cap + 1)]
            assert own.eager_forward == base + steps.index(min(steps))
            given = make_layout(BalanceConfig(eager_forward=base), plan, costs, llm_batching="packed")
            before = predict_steps([given], plan, costs, llm_padded=False, eager=base)[0].step
            assert own.predicted_gain["total"] == pytest.approx((before - min(steps)) / before, abs=1e-6)
            assert build_schedule(plan, layout=own).actions == build_schedule(plan, layout=own,
                                                                              eager=own.eager_forward).actions
            deepened += own.eager_forward > base
    assert deepened > 0  # the fill bubble this plan has: some batches gain from a deeper warmup
    # with a generator after the LLM the layout keeps the depth its encoders and LLM were given
    gen = Plan([ModuleSpec("vision"), ModuleSpec("llm"), ModuleSpec("image")], num_microbatches=8).resolve(
        {"vision": 4, "llm": 4, "image": 4}, generators=["image"])
    for _ in range(6):
        costs = _costs(rng.lognormal(0, 0.5, 48), 0.6 * rng.lognormal(0, 0.5, 48), image=rng.lognormal(-2, 0.5, 48))
        config = BalanceConfig(default="entrain", min_gain=-1.0)
        whole = make_layout(config, gen, costs, llm_batching="packed")
        inner = make_layout(config, gen.without_generators(), costs, llm_batching="packed")
        assert whole.eager_forward == inner.eager_forward
        deepened += inner.eager_forward > 0
    # colocated: every encoder forward runs first anyway, a deeper warmup gains nothing
    coloc = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2)], num_microbatches=8,
                 placement="colocated").resolve({"vision": 4, "llm": 4})
    costs = _costs(rng.lognormal(0, 0.5, 48), rng.lognormal(0, 0.5, 48))
    assert make_layout(BalanceConfig(default="entrain", min_gain=-1.0), coloc, costs,
                       llm_batching="packed").eager_forward == 0


# ---- against a play of the schedule loom really runs ----------------------------------------
def _play(plan: Plan, layout: BatchLayout, costs: SampleCosts, ratio: float = 2.0) -> float:
    """An independent oracle: play `build_schedule`'s actions for ``layout`` (every rank, real
    replicas, routed edges, split backwards), compute costing a slot's packed per-sample costs
    per stage, communication free. Returns the latest rank's end."""
    from loom.schedule.generators import build_schedule
    from loom.schedule.ir import ActionKind as K

    sched = build_schedule(plan, layout=layout)
    slots = layout.slots
    clock = {u: 0.0 for u in sched.actions}
    ptr = {u: 0 for u in sched.actions}
    posted: dict[tuple, float] = {}

    def key(a, sending: bool) -> tuple:
        mine = (a.module, a.stage, a.microbatch)
        theirs = (a.peer_module, a.peer_stage, a.other_microbatch)
        pair = (mine, theirs) if sending else (theirs, mine)
        return ("act" if a.kind in (K.SEND_ACT, K.RECV_ACT) else "grad",) + pair

    def work(a) -> float:
        samples = slots[a.module][a.microbatch] if a.samples is None else a.samples
        return float(costs.work[a.module][list(samples)].sum()) / plan.spec(a.module).num_stages

    left = sum(len(v) for v in sched.actions.values())
    while left:
        moved = False
        for u, acts in sched.actions.items():
            while ptr[u] < len(acts):
                a = acts[ptr[u]]
                if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                    k = key(a, False)
                    if k not in posted:
                        break
                    clock[u] = max(clock[u], posted[k])
                elif a.kind in (K.SEND_ACT, K.SEND_GRAD):
                    posted[key(a, True)] = clock[u]
                elif a.kind is K.FORWARD:
                    clock[u] += work(a)
                elif a.kind is K.BACKWARD:
                    clock[u] += ratio * work(a)
                ptr[u] += 1
                left -= 1
                moved = True
        assert moved, "the oracle's play deadlocked"
    return max(clock.values())


@pytest.mark.parametrize("dp,llm_stages", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_identity_layouts_match_a_play_of_the_real_schedule(dp: int, llm_stages: int) -> None:
    rng = np.random.default_rng(10 * dp + llm_stages)
    m, n = 8, 24
    plan = _plan(m, llm_stages=llm_stages, dp=dp)
    costs = _costs(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))
    for _ in range(5):
        layout = identity_layout(np.array_split(rng.permutation(n), m), plan.module_names)
        assert predict_step(layout, plan, costs, llm_padded=False).step == pytest.approx(_play(plan, layout, costs))


@pytest.mark.parametrize("policy", ["orchmllm", "disttrain", "entrain"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_policy_layouts_match_a_play_of_the_real_schedule(policy: str, dp: int) -> None:
    """Routed layouts (rearranged rounds, deferral, split backwards) at equal data-parallel
    degrees: the prediction is the play's step time."""
    rng = np.random.default_rng(5 + dp)
    plan = _plan(8, llm_stages=2, dp=dp)
    for _ in range(4):
        n = 48
        costs = _costs(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))
        given = make_layout(BalanceConfig(), plan, costs, llm_batching="packed")
        own = make_layout(BalanceConfig(default=policy, min_gain=-1.0), plan, costs, llm_batching="packed")
        p_given = predict_steps([given], plan, costs, llm_padded=False)[0]
        # the encoders' warmup Entrain chose (its eager forward), which the real schedule runs
        p_own = predict_steps([own], plan, costs, llm_padded=False, eager=own.eager_forward)[0]
        t_given, t_own = _play(plan, given, costs), _play(plan, own, costs)
        assert p_given.step == pytest.approx(t_given)
        assert p_own.step == pytest.approx(t_own)


def test_unequal_degrees_are_estimated() -> None:
    """Vision on 2 replicas, the LLM on 1: the lane's encoder is both replicas at the pace of the
    slower, an estimate (within 25 % of the play) that orders OrchMLLM's layouts as the play does."""
    rng = np.random.default_rng(11)
    plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=2)],
                num_microbatches=8).resolve({"vision": 4, "llm": 4})
    for _ in range(4):
        n = 48
        costs = _costs(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))
        given = make_layout(BalanceConfig(), plan, costs, llm_batching="packed")
        own = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0), plan, costs, llm_batching="packed")
        p_given, p_own = predict_steps([given, own], plan, costs, llm_padded=False)
        t_given, t_own = _play(plan, given, costs), _play(plan, own, costs)
        assert p_given.step == pytest.approx(t_given, rel=0.25) and p_own.step == pytest.approx(t_own, rel=0.25)
        if abs(t_own - t_given) > 0.05 * t_given:
            assert (p_own.step < p_given.step) == (t_own < t_given)


@pytest.mark.parametrize("order", ["given", "disttrain"])
def test_orchmllm_records_the_slot_costs_and_index_the_prediction_would_compute(order: str) -> None:
    """The policy hands the prediction its balanced loads (`known_slot_costs`) and the slot of
    every sample (`set_slot_index`): what `slot_costs` and `slot_index` compute (sums to rounding,
    padded products and slots exactly)."""
    from loom.balance.orchmllm import orchmllm_layout

    rng = np.random.default_rng(3)
    for dp, m, llm_padded in [(4, 8, True), (4, 8, False), (2, 2, True), (8, 8, False)]:
        plan = _plan(m, dp=dp)
        n = 12 * m
        lengths = rng.integers(1, 400, n)
        costs = SampleCosts({"vision": rng.lognormal(0, 1, n) * (rng.random(n) < 0.8), "llm": lengths * 1.5},
                            lengths, 1.5, 0.002)
        layout = orchmllm_layout(plan, costs, {"vision": "orchmllm", "llm": "orchmllm"}, order, llm_padded)
        known = slot_costs(layout, costs, llm_padded)
        assert layout.known_slot_costs is not None
        recorded = {p: layout.slot_index(p) for p in layout.arrays}
        fresh = BatchLayout(None, layout.policy, arrays=dict(layout.arrays))
        for p, v in slot_costs(fresh, costs, llm_padded).items():
            if p == "llm" and llm_padded:
                assert np.array_equal(known[p], v)
            else:
                assert np.allclose(known[p], v, rtol=1e-12, atol=0.0), p
            assert np.array_equal(recorded[p], fresh.slot_index(p)), p
        # another costs object is not answered from the record
        other = SampleCosts({k: v * 2 for k, v in costs.work.items()}, lengths * 2, 1.5, 0.002)
        assert not np.array_equal(slot_costs(layout, other, llm_padded)["vision"], known["vision"])


@pytest.mark.parametrize("batching", ["padded", "packed"])
def test_orchmllm_with_one_slot_per_round_keeps_none_layout_without_deciding(batching: str, monkeypatch) -> None:
    """Every module at data-parallel degree 1: each round holds one slot, so OrchMLLM has nothing
    to balance. `make_layout` returns the given layout at once (kept, with why), the same slots,
    schedule-cache key and payload destinations as ``none``'s, so the step runs what ``none`` runs."""
    import loom.balance.policy as policy_module
    from loom.balance.orchmllm import orchmllm_layout
    from loom.balance.payload import layout_payload_bytes

    plan, costs = _coupled_batch()
    none = make_layout(BalanceConfig(), plan, costs, llm_batching=batching)
    # what the policy would build, had it decided: the given layout, by construction
    own = orchmllm_layout(plan, costs, {"vision": "orchmllm", "llm": "orchmllm"}, "given", batching == "padded")
    assert own.key() == none.key()

    def must_not_run(*args, **kwargs):
        raise AssertionError("a policy with nothing to balance must not decide")

    monkeypatch.setattr(policy_module, "orchmllm_layout", must_not_run)
    monkeypatch.setattr(policy_module, "predict_steps", must_not_run)
    for config in (BalanceConfig(default="orchmllm"), BalanceConfig(default="orchmllm", min_gain=-1.0),
                   BalanceConfig(default="none", policy={"llm": "orchmllm"})):
        kept = make_layout(config, plan, costs, llm_batching=batching)
        assert kept.kept_given and "one slot" in kept.kept_why, config
        assert kept.policy == config.summary(plan.module_names)
        assert kept.predicted_gain == {"total": 0.0, "vision": 0.0, "llm": 0.0}
        assert kept.key() == none.key() and kept.is_identity() and kept.contiguous
        sizes = {"vision": np.arange(16.0) + 1, "llm": np.arange(16.0) + 2}
        moved, moved_none = layout_payload_bytes(plan, kept, sizes), layout_payload_bytes(plan, none, sizes)
        assert all(np.array_equal(moved[p], moved_none[p]) for p in plan.module_names)
    # rounds of one slot are still reordered under balance.order = "disttrain": that one decides
    with pytest.raises(AssertionError, match="must not decide"):
        make_layout(BalanceConfig(default="orchmllm", order="disttrain"), plan, costs, llm_batching=batching)


@pytest.mark.parametrize("policy", ["none", "orchmllm", "disttrain", "entrain"])
def test_colocated_steps_against_a_play_of_the_real_schedule(policy: str) -> None:
    """Colocated (OrchMLLM's setting): a vision replica on each LLM replica's rank, its
    forwards first and backwards last. Where the layout keeps the LLM's slots the prediction is
    the play's step; where rows cross ranks it bounds it from above, within a third."""
    rng = np.random.default_rng(17)
    plan = Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2)], num_microbatches=8,
                placement="colocated").resolve({"vision": 4, "llm": 4})
    for _ in range(4):
        n = 32
        costs = _costs(rng.lognormal(0, 1, n), rng.lognormal(0, 1, n))
        layout = make_layout(BalanceConfig(default=policy, min_gain=-1.0), plan, costs, llm_batching="packed")
        predicted, played = predict_step(layout, plan, costs, llm_padded=False).step, _play(plan, layout, costs)
        if layout.shares_llm_slots("vision"):
            assert predicted == pytest.approx(played)
        else:
            assert played <= predicted * (1 + 1e-9) <= 4 / 3 * played
