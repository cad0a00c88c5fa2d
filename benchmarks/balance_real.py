"""Balance, measured: a real 2-rank CPU training run on skewed data, every policy against none.

The production path: each rank is built by `loom.train.rank.build_rank` and steps with
`RankRun.step`, the two calls ``loom train`` makes (`loom.train.main`), on a `TrainConfig`
(`train_config`) with the demo dataset in a skewed mix (many text-only samples, some with one
image, many with several large ones, so a few samples carry most of the vision work), a vision
encoder and a Llama LLM from the zoo (no audio), 8 microbatches, ``[balance] default = policy``,
and the run's optimizer and LR schedule (AdamW with the config's weight decay and betas, warmup
then cosine decay over the run's steps). Two plans of the 2 ranks (`PLANS`):

- ``pipeline``: ``[vision, llm]`` disaggregated, the vision encoder on rank 0 and the LLM on
  rank 1 (a 2-stage multimodal pipeline: DistTrain's and Entrain's setting);
- ``colocated``: ``placement = "colocated"``, a vision and an LLM replica on each rank
  (data parallelism 2 for both: OrchMLLM's setting, every rank runs every module).

A policy whose layout is the given one by construction on a plan
(`loom.balance.policy.nothing_to_balance`: ``orchmllm`` on ``pipeline``, where every module
has one replica) runs exactly ``none``'s step there; it is not timed on that plan (two groups
running the same code measure only noise), and ``config`` says why.

Two LLM batchings per plan, each a run of its own: ``padded`` (one right-padded row per sample,
the default of ``data.pack_sequences = false``) and ``packed`` (each LLM microbatch one packed
row, ``data.pack_sequences = true``). In each, one group per timed policy (``none`` and the
policies of `loom.balance.policy.POLICIES` that act on the plan), each its own 2 fresh gloo
processes with one thread each, all fed the same global batches (`GlobalBatchSampler`: every group trains the same batch at step
``i``, a new batch every step). The groups take turns step by step in a Williams order
(`turn_orders`: over one cycle every group takes every turn position once and follows every
other group once), so slow phases of a shared machine, going first, or the group just before
hit every group alike; after ``--warmup`` untimed steps, ``--repeats`` repeats of
``--steps-per-repeat`` timed steps follow (0, the default: one whole cycle of the turn orders,
4 steps for 4 groups, 6 for 3). A timed
step runs, inside the worker, from a barrier to a barrier around one `RankRun.step` and holds
everything a trainer pays per iteration: the dispatch (metadata all-gather, the policy, the
payload all-to-all), the schedule for a new layout (cached per layout), the step itself with
the optimizer, the LR scheduler's step and the loss all-reduce.

Figures (``better``: higher for every ratio; on ``colocated``, ``_colocated`` follows
``real_step_time_ratio`` and ``real_`` in every name):

- ``real_step_time_ratio_<policy>`` / ``real_step_time_ratio_packed_<policy>``: per repeat,
  the sum of ``none``'s step times over the sum of ``<policy>``'s on the same steps, so the
  same global batches (`paired_ratio`: throughput on identical work; above 1: the policy is
  faster); the value is the median over the repeats, the spread their IQR (5 or more
  repeats) or min-max;
- ``real_step_time_ratio`` / ``real_step_time_ratio_packed``: the same for the best policy of
  that plan and batching (the highest median ratio; ``config`` names it), padded rows and
  packed rows;
- ``real_<batching>_<policy>_step_ms``: the median over the repeats of each repeat's mean
  step time.

``config.runs.<plan>/<rows>.groups.<policy>.minus_none_ms`` holds, per policy, the median over
the timed steps of (policy minus none) on the same step for the whole step, its dispatch, its
``engine.step``, and per rank the compute, the process CPU time and the time in Python's
garbage collector (`paired_differences`; ``gc_ms`` its mean per step):
what a policy pays beyond its layout (one that keeps ``none``'s layout should pay only its
decision).

The step-0 losses of all groups of a run must agree (the same global batch, reference
semantics); the script fails otherwise.

    python -m benchmarks.balance_real [--repeats 6 --steps-per-repeat 4 --warmup 2 ...]

``--min-gain`` sets ``balance.min_gain``: a negative value makes every policy use its own
layout even where its cost model predicts no gain (what the layouts themselves would do; the
figures are then not those of the default config, and ``config.min_gain`` says so).

Prints a table and writes ``benchmarks/results/balance_real.json`` (docs/architecture.md, "Benchmarks").
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

from benchmarks.common import (WorkerGroup, format_table, machine_info, median, peak_rss_mb, start_run,
                               summarize, write_result)

NAME = "balance_real"
WORLD_SIZE = 2
LOSS_RTOL = 1e-4
BASELINE = "none"
BATCHINGS = ("padded", "packed")  # padded: the default config (data.pack_sequences = false)
COMPUTE_KINDS = ("forward", "backward")


def _pipeline(microbatches: int):
    from loom.plan.plan import ModuleSpec, Plan

    return Plan([ModuleSpec("vision"), ModuleSpec("llm")], num_microbatches=microbatches)


def _colocated(microbatches: int):
    from loom.plan.plan import ModuleSpec, Plan

    return Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", data_parallel=2)],
                num_microbatches=microbatches, placement="colocated")


# name -> (description, the plan for a microbatch count)
PLANS = {
    "pipeline": ("[vision] -> [llm], one rank each: a 2-stage multimodal pipeline", _pipeline),
    "colocated": ("placement colocated: a vision and an LLM replica on each rank (data parallel 2)", _colocated),
}


@dataclass
class RealConfig:
    repeats: int = 6  # timed repeats per batching; each gives one ratio per policy
    # timed steps per repeat (the repeat's ratio is that of its step-time sums); a whole cycle
    # of `turn_orders` puts each group in every turn position equally often
    # 0: one whole cycle of `turn_orders` for the plan's groups (4 steps for 4, 6 for 3)
    steps_per_repeat: int = 0
    warmup: int = 2  # untimed steps per group before the repeats
    policies: str = "none,orchmllm,disttrain,entrain"  # the groups; must hold none
    plans: str = "pipeline,colocated"  # plans of the 2 ranks (PLANS), each batching a run of its own per plan
    batchings: str = "padded,packed"  # LLM batchings to run, each a run of its own
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
    lr: float = 1e-3  # optim.lr (the rest of [optim] as in configs/demo.toml: the defaults)
    seed: int = 0
    # balance.min_gain (None: the config's default); a negative value makes every policy use
    # its own layout even where its cost model predicts no gain (a diagnostic, not the default)
    min_gain: float | None = None

    def policy_list(self) -> list[str]:
        return [p for p in self.policies.split(",") if p]

    def batching_list(self) -> list[str]:
        return [b for b in self.batchings.split(",") if b]

    def plan_list(self) -> list[str]:
        return [p for p in self.plans.split(",") if p]

    def mix_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in (part.split(":") for part in self.mix.split(",") if part)}

    def check(self) -> "RealConfig":
        from loom.balance.policy import POLICIES

        names = self.policy_list()
        if BASELINE not in names or len(names) < 2:
            raise ValueError(f"--policies {self.policies!r}: list {BASELINE!r} and at least one policy of {list(POLICIES)}")
        unknown = [p for p in names if p not in POLICIES]
        if unknown:
            raise ValueError(f"--policies {self.policies!r}: {unknown} are not policies; choose from {list(POLICIES)}")
        bad = [b for b in self.batching_list() if b not in BATCHINGS]
        if bad or not self.batching_list():
            raise ValueError(f"--batchings {self.batchings!r}: use a comma-separated subset of {list(BATCHINGS)}")
        bad = [p for p in self.plan_list() if p not in PLANS]
        if bad or not self.plan_list():
            raise ValueError(f"--plans {self.plans!r}: use a comma-separated subset of {list(PLANS)}")
        if self.repeats < 1 or self.steps_per_repeat < 0:
            raise ValueError("--repeats must be at least 1 and --steps-per-repeat at least 0 (0: one cycle of turns)")
        if self.warmup < 1:
            raise ValueError("--warmup must be at least 1 (the first step builds the schedule caches)")
        return self


def train_config(cfg: RealConfig, plan_name: str, llm_batching: str, policy: str = BASELINE, steps: int = 1):
    """The `TrainConfig` of the run on plan ``plan_name`` (`PLANS`) with ``llm_batching`` rows
    under ``policy``: model, plan, data, ``[balance]``, ``optim.lr`` and ``run.steps`` (every
    step the group runs, so the LR schedule is that of a run of this length)."""
    from loom.balance.config import BalanceConfig
    from loom.data.demo import DemoConfig
    from loom.model.zoo import LlamaConfig, VisionConfig
    from loom.train.config import ModelConfig, TrainConfig

    model = ModelConfig(
        vision=VisionConfig(hidden_size=cfg.vision_hidden, num_layers=cfg.vision_layers, num_heads=cfg.vision_heads),
        audio=None,
        llm=LlamaConfig(hidden_size=cfg.llm_hidden, num_layers=cfg.llm_layers, num_heads=cfg.llm_heads,
                        num_kv_heads=cfg.llm_kv_heads, intermediate_size=cfg.llm_intermediate),
    )
    plan = PLANS[plan_name][1](cfg.microbatches)
    demo = DemoConfig(num_samples=cfg.num_samples, seed=cfg.seed, mix=cfg.mix_dict(),
                      max_image_size=cfg.max_image_size, max_images=cfg.max_images)
    train = TrainConfig(model=model, plan=plan, balance=BalanceConfig(default=policy))
    if cfg.min_gain is not None:
        train.balance.min_gain = cfg.min_gain
    train.run = dataclasses.replace(train.run, seed=cfg.seed, steps=steps)
    train.optim = dataclasses.replace(train.optim, lr=cfg.lr)
    train.data = dataclasses.replace(train.data, global_batch_size=cfg.global_batch, demo=demo,
                                     pack_sequences=llm_batching == "packed")
    return train.check()


# ---- one group, on each of its ranks -------------------------------------------------------
def _worker(rank: int, world_size: int, group: str, policy: str, cfg_dict: dict, run_key: tuple[str, str, int],
            commands: list, replies, trace_dir: str | None) -> None:
    """Build the rank with `build_rank`, as `loom.train.main.train` does, then run one
    `RankRun.step` per command from the driver on ``commands[rank]`` (``None`` ends) and reply
    with its times, loss and layout. ``group`` names the group in `WorkerGroup`'s messages."""
    from loom.balance.policy import load_stats
    from loom.data.collate import count_tokens
    from loom.schedule.timeline import events_to_dicts
    from loom.train.rank import build_rank

    cfg = RealConfig(**cfg_dict)
    plan_name, llm_batching, steps = run_key
    train = train_config(cfg, plan_name, llm_batching, policy, steps)
    run = build_rank(train, torch.device("cpu"))
    gc_clock = _GcClock()
    counters = run.token_counts
    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        dist.barrier()
        t0, c0, g0 = time.perf_counter(), time.process_time(), gc_clock.seconds
        done = run.step(i)
        c1, g1 = time.process_time(), gc_clock.seconds
        dist.barrier()
        t1 = time.perf_counter()
        got = done.dispatched
        stats = load_stats(got.layout, train.plan, got.costs)
        compute = sum(e.duration_s for e in done.result.timeline if e.kind in COMPUTE_KINDS)
        counts = [count_tokens(m, counters) for m in got.metas]
        # what the runtime really computes: padded LLM rows are right-padded to each
        # microbatch's longest row; packed rows have no padding
        llm_tokens = sum(c["llm"] for c in counts)
        llm_padded = (sum(len(slot) * max(counts[s]["llm"] for s in slot) for slot in got.layout.slots["llm"] if slot)
                      if not train.data.pack_sequences else llm_tokens)
        info = {
            "total": t1 - t0, "dispatch": done.dispatch_s, "engine_step": done.engine_s, "compute": compute,
            "cpu": c1 - c0, "gc": g1 - g0, "indices": list(done.indices),
            "num_microbatches": got.layout.num_microbatches, "llm_padded_over_real": llm_padded / llm_tokens,
            "mb_max_over_mean": {phase: s["microbatches"] for phase, s in stats.items()},
            "slots": {phase: [list(slot) for slot in slots] for phase, slots in got.layout.slots.items()},
            "kept_given": bool(got.layout.kept_given), "eager_forward": int(got.layout.eager_forward),
            "predicted_gain": float(got.layout.predicted_gain.get("total", 0.0)),
        }
        if trace_dir is not None:
            import json
            (Path(trace_dir) / f"{plan_name}_{llm_batching}_{policy}_rank{rank}_step{i}.json").write_text(
                json.dumps(events_to_dicts(done.result.timeline)))
        replies.put(("step", rank, i, done.loss, info))
    run.close()
    replies.put(("done", rank, peak_rss_mb()))


class _GcClock:
    """Seconds this process spent in Python's cyclic garbage collector (`gc.callbacks`): a
    policy whose decision allocates many objects can trigger collections inside the step."""

    def __init__(self) -> None:
        import gc

        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


class Group(WorkerGroup):
    """A policy's pair of processes and the queues that drive them."""

    def __init__(self, policy: str, cfg: RealConfig, run_key: tuple[str, str, int], trace_dir: str | None):
        super().__init__(f"{run_key[0]}/{run_key[1]}/{policy}", _worker, WORLD_SIZE, policy, asdict(cfg), run_key,
                         extra=(trace_dir,))
        self.policy = policy
        self.losses: list[float] = []
        self.steps: list[dict[str, Any]] = []  # per step: the slower rank's times, layout stats
        self.peak_rss_mb: list[float] = []

    def step(self, i: int) -> dict[str, Any]:
        got = self.command(i)
        self.losses.append(got[0][3])  # the global batch's loss, all-reduced: the same on every rank
        infos = [r[4] for r in got]
        # both ranks leave at the closing barrier: the slower clock; parts: the slower rank's
        step = {k: max(info[k] for info in infos) for k in ("total", "dispatch", "engine_step")}
        step["compute"] = [info["compute"] for info in infos]
        step["cpu"] = [info["cpu"] for info in infos]
        step["gc"] = [info["gc"] for info in infos]
        step.update({k: infos[0][k] for k in ("num_microbatches", "mb_max_over_mean", "llm_padded_over_real",
                                              "slots", "kept_given", "predicted_gain", "indices",
                                              "eager_forward")})
        self.steps.append(step)
        return step

    def finish(self) -> None:
        self.peak_rss_mb = self.close()


# ---- one batching --------------------------------------------------------------------------
def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_batching(cfg: RealConfig, plan_name: str, llm_batching: str, names: list[str], say: Any,
                 trace_dir: str | None) -> dict[str, Any]:
    """The groups ``names`` of one plan and LLM batching, alternating step by step; returns
    per policy the timed steps grouped by repeat, plus the groups' first losses and peak
    memory."""
    where = f"{plan_name}/{llm_batching}"
    orders = turn_orders(names)
    per_repeat = cfg.steps_per_repeat or len(orders)
    total = cfg.warmup + cfg.repeats * per_repeat
    t0 = time.perf_counter()
    groups: dict[str, Group] = {}
    try:
        for name in names:
            groups[name] = Group(name, cfg, (plan_name, llm_batching, total), trace_dir)
        for g in groups.values():
            g.wait_ready()
        say(f"  [{where}] groups set up in {time.perf_counter() - t0:.1f} s")
        for i in range(total):
            # timed step t takes row t of the balanced cycle, so a repeat of len(orders) steps is whole
            for name in orders[(i - cfg.warmup) % len(orders)]:
                groups[name].step(i)
            kind = "warmup" if i < cfg.warmup else f"repeat {(i - cfg.warmup) // per_repeat + 1}"
            say(f"  [{where}] step {i + 1:3d} ({kind}): " + ", ".join(
                f"{n} {groups[n].steps[-1]['total'] * 1e3:.0f} ms" for n in names))
        for g in groups.values():
            g.finish()
    finally:
        for g in groups.values():
            for p in g.procs:
                if p.is_alive():
                    p.terminate()

    # the same work in every group: the same loss on the first step
    ref = groups[BASELINE].losses[0]
    rel0 = {n: abs(g.losses[0] - ref) / max(abs(ref), 1e-12) for n, g in groups.items()}
    if max(rel0.values()) > LOSS_RTOL:
        raise RuntimeError(f"[{where}] the groups compute different losses on the first step "
                           f"({ {n: g.losses[0] for n, g in groups.items()} }): they do not do the same work, "
                           f"the timing would be meaningless")
    # the pairing: every group trained the same global batch at every step
    for i, st in enumerate(groups[BASELINE].steps):
        other = [n for n, g in groups.items() if g.steps[i]["indices"] != st["indices"]]
        if other:
            raise RuntimeError(f"[{where}] step {i}: {other} trained other samples than {BASELINE}; the "
                               f"paired ratio needs the same global batch in every group")
    timed = {n: g.steps[cfg.warmup:] for n, g in groups.items()}
    repeats = {n: [st[r * per_repeat:(r + 1) * per_repeat] for r in range(cfg.repeats)] for n, st in timed.items()}
    return {"timed": timed, "repeats": repeats, "first_loss": {n: g.losses[0] for n, g in groups.items()},
            "first_loss_max_rel_diff": max(rel0.values()), "steps_per_repeat": per_repeat, "peak_rss_mb": {n: max(g.peak_rss_mb) for n, g in groups.items()},
            "wall_s": time.perf_counter() - t0}


def summarize_batching(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per policy: per-repeat mean step times, per-repeat paired ratios (none's step-time sum
    over the policy's, on the same global batches), the per-step paired differences of the
    step's parts (policy minus none, same batch, adjacent turns) and what the layouts looked
    like."""
    base_steps = run["timed"][BASELINE]
    base_reps = run["repeats"][BASELINE]
    out: dict[str, dict[str, Any]] = {}
    for name, reps in run["repeats"].items():
        st = run["timed"][name]
        out[name] = {
            "repeat_step_s": [_mean([s["total"] for s in rep]) for rep in reps],
            "repeat_ratio": [paired_ratio([s["total"] for s in b], [s["total"] for s in rep])
                             for b, rep in zip(base_reps, reps)],
            "dispatch_ms": median([s["dispatch"] for s in st]) * 1e3,
            "engine_step_ms": median([s["engine_step"] for s in st]) * 1e3,
            "compute_ms": [median([s["compute"][r] for s in st]) * 1e3 for r in range(WORLD_SIZE)],
            "cpu_ms": [median([s["cpu"][r] for s in st]) * 1e3 for r in range(WORLD_SIZE)],
            "gc_ms": [_mean([s["gc"][r] for s in st]) * 1e3 for r in range(WORLD_SIZE)],  # mean: collections are rare
            "minus_none_ms": paired_differences(st, base_steps),
            "mean_microbatches": _mean([s["num_microbatches"] for s in st]),
            "llm_padded_over_real": _mean([s["llm_padded_over_real"] for s in st]),
            "mb_max_over_mean": {phase: _mean([s["mb_max_over_mean"][phase] for s in st])
                                 for phase in st[0]["mb_max_over_mean"]},
            # steps whose layout is none's (a policy that predicted no gain keeps the given layout)
            "same_layout_as_none": _mean([float(s["slots"] == b["slots"]) for s, b in zip(st, base_steps)]),
            # steps where the policy kept the given layout (its predicted gain below balance.min_gain)
            "kept_given": _mean([float(s["kept_given"]) for s in st]),
            "predicted_gain": _mean([s["predicted_gain"] for s in st]),
            # the encoders' mean extra warmup the layouts asked for (Entrain's eager forward)
            "eager_forward": _mean([s["eager_forward"] for s in st]),
            "peak_rss_mb": run["peak_rss_mb"][name],
        }
    return out


def turn_orders(names: list[str]) -> list[list[str]]:
    """The groups' turn orders, one per step, cycled: a Williams design (a Latin square balanced
    for first-order carry-over). Over one cycle (``n`` steps for ``n`` groups when ``n`` is even,
    ``2n`` when odd: the square and its mirror) every group takes every turn position equally
    often and directly follows every other group equally often, so neither going first (a CPU
    left idle by the driver) nor the group before it (its caches, the memory it leaves behind)
    favours one group. A plain rotation always puts the same group after each group."""
    n = len(names)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[x] for x in row] for row in rows]


def paired_ratio(base: list[float], policy: list[float]) -> float:
    """None over the policy on the same global batches: the ratio of their step-time sums
    (throughput on identical work, so which batches a repeat drew cancels out)."""
    if len(base) != len(policy) or not base:
        raise ValueError(f"paired_ratio: {len(base)} baseline steps against {len(policy)} policy steps; "
                         "pair the same steps (at least one)")
    return sum(base) / sum(policy)


def paired_differences(steps: list[dict[str, Any]], base_steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the timed steps of (policy minus none) on the same global batch, in ms: the
    whole step, its dispatch and ``engine.step`` (the slower rank's), and per rank the compute
    (forward and backward actions) and the process CPU time. What a policy pays beyond its
    layout shows here without the batch-to-batch variation of the totals."""
    def diff(get) -> float:
        return median([get(s) - get(b) for s, b in zip(steps, base_steps)]) * 1e3

    return {
        "total": diff(lambda s: s["total"]),
        "dispatch": diff(lambda s: s["dispatch"]),
        "engine_step": diff(lambda s: s["engine_step"]),
        "compute": [diff(lambda s, r=r: s["compute"][r]) for r in range(WORLD_SIZE)],
        "cpu": [diff(lambda s, r=r: s["cpu"][r]) for r in range(WORLD_SIZE)],
        "gc": [diff(lambda s, r=r: s["gc"][r]) for r in range(WORLD_SIZE)],
    }


# ---- the run -------------------------------------------------------------------------------
def real_run(verbose: bool = True, trace_dir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """Run every plan and batching and return the figures (see the module docstring) plus
    ``config`` (a plain dict: the configuration and per-group details)."""
    from loom.balance.config import BalanceConfig
    from loom.balance.policy import nothing_to_balance

    cfg = RealConfig(**overrides).check()
    batchings = cfg.batching_list()
    say = print if verbose else (lambda *a, **k: None)
    say(f"{NAME}: vision ({cfg.vision_layers} x {cfg.vision_hidden}) and LLM ({cfg.llm_layers} x {cfg.llm_hidden}) "
        f"on 2 ranks, plans {cfg.plan_list()}, {cfg.microbatches} microbatches, global batch {cfg.global_batch}, mix "
        f"{cfg.mix}, images up to {cfg.max_images} x {cfg.max_image_size}px; 2 gloo processes x 1 thread per group")
    say(f"LLM rows {batchings}, each: {cfg.warmup} warmup steps + {cfg.repeats} repeats of "
        f"{cfg.steps_per_repeat or 'a cycle of'} timed steps, the groups taking turns step by step")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        trace_dir = str(trace_dir)

    t0 = time.perf_counter()
    figures: dict[str, dict[str, Any]] = {}
    details: dict[str, Any] = {}
    not_timed: dict[str, dict[str, str]] = {}
    for plan_name in cfg.plan_list():
        plan = PLANS[plan_name][1](cfg.microbatches)
        # a policy that keeps the given layout by construction runs none's step: not a group of its own
        skip = {p: why for p in cfg.policy_list() if p != BASELINE
                if (why := nothing_to_balance(BalanceConfig(default=p), plan))}
        if skip:
            not_timed[plan_name] = skip
            say(f"[{plan_name}] not timed, none's layout by construction: {skip}")
        names = [n for n in cfg.policy_list() if n not in skip]
        policies = [n for n in names if n != BASELINE]
        if not policies:
            continue
        ratio_name = "real_step_time_ratio" + ("" if plan_name == "pipeline" else f"_{plan_name}")
        step_name = "real_" + ("" if plan_name == "pipeline" else f"{plan_name}_")
        for batching in batchings:
            run = run_batching(cfg, plan_name, batching, names, say, trace_dir)
            summary = summarize_batching(run)
            suffix = "" if batching == "padded" else f"_{batching}"
            ratio_figs = {p: summarize(summary[p]["repeat_ratio"], "ratio (measured)", "higher") for p in policies}
            best = max(policies, key=lambda p: ratio_figs[p]["value"])
            figures[f"{ratio_name}{suffix}"] = ratio_figs[best]
            for p in policies:
                figures[f"{ratio_name}{suffix}_{p}"] = ratio_figs[p]
            for n in names:
                figures[f"{step_name}{batching}_{n}_step_ms"] = summarize(
                    [t * 1e3 for t in summary[n]["repeat_step_s"]], "ms (measured)", "lower", digits=2)
            details[f"{plan_name}/{batching}"] = {
                "best_policy": best,
                "steps_per_repeat": run["steps_per_repeat"],
                "first_step_loss": run["first_loss"],
                "first_step_loss_max_rel_diff": run["first_loss_max_rel_diff"],
                "wall_s": round(run["wall_s"], 1),
                "groups": {n: _rounded(s) for n, s in summary.items()},
            }
            if verbose:
                _print_table(f"{plan_name}/{batching}", summary, ratio_figs, figures, best, names, step_name + batching)
    wall = time.perf_counter() - t0
    say(f"{NAME}: {wall:.0f} s in all")
    figures["config"] = {
        **asdict(cfg), "world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo",
        "plan": {name: PLANS[name][0] for name in cfg.plan_list()},
        "not_timed": not_timed,
        "optimizer": "loom.train.rank.make_optimizer (AdamW, [optim] weight decay, betas 0.9/0.95) with the run's "
                     "LR schedule",
        "path": "loom.train.rank.build_rank + RankRun.step, as loom train",
        "timing": "barrier to barrier per step around RankRun.step (dispatch, engine.step with its schedule and "
                  "optimizer step, LR scheduler, loss all-reduce); every group trains the same global batch at step "
                  "i, the groups taking turns step by step in a Williams order (every turn position and every "
                  "predecessor equally often per cycle); a repeat's ratio is none's step-time sum over the "
                  "policy's on the repeat's steps (the same batches), its step time their mean",
        "headline": "real_step_time_ratio[_colocated][_packed]: per plan and batching, the policy with the highest "
                    "median ratio (best_policy)",
        "runs": details, "wall_s": round(wall, 1),
    }
    return figures


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _print_table(run: str, summary: dict[str, dict[str, Any]], ratio_figs: dict[str, dict[str, Any]],
                 figures: dict[str, dict[str, Any]], best: str, names: list[str], step_prefix: str) -> None:
    def spread(f: dict[str, Any], fmt: str) -> str:
        lo, hi = f["spread"]
        return f"{f['value']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    rows = []
    for n in names:
        s = summary[n]
        ratio = "-" if n == BASELINE else spread(ratio_figs[n], ".3f")
        rows.append([n, spread(figures[f"{step_prefix}_{n}_step_ms"], ".0f"), ratio, f"{s['dispatch_ms']:.1f}",
                     f"{s['engine_step_ms']:.0f}", f"{s['compute_ms'][0]:.0f}/{s['compute_ms'][1]:.0f}",
                     f"{s['mb_max_over_mean']['vision']:.2f}", f"{s['mb_max_over_mean']['llm']:.2f}",
                     f"{s['llm_padded_over_real']:.2f}", f"{s['mean_microbatches']:.1f}",
                     f"{100 * s['same_layout_as_none']:.0f}%", f"{100 * s['kept_given']:.0f}%",
                     f"{100 * s['predicted_gain']:.1f}%", f"{s['eager_forward']:.2f}", s["peak_rss_mb"]])
    spread_is = next(iter(ratio_figs.values()))["spread_is"]
    print(f"\n{run} (plan / LLM rows; value [spread: {spread_is}] over the repeats)")
    print(format_table(["policy", "step ms", "none / policy", "dispatch ms", "engine step ms", "compute r0/r1 ms",
                        "vision mb max/mean", "llm mb max/mean", "LLM padded/real", "microbatches",
                        "none's layout", "kept given", "predicted gain", "eager forward", "peak RSS MB"], rows))
    per_repeat = "; ".join(f"{p} " + " ".join(f"{r:.3f}" for r in summary[p]["repeat_ratio"])
                           for p in names if p != BASELINE)
    print(f"per-repeat none / policy (step-time sums on the same batches): {per_repeat}")
    paired = []
    for n in names:
        if n == BASELINE:
            continue
        d = summary[n]["minus_none_ms"]
        paired.append([n, f"{d['total']:+.1f}", f"{d['dispatch']:+.1f}", f"{d['engine_step']:+.1f}",
                       f"{d['compute'][0]:+.1f}/{d['compute'][1]:+.1f}", f"{d['cpu'][0]:+.1f}/{d['cpu'][1]:+.1f}",
                       "/".join(f"{summary[n]['gc_ms'][r] - summary[BASELINE]['gc_ms'][r]:+.1f}" for r in range(WORLD_SIZE))])
    print("policy minus none on the same step (median over the timed steps, ms; CPU: the rank's process time; "
          "GC: mean time in Python's garbage collector)")
    print(format_table(["policy", "step", "dispatch", "engine step", "compute r0/r1", "CPU r0/r1", "GC r0/r1"], paired))
    print(f"best policy ({run}): {best}, none / {best} = {spread(ratio_figs[best], '.3f')}")


# ---- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    start_run()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, value in asdict(RealConfig()).items():
        if value is not None:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=" ")
    parser.add_argument("--min-gain", type=float, default=None,
                        help="balance.min_gain (default: the config's); negative: every policy uses its own layout")
    parser.add_argument("--out", type=Path, default=None, help="results directory; None: benchmarks/results")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write every rank's per-step timeline (events_to_dicts JSON) into this directory")
    args = parser.parse_args(argv)
    cfg = {name: getattr(args, name) for name in asdict(RealConfig())}
    figures = real_run(verbose=True, trace_dir=args.trace, **cfg)
    config = figures.pop("config")
    path = write_result(NAME, figures, config, machine_info(), args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
