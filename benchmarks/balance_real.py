"""Balance, measured: a real 2-rank CPU training run on skewed data, balanced against unbalanced.

The production path exactly as ``tests/test_balance_runtime.py`` runs it: `build_data` (the
demo dataset with a skewed mix: many text-only samples, some with one image, many with several
large ones, so a few samples carry most of the vision work), `build_model` (a vision encoder and
a Llama LLM from the zoo, no audio), `ParallelEngine.create` on the plan
``[vision, llm]`` (2 ranks: the vision encoder on rank 0, the LLM on rank 1, a 2-stage pipeline
with 8 microbatches), the `Dispatcher` under a `BalanceConfig` policy, then
``engine.step(got.batches, got.num_targets, step, layout=got.layout, rows=got.rows)`` with AdamW.

Groups, each its own 2 fresh gloo processes with one thread each, all fed the same global batches
(`GlobalBatchSampler`, a new batch every step):

- ``none``: equal-count contiguous microbatches (the unbalanced baseline);
- ``entrain``: the headline, fixed in advance (entrain.md §3.5: stratified encoder-balanced
  microbatches with deferral of LLM work, the policy built for this encoder-then-LLM pipeline);
- ``disttrain``: microbatch LPT plus Algorithm 3 order (a second balanced policy, reported too).

All groups start together and then take turns step by step (the order rotates every step), so
slow phases of a shared machine hit every group alike. A timed step runs, inside the worker,
from a barrier to a barrier and includes everything a trainer pays per iteration: the dispatch
(metadata all-gather, the policy, the payload all-to-all), the schedule for a new layout
(`ParallelEngine.schedule_for`: ``build_schedule`` + ``validate_schedule``, cached per layout)
and the step itself (AdamW step included). Those parts are also timed on their own.

The step-0 losses of all groups must agree (the same global batch, reference semantics); the
script fails otherwise.

    python -m benchmarks.balance_real [--steps 10 --warmup 2 --policies none,entrain,disttrain ...]

Prints a table and writes ``benchmarks/results/balance_real.json`` (DESIGN.md, "Benchmarks").
``real_step_time_ratio`` = median step time of ``none`` / that of ``entrain`` (above 1: the
balanced run is faster); ``real_step_time_ratio_disttrain`` the same for ``disttrain``.
`real_run` returns the figures as a dict (``benchmarks/balance_quality.py`` merges it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import (WorkerGroup, figure, format_table, machine_info, median, peak_rss_mb,
                               write_result)

NAME = "balance_real"
WORLD_SIZE = 2
LOSS_RTOL = 1e-4
BASELINE, HEADLINE = "none", "entrain"  # fixed in advance, not the best after the fact
COMPUTE_KINDS = ("forward", "backward")


@dataclass
class RealConfig:
    steps: int = 10  # timed steps per group
    warmup: int = 2  # untimed steps per group before them
    policies: str = "none,entrain,disttrain"  # the groups; must hold none and entrain
    global_batch: int = 32
    microbatches: int = 8
    # skewed data: 40% text only, 20% one image, 40% two to max_images images of up to
    # max_image_size pixels a side (patch 8: up to 144 tokens per image)
    mix: str = "text:0.4,image:0.2,multi_image:0.4"
    max_image_size: int = 96
    max_images: int = 4
    num_samples: int = 4096
    # the vision encoder (rank 0) and the LLM (rank 1), sized so that their compute per
    # microbatch is comparable
    vision_hidden: int = 128
    vision_layers: int = 8
    vision_heads: int = 4
    llm_hidden: int = 128
    llm_layers: int = 4
    llm_heads: int = 4
    llm_kv_heads: int = 2
    llm_intermediate: int = 344
    lr: float = 1e-3
    seed: int = 0
    # "packed": each LLM microbatch one packed row (data.pack_sequences, what large-scale
    # trainers do; the LLM's work is then the sum of its samples', as every policy assumes);
    # "padded": one right-padded row per sample (the padding no policy models grows when
    # balancing spreads long samples over the microbatches)
    llm_batching: str = "packed"

    def policy_list(self) -> list[str]:
        return [p for p in self.policies.split(",") if p]

    def mix_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in (part.split(":") for part in self.mix.split(",") if part)}


def train_config(cfg: RealConfig):
    """The `TrainConfig` (model, plan, data) of the run, as the tests build it."""
    from loom.data.demo import DemoConfig
    from loom.model.zoo import LlamaConfig, VisionConfig
    from loom.plan.plan import ModuleSpec, Plan
    from loom.train.config import ModelConfig, TrainConfig

    model = ModelConfig(
        vision=VisionConfig(hidden_size=cfg.vision_hidden, num_layers=cfg.vision_layers, num_heads=cfg.vision_heads),
        audio=None,
        llm=LlamaConfig(hidden_size=cfg.llm_hidden, num_layers=cfg.llm_layers, num_heads=cfg.llm_heads,
                        num_kv_heads=cfg.llm_kv_heads, intermediate_size=cfg.llm_intermediate),
    )
    plan = Plan([ModuleSpec("vision"), ModuleSpec("llm")], num_microbatches=cfg.microbatches)
    demo = DemoConfig(num_samples=cfg.num_samples, seed=cfg.seed, mix=cfg.mix_dict(),
                      max_image_size=cfg.max_image_size, max_images=cfg.max_images)
    train = TrainConfig(model=model, plan=plan)
    if cfg.llm_batching not in ("packed", "padded"):
        raise ValueError(f"--llm-batching {cfg.llm_batching!r}: choose packed or padded")
    train.data = dataclasses.replace(train.data, global_batch_size=cfg.global_batch, demo=demo,
                                     pack_sequences=cfg.llm_batching == "packed")
    return train


# ---- one group, on each of its ranks -------------------------------------------------------
def _worker(rank: int, world_size: int, policy: str, cfg_dict: dict, commands: list, replies, trace_dir: str | None) -> None:
    """Build the group, then run one step per command from the driver on ``commands[rank]``
    (``None`` ends) and reply with its times, loss and layout statistics."""
    from loom.balance.policy import BalanceConfig, load_stats
    from loom.cost.arch_from_model import arch_from_model
    from loom.data.collate import count_tokens
    from loom.data.sampler import GlobalBatchSampler
    from loom.runtime.dispatch import Dispatcher
    from loom.runtime.engine import ParallelEngine
    from loom.schedule.timeline import events_to_dicts
    from loom.train.build import build_data, build_model, token_counters

    cfg = RealConfig(**cfg_dict)
    train = train_config(cfg)
    cpu = torch.device("cpu")
    tokenizer, dataset = build_data(train)
    model = build_model(train.model, tokenizer, seed=cfg.seed)
    arch, counters = arch_from_model(model), token_counters(model)
    plan = train.plan
    engine = ParallelEngine.create(model, plan, cpu, optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=cfg.lr))
    dispatcher = Dispatcher(plan, dataset, tokenizer, counters, arch, BalanceConfig(default=policy), cpu,
                            pack=train.data.pack_sequences)
    sampler = GlobalBatchSampler(len(dataset), cfg.global_batch, seed=cfg.seed)
    del model
    seen_layouts: set = set()
    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        indices = sampler.batch(i)
        dist.barrier()
        t0 = time.perf_counter()
        got = dispatcher.dispatch(indices)
        t1 = time.perf_counter()
        engine.schedule_for(got.layout)  # build + validate on a new layout, a cache hit otherwise
        t2 = time.perf_counter()
        result = engine.step(got.batches, got.num_targets, i, layout=got.layout, rows=got.rows)
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        key = (got.layout.num_microbatches, tuple(sorted(got.layout.slots.items())))
        new_layout = key not in seen_layouts
        seen_layouts.add(key)
        stats = load_stats(got.layout, plan, got.costs)
        compute = sum(e.duration_s for e in result.timeline if e.kind in COMPUTE_KINDS)
        counts = [count_tokens(m, counters) for m in got.metas]
        # what the runtime really computes: a padded LLM right-pads each microbatch to its
        # longest row (packed rows have no padding); vision_sq is the square of each vision
        # microbatch's tokens, what a dense block-diagonal mask would cost (the zoo encoder
        # attends per image, sum of squares)
        llm_padded = (sum(len(slot) * max(counts[s]["llm"] for s in slot) for slot in got.layout.slots["llm"] if slot)
                      if not train.data.pack_sequences else sum(c["llm"] for c in counts))  # packed rows: no padding
        vision_sq = sum(sum(counts[s]["vision"] for s in slot) ** 2 for slot in got.layout.slots["vision"])
        backward_calls = sum(1 for e in result.timeline if e.kind == "backward")
        info = {
            "total": t4 - t0, "dispatch": t1 - t0, "schedule": t2 - t1, "engine_step": t3 - t2, "compute": compute,
            "new_layout": new_layout, "num_microbatches": got.layout.num_microbatches, "backward_calls": backward_calls,
            "llm_padded_tokens": llm_padded, "llm_tokens": sum(c["llm"] for c in counts), "vision_tokens_sq": vision_sq,
            "mb_max_over_mean": {phase: s["microbatches"] for phase, s in stats.items()},
        }
        if trace_dir is not None:
            import json
            (Path(trace_dir) / f"{policy}_rank{rank}_step{i}.json").write_text(json.dumps(events_to_dicts(result.timeline)))
        replies.put(("step", rank, i, result.loss, info))
    replies.put(("done", rank, peak_rss_mb()))


class Group(WorkerGroup):
    """A policy's pair of processes and the queues that drive them."""

    def __init__(self, policy: str, cfg: RealConfig, trace_dir: str | None):
        super().__init__(policy, _worker, WORLD_SIZE, asdict(cfg), extra=(trace_dir,))
        self.policy = policy
        self.losses: list[float] = []
        self.steps: list[dict[str, Any]] = []  # per step: the slower rank's times, layout stats
        self.peak_rss_mb: list[float] = []

    def step(self, i: int) -> dict[str, Any]:
        got = self.command(i)
        self.losses.append(sum(r[3] for r in got))  # only the LLM rank computes the loss
        infos = [r[4] for r in got]
        # both ranks leave at the closing barrier: the slower clock; parts: the slower rank's
        step = {k: max(info[k] for info in infos) for k in ("total", "dispatch", "schedule", "engine_step")}
        step["compute"] = {r: info["compute"] for r, info in enumerate(infos)}
        step.update({k: infos[0][k] for k in ("new_layout", "num_microbatches", "mb_max_over_mean", "llm_padded_tokens",
                                              "llm_tokens", "vision_tokens_sq")})
        step["backward_calls"] = {r: info["backward_calls"] for r, info in enumerate(infos)}
        self.steps.append(step)
        return step

    def finish(self) -> None:
        self.peak_rss_mb = self.close()


# ---- the run -------------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def real_run(steps: int = 10, warmup: int = 2, policies: str | tuple[str, ...] = "none,entrain,disttrain",
             verbose: bool = True, trace_dir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the groups and return the figures: ``real_step_time_ratio`` (median step time of
    ``none`` / ``entrain``), ``real_step_time_ratio_disttrain`` if disttrain ran, per-group
    median step times, peak RSS and microbatch max/mean loads as ready figures, and ``config``
    (a plain dict: the configuration and per-group details)."""
    if not isinstance(policies, str):
        policies = ",".join(policies)
    cfg = RealConfig(steps=steps, warmup=warmup, policies=policies, **overrides)
    names = cfg.policy_list()
    if BASELINE not in names or HEADLINE not in names:
        raise ValueError(f"policies={cfg.policies!r}: must include {BASELINE!r} and {HEADLINE!r}")
    if cfg.steps < 1 or cfg.warmup < 1:
        raise ValueError("steps and warmup must be at least 1 (the first step builds the schedule caches)")
    say = print if verbose else (lambda *a, **k: None)
    say(f"{NAME}: vision ({cfg.vision_layers} x {cfg.vision_hidden}) on rank 0 -> LLM ({cfg.llm_layers} x "
        f"{cfg.llm_hidden}) on rank 1, {cfg.microbatches} microbatches, global batch {cfg.global_batch}, mix {cfg.mix}, "
        f"images up to {cfg.max_images} x {cfg.max_image_size}px; groups {names}, 2 gloo processes x 1 thread each")
    say(f"{cfg.warmup} warmup + {cfg.steps} timed steps per group, the groups taking turns step by step")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        trace_dir = str(trace_dir)

    t0 = time.perf_counter()
    groups: dict[str, Group] = {}
    try:
        for name in names:
            groups[name] = Group(name, cfg, trace_dir)
        for g in groups.values():
            g.wait_ready()
        say(f"  groups set up in {time.perf_counter() - t0:.1f} s")
        for i in range(cfg.warmup + cfg.steps):
            order = names[i % len(names):] + names[:i % len(names)]  # rotate: nobody always goes first
            for name in order:
                groups[name].step(i)
            kind = "warmup" if i < cfg.warmup else "step"
            say(f"  {kind} {i + 1:3d}: " + ", ".join(
                f"{n} {groups[n].steps[-1]['total'] * 1e3:.0f} ms (loss {groups[n].losses[-1]:.5f})" for n in names))
        for g in groups.values():
            g.finish()
    finally:
        for g in groups.values():
            for p in g.procs:
                if p.is_alive():
                    p.terminate()
    wall = time.perf_counter() - t0

    # the same work in every group: the same loss on the first step
    ref = groups[BASELINE].losses[0]
    rel0 = {n: abs(g.losses[0] - ref) / max(abs(ref), 1e-12) for n, g in groups.items()}
    say("first-step loss: " + ", ".join(f"{n} {g.losses[0]:.6f}" for n, g in groups.items())
        + f" (largest relative difference {max(rel0.values()):.2e})")
    if max(rel0.values()) > LOSS_RTOL:
        raise RuntimeError(f"the groups compute different losses on the first step "
                           f"({ {n: g.losses[0] for n, g in groups.items()} }): they do not do the same work, "
                           f"the timing would be meaningless")

    def timed(name: str) -> list[dict[str, Any]]:
        return groups[name].steps[cfg.warmup:]

    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        st = timed(name)
        new = [s for s in st if s["new_layout"]]
        summary[name] = {
            "step_ms": median([s["total"] for s in st]) * 1e3,
            "min_step_ms": min(s["total"] for s in st) * 1e3,
            "engine_step_ms": median([s["engine_step"] for s in st]) * 1e3,
            "dispatch_ms": median([s["dispatch"] for s in st]) * 1e3,
            "schedule_ms_per_step": _mean([s["schedule"] for s in st]) * 1e3,
            "schedule_ms_per_new_layout": _mean([s["schedule"] for s in new]) * 1e3 if new else None,
            "new_layouts": len(new),
            "compute_ms": {f"rank{r}": median([s["compute"][r] for s in st]) * 1e3 for r in range(WORLD_SIZE)},
            "num_microbatches": sorted({s["num_microbatches"] for s in st}),
            "mean_microbatches": _mean([s["num_microbatches"] for s in st]),
            "vision_backward_calls": _mean([s["backward_calls"][0] for s in st]),
            "llm_padded_over_real_tokens": _mean([s["llm_padded_tokens"] / s["llm_tokens"] for s in st]),
            "vision_tokens_sq_M": _mean([s["vision_tokens_sq"] for s in st]) / 1e6,
            "mb_max_over_mean": {phase: round(_mean([s["mb_max_over_mean"][phase] for s in st]), 4)
                                 for phase in st[0]["mb_max_over_mean"]},
            "peak_rss_mb": max(groups[name].peak_rss_mb),
        }
    base = summary[BASELINE]["step_ms"]
    ratio = {n: base / summary[n]["step_ms"] for n in names}
    paired = {n: median([a["total"] / b["total"] for a, b in zip(timed(BASELINE), timed(n))]) for n in names}
    engine_ratio = {n: summary[BASELINE]["engine_step_ms"] / summary[n]["engine_step_ms"] for n in names}

    if verbose:
        rows = [[n, s["step_ms"], s["min_step_ms"], s["engine_step_ms"], f"{s['dispatch_ms']:.1f}",
                 f"{s['schedule_ms_per_step']:.1f}", f"{s['compute_ms']['rank0']:.0f}/{s['compute_ms']['rank1']:.0f}",
                 f"{s['mb_max_over_mean']['vision']:.2f}", f"{s['mb_max_over_mean']['llm']:.2f}",
                 f"{ratio[n]:.3f}", s["peak_rss_mb"]]
                for n, s in summary.items()]
        print()
        print(format_table(["policy", "median step (ms)", "min (ms)", "engine.step (ms)", "dispatch (ms)",
                            "schedule (ms)", "compute r0/r1 (ms)", "vision mb max/mean", "llm mb max/mean",
                            "none / policy", "peak RSS (MB)"], rows))
        print(f"\nreal_step_time_ratio (none / {HEADLINE}, median step times) = {ratio[HEADLINE]:.3f}"
              f"  (median of step-by-step ratios {paired[HEADLINE]:.3f}; engine.step only {engine_ratio[HEADLINE]:.3f})")
        if "disttrain" in names:
            print(f"real_step_time_ratio_disttrain = {ratio['disttrain']:.3f}  (paired {paired['disttrain']:.3f}; "
                  f"engine.step only {engine_ratio['disttrain']:.3f})")
        print("schedule build + validate per new layout: " + ", ".join(
            f"{n} {s['schedule_ms_per_new_layout'] or 0:.1f} ms x {s['new_layouts']}/{cfg.steps} steps"
            for n, s in summary.items()) + f"; total {wall:.0f} s")
        print("what the runtime computes, mean per step: " + "; ".join(
            f"{n}: {s['mean_microbatches']:.2f} microbatches, {s['vision_backward_calls']:.2f} vision backward calls "
            f"(split backward parts count separately), LLM padded/real tokens {s['llm_padded_over_real_tokens']:.2f}, "
            f"sum over microbatches of vision tokens^2 {s['vision_tokens_sq_M']:.2f} M" for n, s in summary.items()))

    out: dict[str, Any] = {"real_step_time_ratio": round(ratio[HEADLINE], 4)}
    if "disttrain" in names:
        out["real_step_time_ratio_disttrain"] = round(ratio["disttrain"], 4)
    out["real_paired_step_time_ratio"] = figure(paired[HEADLINE], "ratio (measured)", "higher")
    out["real_engine_step_time_ratio"] = figure(engine_ratio[HEADLINE], "ratio (measured)", "higher")
    for n, s in summary.items():
        out[f"real_{n}_step_ms"] = figure(s["step_ms"], "ms (measured)", "lower", digits=2)
        out[f"real_{n}_peak_rss_mb"] = figure(s["peak_rss_mb"], "MB (measured)", "lower", digits=1)
        out[f"real_{n}_vision_microbatch_max_over_mean"] = figure(s["mb_max_over_mean"]["vision"], "ratio (layout)", "lower")
        out[f"real_{n}_schedule_ms_per_step"] = figure(s["schedule_ms_per_step"], "ms (measured)", "lower", digits=2)
        out[f"real_{n}_dispatch_ms"] = figure(s["dispatch_ms"], "ms (measured)", "lower", digits=2)
        out[f"real_{n}_llm_padded_over_real_tokens"] = figure(s["llm_padded_over_real_tokens"], "ratio (layout)", "lower")
    out["config"] = {
        **asdict(cfg), "world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo",
        "plan": "[vision] -> [llm], one rank each", "headline": f"{BASELINE} / {HEADLINE}", "optimizer": "AdamW",
        "timing": "median over timed steps, barrier to barrier, dispatch + schedule_for + engine.step; "
                  "groups take turns step by step",
        "first_step_loss": {n: g.losses[0] for n, g in groups.items()},
        "groups": {n: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}
                   for n, s in summary.items()},
        "paired_ratio": {n: round(v, 4) for n, v in paired.items()},
        "engine_step_ratio": {n: round(v, 4) for n, v in engine_ratio.items()},
        "wall_s": round(wall, 1),
    }
    return out


# ---- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, value in asdict(RealConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=" ")
    parser.add_argument("--out", type=Path, default=None, help="results directory; None: benchmarks/results")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write every rank's per-step timeline (events_to_dicts JSON) into this directory")
    args = parser.parse_args(argv)
    cfg = {name: getattr(args, name) for name in asdict(RealConfig())}
    out = real_run(verbose=True, trace_dir=args.trace, **cfg)
    config = out.pop("config")
    figures = {k: v if isinstance(v, dict) else figure(v, "ratio (measured)", "higher") for k, v in out.items()}
    path = write_result(NAME, figures, config, machine_info(), args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
