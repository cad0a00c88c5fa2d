"""Balance quality: how much each balancing policy evens out the work and shortens the iteration,
on skewed data mixes at cluster scale (SIMULATED), with a hook for a real 2-rank run.

    python -m benchmarks.balance_quality [--steps 3] [--mixes caption,interleaved] [--real] [--real-repeats 6]

What runs (`simulated_quality`): for each skewed mix of `loom.data.synthetic.SKEWED_MIXES`
(caption-like, multi-image, audio-heavy, interleaved documents) a scenario (`loom.sim.scenario`)
of Llama-3-8B with a ViT-H/14 vision encoder (and Whisper-large for the audio-heavy mix, which
has speech) on H100s, the Megatron-style plan at TP 2 x DP 8 (every encoder one stage, the LLM 3
stages: 64 GPUs, 80 with audio), 8 microbatches per pipeline (64 in all), global batch 512, LLM
sequences ``packed`` (as large-scale trainers do) and ``padded`` (loom's runtime, the side a
real CPU run measures). Every policy of `loom.balance.policy.POLICIES` lays out the same global
batches (`Scenario.run_balanced`: `sample_costs`, `make_layout`, the schedule built with the
layout, per-slot per-phase workloads), and the simulator plays them under the analytic cost
model. Per LLM batching ``<b>``, mix, policy and phase (each encoder and the LLM), averaged over
``--steps`` iterations (different global batches):

- ``<b>.<mix>.<policy>.dp_max_over_mean.<phase>``: max / mean over data-parallel replicas of
  the phase's simulated compute (`loom.sim.loads`; 1 = balanced);
- ``<b>.<mix>.<policy>.microbatch_max_over_mean.<phase>``: the same over microbatch slots;
- ``<b>.<mix>.<policy>.iteration_time_vs_none``: simulated iteration time / that of ``none``
  (the unbalanced, equal-count layout); ``<b>.<mix>.none.iteration_time_s`` the baseline, in s;
- ``<b>.<policy>.iteration_time_vs_none_mean``: the geometric mean of the ratio over the mixes.

Every figure above is simulated (its unit says so; better: lower). The measured side is
``benchmarks/balance_real.py`` (a real 2-rank CPU run, every policy against ``none``, padded
and packed LLM rows, the groups taking turns step by step on the same global batches), whose
figures (``real_step_time_ratio``, ``real_step_time_ratio_packed``: none over the best policy,
per repeat the ratio of step-time sums on the same batches, better: higher, with their spread
over the repeats) live in ``balance_real.json``. ``--real`` also runs it here (``--real-repeats``,
``--real-steps-per-repeat``, ``--real-warmup``) and merges its figures. Writes
``benchmarks/results/balance_quality.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import figure, format_table, machine_info, start_run, write_result
from loom.balance.policy import POLICIES
from loom.cost.model_configs import load_model_arch
from loom.cost.hardware import Cluster
from loom.data.synthetic import SKEWED_MIXES
from loom.planner.baselines import megatron_plan
from loom.sim.scenario import ParallelDegrees, Scenario

LLM_NAME = "llama3-8b"
VISION = "vit-h-14"
AUDIO = "whisper-large"
TENSOR_PARALLEL, DATA_PARALLEL, LLM_STAGES, MICROBATCHES_PER_PIPELINE = 2, 8, 3, 8
GLOBAL_BATCH = 512
# packed: large-scale trainers; padded: loom's runtime (each microbatch right-padded), the
# side the real 2-rank run measures
LLM_BATCHING = ("packed", "padded")


def scenario_for(mix: str, seed: int = 0, llm_batching: str = "packed") -> Scenario:
    """The benchmark's scenario for ``mix``: a vision encoder, plus an audio one if the mix has
    speech; frozen encoders with trainable projectors (LLaVA stage 2), GPUs for exactly
    one stage per encoder and ``LLM_STAGES`` LLM stages at TP x DP."""
    encoders = {"vision": VISION}
    if mix == "audio_heavy":
        encoders["audio"] = AUDIO
    freeze = [f"{name}.encoder" for name in encoders]
    arch = load_model_arch(LLM_NAME, encoders, "mlp", freeze)
    gpus = (len(encoders) + LLM_STAGES) * TENSOR_PARALLEL * DATA_PARALLEL
    return Scenario(
        name=f"balance-quality-{mix}", arch=arch, cluster=Cluster("H100", gpus, 8), mix=mix, seed=seed,
        global_batch_size=GLOBAL_BATCH, llm_batching=llm_batching,
        degrees=ParallelDegrees(tensor_parallel=TENSOR_PARALLEL, data_parallel=DATA_PARALLEL,
                                microbatches_per_pipeline=MICROBATCHES_PER_PIPELINE),
    )


def simulated_quality(mixes: tuple[str, ...] = SKEWED_MIXES, policies: tuple[str, ...] = POLICIES,
                      steps: int = 1, seed: int = 0,
                      llm_batching: tuple[str, ...] = LLM_BATCHING) -> dict[str, Any]:
    """Simulate every (LLM batching, mix, policy) over ``steps`` global batches; returns
    ``{"figures": ..., "config": ..., "rows": [...]}`` (rows: one per batching, mix and policy,
    for the table)."""
    if "none" not in policies:
        policies = ("none", *policies)
    figures: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for batching in llm_batching:
        ratios: dict[str, list[float]] = {p: [] for p in policies}
        for mix in mixes:
            scenario = scenario_for(mix, seed, batching)
            plan = megatron_plan(scenario)
            acc: dict[str, dict[str, Any]] = {}
            for step in range(steps):
                metas = scenario.metas(step)
                for policy in policies:
                    run = scenario.run_balanced(plan, policy, metas=metas)
                    loads = run.loads.summary()
                    a = acc.setdefault(policy, {"time": 0.0, "bubble": 0.0, "microbatches": 0,
                                                "dp": {}, "microbatch": {}})
                    a["time"] += run.result.iteration_time / steps
                    a["bubble"] += run.result.bubble_fraction / steps
                    a["microbatches"] = max(a["microbatches"], run.layout.num_microbatches)
                    for axis in ("dp", "microbatch"):
                        for phase, v in loads[axis].items():
                            a[axis][phase] = a[axis].get(phase, 0.0) + v / steps
            base = acc["none"]["time"]
            prefix = f"{batching}.{mix}"
            figures[f"{prefix}.none.iteration_time_s"] = figure(base, "s (simulated)", "lower", digits=6)
            for policy in policies:
                a = acc[policy]
                ratio = a["time"] / base
                ratios[policy].append(ratio)
                figures[f"{prefix}.{policy}.iteration_time_vs_none"] = figure(ratio, "ratio (simulated)", "lower")
                for axis in ("dp", "microbatch"):
                    for phase, v in a[axis].items():
                        figures[f"{prefix}.{policy}.{axis}_max_over_mean.{phase}"] = figure(v, "ratio (simulated)", "lower")
                rows.append({"llm_batching": batching, "mix": mix, "policy": policy, "iteration_time_s": a["time"],
                             "vs_none": ratio, "bubble_fraction": a["bubble"],
                             "layout_microbatches": a["microbatches"], "dp": a["dp"], "microbatch": a["microbatch"]})
        for policy in policies:
            geo = math.exp(sum(math.log(r) for r in ratios[policy]) / len(ratios[policy]))
            figures[f"{batching}.{policy}.iteration_time_vs_none_mean"] = figure(
                geo, "ratio (simulated, geometric mean over mixes)", "lower")
    config = {
        "simulated": True, "mixes": list(mixes), "policies": list(policies), "steps": steps, "seed": seed,
        "llm_batching": list(llm_batching),
        "model": {"llm": LLM_NAME, "vision": VISION, "audio (audio_heavy only)": AUDIO, "projector": "mlp",
                  "frozen": "encoders"},
        "plan": {"kind": "megatron-style", "tensor_parallel": TENSOR_PARALLEL, "data_parallel": DATA_PARALLEL,
                 "llm_stages": LLM_STAGES, "encoder_stages": 1,
                 "num_microbatches": MICROBATCHES_PER_PIPELINE * DATA_PARALLEL, "schedule": "1f1b"},
        "global_batch_size": GLOBAL_BATCH, "gpu": "H100", "cost_model": "analytic", "order": "given",
    }
    return {"figures": figures, "config": config, "rows": rows}


def print_table(rows: list[dict[str, Any]]) -> None:
    def phases(r: dict[str, Any], axis: str) -> str:
        return " ".join(f"{p} {v:.3f}" for p, v in r[axis].items())

    table = [(r["llm_batching"], r["mix"], r["policy"], f"{r['iteration_time_s']:.4f}", f"{r['vs_none']:.3f}",
              f"{100 * r['bubble_fraction']:.1f}%", str(r["layout_microbatches"]), phases(r, "dp"),
              phases(r, "microbatch")) for r in rows]
    print(format_table(("LLM", "mix", "policy", "iter s", "vs none", "bubble", "mbs", "DP max/mean", "microbatch max/mean"),
                       table))


def run_real(**options: Any) -> dict[str, Any] | None:
    """``benchmarks.balance_real.real_run(**options)`` if that module exists, else ``None``."""
    try:
        from benchmarks.balance_real import real_run
    except ImportError as e:
        if e.name not in ("benchmarks.balance_real", "benchmarks"):
            raise  # the module exists but something it imports is missing: a real error
        print("real run missing: benchmarks/balance_real.py does not exist, so real_step_time_ratio is left null")
        return None
    return real_run(**options)


def merge_real(figures: dict[str, dict[str, Any]], real: dict[str, Any] | None, config: dict[str, Any]) -> None:
    """Merge the real run's dict into the figures: ready figures (built with ``figure``) are
    kept as they are, anything else goes to ``config["real_run"]``. Without a real run the
    measured figures live in ``balance_real.json`` alone (`loom bench balance_real`)."""
    if real is None:
        config["real_run"] = "not run here: see benchmarks/results/balance_real.json (--real runs it here too)"
        return
    extra = {}
    for key, value in real.items():
        if isinstance(value, dict) and "value" in value:
            figures[key] = value
        else:
            extra[key] = value
    if extra:
        config["real_run"] = extra


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="global batches per mix (figures are their mean)")
    ap.add_argument("--mixes", default=",".join(SKEWED_MIXES), help="comma-separated data mixes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true",
                    help="also run benchmarks/balance_real.py and merge its figures (by default they live in "
                         "balance_real.json alone, so `loom bench --all` measures them once)")
    ap.add_argument("--real-repeats", type=int, default=6, help="balance_real: timed repeats per LLM batching")
    ap.add_argument("--real-steps-per-repeat", type=int, default=0, help="balance_real: timed steps per repeat (0: one cycle of turns)")
    ap.add_argument("--real-warmup", type=int, default=2, help="balance_real: untimed steps before the repeats")
    ap.add_argument("--out", type=Path, default=None, help="results directory; None: benchmarks/results")
    args = ap.parse_args(argv)
    start_run()
    t0 = time.perf_counter()
    out = simulated_quality(tuple(m for m in args.mixes.split(",") if m), POLICIES, args.steps, args.seed)
    seconds = time.perf_counter() - t0
    print_table(out["rows"])
    print(f"(simulated: {len(out['rows'])} layouts x {args.steps} global batches in {seconds:.1f} s; "
          f"DP / microbatch max/mean: each phase's simulated compute across data-parallel replicas / slots, 1 = balanced)")
    for batching in LLM_BATCHING:
        print(f"{batching}: iteration time / none, geometric mean over the mixes: " + ", ".join(
            f"{p} {out['figures'][f'{batching}.{p}.iteration_time_vs_none_mean']['value']:.3f}" for p in POLICIES))
    real = None if not args.real else run_real(repeats=args.real_repeats, steps_per_repeat=args.real_steps_per_repeat,
                                              warmup=args.real_warmup)
    merge_real(out["figures"], real, out["config"])
    if real is not None:
        for key in ("real_step_time_ratio", "real_step_time_ratio_packed"):
            if key in out["figures"]:
                f = out["figures"][key]
                print(f"{key} = {f['value']} ({f['spread_is']} {f['spread']})")
    path = write_result("balance_quality", out["figures"], out["config"], machine_info(), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
