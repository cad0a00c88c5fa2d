"""Checkpoints of a run with ``torch.distributed.checkpoint`` (DCP), and resuming from them.

Layout, under the run directory::

    checkpoints/step_<N>/        one DCP checkpoint: every rank's shards (``__<R>_0.distcp``),
                                 DCP's ``.metadata`` and loom's ``meta.json``
    checkpoints/latest           "step_<N>", the last complete checkpoint (written last, by rename)

What a checkpoint holds (N steps done, so training continues with step N):

- ``model.<fqn>``: every parameter and persistent buffer by its fully qualified name in the
  whole `MultimodalModel` (``llm.model.layers.0.mlp.up_proj.weight``), never by a stage's or a
  rank's view of it, so a checkpoint does not depend on the plan. Each rank saves the FQNs its
  stages hold: FSDP2 (ZeRO 2/3) and TP parameters as DTensor shards, a whole parameter as a
  plain tensor. Replicas of a stage (data parallelism without ZeRO 2/3, context parallelism)
  hold identical keys; DCP's planner (``dedup_save_plans``) lets one of them write each.
- ``optim.state.<fqn>.<key>``: the optimizer state per parameter (AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq``), from ``get_state_dict`` with ``flatten_optimizer_state_dict``,
  sharded like the parameter. Under ZeRO 1 the rank that owns a parameter saves its state.
  Param-group settings (lr, betas, weight decay) are not saved: they come from the config and
  the LR schedule at the step.
- ``rng.rank<R>``: each rank's torch CPU generator state (restored only under the same world
  size; loom's training draws no random numbers from it today, the sampler and the diffusion
  noise are seeded by step and sample).
- ``meta.json`` (written by rank 0 after DCP finished): the step, the LR schedule's position,
  the plan it was saved under, a hash of the config without ``[run]`` and ``[plan]``, and every
  parameter's name and shape in the whole model, by which `check_compatible` refuses a
  checkpoint of another model before any process starts.

The data position is the step: `loom.data.sampler.GlobalBatchSampler` is a pure function of
(seed, step), and the dispatcher's balancing decisions depend on the step's batch only.

Loading goes the other way, by FQN, so a run may resume under another plan (other stage
counts, data-parallel degrees, ZeRO stages, TP): each rank asks DCP for the keys of the stages
it now holds, shaped as it holds them, and DCP reads the overlapping parts of what was saved.

Asynchronous saves (``run.checkpoint_async``, `Checkpointer.save_async`): DCP's ``async_save``
copies the rank's state into fresh CPU tensors while the step waits (the only blocking part: the
training step changes the parameters in place afterwards), then writes them from a background
thread while training goes on. The thread runs DCP's plan and result collectives on a process
group of its own (gloo), so they never interleave with the training step's on the default group.
A thread rather than DCP's checkpoint process: on gloo/CPU the state is already in CPU memory,
so a second process per rank would only add a copy through a pipe and a process group of its
own, and the write is file I/O, which releases the GIL. At most one save is in flight (a new
one, the final one and the SIGTERM one wait for it first); at each step boundary
`Checkpointer.poll` agrees across the ranks whether it finished (a one-element all-reduce,
only while one is in flight), and only then does rank 0 write ``meta.json`` and ``latest``;
a failed save raises there on every rank, naming the checkpoint directory.

In one process, without a process group (an elastic run's survivors, `loom.train.elastic`):
`save_whole` writes the whole model's state under the same keys (no RNG; ``world_size = 0`` in
``meta.json``), `read_whole` reads any checkpoint back whole.

Nothing in a checkpoint is unpickled unsafely: every saved value is a tensor (DCP reads tensor
data with ``torch.load(weights_only=True)``), loom's own metadata is JSON, and DCP's pickled
``.metadata`` is read by `SafeReader` with an unpickler that admits only DCP's metadata
classes, torch sizes and dtypes and plain containers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from loom.runtime.zero import ShardedStateOptimizer
from loom.train.config import ConfigError, TrainConfig, config_to_toml

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
FORMAT = 1
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names it and what to do."""


@dataclass
class CheckpointMeta:
    """``meta.json`` of one checkpoint."""

    format: int
    step: int  # steps done: training continues with this step
    world_size: int
    plan: dict[str, Any]
    config_hash: str  # `model_config_hash`: the config without [run] and [plan]
    params: dict[str, list[int]]  # every parameter and buffer of the whole model -> its shape
    save_s: float  # seconds the save took (DCP and the metadata), on rank 0

    @classmethod
    def read(cls, ckpt: Path) -> "CheckpointMeta":
        try:
            data = json.loads((ckpt / META).read_text())
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {ckpt}: its {META} is missing or unreadable ({e}); it is not a "
                                  f"complete loom checkpoint: resume from another one") from e


# ---- where checkpoints are --------------------------------------------------------------------
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names (None when there is none)."""
    try:
        name = (checkpoints_dir(run_dir) / LATEST).read_text().strip()
    except OSError:
        return None
    return checkpoints_dir(run_dir) / name if name else None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader sees the old file or the new one, never a part


# ---- the state of a rank ----------------------------------------------------------------------
def model_view(stages: list) -> nn.Module:
    """A module whose submodules are this rank's layers at their paths in the whole model, so
    ``state_dict()`` names each parameter by its full FQN (``Stage.named_parameters``'s names)
    whichever stages the rank holds. The layers are shared, not copied."""
    root = nn.Module()
    for st in stages:
        for layer in st.layers:
            *parents, leaf = layer.name.split(".")
            node = root
            for part in parents:
                child = node._modules.get(part)
                if child is None:
                    child = nn.Module()
                    node.add_module(part, child)
                node = child
            if leaf in node._modules and node._modules[leaf] is not layer.module:
                raise ValueError(f"layer {layer.name!r} is held twice under one name; checkpoints need unique layer names")
            node.add_module(leaf, layer.module)
    return root


def _inner_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer that holds state for this rank's parameters: under ZeRO 1 the local one
    over the parameters the rank owns (its state is sharded by ownership, not by DTensor)."""
    if isinstance(optimizer, (ZeroRedundancyOptimizer, ShardedStateOptimizer)):
        return optimizer.optim
    return optimizer


def _state(view: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
           with_rng: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict of this rank (tensors only) and the optimizer's param-group entries
    (kept out of the checkpoint; `set_state_dict` needs them back)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(view, optimizer, options=_OPTIONS)
    else:  # a rank with nothing to train (a frozen encoder)
        model_sd, optim_sd = get_model_state_dict(view, options=_OPTIONS), {}
    tensors = {k: v for k, v in optim_sd.items() if k.startswith("state.")}
    groups = {k: v for k, v in optim_sd.items() if not k.startswith("state.")}
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"optimizer state {k!r} is a {type(v).__name__}, not a tensor; loom checkpoints hold tensors only")
    sd: dict[str, Any] = {"model": dict(model_sd), "optim": tensors}
    if with_rng:
        sd["rng"] = {f"rank{rank}": torch.get_rng_state()}
    return sd, groups


def _shapes(view: nn.Module) -> dict[str, list[int]]:
    """This rank's parameters and persistent buffers -> their shapes in the whole model (a
    DTensor's global shape)."""
    return {k: list(v.shape) for k, v in view.state_dict().items()}


def model_config_hash(cfg: TrainConfig) -> str:
    """A digest of what makes the model and its training the same run: the config without
    ``[run]`` and the plan (both may change on resume)."""
    text = config_to_toml(dataclasses.replace(cfg, run=type(cfg.run)()))
    text = text.split("[[plan.modules]]")[0].split("\n[plan]")[0]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def expected_shapes(cfg: TrainConfig) -> dict[str, list[int]]:
    """Every parameter and persistent buffer of ``cfg``'s model -> its shape, as a checkpoint
    names them (built on the meta device: no values)."""
    from loom.train.build import build_data, build_model

    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")
    shapes: dict[str, list[int]] = {}
    for module in cfg.plan.module_names:  # model order: the first mismatch is the first the model has
        for layer in model.module_layers(module):
            for k, v in layer.module.state_dict().items():
                shapes[f"{layer.name}.{k}"] = list(v.shape)
    return shapes


def check_compatible(ckpt: Path, meta: CheckpointMeta, shapes: dict[str, list[int]]) -> None:
    """Refuse ``ckpt`` unless it holds every name of ``shapes`` (this run's model, or a rank's
    part of it) with the same shape; the error names the first mismatching parameter."""
    for name, shape in shapes.items():
        saved = meta.params.get(name)
        if saved is None:
            raise CheckpointError(f"checkpoint {ckpt} is of another model: it has no parameter {name!r} (its first is "
                                  f"{next(iter(meta.params), None)!r}); resume with the model config it was saved "
                                  f"with, or start a new run")
        if list(saved) != list(shape):
            raise CheckpointError(f"checkpoint {ckpt} is of another model: parameter {name!r} has shape {list(saved)} "
                                  f"there and {list(shape)} in this model; resume with the model config it was saved "
                                  f"with, or start a new run")


# ---- DCP's metadata, read without arbitrary unpickling ----------------------------------------
_SAFE_MODULES = ("torch.distributed.checkpoint.",)
# what DCP's Metadata pickles besides its own classes (torch.distributed.checkpoint.*): sizes,
# dtypes, layouts and the file names of its _StorageInfo
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a checkpoint's .metadata names {module}.{name}, which is not DCP metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose ``read_metadata`` admits only DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _reason(e: BaseException) -> str:
    """One line for an error of DCP: each failing rank's exception (a `CheckpointException`
    carries them with their tracebacks, which the rank's log has), else the error itself."""
    if isinstance(e, CheckpointException) and e.failures:
        parts = [f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items())]
    else:
        parts = [f"{type(e).__name__}: {e}"]
    return " ".join("; ".join(parts).split())[:300]


# ---- save and load ----------------------------------------------------------------------------
@dataclass
class _InFlight:
    """An asynchronous save not yet agreed finished."""

    step: int
    target: Path
    future: Future
    t0: float  # when the save began (this rank's clock)


@dataclass
class Checkpointer:
    """Saves and loads one rank's share of the run (`loom.train.rank.RankRun`) at step
    boundaries. Every rank calls `save`, `save_async`, `poll`, `wait` and `load` together (they
    are collective). With ``asynchronous`` (``run.checkpoint_async``) it owns a gloo process
    group for the background writes (made here, collectively)."""

    run: Any  # loom.train.rank.RankRun (typed loosely: the rank module imports nothing of this one)
    run_dir: Path
    asynchronous: bool = False

    def __post_init__(self) -> None:
        self.view = model_view(self.run.engine.stages)
        self._all_shapes: dict[str, list[int]] | None = None
        self._in_flight: _InFlight | None = None
        self.last_step: int | None = None  # the step of the last complete save (not one in flight)
        # DCP's collectives from the writer thread need a group the main thread never uses
        self._group = dist.new_group(backend="gloo") if self.asynchronous else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return _inner_optimizer(self.run.optimizer)

    def _begin(self, step: int) -> tuple[Path, dict[str, Any]]:
        """The collective start of a save: the whole model's shapes (once), an empty
        ``step_<step>`` directory, this rank's state dict."""
        rank, world = dist.get_rank(), dist.get_world_size()
        target = step_dir(self.run_dir, step)
        if self._all_shapes is None:  # once per run: every rank's names -> the whole model's
            gathered: list[dict[str, list[int]]] | None = [{} for _ in range(world)] if rank == 0 else None
            dist.gather_object(_shapes(self.view), gathered, dst=0)
            self._all_shapes = {k: v for part in gathered for k, v in part.items()} if rank == 0 else {}
        if rank == 0:
            if target.exists():  # left by a save that did not finish (latest never named it)
                shutil.rmtree(target)
            target.mkdir(parents=True)
        dist.barrier()
        sd, _ = _state(self.view, self.optimizer, rank, with_rng=True)
        return target, sd

    def _finish(self, step: int, target: Path, t0: float) -> None:
        """Rank 0, once DCP has returned there (every rank's shards and ``.metadata`` are
        written): ``meta.json``, then ``latest``."""
        if dist.get_rank() == 0:
            meta = CheckpointMeta(FORMAT, step, dist.get_world_size(), self.run.cfg.plan.to_dict(),
                                  model_config_hash(self.run.cfg), self._all_shapes,
                                  round(time.perf_counter() - t0, 4))
            _write_atomically(target / META, json.dumps(dataclasses.asdict(meta)))
            _write_atomically(checkpoints_dir(self.run_dir) / LATEST, target.name + "\n")

    def save(self, step: int) -> float:
        """Save the state after ``step`` steps as ``checkpoints/step_<step>``, then point
        ``latest`` at it; returns the seconds it took (this rank's clock). An asynchronous
        save still in flight is waited for first."""
        self.wait()
        t0 = time.perf_counter()
        target, sd = self._begin(step)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(target))
        # dcp.save returns on rank 0 after every rank's write result reached it and .metadata
        # is written: only then does meta.json, and after it `latest`, name the checkpoint
        self._finish(step, target, t0)
        dist.barrier()  # no rank runs ahead (or exits) before `latest` names the checkpoint
        self.last_step = step
        return time.perf_counter() - t0

    def save_async(self, step: int) -> float:
        """Start saving the state after ``step`` steps in the background (DCP ``async_save``:
        the state is copied to fresh CPU tensors now, written by a thread); returns the seconds
        the caller was blocked (the previous save's wait, the copy). `poll` at the next step
        boundaries, or `wait`, completes it: ``latest`` names it only then."""
        t0 = time.perf_counter()
        self.wait()
        if self._group is None:
            raise RuntimeError("Checkpointer.save_async needs Checkpointer(asynchronous=True), which makes its process group")
        target, sd = self._begin(step)
        future = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(target), process_group=self._group)
        self._in_flight = _InFlight(step, target, future, t0)
        return time.perf_counter() - t0

    @property
    def in_flight(self) -> int | None:
        """The step of the asynchronous save in flight (None when none is)."""
        return None if self._in_flight is None else self._in_flight.step

    def poll(self) -> tuple[int, float] | None:
        """At a step boundary, with an asynchronous save in flight: agree across the ranks
        whether it has finished everywhere (one all-reduce of [failed, unfinished]); if it
        failed anywhere, raise on every rank (`wait`), naming its directory; if it finished
        everywhere, mark it complete (rank 0 writes ``meta.json`` and ``latest``) and return
        (step, seconds from its start to now); else None."""
        job = self._in_flight
        if job is None:
            return None
        done = job.future.done()
        failed = done and job.future.exception() is not None
        flags = torch.tensor([float(failed), float(not done)], device=self.run.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() == 0 and flags[1].item() == 1:
            return None  # still writing somewhere
        return self.wait()

    def wait(self) -> tuple[int, float] | None:
        """Wait for the asynchronous save in flight (if any) on every rank and complete it as
        `poll` does; a failure raises `CheckpointError` naming the checkpoint directory (every
        rank gets it: DCP reports any rank's write error to all). Returns (step, seconds)."""
        job = self._in_flight
        if job is None:
            return None
        self._in_flight = None
        try:
            job.future.result()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException (a BaseException) has every rank's error
            raise CheckpointError(f"asynchronous save of checkpoint {job.target} (step {job.step}) failed: {_reason(e)}; "
                                  f"`latest` was not moved to it, so a resume takes the last complete checkpoint") from e
        self._finish(job.step, job.target, job.t0)
        dist.barrier()  # `latest` names it before any rank goes on (or exits)
        self.last_step = job.step
        return job.step, time.perf_counter() - job.t0

    def load(self, ckpt: Path) -> int:
        """Restore this rank's state from ``ckpt`` (saved under any plan of the same model);
        returns the step to continue with."""
        ckpt = Path(ckpt)
        meta = CheckpointMeta.read(ckpt)
        check_compatible(ckpt, meta, _shapes(self.view))
        rank = dist.get_rank()
        same_world = meta.world_size == dist.get_world_size()
        optimizer = self.optimizer
        sd, groups = _state(self.view, optimizer, rank, with_rng=same_world)
        try:
            dcp.load(sd, storage_reader=SafeReader(ckpt))
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException (a BaseException) has every rank's error
            raise CheckpointError(f"checkpoint {ckpt}: cannot be loaded into this run ({_reason(e)}); resume with the "
                                  f"model config it was saved with, or from another checkpoint") from e
        if optimizer is not None:
            set_state_dict(self.view, optimizer, model_state_dict=sd["model"],
                           optim_state_dict={**sd["optim"], **groups}, options=_OPTIONS)
        else:
            set_model_state_dict(self.view, sd["model"], options=_OPTIONS)
        if same_world:
            torch.set_rng_state(sd["rng"][f"rank{rank}"])
        self._set_schedule(meta.step)
        return meta.step

    def _set_schedule(self, step: int) -> None:
        """The LR schedule (`loom.train.rank.lr_lambda`) at ``step``: its position, and the
        learning rate it gives there in every param group."""
        scheduler, optimizer = self.run.scheduler, self.run.optimizer
        if scheduler is None or optimizer is None:
            return
        scheduler.last_epoch = step
        scheduler._step_count = step + 1  # as after `step` calls of scheduler.step()
        lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs


def truncate_log(path: Path, step: int) -> None:
    """Keep the lines of a per-step JSONL log (``metrics.jsonl``, ``balance.jsonl``) for the
    steps before ``step``: a resumed run appends from there, and steps a stopped run logged
    after its last checkpoint are run (and logged) again."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a stop
    _write_atomically(path, "".join(k + "\n" for k in kept))


# ---- the whole model's state in one process (an elastic run's survivors; loom.train.elastic) ---
def save_whole(run_dir: Path, step: int, cfg: TrainConfig, model: dict[str, torch.Tensor],
               optim: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write ``checkpoints/step_<step>`` from the whole model's state held by one process, with
    the keys `Checkpointer` saves (``model.<fqn>``; ``optim.state.<fqn>.<key>``), then
    ``meta.json`` and ``latest``, so `Checkpointer.load` (any plan) and `read_whole` (an elastic
    run) resume from it. No process group: DCP saves in one process. No rank's RNG state: its
    ``meta.json`` says ``world_size = 0``, which no run has, so none is restored."""
    t0 = time.perf_counter()
    target = step_dir(run_dir, step)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    flat = {f"state.{name}.{key}": v for name, st in sorted(optim.items()) for key, v in sorted(st.items())}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"model": dict(model), "optim": flat}, storage_writer=dcp.FileSystemWriter(target))
    meta = CheckpointMeta(FORMAT, step, 0, cfg.plan.to_dict(), model_config_hash(cfg),
                          {k: list(v.shape) for k, v in model.items()}, round(time.perf_counter() - t0, 4))
    _write_atomically(target / META, json.dumps(dataclasses.asdict(meta)))
    _write_atomically(checkpoints_dir(run_dir) / LATEST, target.name + "\n")
    return target


def read_whole(ckpt: Path) -> tuple[int, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The whole model's state in one process, from any loom checkpoint (`save_whole`'s or a
    run's, saved under any plan: DCP joins the shards): (step, ``{fqn: tensor}``, ``{fqn:
    {step, exp_avg, exp_avg_sq}}``). No process group is needed. Read with `SafeReader`."""
    ckpt = Path(ckpt)
    meta = CheckpointMeta.read(ckpt)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sd: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optim": {}}
    for key, md in SafeReader(ckpt).read_metadata().state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and key.startswith(("model.", "optim.state.")):
            head, rest = key.split(".", 1)
            sd[head][rest] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load(sd, storage_reader=SafeReader(ckpt))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException (a BaseException) has every rank's error
        raise CheckpointError(f"checkpoint {ckpt}: cannot be read ({_reason(e)}); resume from another checkpoint") from e
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd["optim"].items():
        name, key = k[len("state."):].rsplit(".", 1)
        optim.setdefault(name, {})[key] = v
    return meta.step, sd["model"], optim
