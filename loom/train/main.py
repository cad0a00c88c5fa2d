"""The training loop: the ``torchrun`` target.

    torchrun --nproc-per-node 4 -m loom.train.main --config runs/demo/config.toml --run-dir runs/demo

One obvious loop (torchtitan style): every rank builds its share of the run with
`loom.train.rank.build_rank` (the model from the same seed, cut to its stage; the optimizer, LR
schedule, sampler and `Dispatcher`) and runs `RankRun.step` once per step: the global batch's
sample indices from the seeded sampler; the dispatcher loads each rank's share, gathers the
metadata, applies the ``[balance]`` policy and moves every payload to the ranks that run it;
each rank runs its share of the schedule. The benchmarks call the same two functions.
Rank 0 writes ``metrics.jsonl``, ``balance.jsonl`` (per step: the policy, the microbatches'
dataset indices per phase, max/mean load across replicas and microbatches) and, at the end,
``trace.json`` with every rank's timeline of the last step. Every rank writes its output to
``logs/rank<R>.log`` and how it ended to ``logs/rank<R>.exit.json``; rank 0 marks the run
``completed`` in ``status`` (`loom.train.status`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loom.balance.policy import load_stats
from loom.schedule.timeline import write_chrome_trace
from loom.train.config import TrainConfig, load_config
from loom.train.launch import SUPERVISOR_ENV, die_with_parent
from loom.train.rank import build_rank, lr_lambda
from loom.train.status import LOGS, RankExit, Terminated, classify, write_pid, write_status


def init_distributed(device_kind: str) -> torch.device:
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timedelta(minutes=10))
        return torch.device("cuda", local)
    torch.set_num_threads(1)  # several ranks share the cores of one CPU machine
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return torch.device("cpu")


def train(cfg: TrainConfig, run_dir: Path) -> None:
    device = init_distributed(cfg.run.device)
    rank = dist.get_rank()
    run = build_rank(cfg, device)
    if rank == 0:
        cfg.plan.to_json(run_dir / "plan.json")
        # the unbalanced iteration's schedule as the engine runs it (after any bubble fill)
        run.engine.schedule_for(run.engine.identity_layout(cfg.data.global_batch_size)).to_json(run_dir / "schedule.json")

    progress = None
    metrics = balance_log = None
    if rank == 0:
        metrics = open(run_dir / "metrics.jsonl", "w")
        balance_log = open(run_dir / "balance.jsonl", "w")
        if sys.stdout.isatty():  # a live bar in a terminal; plain log lines in files and CI logs
            from tqdm import tqdm

            progress = tqdm(total=cfg.run.steps, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True)

    last_timeline = []
    for step in range(cfg.run.steps):
        done = run.step(step, exact_timing=step == cfg.run.steps - 1)  # the traced step
        got, loss, step_time = done.dispatched, done.loss, done.total_s
        last_timeline = done.result.timeline
        if rank == 0:
            row = {
                "step": step,
                "loss": round(loss, 6),
                "samples_per_s": round(len(done.indices) / step_time, 3),
                "step_time_s": round(step_time, 4),
                "target_tokens": got.num_targets,
                "lr": cfg.optim.lr * lr_lambda(cfg)(step),
            }
            if len(done.losses) > 1:  # generators: each loss term on its own ("loss" is their sum)
                row.update({f"loss_{m}": round(v, 6) for m, v in done.losses.items()})
            if done.result.grad_norm is not None:  # optim.max_grad_norm > 0: the pre-clip global norm
                row["grad_norm"] = round(done.result.grad_norm, 6)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            balance_log.write(json.dumps({
                "step": step,
                "policy": got.layout.policy, "kept_given": got.layout.kept_given, "predicted_gain": got.layout.predicted_gain,
                "kept_why": got.layout.kept_why,
                "nodewise": got.layout.nodewise,
                "num_microbatches": got.layout.num_microbatches,
                "max_over_mean": load_stats(got.layout, cfg.plan, got.costs),
                "microbatches": {p: [[done.indices[s] for s in slot] for slot in v] for p, v in got.layout.slots.items()},
            }) + "\n")
            if progress is not None:
                progress.set_postfix(loss=f"{loss:.3f}", samples_s=f"{row['samples_per_s']:.1f}")
                progress.update(1)
            elif step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                terms = "".join(f"  {m} {v:.4f}" for m, v in done.losses.items()) if len(done.losses) > 1 else ""
                print(f"step {step:5d}/{cfg.run.steps}  loss {loss:.4f}{terms}  "
                      f"{row['samples_per_s']:7.1f} samples/s  {step_time * 1e3:7.1f} ms/step", flush=True)

    if rank == 0 and set(got.layout.policy.values()) != {"none"}:
        # a balanced run's schedule changes with its layout: keep the last step's next to the base one
        run.engine.schedule_for(got.layout).to_json(run_dir / "schedule_last_step.json")
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(last_timeline, gathered, dst=0)
    if rank == 0:
        if progress is not None:
            progress.close()
        metrics.close()
        balance_log.close()
        events = [e for per_rank in gathered for e in per_rank]
        t_min = min(e.start_s for e in events)
        for e in events:
            e.start_s -= t_min
            e.end_s -= t_min
        roles = {r: " + ".join("{}.stage{} dp{}".format(*role) for role in cfg.plan.stages_of(r))
                 for r in range(dist.get_world_size())}  # every stage the rank hosts
        write_chrome_trace(events, run_dir / "trace.json", roles)
    run.close()  # no send in flight when the group goes (issue 8, point 16)
    dist.barrier()
    dist.destroy_process_group()


def _own_output(run_dir: Path, rank: int) -> None:
    """Send this rank's stderr (tracebacks, warnings, native library messages) to
    ``logs/rank<R>.log``, and its stdout too except on rank 0, whose progress lines stay on
    the terminal; `loom train` prints one line for the whole run instead."""
    logs = run_dir / LOGS
    logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 2)
    if rank != 0:
        os.dup2(fd, 1)
    os.close(fd)


_stopping = False  # set once this rank is ending: a second signal must not cut its record short


def _raise_terminated(signum: int, frame: object) -> None:
    # a stop usually comes twice (from `loom train` and from torchrun); only the first one
    # raises, so a Terminated cannot escape the handler below while it writes the exit record
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> None:
    global _stopping
    ap = argparse.ArgumentParser(description="loom training process (launched by torchrun; see `loom train`)")
    ap.add_argument("--config", required=True, help="resolved TOML config")
    ap.add_argument("--run-dir", required=True, help="run directory for metrics and traces")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    # die with torchrun (which dies with `loom train`); exit now if `loom train` is already gone
    supervisor = os.environ.get(SUPERVISOR_ENV)
    die_with_parent(int(supervisor) if supervisor and supervisor.isdigit() else None)
    _own_output(run_dir, rank)
    write_pid(run_dir, rank)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _raise_terminated)
    try:
        cfg = load_config(args.config)
        # the nodes of this launch (a run started by hand with torchrun on several nodes)
        local = os.environ.get("LOCAL_WORLD_SIZE")
        cfg.check_ranks_per_node(int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None)
        train(cfg, run_dir)
    except BaseException as e:  # noqa: BLE001 - every way a rank ends is recorded
        _stopping = True
        state, reason = classify(e)
        traceback.print_exc()
        RankExit(rank, os.getpid(), state, reason, time.time()).write(run_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        # skip interpreter teardown: destructors of a broken process group can hang or abort
        os._exit(143 if state == "terminated" else 1)
    RankExit(rank, os.getpid(), "done", "", time.time()).write(run_dir)
    if rank == 0:
        write_status(run_dir, "completed")  # also for runs started by hand with torchrun


if __name__ == "__main__":
    main()
