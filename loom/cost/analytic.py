"""`AnalyticCostModel`: a plan's costs from the architecture and the hardware specs (issue 3,
item 1; cornstarch.md §3.2.2, entrain.md §3.1, disttrain.md §3.1).

Per layer and per part of the work (forward, backward-input, backward-weight), from the FLOPs
and bytes of `loom.cost.flops`, on one rank of a stage with TP degree ``t`` and CP degree ``c``:

- GEMMs: by their shapes (`loom.cost.gemm`): each of a layer's GEMMs on one rank (TP cuts its
  parallel dimension, the rank's ``T / c`` tokens its rows) at the GPU's ceiling times its tile
  and wave quantization, or bound by its operands' HBM traffic, which is what bounds small
  microbatches ("memory-bandwidth saturation", entrain.md §3.1). With a constant
  ``efficiency`` instead: ``max(FLOPs / (t c) / (peak x efficiency), weight bytes / t / HBM
  bandwidth)``;
- attention: FLOPs ``/ (t c) / (peak x attention efficiency)`` (heads split by TP, the
  load-balanced causal shards by CP), `GPUSpec.attention_efficiency` or the constant;
- embedding lookups and norms: bytes ``/ c / HBM bandwidth`` (replicated across TP);
- TP communication, as `loom.runtime.tensor_parallel` runs it. The LLM with sequence
  parallelism (Korthikanti et al. 2023 §4.2.2): a block all-gathers its ``T/c x hidden``
  sequence before attention and before the MLP and reduce-scatters after each (backward: the
  same two pairs, reversed), which costs what Megatron's two all-reduces per pass cost in the
  ring model; the vocabulary-parallel embedding all-reduces its output in forward and its
  gradient is all-gathered back from the sequence shards in backward-input (the merge runs on
  the full sequence); the head all-gathers its input in forward and reduce-scatters the input
  gradient; norms and elementwise work run on ``T/t`` tokens (their HBM traffic ``/ t``); the
  vocabulary-parallel loss's per-token scalars are left out. Encoders (no sequence
  parallelism): a block all-reduces its activation twice in forward and twice in
  backward-input; front-ends, final norms and projectors run replicated (whole compute, no
  communication). With ``tp_comm_overlap`` (Megatron-LM's ``--tp-comm-overlap``, the TP
  collectives chunked and pipelined with the GEMMs around them) a layer's TP communication
  of a pass hides under that pass's own compute: only ``max(0, comm - compute)`` is exposed
  (the backward's under the backward-input part, where its collectives sit). loom's runtime
  does not overlap them; the option prices a stack that does (a scenario's ``[cost]``);
- CP communication: a block all-gathers K and V (``T x 2 kv`` elements per TP shard) in
  forward, and in backward-input gathers them again and reduce-scatters their gradients;
- ZeRO (`loom.runtime.zero`, FSDP2 ``fully_shard`` per layer), the parameter all-gathers over
  the ``data x context`` replicas (a shard group under hybrid sharding) that FSDP2 really runs
  (counted on a 2-rank group, ``tests/test_zero_cost.py``): ZeRO-3 (``reshard_after_forward=
  True``) gathers a layer before each forward and again before each backward, ``2 m`` per step
  for ``m`` microbatches on the stage. ZeRO-2 (``reshard_after_forward=False``) keeps the
  gathered parameters after a forward, but every backward reshards them (FSDP2's
  ``reshard_after_backward``), so whatever pass follows a backward gathers again: the first
  forward of the step and the pass after each backward but the last, ``m`` per step whatever
  the schedule (1F1B's steady forwards, its cool-down's backwards, GPipe's backwards). The cost
  model charges one gather to each forward: the step's total exactly, its place within the step
  approximately. A ZeRO-2 layer that runs no backward is never resharded: it gathers once, in
  the first step, and none after. Gathers move the compute dtype: fp32, or bf16 under
  ``run.dtype = "bf16"`` (FSDP2's ``MixedPrecisionPolicy``, `loom.runtime.zero`);
- frozen-aware backward (`loom.cost.frozen`, cornstarch.md §3.2.2): backward-weight only for
  trainable layers, backward-input only where something trainable lies at or before the
  layer, across modules;
- recomputation (``ModuleSpec.recompute``), only where the block runs some backward
  (cornstarch.md §3.2.1): ``"full"`` adds a block's whole forward (with its TP/CP
  communication) to its backward; ``"selective"`` only its attention core's forward FLOPs
  (Korthikanti et al. 2023 §4.2), no communication.

All collectives use the alpha-beta ring model of `loom.cost.comm`, over NVLink when the group
shares a node and over the network otherwise. Memory follows `loom.cost.memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loom.cost import comm
from loom.cost.arch import LayerArch, ModelArch
from loom.cost.flops import attention_flops, gemm_flops, memory_traffic, model_flops
from loom.cost.frozen import BackwardNeeds, backward_needs
from loom.cost.gemm import layer_gemm_seconds
from loom.cost.hardware import Cluster
from loom.cost.memory import (
    MASTER_BYTES,
    OPTIMIZER_STATE_BYTES,
    StaticMemory,
    activation_bytes_per_token,
    backward_working_bytes,
    static_memory,
    stage_output_bytes_per_token,
    weight_copy_bytes,
    zero3_gather_bytes,
)
from loom.cost.model import CostModel, MicrobatchWork, Phase, StageKind, Workload
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError

# HBM bytes an optimizer step moves per trainable parameter (fp32 weights and gradients, as
# autocast keeps them: `loom.cost.memory`, "Precision"). Adam reads the weight, its gradient, m
# and v (16) and writes weight, m and v (12); SGD reads weight and gradient (8), writes the weight.
OPTIMIZER_STEP_BYTES = {"adam": 28, "sgd": 12}

_CACHE_LIMIT = 200_000


@dataclass(frozen=True)
class LayerCost:
    """Seconds one rank of a stage spends on one layer for one microbatch. ``recompute`` is the
    recomputed forward counted in backward; ``*_comm`` are the parts of the times that are
    communication (TP, CP, ZeRO-3), for breakdowns and tests."""

    name: str
    kind: str
    forward: float
    backward_input: float
    backward_weight: float
    recompute: float
    forward_comm: float = 0.0
    backward_comm: float = 0.0

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight + self.recompute


@dataclass(frozen=True)
class _Groups:
    """The communication groups of a stage (its replica 0: all replicas are laid out alike)."""

    tp: int
    cp: int
    shards: int  # (a shard group of the) data x context parallel: gradient reduction and ZeRO sharding
    tp_link: comm.Link
    cp_link: comm.Link
    dp_link: comm.Link  # inside a shard group (all the replicas without hybrid sharding)
    # hybrid sharding (ModuleSpec.shard_degree): shard groups that replicate each other, and the
    # link between a shard's copies (gradients all-reduced across after the reduce-scatter inside)
    replicas: int = 1
    replicate_link: comm.Link | None = None


_SHAPES: dict[int, tuple[ModelArch, dict[str, list[BackwardNeeds]], dict[str, list[int]]]] = {}


def _layer_shapes(arch: ModelArch) -> tuple[dict[str, list[BackwardNeeds]], dict[str, list[int]]]:
    """Per module, each layer's backward needs and an id shared by layers of equal shape and
    needs; kept per architecture, as a planner builds thousands of cost models of one model."""
    kept = _SHAPES.get(id(arch))
    if kept is None or kept[0] is not arch:
        needs = backward_needs(arch)
        shape_ids: dict[str, list[int]] = {}
        for name, module in arch.modules.items():
            ids: dict[tuple[LayerArch, BackwardNeeds], int] = {}
            shape_ids[name] = [ids.setdefault((dataclasses.replace(l, name=""), n), len(ids))
                               for l, n in zip(module.layers, needs[name])]
        if len(_SHAPES) > 32:
            _SHAPES.clear()
        kept = _SHAPES[id(arch)] = (arch, needs, shape_ids)  # the arch itself: its id stays its own
    return kept[1], kept[2]


class AnalyticCostModel(CostModel):
    """Costs from `ModelArch` dimensions and `GPUSpec` numbers (module docstring).

    ``dtype_bytes`` is the width of activations, messages and GEMM operands: ``run.dtype``'s
    (`loom.cost.memory.DTYPE_BYTES`: bf16 2, the default, or fp32 4), and of ZeRO-2/3's
    parameter gathers (FSDP2's ``MixedPrecisionPolicy`` under bf16); weights, gradients, their
    reduction and the optimizer state are fp32 whatever it is (`loom.cost.memory.MASTER_BYTES`).
    The peak is the GPU's dense BF16 figure whatever ``dtype_bytes`` is. ``efficiency``: ``None``
    (the default) prices GEMMs by shape and attention at the GPU's `attention_efficiency`
    (module docstring); a number is the fraction of that peak every GEMM and attention kernel
    achieves. ``optimizer`` is ``"adam"`` or ``"sgd"``. ``tp_comm_overlap``: TP collectives
    hidden under the layer's compute (module docstring).
    """

    def __init__(
        self,
        arch: ModelArch,
        plan: Plan,
        cluster: Cluster,
        dtype_bytes: int = 2,
        efficiency: float | None = None,
        optimizer: str = "adam",
        tp_comm_overlap: bool = False,
    ) -> None:
        if efficiency is not None and not 0 < efficiency <= 1:
            raise ValueError(f"efficiency = {efficiency}: the achieved fraction of peak must be in (0, 1]")
        if dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes = {dtype_bytes}: choose 2 (run.dtype bf16) or 4 (fp32)")
        if optimizer not in OPTIMIZER_STEP_BYTES:
            raise ValueError(f"optimizer = {optimizer!r}: choose one of {list(OPTIMIZER_STEP_BYTES)}")
        assert set(OPTIMIZER_STEP_BYTES) == set(OPTIMIZER_STATE_BYTES)
        plan.resolve(arch.layer_counts(), generators=arch.generator_names)
        if plan.world_size > cluster.num_gpus:
            raise PlanError(
                f"plan needs {plan.world_size} ranks but the cluster has {cluster.num_gpus} GPUs "
                f"(cluster.num_gpus): lower the plan's degrees or use a larger cluster"
            )
        for spec in plan.modules:
            for layer in arch.module(spec.name).layers:
                if spec.name in plan.generator_names:
                    break  # a generator is whole on each TP rank (`Plan.item_shares`)
                if layer.kind == "block" and layer.heads % spec.tensor_parallel:
                    raise PlanError(
                        f"plan.modules[{spec.name!r}].tensor_parallel = {spec.tensor_parallel} does not divide "
                        f"the {layer.heads} attention heads of {layer.name!r}"
                    )
        self.arch = arch
        self.plan = plan
        self._generators = set(plan.generator_names)
        self.cluster = cluster
        self.spec = cluster.spec
        self.dtype_bytes = dtype_bytes
        self.efficiency = efficiency
        self.tp_comm_overlap = tp_comm_overlap
        gpu = cluster.spec
        self._gemm_rate = gpu.peak_bf16_flops * (efficiency or gpu.gemm_ceiling)
        self._attention_rate = gpu.peak_bf16_flops * (efficiency or gpu.attention_efficiency)
        self.optimizer = optimizer
        self.needs, self._shape_ids = _layer_shapes(arch)
        self._groups: dict[tuple[str, int], _Groups] = {}
        self._costs: dict[tuple[str, int, Workload], list[LayerCost]] = {}
        self._stage_times: dict[tuple[int, str, Workload], float] = {}
        self._stage_sigs: dict[tuple[str, int], int] = {}
        self._signature_ids: dict[tuple, int] = {}
        self._shape_costs: dict[tuple, LayerCost] = {}
        self._stage_outputs: dict[tuple[str, int], tuple[LayerArch, float]] = {}
        self._links: dict[tuple[int, int], comm.Link] = {}
        self._flop_coefficients: dict[str, tuple[float, float]] = {}

    # ---- structure -------------------------------------------------------------------------
    def stage_layers(self, module: str, stage: int) -> list[tuple[LayerArch, BackwardNeeds]]:
        spec = self.plan.spec(module)
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"module {module!r} has stages 0..{spec.num_stages - 1}; got stage {stage}")
        lo, hi = self.plan.layers_of(module, stage)
        layers = self.arch.module(module).layers
        return list(zip(layers[lo:hi], self.needs[module][lo:hi]))

    def groups(self, module: str, stage: int) -> _Groups:
        key = (module, stage)
        if key not in self._groups:
            self.stage_layers(module, stage)  # checks the stage index
            spec = self.plan.spec(module)
            tp, cp, dp = spec.tensor_parallel, spec.context_parallel, spec.data_parallel
            shard = self._shards(module) // cp  # consecutive replicas one shard group spans
            rank = self.plan.rank_of
            # a group's ranks grow with its index: it shares a node iff its first and last do
            span = lambda first, last: comm.link_for(self.cluster, (first, last))
            self._groups[key] = _Groups(
                tp=tp,
                cp=cp,
                shards=shard * cp,
                tp_link=span(rank(module, stage, 0), rank(module, stage, 0, tp=tp - 1)),
                cp_link=span(rank(module, stage, 0), rank(module, stage, 0, cp=cp - 1)),
                dp_link=span(rank(module, stage, 0), rank(module, stage, shard - 1, cp=cp - 1)),
                replicas=dp // shard,
                replicate_link=span(rank(module, stage, 0), rank(module, stage, dp - shard)),
            )
        return self._groups[key]

    # ---- per-layer costs -------------------------------------------------------------------
    def layer_costs(self, module: str, stage: int, work: Workload) -> list[LayerCost]:
        """Per layer of the stage, seconds per rank for a microbatch with this workload (an
        encoder in lanes, a generator at TP > 1: a rank's share of its items, `Plan.item_shares`)."""
        work = work.share(self.plan.item_shares(module))
        key = (module, stage, work)
        cached = self._costs.get(key)
        if cached is None:
            layers = self.stage_layers(module, stage)  # checks the stage index
            spec = self.plan.spec(module)
            g = self.groups(module, stage)
            # blocks repeat: cost each distinct (shape, needs) once, then name the copies
            lo, _ = self.plan.layers_of(module, stage)
            kinds = self._shape_ids[module]
            cached = []
            for i, (layer, need) in enumerate(layers):
                # identical blocks under identical groups cost the same in every stage
                shape_key = (module, kinds[lo + i], need.weight, need.input, work, id(g))  # g: cached per stage
                c = self._shape_costs.get(shape_key)
                if c is None:
                    c = self._shape_costs[shape_key] = self._layer_cost(layer, need, work, spec, g)
                elif c.name != layer.name:
                    c = LayerCost(layer.name, c.kind, c.forward, c.backward_input, c.backward_weight, c.recompute,
                                  c.forward_comm, c.backward_comm)
                cached.append(c)
            if len(self._costs) >= _CACHE_LIMIT:
                self._costs.clear()
                self._shape_costs.clear()
            self._costs[key] = cached
        return cached

    def module_layer_costs(self, module: str, work: Workload) -> list[LayerCost]:
        """Per layer of the whole module (each under its own stage's groups), e.g. for a
        partitioner balancing ``forward + backward`` (cornstarch.md §3.2.2)."""
        out: list[LayerCost] = []
        for s in range(self.plan.spec(module).num_stages):
            out += self.layer_costs(module, s, work)
        return out

    def _compute(self, layer: LayerArch, work: Workload, phase: str, tp: int, cp: int, sp: int = 1) -> float:
        """``sp``: how many ways norms and elementwise work are split (the TP degree under
        sequence parallelism, else 1)."""
        hbm = self.spec.hbm_bandwidth
        gemm = getattr(gemm_flops(layer, work), phase)
        t = 0.0
        if gemm and self.efficiency is None:  # by shape: the rank's rows on the layer's own grid
            t += layer_gemm_seconds(layer, work.tokens / cp / layer.scale**2, tp, phase, gemm / (tp * cp),
                                    self.spec, self.dtype_bytes)
        elif gemm:
            t += max(gemm / (tp * cp) / self._gemm_rate, layer.gemm_weights / tp * self.dtype_bytes / hbm)
        t += getattr(attention_flops(layer, work), phase) / (tp * cp) / self._attention_rate
        t += getattr(memory_traffic(layer, work, self.dtype_bytes), phase) / (cp * sp) / hbm
        return t

    def _layer_cost(self, layer: LayerArch, need: BackwardNeeds, work: Workload, spec: ModuleSpec, g: _Groups) -> LayerCost:
        if work.tokens <= 0:
            return LayerCost(layer.name, layer.kind, 0.0, 0.0, 0.0, 0.0)
        b, tp, cp = self.dtype_bytes, g.tp, g.cp
        tokens = work.tokens / cp
        forward_comm = backward_input_comm = 0.0
        sequence_parallel = spec.name == LLM  # what loom.runtime.tensor_parallel runs
        sp = tp if sequence_parallel else 1
        if (layer.kind not in ("block", "embedding", "head") and not sequence_parallel) or spec.name in self._generators:
            # an encoder's front-end, final norm and projector run replicated; a generator is whole
            # on each TP rank, which runs a share of the images (`layer_costs` shares the work)
            tp = 1
        if tp > 1:
            activation = tokens * layer.hidden * b
            all_reduce = lambda n: comm.all_reduce_time(n, tp, g.tp_link)
            gather_and_scatter = lambda n: (comm.all_gather_time(n, tp, g.tp_link)
                                            + comm.reduce_scatter_time(n, tp, g.tp_link))
            if layer.kind == "block" and sequence_parallel:
                forward_comm += 2 * gather_and_scatter(activation)
                backward_input_comm += 2 * gather_and_scatter(activation)
            elif layer.kind == "block":
                forward_comm += 2 * all_reduce(activation)
                backward_input_comm += 2 * all_reduce(activation)
            elif layer.kind == "embedding":
                forward_comm += all_reduce(activation)
                backward_input_comm += comm.all_gather_time(activation, tp, g.tp_link)
            elif layer.kind == "head":
                forward_comm += comm.all_gather_time(activation, tp, g.tp_link)
                backward_input_comm += comm.reduce_scatter_time(activation, tp, g.tp_link)
        tp_comm = (forward_comm, backward_input_comm)  # what an overlap can hide (module docstring)
        kv_gather = 0.0
        if cp > 1 and layer.kind == "block":
            kv = work.tokens * 2 * max(layer.kv_dim / tp, layer.kv_dim / layer.kv_heads) * b
            # loom.runtime.context_parallel: the gathered keys and values stay for the backward,
            # whose gather gradient is one reduce-scatter (recompute gathers again: below)
            kv_gather = comm.all_gather_time(kv, cp, g.cp_link)
            forward_comm += kv_gather
            backward_input_comm += comm.reduce_scatter_time(kv, cp, g.cp_link)
        gather = 0.0
        if spec.zero_stage >= 3 or (spec.zero_stage == 2 and need.any):
            # FSDP2 gathers in the compute dtype (bf16 under its MixedPrecisionPolicy); ZeRO-2's
            # m gathers per step, one per forward (module docstring)
            gather = comm.all_gather_time(layer.stored_params / tp * b, g.shards, g.dp_link)

        forward_compute = self._compute(layer, work, "forward", tp, cp, sp)
        backward_input_compute = self._compute(layer, work, "backward_input", tp, cp, sp) if need.input else 0.0
        if self.tp_comm_overlap:
            forward_comm -= min(tp_comm[0], forward_compute)
            backward_input_comm -= min(tp_comm[1], backward_input_compute)
        forward_core = forward_compute + forward_comm
        backward_input = backward_weight = 0.0
        if need.input:
            backward_input = backward_input_compute + backward_input_comm
        if need.weight:
            backward_weight = self._compute(layer, work, "backward_weight", tp, cp, sp)
        recompute = 0.0
        if layer.kind == "block" and need.any:
            if spec.recompute == "full":
                recompute = forward_core
            elif spec.recompute == "selective":  # the attention core only: no GEMMs; under CP its gather
                recompute = attention_flops(layer, work).forward / (tp * cp) / self._attention_rate + kv_gather
        backward_gather = gather if need.any and spec.zero_stage >= 3 else 0.0
        # the parameters are gathered once for the layer's whole backward, at its first part
        if need.input:
            backward_input += backward_gather
        else:
            backward_weight += backward_gather
        backward_comm = ((backward_input_comm if need.input else 0.0) + backward_gather
                         + (forward_comm if recompute and spec.recompute == "full" else 0.0)
                         + (kv_gather if recompute and spec.recompute == "selective" else 0.0))
        return LayerCost(
            name=layer.name,
            kind=layer.kind,
            forward=forward_core + gather,
            backward_input=backward_input,
            backward_weight=backward_weight,
            recompute=recompute,
            forward_comm=forward_comm + gather,
            backward_comm=backward_comm,
        )

    # ---- compute ---------------------------------------------------------------------------
    def _stage_signature(self, module: str, stage: int) -> int:
        """Stages with the same layer shapes, backward needs and groups (the middle stages of an
        LLM) cost the same: the simulator's many questions share one answer per signature."""
        sid = self._stage_sigs.get((module, stage))
        if sid is None:
            self.stage_layers(module, stage)  # checks the stage index
            lo, hi = self.plan.layers_of(module, stage)
            sig = (module, tuple(self._shape_ids[module][lo:hi]), tuple(self.needs[module][lo:hi]),
                   self.groups(module, stage))
            sid = self._stage_sigs[(module, stage)] = self._signature_ids.setdefault(sig, len(self._signature_ids))
        return sid

    def stage_time(self, module: str, stage: int, kind: StageKind, work: Workload) -> float:
        key = (self._stage_signature(module, stage), kind, work)
        t = self._stage_times.get(key)
        if t is None:
            costs = self.layer_costs(module, stage, work)
            if kind == "forward":
                t = sum(c.forward for c in costs)
            elif kind == "backward":
                t = sum(c.backward for c in costs)
            elif kind in ("backward_input", "backward_weight"):  # ZB-H1's split backward
                t = self.phase_time(module, stage, kind, work)
            else:
                raise ValueError(f"stage_time kind {kind!r}: choose 'forward', 'backward', 'backward_input' or "
                                 f"'backward_weight'")
            self._stage_times[key] = t
        return t

    def phase_time(self, module: str, stage: int, phase: Phase, work: Workload) -> float:
        """Seconds of one part of the Zero-Bubble split. A recomputed forward is counted with
        the first backward part its layer runs (backward-input if any, else backward-weight),
        so ``backward_input + backward_weight == stage_time(..., "backward", ...)``."""
        costs = self.layer_costs(module, stage, work)
        if phase == "forward":
            return sum(c.forward for c in costs)
        if phase == "backward_input":
            return sum(c.backward_input + (c.recompute if c.backward_input else 0.0) for c in costs)
        if phase == "backward_weight":
            return sum(c.backward_weight + (0.0 if c.backward_input else c.recompute) for c in costs)
        raise ValueError(f"phase {phase!r}: choose 'forward', 'backward_input' or 'backward_weight'")

    # ---- communication ---------------------------------------------------------------------
    def _unit_rank(self, unit: int) -> int:
        return self.plan.rank_of(*self.plan.role_of_unit(unit))

    def transfer_time(self, src_unit: int, dst_unit: int, module: str, stage: int, work: Workload) -> float:
        """The stage's last layer's output, ``tokens_out x width x dtype_bytes`` split over the
        CP ranks (each sends its shard in parallel; TP ranks hold replicas), point to point
        over the link between the two units' first ranks."""
        if src_unit == dst_unit:
            return 0.0
        # the simulator asks once per message: keep the stage's output layer
        out = self._stage_outputs.get((module, stage))
        if out is None:
            last, _ = self.stage_layers(module, stage)[-1]
            out = self._stage_outputs[(module, stage)] = (
                last, last.out_width * self.dtype_bytes / self.plan.spec(module).context_parallel)
        return comm.p2p_time(out[0].tokens_out(work.tokens) * out[1], self._link(src_unit, dst_unit))

    def _link(self, src_unit: int, dst_unit: int) -> comm.Link:
        """The link between two units' first ranks (asked once per message: kept)."""
        link = self._links.get((src_unit, dst_unit))
        if link is None:
            link = self._links[(src_unit, dst_unit)] = comm.link_for(
                self.cluster, [self._unit_rank(src_unit), self._unit_rank(dst_unit)])
        return link

    def condition_transfer_time(self, src_unit: int, dst_unit: int, generator: str, work: Workload) -> float:
        """The LLM's final states at the generator's generation positions, ``cond_tokens`` per
        item of the LLM's width, point to point over the link between the two units (the gradient
        back has the same size)."""
        if src_unit == dst_unit:
            return 0.0
        width = self.arch.module(LLM).layers[-1].hidden  # the head's input: the final states
        nbytes = work.segments * self.arch.module(generator).cond_tokens * width * self.dtype_bytes
        return comm.p2p_time(nbytes, self._link(src_unit, dst_unit))

    def _trainable_params(self, module: str, stage: int) -> float:
        """Trainable parameters of the stage on one rank (its TP shard)."""
        layers = self.stage_layers(module, stage)
        return sum(l.stored_params for l, _ in layers if l.trainable) / self._param_shards(module)

    def _shards(self, module: str) -> int:
        """The ranks a ZeRO shard group spans (`groups`' ``shards``, without its links)."""
        spec = self.plan.spec(module)
        return (spec.shard_degree or spec.data_parallel) * spec.context_parallel

    def _param_shards(self, module: str) -> int:
        """The TP degree a module's parameters are sharded over: 1 for a generator, whole on each
        of its TP ranks (`Plan.item_shares`)."""
        return 1 if module in self._generators else self.plan.spec(module).tensor_parallel

    def grad_sync_time(self, module: str, stage: int) -> float:
        """Ring all-reduce of the stage's trainable gradients (fp32, ``MASTER_BYTES`` each, per TP
        shard) over its data x context-parallel replicas. ZeRO as `loom.runtime.zero` runs it:
        under ZeRO-1 that all-reduce (the executor's) and then the updated parameters each rank
        owns broadcast to the others (``ZeroRedundancyOptimizer``), an all-gather's volume; under
        ZeRO-2 and -3 FSDP2's reduce-scatter only, in the stage's last backward (the parameters
        are gathered on demand, in `stage_time`: module docstring). Under hybrid sharding
        (FSDP2's HSDP) that happens inside each shard group, then each rank's gradient shard is
        all-reduced across the groups' copies of it."""
        g = self.groups(module, stage)
        nbytes = self._trainable_params(module, stage) * MASTER_BYTES
        zero = self.plan.spec(module).zero_stage
        if zero >= 2:
            inside = comm.reduce_scatter_time(nbytes, g.shards, g.dp_link)
        else:
            inside = comm.all_reduce_time(nbytes, g.shards, g.dp_link)
            if zero == 1:
                inside += comm.all_gather_time(nbytes, g.shards, g.dp_link)
        if g.replicas > 1:
            inside += comm.all_reduce_time(nbytes / g.shards, g.replicas, g.replicate_link)
        if module in self._generators and g.tp > 1:  # each TP rank's share of the images: summed over the group first
            inside += comm.all_reduce_time(nbytes, g.tp, g.tp_link)
        return inside + self.tie_sync_time(module, stage)

    def tie_sync_time(self, module: str, stage: int) -> float:
        """Tied embeddings on different stages (`loom.runtime.tied`, Megatron-LM's embedding
        group): the tied copy's fp32 gradient all-reduced between the LLM's first stage (the
        embedding) and its last (the head), 2 ranks over the link between them; 0 elsewhere."""
        head = self.arch.module(LLM).layers[-1] if module == LLM else None
        last = self.plan.spec(LLM).num_stages - 1 if module == LLM else 0
        if head is None or head.kind != "head" or not head.tied or not head.trainable or last == 0 \
                or stage not in (0, last):
            return 0.0
        link = self._link(self.plan.unit_of(LLM, 0, 0), self.plan.unit_of(LLM, last, 0))
        return comm.all_reduce_time(head.vocab * head.hidden * MASTER_BYTES, 2, link)

    def clip_time(self) -> float:
        """Gradient clipping's norm (``optim.max_grad_norm`` > 0, `loom.runtime.executor`): one
        fp32 scalar SUM all-reduce over the plan's world, over the network once it spans nodes."""
        world = self.plan.world_size
        return comm.all_reduce_time(MASTER_BYTES, world, comm.link_for(self.cluster, range(world)))

    def optimizer_time(self, module: str, stage: int) -> float:
        """A memory-bound update: ``OPTIMIZER_STEP_BYTES`` per trainable parameter on the rank
        (its ZeRO shard under ZeRO >= 1), at HBM bandwidth."""
        spec = self.plan.spec(module)
        params = self._trainable_params(module, stage)
        if spec.zero_stage >= 1:
            params /= self._shards(module)
        return params * OPTIMIZER_STEP_BYTES[self.optimizer] / self.spec.hbm_bandwidth

    # ---- memory ----------------------------------------------------------------------------
    def static_breakdown(self, module: str, stage: int) -> StaticMemory:
        spec = self.plan.spec(module)
        layers = [l for l, _ in self.stage_layers(module, stage)]
        # several microbatches per replica: loom's ZeRO-2/3 reduce-scatter only after the last
        accumulates = len(self.plan.microbatches_of(module, 0)) > 1  # replica 0 gets the most (round-robin)
        return static_memory(layers, self._param_shards(module), self._shards(module), spec.zero_stage,
                             self.optimizer, accumulates, self.dtype_bytes)

    def static_memory(self, module: str, stage: int) -> float:
        return self.static_breakdown(module, stage).total

    def activation_memory(self, module: str, stage: int, work: Workload) -> float:
        """What a microbatch keeps per rank (`loom.cost.memory`): its activations, under bf16
        the weight copies its backward reads (blocks under ``full`` recompute keep none), and
        the stage's output until its gradient returns (every stage but the LLM's last)."""
        spec = self.plan.spec(module)
        tokens = work.share(self.plan.item_shares(module)).tokens / spec.context_parallel
        if tokens <= 0:
            return 0.0
        t = self._param_shards(module)
        sp = module == LLM  # sequence parallelism under TP, as loom.runtime.tensor_parallel runs it
        layers = self.stage_layers(module, stage)
        # FSDP2 (ZeRO-2/3) gathers parameters in the compute dtype: autocast casts no copy of them
        copies = spec.zero_stage < 2
        kept = sum(
            activation_bytes_per_token(l, t, spec.recompute, self.dtype_bytes, sp) * tokens
            + (0.0 if (l.kind == "block" and spec.recompute == "full") or not copies
               else weight_copy_bytes(l, t, self.dtype_bytes))
            for l, need in layers
            if need.any
        )
        last, need = layers[-1]
        if need.any and not (module == LLM and stage == spec.num_stages - 1):  # the LLM's last computes the loss
            kept += stage_output_bytes_per_token(last, self.dtype_bytes, t if sp else 1) * tokens
        return kept

    def transient_memory(self, module: str, stage: int, work: Workload) -> float:
        """One layer's backward working set at a time (`loom.cost.memory`, counted once per
        rank, not per microbatch): its gradients' intermediates and, under recompute, one
        block's recomputed activations (all under ``full``, with the copy of its weights the
        recomputation casts under bf16; its attention core's under ``selective``)."""
        spec = self.plan.spec(module)
        if work.tokens <= 0:
            return 0.0
        tokens = work.share(self.plan.item_shares(module)).tokens / spec.context_parallel
        t = self._param_shards(module)
        # the recomputed block casts its weights again (not FSDP2's, gathered in the compute dtype)
        copies = spec.recompute == "full" and spec.zero_stage < 2
        layers = self.stage_layers(module, stage)
        gather = (zero3_gather_bytes([l for l, _ in layers], t, self._shards(module), self.dtype_bytes)
                  if spec.zero_stage >= 3 else 0.0)  # a layer's parameters gathered for its backward
        return gather + max(
            (backward_working_bytes(l, t, self.dtype_bytes, tokens, spec.recompute, module == LLM)
             + (weight_copy_bytes(l, t, self.dtype_bytes) if copies and l.kind == "block" else 0.0)
             for l, need in layers if need.any),
            default=0.0,
        )

    # ---- throughput ------------------------------------------------------------------------
    def model_flops(self, work: MicrobatchWork) -> float:
        """`loom.cost.flops.model_flops`: forward plus the frozen-aware backward, without
        recomputation; ``6 T P + 12 c S2 L q`` for a fully trainable dense decoder."""
        unknown = set(work) - set(self.arch.modules)
        if unknown:
            raise ValueError(f"model_flops: unknown modules {sorted(unknown)}; the model has {self.arch.module_names}")
        # FLOPs are linear in (tokens, attn_sq) (`loom.cost.flops`), so each module's two
        # coefficients are computed once; the simulator asks for every microbatch
        total = 0.0
        for name, w in work.items():
            coef = self._flop_coefficients.get(name)
            if coef is None:
                coef = self._flop_coefficients[name] = (
                    model_flops(self.arch, {name: Workload(tokens=1)}, self.needs),
                    model_flops(self.arch, {name: Workload(attn_sq=1)}, self.needs),
                )
            total += coef[0] * w.tokens + coef[1] * w.attn_sq
        return total

    def peak_flops_per_rank(self) -> float:
        return self.spec.peak_bf16_flops


