"""benchmarks/optimus.py at a reduced configuration (GPT-175B + ViT-22B at LLM DP 2 x PP 8 x TP 8
on 128 GPUs, 8 microbatches per pipeline; one process, seconds): the result's shape, and that
``optimus_sim_ratio``'s two sides are the simulated Megatron-style interleaved first_stage plan
and the Optimus scheduler's own latency; the real run's ratios from given step times, its
configuration and its argument checks (no process is launched). No figure is asserted on time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import write_result
from benchmarks.optimus import (FIGURES, REAL_FIGURES, REAL_MEGATRON, REAL_NOT_RUN, REAL_OPTIMUS, RealConfig, main,
                                measure, real_ratio_figures)
from benchmarks.placements import BenchConfig, placement_figures, train_config
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
    # without the real run its ratios are recorded as not measured, never as numbers
    assert not set(REAL_FIGURES) & set(figures) and config["optimus_real"] == REAL_NOT_RUN
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
    # played: loom's Optimus plan (ViT whole on each TP-8 unit, colocated, no ZeRO), filled and simulated
    played = config["optimus_played"]
    assert played["encoder"] == {"dp": 16, "tp": 8} and played["iteration_s"] <= played["coarse_iteration_s"]
    assert figures["optimus_played_sim_ratio"]["value"] == pytest.approx(sim.iteration_time / played["iteration_s"],
                                                                         rel=1e-3)


def test_real_ratios_from_given_step_times():
    """first_stage's step-time sum over optimus's per repeat (the same batches), median and
    spread over the repeats; the simulated ratio from the median simulated steps."""
    names = [REAL_MEGATRON, REAL_OPTIMUS]
    repeats = {REAL_MEGATRON: [[0.3, 0.3], [0.5, 0.3], [0.2, 0.4], [0.3, 0.3]],
               REAL_OPTIMUS: [[0.2, 0.2], [0.4, 0.4], [0.3, 0.3], [0.1, 0.2]]}
    simulated = {REAL_MEGATRON: [0.21, 0.27, 0.24], REAL_OPTIMUS: [0.2, 0.1, 0.15]}
    figs = real_ratio_figures(placement_figures(names, repeats, simulated, global_batch=16, baseline=REAL_MEGATRON))
    assert set(figs) == set(REAL_FIGURES)
    real, sim = figs["optimus_real_ratio"], figs["optimus_real_sim_ratio"]
    # per repeat: 0.6/0.4 = 1.5, 0.8/0.8 = 1.0, 0.6/0.6 = 1.0, 0.6/0.3 = 2.0; median 1.25, min-max under 5 repeats
    assert real["value"] == pytest.approx(1.25) and real["spread"] == [1.0, 2.0] and real["spread_is"] == "min-max"
    assert real["better"] == "higher" and "first_stage over optimus" in real["unit"]
    assert sim["value"] == pytest.approx(0.24 / 0.15) and sim["spread"] is None and sim["better"] == "higher"
    # the other direction would be the reciprocal: the numerator is first_stage
    flipped = placement_figures(names, repeats, simulated, global_batch=16, baseline=REAL_OPTIMUS)
    assert flipped[f"placement_sim_ratio_{REAL_OPTIMUS}_over_{REAL_MEGATRON}"]["value"] == pytest.approx(0.15 / 0.24)


def test_real_run_sides_are_megatrons_layout_and_the_filled_colocated_one():
    meg, opt = train_config(REAL_MEGATRON, 4).plan, train_config(REAL_OPTIMUS, 4, "/tmp/profile.json")
    assert (meg.placement, meg.bubble_fill, meg.schedule, meg.spec("llm").num_stages) == ("first_stage", "none", "1f1b", 2)
    assert (opt.plan.placement, opt.plan.bubble_fill, opt.plan.spec("vision").data_parallel) == ("colocated", "optimus", 2)
    assert opt.plan.spec("llm").num_stages == 2 and opt.run.profile == "/tmp/profile.json"
    # the pair runs as a placements benchmark with first_stage as the baseline: 2 steps a repeat
    cfg = BenchConfig(placements=f"{REAL_MEGATRON},{REAL_OPTIMUS}", baseline=REAL_MEGATRON).check()
    assert cfg.steps_per_repeat() == 2


@pytest.mark.parametrize("fields, match", [({"repeats": 2}, "--real-repeats 2: give 3 or more"),
                                           ({"warmup": 0}, "--real-warmup 0"),
                                           ({"profile_repeats": 0}, "--real-profile-repeats 0")])
def test_real_run_arguments_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        RealConfig(**fields).check()
    assert RealConfig().check().repeats >= 3


def test_cli_refuses_bad_real_repeats_and_unknown_figures(capsys):
    with pytest.raises(SystemExit):
        main(["--real-repeats", "1"])
    assert "--real-repeats 1: give 3 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--only", "optimus_real_ratio,nope"])
    assert "unknown figures ['nope']" in capsys.readouterr().err


def test_listed_by_loom_bench():
    assert "optimus" in benchmark_names(Path(__file__).resolve().parent.parent)
