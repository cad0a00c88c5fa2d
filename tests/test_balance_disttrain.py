"""DistTrain reordering (disttrain.md §3.3-§3.5): exact oracles on small instances.

- Algorithm 2 (`balance_dp_groups`) against brute-force multiway partitioning.
- The O(p) GETINTERVAL recurrence against the Appendix A reference simulator.
- Algorithm 3 (`reorder_microbatches`) against the given order and the brute-force best order.
"""

from __future__ import annotations

import itertools
import random
import statistics

import numpy as np
import pytest

from loom.balance.disttrain import (
    _iteration_time,
    _simulate_reference,
    balance_dp_groups,
    chain_times,
    reorder_microbatches,
    reorder_microbatches_batched,
    simulate_1f1b,
)


# ---- helpers -----------------------------------------------------------------------------
def _max_load(workloads, groups):
    return max(sum(workloads[i] for i in g) for g in groups)


def _brute_force_partition(workloads, m, equal_counts):
    """Smallest achievable largest group load over all assignments (group 0 fixed for sample 0
    by symmetry)."""
    n = len(workloads)
    best = float("inf")
    for assign in itertools.product(range(m), repeat=n - 1):
        assign = (0,) + assign
        if equal_counts and any(assign.count(g) != n // m for g in range(m)):
            continue
        loads = [0.0] * m
        for i, g in enumerate(assign):
            loads[g] += workloads[i]
        best = min(best, max(loads))
    return best


def _assert_partition(groups, n, m):
    """Every sample exactly once: no drop, no duplicate."""
    assert len(groups) == m
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))
    assert all(g == sorted(g) for g in groups)


def _random_instance(rng, l, p, with_generator):
    enc = [rng.lognormvariate(0.0, 0.8) for _ in range(l)]
    gen = [0.5 * rng.lognormvariate(0.0, 0.8) for _ in range(l)] if with_generator else None
    return enc, gen


# ---- Algorithm 2: balance across DP groups ------------------------------------------------
def test_balance_paper_example_pairs_large_with_small():
    # Fig. 6/11: the two largest samples must not land on the same DP rank.
    groups = balance_dp_groups([4.0, 3.0, 2.0, 1.0], 2)
    assert groups == [[0, 3], [1, 2]]


def test_balance_descending_fixes_ascending_counterexample():
    # digest §3.3 defect 1: ascending greedy on {1, 1, 2}, m = 2 gives max 3; OPT is 2.
    groups = balance_dp_groups([1.0, 1.0, 2.0], 2)
    _assert_partition(groups, 3, 2)
    assert _max_load([1.0, 1.0, 2.0], groups) == 2.0


def test_balance_equal_counts_caps_group_size():
    # digest §3.3 defect 2: without the cap, {10}, {1, 1, 1, 1, 1}.
    w = [10.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert balance_dp_groups(w, 2) == [[0], [1, 2, 3, 4, 5]]
    groups = balance_dp_groups(w, 2, equal_counts=True)
    _assert_partition(groups, 6, 2)
    assert [len(g) for g in groups] == [3, 3]
    assert _max_load(w, groups) == 12.0  # optimal: 10 + 1 + 1 against 1 + 1 + 1


def test_balance_lpt_within_graham_bound_of_brute_force():
    """Unconstrained: Graham's proven LPT bound, max load <= (4/3 - 1/(3m)) OPT."""
    rng = random.Random(11)
    worst = 1.0
    for _ in range(300):
        m = rng.randint(2, 3)
        n = rng.randint(1, 8)
        w = [rng.choice([float(rng.randint(1, 9)), rng.lognormvariate(0, 1)]) for _ in range(n)]
        groups = balance_dp_groups(w, m)
        _assert_partition(groups, n, m)
        ratio = _max_load(w, groups) / _brute_force_partition(w, m, False)
        assert ratio <= 4 / 3 - 1 / (3 * m) + 1e-12
        worst = max(worst, ratio)
    print(f"LPT worst ratio to brute force: {worst:.3f}")


def test_balance_equal_counts_against_brute_force():
    """Equal counts: no bound is proven for capped LPT (digest §3.3), so 4/3 is asserted here as
    an empirical regression bound on these seeded instances (worst measured when written:
    1.106, over 300 instances with n <= 8, m <= 3)."""
    rng = random.Random(12)
    worst = 1.0
    for _ in range(300):
        m = rng.randint(2, 3)
        n = m * rng.randint(1, 8 // m)
        w = [rng.choice([float(rng.randint(1, 9)), rng.lognormvariate(0, 1)]) for _ in range(n)]
        groups = balance_dp_groups(w, m, equal_counts=True)
        _assert_partition(groups, n, m)
        assert {len(g) for g in groups} == {n // m}
        ratio = _max_load(w, groups) / _brute_force_partition(w, m, True)
        assert 1.0 - 1e-12 <= ratio <= 4 / 3
        worst = max(worst, ratio)
    print(f"capped LPT worst ratio to brute force: {worst:.3f}")


def test_balance_large_batch_counts_every_sample_once():
    rng = np.random.default_rng(0)
    w = rng.lognormal(0.0, 1.0, size=1920)
    for eq in (False, True):
        groups = balance_dp_groups(w, 16, equal_counts=eq)
        _assert_partition(groups, 1920, 16)
        if eq:
            assert {len(g) for g in groups} == {120}
        loads = [w[g].sum() for g in groups]
        assert max(loads) / (w.sum() / 16) < 1.01  # many small items: near-perfect balance


def test_balance_edge_cases_and_determinism():
    assert balance_dp_groups([], 3) == [[], [], []]
    assert balance_dp_groups([], 3, equal_counts=True) == [[], [], []]
    assert balance_dp_groups([5.0], 3) == [[0], [], []]
    # ties: lower index first, lower group first
    assert balance_dp_groups([1.0] * 4, 2) == [[0, 2], [1, 3]]
    w = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert balance_dp_groups(w, 3) == balance_dp_groups(tuple(w), 3) == balance_dp_groups(np.array(w), 3)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([1.0, -1.0], 2), {}, r"workloads\[1\].*non-negative"),
        (([1.0, float("nan")], 2), {}, r"workloads\[1\].*finite"),
        (([1.0, "x"], 2), {}, r"workloads\[1\].*not a number"),
        ((5, 2), {}, r"workloads must be a sequence"),
        (([1.0], 0), {}, r"num_groups must be a positive integer"),
        (([1.0], 2.0), {}, r"num_groups must be a positive integer"),
        (([1.0], True), {}, r"num_groups must be a positive integer"),
        (
            ([1.0] * 10, 4),
            {"equal_counts": True},
            r"equal_counts=True needs len\(workloads\) divisible by num_groups.*10 samples over 4 groups",
        ),
        (([1.0] * 3, 4), {"equal_counts": True}, r"equal_counts=False"),
    ],
)
def test_balance_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        balance_dp_groups(*args, **kwargs)


# ---- the 1F1B chain and its simulators -----------------------------------------------------
def test_reference_simulator_uniform_closed_form():
    # Uniform 1F1B: (l + p - 1) * (f + b) for equal stage times f, b.
    for p, l in [(2, 1), (4, 6), (4, 3), (8, 20)]:
        t = simulate_1f1b(range(l), [1.0] * l, 1.0, p)
        assert t == pytest.approx((l + p - 1) * 3.0)


def test_recurrence_matches_reference_simulator():
    """The O(p)-per-microbatch recurrence behind GETINTERVAL is exact: it equals the
    Appendix A event simulation on random chains and orders (warm-up clipped by l, generator
    stage, frozen encoder with zero backward)."""
    rng = random.Random(3)
    for _ in range(400):
        l, p = rng.randint(1, 12), rng.randint(2, 7)
        enc, gen = _random_instance(rng, l, p, with_generator=p >= 3 and rng.random() < 0.5)
        llm = [rng.uniform(0.2, 2.0) for _ in range(l)] if rng.random() < 0.5 else rng.uniform(0.2, 2.0)
        times = chain_times(
            enc,
            llm,
            p,
            generator_times=gen,
            backward_ratio=rng.choice([0.0, 1.0, 2.0, 3.0]),
        )
        order = list(range(l))
        rng.shuffle(order)
        assert _iteration_time(times, order) == pytest.approx(_simulate_reference(times, order), rel=1e-12)


def test_chain_layout():
    times = chain_times([1.0, 2.0], [0.5, 0.7], 4, generator_times=[3.0, 4.0], backward_ratio=2.0)
    assert times.depth == 4 and times.num_microbatches == 2
    assert times.forward == ((1.0, 2.0), (0.5, 0.7), (0.5, 0.7), (3.0, 4.0))
    assert times.backward[0] == (2.0, 4.0) and times.backward[-1] == (6.0, 8.0)


# ---- Algorithm 3: inter-microbatch reordering ----------------------------------------------
def _check_permutation(order, l):
    assert sorted(order) == list(range(l))  # no microbatch dropped or duplicated


def test_reorder_structure_of_algorithm_3():
    # never_worse=False returns Alg. 3's own order: smallest first, the p - 1 next smallest last.
    rng = random.Random(4)
    p, l = 4, 16
    enc = [rng.lognormvariate(0, 0.8) for _ in range(l)]
    order = reorder_microbatches(enc, 1.0, p, never_worse=False)
    _check_permutation(order, l)
    by_size = sorted(range(l), key=lambda j: enc[j])
    assert order[0] == by_size[0]
    assert set(order[-(p - 1) :]) == set(by_size[1:p])


@pytest.mark.parametrize(
    "p, l",
    [(2, 1), (2, 2), (4, 1), (4, 3), (4, 4), (4, 5), (4, 6), (8, 7), (8, 64), (3, 40)],
)
def test_reorder_is_a_permutation_for_all_shapes(p, l):
    rng = random.Random(p * 100 + l)
    for with_gen in (False, True):
        if with_gen and p < 3:
            continue
        enc, gen = _random_instance(rng, l, p, with_gen)
        for nw in (True, False):
            _check_permutation(
                reorder_microbatches(enc, 1.0, p, generator_times=gen, never_worse=nw),
                l,
            )


def test_reorder_never_worse_than_given_order():
    rng = random.Random(5)
    gains = []
    for _ in range(150):
        p, l = rng.randint(2, 8), rng.randint(1, 24)
        enc, gen = _random_instance(rng, l, p, with_generator=p >= 3 and rng.random() < 0.5)
        order = reorder_microbatches(enc, 1.0, p, generator_times=gen)
        _check_permutation(order, l)
        given = simulate_1f1b(range(l), enc, 1.0, p, generator_times=gen)
        ours = simulate_1f1b(order, enc, 1.0, p, generator_times=gen)
        assert ours <= given * (1 + 1e-12)
        gains.append(given / ours)
    assert statistics.mean(gains) > 1.0


def test_reorder_against_brute_force_optimum():
    """No bound is stated for Alg. 3 (disttrain.md §3.4), so this asserts only <= the given order
    and reports the mean ratio to the brute-force optimum. When written: Alg. 3 averaged about
    1.06 of the optimum (given order about 1.14); the digest's own check found 6.9% above the
    optimum at p = 4, l = 7."""
    rng = random.Random(6)
    ratios, given_ratios = [], []
    # l = 6 on the reference simulator itself; l = 7 (5040 orders) on the recurrence, which the
    # test above proves equal to it, to stay within the time budget.
    cases = [(4, 6, True)] * 6 + [(3, 6, False)] * 4 + [(4, 7, False)] * 3 + [(5, 7, True)] * 3
    for p, l, with_gen in cases:
        enc, gen = _random_instance(rng, l, p, with_gen)
        times = chain_times(enc, 1.0, p, generator_times=gen)
        objective = _simulate_reference if l <= 6 else _iteration_time
        best = min(objective(times, perm) for perm in itertools.permutations(range(l)))
        order = reorder_microbatches(enc, 1.0, p, generator_times=gen)
        ours = simulate_1f1b(order, enc, 1.0, p, generator_times=gen)
        given = simulate_1f1b(range(l), enc, 1.0, p, generator_times=gen)
        assert best * (1 - 1e-12) <= ours <= given * (1 + 1e-12)
        ratios.append(ours / best)
        given_ratios.append(given / best)
    print(
        f"Alg. 3 / optimum: mean {statistics.mean(ratios):.3f}, worst {max(ratios):.3f}; "
        f"given order / optimum: mean {statistics.mean(given_ratios):.3f}"
    )
    assert statistics.mean(ratios) < statistics.mean(given_ratios)


def test_reorder_uniform_microbatches_keep_time():
    order = reorder_microbatches([2.0] * 10, 1.0, 4)
    _check_permutation(order, 10)
    assert simulate_1f1b(order, [2.0] * 10, 1.0, 4) == simulate_1f1b(range(10), [2.0] * 10, 1.0, 4)


def test_reorder_deterministic_and_accepts_numpy():
    rng = np.random.default_rng(7)
    enc = rng.lognormal(0.0, 0.8, size=32)
    a = reorder_microbatches(enc, 1.0, 8)
    assert a == reorder_microbatches(list(enc), 1.0, 8) == reorder_microbatches(tuple(enc), 1.0, 8)


def test_reorder_64_microbatches_depth_8_places_each_microbatch_a_bounded_number_of_times(monkeypatch):
    # Work, not wall-clock, guards against an accidental re-simulation per GETINTERVAL call:
    # two candidate orders built and three scored is 5 placements per microbatch, each O(p).
    import loom.balance.disttrain as dt

    placed = []
    original = dt._OneFOneBRecurrence.place
    monkeypatch.setattr(dt._OneFOneBRecurrence, "place", lambda self, j: (placed.append(j), original(self, j))[1])
    monkeypatch.setattr(dt, "_simulate_reference", lambda *a: pytest.fail("reorder must not re-simulate"))
    rng = random.Random(8)
    enc = [rng.lognormvariate(0, 0.8) for _ in range(64)]
    order = reorder_microbatches(enc, 1.0, 8)
    assert sorted(order) == list(range(64))
    assert len(placed) <= 5 * 64


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([], 1.0, 4), {}, r"encoder_times is empty"),
        (([1.0, -2.0], 1.0, 4), {}, r"encoder_times\[1\].*non-negative"),
        (
            ([1.0, 2.0], [1.0], 4),
            {},
            r"llm_times has 1 entries but encoder_times has 2",
        ),
        (([1.0, 2.0], -1.0, 4), {}, r"llm_times\[0\].*non-negative"),
        (
            ([1.0, 2.0], 1.0, 1),
            {},
            r"pipeline_depth = 1 leaves no LLM stage.*pipeline_depth >= 2",
        ),
        (([1.0, 2.0], 1.0, 2), {"generator_times": [1.0, 1.0]}, r"pipeline_depth >= 3"),
        (([1.0, 2.0], 1.0, 0), {}, r"pipeline_depth must be a positive integer"),
        (([1.0, 2.0], 1.0, 4.0), {}, r"pipeline_depth must be a positive integer"),
        (
            ([1.0, 2.0], 1.0, 4),
            {"generator_times": [1.0]},
            r"generator_times has 1 entries",
        ),
        (([1.0, 2.0], 1.0, 4), {"backward_ratio": -1}, r"backward_ratio"),
        (
            ([1.0, 2.0], 1.0, 4),
            {"backward_ratio": "x"},
            r"backward_ratio must be a number",
        ),
    ],
)
def test_reorder_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        reorder_microbatches(*args, **kwargs)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 3], ["a", 1, 2]])
def test_simulate_bad_order(order):
    with pytest.raises(ValueError, match=r"order must be"):
        simulate_1f1b(order, [1.0, 1.0, 1.0], 1.0, 3)


# ---- Algorithm 3 for many groups at once --------------------------------------------------
@pytest.mark.parametrize("ties", [False, True])
def test_batched_reorder_is_bit_identical_to_one_group_at_a_time(ties):
    """The lockstep version repeats the scalar recurrence's float operations in order, so it
    returns the very orders (and iteration times) `reorder_microbatches` returns per group,
    ties included (integer-valued times make equal keys and equal intervals common)."""
    rng = np.random.default_rng(11 + ties)
    for _ in range(60):
        g, l, p = int(rng.integers(1, 5)), int(rng.integers(1, 18)), int(rng.integers(2, 9))
        if ties:
            enc, llm = rng.integers(0, 4, (g, l)).astype(float), rng.integers(0, 3, (g, l)).astype(float)
        else:
            enc, llm = rng.lognormal(0, 0.8, (g, l)), rng.lognormal(0, 0.5, (g, l))
        for never_worse in (True, False):
            orders, times = reorder_microbatches_batched(enc, llm, p, never_worse=never_worse)
            for r in range(g):
                expected = reorder_microbatches(enc[r], llm[r], p, never_worse=never_worse)
                assert orders[r].tolist() == expected
                assert times[r] == _iteration_time(chain_times(enc[r], llm[r], p), expected)


def test_pools_pick_the_same_member_when_distances_round_alike():
    """SELECTCLOSEST is the smallest *computed* distance |key - target|, ties to the smaller key
    then the lower index, in the scalar pool and the lockstep one alike; far from the target
    distinct keys can round to one distance (4 - 1 and 4 - (1 + 2**-52) are both 3.0)."""
    from loom.balance.disttrain import _BatchedPool, _SortedPool

    tiny = 2.0**-52
    cases = [([1.0, 1.0 + tiny, 2.5], 4.0), ([1.0, 1.0 + tiny, 1.0 + tiny, 7.0], 4.0), ([0.5, 1.5], 1.0),
             ([2.0, 2.0, 3.0], 2.5), ([1.0 + tiny, 1.0, 1.0 + 2 * tiny], 1e3), ([5.0, 6.0], 1.0)]
    rng = np.random.default_rng(3)
    for _ in range(200):
        keys = (rng.integers(0, 6, int(rng.integers(1, 9))) * rng.choice([1.0, tiny, 0.25])
                + rng.choice([0.0, 1.0, 1e3])).tolist()
        cases.append((keys, float(rng.choice([0.0, 1.0, 4.0, 1e3, 1e19])) + float(rng.integers(0, 4))))
    for keys, target in cases:
        members = list(range(len(keys)))
        scalar = _SortedPool(members, keys)
        lockstep = _BatchedPool(np.argsort(np.array(keys), kind="stable")[None, :], np.array([keys]))
        while len(scalar):
            assert lockstep.pop_closest(np.array([target])).tolist() == [scalar.pop_closest(target)], (keys, target)
    assert _SortedPool([0, 1, 2], [1.0, 1.0 + tiny, 2.5]).pop_closest(4.0) == 2  # 1.5 away, the others 3.0
    assert _SortedPool([0, 1], [1.0, 1.0 + tiny]).pop_closest(4.0) == 0  # both 3.0 away: the smaller


def test_batched_reorder_bad_input():
    with pytest.raises(ValueError, match=r"\(groups, microbatches\) arrays of one shape"):
        reorder_microbatches_batched(np.ones((2, 3)), np.ones((2, 4)), 4)
    with pytest.raises(ValueError, match=r"pipeline_depth >= 2"):
        reorder_microbatches_batched(np.ones((2, 3)), np.ones((2, 3)), 1)
    with pytest.raises(ValueError, match=r"finite and non-negative"):
        reorder_microbatches_batched(-np.ones((2, 3)), np.ones((2, 3)), 4)


def test_policy_lockstep_lpt_is_balance_dp_groups_per_group():
    """The disttrain policy's microbatch LPT runs every group in lockstep; per group it must be
    `balance_dp_groups` itself (same order, same float sums), zero costs and ties included."""
    from loom.balance.disttrain_policy import (
        _by_group,
        _lockstep_lpt,
        _members_descending,
    )

    rng = np.random.default_rng(16)
    for trial in range(30):
        groups, k = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        group_of = np.concatenate([np.full(int(rng.integers(k, 3 * k + 1)), g) for g in range(groups)])
        rng.shuffle(group_of)
        cost = rng.integers(0, 4, group_of.size).astype(float) if trial % 2 else rng.lognormal(0, 1, group_of.size)
        sizes = np.bincount(group_of, minlength=groups)
        members = _members_descending(_by_group(group_of, sizes), cost, sizes)
        for g in range(groups):  # each row: the group's positions by cost descending, then position
            mine = np.flatnonzero(group_of == g)
            assert members[g].tolist() == sorted(mine.tolist(), key=lambda i: (-cost[i], i)) + [-1] * (
                members.shape[1] - mine.size)
        mb_of = _lockstep_lpt(members, cost, k)
        for g in range(groups):
            mine = np.flatnonzero(group_of == g)
            expected = balance_dp_groups(cost[mine].tolist(), k)
            got = [sorted(np.flatnonzero(mb_of[mine] == b).tolist()) for b in range(k)]
            assert got == expected
