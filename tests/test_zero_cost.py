"""Hybrid sharding in the cost model (issue 9 point 5, `loom.cost.analytic`): a shard group of
``shard_degree`` replicas inside a node, groups replicated across nodes; the gradient sync is a
reduce-scatter inside plus an all-reduce of each shard across (FSDP2's HSDP, `loom.runtime.zero`);
`loom plan` prints the sharding."""

from __future__ import annotations

import pytest

from loom.cli import main
from loom.cost import comm
from loom.cost.analytic import AnalyticCostModel, MASTER_BYTES
from loom.cost.hardware import Cluster, get_gpu
from loom.cost.model_configs import load_model_arch
from loom.plan.plan import ModuleSpec, Plan


def _cost(**llm) -> AnalyticCostModel:
    arch = load_model_arch(llm="llama3-8b")
    plan = Plan([ModuleSpec("llm", data_parallel=16, **llm)], num_microbatches=16)
    return AnalyticCostModel(arch, plan, Cluster("H100", 16, 8))


def test_hybrid_groups_shard_inside_a_node_and_replicate_across() -> None:
    gpu = get_gpu("H100")
    plain, hybrid = _cost(zero_stage=3), _cost(zero_stage=3, shard_degree=8)
    g = hybrid.groups("llm", 0)
    assert (g.shards, g.replicas) == (8, 2)
    assert g.dp_link.bandwidth == gpu.intra_node_bandwidth  # a shard group: ranks 0-7, one node
    assert g.replicate_link.bandwidth == gpu.inter_node_bandwidth  # a shard's copies: ranks 0 and 8
    assert (plain.groups("llm", 0).shards, plain.groups("llm", 0).replicas) == (16, 1)
    nbytes = hybrid._trainable_params("llm", 0) * MASTER_BYTES
    expected = (comm.reduce_scatter_time(nbytes, 8, g.dp_link)
                + comm.all_reduce_time(nbytes / 8, 2, g.replicate_link))
    assert hybrid.grad_sync_time("llm", 0) == pytest.approx(expected)
    # the sharded reduction stays inside the node: cheaper than one across both nodes
    assert hybrid.grad_sync_time("llm", 0) < plain.grad_sync_time("llm", 0)
    # ZeRO's sharded state grows as the shard group shrinks
    assert hybrid.static_breakdown("llm", 0).params == pytest.approx(2 * plain.static_breakdown("llm", 0).params)


def test_loom_plan_prints_the_sharding(capsys) -> None:
    overrides = ["plan.modules.llm.data_parallel=4", "plan.modules.llm.zero_stage=3",
                 "plan.modules.llm.shard_degree=2", "data.global_batch_size=8"]
    assert main(["plan", "--config", "configs/demo.toml", *overrides]) == 0
    out = capsys.readouterr().out
    assert "shard_degree = 2" in out
    assert "zero llm: ZeRO-3 sharded over 2 replicas, 2 shard groups replicated (hybrid)" in out
