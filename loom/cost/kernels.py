"""A stage's work as the kernels a GPU runs: each layer's pass as the sequence of compute and
communication kernels Megatron-LM's tensor parallelism issues (optimus.md §1.2: "each forward
or backward pass of a transformer layer requires two all-gather and two reduce-scatter kernels",
and the compute stream idles during them). Optimus's fine schedule fills those TP bubbles with
encoder kernels at this granularity (§2.4, §3.5 ScheduleKernels; `loom.planner.optimus.fine`).

The analytic model prices a layer as a whole (`AnalyticCostModel.layer_costs`); here that price
is cut into kernels so that a stage's kernels add up to its `stage_time` exactly:

- the layer's compute time is split among its compute kernels in proportion to their FLOPs
  (`loom.cost.flops`): a block's QKV projection, attention core, output projection, MLP in
  (gate and up, or fc1) and MLP out; any other layer is one compute kernel;
- its communication time is split evenly among its collectives, at Megatron's positions:
  under sequence parallelism (loom's LLM, `loom.runtime.tensor_parallel`) an all-gather before
  and a reduce-scatter after each of the attention and MLP halves; without it (an encoder
  under TP) an all-reduce after each half; another layer's communication comes after its
  compute. A backward runs the forward's kernels in mirror order;
- a recomputed forward (``LayerCost.recompute``) runs first in the backward, as the forward's
  kernels scaled to its time.

Decided (the paper gives no kernel list): the split is by FLOPs, not by per-kernel efficiency,
and a layer's CP or ZeRO-3 communication rides with its TP collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.analytic import AnalyticCostModel, LayerCost
from loom.cost.arch import LayerArch
from loom.cost.flops import attention_flops
from loom.cost.model import Workload
from loom.plan.plan import LLM

KINDS = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class Kernel:
    """``seconds`` of one kernel of ``layer`` (its index in the stage); ``comm``: a collective
    (it holds the link, the compute stream idles), else compute."""

    name: str
    seconds: float
    comm: bool = False
    layer: int = 0


_COMM = None  # a slot of the pattern that takes one collective's share of the communication


def _pattern(layer: LayerArch, work: Workload, sequence_parallel: bool, tensor_parallel: bool,
             gemm: float, core: float) -> list[tuple[str, float] | None]:
    """The forward kernel order with FLOPs per compute kernel (``gemm`` FLOPs per GEMM weight
    and token, ``core`` the attention core's FLOPs), ``_COMM`` for a collective."""
    if layer.kind != "block":
        return [(layer.kind, 1.0), _COMM] if tensor_parallel else [(layer.kind, 1.0)]
    t, h = float(work.tokens), layer.hidden
    attention = [("qkv", gemm * t * h * (layer.q_dim + 2 * layer.kv_dim)), ("core", core),
                 ("proj", gemm * t * layer.q_dim * h)]
    mlp = [("mlp_in", gemm * t * h * layer.ffn * (2 if layer.gated_mlp else 1)), ("mlp_out", gemm * t * layer.ffn * h)]
    if not tensor_parallel:
        return attention + mlp
    if sequence_parallel:
        return [_COMM, *attention, _COMM, _COMM, *mlp, _COMM]
    return [*attention, _COMM, *mlp, _COMM]


def _cut(pattern: list[tuple[str, float] | None], compute: float, comm: float, index: int) -> list[Kernel]:
    """``pattern`` with ``compute`` seconds split by FLOPs and ``comm`` evenly over its slots."""
    flops = sum(p[1] for p in pattern if p is not _COMM)
    slots = sum(1 for p in pattern if p is _COMM)
    out = []
    for p in pattern:
        if p is _COMM:
            if comm > 0:
                out.append(Kernel("collective", comm / slots, True, index))
        elif compute > 0:
            share = p[1] / flops if flops > 0 else 1.0 / (len(pattern) - slots)
            if share > 0:
                out.append(Kernel(p[0], compute * share, False, index))
    if comm > 0 and not slots:  # communication the pattern has no collective for (CP, ZeRO-3 at TP 1)
        out.append(Kernel("collective", comm, True, index))
    return out


def layer_kernels(layer: LayerArch, cost: LayerCost, kind: str, work: Workload, sequence_parallel: bool,
                  tensor_parallel: bool, index: int = 0) -> list[Kernel]:
    """The kernels of one layer's ``kind`` pass (`KINDS`; module docstring), in the order they
    run; their seconds add up to what `AnalyticCostModel.stage_time` counts for the layer."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose one of {KINDS}")
    core_f = attention_flops(layer, work).forward
    forward = _pattern(layer, work, sequence_parallel, tensor_parallel, 2.0, core_f)
    if kind == "forward":
        return _cut(forward, cost.forward - cost.forward_comm, cost.forward_comm, index)
    has_input = cost.backward_input > 0
    parts = {"backward": (1.0 if has_input else 0.0, 1.0), "backward_input": (1.0, 0.0),
             "backward_weight": (0.0, 1.0)}[kind]
    total = {"backward": cost.backward,
             "backward_input": cost.backward_input + (cost.recompute if has_input else 0.0),
             "backward_weight": cost.backward_weight + (0.0 if has_input else cost.recompute)}[kind]
    carries_recompute = kind == "backward" or (kind == "backward_input") == has_input
    comm = cost.backward_comm if carries_recompute else 0.0
    out: list[Kernel] = []
    if carries_recompute and cost.recompute > 0 and cost.forward > 0:
        rc_comm = cost.recompute * cost.forward_comm / cost.forward
        out += _cut(forward, cost.recompute - rc_comm, rc_comm, index)
        total, comm = total - cost.recompute, max(0.0, comm - rc_comm)
    # a GEMM's backward: input gradient and weight gradient, each the forward's FLOPs; the
    # attention core's backward is twice its forward and only in the input part
    gemm = 2.0 * (parts[0] * has_input + parts[1] * (cost.backward_weight > 0))
    backward = _pattern(layer, work, sequence_parallel, tensor_parallel, gemm, 2.0 * core_f * parts[0] * has_input)
    return out + _cut(backward[::-1], total - comm, comm, index)


def stage_kernels(cost: AnalyticCostModel, module: str, stage: int, kind: str, work: Workload) -> list[Kernel]:
    """The kernels of one microbatch's ``kind`` pass through ``module``'s ``stage`` on one rank
    (its layers in the order they run: a backward last layer first), as ``cost`` prices it:
    their seconds add up to ``cost.stage_time(module, stage, kind, work)``."""
    costs = cost.layer_costs(module, stage, work)
    layers = [layer for layer, _ in cost.stage_layers(module, stage)]
    tp = cost.plan.spec(module).tensor_parallel > 1
    sp = tp and module == LLM  # what loom.runtime.tensor_parallel runs (as the analytic model prices it)
    work = work.share(cost.plan.item_shares(module))
    order = range(len(layers)) if kind == "forward" else range(len(layers) - 1, -1, -1)
    out: list[Kernel] = []
    for i in order:
        # an encoder's front-end, final norm and projector run replicated under TP
        layer_tp = tp and (sp or layers[i].kind in ("block", "embedding", "head"))
        out += layer_kernels(layers[i], costs[i], kind, work, sp, layer_tp, i)
    return out
