"""OrchMLLM post-balancing (loom.balance.lpt, padded, nodewise) against exact oracles: brute force on small
instances, the LPT bound, the heap reference, and brute force over node-wise permutations."""

import numpy as np
import pytest

from loom.balance.assignment import Assignment, InfeasibleBalanceError, packed_loads, padded_loads
from loom.balance.lpt import _lpt_fast, _lpt_integer_core, lpt_balance, quantised_lpt
from loom.balance.lpt import _lpt_heap as _lpt_reference
from loom.balance.nodewise import nodewise_rearrangement
from loom.balance.padded import padded_balance, padded_balance_fast
from oracles import brute_force_balance, nodewise_brute_force


def assert_partition(a: Assignment, n: int, d: int) -> None:
    # No sample dropped or duplicated: every sample has exactly one rank in range.
    assert a.rank_of_sample.shape == (n,)
    assert a.loads.shape == (d,)
    if n:
        assert a.rank_of_sample.min() >= 0 and a.rank_of_sample.max() < d
    flat = sorted(k for rank in a.ranks for k in rank)
    assert flat == list(range(n))


def small_instances(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        d = int(rng.integers(2, 4))
        n = int(rng.integers(1, 8 if d == 3 else 10))
        yield rng.integers(1, 20, size=n).astype(float), d


def test_lpt_within_graham_bound_of_brute_force():
    worst = 1.0
    for lengths, d in small_instances(0, 40):
        a = lpt_balance(lengths, d)
        assert_partition(a, lengths.size, d)
        opt = brute_force_balance(lengths.size, d, lambda r: packed_loads(lengths, r, d)).max_load
        ratio = a.max_load / opt
        worst = max(worst, ratio)
        assert ratio <= 4 / 3 - 1 / (3 * d) + 1e-12
    assert worst >= 1.0


def test_lpt_graham_tight_example():
    # Graham's tight instance for d=2: 3,3,2,2,2 -> LPT 7, optimum 6 (ratio 7/6 = 4/3 - 1/6).
    a = lpt_balance([3, 3, 2, 2, 2], 2)
    assert a.max_load == 7
    assert a.ranks == [[0, 2, 4], [1, 3]]


@pytest.mark.parametrize("seed", range(4))
def test_fast_lpt_equals_heap_reference(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(3, 200))
    n = int(rng.integers(1, 3000))
    ints = rng.integers(0, 50, size=n).astype(float)  # many ties and zeros
    floats = rng.lognormal(3, 1, size=n)
    for w in (ints, floats):
        ref = _lpt_reference(w, d)
        assert np.array_equal(_lpt_fast(w, d), ref)
        assert np.array_equal(lpt_balance(w, d).rank_of_sample, ref)
    assert np.array_equal(_lpt_integer_core(ints.astype(np.int64), d)[0], _lpt_reference(ints, d))


def test_lpt_more_ranks_than_samples_and_empty():
    a = lpt_balance([5, 1], 4)
    assert_partition(a, 2, 4)
    assert sorted(a.loads.tolist()) == [0, 0, 1, 5]
    empty = lpt_balance([], 3)
    assert_partition(empty, 0, 3)
    assert empty.max_load == 0 and empty.imbalance() == 1.0


def test_padded_equals_brute_force():
    for lengths, d in small_instances(1, 40):
        a = padded_balance(lengths, d)
        assert_partition(a, lengths.size, d)
        assert np.allclose(a.loads, padded_loads(lengths, a.rank_of_sample, d))
        opt = brute_force_balance(lengths.size, d, lambda r: padded_loads(lengths, r, d)).max_load
        assert a.max_load == opt


def test_padded_quadratic_and_real_costs_equal_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(15):
        d = int(rng.integers(2, 4))
        n = int(rng.integers(1, 7))
        lengths = rng.integers(1, 30, size=n).astype(float)
        # Integer coefficients: exact integer search.
        a = padded_balance(lengths, d, alpha=2.0, beta=1.0)
        opt = brute_force_balance(n, d, lambda r: padded_loads(lengths, r, d, 2.0, 1.0)).max_load
        assert a.max_load == opt
        # Real lengths: float search to relative 1e-12.
        real = lengths * 0.37
        b = padded_balance(real, d, alpha=1.0, beta=0.01)
        opt = brute_force_balance(n, d, lambda r: padded_loads(real, r, d, 1.0, 0.01)).max_load
        assert b.max_load == pytest.approx(opt, rel=1e-9)
        assert_partition(b, n, d)


def test_padded_large_is_partition_and_beats_random():
    rng = np.random.default_rng(3)
    d, per = 64, 30
    lengths = np.round(rng.lognormal(6, 1, d * per))
    a = padded_balance(lengths, d)
    assert_partition(a, lengths.size, d)
    random = padded_loads(lengths, np.repeat(np.arange(d), per), d)
    assert a.max_load <= random.max()
    assert a.max_load >= max(lengths.max(), np.ceil(lengths.sum() / d))


def test_validation_errors():
    with pytest.raises(ValueError, match="num_ranks"):
        lpt_balance([1, 2], 0)
    with pytest.raises(ValueError, match=r"workloads\[1\].*negative"):
        lpt_balance([1, -2], 2)
    with pytest.raises(ValueError, match="NaN"):
        padded_balance([1, float("nan")], 2)
    with pytest.raises(ValueError, match="1-D"):
        lpt_balance([[1, 2]], 2)
    with pytest.raises(ValueError, match="beta"):
        padded_balance([1, 2], 2, beta=-1)
    with pytest.raises(InfeasibleBalanceError, match="capacity"):
        lpt_balance([10, 1], 2, capacity=5)
    with pytest.raises(InfeasibleBalanceError, match="num_ranks \\* capacity"):
        lpt_balance([4, 4, 4], 2, capacity=5)
    # Padded optimum for [3,3,3] on 2 ranks is 6 (two share a rank): capacity 5 cannot be met.
    with pytest.raises(InfeasibleBalanceError, match="optimal padded"):
        padded_balance([3, 3, 3], 2, capacity=5)
    assert padded_balance([3, 3, 3], 2, capacity=6).max_load == 6


def _nodewise_instance(rng, d, per, ranks_per_node):
    n = d * per
    lengths = np.round(rng.lognormal(5, 1, n))
    source = np.repeat(np.arange(d), per)
    balanced = lpt_balance(lengths, d)
    return balanced, source, lengths


def test_nodewise_milp_equals_brute_force_on_tiny():
    rng = np.random.default_rng(5)
    for d, c in [(4, 2), (6, 2), (6, 3)]:
        for _ in range(3):
            balanced, source, volumes = _nodewise_instance(rng, d, 4, c)
            plan = nodewise_rearrangement(balanced, source, volumes, c, time_limit=5.0)
            exact = nodewise_brute_force(balanced, source, volumes, c)
            assert plan.max_internode_send == pytest.approx(exact)
            assert plan.gap == pytest.approx(0.0, abs=1e-6)


def test_nodewise_milp_not_worse_than_heuristic_and_keeps_balance():
    rng = np.random.default_rng(6)
    balanced, source, volumes = _nodewise_instance(rng, 16, 10, 4)
    heur = nodewise_rearrangement(balanced, source, volumes, 4, use_milp=False)
    plan = nodewise_rearrangement(balanced, source, volumes, 4, time_limit=2.0)
    assert plan.max_internode_send <= heur.max_internode_send + 1e-9
    assert plan.max_internode_send <= plan.identity_max_send + 1e-9
    assert 0.0 <= plan.gap <= 1.0 and plan.lower_bound <= plan.max_internode_send + 1e-9
    # A permutation of whole batches: same multiset of loads, every sample kept.
    assert sorted(plan.assignment.loads) == sorted(balanced.loads)
    assert_partition(plan.assignment, volumes.size, 16)
    assert sorted(plan.rank_of_batch.tolist()) == list(range(16))
    for j in range(16):
        moved = plan.assignment.samples_on(int(plan.rank_of_batch[j]))
        assert np.array_equal(moved, balanced.samples_on(j))


def test_nodewise_validation():
    balanced = lpt_balance([1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        nodewise_rearrangement(balanced, [0, 1, 2, 3], [1, 1, 1, 1], 3)
    with pytest.raises(ValueError, match="source_rank"):
        nodewise_rearrangement(balanced, [0, 1, 2], [1, 1, 1, 1], 2)
    with pytest.raises(ValueError, match="source_rank values"):
        nodewise_rearrangement(balanced, [0, 1, 2, 9], [1, 1, 1, 1], 2)
    with pytest.raises(ValueError, match="volumes"):
        nodewise_rearrangement(balanced, [0, 1, 2, 3], [1, 1, 1, -1], 2)


def test_integer_lpt_paths_equal_heap_reference():
    # The integer core's branches: uint16 radix order (max < 2^16) or packed int64 keys
    # (max >= 2^16); int32 or int64 rank keys (by the load bound); int16 or int32 scatter.
    from loom.balance.lpt import _lpt_integer_core

    rng = np.random.default_rng(11)
    cases = [
        (rng.integers(0, 40, size=900), 37),  # many ties and zeros, uint16 order, int32 keys
        (rng.integers(60_000, 200_000, size=700), 50),  # max >= 2^16: packed int64 order
        (rng.integers(0, 2**30, size=500), 7),  # load bound >= 2^31: int64 rank keys
        (rng.integers(1, 10, size=40_000), 33_000),  # > 2^15 ranks: int32 scatter
        (np.zeros(300, dtype=np.int64), 9),  # all equal: ties on index, then rank
    ]
    for w, d in cases:
        ref = _lpt_reference(w.astype(float), d)
        rank_of, loads = _lpt_integer_core(w, d)
        assert rank_of.dtype == np.int64 and np.array_equal(rank_of, ref)
        assert np.array_equal(loads, packed_loads(w.astype(float), ref, d))
        a = lpt_balance(w, d)
        assert np.array_equal(a.rank_of_sample, ref) and np.array_equal(a.loads, loads)
    # Values that cannot be packed fall back to the float path with the same answer.
    big = rng.integers(2**31, 2**40, size=200)
    assert _lpt_integer_core(big, 5) is None
    assert np.array_equal(lpt_balance(big, 5).rank_of_sample, _lpt_reference(big.astype(float), 5))


def test_lpt_integer_dtypes_and_lists_agree():
    rng = np.random.default_rng(12)
    w = rng.integers(1, 3000, size=5000)
    ref = lpt_balance(w.astype(float), 97)
    for arr in (w.astype(np.int32), w.astype(np.uint16), w.astype(np.uint64), w.tolist()):
        a = lpt_balance(arr, 97)
        assert np.array_equal(a.rank_of_sample, ref.rank_of_sample)
        assert a.loads.dtype == np.float64 and np.array_equal(a.loads, ref.loads)
    with pytest.raises(ValueError, match=r"workloads\[2\].*negative"):
        lpt_balance(np.array([3, 1, -1, 2] * 20), 4)


def test_lpt_scratch_is_per_thread():
    # The integer core keeps n-sized scratch per thread; concurrent calls must not share it.
    import threading

    rng = np.random.default_rng(13)
    inputs = [rng.integers(1, 5000, size=int(rng.integers(2000, 6000))) for _ in range(6)]
    expected = [lpt_balance(w, 61).rank_of_sample for w in inputs]
    results = {}

    def work(i):
        for _ in range(5):
            results[i] = lpt_balance(inputs[i], 61).rank_of_sample

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(expected):
        assert np.array_equal(results[i], e)


def test_nodewise_bounds_are_valid_and_tighter():
    from loom.balance.nodewise import (
        _nodewise_lower_bound,
        _nodewise_node_bound,
        _traffic_matrix,
    )

    rng = np.random.default_rng(14)
    improved = 0
    for d, c in [(4, 2), (6, 2), (6, 3), (8, 4)]:
        for _ in range(3):
            balanced, _, volumes = _nodewise_instance(rng, d, 4, c)
            source = rng.integers(0, d, volumes.size)
            exact = nodewise_brute_force(balanced, source, volumes, c)
            V = _traffic_matrix(source, balanced.rank_of_sample, volumes, d)
            per_rank = _nodewise_lower_bound(V, c)
            per_node = _nodewise_node_bound(V, c, deadline=float("inf"))
            assert per_rank <= exact + 1e-9 and per_node <= exact * (1 + 1e-9) + 1e-9
            plan = nodewise_rearrangement(balanced, source, volumes, c, time_limit=5.0)
            assert per_rank - 1e-9 <= plan.lower_bound <= exact + 1e-9
            assert plan.max_internode_send == pytest.approx(exact)
            improved += per_node > per_rank + 1e-9
    assert improved  # coupling a node's ranks beats the per-rank bound on some instances


def test_nodewise_milp_limit_leaves_room_for_overhead(monkeypatch):
    # The MILP's own time limit is what is left of time_limit after the heuristic and the bound,
    # less a reserve for HiGHS's setup and overrun: never the whole budget.
    import time

    import loom.balance.nodewise as orch

    rng = np.random.default_rng(15)
    balanced, _, volumes = _nodewise_instance(rng, 32, 8, 8)
    source = rng.integers(0, 32, volumes.size)
    seen = []
    real = orch._milp_nodes

    def spy(V, c, upper, limit):
        seen.append((time.perf_counter(), limit))
        return real(V, c, upper, limit)

    monkeypatch.setattr(orch, "_milp_nodes", spy)
    start = time.perf_counter()
    plan = nodewise_rearrangement(balanced, source, volumes, 8, time_limit=0.2)
    # (Skipped when the bound already proves the heuristic optimal, or no time is left.)
    for called, limit in seen:
        assert limit <= (start + 0.2 - called) - orch._MILP_OVERHEAD_S
    assert 0.0 <= plan.gap <= 1.0 and plan.lower_bound <= plan.max_internode_send + 1e-9


def test_padded_balance_real_valued_costs_equal_brute_force():
    """Real alpha, beta: the upper search bound max(w) * ceil(n/d) must stay feasible despite
    rounding in bound / w (it once failed on 3 * w / w = 2.999...), and the result is optimal."""
    import itertools
    import random

    assert sorted(map(sorted, padded_balance([94, 39, 91, 111, 104, 61], 2, alpha=1.0, beta=0.001).ranks)) == [
        [0, 3, 4], [1, 2, 5]]
    rng = random.Random(11)
    for _ in range(150):
        n, d = rng.randint(1, 7), rng.randint(1, 3)
        lengths = [rng.randint(1, 120) for _ in range(n)]
        a, b = rng.random() + 0.1, rng.random() * 0.01
        got = padded_balance(lengths, d, alpha=a, beta=b).max_load
        best = min(padded_loads(lengths, np.array(p), d, a, b).max() for p in itertools.product(range(d), repeat=n))
        assert got <= best * (1 + 1e-9), (lengths, d, a, b, got, best)


def test_quantised_lpt_within_its_stated_bound_of_brute_force():
    # coarse levels make the rounding matter; the bound of `quantised_lpt`'s docstring holds
    rng = np.random.default_rng(21)
    for levels in (4, 16, 2**16 - 1):
        for costs, d in small_instances(22, 25):
            costs = costs * rng.uniform(0.5, 1.5, costs.size)
            a = quantised_lpt(costs, d, levels=levels)
            assert_partition(a, costs.size, d)
            assert np.allclose(a.loads, packed_loads(costs, a.rank_of_sample, d))
            opt = brute_force_balance(costs.size, d, lambda r: packed_loads(costs, r, d))
            u = costs.max() / levels
            k = max(np.bincount(a.rank_of_sample, minlength=d).max(), np.bincount(opt.rank_of_sample, minlength=d).max())
            assert a.max_load <= (4 / 3 - 1 / (3 * d)) * (opt.max_load + k * u / 2) + k * u / 2 + 1e-9


def test_quantised_lpt_at_scale_is_within_graham_of_the_lower_bound():
    rng = np.random.default_rng(23)
    costs = rng.lognormal(0.0, 1.0, 2560 * 60)
    a = quantised_lpt(costs, 2560)
    assert_partition(a, costs.size, 2560)
    lower = max(costs.max(), costs.sum() / 2560)
    k = np.bincount(a.rank_of_sample, minlength=2560).max()
    assert a.max_load <= (4 / 3) * (lower + k * costs.max() / 65535)


@pytest.mark.parametrize("seed", range(4))
def test_padded_fast_within_tolerance_of_exact(seed):
    rng = np.random.default_rng(seed)
    for n, d in [(1, 3), (7, 3), (50, 8), (600, 37), (3000, 64)]:
        lengths = np.maximum(1, rng.lognormal(5.0, 1.0, n)).astype(np.int64)
        alpha, beta = float(rng.uniform(1, 5)), float(rng.uniform(0, 0.02))
        fast = padded_balance_fast(lengths, d, alpha, beta, tolerance=1e-3)
        assert_partition(fast, n, d)
        assert np.allclose(fast.loads, padded_loads(lengths, fast.rank_of_sample, d, alpha, beta))
        exact = padded_balance(lengths, d, alpha, beta)
        assert fast.max_load <= exact.max_load * (1 + 1e-3) + 1e-9
    lengths = np.array([5, 5, 5, 1], dtype=np.int64)  # small: brute force
    fast = padded_balance_fast(lengths, 2, 1.0, 0.0)
    assert fast.max_load == brute_force_balance(4, 2, lambda r: padded_loads(lengths, r, 2)).max_load


@pytest.mark.parametrize("bad, match", [([1.0, float("nan")], "NaN or infinity"), ([float("inf"), 1.0], "NaN or infinity"),
                                        ([1.0, -float("inf")], "NaN or infinity"), ([2.0, -1.0], r"costs\[1\] = -1.0"),
                                        ([[1.0, 2.0]], "1-D")])
def test_quantised_lpt_names_bad_costs(bad, match):
    # the fast validation (max and min) hands every bad input to the full check's message
    with pytest.raises(ValueError, match=match):
        quantised_lpt(bad, 2)


@pytest.mark.parametrize("n, bound", [(0, 5), (1, 1), (1000, 3), (153_600, 2560), (70_000, 70_000), (5, 2**40)])
def test_stable_argsort_equals_numpy_stable(n, bound):
    from loom.balance.sorting import stable_argsort

    key = np.random.default_rng(n).integers(0, bound, size=n)  # the last cases take the fallback
    got = stable_argsort(key, bound)
    assert got.dtype == np.int64 and np.array_equal(got, np.argsort(key, kind="stable"))


def test_lpt_groups_are_each_ranks_items_sorted_when_every_batch_is_full():
    """`_lpt_integer_core`'s ``groups`` (every batch full: one item per rank per batch) is the
    stable argsort of its assignment, row per rank; the assignment itself is unchanged."""
    from loom.balance.lpt import _quantised_lpt

    rng = np.random.default_rng(3)
    seen = 0
    for n_per, d, spread in [(60, 256, 0.05), (7, 64, 0.02), (5, 64, 1.0), (3, 10, 0.0)]:
        costs = 1000.0 * (1.0 + spread * rng.random(n_per * d))
        groups: list = []
        a = _quantised_lpt(costs, d, groups=groups)
        assert np.array_equal(a.rank_of_sample, quantised_lpt(costs, d).rank_of_sample)
        if groups:
            seen += 1
            assert groups[0].shape == (d, n_per)
            assert np.array_equal(groups[0], np.argsort(a.rank_of_sample, kind="stable").reshape(d, n_per))
    assert seen >= 2  # near-equal costs fill every batch


@pytest.mark.parametrize("rounds", [1, 3])
def test_orchmllm_layout_from_lpt_groups_equals_the_sorted_one(rounds: int, monkeypatch):
    """The layout built from LPT's grouped bins (no sort of all positions) is the one built by
    sorting every sample's slot (`slot_arrays`), over one round and several."""
    import loom.balance.orchmllm as orch
    from loom.balance.costs import SampleCosts
    from loom.plan.plan import ModuleSpec, Plan

    dp = 32
    plan = Plan([ModuleSpec("vision", data_parallel=dp), ModuleSpec("llm", data_parallel=dp)],
                num_microbatches=dp * rounds).resolve({"vision": 4, "llm": 4})
    rng = np.random.default_rng(rounds)
    n = dp * rounds * 20
    vision = 1000.0 * (1.0 + 0.05 * rng.random(n))
    lengths = rng.integers(50, 400, n)
    costs = SampleCosts({"vision": vision, "llm": lengths * 1.0}, lengths, 1.0, 0.0)
    chosen = {"vision": "orchmllm", "llm": "orchmllm"}
    calls = []
    real = orch.balance_round

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(bool(args[6] if len(args) > 6 else kwargs.get("groups")))
        return out

    monkeypatch.setattr(orch, "balance_round", spy)
    grouped = orch.orchmllm_layout(plan, costs, chosen, "given", llm_padded=False)
    assert sum(calls) >= rounds  # the vision rounds took the grouped path
    monkeypatch.setattr(orch, "balance_round", lambda *a, **k: real(*a[:6]))  # no groups: sorted
    sorted_ = orch.orchmllm_layout(plan, costs, chosen, "given", llm_padded=False)
    for p in chosen:
        assert np.array_equal(grouped.arrays[p][0], sorted_.arrays[p][0]), p
        assert np.array_equal(grouped.arrays[p][1], sorted_.arrays[p][1]), p
    assert grouped.key() == sorted_.key()
