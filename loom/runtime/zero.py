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
  sharded parameters), so stage 1 does not use FSDP.

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
reduce-scattered inside and all-reduced across the groups.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.runtime.stage import Stage


@dataclass
class ZeroStage:
    """One rank's ZeRO state for its stage: the FSDP-wrapped layers (stages 2 and 3)."""

    zero_stage: int
    modules: list[FSDPModule] = field(default_factory=list)
    replicate_rank: int = 0  # the rank's coordinate across shard groups (0 without hybrid sharding)

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
        """This rank's share of the squared global gradient norm: its local shard of every
        sharded gradient, on the first shard group only (the others hold the same shards)."""
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad.detach() for p in params)]
        if not grads or self.replicate_rank != 0:
            return torch.zeros((), dtype=torch.float32)
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0).float() for g in grads])
        return (norms * norms).sum()


def shard_stage(stage: Stage, zero_stage: int, mesh: DeviceMesh) -> ZeroStage:
    """`fully_shard` each layer of ``stage`` over ``mesh`` (1-D dp, or 2-D (replicate, shard)
    for hybrid sharding) for ZeRO 2 or 3; gradients SUM-reduced (divide factor 1)."""
    modules: list[FSDPModule] = []
    for layer in stage.layers:
        if not any(True for _ in layer.module.parameters()):
            continue
        fully_shard(layer.module, mesh=mesh, reshard_after_forward=zero_stage >= 3)
        # a plain SUM: divide factor 1, and SUM ops only (a factor otherwise becomes NCCL's
        # PREMUL_SUM, which gloo lacks; with factor 1 FSDP skips its post-division)
        layer.module.set_gradient_divide_factor(1.0)
        layer.module.set_force_sum_reduction_for_comms(True)
        modules.append(layer.module)
    replicate = mesh.get_local_rank(0) if mesh.ndim == 2 else 0
    return ZeroStage(zero_stage, modules, replicate)


def zero_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                   group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    """ZeRO 1: ``optimizer``'s class and settings, its state sharded over ``group``
    (`ZeroRedundancyOptimizer`; each rank steps its own parameters and broadcasts them)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # defaults can hold derived keys the constructor does not take (AdamW's decoupled_weight_decay)
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), process_group=group, **settings)


def check_zero(spec: ModuleSpec) -> None:
    """Refuse a ZeRO setting the runtime cannot execute (before any group is built)."""
    where = f"plan.modules[{spec.name!r}]"
    if spec.zero_stage and spec.data_parallel == 1:
        raise PlanError(f"{where}.zero_stage = {spec.zero_stage} with data_parallel = 1: ZeRO shards over the "
                        f"data-parallel replicas and there is one; set zero_stage = 0 or data_parallel >= 2")
    if spec.zero_stage and spec.tensor_parallel > 1:
        raise PlanError(f"{where}.zero_stage = {spec.zero_stage} with tensor_parallel = {spec.tensor_parallel}: "
                        f"ZeRO over tensor-parallel shards is not executed yet; set one of them to its default")
    shard = spec.shard_degree or spec.data_parallel
    if shard != spec.data_parallel and spec.zero_stage < 2:
        raise PlanError(f"{where}.shard_degree = {spec.shard_degree} needs zero_stage 2 or 3 (hybrid sharding "
                        f"is FSDP's); set zero_stage = 2 or 3, or leave shard_degree unset")


def apply_zero(stage: Stage, plan: Plan, meshes: dict[str, DeviceMesh],
               hybrid: dict[str, DeviceMesh]) -> ZeroStage | None:
    """The rank's `ZeroStage` under its module's ``zero_stage`` 2 or 3 (None otherwise: stage 1
    is the optimizer's, `zero_optimizer`)."""
    spec = plan.spec(stage.module)
    if spec.zero_stage < 2 or spec.data_parallel == 1:
        return None
    if stage.module in hybrid:
        mesh = hybrid[stage.module]["dp_replicate", "dp_shard"]
    else:
        mesh = meshes[stage.module]["dp"]
    return shard_stage(stage, spec.zero_stage, mesh)
