"""The training loop: the ``torchrun`` target.

    torchrun --nproc-per-node 4 -m loom.train.main --config runs/demo/config.toml --run-dir runs/demo

One obvious loop (torchtitan style): every rank builds its share of the run with
`loom.train.rank.build_rank` (the model from the same seed, cut to its stage; the optimizer, LR
schedule, sampler and `Dispatcher`) and runs `RankRun.step` once per step: the global batch's
sample indices from the seeded sampler; the dispatcher loads each rank's share, gathers the
metadata, applies the ``[balance]`` policy and moves every payload to the ranks that run it;
each rank runs its share of the schedule. The benchmarks call the same two functions.
Rank 0 writes ``metrics.jsonl`` (and, with ``run.tensorboard``, the same numbers as TensorBoard
scalars in ``tensorboard/``, `loom.train.scalars`), ``balance.jsonl`` (per step: the policy, the microbatches'
dataset indices per phase, max/mean load across replicas and microbatches) and, at the end,
``trace.json`` with every rank's timeline of the last step. With ``run.eval_every``, every rank
evaluates the held-out split (``data.eval_samples``, `RankRun.evaluate`: forward only, the state
untouched) after every ``eval_every``-th step and the last, and its mean loss joins that step's
row as ``eval_loss``. Every rank writes its output to
``logs/rank<R>.log`` and how it ended to ``logs/rank<R>.exit.json``; rank 0 marks the run
``completed`` in ``status`` (`loom.train.status`).

Checkpoints (`loom.train.checkpoint`): every ``run.checkpoint_every`` steps (with
``run.checkpoint_async`` in the background, completed at a later step boundary), after the last
step, and on SIGTERM (both after any save in flight): the first SIGTERM during the training
loop asks for a stop; the ranks agree on it at the next step boundary (a one-element
all-reduce before each step), save a checkpoint there and exit cleanly. SIGINT (Ctrl-C, and
the supervisor's stop after a failure) stops a rank at once, without a checkpoint, as before.
``--resume CKPT`` continues from a checkpoint: ``metrics.jsonl`` and ``balance.jsonl`` keep the
steps before it and are appended to.
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
from loom.train.checkpoint import Checkpointer, truncate_log
from loom.train.config import TrainConfig, load_config
from loom.train.launch import SUPERVISOR_ENV, die_with_parent
from loom.train.rank import build_rank, lr_lambda
from loom.train.scalars import TensorBoardScalars
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


def _stop_agreed(device: torch.device) -> bool:
    """Whether any rank was asked to stop (SIGTERM): the same answer on every rank, so they all
    stop at the same step boundary."""
    flag = torch.tensor([1.0 if _stop_requested else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _say(progress, text: str) -> None:
    if progress is not None:
        progress.write(text)
    else:
        print(text, flush=True)


def train(cfg: TrainConfig, run_dir: Path, resume: Path | None = None) -> int | None:
    """Train ``cfg`` (from the checkpoint ``resume``, if given); returns the step a SIGTERM
    stopped the run at (a checkpoint of it saved), None when every step ran."""
    global _graceful
    device = init_distributed(cfg.run.device)
    rank = dist.get_rank()
    run = build_rank(cfg, device)
    checkpointer = Checkpointer(run, run_dir, asynchronous=cfg.run.checkpoint_async)
    start = 0
    if resume is not None:
        t0 = time.perf_counter()
        start = checkpointer.load(resume)
        if rank == 0:
            print(f"resumed from {resume} at step {start} ({time.perf_counter() - t0:.2f} s)", flush=True)
    if rank == 0:
        cfg.plan.to_json(run_dir / "plan.json")
        # the unbalanced iteration's schedule as the engine runs it (after any bubble fill)
        run.engine.schedule_for(run.engine.identity_layout(cfg.data.global_batch_size)).to_json(run_dir / "schedule.json")

    progress = None
    metrics = balance_log = board = None
    if rank == 0:
        if resume is not None:  # the steps before the checkpoint stay; later ones run again
            truncate_log(run_dir / "metrics.jsonl", start)
            truncate_log(run_dir / "balance.jsonl", start)
        metrics = open(run_dir / "metrics.jsonl", "a" if resume is not None else "w")
        balance_log = open(run_dir / "balance.jsonl", "a" if resume is not None else "w")
        if cfg.run.tensorboard:  # the same rows as scalars (loom.train.scalars)
            board = TensorBoardScalars(run_dir, resume_step=start if resume is not None else None)
        if sys.stdout.isatty():  # a live bar in a terminal; plain log lines in files and CI logs
            from tqdm import tqdm

            progress = tqdm(total=cfg.run.steps, initial=start, desc="train", unit="step", file=sys.stdout,
                            dynamic_ncols=True)

    def background_done(saved: tuple[int, float] | None) -> None:
        if saved is not None and rank == 0:
            _say(progress, f"checkpoint step_{saved[0]} saved in the background ({saved[1]:.2f} s)")

    last_timeline = []
    got = None
    stopped = None
    every = cfg.run.checkpoint_every
    _graceful = True  # from here a SIGTERM asks for a stop at a step boundary (`_on_sigterm`)
    for step in range(start, cfg.run.steps):
        background_done(checkpointer.poll())  # run.checkpoint_async: the save in flight finished (or failed) everywhere?
        if _stop_agreed(device):
            stopped = step
            break
        done = run.step(step, exact_timing=step == cfg.run.steps - 1)  # the traced step
        got, loss, step_time = done.dispatched, done.loss, done.total_s
        last_timeline = done.result.timeline
        evals = None  # run.eval_every: the held-out split's mean losses (every rank takes part)
        if cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or step == cfg.run.steps - 1):
            evals = run.evaluate(step)
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
            if cfg.data.on_error == "skip":  # samples replaced while loading (each named in logs/rank<R>.log)
                row["skipped_samples"] = done.skipped_samples
            if done.result.grad_norm is not None:  # optim.max_grad_norm > 0: the pre-clip global norm
                row["grad_norm"] = round(done.result.grad_norm, 6)
            if evals is not None:  # the split's mean token loss (plus each generator's, as "loss" sums them)
                row["eval_loss"] = round(sum(evals.values()), 6)
                if len(evals) > 1:
                    row.update({f"eval_loss_{m}": round(v, 6) for m, v in evals.items()})
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if board is not None:
                board.write(row)
            balance_log.write(json.dumps({
                "step": step,
                "policy": got.layout.policy, "kept_given": got.layout.kept_given, "predicted_gain": got.layout.predicted_gain,
                "kept_why": got.layout.kept_why,
                "nodewise": got.layout.nodewise,
                "num_microbatches": got.layout.num_microbatches, "eager_forward": got.layout.eager_forward,
                "max_over_mean": load_stats(got.layout, cfg.plan, got.costs),
                "microbatches": {p: [[done.indices[s] for s in slot] for slot in v] for p, v in got.layout.slots.items()},
            }) + "\n")
            evaluated = f"  eval_loss {row['eval_loss']:.4f}" if evals is not None else ""
            if progress is not None:
                progress.set_postfix(loss=f"{loss:.3f}", samples_s=f"{row['samples_per_s']:.1f}")
                progress.update(1)
                if evals is not None:  # kept above the bar, where a postfix would be overwritten
                    _say(progress, f"step {step:5d}/{cfg.run.steps}{evaluated}")
            elif step % cfg.run.log_every == 0 or step == cfg.run.steps - 1 or evals is not None:
                terms = "".join(f"  {m} {v:.4f}" for m, v in done.losses.items()) if len(done.losses) > 1 else ""
                print(f"step {step:5d}/{cfg.run.steps}  loss {loss:.4f}{terms}  "
                      f"{row['samples_per_s']:7.1f} samples/s  {step_time * 1e3:7.1f} ms/step{evaluated}", flush=True)
        if every and (step + 1) % every == 0 and step + 1 < cfg.run.steps:
            if cfg.run.checkpoint_async:  # written while the next steps run; `latest` names it once done
                background_done(checkpointer.wait())  # at most one in flight: the previous one first
                seconds = checkpointer.save_async(step + 1)
                if rank == 0:
                    _say(progress, f"checkpoint step_{step + 1} saving in the background (step blocked {seconds:.2f} s)")
            else:
                seconds = checkpointer.save(step + 1)
                if rank == 0:
                    _say(progress, f"checkpoint step_{step + 1} saved ({seconds:.2f} s)")

    end = cfg.run.steps if stopped is None else stopped
    background_done(checkpointer.wait())  # an asynchronous save still in flight completes (or raises) first
    # a resumed run that ran no step has its checkpoint already, as has a stop right after a periodic save
    if (end > start or resume is None) and checkpointer.last_step != end:
        seconds = checkpointer.save(end)
        if rank == 0:
            _say(progress, f"checkpoint step_{end} saved ({seconds:.2f} s)")
    if rank == 0 and got is not None and set(got.layout.policy.values()) != {"none"}:
        # a balanced run's schedule changes with its layout: keep the last step's next to the base one
        run.engine.schedule_for(got.layout).to_json(run_dir / "schedule_last_step.json")
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(last_timeline, gathered, dst=0)
    if rank == 0:
        if progress is not None:
            progress.close()
        metrics.close()
        balance_log.close()
        if board is not None:
            board.close()
        events = [e for per_rank in gathered for e in per_rank]
    if rank == 0 and events:  # no step ran: a resumed run already at its end, or one stopped at once
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
    return stopped


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
_graceful = False  # in the training loop: SIGTERM asks for a checkpoint and a stop at the next step
_stop_requested = False  # a SIGTERM came during the training loop


def _raise_terminated(signum: int, frame: object) -> None:
    # a stop usually comes twice (from `loom train` and from torchrun); only the first one
    # raises, so a Terminated cannot escape the handler below while it writes the exit record
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


def _on_sigterm(signum: int, frame: object) -> None:
    # in the loop, a stop where every rank can save: the next step boundary (`_stop_agreed`);
    # before it (setup) nothing new is there to save, so stop at once as SIGINT does
    global _stop_requested
    if _graceful:
        _stop_requested = True
        return
    _raise_terminated(signum, frame)


def main(argv: list[str] | None = None) -> None:
    global _stopping
    ap = argparse.ArgumentParser(description="loom training process (launched by torchrun; see `loom train`)")
    ap.add_argument("--config", required=True, help="resolved TOML config")
    ap.add_argument("--run-dir", required=True, help="run directory for metrics and traces")
    ap.add_argument("--resume", default=None, metavar="CHECKPOINT",
                    help="continue from this checkpoint directory (runs/<name>/checkpoints/step_<N>)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    # die with torchrun (which dies with `loom train`); exit now if `loom train` is already gone
    supervisor = os.environ.get(SUPERVISOR_ENV)
    die_with_parent(int(supervisor) if supervisor and supervisor.isdigit() else None)
    _own_output(run_dir, rank)
    write_pid(run_dir, rank)
    signal.signal(signal.SIGINT, _raise_terminated)
    signal.signal(signal.SIGTERM, _on_sigterm)
    stopped = None
    try:
        cfg = load_config(args.config)
        # the nodes of this launch (a run started by hand with torchrun on several nodes)
        local = os.environ.get("LOCAL_WORLD_SIZE")
        cfg.check_ranks_per_node(int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None)
        stopped = train(cfg, run_dir, Path(args.resume) if args.resume else None)
    except BaseException as e:  # noqa: BLE001 - every way a rank ends is recorded
        _stopping = True
        state, reason = classify(e)
        traceback.print_exc()
        RankExit(rank, os.getpid(), state, reason, time.time()).write(run_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        # skip interpreter teardown: destructors of a broken process group can hang or abort
        os._exit(143 if state == "terminated" else 1)
    if stopped is not None:  # SIGTERM: a checkpoint at the step boundary, then a clean exit
        _stopping = True
        RankExit(rank, os.getpid(), "terminated", f"stopped by SIGTERM at step {stopped} (checkpoint step_{stopped} "
                 f"saved)", time.time()).write(run_dir)
        if rank == 0:
            write_status(run_dir, f"interrupted at step {stopped}")
        return
    RankExit(rank, os.getpid(), "done", "", time.time()).write(run_dir)
    if rank == 0:
        write_status(run_dir, "completed")  # also for runs started by hand with torchrun


if __name__ == "__main__":
    main()
