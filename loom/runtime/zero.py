"""ZeRO stages 1 to 3 over a module's data-parallel group (issue 9 point 5; the ZeRO paper's
stages as PyTorch's FSDP2 executes them, DESIGN.md principle 5).

- **Stage 3**: `fully_shard` of every layer of the rank's stage with
  ``reshard_after_forward=True`` (parameters, gradients and optimizer state sharded; each layer
  all-gathers its parameters for forward and again for backward).
- **Stage 2**: the same with ``reshard_after_forward=False`` (parameters stay gathered from
  forward to backward; gradients and optimizer state sharded).
- **Stage 1**: `torch.distributed.optim.ZeroRedundancyOptimizer` over the dp group. Gradients
  stay whole and are SUM all-reduced by the executor's GRAD_SYNC as without ZeRO, each rank
  updates the parameters it owns and broadcasts them: exactly "optimizer state sharded, nothing
  else". FSDP2 with parameters kept whole cannot express it (its optimizer state follows the
  sharded parameters), so stage 1 does not use FSDP. Under tensor parallelism the parameters
  are DTensors, which ``ZeroRedundancyOptimizer`` cannot broadcast (``c10d.broadcast_`` has no
  DTensor sharding strategy): `ShardedStateOptimizer` does the same on the TP shards (each dp
  rank steps the shards it owns, then broadcasts them, local tensors only).

**With tensor parallelism on the same module** (torchtitan's order, DESIGN.md principle 5):
`loom.runtime.tensor_parallel` first splits each layer over the unit's ``tp`` mesh, then
`fully_shard` shards the TP shards over the ``dp`` dimension of the same module mesh, so
FSDP2 works on a 2-D (dp, tp) mesh: it all-gathers and reduce-scatters local TP shards over
dp, and turns a replicated parameter's ``Partial`` TP gradient (a norm weight under sequence
parallelism) into the parameter's placement before reducing. A sharded gradient is then a
DTensor on (dp, tp): `ZeroStage.grad_norm_sq` counts each distinct shard once.

**Mixed precision** (``run.dtype = "bf16"``, `loom.runtime.precision`): FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gathers the parameters in bf16
(half the all-gather bytes) while the sharded master weights, the gradient reduce-scatter and
the optimizer state stay fp32; inputs are not cast (``cast_forward_inputs=False``: the residual
stream stays fp32, autocast casts what the matrix products read, as without FSDP).

Semantics stay the reference's (`loom.runtime.executor`): losses are scaled by the global
target count, so FSDP's gradient reduction is a SUM (divide factor 1); a stage runs several
microbatch backwards per iteration and reduces only after the last of them
(`ZeroStage.before_backward`, as ``torch.distributed.pipelining``'s stage does with
``set_requires_gradient_sync`` / ``set_is_last_backward``); the GRAD_SYNC action leaves
FSDP-managed gradients alone. Frozen parameters have ``requires_grad=False``: FSDP2 gives them
no gradient and reduces none; a fully frozen stage only all-gathers for its no-grad forwards.

**Hybrid sharding** (``ModuleSpec.shard_degree`` below ``data_parallel``): FSDP2 on a 2-D
(replicate, shard) mesh of the stage's dp ranks (`loom.runtime.mesh.build_hybrid_meshes`):
parameters sharded inside each group of ``shard_degree`` consecutive replicas, gradients
reduce-scattered inside and all-reduced across the groups. Under TP the unit's TP mesh is sliced
from the same hybrid mesh (the engine passes it to `loom.runtime.unit.UnitPlace.of`), so FSDP2
joins them into one 3-D (replicate, shard, tp) mesh.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.runtime.precision import Precision
from loom.runtime.stage import Stage


@dataclass
class ZeroStage:
    """One rank's ZeRO state for its stage: the FSDP-wrapped layers (stages 2 and 3)."""

    zero_stage: int
    modules: list[FSDPModule] = field(default_factory=list)
    tp_rank: int = 0  # the rank's coordinate in its unit's TP mesh (0 without TP)

    @property
    def shards_gradients(self) -> bool:
        """Gradients are FSDP's (sharded DTensors, reduced in backward): GRAD_SYNC skips them."""
        return bool(self.modules)

    def before_backward(self, last: bool) -> None:
        """Before a backward of the stage: reduce (and finish the iteration's backward) only
        when it is the stage's last backward of the iteration; earlier ones accumulate."""
        for m in self.modules:
            m.set_requires_gradient_sync(last, recurse=False)
            m.set_is_last_backward(last)

    def grad_norm_sq(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the local part of every
        sharded gradient that this rank is the first holder of (`counts_shard`), so each
        distinct shard over dp, tp and the hybrid replicas counts once. A parameter TP leaves
        whole (an encoder's front-end or projector) is sharded over dp only, the same shard on
        every TP rank of the unit: the first TP rank counts it."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad.detach() for p in params)
                 if counts_shard(g) and (self.tp_rank == 0 or _on_tp_mesh(g))]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0).float() for g in grads])
        return (norms * norms).sum()


def counts_shard(t: torch.Tensor) -> bool:
    """Whether this rank counts ``t``'s local part in a global sum: a DTensor's local part is
    replicated along each mesh dimension whose placement is ``Replicate`` (the hybrid
    replicas, the TP ranks of a replicated norm weight), so only coordinate 0 there counts it;
    a plain tensor is this rank's own."""
    if not isinstance(t, DTensor):
        return True
    coordinate = t.device_mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c, pl in zip(coordinate, t.placements)
                                          if isinstance(pl, Replicate))


def _on_tp_mesh(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and "tp" in (t.device_mesh.mesh_dim_names or ())


def mixed_precision_policy(precision: Precision | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for the run's precision (module docstring): bf16 all-gathers with fp32
    reduction under ``run.dtype = "bf16"``, FSDP's defaults (the parameters' fp32) otherwise."""
    if precision is None or not precision.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


def shard_stage(stage: Stage, zero_stage: int, mesh: DeviceMesh, precision: Precision | None = None,
                tp_rank: int = 0) -> ZeroStage:
    """`fully_shard` each layer of ``stage`` over ``mesh`` (1-D dp, or 2-D (replicate, shard)
    for hybrid sharding) for ZeRO 2 or 3; gradients SUM-reduced (divide factor 1). Layers
    already split by TP keep their TP shards and FSDP shards those over ``mesh``, which must
    come from the same module mesh as the TP mesh (module docstring)."""
    modules: list[FSDPModule] = []
    policy = mixed_precision_policy(precision)
    for layer in stage.layers:
        if not any(True for _ in layer.module.parameters()):
            continue
        fully_shard(layer.module, mesh=mesh, reshard_after_forward=zero_stage >= 3, mp_policy=policy)
        # a plain SUM: divide factor 1, and SUM ops only (a factor otherwise becomes NCCL's
        # PREMUL_SUM, which gloo lacks; with factor 1 FSDP skips its post-division)
        layer.module.set_gradient_divide_factor(1.0)
        layer.module.set_force_sum_reduction_for_comms(True)
        modules.append(layer.module)
    return ZeroStage(zero_stage, modules, tp_rank)


class ShardedStateOptimizer(torch.optim.Optimizer):
    """ZeRO 1 over ``group`` for parameters that are DTensors (TP shards): each parameter has
    one owner in the group (largest first onto the least-loaded rank, by local elements, as
    ``ZeroRedundancyOptimizer`` partitions), the inner ``optimizer_class`` holds state for the
    owned ones only and steps them, then every owner broadcasts its updated local shards (one
    flat bucket per owner). Gradients are whole (synchronised before the step), so every rank
    of the group ends the step with the same shards as an unsharded optimizer would give."""

    def __init__(self, params: list[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                 group: dist.ProcessGroup, **defaults: Any):
        params = list(params)
        super().__init__(params, defaults)
        self.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        load = [0] * size
        self.owners: list[list[torch.Tensor]] = [[] for _ in range(size)]  # per group rank, its params
        mine = []
        for p in sorted(params, key=lambda q: -_local(q).numel()):  # stable: the same order everywhere
            owner = min(range(size), key=load.__getitem__)
            load[owner] += _local(p).numel()
            self.owners[owner].append(p)
            if owner == me:
                mine.append(p)
        self.optim = optimizer_class(mine, **defaults) if mine else None
        self.state = self.optim.state if self.optim is not None else self.state  # the owned shards' state only

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardedStateOptimizer.step takes no closure (loom's executor steps without one)")
        if self.optim is not None:
            for key, value in self.param_groups[0].items():  # the LR schedule writes the outer groups
                if key != "params":
                    self.optim.param_groups[0][key] = value
            self.optim.step()
        for owner, params in enumerate(self.owners):
            if not params:
                continue
            shards = [_local(p).detach() for p in params]
            flat = _flatten_dense_tensors(shards)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, owner), group=self.group)
            for shard, value in zip(shards, _unflatten_dense_tensors(flat, shards)):
                shard.copy_(value)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def zero_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                   group: dist.ProcessGroup) -> torch.optim.Optimizer:
    """ZeRO 1: ``optimizer``'s class and settings, its state sharded over ``group``
    (`ZeroRedundancyOptimizer`, or `ShardedStateOptimizer` when the parameters are TP shards;
    each rank steps its own parameters and broadcasts them)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # defaults can hold derived keys the constructor does not take (AdamW's decoupled_weight_decay)
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if any(isinstance(p, DTensor) for p in params):
        return ShardedStateOptimizer(params, type(optimizer), group, **settings)
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **settings)


def check_zero(spec: ModuleSpec) -> None:
    """Refuse a ZeRO setting the runtime cannot execute (before any group is built)."""
    where = f"plan.modules[{spec.name!r}]"
    if spec.zero_stage and spec.data_parallel == 1:
        raise PlanError(f"{where}.zero_stage = {spec.zero_stage} with data_parallel = 1: ZeRO shards over the "
                        f"data-parallel replicas and there is one; set zero_stage = 0 or data_parallel >= 2")
    shard = spec.shard_degree or spec.data_parallel
    if shard != spec.data_parallel and spec.zero_stage < 2:
        raise PlanError(f"{where}.shard_degree = {spec.shard_degree} needs zero_stage 2 or 3 (hybrid sharding "
                        f"is FSDP's); set zero_stage = 2 or 3, or leave shard_degree unset")


def apply_zero(stage: Stage, plan: Plan, meshes: dict[str, DeviceMesh],
               hybrid: dict[str, DeviceMesh], precision: Precision | None = None,
               replicas: dict[str, DeviceMesh] | None = None) -> ZeroStage | None:
    """The rank's `ZeroStage` under its module's ``zero_stage`` 2 or 3 (None otherwise: stage 1
    is the optimizer's, `zero_optimizer`). Call after tensor parallelism split the stage. Under
    context parallelism FSDP shards over the dp x cp ranks (``replicas``,
    `loom.runtime.mesh.build_replica_meshes`): they hold the same parameters, and its
    reduce-scatter sums the CP ranks' partial gradients with the replicas'."""
    spec = plan.spec(stage.module)
    if spec.zero_stage < 2 or spec.data_parallel == 1:
        return None
    if spec.context_parallel > 1:
        if replicas is None or stage.module not in replicas:
            raise ValueError(f"module {stage.module!r} has context_parallel = {spec.context_parallel}: pass the "
                             f"meshes of build_replica_meshes as replicas=")
        mesh = replicas[stage.module]["dp_cp"]
    elif stage.module in hybrid:
        mesh = hybrid[stage.module]["dp_replicate", "dp_shard"]
    else:
        mesh = meshes[stage.module]["dp"]  # the same root as the unit's tp mesh: FSDP's (dp, tp)
    tp_rank = meshes[stage.module]["tp"].get_local_rank() if spec.tensor_parallel > 1 else 0
    return shard_stage(stage, spec.zero_stage, mesh, precision, tp_rank)
