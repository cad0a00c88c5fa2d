"""Simulator fidelity: the simulator's prediction against what ``loom train`` measures, per step
and per action (issue 8, point 5 and its acceptance).

What runs: ``--rounds`` rounds (default 5), each

1. **a profile**, from a separate ``loom profile`` run of the demo model (configs/demo.toml),
   one thread, with co-running processes standing in for the other ranks (none by default: the
   simulator prices the core sharing), written to a file *before any step of its round is
   measured*; the simulator loads that file as production would
   (`loom.cost.profile_file.load_profile_for`, then `loom.cost.profiled.ProfiledCostModel`). The
   first round's run measures everything (the CPU slowdown of sharing the host too,
   `loom.profile.contention`); later rounds' runs time the layers only (``--no-comm
   --no-dispatch --no-contention``) and take the communication and dispatcher fits and the
   contention from the first round's file. ``--profile PATH`` uses a stored profile in every round instead
   (it must match the model);
2. then **real steps on the production path** of ``loom train``: 4 local gloo processes (started
   once, idle while a profile runs), one thread each, the demo config with each case's
   overrides, each rank built by `loom.train.rank.build_rank` and stepped by `RankRun.step`
   (the training loop's own builder and iteration: the seeded sampler's global batch of that
   step, the `Dispatcher` with its metadata all-gather, the ``[balance]`` policy's layout and
   the payload all-to-all, then ``engine.step`` with the layout and its `RowMap`, the run's
   AdamW and LR schedule, the loss all-reduce): ``--warmup`` untimed then ``--steps`` timed
   steps of every case (the step numbers go on from round to round: every step has its own
   global batch). The cases:
   - ``demo``: the demo plan (vision and audio encoders in parallel on a rank each, a 2-stage
     LLM; multimodal 1F1B, 4 microbatches) under policy ``none``, ``disttrain`` and
     ``entrain`` (whose layout defers LLM work, entrain.md §3.6, so its schedule has split
     backwards);
   - ``dp2``: vision | audio | an LLM of data-parallel degree 2 (routed encoder->LLM edges,
     a gradient all-reduce), under ``none`` and ``orchmllm``.
   As in ``loom train``, the dispatcher reads (decodes) its shard's samples inside the step.
   Cases alternate within each step number, so every case samples the machine over the same
   minutes; a step runs from a barrier to the end of `RankRun.step` on the last rank (``max end
   - min start``, one clock), the dispatch included. Each rank's CPU time over the step is
   recorded beside it (what it computed, whatever the contention).

Rounds exist because this machine's speed drifts from minute to minute (other work, the VM):
a profile taken long before the steps prices a different machine. Each round pairs a profile
with the steps right after it, and the figures are medians over rounds with their spread.

**The simulation of the same IR**, for every timed step's batch with its round's profile: the
schedule ``engine.schedule_for`` runs for the layout (rebuilt here from the same metadata by the
same `make_layout`), each slot's workload per phase from the samples it holds
(`loom.cost.workload.sample_work`, right-padded LLM rows as the runtime collates them), the
dispatch priced by `loom.sim.dispatch` (the dispatcher's host work from the profile's fit; the
metadata all-gather and the payload all-to-alls over the profile's message link measured with
the sender waiting, ``latency_idle``, as every rank waits in those collectives; the decision at
its CPU time measured here before each round's steps, the median of repeated ``sample_costs`` +
``make_layout`` calls on the gathered metadata), and the loss all-reduce that ends the step (one
scalar over the world, `ProfiledCostModel.clip_time`'s pricing). The 4 ranks share this
machine's cores: the simulation prices that with `loom.sim.sharing.CoreSharing` (each rank
kept on one core as the kernel keeps it, processor sharing of each core, with the CPU slowdown
beside busy ranks that the profile measured, ``contention``, and the cold start the profile
measured for each action of a rank that shares its core), the profile being solo
(``--no-sharing`` plays each rank on a core of its own). The figures without that slowdown,
with the host's cores shared by all ranks instead, and without the cold start, are printed and
stored beside (``core_sharing.without_slowdown``, ``core_sharing.host_placement``,
``core_sharing.without_cold_start``).

Figures:

- ``median_abs_rel_error``: iteration level, per round the median over cases of ``|sim - real|
  / real`` with ``real`` the median step time of the case over the round's timed steps and
  ``sim`` the median of its simulated steps (the same steps); the figure is the median over
  rounds, its spread the rounds' [min, max] (target <= 0.15);
- ``action_median_abs_rel_error``: per action kind, the median over kinds of each kind's median
  ``|sim - real| / real``, where one observation is the time one rank spends in that kind in one
  step of one case (the sum of its matched actions' durations; real and simulated: the
  medians over the timed steps), for the kinds forward, backward, send/receive (every send and receive), gradient
  sync, optimizer and dispatch (target <= 0.25). Per rank-step sums rather than single actions
  because the simulator's sends take no time on their rank (their CPU cost is charged to the
  compute action around them, `ProfiledCostModel`), so single messages have no counterpart.
  Per round, then the median over rounds (spread over rounds). The per-kind table shows each
  kind's error per round and its summed times.
- ``max_abs_rel_error``: the worst case's iteration-level error (per round; median over rounds);
- ``cpu_median_abs_rel_error``: per round the median over every case's ranks of ``|sim - real| /
  real`` of one rank's CPU seconds per step (measured: ``time.process_time`` over `RankRun.step`,
  every thread, its main thread's share stored beside; simulated: its compute's core-time in the
  shared play, each action's solo time times the CPU slowdown it met beside busy ranks
  (`SimResult.cpu`; the time slicing costs waiting, not CPU), its collectives, the dispatcher's
  host work and the decision), the median over rounds. No target: it checks the cost model apart
  from the time slicing and drift (what the ranks compute, not when), so a large iteration error
  beside a small CPU error is the machine's load, not the profile's prices;
- ``sim_seconds_1024gpu_64mb``: seconds of one ``simulate`` of a 1024-GPU plan (simulated, not
  a measurement of training).

    python benchmarks/sim_fidelity.py [--rounds 5 --steps 5 --warmup 1 --cases 0,3 --profile PATH --out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import (WorkerGroup, figure, format_table, load_avg_1m, machine_info, spread_of, start_run,
                               write_result)
from loom.balance.payload import layout_payload_bytes, sample_payload_bytes
from loom.balance.policy import make_layout, sample_costs
from loom.cost.arch_from_model import arch_from_model
from loom.cost.comm import Link
from loom.cost.model import Workload
from loom.cost.profile_file import Profile, load_profile_for
from loom.cost.profiled import ProfiledCostModel
from loom.cost.workload import MetadataArrays, sample_work
from loom.data.sampler import GlobalBatchSampler
from loom.data.sample import SampleMeta
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.profile.corun import CoRunners
from loom.runtime.local import host_cores
from loom.runtime.stage import trainable_stages
from loom.schedule.generators import build_schedule
from loom.schedule.timeline import events_from_dicts, events_to_dicts
from loom.sim.dispatch import DISPATCH, Links, metadata_bytes, price_dispatch
from loom.sim.sharing import CoreSharing, profile_sharing
from loom.sim.simulator import simulate
from loom.train.build import build_data, build_model
from loom.train.rank import build_rank
from loom.train.config import TrainConfig, load_config

NAME = "sim_fidelity"
REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "demo.toml"
WORLD_SIZE = 4
TARGET_MEDIAN = 0.15
TARGET_ACTION = 0.25
# action kinds of the per-kind figure: timeline kind -> reported kind
KIND_OF = {"forward": "forward", "backward": "backward", "send_act": "send/receive", "recv_act": "send/receive",
           "send_grad": "send/receive", "recv_grad": "send/receive", "grad_sync": "gradient sync",
           "optimizer_step": "optimizer", DISPATCH: "dispatch"}
KINDS = ("forward", "backward", "send/receive", "gradient sync", "optimizer", "dispatch")
# A rank-step whose time in a kind is below this on both sides is left out of that kind's error:
# a relative error of two noise-level times (a grad sync with one replica: a no-op that the
# executor still records, a few microseconds) says nothing. Either side above it counts.
MIN_OBSERVATION_S = 1e-3


@dataclass
class Case:
    name: str
    overrides: list[str]  # on configs/demo.toml, as `loom train` takes them


def cases() -> list[Case]:
    dp2 = ["plan.modules.llm.num_stages=1", "plan.modules.llm.data_parallel=2"]
    return [
        Case("demo none", []),
        Case("demo disttrain", ['balance.default="disttrain"']),
        Case("demo entrain (deferral)", ['balance.default="entrain"']),
        Case("dp2 none", dp2),
        Case("dp2 orchmllm", dp2 + ['balance.default="orchmllm"']),
    ]


def train_config(case: Case) -> TrainConfig:
    return load_config(CONFIG, list(case.overrides))


def batch_indices(cfg: TrainConfig, step: int) -> list[int]:
    """The global batch of ``step``, as `loom train`'s sampler draws it."""
    return GlobalBatchSampler(cfg.data.demo.num_samples, cfg.data.global_batch_size, seed=cfg.run.seed).batch(step)


# ---- 1. the profile: a separate `loom profile` run -------------------------------------------
def run_profiler(out: Path, co_runners: int, repeats: int, layers_only: bool = False) -> float:
    """``loom profile`` of the demo config as a subprocess, written to ``out``; returns its wall
    seconds. ``layers_only`` skips the communication, dispatcher and contention measurements
    (``--no-comm --no-dispatch --no-contention``): a later round's profile, whose round takes
    those from the first round's stored profile (`round_profile`)."""
    # `python -m loom.cli` of this checkout (what the `loom` script runs), so the profile is of
    # this tree's code whatever the installed entry point points at
    cmd = [sys.executable, "-m", "loom.cli", "profile", "--config", str(CONFIG), "--out", str(out), "--threads", "1",
           "--co-runners", str(co_runners), "--repeats", str(repeats)] + (
               ["--no-comm", "--no-dispatch", "--no-contention"] if layers_only else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    print("  $ loom " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"loom profile failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def round_profile(path: Path, first: Path, model) -> Profile:
    """A round's stored profile as production loads it (`load_profile_for`); where it was taken
    ``layers_only``, its communication and dispatcher fits and its CPU contention come from
    the first round's stored profile ``first`` (both files exist before the round's steps run)."""
    profile = load_profile_for(path, model)
    if path != first and (profile.comm is None or not profile.dispatch or not profile.contention):
        base = load_profile_for(first, model)
        profile.comm = profile.comm or base.comm
        profile.dispatch = profile.dispatch or base.dispatch
        profile.contention = profile.contention or base.contention
    if profile.comm is None:
        raise SystemExit(f"the profile {first} has no communication fits: profile without --no-comm")
    return profile


# ---- 2. the real steps ------------------------------------------------------------------------
def _worker(rank: int, world_size: int, name: str, case_dicts: list[dict], commands, replies) -> None:
    runs = []
    for cd in case_dicts:
        runs.append(build_rank(train_config(Case(**cd)), torch.device("cpu")))
    replies.put(("ready", rank))
    while (r := commands[rank].get()) is not None:
        records = []
        for run in runs:
            dist.barrier()  # every rank is idle: the step's clock starts here
            start, cpu, main = time.time(), time.process_time(), time.thread_time()
            got = run.step(r, exact_timing=True)  # what `loom train` runs: sampler, dispatcher, engine, LR step
            end, cpu, main = time.time(), time.process_time() - cpu, time.thread_time() - main
            dist.barrier()
            records.append({"start": start, "dispatched": start + got.dispatch_s, "end": end, "cpu": cpu, "main": main,
                            "timeline": events_to_dicts(got.result.timeline)})
        replies.put(("step", rank, records))
    replies.put(("done", rank, 0.0))


def measure(group: WorkerGroup, selected: list[Case], steps: list[int], warmup: int, label: str) -> list[dict]:
    """Per case: step times, per-rank CPU seconds and, per timed step, every rank's measured
    events (the dispatch as one ``dispatch`` event per rank). ``warmup`` untimed steps run
    first (steps ``steps[0] - warmup`` on), then ``steps``; cases alternate within each."""
    per_case = [{"times": [], "steps": [], "cpu": [], "main": []} for _ in selected]
    for r in list(range(steps[0] - warmup, steps[0])) + steps:
        got = group.command(r)
        if r < steps[0]:
            continue
        for i, acc in enumerate(per_case):
            rows = [g[2][i] for g in got]
            acc["times"].append(max(x["end"] for x in rows) - min(x["start"] for x in rows))
            acc["cpu"].append([x["cpu"] for x in rows])
            acc["main"].append([x["main"] for x in rows])
            events = []
            for rank, x in enumerate(rows):
                events.append({"rank": rank, "kind": DISPATCH, "label": "dispatch", "module": "", "stage": 0,
                               "microbatch": -1, "start_s": x["start"], "end_s": x["dispatched"], "step": r})
                events += x["timeline"]
            acc["steps"].append(events)
        print(f"  {label} step {r}: " + " ".join(f"{acc['times'][-1] * 1e3:.0f}" for acc in per_case) + " ms",
              flush=True)
    return per_case


# ---- 3. the simulation -------------------------------------------------------------------------
def decision_seconds(cfg: TrainConfig, arch, metas: list[SampleMeta], repeats: int = 7) -> float:
    """The layout decision as every rank pays it (per-sample costs from the gathered metadata,
    then `make_layout`), measured here: the median CPU time (``time.process_time``, one thread)
    of ``repeats`` calls. CPU time, as the profile measures the dispatcher's host work: what the
    decision computes, whatever else runs on the machine; the simulator adds the ranks deciding
    at once on shared cores (`CoreSharing.concurrent_stretch`)."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        make_layout(cfg.balance, cfg.plan, sample_costs(arch, metas), "packed" if cfg.data.pack_sequences else "padded")
        times.append(time.process_time() - t0)
    return statistics.median(times)


@dataclass
class CaseModel:
    """What the simulation of a case needs, built once: its config (plan resolved), data set,
    model, architecture and LLM batching."""
    cfg: TrainConfig
    dataset: Any
    model: Any
    plan: Plan
    arch: Any
    batching: str


def case_model(case: Case) -> CaseModel:
    cfg = train_config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    plan = cfg.plan.resolve(model.layer_counts(), WORLD_SIZE)
    cfg.plan = plan
    return CaseModel(cfg, dataset, model, plan, arch_from_model(model),
                     "packed" if cfg.data.pack_sequences else "padded")


def measure_decisions(models: list[CaseModel], co_runners: int) -> list[float]:
    """Each case's decision time (`decision_seconds`), measured before any step with
    ``co_runners`` processes computing alongside, the contention the profile was taken under
    (solo by default: the simulator's core sharing prices the other ranks deciding at once)."""
    with CoRunners(co_runners):
        return [decision_seconds(cm.cfg, cm.arch, [cm.dataset.meta(i) for i in batch_indices(cm.cfg, 0)])
                for cm in models]


@dataclass
class Predicted:
    """One simulated step: the `SimResult`, the dispatch's price and ``iteration_s``, the
    simulated iteration plus the loss all-reduce that ends `RankStep` (``loss_reduce_s``)."""
    result: Any
    dispatch: Any
    loss_reduce_s: float

    @property
    def iteration_s(self) -> float:
        return self.result.iteration_time + self.loss_reduce_s


def predict(cm: CaseModel, step: int, profile: Profile, links: Links, decide_s: float,
            sharing: CoreSharing | None) -> Predicted:
    """The simulated step ``step`` of a case: the schedule `engine.schedule_for` runs for the
    layout the dispatcher decides, its slots' workloads, the dispatch priced (the decision taking
    ``decide_s``), the ranks sharing this host's cores as ``sharing`` says; then the step's loss
    all-reduce (`RankRun.step` sums the loss over the world after ``engine.step``: one scalar
    all-reduce every rank joins, priced as the cost model prices such a collective,
    `ProfiledCostModel.clip_time`)."""
    cfg, plan, arch, batching = cm.cfg, cm.plan, cm.arch, cm.batching
    metas = [cm.dataset.meta(i) for i in batch_indices(cfg, step)]
    layout = make_layout(cfg.balance, plan, sample_costs(arch, metas), batching)
    schedule = build_schedule(plan, trainable_stages(cm.model, plan), layout=layout, eager=cfg.balance.eager_forward)
    layout_plan = replace(plan, num_microbatches=layout.num_microbatches)  # as engine.schedule_for validates it
    cost = ProfiledCostModel(profile, cm.model, layout_plan)
    work = [{phase: sample_work(arch, [metas[s] for s in slots[j]], batching)[phase] for phase, slots in layout.slots.items()}
            for j in range(layout.num_microbatches)]
    per_sample = [sample_work(arch, [m], batching) for m in metas]
    dispatch = price_dispatch(WORLD_SIZE, links, metadata_bytes=metadata_bytes(metas, WORLD_SIZE),
                              decision_seconds=decide_s,
                              payload=layout_payload_bytes(plan, layout, sample_payload_bytes(arch, MetadataArrays.from_metas(metas))),
                              host_seconds=profile.dispatch_host_seconds(len(metas), WORLD_SIZE) or 0.0)
    result = simulate(schedule, layout_plan, cost, work, sample_work=per_sample, dispatch=dispatch, sharing=sharing,
                      clip=cfg.optim.max_grad_norm > 0)
    return Predicted(result, result.dispatch_parts, cost.clip_time())


def dispatch_links(profile: Profile) -> Links:
    """The link the dispatch's collectives run over: the profile's message latency measured
    with the sender *waiting* (``latency_idle``), since in the metadata all-gather and the
    payload all-to-alls every rank waits in the collective and none computes on (the pipeline's
    messages, whose senders compute on, use ``latency`` in `ProfiledCostModel`)."""
    comm = profile.comm
    fit = comm.latency_idle or comm.latency
    return Links.uniform(Link("gloo loopback (profiled, idle sender)", 1.0 / max(fit.seconds_per_byte, 1e-15),
                              fit.alpha_s))


def kind_totals(events: list) -> dict[tuple[int, str], float]:
    """(rank, reported kind) -> seconds in that kind in one step (`TimelineEvent`s or their dicts)."""
    out: dict[tuple[int, str], float] = {}
    for e in (events_from_dicts(events) if events and isinstance(events[0], dict) else events):
        kind = KIND_OF.get(e.kind)
        if kind is not None:
            out[(e.rank, kind)] = out.get((e.rank, kind), 0.0) + e.duration_s
    return out


def per_step_kinds(steps: list[list]) -> dict[tuple[int, str], list[float]]:
    """(rank, reported kind) -> its seconds in each step (`kind_totals` of every step's events)."""
    out: dict[tuple[int, str], list[float]] = {}
    for events in steps:
        for key, v in kind_totals(events).items():
            out.setdefault(key, []).append(v)
    return out


# ---- simulator speed ---------------------------------------------------------------------------
def simulator_speed(repeats: int = 3) -> tuple[float, dict[str, Any]]:
    """Seconds of one `simulate` call on a 1024-GPU plan with 64 microbatches (median of
    ``repeats`` calls, each with a fresh cost model; the schedule is built once, outside)."""
    from loom.cost.analytic import AnalyticCostModel
    from loom.cost.hardware import Cluster
    from loom.cost.model_configs import load_model_arch

    arch = load_model_arch(llm="llama3-70b", encoders={"vision": "vit-h-14"}, projector="mlp",
                           freeze=["vision.encoder"])
    # vision: TP 8 x DP 8 = 64 GPUs; LLM: TP 8 x PP 15 x DP 8 = 960 GPUs; 64 microbatches per pipeline
    plan = Plan([ModuleSpec("vision", data_parallel=8, tensor_parallel=8),
                 ModuleSpec(LLM, num_stages=15, data_parallel=8, tensor_parallel=8)],
                num_microbatches=64 * 8, schedule="1f1b")
    plan.resolve(arch.layer_counts(), 1024)
    trainable = {(m.name, s): any(l.trainable for l in arch.module(m.name).layers[slice(*plan.layers_of(m.name, s))])
                 for m in plan.modules for s in range(m.num_stages)}
    schedule = build_schedule(plan, trainable)
    gen = torch.Generator().manual_seed(0)
    work = []
    for _ in range(plan.num_microbatches):
        images = [int(n) for n in torch.randint(1, 5, (2,), generator=gen)]  # 2 samples of 1-4 images
        lengths = [256 * n + int(torch.randint(64, 1024, (1,), generator=gen)) for n in images]
        work.append({"vision": Workload.of_lengths([256] * sum(images)), LLM: Workload.padded(lengths)})
    times = []
    for _ in range(repeats):
        cost = AnalyticCostModel(arch, plan, Cluster("H100", num_gpus=1024, gpus_per_node=8))  # caches cold
        t0 = time.perf_counter()
        result = simulate(schedule, plan, cost, work)
        times.append(time.perf_counter() - t0)
    info = {"cost_model": "AnalyticCostModel (H100)", "world_size": plan.world_size, "pipeline_units": plan.num_units,
            "actions": sum(len(a) for a in schedule.actions.values()),
            "plan": "vision TP8 x DP8 (frozen encoder, trainable projector); llama3-70b TP8 x PP15 x DP8; 1F1B, "
                    "64 microbatches per pipeline (512 in all)",
            "simulated_iteration_s": round(result.iteration_time, 4),
            "timing": f"median of {repeats} simulate calls, each with a fresh cost model (its caches cold)",
            "all_seconds": [round(t, 4) for t in times]}
    return statistics.median(times), info


# ---- main ------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of (a `loom profile` stored to a file, then the timed steps of every case)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps of every case per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of every case per round, before them")
    ap.add_argument("--cases", type=str, default=None,
                    help="comma-separated case indices (default: all): "
                         + ", ".join(f"{i} {c.name}" for i, c in enumerate(cases())))
    ap.add_argument("--profile", type=Path, default=None,
                    help="a stored profile of the demo model to use in every round instead of running `loom profile`")
    ap.add_argument("--profile-repeats", type=int, default=3, help="`loom profile --repeats`")
    ap.add_argument("--co-runners", type=int, default=0,
                    help="`loom profile --co-runners`: processes computing while layers are timed (default 0: a "
                         "solo profile, the simulator pricing the ranks' core sharing)")
    ap.add_argument("--no-sharing", action="store_true",
                    help="simulate every rank on a core of its own (no core sharing; for comparison)")
    ap.add_argument("--out", type=Path, default=None, help="results directory; default benchmarks/results")
    args = ap.parse_args(argv)
    for flag, value, low in (("--rounds", args.rounds, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                             ("--profile-repeats", args.profile_repeats, 1), ("--co-runners", args.co_runners, 0)):
        if value < low:
            ap.error(f"{flag} {value}: use {low} or more")
    return args


def round_sharing(profile: Profile, no_sharing: bool, **changes: Any) -> CoreSharing | None:
    """The core sharing a round is simulated under: this host's cores shared by the world's
    ranks, with the CPU slowdown of the profile's contention measurement (`loom.profile.contention`,
    `contention_slowdown`) where it has one, each rank kept on one core (`loom.sim.sharing.place_units`)
    and paying its cold start where it shares it; ``changes`` replace `CoreSharing` fields (the
    ablations); None with ``--no-sharing``."""
    if no_sharing:
        return None
    return replace(profile_sharing(profile, host_cores(), WORLD_SIZE), **changes)


# the model's parts left out one at a time, each simulated over the same measured rounds:
# name -> (what is left out, the `CoreSharing` fields that leave it out)
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "without_slowdown": ("without the CPU slowdown of sharing", {"slowdown": ()}),
    "host_placement": ("sharing the host's cores by processor sharing (placement=\"host\")", {"placement": "host"}),
    "without_cold_start": ("without the cold start of the actions of ranks sharing a core", {"cold_start": False}),
}


def compare_round(selected: list[Case], models: list[CaseModel], measured: list[dict], steps: list[int],
                  profile: Profile, decisions: list[float], sharing: CoreSharing | None) -> dict[str, Any]:
    """One round's comparison: per case the median measured and simulated step (the same
    steps, each simulated with its own global batch) and their error; per action kind the
    observations (relative error, measured, simulated seconds) of every rank-step."""
    links = dispatch_links(profile)
    cases_out, observations = [], {k: [] for k in KINDS}
    for case, cm, meas, decide_s in zip(selected, models, measured, decisions):
        sims = [predict(cm, step, profile, links, decide_s, sharing) for step in steps]
        # each rank's simulated CPU: its compute's core-time (solo times the CPU slowdown each
        # action met beside the host's other busy ranks, `SimResult.cpu`; no time slicing, which
        # costs waiting, not CPU), its collectives, the dispatcher's host work and the decision
        # (at the slowdown of every rank deciding at once), against its measured CPU time
        solo = [predict(cm, step, profile, links, decide_s, None) for step in steps]
        slow = sharing.slowdown_at(WORLD_SIZE) if sharing is not None else 1.0
        sim_cpu = [statistics.median(
            (s.result.cpu if sharing is not None else p.result.compute)[r] + p.result.sync[r] + p.dispatch.decide * slow
            + (p.dispatch.host_per_rank[r] if p.dispatch.host_per_rank else p.dispatch.host)
            for s, p in zip(sims, solo)) for r in range(WORLD_SIZE)]
        real_cpu = [statistics.median(c[r] for c in meas["cpu"]) for r in range(WORLD_SIZE)]
        real = statistics.median(meas["times"])
        predicted = statistics.median(p.iteration_s for p in sims)
        sim_kinds, real_kinds = per_step_kinds([p.result.timeline for p in sims]), per_step_kinds(meas["steps"])
        per_kind = {}
        for key in sorted(set(sim_kinds) | set(real_kinds)):
            r = statistics.median(real_kinds[key]) if key in real_kinds else 0.0
            s = statistics.median(sim_kinds[key]) if key in sim_kinds else 0.0
            per_kind[f"r{key[0]} {key[1]}"] = {"measured_ms": round(r * 1e3, 3), "simulated_ms": round(s * 1e3, 3)}
            if r > 0 and max(r, s) >= MIN_OBSERVATION_S:
                observations[key[1]].append((abs(s - r) / r, r, s))
        cases_out.append({
            "case": case.name, "overrides": case.overrides, "steps": steps,
            "measured_ms": [round(t * 1e3, 3) for t in meas["times"]],
            "predicted_ms": [round(p.iteration_s * 1e3, 3) for p in sims],
            "real_s": real, "predicted_s": predicted, "abs_rel_error": abs(predicted - real) / real,
            "dispatch_measured_s": statistics.median([e["end_s"] - e["start_s"] for ev in meas["steps"] for e in ev
                                                      if e["kind"] == DISPATCH]),
            "dispatch_simulated_s": statistics.median(p.dispatch.total for p in sims),
            "loss_reduce_simulated_ms": round(sims[0].loss_reduce_s * 1e3, 3),
            # CPU seconds of each rank's whole step (every thread): what it computed, whatever
            # the contention; beside the wall times it separates work from waiting
            "cpu_ms_per_rank": [round(t * 1e3, 3) for t in real_cpu],
            # of which the rank's main thread (the rest: gloo's threads moving messages and
            # running collectives, which the simulator does not price as CPU)
            "main_thread_cpu_ms_per_rank": [round(statistics.median(c[r] for c in meas["main"]) * 1e3, 3)
                                            for r in range(WORLD_SIZE)],
            "simulated_cpu_ms_per_rank": [round(t * 1e3, 3) for t in sim_cpu],
            "cpu_abs_rel_error": [abs(s - r) / r for s, r in zip(sim_cpu, real_cpu)],
            "dispatch_first_step": sims[0].dispatch.summary(), "per_rank_kind": per_kind})
    kind_errors = {k: statistics.median(o[0] for o in obs) for k, obs in observations.items() if obs}
    errors = [c["abs_rel_error"] for c in cases_out]
    return {"cases": cases_out, "observations": observations, "kind_errors": kind_errors,
            "cpu_median_abs_rel_error": statistics.median(e for c in cases_out for e in c["cpu_abs_rel_error"]),
            "median_abs_rel_error": statistics.median(errors), "max_abs_rel_error": max(errors),
            "action_median_abs_rel_error": statistics.median(kind_errors.values())}


def main(argv=None) -> dict:
    args = parse_args(argv)
    start_run()
    all_cases = cases()
    try:
        chosen = [int(i) for i in args.cases.split(",")] if args.cases else list(range(len(all_cases)))
        selected = [all_cases[i] for i in chosen]
    except (ValueError, IndexError):
        raise SystemExit(f"--cases {args.cases!r}: give indices 0..{len(all_cases) - 1} separated by commas")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print(f"{NAME}: {len(selected)} cases on the production path (Dispatcher + engine.step with the layout), "
          f"{WORLD_SIZE} gloo processes x 1 thread; {args.rounds} rounds of (profile -> {args.warmup} warmup + "
          f"{args.steps} timed steps of every case)")
    models = [case_model(c) for c in selected]
    rounds, profile_seconds, loads = [], [], []
    with tempfile.TemporaryDirectory(prefix="loom-sim-fidelity-") as tmp:
        group = WorkerGroup(NAME, _worker, WORLD_SIZE, [asdict(c) for c in selected])
        measured_rounds = []
        try:
            group.wait_ready()
            per_round = args.warmup + args.steps
            for k in range(args.rounds):
                # the round's profile is stored before any of its steps runs (the workers idle)
                path = args.profile if args.profile is not None else Path(tmp) / f"profile{k}.json"
                if args.profile is None:
                    profile_seconds.append(run_profiler(path, args.co_runners, args.profile_repeats, layers_only=k > 0))
                    print(f"  round {k + 1}: profiled in {profile_seconds[-1]:.0f} s -> {path}", flush=True)
                # the decision times too, measured before the round's steps
                decisions = measure_decisions(models, args.co_runners)
                print(f"  round {k + 1}: decisions " + ", ".join(f"{c.name} {d * 1e3:.1f} ms"
                                                           for c, d in zip(selected, decisions)), flush=True)
                steps = list(range(k * per_round + args.warmup, (k + 1) * per_round))
                load_before = load_avg_1m()
                measured = measure(group, selected, steps, args.warmup, f"round {k + 1}/{args.rounds}")
                loads.append([load_before, load_avg_1m()])  # the machine's load around the steps
                # loaded now, as a run loads its stored profile; the first round's file gives the
                # communication and dispatcher fits to the later, layers-only ones
                first = args.profile if args.profile is not None else Path(tmp) / "profile0.json"
                measured_rounds.append((round_profile(path, first, models[0].model), steps, measured, decisions))
            group.close()
        finally:
            for p in group.procs:
                if p.is_alive():
                    p.terminate()
        print(f"  measured in {time.perf_counter() - t_start:.0f} s")
        ablated: dict[str, list[dict]] = {k: [] for k in ABLATIONS}  # the same rounds, a part of the model left out
        for profile, steps, measured, decisions in measured_rounds:
            rounds.append(compare_round(selected, models, measured, steps, profile, decisions,
                                        round_sharing(profile, args.no_sharing)))
            if args.no_sharing:
                continue
            for name, (_, changes) in ABLATIONS.items():
                if name != "without_slowdown" or profile.contention:
                    ablated[name].append(compare_round(selected, models, measured, steps, profile, decisions,
                                                       round_sharing(profile, False, **changes)))

    print()
    header = ["case"] + [f"r{k + 1} {h}" for k in range(len(rounds)) for h in ("measured", "predicted", "error")]
    rows = []
    for i, case in enumerate(selected):
        row = [case.name]
        for rd in rounds:
            c = rd["cases"][i]
            row += [c["real_s"] * 1e3, c["predicted_s"] * 1e3, f"{(c['predicted_s'] - c['real_s']) / c['real_s']:+.1%}"]
        rows.append(row)
    print("step time (ms; median of each round's timed steps), measured and predicted, per round; the 1-minute load "
          "average before and after each round's steps: " + ", ".join(f"r{k + 1} {a}-{b}" for k, (a, b) in enumerate(loads)))
    print(format_table(header, rows))
    print()
    def per_rank(i: int, key: str) -> str:  # median over rounds, per rank
        return " ".join(f"{statistics.median(rd['cases'][i][key][r] for rd in rounds):.0f}" for r in range(WORLD_SIZE))

    print("dispatch, and each rank's CPU time per step (ms, ranks 0-3; medians over rounds): measured (all threads, "
          "and the main thread alone), and simulated (compute's core-time, collectives, dispatcher host work, decision)")
    print(format_table(["case", "dispatch measured", "dispatch simulated", "CPU measured", "main thread",
                        "CPU simulated"],
                       [[c.name, statistics.median(rd["cases"][i]["dispatch_measured_s"] for rd in rounds) * 1e3,
                         statistics.median(rd["cases"][i]["dispatch_simulated_s"] for rd in rounds) * 1e3,
                         per_rank(i, "cpu_ms_per_rank"), per_rank(i, "main_thread_cpu_ms_per_rank"),
                         per_rank(i, "simulated_cpu_ms_per_rank")]
                        for i, c in enumerate(selected)]))
    kind_rows = []
    for kind in KINDS:
        obs = [o for rd in rounds for o in rd["observations"][kind]]
        per_round = [rd["kind_errors"][kind] for rd in rounds if kind in rd["kind_errors"]]
        if not obs:
            kind_rows.append([kind, 0, "-", "-", "-", "-"])
            continue
        kind_rows.append([kind, len(obs), f"{statistics.median(per_round):.3f}",
                          " ".join(f"{e:.2f}" for e in per_round), sum(o[1] for o in obs) * 1e3,
                          sum(o[2] for o in obs) * 1e3])
    print()
    print(f"per action kind: one observation = one rank's time in the kind in one step of one case "
          f"(left out when under {MIN_OBSERVATION_S * 1e3:.0f} ms on both sides); error: median over rounds of "
          f"each round's median")
    print(format_table(["kind", "rank-steps", "median |sim-real|/real", "per round", "measured ms (sum)",
                        "simulated ms (sum)"], kind_rows))
    med_r = [rd["median_abs_rel_error"] for rd in rounds]
    act_r = [rd["action_median_abs_rel_error"] for rd in rounds]
    worst_r = [rd["max_abs_rel_error"] for rd in rounds]
    cpu_r = [rd["cpu_median_abs_rel_error"] for rd in rounds]
    med, action, worst = statistics.median(med_r), statistics.median(act_r), statistics.median(worst_r)
    cpu = statistics.median(cpu_r)
    print(f"\nmedian_abs_rel_error = {med:.3f} (target <= {TARGET_MEDIAN}; rounds "
          f"{' '.join(f'{v:.3f}' for v in med_r)}), action_median_abs_rel_error = {action:.3f} (target <= "
          f"{TARGET_ACTION}; rounds {' '.join(f'{v:.3f}' for v in act_r)}), max_abs_rel_error = {worst:.3f}, "
          f"cpu_median_abs_rel_error = {cpu:.3f} (rounds {' '.join(f'{v:.3f}' for v in cpu_r)})")
    contention = [p.contention for p, *_ in measured_rounds][0] if measured_rounds else {}
    ablation_figures = {name: {k: round(statistics.median(rd[k] for rd in rds), 4) for k in (
        "median_abs_rel_error", "action_median_abs_rel_error", "cpu_median_abs_rel_error")}
        for name, rds in ablated.items() if rds}
    for name, got in ablation_figures.items():
        note = (f" (contention {contention.get('cpu_ratio', 1.0):.3f} x at {contention.get('busy')} busy ranks)"
                if name == "without_slowdown" else "")
        print(f"{ABLATIONS[name][0]}{note}: " + ", ".join(f"{k} = {v:.3f}" for k, v in got.items()))

    sim_s, sim_info = simulator_speed()
    print(f"sim_seconds_1024gpu_64mb = {sim_s:.3f} s ({sim_info['pipeline_units']} pipeline units, "
          f"{sim_info['actions']} actions; simulated, the issue asks for under 1 s)")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    figures = {
        "median_abs_rel_error": figure(med, "fraction", "lower", *spread_of(med_r)),
        "action_median_abs_rel_error": figure(action, "fraction", "lower", *spread_of(act_r)),
        "max_abs_rel_error": figure(worst, "fraction", "lower", *spread_of(worst_r)),
        "cpu_median_abs_rel_error": figure(cpu, "fraction", "lower", *spread_of(cpu_r)),
        "sim_seconds_1024gpu_64mb": figure(sim_s, "s", "lower", *spread_of(sim_info["all_seconds"])),
    }
    config = {
        "world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo", "num_rounds": args.rounds,
        "timed_steps_per_round": args.steps, "warmup_steps_per_round": args.warmup,
        "config": "configs/demo.toml with each case's overrides",
        "path": "build_rank + RankRun.step, as loom/train/main.py (Dispatcher.dispatch, ParallelEngine.step with "
                "the layout, LR scheduler, loss all-reduce)",
        "timing": "per step: max end - min start over the ranks, from a barrier, dispatch included; per round the "
                  "median over its timed steps; cases alternate within each step",
        "profile": ("stored profile " + str(args.profile) + " in every round") if args.profile else
                   f"per round a separate `loom profile` run stored before that round's steps (--threads 1, "
                   f"--co-runners {args.co_runners}, --repeats {args.profile_repeats}; rounds after the first "
                   f"--no-comm --no-dispatch, taking those fits from the first round's file), loaded with "
                   f"load_profile_for; seconds {[round(s) for s in profile_seconds]}",
        "figures": "each figure per round (median over cases; over kinds of each kind's median over rank-steps), "
                   "then the median over rounds; spread: over rounds",
        "dispatch_model": "loom.sim.dispatch: the dispatcher's host work from the profile's fit (loom.profile."
                          "dispatch, CPU time per rank, shared cores), ring all-gather of the metadata table and one "
                          "all-to-all per phase over the profiled idle-sender message link (latency_idle fit), "
                          f"decision CPU time measured before each round's steps with {args.co_runners} co-runners",
        "loss_all_reduce": "RankRun.step's scalar loss all-reduce after engine.step, added to the simulated "
                           "iteration (ProfiledCostModel.clip_time: the all-reduce fit carried to the world)",
        "core_sharing": None if args.no_sharing else {
            "cores": host_cores(), "ranks_per_host": WORLD_SIZE,
            "model": "loom.sim.sharing (each rank kept on one core, placed by place_units; processor sharing "
                     "of each core, fixed point; CPU slowdown beside busy ranks from the "
                     "first profile's contention measurement, loom.profile.contention; the wake-up delay of a "
                     "receive that blocked and whose message arrived with every core computing, from the first "
                     "profile's latency_full fit, Communication.wake_delay; the communicator threads' CPU per "
                     "message as background load on the cores, the first profile's thread_send/thread_recv fits, "
                     "CostModel.transfer_cpu)",
            "contention": contention,
            "wake_s": round(measured_rounds[0][0].comm.wake_delay(), 6) if measured_rounds else None,
            **{name: ablation_figures.get(name) for name in ABLATIONS}},
        "kind_errors_per_round": [{k: round(v, 4) for k, v in rd["kind_errors"].items()} for rd in rounds],
        # the first round's message and all-reduce fits (what the simulator charges per message)
        "profile_comm": {k: {"alpha_ms": round(v["alpha_s"] * 1e3, 4), "ms_per_mb": round(v["seconds_per_byte"] * 1e9, 4)}
                         for k, v in measured_rounds[0][0].comm.to_dict().items() if isinstance(v, dict)}
                        if measured_rounds and measured_rounds[0][0].comm else None,
        "rounds": [{"load_avg_1m_around_steps": load, "median_abs_rel_error": round(rd["median_abs_rel_error"], 4),
                    "action_median_abs_rel_error": round(rd["action_median_abs_rel_error"], 4),
                    "cpu_median_abs_rel_error": round(rd["cpu_median_abs_rel_error"], 4),
                    "cases": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()}
                              for c in rd["cases"]]} for rd, load in zip(rounds, loads)],
        "simulator_speed": sim_info,
    }
    path = write_result(NAME, figures, config, machine_info(), args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
