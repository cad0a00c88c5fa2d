"""Placements, measured: real 2-rank CPU runs of the demo model under ``disaggregated``,
``first_stage`` and ``colocated`` (issue 10's acceptance), and ``colocated`` with Optimus's
bubble fill, each beside the simulator's prediction of the same steps.

    python -m benchmarks.placements [--repeats 5 --warmup 2 --only disaggregated,colocated ...]

The model: the demo's (configs/demo.toml's sizes) without the audio encoder, a vision encoder
and a 4-layer Llama, in ``benchmarks/placements.toml``; the demo data (global batch 16, 4
microbatches), policy ``none``, the run's AdamW and LR schedule. Each placement runs on the
same 2 ranks (`PLACEMENTS`; docs/plans.md, "First-stage placement", "Colocated placement"):

- ``disaggregated``: vision on rank 0, the LLM (one stage) on rank 1 (loom's own layout);
- ``first_stage``: vision inside the LLM's first pipeline stage (rank 0), the LLM in 2 stages
  (Megatron-LM's and Cornstarch's baseline layout, cornstarch.md §3.1);
- ``colocated``: vision at DP 2 (a replica on each rank), the LLM in 2 stages (optimus.md
  §2.3's colocation without its bubble scheduler);
- ``colocated_dp``: vision at DP 2 and the LLM at DP 2, one stage (OrchMLLM's all-DP setup,
  orchmllm.md §2.3);
- ``optimus``: ``colocated`` with ``plan.bubble_fill = "optimus"``: each iteration's schedule
  with vision's forward and backward blocks moved into the LLM's bubbles (optimus.md §3.2 to
  §3.6, `loom.sim.bubble_fill`), the fill timed by the benchmark's own ``loom profile``
  (``run.profile``, as a user runs it after profiling). Every placement keeps `Plan.resolve`'s
  stage boundaries: the profile steers the fill only, not the partition ``loom train`` would
  derive from it, so ``optimus``'s LLM stages are those of ``colocated`` and ``first_stage``.

The profile (below) is taken before any group starts, so ``optimus``'s ranks read it when they
build. Each placement is a group of 2 fresh gloo processes with one thread each (the machine has 2
cores: a pipeline bubble is real idle time), built by `loom.train.rank.build_rank` and stepped by
`RankRun.step`, what ``loom train`` runs. Every group trains the same global batch at step
``i``; the groups take turns step by step in a Williams order (`benchmarks.balance_real.turn_orders`),
``--warmup`` untimed steps, then ``--repeats`` repeats of one turn cycle each. A step runs from a
barrier to a barrier around `RankRun.step` (the slower rank's clock): dispatch, schedule,
optimizer, LR step, loss all-reduce. The step-0 losses of all groups must agree (same batch,
same initial weights: reference semantics), or the script fails.

The prediction: before any step, ``loom profile`` of ``placements.toml``'s model (one thread)
is written to a file; the simulator loads it as production does (`load_profile_for`,
`ProfiledCostModel`) and plays, for every timed step's global batch, the schedule the engine
runs for that placement and layout (for ``optimus``, the engine's own transform,
`loom.train.build.bubble_filler`, applied as `ParallelEngine.schedule_for` applies it), with
the dispatch priced (`loom.sim.dispatch`), the 2 ranks sharing the host's cores
(`CoreSharing`) and the loss all-reduce, as ``benchmarks/sim_fidelity.py`` does for the demo.

Figures, per placement ``<p>``:

- ``placement_<p>_step_ms`` (lower is better): the median over repeats of a repeat's mean
  step time, spread over the repeats (IQR for 5 or more, else min-max);
- ``placement_<p>_samples_per_s`` (higher): global batch over step time, per repeat;
- ``placement_<p>_sim_step_ms`` (lower): the median simulated step over the same timed steps,
  and ``placement_<p>_sim_samples_per_s`` (higher) the global batch over it;
- ``placement_<p>_sim_abs_rel_error`` (lower): ``|sim - real| / real`` of those medians;

and between placements, against the baseline ``<b>`` (``--baseline``, disaggregated by default;
``benchmarks/optimus.py`` runs ``first_stage`` against ``optimus`` with ``first_stage`` as it):

- ``placement_step_ratio_<b>_over_<p>`` (higher: ``<p>`` is faster than ``<b>``): per repeat,
  ``<b>``'s step-time sum over ``<p>``'s on the same global batches; median over repeats with
  spread;
- ``placement_sim_ratio_<b>_over_<p>``: the simulator's prediction of that ratio (its median
  simulated steps' ratio), beside it.

The config's ``placements_detail`` records per placement its resolved plan, the compute order
of the schedule its engine ran on the first timed step's batch (`compute_order`) and, for a
filled one, whether the fill changed the generator's schedule (``fill_changed_schedule``); its
``profile`` how the profile was taken and on what. Writes ``benchmarks/results/placements.json``
(not with ``--only``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.balance_real import paired_ratio, turn_orders
from benchmarks.common import (WorkerGroup, figure, format_table, machine_info, median, peak_rss_mb, start_run,
                               summarize, write_result)

NAME = "placements"
REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "benchmarks" / "placements.toml"
WORLD_SIZE = 2
BASELINE = "disaggregated"
LOSS_RTOL = 1e-4
# placement -> (what it is, overrides on placements.toml, as `loom train` takes them)
PLACEMENTS: dict[str, tuple[str, list[str]]] = {
    "disaggregated": ("vision on rank 0, the LLM (1 stage) on rank 1", []),
    "first_stage": ("vision inside LLM stage 0 (rank 0), the LLM in 2 stages",
                    ['plan.placement="first_stage"', "plan.modules.llm.num_stages=2"]),
    "colocated": ("vision DP 2 (a replica per rank), the LLM in 2 stages",
                  ['plan.placement="colocated"', "plan.modules.vision.data_parallel=2", "plan.modules.llm.num_stages=2"]),
    "colocated_dp": ("vision DP 2 and the LLM DP 2, one stage (OrchMLLM's all-DP setup)",
                     ['plan.placement="colocated"', "plan.modules.vision.data_parallel=2",
                      "plan.modules.llm.data_parallel=2"]),
    "optimus": ("colocated with Optimus's bubble fill: vision's blocks moved into the LLM's bubbles",
                ['plan.placement="colocated"', "plan.modules.vision.data_parallel=2", "plan.modules.llm.num_stages=2",
                 'plan.bubble_fill="optimus"']),
}
# placements whose run takes the benchmark's `loom profile` as ``run.profile`` (the fill's timing)
PROFILED = frozenset({"optimus"})


@dataclass
class BenchConfig:
    placements: str = "disaggregated,first_stage,colocated,colocated_dp,optimus"  # the groups; must hold the baseline
    baseline: str = BASELINE  # the placement every ratio is taken against
    repeats: int = 5  # timed repeats, each one whole turn cycle
    warmup: int = 2  # untimed steps per group before the repeats
    profile_repeats: int = 3  # `loom profile --repeats`
    no_sharing: bool = False  # simulate each rank on a core of its own

    def names(self) -> list[str]:
        return [p for p in self.placements.split(",") if p]

    def steps_per_repeat(self) -> int:
        return len(turn_orders(self.names()))

    def check(self) -> "BenchConfig":
        names = self.names()
        unknown = [p for p in names if p not in PLACEMENTS]
        if self.baseline not in PLACEMENTS:
            raise ValueError(f"--baseline {self.baseline!r}: choose one of {list(PLACEMENTS)}")
        if unknown or self.baseline not in names or len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"--placements {self.placements!r}: list the baseline {self.baseline!r} and at least one "
                             f"other of {list(PLACEMENTS)}, each once"
                             + (f" ({unknown} are not placements)" if unknown else ""))
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats}: give 1 or more (5 or more for an IQR spread)")
        if self.warmup < 1:
            raise ValueError(f"--warmup {self.warmup}: give 1 or more (the first step builds the schedule caches)")
        if self.profile_repeats < 1:
            raise ValueError(f"--profile-repeats {self.profile_repeats}: give 1 or more")
        return self


def train_config(placement: str, steps: int, profile: str = ""):
    """The `TrainConfig` of ``placement`` (placements.toml with its overrides), ``run.steps``
    the group's whole run (so the LR schedule is that of a run of this length); a `PROFILED`
    placement gets ``profile`` (a ``loom profile`` JSON) as ``run.profile`` (without one, its
    fill times actions on the analytic model, as ``loom train`` does without ``run.profile``)."""
    from loom.train.config import load_config

    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: choose one of {list(PLACEMENTS)}")
    overrides = PLACEMENTS[placement][1] + [f"run.steps={steps}"]
    if profile and placement in PROFILED:
        overrides.append(f"run.profile={json.dumps(str(profile))}")  # a TOML basic string
    return load_config(CONFIG, overrides)


# ---- the real steps, on each rank of a group -------------------------------------------------
def _worker(rank: int, world_size: int, group: str, placement: str, steps: int, profile: str, commands: list,
            replies) -> None:
    from loom.train.rank import build_rank

    run = build_rank(train_config(placement, steps, profile), torch.device("cpu"))
    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        dist.barrier()  # every rank idle: the step's clock starts here
        t0, c0 = time.perf_counter(), time.process_time()
        done = run.step(i)
        c1 = time.process_time()
        dist.barrier()
        replies.put(("step", rank, i, done.loss, {"total": time.perf_counter() - t0, "cpu": c1 - c0,
                                                  "dispatch": done.dispatch_s, "engine_step": done.engine_s,
                                                  "indices": list(done.indices)}))
    run.close()
    replies.put(("done", rank, peak_rss_mb()))


class Group(WorkerGroup):
    """One placement's 2 processes; per step the slower rank's times."""

    def __init__(self, placement: str, steps: int, profile: str):
        super().__init__(placement, _worker, WORLD_SIZE, placement, steps, profile)
        self.placement = placement
        self.losses: list[float] = []
        self.steps: list[dict[str, Any]] = []
        self.peak_rss_mb: list[float] = []

    def step(self, i: int) -> dict[str, Any]:
        got = self.command(i)
        self.losses.append(got[0][3])  # all-reduced: the same on every rank
        infos = [r[4] for r in got]
        step = {k: max(info[k] for info in infos) for k in ("total", "dispatch", "engine_step")}
        step["cpu"] = [info["cpu"] for info in infos]
        step["indices"] = infos[0]["indices"]
        self.steps.append(step)
        return step


def run_groups(cfg: BenchConfig, say: Any, profile: str) -> dict[str, Group]:
    """Every placement's group (a `PROFILED` one reading ``profile``, which must exist now),
    alternating step by step; checks the pairing (same batches, same first loss)."""
    names = cfg.names()
    total = cfg.warmup + cfg.repeats * cfg.steps_per_repeat()
    groups: dict[str, Group] = {}
    try:
        for name in names:
            groups[name] = Group(name, total, profile)
        for g in groups.values():
            g.wait_ready()
        orders = turn_orders(names)
        for i in range(total):
            for name in orders[(i - cfg.warmup) % len(orders)]:
                groups[name].step(i)
            kind = "warmup" if i < cfg.warmup else f"repeat {(i - cfg.warmup) // cfg.steps_per_repeat() + 1}"
            say(f"  step {i + 1:3d} ({kind}): " + ", ".join(f"{n} {groups[n].steps[-1]['total'] * 1e3:.0f} ms"
                                                           for n in names))
        for g in groups.values():
            g.peak_rss_mb = g.close()
    finally:
        for g in groups.values():
            for p in g.procs:
                if p.is_alive():
                    p.terminate()
    check_same_work({n: g.losses[0] for n, g in groups.items()}, {n: [s["indices"] for s in g.steps] for n, g in groups.items()},
                    cfg.baseline)
    return groups


def check_same_work(first_loss: dict[str, float], indices: dict[str, list[list[int]]],
                    baseline: str = BASELINE) -> float:
    """Every placement trained the same global batches and, on the first, computed the same
    loss (reference semantics: a placement moves work, it does not change it); returns the
    largest relative loss difference. Raises otherwise: the timings would compare other work."""
    ref = first_loss[baseline]
    rel = {n: abs(v - ref) / max(abs(ref), 1e-12) for n, v in first_loss.items()}
    if max(rel.values()) > LOSS_RTOL:
        raise RuntimeError(f"the placements compute different first-step losses {first_loss}: they do not do the "
                           f"same work (relative difference above {LOSS_RTOL}), the timings would be meaningless")
    for n, steps in indices.items():
        if steps != indices[baseline]:
            raise RuntimeError(f"placement {n!r} trained other global batches than {baseline!r}; the paired ratio "
                               f"needs the same batch at every step")
    return max(rel.values())


def repeat_sums(times: list[float], warmup: int, repeats: int, per_repeat: int) -> list[list[float]]:
    """The timed steps (after ``warmup``) cut into ``repeats`` repeats of ``per_repeat`` steps."""
    if len(times) != warmup + repeats * per_repeat:
        raise ValueError(f"repeat_sums: {len(times)} steps, expected warmup {warmup} + {repeats} x {per_repeat}")
    timed = times[warmup:]
    return [timed[r * per_repeat:(r + 1) * per_repeat] for r in range(repeats)]


# ---- the prediction ------------------------------------------------------------------------
def run_profiler(out: Path, repeats: int) -> float:
    """``loom profile`` of placements.toml's model (one thread, solo) as a subprocess of this
    checkout, written to ``out`` before any step; returns its wall seconds."""
    cmd = [sys.executable, "-m", "loom.cli", "profile", "--config", str(CONFIG), "--out", str(out), "--threads", "1",
           "--repeats", str(repeats)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"loom profile failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


@dataclass
class PlacementModel:
    """What simulating one placement's steps needs, built once; ``transform`` is the engine's
    `ParallelEngine.schedule_transform` under the plan's ``bubble_fill`` (None: none)."""
    cfg: Any
    dataset: Any
    model: Any
    plan: Any
    arch: Any
    transform: Callable[[Any, Any], Any] | None = None


def placement_model(placement: str, steps: int, profile: str = "") -> PlacementModel:
    """``placement``'s config (`train_config`, with ``profile``), model and resolved plan, and
    the schedule transform `loom.train.rank.build_rank` gives its engine (the same call on the
    same config, model, data and plan: `loom.train.build.bubble_filler`)."""
    from loom.cost.arch_from_model import arch_from_model
    from loom.train.build import bubble_filler, build_data, build_model

    cfg = train_config(placement, steps, profile)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    cfg.plan = cfg.plan.resolve(model.layer_counts(), WORLD_SIZE)
    transform = bubble_filler(cfg, model, dataset, cfg.plan) if cfg.plan.bubble_fill != "none" else None
    return PlacementModel(cfg, dataset, model, cfg.plan, arch_from_model(model), transform)


def step_layout(pm: PlacementModel, step: int) -> tuple[list[Any], Any]:
    """The metadata of ``step``'s global batch and the layout the dispatcher decides for it."""
    from benchmarks.sim_fidelity import batch_indices
    from loom.balance.policy import make_layout, sample_costs

    batching = "packed" if pm.cfg.data.pack_sequences else "padded"
    metas = [pm.dataset.meta(i) for i in batch_indices(pm.cfg, step)]
    return metas, make_layout(pm.cfg.balance, pm.plan, sample_costs(pm.arch, metas), batching)


def engine_schedule(pm: PlacementModel, layout: Any) -> Any:
    """The schedule the engine runs for ``layout``, as `ParallelEngine.schedule_for` builds it:
    the plan's generator, then the placement's transform (Optimus's fill) on the plan with the
    layout's microbatch count."""
    from loom.runtime.stage import trainable_stages
    from loom.schedule.generators import build_schedule

    schedule = build_schedule(pm.plan, trainable_stages(pm.model, pm.plan), layout=layout,
                              eager=pm.cfg.balance.eager_forward)
    if pm.transform is not None:
        schedule = pm.transform(schedule, replace(pm.plan, num_microbatches=layout.num_microbatches))
    return schedule


def compute_order(schedule: Any, plan: Any) -> dict[str, list[str]]:
    """Per unit (``"<unit> <module> stage <s>"``), its compute actions in the order it runs them,
    as ``<module><stage> F<microbatch>`` (forward) or ``B`` (any backward kind): which schedule
    a placement ran, in a form a reader can compare."""
    from loom.schedule.ir import ActionKind

    letters = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B", ActionKind.BACKWARD_INPUT: "Bi",
               ActionKind.BACKWARD_WEIGHT: "Bw"}
    out = {}
    for u, acts in sorted(schedule.actions.items()):
        module, stage, _ = plan.role_of_unit(u)
        out[f"{u} {module} stage {stage}"] = [f"{a.module}{a.stage} {letters[a.kind]}{a.microbatch}"
                                              for a in acts if a.kind in letters]
    return out


def predict_step(pm: PlacementModel, step: int, profile: Any, decide_s: float, sharing: Any) -> tuple[float, list[float]]:
    """The simulated seconds of ``step`` under the placement, as `benchmarks.sim_fidelity.predict`
    prices a demo step (the layout the dispatcher decides, the schedule the engine builds for
    it with the placement's transform, `engine_schedule`, the dispatch, the core sharing) at this benchmark's world size, plus the loss
    all-reduce that ends `RankRun.step`; and per rank the CPU seconds of its compute (every
    unit it hosts: `SimResult.cpu`), to set beside the measured CPU time."""
    from benchmarks.sim_fidelity import dispatch_links
    from loom.balance.payload import layout_payload_bytes, sample_payload_bytes
    from loom.cost.profiled import ProfiledCostModel
    from loom.cost.workload import MetadataArrays, sample_work
    from loom.sim.dispatch import metadata_bytes, price_dispatch
    from loom.sim.simulator import simulate

    cfg, plan, arch = pm.cfg, pm.plan, pm.arch
    batching = "packed" if cfg.data.pack_sequences else "padded"
    metas, layout = step_layout(pm, step)
    schedule = engine_schedule(pm, layout)
    layout_plan = replace(plan, num_microbatches=layout.num_microbatches)
    cost = ProfiledCostModel(profile, pm.model, layout_plan)
    work = [{phase: sample_work(arch, [metas[s] for s in slots[j]], batching)[phase] for phase, slots in layout.slots.items()}
            for j in range(layout.num_microbatches)]
    per_sample = [sample_work(arch, [m], batching) for m in metas]
    dispatch = price_dispatch(WORLD_SIZE, dispatch_links(profile), metadata_bytes=metadata_bytes(metas, WORLD_SIZE),
                              decision_seconds=decide_s,
                              payload=layout_payload_bytes(plan, layout,
                                                           sample_payload_bytes(arch, MetadataArrays.from_metas(metas))),
                              host_seconds=profile.dispatch_host_seconds(len(metas), WORLD_SIZE) or 0.0)
    result = simulate(schedule, layout_plan, cost, work, sample_work=per_sample, dispatch=dispatch, sharing=sharing,
                      clip=cfg.optim.max_grad_norm > 0)
    per_unit = result.cpu if result.cpu is not None else result.compute  # None: no core sharing, CPU = compute
    cpu = [sum(t for u, t in per_unit.items() if result.first_rank[u] == r) for r in range(WORLD_SIZE)]
    return result.iteration_time + cost.clip_time(), cpu


def core_sharing(profile: Any, no_sharing: bool) -> Any:
    """This host's cores shared by the 2 ranks, with the profile's measured CPU slowdown beside
    a busy rank (`benchmarks.sim_fidelity.round_sharing` at this world size); None: a core each."""
    from loom.runtime.local import host_cores
    from loom.sim.sharing import profile_sharing

    if no_sharing:
        return None
    return profile_sharing(profile, host_cores(), WORLD_SIZE)


def predictions(cfg: BenchConfig, profile_path: Path, timed_steps: list[int],
                total: int) -> tuple[dict[str, list[tuple[float, list[float]]]], dict[str, dict[str, Any]]]:
    """Per placement, `predict_step` of every timed step (the decision's CPU time measured
    here, on step 0's batch, as `benchmarks.sim_fidelity.decision_seconds` does); and per
    placement its resolved plan and the schedule its engine runs on the first timed step's
    batch (`compute_order`; for a filled one, also whether the fill changed the generator's)."""
    from benchmarks.sim_fidelity import batch_indices, decision_seconds
    from loom.cost.profile_file import load_profile_for

    out, ran = {}, {}
    for name in cfg.names():
        pm = placement_model(name, total, str(profile_path))
        layout = step_layout(pm, timed_steps[0])[1]
        schedule = engine_schedule(pm, layout)
        ran[name] = {"plan": pm.plan.to_dict(), "schedule_kind": schedule.kind,
                     "compute_order_first_timed_step": compute_order(schedule, pm.plan)}
        if pm.transform is not None:
            plain = engine_schedule(replace(pm, transform=None), layout)
            ran[name]["fill_changed_schedule"] = plain.actions != schedule.actions
        profile = load_profile_for(profile_path, pm.model)
        if profile.comm is None:
            raise RuntimeError(f"the profile {profile_path} has no communication fits: profile without --no-comm")
        decide_s = decision_seconds(pm.cfg, pm.arch, [pm.dataset.meta(i) for i in batch_indices(pm.cfg, 0)])
        sharing = core_sharing(profile, cfg.no_sharing)
        out[name] = [predict_step(pm, s, profile, decide_s, sharing) for s in timed_steps]
    return out, ran


def profile_summary(path: Path, repeats: int, wall_s: float) -> dict[str, Any]:
    """What the result records of the benchmark's profile (the file itself is a temporary):
    how it was taken and what it measured on."""
    data = json.loads(path.read_text())
    return {"command": f"loom profile --config {CONFIG.relative_to(REPO)} --threads 1 --repeats {repeats}",
            "signature_hash": data.get("signature_hash"), "device": data.get("device"),
            "dtype": data.get("dtype"), "settings": data.get("settings"),
            "matmul_flops_per_s": data.get("matmul_flops_per_s"), "contention": data.get("contention"),
            "wall_s": round(wall_s, 1), "read_by": ["the simulator's ProfiledCostModel (every placement)"]
            + [f"{p}'s run.profile (its bubble fill's timing)" for p in sorted(PROFILED)]}


# ---- figures -------------------------------------------------------------------------------
def placement_figures(names: list[str], repeats: dict[str, list[list[float]]], simulated: dict[str, list[float]],
                      global_batch: int, baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """The figures of the module docstring from each placement's timed steps grouped by repeat
    (``repeats[p][r]``: seconds, the same global batches across placements) and its simulated
    timed steps (seconds, the same steps in order), the ratios against ``baseline``."""
    figs: dict[str, dict[str, Any]] = {}
    base = repeats[baseline]
    for n in names:
        means = [sum(rep) / len(rep) for rep in repeats[n]]
        real = median([t for rep in repeats[n] for t in rep])
        sim = median(simulated[n])
        figs[f"placement_{n}_step_ms"] = summarize([m * 1e3 for m in means], "ms (measured)", "lower", digits=2)
        figs[f"placement_{n}_samples_per_s"] = summarize([global_batch / m for m in means], "samples/s (measured)",
                                                         "higher", digits=2)
        figs[f"placement_{n}_sim_step_ms"] = figure(sim * 1e3, "ms (simulated)", "lower", digits=2)
        figs[f"placement_{n}_sim_samples_per_s"] = figure(global_batch / sim, "samples/s (simulated)", "higher",
                                                          digits=2)
        figs[f"placement_{n}_sim_abs_rel_error"] = figure(abs(sim - real) / real, "fraction", "lower")
    for n in names:
        if n == baseline:
            continue
        figs[f"placement_step_ratio_{baseline}_over_{n}"] = summarize(
            [paired_ratio(b, p) for b, p in zip(base, repeats[n])], "ratio (measured)", "higher")
        figs[f"placement_sim_ratio_{baseline}_over_{n}"] = figure(
            median(simulated[baseline]) / median(simulated[n]), "ratio (simulated)", "higher")
    return figs


# ---- the run -------------------------------------------------------------------------------
def measure(cfg: BenchConfig, say: Any = print) -> tuple[dict[str, Any], dict[str, Any]]:
    names, per = cfg.names(), cfg.steps_per_repeat()
    total = cfg.warmup + cfg.repeats * per
    timed_steps = list(range(cfg.warmup, total))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / "profile.json"
        say(f"{NAME}: loom profile of {CONFIG.name} (1 thread) -> {profile_path}")
        profile_s = run_profiler(profile_path, cfg.profile_repeats)
        profile = profile_summary(profile_path, cfg.profile_repeats, profile_s)
        say(f"{NAME}: {names}, {WORLD_SIZE} gloo processes x 1 thread each; {cfg.warmup} warmup + {cfg.repeats} "
            f"repeats x {per} timed steps, the placements taking turns step by step")
        groups = run_groups(cfg, say, str(profile_path))
        say(f"{NAME}: simulating the {len(timed_steps)} timed steps of each placement")
        predicted, ran = predictions(cfg, profile_path, timed_steps, total)
    simulated = {n: [p[0] for p in got] for n, got in predicted.items()}
    global_batch = train_config(cfg.baseline, total).data.global_batch_size
    repeats = {n: repeat_sums([s["total"] for s in g.steps], cfg.warmup, cfg.repeats, per) for n, g in groups.items()}
    figures = placement_figures(names, repeats, simulated, global_batch, cfg.baseline)
    details = {n: {"what": PLACEMENTS[n][0], "overrides": PLACEMENTS[n][1]
                   + (["run.profile=<the benchmark's profile>"] if n in PROFILED else []),
                   **ran[n], "first_step_loss": g.losses[0],
                   "dispatch_ms": round(median([s["dispatch"] for s in g.steps[cfg.warmup:]]) * 1e3, 3),
                   "engine_step_ms": round(median([s["engine_step"] for s in g.steps[cfg.warmup:]]) * 1e3, 3),
                   "cpu_ms_per_rank": [round(median([s["cpu"][r] for s in g.steps[cfg.warmup:]]) * 1e3, 3)
                                       for r in range(WORLD_SIZE)],
                   "measured_ms": [round(s["total"] * 1e3, 3) for s in g.steps[cfg.warmup:]],
                   "simulated_ms": [round(t * 1e3, 3) for t in simulated[n]],
                   # what each rank computes, measured (CPU time over RankRun.step, every thread)
                   # and simulated (its units' compute): apart from waiting and the machine's load
                   "simulated_compute_cpu_ms_per_rank": [round(median([p[1][r] for p in predicted[n]]) * 1e3, 3)
                                                         for r in range(WORLD_SIZE)],
                   "peak_rss_mb": max(g.peak_rss_mb)} for n, g in groups.items()}
    config = {**asdict(cfg), "config_file": str(CONFIG.relative_to(REPO)), "world_size": WORLD_SIZE,
              "threads_per_process": 1, "backend": "gloo", "global_batch": global_batch,
              "steps_per_repeat": per, "timed_steps": timed_steps, "profile_wall_s": round(profile_s, 1),
              "profile": profile,
              "path": "loom.train.rank.build_rank + RankRun.step, as loom train",
              "timing": "barrier to barrier around RankRun.step, the slower rank; every placement trains the same "
                        "global batch at step i, the placements taking turns in a Williams order",
              "simulation": "the same timed steps' batches, a loom profile of the model taken before the steps "
                            "(ProfiledCostModel), dispatch priced, the ranks sharing the host's cores",
              "ratio_direction": f"placement_step_ratio_{cfg.baseline}_over_<p> above 1: <p> is faster than "
                                 f"{cfg.baseline}",
              "first_step_loss_max_rel_diff": check_same_work({n: g.losses[0] for n, g in groups.items()},
                                                              {n: [s["indices"] for s in g.steps]
                                                               for n, g in groups.items()}, cfg.baseline),
              "placements_detail": details, "wall_s": round(time.perf_counter() - t0, 1)}
    return figures, config


def main(argv: list[str] | None = None) -> None:
    start_run()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, value in asdict(BenchConfig()).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, type=type(value), default=value, help=" ")
    ap.add_argument("--only", default="", help="comma-separated placements to run (with the baseline); prints "
                    "and writes no result file, so a partial run never replaces the full one")
    args = ap.parse_args(argv)
    values = {name: getattr(args, name) for name in asdict(BenchConfig())}
    if args.only:
        values["placements"] = ",".join(dict.fromkeys([args.baseline] + [p for p in args.only.split(",") if p]))
    try:
        cfg = BenchConfig(**values).check()
    except ValueError as e:
        ap.error(str(e))
    figures, config = measure(cfg)
    rows = [[name, f"{f['value']:.4g}", f["unit"], f["better"],
             "" if f["spread"] is None else f"{f['spread'][0]:.4g}-{f['spread'][1]:.4g}"] for name, f in figures.items()]
    print(format_table(["figure", "value", "unit", "better", "spread"], rows))
    for n, d in config["placements_detail"].items():
        print(f"{n}: CPU ms per rank, measured {d['cpu_ms_per_rank']}, simulated compute "
              f"{d['simulated_compute_cpu_ms_per_rank']}"
              + (f"; the fill changed the schedule: {d['fill_changed_schedule']}" if "fill_changed_schedule" in d else ""))
    print(f"{NAME}: {config['wall_s']} s in all (profile {config['profile_wall_s']} s)")
    if args.only:
        print("(--only: no result file written)")
        return
    print(f"wrote {write_result(NAME, figures, config, machine_info())}")


if __name__ == "__main__":
    main()
