"""The simulator under balanced layouts (routed encoder-to-LLM edges, Entrain's split backward),
scenarios run under balancing policies, `loom simulate --policy`, and the skewed data mixes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loom.balance.policy import BalanceConfig, SampleCosts, make_layout
from loom.cli import main
from loom.cost.model_configs import load_model_arch
from loom.cost.hardware import Cluster
from loom.cost.model import Workload
from loom.cost.uniform import UniformCostModel
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.schedule import Action, ActionKind, Schedule, build_schedule, unit_cost_makespan
from loom.schedule.validate import validate_schedule
from loom.sim import peak_memory, simulate
from loom.sim.loads import max_over_mean
from loom.cost.workload import sample_work
from loom.sim.scenario import ParallelDegrees, Scenario
from loom.data.synthetic import MIXES, SKEWED_MIXES, SyntheticMetadata

from plans import multimodal

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


# ---- helpers -----------------------------------------------------------------------------
def skewed_costs(n: int, seed: int, phases=("vision", "audio", LLM)) -> SampleCosts:
    rng = np.random.default_rng(seed)
    work = {p: [float(x) for x in rng.lognormal(0.0, 1.0, n)] for p in phases}
    return SampleCosts(work, [int(100 * x) + 1 for x in work[LLM]], 1.0, 1.0)


def per_sample_tokens(n: int, seed: int, phases=("vision", "audio", LLM)) -> list[dict[str, Workload]]:
    """A per-sample workload table with distinct token counts (for part costs)."""
    rng = np.random.default_rng(seed + 100)
    return [{p: Workload.of_lengths([int(rng.integers(1, 50))]) for p in phases} for _ in range(n)]


def slot_work(layout, table) -> list[dict[str, Workload]]:
    """Per slot, per phase: the sum of its samples' workloads (packed)."""
    work = [{} for _ in range(layout.num_microbatches)]
    for phase, slots in layout.slots.items():
        for j, slot in enumerate(slots):
            w = Workload()
            for s in slot:
                w = w + table[s][phase]
            work[j][phase] = w
    return work


class LoggingTokenCost(UniformCostModel):
    """Forward costs the workload's tokens, backward twice that; transfers cost 0.01 per token and
    are logged as ``(module, stage, tokens)``."""

    def __init__(self, plan):
        super().__init__(plan)
        self.transfers: list[tuple[str, int, int]] = []

    def stage_time(self, module, stage, kind, work):
        return float(work.tokens) * (1.0 if kind == "forward" else 2.0)

    def transfer_time(self, src_unit, dst_unit, module, stage, work):
        self.transfers.append((module, stage, work.tokens))
        return 0.01 * work.tokens

    def activation_memory(self, module, stage, work):
        return float(work.tokens)

    def transient_memory(self, module, stage, work):
        return 1000.0 * work.tokens


def layouts(plan: Plan, n: int, seeds=range(6)):
    """Every policy's layout of a few skewed batches (skipping those a policy rejects)."""
    for seed in seeds:
        costs = skewed_costs(n, seed, tuple(plan.module_names))
        for policy in ("orchmllm", "disttrain", "entrain"):
            yield seed, policy, make_layout(BalanceConfig(policy), plan, costs)


# ---- the simulator plays routed and split schedules --------------------------------------
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_routed_and_deferred_schedules_play_like_the_validator(kind):
    """dp 2 everywhere, orchmllm (routed edges) and entrain (routed edges, deferral, split
    backward): no deadlock, and with unit costs the simulated time is the validator's play."""
    plan = multimodal(vision=2, audio=1, llm=2, microbatches=8, dp_enc=2, dp_llm=2, kind=kind)
    routed = split = 0
    for _, policy, layout in layouts(plan, 24):
        schedule = build_schedule(plan, layout=layout)
        validate_schedule(schedule)
        r = simulate(schedule, plan, UniformCostModel(plan, forward=1.0, backward=1.0))
        assert r.iteration_time == unit_cost_makespan(schedule)
        acts = [a for lst in schedule.actions.values() for a in lst]
        routed += any(a.peer_microbatch is not None and a.peer_microbatch != a.microbatch for a in acts)
        split += any(a.kind is B and a.samples is not None for a in acts)
    assert routed and split  # both features were exercised


def test_parts_cost_their_own_samples():
    """A split backward part costs its samples' backward, so the parts of a microbatch add up to
    one whole backward; a routed message carries only its part's tokens, so every sample's
    encoder output crosses the edge once forward and once backward."""
    plan = multimodal(vision=1, audio=0, llm=2, microbatches=8, dp_enc=2, dp_llm=2)
    n = 24
    table = per_sample_tokens(n, 0, ("vision", LLM))
    checked_split = False
    for _, policy, layout in layouts(plan, n):
        schedule = build_schedule(plan, layout=layout)
        work = slot_work(layout, table)
        cost = LoggingTokenCost(plan)
        r = simulate(schedule, plan, cost, work, sample_work=table)
        for module, stage in (("vision", 0), (LLM, 0), (LLM, 1)):
            for j in range(layout.num_microbatches):
                parts = [e.end_s - e.start_s for e in r.timeline
                         if e.kind == "backward" and (e.module, e.stage, e.microbatch) == (module, stage, j)]
                assert sum(parts) == pytest.approx(2.0 * work[j][module].tokens)
                checked_split |= len(parts) > 1
        crossing = sum(t for m, s, t in cost.transfers if m == "vision")
        assert crossing == 2 * sum(row["vision"].tokens for row in table)  # activations + gradients
        # without sample_work a routed part cannot be priced
        if not layout.is_identity():
            with pytest.raises(ValueError, match="sample_work"):
                simulate(schedule, plan, cost, work)
    assert checked_split


def test_split_backward_frees_activation_at_the_last_part():
    """Hand-built unit: F0 F1 B0[part 0] B1 B0[part 1]: the activation of microbatch 0 is held
    until its last part (never counted twice); each part's recompute set is its own samples'."""
    plan = Plan([ModuleSpec(LLM)], num_microbatches=2).resolve({LLM: 2})
    acts = [Action(F, LLM, 0, 0), Action(F, LLM, 0, 1), Action(B, LLM, 0, 0, samples=(0,)),
            Action(B, LLM, 0, 1), Action(B, LLM, 0, 0, samples=(1,))]
    schedule = Schedule("1f1b", 2, {0: acts})
    table = [{LLM: Workload(tokens=3)}, {LLM: Workload(tokens=5)}, {LLM: Workload(tokens=7)}]
    work = [{LLM: Workload(tokens=8)}, {LLM: Workload(tokens=7)}]  # mb0 = samples 0 and 1, mb1 = sample 2

    class NoTransient(LoggingTokenCost):
        def transient_memory(self, module, stage, work):
            return 0.0

    assert peak_memory(schedule, plan, NoTransient(plan), work, sample_work=table)[0] == 15.0
    # with the recompute working set: largest is during B1 (live 15 + 7000) or B0 part 1 (8 + 5000)
    assert peak_memory(schedule, plan, LoggingTokenCost(plan), work, sample_work=table)[0] == 15.0 + 7000.0
    r = simulate(schedule, plan, LoggingTokenCost(plan), work, sample_work=table)
    assert r.iteration_time == pytest.approx(8 + 7 + 2 * 3 + 2 * 7 + 2 * 5)


def test_fewer_layout_microbatches_than_the_plan():
    """Entrain's K_eff: one sample with most of the encoder work shrinks every replica's
    microbatch count; the schedule and the simulation follow the layout's count."""
    plan = multimodal(vision=1, audio=0, llm=2, microbatches=8, dp_enc=2, dp_llm=2)
    costs = skewed_costs(16, 3, ("vision", LLM))
    costs.work["vision"][5] = 1000.0
    layout = make_layout(BalanceConfig("entrain", min_gain=float("-inf")), plan, costs)
    assert layout.num_microbatches < plan.num_microbatches
    schedule = build_schedule(plan, layout=layout)
    table = per_sample_tokens(16, 3, ("vision", LLM))
    r = simulate(schedule, plan, LoggingTokenCost(plan), slot_work(layout, table), sample_work=table)
    assert r.num_microbatches == layout.num_microbatches and r.iteration_time > 0


# ---- scenarios under policies ------------------------------------------------------------
ARCH = load_model_arch("llama3-8b", {"vision": "vit-h-14"}, "mlp", ["vision.encoder"])


def small_scenario(mix: str = "caption", llm_batching: str = "packed") -> tuple[Scenario, Plan]:
    scenario = Scenario("t", ARCH, Cluster("H100", 16, 8), mix=mix, global_batch_size=64, llm_batching=llm_batching,
                        degrees=ParallelDegrees(tensor_parallel=2, data_parallel=2, microbatches_per_pipeline=4))
    plan = Plan([ModuleSpec("vision", data_parallel=2, tensor_parallel=2),
                 ModuleSpec(LLM, num_stages=2, data_parallel=2, tensor_parallel=2)], num_microbatches=8)
    return scenario, plan


def test_every_policy_keeps_every_token():
    """The simulated work per phase sums to the same tokens under every policy (no sample lost
    or duplicated), and the none policy is the plain run after the dispatch."""
    scenario, plan = small_scenario("multi_image")
    metas = scenario.metas()
    totals = {}
    for policy in ("none", "orchmllm", "disttrain", "entrain"):
        run = scenario.run_balanced(plan, policy, metas=metas)
        totals[policy] = {p: sum(w[p].tokens for w in run.work) for p in plan.module_names}
        assert run.result.num_microbatches == run.layout.num_microbatches
    expected = {p: sum(sample_work(ARCH, [m])[p].tokens for m in metas) for p in plan.module_names}
    assert all(t == expected for t in totals.values()), totals
    plain = scenario.run(plan).iteration_time
    assert scenario.run_balanced(plan, "none", metas=metas, dispatch=False).result.iteration_time == plain
    none = scenario.run_balanced(plan, "none", metas=metas).result
    assert none.dispatch > 0 and none.iteration_time == pytest.approx(plain + none.dispatch)


def test_balanced_runs_pay_the_dispatch():
    """`run_balanced` starts every step with the dispatcher's cost: the metadata all-gather,
    the policy's decision (modelled per sample, or as given) and the payload all-to-alls."""
    from loom.sim.dispatch import decision_seconds_model

    scenario, plan = small_scenario("multi_image")
    metas = scenario.metas()
    none = scenario.run_balanced(plan, "none", metas=metas).result.dispatch_parts
    orch = scenario.run_balanced(plan, "orchmllm", metas=metas).result.dispatch_parts
    assert none.decide == 0.0 and orch.decide == pytest.approx(decision_seconds_model("orchmllm", len(metas)))
    assert none.gather == orch.gather > 0  # the same metadata either way
    assert set(none.payload) == set(plan.module_names) and all(t > 0 for t in none.payload.values())
    # every image's pixels and every sample's ids leave their loader rank for each stage that needs them
    assert none.payload_bytes[LLM] > 0 and none.payload_bytes["vision"] > 0
    given = scenario.run_balanced(plan, "orchmllm", metas=metas, decision_seconds=0.25).result
    assert given.dispatch_parts.decide == 0.25
    assert given.iteration_time == pytest.approx(
        scenario.run_balanced(plan, "orchmllm", metas=metas, dispatch=False).result.iteration_time + given.dispatch)


@pytest.mark.parametrize("mix", ["caption", "multi_image"])
def test_orchmllm_lowers_imbalance_across_dp(mix):
    """Post-balancing evens the replicas out: the encoder (LPT) in any case, and the LLM too when
    it is padded, which is what OrchMLLM's binary search optimises."""
    for batching in ("packed", "padded"):
        scenario, plan = small_scenario(mix, batching)
        metas = scenario.metas()
        before = scenario.run_balanced(plan, "none", metas=metas).loads
        after = scenario.run_balanced(plan, "orchmllm", metas=metas).loads
        assert after.dp_ratio("vision") < before.dp_ratio("vision")
        if batching == "padded":
            assert after.dp_ratio(LLM) < before.dp_ratio(LLM)
            assert after.microbatch_ratio(LLM) < before.microbatch_ratio(LLM)


def test_max_over_mean():
    assert max_over_mean([1.0, 3.0]) == 1.5 and max_over_mean([]) == 1.0 and max_over_mean([0.0, 0.0]) == 1.0


# ---- loom simulate --policy --------------------------------------------------------------
SCENARIO = """
name = "tiny"
[model]
llm = "llama3-8b"
encoders = { vision = "vit-h-14" }
projector = "mlp"
freeze = ["vision.encoder"]
[cluster]
gpu = "H100"
num_gpus = 16
[data]
mix = "caption"
global_batch_size = 64
[parallel]
tensor_parallel = 2
data_parallel = 2
[plans.small]
num_microbatches = 8
[[plans.small.modules]]
name = "vision"
data_parallel = 2
tensor_parallel = 2
[[plans.small.modules]]
name = "llm"
num_stages = 2
data_parallel = 2
tensor_parallel = 2
"""


def test_cli_unknown_policy_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    assert main(["simulate", "--config", str(path), "--policy", "none,lpt", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--policy" in err and "'lpt'" in err
    for name in ("none", "orchmllm", "disttrain", "entrain"):
        assert name in err
    assert main(["simulate", "--config", str(path), "--policy", "orchmllm", "--order", "random",
                 "--out", str(tmp_path)]) == 2
    assert "--order" in capsys.readouterr().err


def test_cli_policies_json_and_table(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    out = str(tmp_path / "out")
    assert main(["simulate", "--config", str(path), "--policy", "orchmllm", "--policy", "entrain", "--json",
                 "--no-png", "--out", out]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in result["plans"]}
    assert list(rows) == ["none", "orchmllm", "entrain"] and result["policies"] == ["orchmllm", "entrain"]
    assert rows["none"]["vs_none"]["iteration_time"] == 0.0
    for r in rows.values():
        assert r["simulated"] and r["iteration_time_s"] > 0
        assert set(r["load_max_over_mean"]) == {"dp", "microbatch"}
        assert set(r["load_max_over_mean"]["dp"]) == {"vision", "llm"}
        assert all(v >= 1.0 for axis in r["load_max_over_mean"].values() for v in axis.values())
        assert set(r["vs_none"]) == {"iteration_time", "bubble_fraction", "load_max_over_mean"}
    assert main(["simulate", "--config", str(path), "--policy", "none,orchmllm", "--order", "disttrain",
                 "--no-png", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "orchmllm (disttrain order)" in text and "vs none" in text and "vision DP" in text and "llm mb" in text


# ---- skewed data mixes -------------------------------------------------------------------
AUDIO_ARCH = load_model_arch("llama3-8b", {"vision": "vit-h-14", "audio": "whisper-large"})


@pytest.mark.parametrize("mix", SKEWED_MIXES)
def test_skewed_mixes_are_skewed_and_deterministic(mix):
    assert mix in MIXES
    stream = SyntheticMetadata(mix, seed=7, patch_size=14)
    metas = [stream.meta(i) for i in range(400)]
    enc = np.array([sum(w.tokens for p, w in sample_work(AUDIO_ARCH, [m]).items() if p != LLM) for m in metas], float)
    llm = np.array([sample_work(AUDIO_ARCH, [m])[LLM].tokens for m in metas], float)
    assert enc.max() / enc.mean() > 2.0 and llm.max() / llm.mean() > 2.0
    assert enc.std() / enc.mean() > 0.4  # not one outlier: spread throughout
    again = SyntheticMetadata(mix, seed=7, patch_size=14)
    assert [again.meta(i) for i in range(400)] == metas
    other = SyntheticMetadata(mix, seed=8, patch_size=14)
    assert [other.meta(i) for i in range(400)] != metas


def test_dispatch_prices_the_all_to_all_with_and_without_nodewise_rearrangement():
    """With ``balance.ranks_per_node`` OrchMLLM permutes each round's bins so fewer payload bytes
    cross nodes; the simulated dispatch prices the exchange the step pays and, beside it, the
    same layout before the permutation (the plain orchmllm layout)."""
    from loom.balance.config import BalanceConfig

    scenario = Scenario("t", ARCH, Cluster("H100", 16, 4), mix="multi_image", global_batch_size=64,
                        degrees=ParallelDegrees(tensor_parallel=1, data_parallel=8))
    plan = Plan([ModuleSpec("vision", data_parallel=8), ModuleSpec(LLM, data_parallel=8)], num_microbatches=16)
    metas = scenario.metas()
    plain = scenario.run_balanced(plan, BalanceConfig("orchmllm"), metas=metas).result.dispatch_parts
    nodewise = scenario.run_balanced(plan, BalanceConfig("orchmllm", ranks_per_node=4), metas=metas).result
    parts = nodewise.dispatch_parts
    assert plain.unpermuted is None and parts.unpermuted is not None
    for phase in plan.module_names:
        assert parts.unpermuted["payload_s"][phase] == pytest.approx(plain.payload[phase])
        assert parts.payload[phase] <= parts.unpermuted["payload_s"][phase] + 1e-12
    assert sum(parts.payload.values()) < sum(plain.payload.values())  # fewer bytes cross the slow links
    assert nodewise.summary()["dispatch"]["without_nodewise"] == parts.unpermuted
