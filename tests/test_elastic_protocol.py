"""The pure rules of elastic recovery (loom.elastic.protocol, loom.elastic.planning), no processes:
the commit decision, the copy plan of missing layers, the layer-wise sync groups, and the
generations after failures (oobleck.md §3.6-§3.9)."""

from __future__ import annotations

import itertools

import pytest

from loom.elastic.config import ElasticConfig
from loom.elastic.planning import first_generation, next_generation
from loom.elastic.protocol import copy_plan, decide, sync_groups
from loom.plan.plan import ModuleSpec, Plan


def test_commit_only_when_every_member_voted_ok():
    members = [0, 2, 3]
    assert decide(members, {0: "ok", 2: "ok", 3: "ok"}, dead=[]) == "commit"
    # a member that voted ok and then died still counts: the others commit
    assert decide(members, {0: "ok", 2: "ok", 3: "ok"}, dead=[2]) == "commit"
    assert decide(members, {0: "ok", 2: "abort"}, dead=[]) == "abort"
    assert decide(members, {0: "ok", 2: "ok"}, dead=[]) is None  # 3 alive and silent: wait
    assert decide(members, {0: "ok", 2: "ok"}, dead=[3]) == "abort"  # 3 can never vote


def test_decisions_agree_whenever_survivors_read():
    """Votes only appear (write-once) and a rank is declared dead only after it stopped writing:
    every reading a survivor can make along any order of events decides the same, or not yet."""
    members = [0, 1, 2]
    for final in itertools.product(["ok", "abort", None], repeat=3):  # None: died before voting
        votes_final = {m: v for m, v in zip(members, final) if v is not None}
        dead = [m for m, v in zip(members, final) if v is None]
        outcome = decide(members, votes_final, dead)
        assert outcome is not None
        for order in itertools.permutations(list(votes_final) + [("dead", d) for d in dead]):
            seen, gone = {}, []
            for ev in order:
                if isinstance(ev, tuple):
                    gone.append(ev[1])
                else:
                    seen[ev] = votes_final[ev]
                got = decide(members, seen, gone)
                assert got in (None, outcome), (final, order, got)


def test_copy_plan_takes_the_lowest_surviving_holder_and_refuses_a_lost_layer():
    haves = {0: ["a", "b"], 2: ["c"], 3: ["a", "b", "c"]}
    needs = {0: ["a", "b", "c"], 2: ["b", "c"], 3: ["a"]}
    assert copy_plan(needs, haves) == {(2, 0): ["c"], (0, 2): ["b"]}
    with pytest.raises(LookupError, match="d"):
        copy_plan({0: ["d"]}, haves)


def test_sync_groups_bucket_parameters_by_their_holders():
    # Fig. 2.9: a 3-stage and a 2-stage pipeline of 6 layers
    held = {0: ["l0", "l1"], 1: ["l2", "l3"], 2: ["l4", "l5"], 3: ["l0", "l1", "l2"], 4: ["l3", "l4", "l5"]}
    assert sync_groups(held) == {(0, 3): ["l0", "l1"], (1, 3): ["l2"], (1, 4): ["l3"], (2, 4): ["l4", "l5"]}


def _plan() -> Plan:
    return Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=2)], num_microbatches=4)


def test_generations_after_failures():
    el = ElasticConfig(nodes=6, f=1, min_nodes=2)
    g0 = first_generation(_plan(), ["vision"], 6, 12, el)
    assert g0.pipelines == [[0, 1, 2], [3, 4, 5]] and sum(g0.samples) == 12
    g1 = next_generation(g0, {1}, _plan(), ["vision"], 12, el)  # simple reinstantiation: 3 -> 2 nodes
    assert g1.pipelines == [[0, 2], [3, 4, 5]] and not g1.stop and sum(g1.samples) == 12
    assert [p.spec("llm").num_stages for p in g1.plans] == [2, 3]
    assert g1.shares(list(range(12))) == [list(range(g1.samples[0])), list(range(g1.samples[0], 12))]
    g2 = next_generation(g1, {1, 2}, _plan(), ["vision"], 12, el)  # borrow: [0] takes a node from [3, 4, 5]
    assert sorted(map(len, g2.pipelines)) == [2, 2] and not g2.stop
    g3 = next_generation(g1, {1, 3, 4}, _plan(), ["vision"], 12, el)  # 3 nodes: below (f + 1) * n0 = 4
    assert g3.stop and "f = 1 needs 2" in g3.stop and g3.members == [0, 2, 5]
