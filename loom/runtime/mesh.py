"""One `DeviceMesh` per module, built from the plan (docs/architecture.md, "Plans and schedules
are data"; the shape of torchtitan's ``ParallelDims.build_mesh``, one mesh per module because a
multimodal plan gives every module degrees of its own).

A module's mesh covers that module's contiguous block of ranks with dimensions `MESH_DIMS` =
``("pp", "dp", "cp", "tp")``: its ranks reshaped to ``(num_stages, data_parallel,
context_parallel, tensor_parallel)``, which is exactly the layout of `Plan.rank_of`, so a rank's
mesh coordinate is `Plan.coordinate_of`. Dimensions of size 1 are kept, so code for one
technique asks ``mesh["tp"]`` or ``mesh["dp"]`` whatever the degrees. Ranks outside a module
hold its mesh too, with ``get_coordinate() is None``; slice it (``mesh["dp", "cp", "tp"]``, the
rank's pipeline unit) or flatten it (``mesh["dp", "cp"]._flatten()``, FSDP's dp x cp) only on
its own ranks: torch 2.13 refuses to slice a mesh whose ``pp`` is above 1 elsewhere.

Creating a mesh creates its process groups, which is collective over the whole world: every
rank builds every module's mesh, in plan order. Process groups of the edges between modules
stay in `loom.runtime.comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loom.plan.plan import MESH_DIMS, Plan


class MeshError(RuntimeError):
    """A mesh that does not match the plan it was built from."""


def module_mesh_ranks(plan: Plan, name: str) -> torch.Tensor:
    """Module ``name``'s global ranks shaped ``plan.mesh_shape(name)`` (``MESH_DIMS`` order)."""
    offset = plan.rank_offset(name)
    shape = plan.mesh_shape(name)
    return torch.arange(offset, offset + plan.spec(name).num_ranks, dtype=torch.int).reshape(shape)


def build_meshes(plan: Plan, device_type: str) -> dict[str, DeviceMesh]:
    """Every module's mesh, keyed by module name. Call on every rank, after
    ``torch.distributed`` is initialised, with a plan of the world's size."""
    if dist.get_world_size() != plan.world_size:
        raise MeshError(f"the plan needs {plan.world_size} ranks but the world has {dist.get_world_size()}: "
                        f"launch {plan.world_size} processes or change the plan's degrees")
    meshes = {m.name: DeviceMesh(device_type, module_mesh_ranks(plan, m.name), mesh_dim_names=MESH_DIMS)
              for m in plan.modules}
    check_meshes(plan, meshes, dist.get_rank())
    return meshes


def check_meshes(plan: Plan, meshes: dict[str, DeviceMesh], rank: int) -> None:
    """Each mesh has the plan's sizes, and ``rank`` has a coordinate in its own module's mesh
    only, equal to `Plan.coordinate_of` (as torchtitan's ``ParallelDims._validate_meshes``), and
    under ``first_stage`` in the meshes of the encoders its LLM position hosts."""
    mine = plan.coordinate_of(rank)
    for name, mesh in meshes.items():
        if tuple(mesh.shape) != plan.mesh_shape(name) or mesh.mesh_dim_names != MESH_DIMS:
            raise MeshError(f"module {name!r}: mesh {tuple(mesh.shape)} over {mesh.mesh_dim_names}, but the plan "
                            f"gives {plan.mesh_shape(name)} over {MESH_DIMS}")
        coordinate = mesh.get_coordinate()
        expected = mine.index if name == mine.module else None
        if plan.hosted_by_llm(name) and plan.placement == "colocated":  # every unit hosts a replica, at its TP
            expected = (0, rank // plan.spec(name).tensor_parallel, 0, rank % plan.spec(name).tensor_parallel)
        elif plan.hosted_by_llm(name) and mine.stage == 0:  # first_stage: the LLM's first position hosts it
            expected = (0, mine.replica, 0, mine.tensor)
        if (tuple(coordinate) if coordinate is not None else None) != expected:
            raise MeshError(f"rank {rank}: coordinate {coordinate} in module {name!r}'s mesh, but the plan "
                            f"places it at {expected}")


def data_parallel_group(meshes: dict[str, DeviceMesh], plan: Plan, rank: int,
                        replicas: dict[str, DeviceMesh] | None = None) -> dist.ProcessGroup | None:
    """The group ``rank``'s stage synchronises gradients over: its data-parallel replicas (the
    ``dp`` dimension of its module's mesh), or, under context parallelism, the ``dp_cp`` group of
    `build_replica_meshes` (CP ranks each hold their tokens' share of the gradient); None when
    there is nothing to synchronise."""
    module = plan.coordinate_of(rank).module
    spec = plan.spec(module)
    if spec.context_parallel > 1:
        if replicas is None or module not in replicas:
            raise MeshError(f"module {module!r} has context_parallel = {spec.context_parallel}: pass the meshes of "
                            f"build_replica_meshes as replicas=")
        return replicas[module].get_group("dp_cp")
    if spec.data_parallel == 1:
        return None
    return meshes[module].get_group("dp")


def stage_data_parallel_group(meshes: dict[str, DeviceMesh], plan: Plan, rank: int, module: str,
                              replicas: dict[str, DeviceMesh] | None = None) -> dist.ProcessGroup | None:
    """The group a stage of ``module`` on ``rank`` synchronises gradients over: the rank's own
    module's (`data_parallel_group`), or, for an encoder the rank hosts (``first_stage``,
    ``colocated``), the ``dp`` dimension of that encoder's mesh."""
    if not plan.hosted_by_llm(module):
        return data_parallel_group(meshes, plan, rank, replicas)
    if plan.spec(module).data_parallel == 1:
        return None
    return meshes[module].get_group("dp")


REPLICA_DIMS = ("pp", "dp_cp", "tp")


def build_replica_meshes(plan: Plan, device_type: str) -> dict[str, DeviceMesh]:
    """For each module with context parallelism, a mesh over the same ranks with ``dp`` and ``cp``
    flattened into ``dp_cp`` (contiguous under the rank layout): the group of a stage's ranks that
    hold the same parameters (or TP shards) and partial gradients. Built as a mesh of its own, on
    every rank in plan order (group creation is collective), rather than by ``_flatten`` on the
    module's ranks only."""
    out = {}
    for m in plan.modules:
        if m.context_parallel == 1:
            continue
        pp, dp, cp, tp = plan.mesh_shape(m.name)
        ranks = module_mesh_ranks(plan, m.name).reshape(pp, dp * cp, tp)
        out[m.name] = DeviceMesh(device_type, ranks, mesh_dim_names=REPLICA_DIMS)
    return out


HYBRID_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_hybrid_meshes(plan: Plan, device_type: str) -> dict[str, DeviceMesh]:
    """For each module with hybrid sharding (``ModuleSpec.shard_degree`` below its
    ``data_parallel``), a mesh over the same ranks as its `build_meshes` mesh with ``dp`` split
    into ``(dp_replicate, dp_shard)``: consecutive replicas form a shard group (inside a node
    under the plan's rank layout), the groups replicate. Collective like `build_meshes`: call on
    every rank, in plan order; slice ``mesh["dp_replicate", "dp_shard"]`` on the module's ranks."""
    out = {}
    for m in plan.modules:
        shard = m.shard_degree or m.data_parallel
        if shard == m.data_parallel:
            continue
        pp, dp, cp, tp = plan.mesh_shape(m.name)
        ranks = module_mesh_ranks(plan, m.name).reshape(pp, dp // shard, shard, cp, tp)
        out[m.name] = DeviceMesh(device_type, ranks, mesh_dim_names=HYBRID_DIMS)
    return out
