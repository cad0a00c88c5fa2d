"""Failure traces and ``loom simulate --failures`` (oobleck.md §4.2, §6.2): the trace format and
generator, the hand-checkable accounting of Oobleck and restart-from-checkpoint, and the whole
path on a tiny scenario."""

from __future__ import annotations

import json
import math

import pytest

from loom.cli import main
from loom.planner.oobleck_failures import FailurePricer, FailureSettings, simulate_failures
from loom.sim.failures import (
    FailureEvent, FailureTrace, PhaseRun, TraceError, generate_trace, play_oobleck, play_restart, read_trace,
)
from loom.sim.scenario import load_scenario

TINY = """
name = "tiny-oobleck"
[model]
llm = "llama32-1b"
[cluster]
gpu = "A40"
num_gpus = 6
gpus_per_node = 1
[data]
global_batch_size = 24
[data.kinds.text]
text_median = 254
text_sigma = 0.0
text_range = [254, 254]
"""


# ---- trace format and generator ---------------------------------------------------------------
def test_trace_round_trip_and_csv(tmp_path):
    trace = FailureTrace(4, 100.0, (FailureEvent(10.0, (2,)), FailureEvent(30.0, (0, 3))))
    trace.to_json(tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json") == trace
    (tmp_path / "t.csv").write_text("time_s,node\n10,2\n30,0\n30,3\n")
    assert read_trace(tmp_path / "t.csv", num_nodes=4, duration_s=100.0) == trace
    assert trace.phases() == [(0.0, 10.0, (0, 1, 2, 3)), (10.0, 30.0, (0, 1, 3)), (30.0, 100.0, (1,))]


def test_bad_traces_name_the_file_and_event(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_nodes": 4, "duration_s": 50, "events": [{"time_s": 5, "nodes": [1]},
                                                                            {"time_s": 9, "nodes": [1]}]}))
    with pytest.raises(TraceError, match=r"bad\.json.*events\[1\] loses node 1 again"):
        read_trace(bad)
    bad.write_text(json.dumps({"num_nodes": 4, "events": [{"time_s": 5, "nodes": [7]}]}))
    with pytest.raises(TraceError, match=r"names node 7; nodes are 0 \.\. 3"):
        read_trace(bad)
    with pytest.raises(TraceError, match="num_nodes = 4 but the cluster has 6"):
        read_trace(bad, num_nodes=6)


def test_generated_traces_lose_one_node_at_a_time_until_half():
    trace = generate_trace(30, 600.0, seed=3)
    assert len(trace.events) == 15 and all(len(e.nodes) == 1 for e in trace.events)
    assert len({e.nodes[0] for e in trace.events}) == 15
    assert trace.duration_s > trace.events[-1].time_s
    assert generate_trace(30, 600.0, seed=3) == trace and generate_trace(30, 600.0, seed=4) != trace
    fixed = generate_trace(8, 100.0, exponential=False)
    assert [e.time_s for e in fixed.events] == [100.0, 200.0, 300.0, 400.0] and fixed.duration_s == 500.0


# ---- accounting (hand-checked) ----------------------------------------------------------------
def test_accounting_of_one_failure():
    # 100 s at 10 s a step, a failure, then 100 s at 12.5 s a step after 5 s of recovery
    oobleck = play_oobleck([PhaseRun(0, 100, 4, 10.0, 0.0), PhaseRun(100, 200, 3, 12.5, 5.0)], 8)
    assert (oobleck.steps, oobleck.lost_steps) == (10 + 7, 0)  # floor(95 / 12.5) = 7; 100 / 10 loses nothing
    assert oobleck.samples_per_s == pytest.approx(17 * 8 / 200) and oobleck.fraction_of_failure_free == 0.85
    # restart: 3 steps + a 2 s checkpoint = 32 s cycles; 110 s hold 3 cycles (9 steps) and 1 step that the
    # failure loses; 20 s of restart, then 80 s at 12 s a step: 2 cycles of 38 s and no room for another step
    restart = play_restart([PhaseRun(0, 110, 4, 10.0, 0.0), PhaseRun(110, 210, 3, 12.0, 20.0)], 8, 3, 2.0)
    assert (restart.steps, restart.lost_steps) == (9 + 6, 1)


def test_no_failures_runs_at_the_failure_free_rate():
    oobleck = play_oobleck([PhaseRun(0, 1000, 4, 10.0, 0.0)], 8)
    assert oobleck.fraction_of_failure_free == 1.0
    restart = play_restart([PhaseRun(0, 1000, 4, 10.0, 0.0)], 8, 10, 25.0)  # 125 s cycles: 8 of them
    assert restart.steps == 80 and restart.fraction_of_failure_free == pytest.approx(0.8)


# ---- the whole path on a tiny scenario ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("oobleck") / "tiny.toml"
    path.write_text(TINY)
    scenario = load_scenario(path)
    settings = FailureSettings(fault_tolerance=1, microbatch_size=2, min_nodes=2)
    return path, scenario, FailurePricer(scenario, settings)


def test_simulated_failure_trace_on_a_tiny_scenario(tiny):
    _, scenario, pricer = tiny
    assert pricer.spec.template_sizes == (2, 3, 4)
    quiet = simulate_failures(scenario, FailureTrace(6, 3600.0, ()), pricer.settings, pricer)
    step = quiet.oobleck.phases[0].step_s
    assert quiet.oobleck.steps == math.floor(3600.0 / step + 1e-9)
    trace = FailureTrace(6, 3600.0, (FailureEvent(1000.0, (5,)),))
    report = simulate_failures(scenario, trace, pricer.settings, pricer)
    first, second = report.oobleck.phases
    assert first.step_s == step and second.step_s >= step and second.recovery_s >= pricer.settings.reconfigure_s
    assert report.oobleck.steps == (math.floor(1000.0 / step + 1e-9)
                                    + math.floor((2600.0 - second.recovery_s) / second.step_s + 1e-9))
    # restart: one grid at 6 and at 5 nodes (the fastest whole copies of one template), a checkpoint every 10
    restart_step = report.restart.phases[0].step_s
    cycle = 10 * restart_step + report.checkpoint_s
    kept = 10 * math.floor(1000.0 / cycle + 1e-9)
    after = 2600.0 - report.restart_s
    step2 = report.restart.phases[1].step_s
    cycle2 = 10 * step2 + report.checkpoint_s
    cycles = math.floor(after / cycle2 + 1e-9)
    tail = min(10, math.floor((after - cycles * cycle2) / step2 + 1e-9))
    assert report.restart.steps == kept + 10 * cycles + tail
    # this model is small for its batch: the gradient sync across f + 1 = 2 pipelines costs more than it
    # saves, so the restart grid (one 4-node pipeline) runs faster than Oobleck's two, failure or not
    assert report.restart.phases[0].step_s < first.step_s and report.ratio < 1.0
    assert sum(int(x) for x in report.layouts[1].split("+")) == 5


def test_cli_plays_a_trace(tiny, tmp_path, capsys):
    path, _, _ = tiny
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,node\n600,1\n1200,4\n")
    assert main(["simulate", "--config", str(path), "--failures", str(trace), "--min-nodes", "2", "--json",
                 "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] and out["failures"] == 2 and out["oobleck"]["steps"] > 0
    assert main(["simulate", "--config", str(path), "--failure-interval", "600", "--fault-tolerance", "3",
                 "--min-nodes", "2", "--out", str(tmp_path)]) == 2
    assert "fault_tolerance f = 3 needs (f + 1) x n0 = 4 x 2 = 8 nodes" in capsys.readouterr().err
