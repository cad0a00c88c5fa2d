"""A rank's place in its pipeline unit, and how units of several ranks talk to each other.

A *pipeline unit* is one (module, stage, replica) of the plan: ``tensor_parallel x
context_parallel`` ranks that run that stage replica together (`loom.plan.plan`, rank layout).
Schedules (the IR) address units, so the contract of a unit of several ranks is:

- **Actions.** Every rank of a unit runs its unit's action list, ``schedule.actions[unit]``,
  in the same order: sends, receives, forwards, backwards, gradient syncs and optimizer steps
  happen on all of them (collectives inside a unit, TP's and CP's, match up because the ranks
  run the same code in the same order).
- **Microbatches.** The `Dispatcher` delivers a unit's payloads to its leader; the engine
  shares the leader's microbatches with the unit (`UnitPlace.share_microbatches`: over the TP
  group, then over each CP group) before the actions run, and the executor pads the LLM's to
  `UnitPlace.sequence_multiple` (`prepare_microbatches`); under context parallelism it also
  fixes each LLM microbatch's CP block size (with TP, a multiple of the TP degree, the rows
  padded to whole blocks, so every CP rank's tokens shard evenly over TP).
- **Messages between units** (`UnitPlace.destinations`, `UnitPlace.source`; the same rule for
  activations forward and gradients backward, with the roles swapped):

  * between consecutive stages of one module (the same ``(cp, tp)`` layout on both sides),
    rank ``i`` of the sending unit sends to rank ``i`` of the receiving unit: activations may
    stay sharded (sequence-sharded under TP's sequence parallelism, token-sharded under CP),
    and so may their gradients;
  * across modules (an encoder's output into the LLM), the sending unit's output is the full
    tensor on every one of its ranks (DTensor ``Replicate`` semantics), and only the unit's
    *leader* (cp = tp = 0) sends it, to every rank of the receiving unit. Gradients go back the
    same way: the receiving unit's leader sends the full input gradient to every rank of the
    sending unit. Under DTensor semantics the gradient of a ``Replicate`` tensor is the full
    gradient on every rank, so one rank's copy is the whole gradient: it is counted once, never
    summed over the receiver's ranks.

- **Loss.** Every rank of the LLM's last unit computes the full loss (vocabulary-parallel
  cross-entropy under TP, `loss_context`); backward runs from it on every rank (each holds the
  one replicated value), and only the leader reports it (`reports_loss`), so the sum of the
  reported losses over all ranks is the reference loss.
- **Gradients.** A parameter sharded by TP is a DTensor whose local shard each rank owns; a
  replicated parameter's gradient is the full gradient on every rank of the unit (DTensor
  reduces it inside the unit). Data-parallel synchronisation is a SUM all-reduce of local
  shards over the replicas (`sync_gradients`; context parallelism joins the group as dp x cp),
  and the clipping norm counts every shard once and a replicated parameter once per unit
  (`grad_norm_sq`).

With TP = CP = 1 a unit is one rank and all of this reduces to the plain pipeline runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from loom.data.sample import Batch
from loom.model.multimodal import IGNORE_INDEX
from loom.plan.plan import LLM, Plan
from loom.runtime.context_parallel import cp_block


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local part: the shard a rank owns for a DTensor, ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor split over its mesh (each rank owns a distinct part)."""
    return isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)


@dataclass
class UnitPlace:
    """Where one rank sits in its pipeline unit (module docstring for the contract)."""

    plan: Plan
    rank: int
    module: str
    stage: int
    replica: int
    context: int  # cp rank inside the unit
    tensor: int  # tp rank inside the unit
    unit: int  # the pipeline unit: the key of this rank's actions in a schedule
    tp_mesh: DeviceMesh | None = None  # 1-d mesh over the unit's TP ranks (None: TP = 1)
    cp_mesh: DeviceMesh | None = None  # 1-d mesh over the unit's CP ranks (None: CP = 1)

    @classmethod
    def of(cls, plan: Plan, rank: int, meshes: dict[str, DeviceMesh] | None = None) -> "UnitPlace":
        """``rank``'s place; with ``meshes`` (`loom.runtime.mesh.build_meshes`) its unit's TP
        and CP sub-meshes where those degrees exceed 1 (sliced on this rank only: slicing is
        local to the rank's own module mesh)."""
        c = plan.coordinate_of(rank)
        spec = plan.spec(c.module)
        tp_mesh = cp_mesh = None
        if meshes is not None:
            if spec.tensor_parallel > 1:
                tp_mesh = meshes[c.module]["tp"]
            if spec.context_parallel > 1:
                cp_mesh = meshes[c.module]["cp"]
        return cls(plan, rank, c.module, c.stage, c.replica, c.context, c.tensor,
                   plan.unit_of(c.module, c.stage, c.replica), tp_mesh, cp_mesh)

    # ---- the unit ------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.plan.spec(self.module).tensor_parallel

    @property
    def cp_size(self) -> int:
        return self.plan.spec(self.module).context_parallel

    @property
    def size(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def index(self) -> int:
        """This rank's position in its unit (CP-major, then TP, as the rank layout)."""
        return self.context * self.tp_size + self.tensor

    @property
    def is_leader(self) -> bool:
        """The unit's first rank: it sends a full output across modules and reports the loss."""
        return self.index == 0

    @property
    def reports_loss(self) -> bool:
        """TP ranks share one (replicated) loss; CP ranks each hold their tokens' share."""
        return self.tensor == 0

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.tp_mesh.get_group() if self.tp_mesh is not None else None

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.cp_mesh.get_group() if self.cp_mesh is not None else None

    def unit_ranks(self, unit: int) -> list[int]:
        """The global ranks of pipeline unit ``unit``, in unit order (its leader first)."""
        module, stage, replica = self.plan.role_of_unit(unit)
        first = self.plan.rank_of(module, stage, replica)
        return list(range(first, first + self.plan.spec(module).ranks_per_unit))

    def same_layout(self, unit: int) -> bool:
        """Whether ``unit`` has this unit's (cp, tp) layout and rank-to-rank messages: stages of
        the same module (edges only join consecutive stages)."""
        return self.plan.role_of_unit(unit)[0] == self.module

    # ---- messages between units ------------------------------------------------------------
    def destinations(self, unit: int) -> list[int]:
        """The ranks this rank sends a message for peer unit ``unit`` to (an activation forward,
        or an input gradient backward): its counterpart of the same index in the same module,
        otherwise every rank of ``unit`` from the leader and none from the other ranks."""
        ranks = self.unit_ranks(unit)
        if self.same_layout(unit):
            return [ranks[self.index]]
        return ranks if self.is_leader else []

    def source(self, unit: int) -> int:
        """The rank this rank receives a message from peer unit ``unit`` from: its counterpart of
        the same index in the same module, otherwise ``unit``'s leader."""
        ranks = self.unit_ranks(unit)
        return ranks[self.index] if self.same_layout(unit) else ranks[0]

    # ---- microbatches ----------------------------------------------------------------------
    @property
    def sequence_multiple(self) -> int:
        """What the LLM's sequence length must be a multiple of on this unit: the TP degree
        (sequence parallelism shards it evenly); 1 elsewhere."""
        return self.tp_size if self.module == LLM else 1

    def prepare_microbatches(self, microbatches: dict[int, Batch],
                             placeholder_ids: dict[str, int]) -> tuple[dict[int, Batch], dict[int, int]]:
        """The microbatches as this unit runs them, and the CP block size of each (LLM units under
        context parallelism; empty otherwise). Without CP the LLM's rows are right-padded to
        `sequence_multiple`; under CP each row's block is `cp_block` of its length, a multiple of
        the TP degree, and with TP the rows are padded to whole blocks (every CP rank then holds
        whole blocks, a multiple of the TP degree)."""
        if self.module == LLM and self.cp_size > 1:
            blocks, out = {}, {}
            for j, b in microbatches.items():
                blocks[j] = cp_block(b.input_ids.shape[1], self.cp_size, self.tp_size)
                out[j] = pad_microbatch(b, blocks[j], placeholder_ids) if self.tp_size > 1 else b
            return out, blocks
        multiple = self.sequence_multiple
        if multiple == 1:
            return microbatches, {}
        return {j: pad_microbatch(b, multiple, placeholder_ids) for j, b in microbatches.items()}, {}

    def share_microbatches(self, microbatches: dict[int, Batch]) -> dict[int, Batch]:
        """The unit leader's microbatches on every rank of the unit (the `Dispatcher` delivers a
        unit's payloads to its leader only): broadcast over the leader's TP group, then over
        each CP group. What the other ranks were given is replaced."""
        if self.size == 1:
            return microbatches
        box = [microbatches]
        for mesh, root in ((self.tp_mesh, self.context == 0), (self.cp_mesh, True)):
            if mesh is not None and root:
                group = mesh.get_group()
                dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    # ---- loss ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        """Vocabulary-parallel cross-entropy (``loss_parallel``) on a TP unit, for the forward
        and the backward of the loss; nothing otherwise."""
        if self.tp_mesh is None:
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield

    @staticmethod
    def loss_value(loss: torch.Tensor) -> torch.Tensor:
        """The loss as a plain tensor: a replicated DTensor's local value (the full loss; backward
        from it on every rank is DTensor's gradient of one replicated value)."""
        return loss.to_local() if isinstance(loss, DTensor) else loss

    # ---- gradients -----------------------------------------------------------------------
    def grad_norm_sq(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's share of the squared global gradient norm of ``params`` (with gradients):
        a sharded parameter's local part on every rank, a replicated one on the unit's leader
        only; 0 on replicas other than the first (they hold the same gradients after the sync).
        Per-parameter norms first, as ``clip_grad_norm_`` does (after `settle_gradients`)."""
        settle_gradients(params)
        # CP ranks hold the same shards after the dp x cp sync: count the first CP rank's
        sharded = [local_tensor(p.grad.detach()) for p in params if is_sharded(p)] if self.context == 0 else []
        whole = [local_tensor(p.grad.detach()) for p in params if not is_sharded(p)] if self.is_leader else []
        grads = sharded + whole
        if not grads or self.replica != 0:
            device = params[0].grad.device if params else torch.device("cpu")
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0).float() for g in grads])
        return (norms * norms).sum()


def settle_gradients(params: list[nn.Parameter]) -> None:
    """Give each DTensor parameter's gradient the parameter's own placements. Autograd may leave
    it otherwise (a ``Partial`` sum for a replicated norm weight computed on sequence shards, a
    ``Replicate`` gradient for a vocabulary-sharded embedding); the data-parallel sync, the
    clipping norm and the optimizer all read local shards, which must be the parameter's."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def sync_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Settle ``params``' gradients (`settle_gradients`), then a SUM all-reduce of them over ``group`` (the data-parallel replicas of one
    stage), in one flat bucket of local shards (a TP-sharded parameter syncs its own shard with
    the same shard of every replica). A missing gradient joins as zeros."""
    settle_gradients(params)
    if group is None or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    shards = [local_tensor(g) for g in grads]
    flat = _flatten_dense_tensors(shards)
    dist.all_reduce(flat, group=group)
    for p, g, shard, summed in zip(params, grads, shards, _unflatten_dense_tensors(flat, shards)):
        shard.copy_(summed)
        p.grad = g


def pad_microbatch(batch: Batch, multiple: int, placeholder_ids: dict[str, int]) -> Batch:
    """``batch`` right-padded so its sequence length is a multiple of ``multiple`` (even
    sequence shards): padding takes an id that is no placeholder, label ``IGNORE_INDEX``, and
    in a packed row a segment of its own, so no real token sees it or changes."""
    length = batch.input_ids.shape[1]
    extra = -length % multiple
    if extra == 0:
        return batch
    taken = set(placeholder_ids.values())
    pad_id = next(i for i in range(len(taken) + 1) if i not in taken)
    ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=pad_id)
    labels = torch.nn.functional.pad(batch.labels, (0, extra), value=IGNORE_INDEX)
    segments = None if batch.segments is None else [*batch.segments, extra]
    return dataclasses.replace(batch, input_ids=ids, labels=labels, segments=segments)
