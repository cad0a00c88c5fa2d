"""Optimus's bubble scheduler at optimus.md §4.6's configuration (issue 10's acceptance): its
speed, how much of the LLM's bubbles it fills, and its iteration time against Megatron-LM's
layout, on loom's analytic model; and a real CPU run of Optimus's filled colocated schedule
against Megatron-LM's layout on a small model, with the simulator's prediction beside it.

    python -m benchmarks.optimus [--repeats 3] [--refine 8] [--real-repeats 9] [--no-real]
                                 [--only optimus_schedule_s,...]

The configuration (`loom.planner.optimus.paper`): ViT-22B + GPT-175B on 3072 H100, the LLM at
PP 8 x TP 8 x DP 48, 32 microbatches of 2 per pipeline, sequence 2048, full recompute, ZeRO-1.

Figures:
- ``optimus_schedule_s`` (lower is better; target at most 3 s, the paper reports minutes): CPU
  seconds (`time.process_time`, so the shared machine's load matters less) of the bubble
  scheduler, the model planner plus the search over every encoder plan and partition with its
  stage pricing (`PaperRun.plan_s + schedule_s`), with the fine step on each plan's ``refine``
  best coarse partitions (optimus.md §3.2 Algorithm 2; ``--refine 0``: coarse only), at kernel
  granularity (`loom.planner.optimus.fine`: the simulated LLM timeline and the encoder stages
  cut into kernels by `loom.cost.kernels`, so encoder kernels may fill the TP bubbles inside
  the LLM's layers, §1.2, §3.5). Median over the repeats, spread min-max. ``simulate_s`` in the config is the CPU time of simulating
  the LLM's timeline, the scheduler's input (the offline profile's stand-in), not part of it.
- ``bubble_fill_fraction`` (higher is better): the share of the LLM's bubble GPU-time that the
  best schedule's encoder work fills (`BubbleSchedule.bubble_fill_fraction`). At kernel
  granularity the bubbles include the TP bubbles (the compute stream idle during the LLM's TP
  collectives); the config gives the TP bubbles' time and how much of it encoder kernels fill
  (``tp_bubbles``), and the layer-granularity search's best beside it (``optimus_layer_best``:
  there the TP collectives count as LLM work).
- ``optimus_sim_ratio`` (higher is better): Megatron's iteration time over Optimus's. The
  Megatron side is simulated: the ``first_stage`` placement (ViT-22B inside the LLM's first
  pipeline position at its TP 8 and DP 48) with interleaved 1F1B at ``--virtual-stages`` (2 by
  default: the paper's own interleaved example, optimus.md §2.5, has 2 chunks per device; 96
  layers over 8 x 2 chunks and 32 microbatches, a multiple of PP 8, satisfy Megatron's
  constraints, §3.11). The Optimus side is NOT simulated: it is the scheduler's own latency,
  the best schedule's rigid shift of the simulated LLM timeline plus the encoder work it
  places (`BubbleSchedule.latency`, `loom.planner.optimus.coarse`); this figure does not play
  the paper-scale plan through the IR transform (`loom.sim.bubble_fill`, which the real part
  below does run). Its LLM timeline is plain 1F1B (the scheduler reads no interleaved timeline yet).
- ``optimus_played_sim_ratio`` (higher is better): the same Megatron side over loom's own
  Optimus at that configuration, played by the simulator: the ``--compare`` plan
  (`loom.planner.baselines.optimus_plan`: ViT-22B whole on each of the LLM's 384 TP-8 units,
  ``colocated``, GPT-175B at PP 8 x TP 8 x DP 48, no ZeRO since the colocated runtime runs none),
  its 1F1B schedule filled by `loom.sim.bubble_fill` and simulated, as ``loom simulate`` prices
  it. Its peak memory per rank is in the config (without ZeRO it exceeds 80 GB).

The real part (``--no-real`` skips it), on `benchmarks.placements`'s machinery: its
``first_stage`` placement (vision inside the LLM's first pipeline stage, plain 1F1B over 2
stages: Megatron-LM's layout) against its ``optimus`` one (vision at DP 2 colocated with the
2-stage LLM, ``plan.bubble_fill = "optimus"``: each iteration's schedule filled by
`loom.sim.bubble_fill` inside ``loom train``'s engine, timed by a fresh ``loom profile`` given as
``run.profile``). The model is the demo's sizes without audio (``benchmarks/placements.toml``:
a vision encoder and a 4-layer Llama; it has no audio encoder, so one encoder is filled), the
demo data, global batch 16 in 4 microbatches, policy ``none``. Each side is a group of 2 gloo
processes with one thread each on this 2-core machine (a bubble is real idle time), built by
`loom.train.rank.build_rank` and stepped by `RankRun.step`; both train the same global batch at
step ``i``, taking turns step by step (alternating), ``--real-warmup`` untimed steps then
``--real-repeats`` repeats of 2 steps each; their first losses must agree.

- ``optimus_real_ratio`` (higher is better: above 1, Optimus is faster): per repeat,
  first_stage's step-time sum over optimus's on the same global batches; median over the
  repeats, spread IQR (5 or more repeats) or min-max.
- ``optimus_real_sim_ratio`` (higher): the simulator's prediction of that ratio: its median
  simulated step of first_stage over optimus's, on the same steps' batches, each side playing
  the schedule its engine ran (the fill applied as the engine applies it), the profile's costs,
  the dispatch priced and the 2 ranks sharing the cores (`benchmarks.placements.predict_step`).

The config's ``optimus_real`` holds both sides' resolved plans, overrides and the compute order
of the schedule each ran (first timed step), whether the fill changed the colocated schedule
(``fill_changed_schedule``), the profile (how it was taken, on what), the repeats, the per-step
times and the placements benchmark's figures for the pair. Where the critical rank (the LLM's
first stage, which also runs a vision replica) has no idle gap a whole vision block fits in,
the fill leaves the colocated schedule as it was and the ratio measures the colocation (vision
at DP 2 beside the LLM's stages) against first_stage; ``fill_changed_schedule`` says which.
Writes ``benchmarks/results/optimus.json`` (not with ``--only`` or ``--no-real``).
"""

from __future__ import annotations

import argparse
import bisect
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import figure, format_table, machine_info, median, start_run, summarize, write_result
from loom.cost.analytic import AnalyticCostModel
from loom.cost.hardware import Cluster
from loom.planner.baselines import first_stage_plan, megatron_plan, optimus_plan
from loom.planner.optimus.model_planner import LLMParallel, encoder_stage_times
from loom.planner.optimus.paper import (
    LLM_PLAN,
    MICROBATCH_SIZE,
    NUM_MICROBATCHES,
    PaperRun,
    paper_arch,
    paper_search,
    paper_workload,
)
from loom.planner.optimus.search import optimus_search
from loom.schedule.generators import build_schedule
from loom.sim.bubble_fill import fill_bubbles
from loom.sim.scenario import ParallelDegrees, Scenario
from loom.sim.simulator import SimResult, simulate

FIGURES = ("optimus_schedule_s", "bubble_fill_fraction", "optimus_sim_ratio", "optimus_played_sim_ratio")
REAL_FIGURES = ("optimus_real_ratio", "optimus_real_sim_ratio")
TARGET_SCHEDULE_S = 3.0
MEMORY_LIMIT = 80e9  # H100 80 GB, as paper_search's planner prunes by
# the real run's two sides: benchmarks.placements placements, the first the ratios' numerator
REAL_MEGATRON, REAL_OPTIMUS = "first_stage", "optimus"
REAL_NOT_RUN = "not measured in this run (--no-real, or --only without it)"


@dataclass(frozen=True)
class RealConfig:
    """The real run's repeats (at least 3: a median with a spread), untimed warmup steps per
    side and ``loom profile`` repeats."""

    repeats: int = 9  # cheap beside the profile: 2 steps of ~0.25 s a repeat
    warmup: int = 2
    profile_repeats: int = 3

    def check(self) -> "RealConfig":
        if self.repeats < 3:
            raise ValueError(f"--real-repeats {self.repeats}: give 3 or more (a median with a spread; 5 or more "
                             f"for an IQR)")
        if self.warmup < 1:
            raise ValueError(f"--real-warmup {self.warmup}: give 1 or more (the first step builds the schedule caches)")
        if self.profile_repeats < 1:
            raise ValueError(f"--real-profile-repeats {self.profile_repeats}: give 1 or more")
        return self


@dataclass(frozen=True)
class BaselineRun:
    """One Megatron-style plan simulated on the paper's model, cluster and workload."""

    label: str
    placement: str
    virtual_stages: int
    llm_stages: int
    result: SimResult

    def summary(self) -> dict[str, Any]:
        peak = max(self.result.peak_memory.values())
        return {"placement": self.placement, "llm_pipeline_positions": self.llm_stages // self.virtual_stages,
                "virtual_stages": self.virtual_stages, "iteration_s": round(self.result.iteration_time, 4),
                "bubble_fraction": round(self.result.bubble_fraction, 4),
                "peak_memory_per_rank_gb": round(peak / 1e9, 2), "fits_80gb": peak <= MEMORY_LIMIT}


def scheduler_runs(repeats: int, refine: int, num_microbatches: int = NUM_MICROBATCHES,
                   llm_plan: LLMParallel = LLM_PLAN) -> list[PaperRun]:
    """``repeats`` fresh runs of `paper_search` (each simulates the LLM timeline, plans and searches)."""
    if repeats < 1:
        raise ValueError(f"repeats = {repeats}: give 1 or more (3 or more for a median with a spread)")
    return [paper_search(num_microbatches=num_microbatches, refine=refine, llm_plan=llm_plan) for _ in range(repeats)]


def tp_bubbles(run: PaperRun) -> dict[str, float]:
    """The LLM's TP bubble seconds over its stages (one rank each) and the encoder compute the
    best schedule places inside them."""
    best, total, filled = run.result.best, 0.0, 0.0
    for stage in run.timeline.stages:
        total += sum(hi - lo for lo, hi in stage.link)
    ends = [[hi for _, hi in stage.link] for stage in run.timeline.stages]
    for b in best.blocks:
        if b.comm:
            continue
        link = run.timeline.stages[b.llm_stage].link
        i = bisect.bisect_right(ends[b.llm_stage], b.start - best.shift)
        while i < len(link) and link[i][0] + best.shift < b.end:
            filled += max(0.0, min(b.end, link[i][1] + best.shift) - max(b.start, link[i][0] + best.shift))
            i += 1
    group = best.candidate.group_size  # a device is TP_enc ranks, as the bubble figure counts
    return {"tp_bubble_s": round(total * group, 4), "tp_bubble_filled_s": round(filled, 4),
            "tp_bubble_filled_fraction": round(filled / (total * group), 4) if total else 0.0}


def coarse_only(run: PaperRun, llm_plan: LLMParallel = LLM_PLAN) -> dict[str, Any]:
    """The coarse search's best schedule on ``run``'s own timeline and plans (context for a refined run)."""
    arch, work = paper_arch(), paper_workload()
    cluster = Cluster("h100", llm_plan.data_parallel * llm_plan.pipeline_parallel * llm_plan.tensor_parallel)
    best = optimus_search(run.planned, run.timeline,
                          lambda c: encoder_stage_times(arch, c, cluster, work, recompute="full", kernels=True)).best
    if best is None:
        raise RuntimeError("the coarse search found no schedule although the refined one did")
    return _rounded(best.summary())


def megatron_runs(virtual_stages: int, num_microbatches: int = NUM_MICROBATCHES,
                  llm_plan: LLMParallel = LLM_PLAN) -> dict[str, BaselineRun]:
    """The Megatron-style plans on the paper's model, cluster and workload (`paper_workload` for
    every microbatch), each simulated once: ``first_stage_interleaved`` (the ratio's side),
    ``first_stage`` (plain 1F1B) and ``disaggregated`` (the ViT as an extra first pipeline
    stage on ranks of its own, the LLM's layers over the rest, `megatron_plan`)."""
    arch, work = paper_arch(), paper_workload()
    gpus = llm_plan.data_parallel * llm_plan.pipeline_parallel * llm_plan.tensor_parallel
    cluster = Cluster("h100", gpus)
    out = {}
    for label, v, build in (("first_stage_interleaved", virtual_stages, first_stage_plan),
                            ("first_stage", 1, first_stage_plan), ("disaggregated", 1, megatron_plan)):
        # the degrees paper_search gives the LLM alone: same TP, DP, ZeRO, recompute, microbatches
        degrees = ParallelDegrees(tensor_parallel=llm_plan.tensor_parallel, data_parallel=llm_plan.data_parallel,
                                  microbatches_per_pipeline=num_microbatches, virtual_stages=v,
                                  zero_stage=1, recompute="full")
        plan = build(Scenario("optimus-paper", arch, cluster, degrees=degrees))
        sim = simulate(build_schedule(plan), plan, AnalyticCostModel(arch, plan, cluster),
                       [dict(work) for _ in range(plan.num_microbatches)])
        out[label] = BaselineRun(label, plan.placement, v, plan.spec("llm").num_stages, sim)
    return out


def played_optimus(num_microbatches: int = NUM_MICROBATCHES, llm_plan: LLMParallel = LLM_PLAN) -> dict[str, Any]:
    """loom's Optimus plan on the paper's model, cluster and workload (`optimus_plan`: the
    encoder whole on every LLM unit at its TP, no ZeRO, full recompute), its colocated 1F1B
    schedule filled by `fill_bubbles` and simulated: the module docstring's played side."""
    arch, work = paper_arch(), paper_workload()
    gpus = llm_plan.data_parallel * llm_plan.pipeline_parallel * llm_plan.tensor_parallel
    cluster = Cluster("h100", gpus)
    degrees = ParallelDegrees(tensor_parallel=llm_plan.tensor_parallel, data_parallel=llm_plan.data_parallel,
                              microbatches_per_pipeline=num_microbatches, zero_stage=0, recompute="full")
    plan = optimus_plan(Scenario("optimus-paper", arch, cluster, degrees=degrees))
    cost = AnalyticCostModel(arch, plan, cluster)
    works = [dict(work) for _ in range(plan.num_microbatches)]
    t0 = time.process_time()
    filled = fill_bubbles(build_schedule(plan), plan, cost, works)
    fill_s = time.process_time() - t0
    result = simulate(filled.schedule, plan, cost, works)
    peak = max(result.peak_memory.values())
    return {"iteration_s": result.iteration_time, "coarse_iteration_s": filled.coarse_s, "fill_rounds": filled.rounds,
            "blocks_moved": filled.moved, "fill_cpu_s": round(fill_s, 2),
            "encoder": {"dp": plan.spec("vision").data_parallel, "tp": plan.spec("vision").tensor_parallel},
            "peak_memory_per_rank_gb": round(peak / 1e9, 2), "fits_80gb": peak <= MEMORY_LIMIT}


def real_ratio_figures(placement_figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``optimus_real_ratio`` and ``optimus_real_sim_ratio`` from `benchmarks.placements`'
    figures of a run with ``first_stage`` as the baseline (its paired ratio over ``optimus``
    per repeat, and its simulated one), relabelled."""
    measured = placement_figures[f"placement_step_ratio_{REAL_MEGATRON}_over_{REAL_OPTIMUS}"]
    simulated = placement_figures[f"placement_sim_ratio_{REAL_MEGATRON}_over_{REAL_OPTIMUS}"]
    return {"optimus_real_ratio": {**measured, "unit": f"x ({REAL_MEGATRON} over {REAL_OPTIMUS}, measured)"},
            "optimus_real_sim_ratio": {**simulated, "unit": f"x ({REAL_MEGATRON} over {REAL_OPTIMUS}, simulated)"}}


def real_run(real: RealConfig, say: Any = print) -> tuple[dict[str, Any], dict[str, Any]]:
    """The real part of the module docstring: `benchmarks.placements.measure` on the pair, with
    first_stage as the baseline; returns its two figures and the config's ``optimus_real``."""
    from benchmarks import placements

    cfg = placements.BenchConfig(placements=f"{REAL_MEGATRON},{REAL_OPTIMUS}", baseline=REAL_MEGATRON,
                                 repeats=real.repeats, warmup=real.warmup,
                                 profile_repeats=real.profile_repeats).check()
    pfigs, pconfig = placements.measure(cfg, say)
    detail = pconfig.pop("placements_detail")
    sides = {"numerator": f"{REAL_MEGATRON}: {placements.PLACEMENTS[REAL_MEGATRON][0]} (Megatron-LM's layout, "
                          f"plain 1F1B)",
             "denominator": f"{REAL_OPTIMUS}: {placements.PLACEMENTS[REAL_OPTIMUS][0]} (plan.bubble_fill = 'optimus', "
                            f"timed by run.profile = the profile below)"}
    return real_ratio_figures(pfigs), {"sides": sides, **pconfig, "model": "the demo's sizes without audio "
                                       "(benchmarks/placements.toml): vision encoder + 4-layer Llama, no audio encoder",
                                       "sides_detail": detail, "placement_figures": pfigs}


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def measure(repeats: int = 3, refine: int = 8, virtual_stages: int = 2, num_microbatches: int = NUM_MICROBATCHES,
            llm_plan: LLMParallel = LLM_PLAN, only: frozenset[str] = frozenset(), real: RealConfig | None = None,
            say: Any = print) -> tuple[dict[str, Any], dict[str, Any]]:
    """The figures (all, or those in ``only``) and the config, at the given configuration; the
    real run's (`real_run`) only with ``real`` (None: not run, the config says so)."""
    wanted = set(only or FIGURES + REAL_FIGURES)
    runs = scheduler_runs(repeats, refine, num_microbatches, llm_plan)
    best = runs[0].result.best
    if best is None:
        raise RuntimeError("the Optimus search found no schedule within the memory limit at this configuration")
    # the search is deterministic: every repeat must pick the same schedule
    if any(r.result.best is None or r.result.best.summary() != best.summary() for r in runs[1:]):
        raise RuntimeError("paper_search chose different schedules on repeats of the same input")
    figures: dict[str, Any] = {}
    if "optimus_schedule_s" in wanted:
        figures["optimus_schedule_s"] = summarize([r.plan_s + r.schedule_s for r in runs], "s", "lower")
    if "bubble_fill_fraction" in wanted:
        figures["bubble_fill_fraction"] = figure(best.bubble_fill_fraction, "fraction", "higher")
    config: dict[str, Any] = {
        "model": "ViT-22B (optimus.md §4.2 Table 8) + GPT-175B, loom.planner.optimus.paper",
        "gpus": llm_plan.data_parallel * llm_plan.pipeline_parallel * llm_plan.tensor_parallel, "gpu": "h100",
        "llm_plan": {"dp": llm_plan.data_parallel, "pp": llm_plan.pipeline_parallel, "tp": llm_plan.tensor_parallel},
        "microbatches_per_pipeline": num_microbatches, "microbatch_size": MICROBATCH_SIZE,
        "recompute": "full", "zero_stage": 1, "memory_limit_gb": MEMORY_LIMIT / 1e9,
        "repeats": repeats, "refine": refine, "times": "CPU seconds (time.process_time), one process",
        "target_optimus_schedule_s": TARGET_SCHEDULE_S,
        "simulate_s": round(median([r.simulate_s for r in runs]), 4),
        "simulate_s_what": "CPU seconds simulating the LLM alone (1F1B) for the scheduler's timeline; not in optimus_schedule_s",
        "plan_s": round(median([r.plan_s for r in runs]), 4),
        "schedule_s": round(median([r.schedule_s for r in runs]), 4),
        "candidates": len(runs[0].planned.candidates),
        "partitions": sum(count for _, _, count in runs[0].result.per_candidate),
        "optimus_best": _rounded(best.summary()),
        "optimus_peak_memory_per_rank_gb": round(best.candidate.memory.total(max(best.partition)) / 1e9, 2),
        "optimus_memory_what": "loom's memory model on the planner's worst rank, the pipeline's largest part in flight",
        "optimus_real": REAL_NOT_RUN,
    }
    config["granularity"] = "kernel"
    config["tp_bubbles"] = tp_bubbles(runs[0])
    if refine:
        config["optimus_coarse_only_best"] = coarse_only(runs[0], llm_plan)
        layer_run = paper_search(num_microbatches=num_microbatches, refine=refine, llm_plan=llm_plan,
                                 granularity="layer")
        if layer_run.result.best is not None:
            config["optimus_layer_best"] = {**_rounded(layer_run.result.best.summary()),
                                            "schedule_s": round(layer_run.plan_s + layer_run.schedule_s, 4)}
    if wanted & {"optimus_sim_ratio", "optimus_played_sim_ratio"}:
        baselines = megatron_runs(virtual_stages, num_microbatches, llm_plan)
        megatron = baselines["first_stage_interleaved"]
        config["megatron"] = {label: b.summary() for label, b in baselines.items()}
    if "optimus_sim_ratio" in wanted:
        figures["optimus_sim_ratio"] = figure(megatron.result.iteration_time / best.latency, "x", "higher")
        config["optimus_sim_ratio_sides"] = {
            "numerator": f"simulated iteration time of Megatron-style first_stage placement, interleaved 1F1B with "
                         f"virtual_stages {virtual_stages} (loom.sim.simulator.simulate, AnalyticCostModel)",
            "denominator": "the Optimus scheduler's own latency of its best schedule (BubbleSchedule.latency): a rigid "
                           "shift of the simulated LLM timeline (1F1B) plus the encoder work it places; NOT a play of "
                           "an Optimus-filled schedule in the simulator (loom.sim.bubble_fill is not applied here)",
            "megatron_iteration_s": round(megatron.result.iteration_time, 4),
            "optimus_latency_s": round(best.latency, 4),
            "llm_alone_iteration_s": round(runs[0].timeline.end, 4),
        }
    if "optimus_played_sim_ratio" in wanted:
        played = played_optimus(num_microbatches, llm_plan)
        figures["optimus_played_sim_ratio"] = figure(megatron.result.iteration_time / played["iteration_s"], "x",
                                                     "higher")
        config["optimus_played"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in played.items()}
    if real is not None and wanted & set(REAL_FIGURES):
        real_figs, config["optimus_real"] = real_run(real.check(), say)
        figures.update({k: v for k, v in real_figs.items() if k in wanted})
    return figures, config


def main(argv: list[str] | None = None) -> None:
    start_run()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--refine", type=int, default=8, help="fine step on each plan's N best coarse partitions (0: coarse only)")
    ap.add_argument("--virtual-stages", type=int, default=2, help="the Megatron side's interleaving")
    ap.add_argument("--real-repeats", type=int, default=RealConfig.repeats,
                    help="the real run's repeats of 2 alternating steps (3 or more)")
    ap.add_argument("--real-warmup", type=int, default=RealConfig.warmup, help="the real run's untimed steps per side")
    ap.add_argument("--real-profile-repeats", type=int, default=RealConfig.profile_repeats,
                    help="`loom profile --repeats` of the real run's profile")
    ap.add_argument("--no-real", action="store_true", help="skip the real 2-process run (optimus_real_ratio, "
                    "optimus_real_sim_ratio); prints and writes no result file")
    ap.add_argument("--only", default="", help="comma-separated figure names to measure (prints them and "
                    "writes no result file, so a partial run never replaces the full one)")
    args = ap.parse_args(argv)
    only = frozenset(n for n in args.only.split(",") if n)
    if only - set(FIGURES + REAL_FIGURES):
        ap.error(f"--only names unknown figures {sorted(only - set(FIGURES + REAL_FIGURES))}; choose from "
                 f"{list(FIGURES + REAL_FIGURES)}")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: give 1 or more")
    real = None
    if not args.no_real:
        try:
            real = RealConfig(args.real_repeats, args.real_warmup, args.real_profile_repeats).check()
        except ValueError as e:
            ap.error(str(e))
    figures, config = measure(args.repeats, args.refine, args.virtual_stages, only=only, real=real)
    rows = [[name, f"{f['value']:.4g}", f["unit"], f["better"], "" if f["spread"] is None else
             f"{f['spread'][0]:.4g}-{f['spread'][1]:.4g}"] for name, f in figures.items()]
    print(format_table(["figure", "value", "unit", "better", "spread"], rows))
    print(f"simulate_s (LLM timeline, not in optimus_schedule_s): {config['simulate_s']}")
    print(f"optimus best: {config['optimus_best']}")
    print(f"TP bubbles: {config['tp_bubbles']}")
    if "optimus_layer_best" in config:
        print(f"optimus best at layer granularity: {config['optimus_layer_best']}")
    for label, b in config.get("megatron", {}).items():
        print(f"megatron {label}: {b}")
    if isinstance(config["optimus_real"], str):
        print(f"optimus_real_ratio: {config['optimus_real']}")
    else:
        for n, d in config["optimus_real"]["sides_detail"].items():
            print(f"real {n}: measured {d['measured_ms']} ms, simulated {d['simulated_ms']} ms"
                  + (f"; fill changed the colocated schedule: {d['fill_changed_schedule']}"
                     if "fill_changed_schedule" in d else ""))
        print(f"real run: {config['optimus_real']['wall_s']} s (profile {config['optimus_real']['profile_wall_s']} s)")
    if only or real is None:
        print(f"({'--only' if only else '--no-real'}: no result file written)")
        return
    path = write_result("optimus", figures, config, machine_info())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
