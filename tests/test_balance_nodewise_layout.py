"""OrchMLLM's node-wise rearrangement inside the policy (orchmllm.md §3.10): the permuted layout
is still a partition the schedule can route, it never moves more cross-node payload bytes than
the unpermuted one, strictly fewer on a constructed case; the payload rule agrees with the
runtime's loader shards and the simulator's payload function. No processes."""

from __future__ import annotations

import numpy as np
import pytest

from loom.balance.config import BalanceConfig, BalanceError
from loom.balance.costs import sample_costs
from loom.balance.padded import _bucket_runs
from loom.balance.payload import layout_payload_bytes, loader_rank_of, payload_matrix, sample_payload_bytes
from loom.balance.policy import make_layout
from loom.balance.rearrange import rearrange_round
from loom.cost.model_configs import load_model_arch
from loom.cost.workload import MetadataArrays
from loom.data.synthetic import SyntheticMetadata
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.runtime.dispatch import loader_shards
from loom.schedule.layout import round_size
from oracles import cross_node_send


@pytest.fixture(scope="module")
def arch():
    return load_model_arch("llama3-8b", {"vision": "vit-h-14"})


@pytest.fixture(scope="module")
def metas():
    data = SyntheticMetadata("caption", seed=3)
    return [data.meta(i) for i in range(512)]


def _plan(arch, vision_dp: int, llm_dp: int, llm_stages: int, m: int) -> Plan:
    plan = Plan([ModuleSpec("vision", data_parallel=vision_dp),
                 ModuleSpec(LLM, data_parallel=llm_dp, num_stages=llm_stages)], num_microbatches=m)
    return plan.resolve({name: arch.module(name).num_layers for name in arch.module_names})


def test_loader_rank_of_is_the_runtimes_loader_shards():
    for n, world in [(0, 3), (5, 8), (64, 16), (100, 7), (153, 10)]:
        want = np.empty(n, dtype=np.int64)
        for rank, shard in enumerate(loader_shards(n, world)):
            want[shard] = rank
        assert np.array_equal(loader_rank_of(n, world), want)


def test_payload_rule_follows_the_dispatcher(arch, metas):
    # the oracle: the dispatcher's rule, one sample and one stage at a time
    batch = metas[:48]
    plan = _plan(arch, 2, 2, 2, 4)
    mine = sample_payload_bytes(arch, MetadataArrays.from_metas(batch))
    assert np.array_equal(mine[LLM], [8.0 * m.text_tokens for m in batch])  # int64 ids
    assert np.array_equal(mine["vision"], [4.0 * sum(3 * i.height * i.width for i in m.images) for m in batch])
    layout = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0), plan, sample_costs(arch, batch))
    world = plan.world_size
    got = layout_payload_bytes(plan, layout, mine)
    for p in plan.module_names:
        spec = plan.spec(p)
        want = np.zeros((world, world))
        for src, shard in enumerate(loader_shards(len(batch), world)):
            for s in shard:
                j = layout.slot_index(p)[s]
                for stage in range(spec.num_stages):
                    want[src, plan.rank_of(p, stage, j % spec.data_parallel)] += mine[p][s]
        assert np.array_equal(got[p], want)


def _cross_total(plan, layout, costs, rpn, permuted=True) -> float:
    return sum(float(cross_node_send(plan, layout, p, costs.payload_bytes[p], rpn, permuted).sum())
               for p in plan.module_names)


@pytest.mark.parametrize("shape", [(8, 8, 1, 16, "given"), (4, 8, 1, 16, "given"), (8, 8, 2, 8, "given"),
                                   (8, 8, 1, 32, "disttrain")])
def test_permuted_layout_is_valid_and_never_moves_more_cross_node_bytes(arch, metas, shape):
    vision_dp, llm_dp, stages, m, order = shape
    plan = _plan(arch, vision_dp, llm_dp, stages, m)
    rpn = 4
    costs = sample_costs(arch, metas[:160])
    plain = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0, order=order), plan, costs)
    cfg = BalanceConfig(default="orchmllm", min_gain=-1.0, ranks_per_node=rpn, order=order)
    layout = make_layout(cfg, plan, costs)
    layout.check(costs.num_samples, plan.module_names)
    layout.check_routes(plan)
    assert set(layout.nodewise) == set(plan.module_names)
    # the permutation is recorded: undoing it gives the layout the policy makes without it
    r = round_size(plan)
    for p in plan.module_names:
        assert np.array_equal(layout.unpermuted_slot[p][layout.slot_index(p)], plain.slot_index(p))
        before, after = layout.nodewise[p]["cross_node_bytes"]
        assert after <= before
        assert before == pytest.approx(float(cross_node_send(plan, layout, p, costs.payload_bytes[p], rpn, False).sum()))
        assert after == pytest.approx(float(cross_node_send(plan, layout, p, costs.payload_bytes[p], rpn).sum()))
    # the permutation keeps each round's balance: every round's slowest slot is unchanged (the
    # predicted step may still move: bins pair up differently along a replica's pipeline)
    for p in plan.module_names:
        peaks = []
        for lay in (layout, plain):
            idx = lay.slot_index(p)
            if p == LLM:  # right-padded rows: count x the longest row's cost
                peak = np.zeros(m)
                np.maximum.at(peak, idx, costs.llm_padded_weight())
                slot_cost = np.bincount(idx, minlength=m) * peak
            else:
                slot_cost = np.bincount(idx, weights=costs.work[p], minlength=m)
            peaks.append(slot_cost.reshape(-1, r).max(axis=1))
        assert np.allclose(peaks[0], peaks[1])
    with_perm, without = _cross_total(plan, layout, costs, rpn), _cross_total(plan, layout, costs, rpn, False)
    assert with_perm <= without
    assert without == pytest.approx(_cross_total(plan, plain, costs, rpn))
    # the all-to-all matrices with and without the permutation carry the same bytes in all
    for p in plan.module_names:
        a = payload_matrix(plan, layout, p, costs.payload_bytes[p])
        b = payload_matrix(plan, layout, p, costs.payload_bytes[p], permuted=False)
        assert a.sum() == pytest.approx(b.sum())


def test_skewed_batch_moves_strictly_fewer_cross_node_bytes(arch, metas):
    plan = _plan(arch, 8, 8, 1, 16)
    costs = sample_costs(arch, metas[:256])
    layout = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0, ranks_per_node=4), plan, costs)
    assert _cross_total(plan, layout, costs, 4) < _cross_total(plan, layout, costs, 4, permuted=False)
    assert any(r["rounds_permuted"] for r in layout.nodewise.values())


def test_constructed_round_keeps_every_byte_on_node():
    # 4 slots on ranks 0..3 (2 nodes of 2); bin b's samples were all loaded by rank 3 - b, and the
    # policy placed bin b on slot b: every byte crosses a node. Reversed, none does.
    bins = np.repeat(np.arange(4), 3)
    src = 3 - bins
    size = np.full(12, 100.0)
    dest = np.arange(4).reshape(4, 1)
    got = rearrange_round(bins, np.arange(4), src, size, dest, ranks_per_node=2, time_limit=0.05)
    assert got.applied and got.cross_before == 1200.0 and got.cross_after == 0.0
    assert sorted(got.slot_of_bin.tolist()) == [0, 1, 2, 3]
    assert got.max_send_after == 0.0 < got.max_send_before
    # pipelined (2 destination ranks per slot, on different nodes): the exact assignment
    dest2 = np.stack([np.arange(4), 4 + np.arange(4)], axis=1)  # stage 1 on nodes 2 and 3
    got2 = rearrange_round(bins, np.arange(4), src, size, dest2, ranks_per_node=2, time_limit=0.05)
    assert got2.method == "assignment" and got2.cross_after == 1200.0 < got2.cross_before == 2400.0


def test_rearrangement_off_by_default_and_with_one_node(arch, metas):
    plan = _plan(arch, 4, 4, 1, 8)
    costs = sample_costs(arch, metas[:64])
    off = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0), plan, costs)
    assert off.nodewise == {} and off.unpermuted_slot == {}
    one_node = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0, ranks_per_node=plan.world_size), plan, costs)
    assert one_node == off  # nothing crosses a node: nothing to permute
    assert all(r["rounds_permuted"] == 0 for r in one_node.nodewise.values())


def test_nodewise_time_limit_is_checked():
    with pytest.raises(BalanceError, match="balance.nodewise_time_limit"):
        BalanceConfig(nodewise_time_limit=0).check()
    with pytest.raises(BalanceError, match="balance.nodewise_time_limit"):
        BalanceConfig(nodewise_time_limit=float("inf")).check()


def test_bucket_runs_equals_the_greedy_over_positions():
    rng = np.random.default_rng(5)
    for _ in range(200):
        lengths = np.sort(rng.integers(0, 40, rng.integers(1, 60)))[::-1]
        w = 2.0 * lengths + 0.01 * lengths * lengths
        bound = float(rng.uniform(1, 400))
        runs, pos = 0, 0
        while pos < lengths.size:  # the greedy, one run at a time
            runs += 1
            pos = lengths.size if w[pos] <= 0 else pos + max(int(bound // w[pos]), 1)
        values = np.unique(lengths)
        counts = np.bincount(np.searchsorted(values, lengths), minlength=values.size)[::-1]
        wv = (2.0 * values + 0.01 * values * values)[::-1]
        assert _bucket_runs(wv, np.cumsum(counts).tolist(), bound, 10**9) == runs


def test_from_gathered_reads_lists_and_padded_tables_alike():
    import dataclasses

    for mix in ("caption", "audio_heavy"):
        data = SyntheticMetadata(mix, seed=1)
        batch = [data.meta(i) for i in range(100)]
        flats = [MetadataArrays.from_metas(batch[i:i + 9]).to_flat() for i in range(0, 100, 9)]
        table = np.zeros((len(flats), max(map(len, flats)) + 2), dtype=np.int64)  # zero-padded rows
        for k, f in enumerate(flats):
            table[k, :len(f)] = f
        whole = MetadataArrays.from_metas(batch)
        for got in (MetadataArrays.from_gathered(flats), MetadataArrays.from_gathered(table)):
            for f in dataclasses.fields(MetadataArrays):
                assert np.array_equal(getattr(got, f.name), getattr(whole, f.name)), (mix, f.name)
    with pytest.raises(ValueError, match="shorter than their headers"):
        MetadataArrays.from_gathered([flats[0][:-1]])


def test_slot_destinations_are_the_plans_ranks():
    from loom.balance.payload import slot_destinations

    plan = Plan([ModuleSpec("vision", data_parallel=3, tensor_parallel=2),
                 ModuleSpec(LLM, data_parallel=2, num_stages=3, context_parallel=2)], num_microbatches=6)
    for p in plan.module_names:
        spec = plan.spec(p)
        want = [[plan.rank_of(p, st, j % spec.data_parallel) for st in range(spec.num_stages)] for j in range(6)]
        assert slot_destinations(plan, p, 6).tolist() == want


def test_large_rounds_take_the_greedy_placement_and_never_move_more(arch, metas):
    from loom.balance.rearrange import EXACT_MAX_SLOTS

    dp = 2 * EXACT_MAX_SLOTS
    plan = _plan(arch, dp, dp, 1, dp)
    costs = sample_costs(arch, [metas[i % len(metas)] for i in range(4 * dp)])
    layout = make_layout(BalanceConfig(default="orchmllm", min_gain=-1.0, ranks_per_node=8), plan, costs)
    layout.check(costs.num_samples, plan.module_names)
    layout.check_routes(plan)
    for p, rec in layout.nodewise.items():
        assert rec["method"] == ["greedy"]
        assert rec["cross_node_bytes"][1] < rec["cross_node_bytes"][0]
    assert _cross_total(plan, layout, costs, 8) < _cross_total(plan, layout, costs, 8, permuted=False)


def test_padded_fast_fills_every_rank_when_it_can():
    from loom.balance.assignment import padded_loads
    from loom.balance.padded import padded_balance, padded_balance_fast

    rng = np.random.default_rng(8)
    for n, d in [(3, 5), (10, 10), (64, 64), (100, 60), (3000, 64)]:
        lengths = rng.integers(1, 300, n)
        fast = padded_balance_fast(lengths, d, 1.5, 0.01)
        counts = np.bincount(fast.rank_of_sample, minlength=d)
        assert (counts == 0).sum() == max(d - n, 0)
        assert np.allclose(fast.loads, padded_loads(lengths, fast.rank_of_sample, d, 1.5, 0.01))
        assert fast.max_load <= padded_balance(lengths, d, 1.5, 0.01).max_load * (1 + 1e-3) + 1e-9
