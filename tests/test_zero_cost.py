"""ZeRO in the cost model (issue 9 points 5 and 9, `loom.cost.analytic`): the parameter
all-gathers FSDP2 really runs under ZeRO-2 and -3 (counted on a fake 2-rank group, one process,
through `loom.runtime.zero.shard_stage` and a schedule's own action order), the gradient syncs of
ZeRO-1/2/3; hybrid sharding: a shard group of ``shard_degree`` replicas inside a node, groups
replicated across nodes; the gradient sync is a reduce-scatter inside plus an all-reduce of each
shard across (FSDP2's HSDP, `loom.runtime.zero`); `loom plan` prints the sharding."""

from __future__ import annotations

import pytest
import torch

from loom.cli import main
from loom.cost import comm
from loom.cost.analytic import AnalyticCostModel, MASTER_BYTES
from loom.cost.hardware import Cluster, get_gpu
from loom.cost.memory import DTYPE_BYTES
from loom.cost.model_configs import load_model_arch
from loom.cost.model import Workload
from loom.plan.plan import ModuleSpec, Plan
from loom.schedule.generators import build_schedule
from loom.schedule.ir import ActionKind


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


@pytest.fixture
def fake_dp_group():
    """A 2-rank process group in this one process (PyTorch's fake backend: collectives keep
    their shapes and move no data): enough for FSDP2 to run its all-gathers, which are counted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _fsdp_gathers(mesh, zero: int, actions, frozen: bool = False, dtype: str = "fp32") -> tuple[float, float]:
    """All-gathers per layer per step (the second, steady one) that FSDP2 runs for ``actions``
    (a unit's FORWARD / BACKWARD list) on a stage sharded as `loom.runtime.zero` shards it under
    ``run.dtype`` ``dtype``, its last backward reducing (`ZeroStage.before_backward`, as the
    executor calls it), and the bytes each gathers per parameter."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from loom.model.layers import Layer
    from loom.runtime.precision import Precision
    from loom.runtime.stage import Stage
    from loom.runtime.zero import shard_stage

    layers = [torch.nn.Linear(16, 16).requires_grad_(not frozen) for _ in range(3)]
    params = sum(p.numel() for p in layers[0].parameters())
    stage = Stage("llm", 0, 0, [Layer(f"l{i}", m, lambda x, ctx: x) for i, m in enumerate(layers)], True, False)
    zero_stage = shard_stage(stage, zero, mesh, Precision(dtype, "cpu"))
    last = max((i for i, a in enumerate(actions) if a.kind is ActionKind.BACKWARD), default=-1)
    counted = {"calls": 0, "bytes": 0}
    original = DefaultAllGather.__call__

    def counting(self, output_tensor, *args, **kwargs):
        counted["calls"] += 1
        counted["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return original(self, output_tensor, *args, **kwargs)

    DefaultAllGather.__call__ = counting
    try:
        for _ in range(2):
            counted.update(calls=0, bytes=0)
            outputs = {}
            for i, a in enumerate(actions):
                if a.kind is ActionKind.FORWARD:
                    x = torch.randn(4, 16, requires_grad=not frozen)
                    with Precision(dtype, "cpu").autocast():
                        for m in layers:
                            x = m(x)
                    outputs[a.microbatch] = x
                else:
                    zero_stage.before_backward(i == last)
                    outputs.pop(a.microbatch).float().sum().backward()
    finally:
        DefaultAllGather.__call__ = original
    per_parameter = counted["bytes"] / counted["calls"] / params if counted["calls"] else 0.0
    return counted["calls"] / len(layers), per_parameter


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_parameter_gathers_are_priced_as_fsdp2_runs_them(fake_dp_group, zero, schedule, dtype) -> None:
    # stage 0 of a 2-stage pipeline, 4 microbatches per replica: 1F1B's warm-up, steady
    # alternation and cool-down, or GPipe's forwards then backwards
    plan = Plan([ModuleSpec("llm", num_stages=2, data_parallel=2, zero_stage=zero)], num_microbatches=8,
                schedule=schedule)
    dtype_bytes = DTYPE_BYTES[dtype]
    cost = AnalyticCostModel(load_model_arch(llm="llama3-8b"), plan, Cluster("H100", 4), dtype_bytes=dtype_bytes)
    actions = [a for a in build_schedule(cost.plan).actions[cost.plan.unit_of("llm", 0, 0)]
               if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
    forwards = sum(a.kind is ActionKind.FORWARD for a in actions)
    assert forwards == 4 and len(actions) == 8
    gathers, per_parameter = _fsdp_gathers(fake_dp_group, zero, actions, dtype=dtype)
    # ZeRO-3 gathers before every forward and every backward; ZeRO-2 once per backward (each
    # backward reshards, whatever pass comes next gathers again), not once per step
    assert gathers == (2 * forwards if zero == 3 else forwards)
    # in the compute dtype: FSDP2's MixedPrecisionPolicy gathers bf16 copies under bf16
    assert per_parameter == dtype_bytes
    # the model: a block's gathers over the step, from its per-microbatch forward and backward
    block = cost.layer_costs("llm", 0, Workload.of_lengths([128]))[1]
    assert block.kind == "block"
    layer = cost.stage_layers("llm", 0)[1][0]
    gather = comm.all_gather_time(layer.stored_params * per_parameter, 2, cost.groups("llm", 0).dp_link)
    priced = forwards * block.forward_comm + forwards * block.backward_comm  # TP 1, CP 1: gathers only
    assert priced == pytest.approx(gathers * gather)


def test_zero2_layer_without_backward_gathers_once_and_keeps_its_parameters(fake_dp_group) -> None:
    # a frozen stage runs forwards only: FSDP2 never reshards it (no backward), so it gathers
    # in the first step only; ZeRO-3 gathers before every forward
    from types import SimpleNamespace

    forwards = [SimpleNamespace(kind=ActionKind.FORWARD, microbatch=j) for j in range(4)]
    assert _fsdp_gathers(fake_dp_group, 2, forwards, frozen=True)[0] == 0
    assert _fsdp_gathers(fake_dp_group, 3, forwards, frozen=True)[0] == 4
    arch = load_model_arch(llm="llama3-8b").with_freeze(["llm"])
    w = Workload.of_lengths([128])
    for zero, comm_per_forward in ((2, False), (3, True)):
        plan = Plan([ModuleSpec("llm", num_stages=2, data_parallel=2, zero_stage=zero)], num_microbatches=8)
        block = AnalyticCostModel(arch, plan, Cluster("H100", 4)).layer_costs("llm", 0, w)[1]
        assert (block.forward_comm > 0) == comm_per_forward and block.backward_comm == 0


def test_zero_gradient_syncs() -> None:
    # ZeRO-1: the executor's all-reduce, then ZeroRedundancyOptimizer's broadcast of each
    # rank's updated parameters (an all-gather's volume); ZeRO-2 and -3: FSDP2's reduce-scatter
    costs = {z: _cost(zero_stage=z) for z in (0, 1, 2, 3)}
    g = costs[0].groups("llm", 0)
    nbytes = costs[0]._trainable_params("llm", 0) * MASTER_BYTES
    assert costs[0].grad_sync_time("llm", 0) == pytest.approx(comm.all_reduce_time(nbytes, 16, g.dp_link))
    assert costs[1].grad_sync_time("llm", 0) == pytest.approx(
        comm.all_reduce_time(nbytes, 16, g.dp_link) + comm.all_gather_time(nbytes, 16, g.dp_link))
    for z in (2, 3):
        assert costs[z].grad_sync_time("llm", 0) == pytest.approx(comm.reduce_scatter_time(nbytes, 16, g.dp_link))


def test_zero_with_tp_on_one_module_divides_by_both() -> None:
    """ZeRO over a module's TP shards (`loom.runtime.zero`: FSDP2 on the (dp, tp) mesh, ZeRO-1's
    owners over TP shards): a rank stores its TP shard's share of the ZeRO shard, and the
    gradient sync reduce-scatters the TP shard's gradients over the dp group."""
    arch = load_model_arch(llm="llama3-8b")

    def cost(tp: int, zero: int) -> AnalyticCostModel:
        plan = Plan([ModuleSpec("llm", data_parallel=4, tensor_parallel=tp, zero_stage=zero)], num_microbatches=16)
        return AnalyticCostModel(arch, plan, Cluster("H100", 4 * tp, 8))

    for zero in (1, 3):
        with_tp, without = cost(2, zero).static_breakdown("llm", 0), cost(1, zero).static_breakdown("llm", 0)
        assert with_tp.optimizer == pytest.approx(without.optimizer / 2)  # Adam's state: / tp / dp
        assert with_tp.optimizer == pytest.approx(cost(2, 0).static_breakdown("llm", 0).optimizer / 4)
        if zero == 3:
            assert with_tp.params == pytest.approx(without.params / 2)
            assert with_tp.params == pytest.approx(cost(2, 0).static_breakdown("llm", 0).params / 4)
    model = cost(2, 3)
    g = model.groups("llm", 0)
    assert g.shards == 4
    shard_bytes = sum(l.stored_params for l, _ in model.stage_layers("llm", 0)) / 2 * MASTER_BYTES
    assert model.grad_sync_time("llm", 0) == pytest.approx(comm.reduce_scatter_time(shard_bytes, 4, g.dp_link))
