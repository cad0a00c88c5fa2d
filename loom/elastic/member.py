"""A rank's part in one generation of an elastic run: its pipeline's process group and engine,
the state it brings along, the copies it receives (oobleck.md §3.7), the layer-wise gradient
synchronisation across pipelines (§3.9) and the atomic commit of each step.

Each pipeline replica is a world of its own for the runtime: the process's default group spans
only its pipeline's ranks (a `PrefixStore` per generation and pipeline on the shared store), so
`ParallelEngine.create` builds a one-replica plan unchanged. Groups across pipelines are built
directly on the store (`ProcessGroupGloo`): one per set of ranks holding the same parameters
(one rank per pipeline; the layer-wise groups), one per copy (source, receiver), and one over
every member (the loss normalisers). Every rank creates the groups it belongs to in one global
order (copies, then syncs, then all; sorted), so no two ranks wait on each other's creation.

Losses are normalised by the whole global batch's target count, so the sum over pipelines of
their gradients is the single-process gradient: the layer-wise all-reduce is a SUM.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from loom.elastic.coordination import Coordinator
from loom.elastic.layout import BeyondTolerance, Generation
from loom.elastic.protocol import copy_plan, sync_groups
from loom.runtime.engine import ParallelEngine

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's per-parameter state (amsgrad off)


class StepAborted(RuntimeError):
    """The step was abandoned on every survivor (a failure): it is redone in the next generation."""


@dataclass
class HeldState:
    """What a rank holds at its last committed step: parameters and their AdamW state by name.
    Plain tensors, so they outlive the engine and groups they came from."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: ParallelEngine) -> "HeldState":
        out = cls()
        opt = engine.optimizer
        for name, p in engine.named_parameters().items():
            out.params[name] = p.detach()
            if opt is not None and p in opt.state and opt.state[p]:
                out.optim[name] = {k: opt.state[p][k] for k in ADAM_KEYS}
        return out


@dataclass
class Formed:
    """This rank in generation ``gen``: pipeline ``pipeline`` at position ``local``."""

    gen: Generation
    rank: int
    pipeline: int
    local: int
    engine: ParallelEngine
    sync: list[tuple[ProcessGroupGloo, list[torch.nn.Parameter]]]
    everyone: ProcessGroupGloo
    copied: int = 0  # parameters received from other ranks

    @property
    def members(self) -> list[int]:
        return self.gen.members

    @property
    def leader(self) -> bool:
        return self.rank == self.members[0]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """SUM over every member of the generation."""
        self.everyone.allreduce([t]).wait()
        return t

    def sync_gradients(self) -> None:
        """Layer-wise SUM across pipelines (oobleck.md §3.9), one flat bucket per holder set. A
        parameter keeps no gradient where no pipeline gave it one (as the single process,
        whose optimizer then skips it)."""
        for pg, params in self.sync:
            flags = torch.tensor([float(p.grad is not None) for p in params])
            flat = torch.cat([flags] + [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                        for p in params])
            pg.allreduce([flat]).wait()
            at = len(params)
            for i, p in enumerate(params):
                n = p.numel()
                if flat[i] > 0:
                    g = flat[at:at + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                at += n

    def clip(self, max_norm: float) -> float:
        """Global-norm clipping as ``clip_grad_norm_`` on the whole model: after the sync every
        pipeline holds the whole gradient once, so the norm over one pipeline is the model's."""
        params = [p for p in self.engine.named_parameters().values() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32)
        for p in params:
            local += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(local)  # over the pipeline (the default group)
        norm = float(local.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def drop(self) -> None:
        """Release the generation's groups (closing their connections releases any peer still
        waiting on this rank) and its engine; the parameters live on in a `HeldState`."""
        self.engine.executor.before_update = None
        self.sync.clear()
        self.everyone = None  # type: ignore[assignment]
        self.engine = None  # type: ignore[assignment]
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def _gloo(store, prefix: str, rank: int, size: int, timeout_s: float) -> ProcessGroupGloo:
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s))


def form(coord: Coordinator, gen: Generation, rank: int, build: Callable[[object], ParallelEngine],
         state: HeldState | None, committed: int, timeout_s: float) -> Formed:
    """Join generation ``gen``: init this rank's pipeline group, build its engine (``build(plan)``),
    load what ``state`` holds, receive what it lacks from a surviving holder (parameters and AdamW
    state; with no step committed, every rank's seed initialisation is already right), and build
    the layer-wise and all-member groups. ``committed``: steps committed so far (every member
    must agree)."""
    store, n = coord.store, gen.number
    i = gen.pipeline_of(rank)
    ranks = gen.pipelines[i]
    local = ranks.index(rank)
    # everyone at the rendezvous first (workers start, and leave the last generation, at their own
    # pace), so the groups' own timeout (timeout_s, failure detection's backstop) only counts from here
    store.set(f"g{n}/arrived/{rank}", "1")
    coord.wait_keys([f"g{n}/arrived/{m}" for m in gen.members], n, max(300.0, 6 * timeout_s))
    dist.init_process_group("gloo", store=PrefixStore(f"g{n}/p{i}", store), rank=local, world_size=len(ranks),
                            timeout=timedelta(seconds=timeout_s))
    engine = build(gen.plans[i])
    named = engine.named_parameters()
    trainable = sorted(k for k, p in named.items() if p.requires_grad)
    have = sorted(state.params) if state is not None and committed > 0 else []
    store.set(f"g{n}/held/{rank}", json.dumps({"held": trainable, "have": have, "committed": committed}))
    members = gen.members
    # members build their engines at their own pace (a loaded machine): wait long, but not past a new failure
    coord.wait_keys([f"g{n}/held/{m}" for m in members], n, max(60.0, 6 * timeout_s))
    info = {m: json.loads(store.get(f"g{n}/held/{m}")) for m in members}
    steps = {m: v["committed"] for m, v in info.items()}
    if len(set(steps.values())) != 1:
        raise RuntimeError(f"generation {n}: members disagree on the committed steps {steps}")
    if state is not None and committed > 0:
        for name, p in named.items():
            if name in state.params:
                with torch.no_grad():
                    p.copy_(state.params[name])
    opt_state = dict(state.optim) if state is not None and committed > 0 else {}
    copied = 0
    if committed > 0:
        try:
            plan = copy_plan({m: v["held"] for m, v in info.items()}, {m: v["have"] for m, v in info.items()})
        except LookupError as e:
            raise BeyondTolerance(f"parameter {e.args[0]} has no surviving copy: the failures took every replica of "
                                  f"its layer") from e
        for (src, dst), names in plan.items():
            if rank not in (src, dst):
                continue
            pg = _gloo(store, f"g{n}/copy/{src}/{dst}", 0 if rank == src else 1, 2, timeout_s)
            if rank == src:
                _send_state(pg, names, state)
            else:
                copied += len(names)
                _recv_state(pg, names, named, opt_state)
            del pg
    if engine.optimizer is not None:
        by_param = {named[k]: v for k, v in opt_state.items() if k in named}
        for p, st in by_param.items():
            engine.optimizer.state[p] = {k: v.clone() for k, v in st.items()}
    sync = []
    for holders, names in sync_groups({m: v["held"] for m, v in info.items()}).items():
        if rank in holders:
            pg = _gloo(store, f"g{n}/sync/{'-'.join(map(str, holders))}", holders.index(rank), len(holders), timeout_s)
            sync.append((pg, [named[k] for k in names]))
    everyone = _gloo(store, f"g{n}/all", members.index(rank), len(members), timeout_s)
    return Formed(gen, rank, i, local, engine, sync, everyone, copied)


def _send_state(pg: ProcessGroupGloo, names: list[str], state: HeldState) -> None:
    flags = torch.tensor([float(k in state.optim) for k in names])
    pg.broadcast(flags, 0).wait()
    parts = []
    for k in names:
        parts.append(state.params[k].reshape(-1).float())
        if k in state.optim:
            parts += [state.optim[k][a].reshape(-1).float() for a in ADAM_KEYS]
    flat = torch.cat(parts)
    pg.broadcast(flat, 0).wait()


def _recv_state(pg: ProcessGroupGloo, names: list[str], named: dict[str, torch.nn.Parameter],
                opt_state: dict[str, dict[str, torch.Tensor]]) -> None:
    flags = torch.zeros(len(names))
    pg.broadcast(flags, 0).wait()
    size = sum(named[k].numel() * (1 + (2 * int(f > 0))) + int(f > 0) for k, f in zip(names, flags.tolist()))
    flat = torch.empty(size)
    pg.broadcast(flat, 0).wait()
    at = 0
    for k, f in zip(names, flags.tolist()):
        p = named[k]
        n = p.numel()
        with torch.no_grad():
            p.copy_(flat[at:at + n].view_as(p).to(p.dtype))
        at += n
        if f > 0:
            step = flat[at:at + 1].reshape(()).clone()
            at += 1
            avg = flat[at:at + n].view_as(p).clone()
            sq = flat[at + n:at + 2 * n].view_as(p).clone()
            at += 2 * n
            opt_state[k] = {"step": step, "exp_avg": avg, "exp_avg_sq": sq}
