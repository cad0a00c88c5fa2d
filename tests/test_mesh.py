"""Module meshes from the plan (loom.runtime.mesh): sizes, coordinates and the data-parallel
groups agree with the plan's rank layout (`Plan.rank_of`, `role_of`, `coordinate_of`), and
``loom plan`` prints each rank's coordinates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.plan.plan import MESH_DIMS, ModuleSpec, Plan, PlanError
from loom.runtime.local import run_local
from loom.runtime.mesh import build_meshes, build_replica_meshes, data_parallel_group, module_mesh_ranks

ROOT = Path(__file__).resolve().parents[1]


def _plans() -> dict[str, Plan]:
    """Plans of 8 ranks: DP x PP with encoders, TP x DP x PP, and CP / TP on encoders."""
    return {
        "dp_x_pp": Plan([ModuleSpec("vision", data_parallel=2), ModuleSpec("llm", num_stages=3, data_parallel=2)],
                        num_microbatches=4),
        "tp_dp_pp": Plan([ModuleSpec("llm", num_stages=2, data_parallel=2, tensor_parallel=2)], num_microbatches=4),
        "cp_tp": Plan([ModuleSpec("vision", context_parallel=2), ModuleSpec("audio", tensor_parallel=2),
                       ModuleSpec("llm", num_stages=2, data_parallel=2)], num_microbatches=4),
    }


@pytest.mark.parametrize("case", list(_plans()))
def test_coordinates_invert_rank_of_and_extend_role_of(case):
    plan = _plans()[case]
    assert plan.world_size == 8
    for rank in range(plan.world_size):
        c = plan.coordinate_of(rank)
        assert (c.module, c.stage, c.replica) == plan.role_of(rank)
        assert plan.rank_of(c.module, c.stage, c.replica, tp=c.tensor, cp=c.context) == rank
    for m in plan.modules:
        ranks = module_mesh_ranks(plan, m.name)
        assert tuple(ranks.shape) == plan.mesh_shape(m.name)
        for index in torch.cartesian_prod(*(torch.arange(n) for n in ranks.shape)).reshape(-1, 4).tolist():
            s, d, cp, tp = index
            assert int(ranks[s, d, cp, tp]) == plan.rank_of(m.name, s, d, tp=tp, cp=cp)
    with pytest.raises(PlanError, match="outside the plan's world size 8"):
        plan.coordinate_of(8)


def _mesh_worker(rank: int, world_size: int, out: str) -> None:
    results = {}
    for case, plan in _plans().items():
        meshes = build_meshes(plan, "cpu")
        mine = plan.coordinate_of(rank)
        seen = {}
        for name, mesh in meshes.items():
            coordinate = mesh.get_coordinate()
            seen[name] = (tuple(mesh.shape), mesh.mesh_dim_names, mesh.mesh.tolist(),
                          None if coordinate is None else tuple(coordinate))
        own = meshes[mine.module]
        # every named dimension is there, size-1 ones included, as a group over the right ranks
        dims = {dim: dist.get_process_group_ranks(own.get_group(dim)) for dim in MESH_DIMS}
        group = data_parallel_group(meshes, plan, rank, build_replica_meshes(plan, "cpu"))
        total = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(total, group=group)
        results[case] = {"meshes": seen, "dims": dims, "dp_sum": float(total),
                         "dp_group": None if group is None else dist.get_process_group_ranks(group)}
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.mark.multiprocess
def test_meshes_match_the_plan_on_gloo(tmp_path):
    run_local(_mesh_worker, 8, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(8)]
    for case, plan in _plans().items():
        for rank, res in enumerate(r[case] for r in results):
            mine = plan.coordinate_of(rank)
            for m in plan.modules:
                shape, names, ranks, coordinate = res["meshes"][m.name]
                assert shape == plan.mesh_shape(m.name) and names == MESH_DIMS
                assert ranks == module_mesh_ranks(plan, m.name).tolist()
                assert coordinate == (mine.index if m.name == mine.module else None), (case, rank, m.name)
            s, d, cp, tp = mine.index
            mod, spec = mine.module, plan.spec(mine.module)
            along = {
                "pp": [plan.rank_of(mod, x, d, tp=tp, cp=cp) for x in range(spec.num_stages)],
                "dp": [plan.rank_of(mod, s, x, tp=tp, cp=cp) for x in range(spec.data_parallel)],
                "cp": [plan.rank_of(mod, s, d, tp=tp, cp=x) for x in range(spec.context_parallel)],
                "tp": [plan.rank_of(mod, s, d, tp=x, cp=cp) for x in range(spec.tensor_parallel)],
            }
            assert res["dims"] == along, (case, rank)
            # gradients sync over the replicas, and over dp x cp under context parallelism
            replicas = [plan.rank_of(mod, s, x, tp=tp, cp=y) for x in range(spec.data_parallel)
                        for y in range(spec.context_parallel)]
            assert res["dp_group"] == (replicas if len(replicas) > 1 else None)
            assert res["dp_sum"] == float(sum(replicas)), (case, rank)


def test_loom_plan_prints_mesh_coordinates(tmp_path):
    out = subprocess.run([sys.executable, "-m", "loom.cli", "plan", "--config", str(ROOT / "configs/demo.toml"),
                          "plan.modules.llm.data_parallel=2"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "mesh llm: (pp, dp, cp, tp) = (2, 2, 1, 1)" in lines
    # vision, audio, then the LLM's 2 stages x 2 replicas, stage-major
    assert "rank 0 = vision stage 0 replica 0; mesh (pp, dp, cp, tp) = (0, 0, 0, 0)" in lines
    assert "rank 3 = llm stage 0 replica 1; mesh (pp, dp, cp, tp) = (0, 1, 0, 0)" in lines
    assert "rank 4 = llm stage 1 replica 0; mesh (pp, dp, cp, tp) = (1, 0, 0, 0)" in lines
