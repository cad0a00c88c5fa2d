"""Oobleck in loom (issue 14): how fast templates are planned, and what surviving failures
without a restart is worth (simulated).

    python -m benchmarks.elastic [--repeats 5] [--seeds 5] [--recovery-runs 2]

Figures:

- ``template_s_24x8_96``: seconds to plan the pipeline template of 24 nodes x 8 GPUs for a
  96-layer model (GPT-3 175B's blocks, plus its embedding and head; per-layer costs from the
  analytic cost model on A40s at every TP degree 1-8 that divides the heads), the paper's
  search with stages of any GPU count (``tensor_parallel = "mixed"``,
  `loom.planner.oobleck_templates.plan_templates`), median over ``--repeats`` (target 30 s;
  Table 2.3 of the dissertation reports 3,297.92 s for this cell; the costs are read once,
  before the timing). Also recorded: the same with every template size 2 .. 24 at once (the
  shared memo) and the uniform-TP templates loom executes.
- ``failure_throughput_ratio_6h``, ``_1h``, ``_10m`` (simulated): Oobleck's samples/s over
  restart-from-checkpoint's on GPT-3 6.7B, 30 A40 nodes of 1 GPU, global batch 1024 in
  microbatches of 2 (``configs/sim/oobleck-gpt3-6.7b-30xa40.toml``, the dissertation's §2.7
  setting), a node lost every 6 h, 1 h and 10 min on average until half remain (§2.7.2), f = 1,
  a checkpoint every 10 iterations (`loom.planner.oobleck_failures` for the restart cost and
  the other defaults); median and interquartile range over ``--seeds`` generated traces.
- ``recovery_s`` (measured, loom.elastic's runtime on this machine): seconds from a SIGKILL of a
  rank to the next step committed by the re-formed survivors (the interrupted step redone), on
  the path ``loom train`` takes with ``configs/elastic.toml`` (the demo model, 6 single-process
  nodes, f = 1): ``--recovery-runs`` launches, each killing a random rank at a random point of
  step 3 and another at step 7 (6 -> 5 -> 4 nodes; target 30 s). Recorded with it: its parts
  (kill to the death seen by the supervisor, to the next generation published, the generation's
  forming on the survivors) and the copied parameters.

The machine's load during the run is recorded (other jobs share it); template timings are
single-threaded NumPy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_parts, start_run, summarize, write_result
from loom.planner.oobleck_costs import layer_times
from loom.planner.oobleck_failures import FailurePricer, FailureSettings, simulate_failures
from loom.planner.oobleck_templates import plan_templates
from loom.sim.failures import generate_trace
from loom.sim.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parent.parent / "configs" / "sim" / "oobleck-gpt3-6.7b-30xa40.toml"
# the 96-layer cell of Table 2.3: GPT-3 175B on 24 nodes of 8 A40s
TEMPLATE_OVERRIDES = ['model.llm="gpt3-175b"', "cluster.num_gpus=192", "cluster.gpus_per_node=8"]
INTERVALS = {"6h": 6 * 3600.0, "1h": 3600.0, "10m": 600.0}


def template_time(repeats: int) -> tuple[dict, dict]:
    scenario = load_scenario(SCENARIO, TEMPLATE_OVERRIDES)
    t0 = time.perf_counter()
    times = layer_times(scenario, 1)
    costs_s = time.perf_counter() - t0
    single, every, uniform = [], [], []
    template = None
    for _ in range(repeats):  # alternated, so load changes hit all three alike
        t0 = time.perf_counter()
        template = plan_templates(times, [24], 8, tensor_parallel="mixed")[24]
        single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan_templates(times, range(2, 25), 8, tensor_parallel="mixed")
        every.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan_templates(times, [24], 8)
        uniform.append(time.perf_counter() - t0)
    figures = {"template_s_24x8_96": {**summarize(single, "s", "lower", 3), "target": 30.0}}
    details = {"layers": times.num_layers, "stage_gpu_counts": list(times.gpu_counts),
               "layer_costs_s": round(costs_s, 2), "all_sizes_2_24_s": summarize(every, "s", "lower", 3),
               "uniform_tp_s": summarize(uniform, "s", "lower", 3), "stages": template.num_stages,
               "stage_gpus": sorted(set(template.stage_gpus)), "paper_table_2_3_s": 3297.92}
    return figures, details


def failure_throughput(seeds: int) -> tuple[dict, dict]:
    scenario = load_scenario(SCENARIO)
    settings = FailureSettings()
    pricer = FailurePricer(scenario, settings)  # templates and simulated step times, shared by every trace
    figures, details = {}, {"template_sizes": [pricer.spec.template_sizes[0], pricer.spec.template_sizes[-1]]}
    for label, interval in INTERVALS.items():
        ratios, oobleck, restart = [], [], []
        for seed in range(seeds):
            report = simulate_failures(scenario, generate_trace(pricer.N, interval, seed=seed), settings, pricer)
            ratios.append(report.ratio)
            oobleck.append(report.oobleck.fraction_of_failure_free)
            restart.append(report.restart.fraction_of_failure_free)
        figures[f"failure_throughput_ratio_{label}"] = {**summarize(ratios, "ratio (simulated)", "higher", 3),
                                                        "target": 1.0}
        details[label] = {"oobleck_fraction_of_failure_free": summarize(oobleck, "fraction (simulated)", "higher", 3),
                          "restart_fraction_of_failure_free": summarize(restart, "fraction (simulated)", "higher", 3)}
    details["checkpoint_s"] = round(pricer.state_bytes / settings.storage_bytes_per_s, 2)
    details["settings"] = settings.__dict__
    return figures, details


ELASTIC_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "elastic.toml"
KILL_STEPS = (3, 7)


def recovery(runs: int) -> tuple[dict, dict]:
    """``recovery_s`` (module docstring) over ``runs`` launches of the elastic demo."""
    import json
    import random
    import tempfile

    from loom.elastic.supervisor import Kill
    from loom.train.config import config_to_toml, load_config
    from loom.train.elastic import launch

    rng = random.Random(0)
    values, parts = [], []
    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ELASTIC_CONFIG, ["run.steps=10", f'run.out_dir="{tmp}"'])
            run_dir = Path(tmp) / cfg.run.name
            run_dir.mkdir(parents=True)
            (run_dir / "config.toml").write_text(config_to_toml(cfg))
            first = rng.randrange(cfg.elastic.nodes)
            second = rng.choice([r for r in range(cfg.elastic.nodes) if r != first])
            kills = [Kill([first], KILL_STEPS[0], rng.uniform(0, 0.2)), Kill([second], KILL_STEPS[1], rng.uniform(0, 0.2))]
            out = launch(cfg, run_dir, run_dir / "config.toml", kills=kills, echo=False)
            if out.returncode != 0:
                raise RuntimeError(f"recovery run {run}: {out.message}")
            events = [json.loads(line) for line in (run_dir / "elastic.jsonl").read_text().splitlines()]
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            for kill in (e for e in events if e["event"] == "kill"):
                death = next(e for e in events if e["event"] == "death" and e["rank"] == kill["rank"])
                gen = next(e for e in events if e["event"] == "generation" and e["time"] >= death["time"])
                formed = next(e for e in events if e["event"] == "formed" and e["generation"] == gen["generation"])
                done = min(r["time"] for r in rows if r["generation"] == gen["generation"])
                values.append(done - kill["time"])
                parts.append({"rank": kill["rank"], "step": kill["step"], "death_seen_s": round(death["time"] - kill["time"], 3),
                              "published_s": round(gen["time"] - kill["time"], 3), "form_s": formed["form_s"],
                              "next_step_s": round(done - kill["time"], 3), "pipelines": gen["pipelines"]})
    figures = {"recovery_s": {**summarize(values, "s", "lower", 3), "target": 30.0}}
    return figures, {"config": ELASTIC_CONFIG.name, "kill_steps": list(KILL_STEPS), "recoveries": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the template timing")
    ap.add_argument("--seeds", type=int, default=5, help="generated failure traces per failure rate")
    ap.add_argument("--recovery-runs", type=int, default=2, help="elastic launches for recovery_s (2 kills each)")
    args = ap.parse_args()
    start_run()
    parts = [("templates", lambda: template_time(args.repeats)), ("failures", lambda: failure_throughput(args.seeds))]
    parts.append(("recovery", lambda: recovery(args.recovery_runs)))  # measured: loom.elastic's runtime
    figures, details = run_parts(parts)
    write_result("elastic", figures, {"scenario": SCENARIO.name, "template_overrides": TEMPLATE_OVERRIDES,
                                      "repeats": args.repeats, "seeds": args.seeds,
                                      "recovery_runs": args.recovery_runs, **details})


if __name__ == "__main__":
    main()
