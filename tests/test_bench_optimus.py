"""benchmarks/optimus.py at a reduced configuration (GPT-175B + ViT-22B at LLM DP 2 x PP 8 x TP 8
on 128 GPUs, 8 microbatches per pipeline; one process, seconds): the result's shape, and that
``optimus_sim_ratio``'s two sides are the simulated Megatron-style interleaved first_stage plan
and the Optimus scheduler's own latency. No figure is asserted on time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import write_result
from benchmarks.optimus import FIGURES, REAL_RATIO_NOT_MEASURED, measure
from loom.cli.bench import benchmark_names
from loom.cost.analytic import AnalyticCostModel
from loom.cost.hardware import Cluster
from loom.planner.baselines import first_stage_plan
from loom.planner.optimus.model_planner import LLMParallel
from loom.planner.optimus.paper import paper_arch, paper_search, paper_workload
from loom.schedule.generators import build_schedule
from loom.sim.scenario import ParallelDegrees, Scenario
from loom.sim.simulator import simulate

SMALL = LLMParallel(data_parallel=2, pipeline_parallel=8, tensor_parallel=8)
MICROBATCHES = 8


@pytest.fixture(scope="module")
def measured():
    return measure(repeats=2, refine=2, virtual_stages=2, num_microbatches=MICROBATCHES, llm_plan=SMALL)


def test_result_shape(measured, tmp_path: Path):
    figures, config = measured
    assert set(figures) == set(FIGURES)
    for name, fig in figures.items():
        assert set(fig) == {"value", "unit", "better", "spread", "spread_is"}, name
    assert figures["optimus_schedule_s"]["better"] == "lower" and figures["optimus_schedule_s"]["spread_is"] == "min-max"
    lo, hi = figures["optimus_schedule_s"]["spread"]
    assert 0 < lo <= figures["optimus_schedule_s"]["value"] <= hi
    assert figures["bubble_fill_fraction"]["better"] == "higher"
    assert 0 < figures["bubble_fill_fraction"]["value"] <= 1
    assert figures["optimus_sim_ratio"]["better"] == "higher"
    # the real-run ratio is recorded as not measured, never as a number
    assert "optimus_real_ratio" not in figures and config["optimus_real_ratio"] == REAL_RATIO_NOT_MEASURED
    assert config["gpus"] == 128 and config["microbatches_per_pipeline"] == MICROBATCHES
    assert config["simulate_s"] > 0 and config["candidates"] > 0 and config["partitions"] > 0
    assert set(config["megatron"]) == {"first_stage_interleaved", "first_stage", "disaggregated"}
    assert config["megatron"]["disaggregated"]["placement"] == "disaggregated"
    assert config["megatron"]["first_stage"]["virtual_stages"] == 1
    path = write_result("optimus", figures, config, results_dir=tmp_path)
    assert json.loads(path.read_text())["figures"] == figures


def test_ratio_sides(measured):
    figures, config = measured
    sides = config["optimus_sim_ratio_sides"]
    # Optimus: the scheduler's own latency of its best schedule on the simulated LLM timeline
    run = paper_search(num_microbatches=MICROBATCHES, refine=2, llm_plan=SMALL)
    best = run.result.best
    assert sides["optimus_latency_s"] == pytest.approx(best.latency, abs=1e-4)
    assert best.latency >= run.timeline.end  # the LLM alone plus the encoder's shift, never less
    assert figures["bubble_fill_fraction"]["value"] == pytest.approx(best.bubble_fill_fraction, abs=1e-4)
    # Megatron: first_stage with interleaved 1F1B (2 chunks per position), simulated on the same workload
    arch, work = paper_arch(), paper_workload()
    cluster = Cluster("h100", 128)
    degrees = ParallelDegrees(tensor_parallel=8, data_parallel=2, microbatches_per_pipeline=MICROBATCHES,
                              virtual_stages=2, zero_stage=1, recompute="full")
    plan = first_stage_plan(Scenario("t", arch, cluster, degrees=degrees))
    assert plan.placement == "first_stage" and plan.spec("llm").virtual_stages == 2
    assert plan.spec("llm").num_stages == 16
    sim = simulate(build_schedule(plan), plan, AnalyticCostModel(arch, plan, cluster),
                   [dict(work) for _ in range(plan.num_microbatches)])
    assert sides["megatron_iteration_s"] == pytest.approx(sim.iteration_time, abs=1e-4)
    meg = config["megatron"]["first_stage_interleaved"]
    assert meg["iteration_s"] == sides["megatron_iteration_s"] and meg["virtual_stages"] == 2
    assert meg["bubble_fraction"] == pytest.approx(sim.bubble_fraction, abs=1e-4)
    assert meg["peak_memory_per_rank_gb"] == pytest.approx(max(sim.peak_memory.values()) / 1e9, abs=0.01)
    assert figures["optimus_sim_ratio"]["value"] == pytest.approx(sim.iteration_time / best.latency, abs=1e-3)


def test_listed_by_loom_bench():
    assert "optimus" in benchmark_names(Path(__file__).resolve().parent.parent)
