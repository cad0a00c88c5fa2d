"""``loom train``: check everything that depends only on the config, claim the run directory,
then run ``torchrun`` under `loom.train.launch.Supervisor`.

A run directory belongs to one run. It is free when it does not exist, is empty, or holds only
the ``config.toml`` of a ``--dry-run``; otherwise the run is refused unless ``--overwrite``
(which deletes the directory first). A directory whose run is still going (its ``loom train``
or a worker alive) is refused even with ``--overwrite``; a ``running`` status with no process
alive (its ``loom train`` was SIGKILLed) is named as such.

``--resume runs/<name>`` continues the run there from its latest checkpoint
(`loom.train.checkpoint`): the run's own ``config.toml`` (or ``--config``) with the overrides on
top, so ``run.steps`` may grow and the plan may change; the checkpoint is checked against the
model before any process starts. It needs no ``--overwrite`` (which it refuses), and a run
still going is refused as above.

``--dry-run`` runs every check, prints the command and writes ``config.toml`` into a free run
directory (for launching by hand, e.g. on several nodes); it never writes into, or clears, a
directory that holds a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from loom.plan.plan import LLM
from loom.cli.common import CliError, load_train_config
from loom.train.checkpoint import CheckpointMeta, check_compatible, expected_shapes, latest_checkpoint, truncate_log
from loom.train.config import TrainConfig, config_to_toml
from loom.train.launch import Supervisor, is_loom_process
from loom.train.status import LOGS, SUPERVISOR_PID, read_pids, read_status, read_supervisor_pid, write_status


def check_before_launch(cfg: TrainConfig, dry_run: bool = False) -> None:
    """Refusals that depend only on the config and would otherwise fail inside every rank.
    ``loom train`` starts every rank on this machine, so ``balance.ranks_per_node`` (above 1)
    must be the world size; a dry run may prepare a launch by hand on several nodes, where it
    must divide the world size (each rank checks torchrun's ``LOCAL_WORLD_SIZE`` itself)."""
    cfg.check_launch(None if dry_run else cfg.plan.world_size)


def torchrun_command(cfg: TrainConfig, config_path: Path, run_dir: Path, resume: Path | None = None) -> list[str]:
    """The launch of the run: every rank on this machine, or, for a dry run whose
    ``balance.ranks_per_node`` names smaller nodes, the command to run on each of them."""
    world, per_node = cfg.plan.world_size, cfg.balance.ranks_per_node
    if per_node in (1, world):
        where = ["--standalone", f"--nproc-per-node={world}"]
    else:
        where = [f"--nnodes={world // per_node}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=HOST:29500"]
    return [sys.executable, "-m", "torch.distributed.run", *where,
            "-m", "loom.train.main", "--config", str(config_path), "--run-dir", str(run_dir),
            *(["--resume", str(resume)] if resume is not None else [])]


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds (part of) a run, not just a dry run's ``config.toml``."""
    return run_dir.is_dir() and any(p.name != "config.toml" for p in run_dir.iterdir())


def live_processes(run_dir: Path) -> list[int]:
    """The run's ``loom train`` and workers that still run (pids recorded under ``logs/``)."""
    pids = [read_supervisor_pid(run_dir), *read_pids(run_dir).values()]
    return [pid for pid in pids if pid is not None and is_loom_process(pid)]


def claim_run_dir(cfg: TrainConfig, overwrite: bool, dry_run: bool, resume: bool = False) -> Path:
    """The run directory, refused if it holds a run and neither ``overwrite`` nor ``resume``
    is given; cleared (unless a dry run) with ``overwrite``; kept with ``resume``."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if run_dir.exists() and not run_dir.is_dir():
        raise CliError(f"run.name = {cfg.run.name!r}: {run_dir} is a file, not a run directory; "
                       f"choose another run.name or run.out_dir")
    if not holds_run(run_dir):
        return run_dir
    live = live_processes(run_dir)
    status = read_status(run_dir) or "no status"
    if status == "running" and not live:
        status = "running, but no process of it is alive: its loom train was killed"
    if live:
        raise CliError(f"run.name = {cfg.run.name!r}: the run in {run_dir} is still going (status: {status}; "
                       f"process(es) {live}); stop it first (Ctrl-C or kill -TERM {live[0]}) or choose another "
                       f"run.name")
    if resume:
        return run_dir
    if not overwrite:
        raise CliError(
            f"run.name = {cfg.run.name!r}: {run_dir} already holds a run (status: {status}); choose another "
            f"run.name, pass --resume {run_dir} to continue it from its latest checkpoint (checkpoints/latest), "
            f"or --overwrite to delete it first")
    if not dry_run:
        shutil.rmtree(run_dir)
    return run_dir


def resume_target(args: argparse.Namespace) -> Path | None:
    """For ``--resume RUN_DIR``: the checkpoint to continue from (``checkpoints/latest``), with
    ``args`` set to load the run's ``config.toml`` (unless ``--config``) and to keep the run in
    ``RUN_DIR`` whatever the overrides say."""
    if args.resume is None:
        return None
    run_dir = Path(args.resume)
    if args.overwrite:
        raise CliError(f"--resume {run_dir} with --overwrite: --overwrite deletes the run that --resume continues; "
                       f"pass one of them")
    if not run_dir.is_dir():
        raise CliError(f"--resume {run_dir}: no such run directory; pass runs/<name> of an earlier loom train")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None or not ckpt.is_dir():
        raise CliError(f"--resume {run_dir}: the run has no checkpoint (no {run_dir / 'checkpoints' / 'latest'}, "
                       f"or it names a missing directory); start it again with --overwrite")
    if args.config is None:
        if not (run_dir / "config.toml").is_file():
            raise CliError(f"--resume {run_dir}: no config.toml in it; pass --config with the run's config")
        args.config = str(run_dir / "config.toml")
    # the run stays where it is: these come last, over any run.out_dir / run.name given
    args.overrides = [*args.overrides, f"run.out_dir={json.dumps(str(run_dir.parent))}",
                      f"run.name={json.dumps(run_dir.name)}"]
    return ckpt


KILL_ENV = "LOOM_KILL"  # demos and tests only: "RANK[,RANK...]@STEP[;...]", SIGKILLs by the elastic supervisor


def _train_elastic(cfg: TrainConfig, run_dir: Path, config_path: Path, dry_run: bool, resume: Path | None = None) -> int:
    """An ``[elastic]`` run (docs/elastic.md): ``elastic.nodes`` workers under
    `loom.elastic.supervisor.ElasticSupervisor`, from the checkpoint ``resume`` if given (any loom
    checkpoint of the model: the survivors' one beyond f, or a run's under any plan);
    ``LOOM_KILL`` kills ranks on cue (demos, tests)."""
    from loom.elastic.supervisor import Kill, worker_command
    from loom.train.elastic import launch

    el = cfg.elastic
    try:
        kills = [Kill.parse(k) for k in os.environ.get(KILL_ENV, "").split(";") if k.strip()]
    except ValueError as e:
        raise CliError(f"{KILL_ENV}: {e}") from e
    world = el.nodes * el.ranks_per_node
    for k in kills:
        if any(not 0 <= r < world for r in k.ranks):
            raise CliError(f"{KILL_ENV}: ranks {k.ranks}: the run has ranks 0..{world - 1}")
    from loom.planner.oobleck import OobleckError, TemplateError
    from loom.train.elastic import elastic_planner

    try:  # the templates and the first instantiation, before any process starts
        planner = elastic_planner(cfg)
        first = planner.first()
    except (OobleckError, TemplateError) as e:
        raise CliError(f"[elastic]: {e}") from e
    print(f"loom: elastic run, {world} processes ({el.nodes} nodes), f = {el.f}, pipeline templates of "
          f"{planner.spec.template_sizes[0]} to {planner.spec.template_sizes[-1]} nodes, first pipelines "
          f"{first.pipelines}; run dir {run_dir}" + (f"; continuing from {resume}" if resume is not None else ""),
          flush=True)
    if dry_run:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config_to_toml(cfg))
        print(f"wrote {config_path}; would start {world} workers under the elastic supervisor: "
              + " ".join(worker_command(config_path, run_dir)))
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(config_to_toml(cfg))
    (run_dir / LOGS).mkdir(exist_ok=True)
    if resume is not None:  # the steps before the checkpoint stay; the earlier launch's pids and exits go
        truncate_log(run_dir / "metrics.jsonl", CheckpointMeta.read(resume).step)
        for stale in [*(run_dir / LOGS).glob("rank*.pid"), *(run_dir / LOGS).glob("rank*.exit.json")]:
            stale.unlink()
    (run_dir / LOGS / SUPERVISOR_PID).write_text(f"{os.getpid()}\n")
    write_status(run_dir, "running")
    outcome = launch(cfg, run_dir, config_path, kills=kills, planner=planner, resume=resume)
    write_status(run_dir, outcome.status)
    print(outcome.message, file=sys.stderr if outcome.returncode else sys.stdout, flush=True)
    return outcome.returncode


def cmd_train(args: argparse.Namespace) -> int:
    resume = resume_target(args)
    cfg = load_train_config(args)
    check_before_launch(cfg, args.dry_run)
    if resume is not None:  # another model's checkpoint is refused here, before any process starts
        meta = CheckpointMeta.read(resume)
        if meta.step > cfg.run.steps:
            raise CliError(f"run.steps = {cfg.run.steps}: the run resumes from {resume}, after step {meta.step}; "
                           f"set run.steps to {meta.step} or more")
        check_compatible(resume, meta, expected_shapes(cfg))
    run_dir = claim_run_dir(cfg, args.overwrite, args.dry_run, resume=resume is not None)
    config_path = run_dir / "config.toml"
    if cfg.elastic is not None:  # Oobleck: its own supervisor, not torchrun (loom.train.elastic)
        return _train_elastic(cfg, run_dir, config_path, args.dry_run, resume)
    world = cfg.plan.world_size
    cmd = torchrun_command(cfg, config_path, run_dir, resume)
    print(f"loom: {world} processes, plan " + ", ".join(
        f"{m.name} {m.pipeline_depth} stage(s)"
        + ((f" of {m.virtual_stages} chunks (interleaved)" if m.name == LLM else f" in {m.virtual_stages} chunks")
           if m.virtual_stages > 1 else "") + f" x dp {m.data_parallel}"
        + "".join(f" x {k} {v}" for k, v in (("cp", m.context_parallel), ("tp", m.tensor_parallel)) if v > 1)
        for m in cfg.plan.modules)
        + f", {cfg.plan.num_microbatches} microbatches, {cfg.plan.schedule}; run dir {run_dir}", flush=True)
    if args.dry_run:
        if resume is not None:
            print(f"would continue from {resume}, write {config_path} and run: " + " ".join(cmd))
            return 0
        if holds_run(run_dir):
            print(f"would delete {run_dir} (--overwrite), write {config_path} and run: " + " ".join(cmd))
            return 0
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config_to_toml(cfg))
        nodes = world // cfg.balance.ranks_per_node if cfg.balance.ranks_per_node > 1 else 1
        where = f"on each of {nodes} nodes (with HOST the first node)" if nodes > 1 else ""
        print(f"wrote {config_path}; would run{' ' + where if where else ''}: " + " ".join(cmd))
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(config_to_toml(cfg))
    if resume is not None:  # the earlier launch's pids and exit records would read as this one's
        for stale in [*(run_dir / LOGS).glob("rank*.pid"), *(run_dir / LOGS).glob("rank*.exit.json")]:
            stale.unlink()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    roles = {r: "{} stage {} replica {}".format(*cfg.plan.role_of(r)) for r in range(world)}
    outcome = Supervisor(cmd, run_dir, world, env, roles, steps=cfg.run.steps).run()
    message = outcome.message
    last = latest_checkpoint(run_dir)
    if outcome.returncode and last is not None:  # still one line
        message += f"; last checkpoint {last.name}: continue with loom train --resume {run_dir}"
    print(message or f"loom: completed; run dir {run_dir} (logs in {run_dir / LOGS})",
          file=sys.stderr if outcome.returncode else sys.stdout, flush=True)
    return outcome.returncode
