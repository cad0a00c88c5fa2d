"""Memory per rank: parameters, gradients, optimizer states and activations, and the check that
a plan fits (issue 3, item 1; disttrain.md §3.1 "Memory, per GPU").

**Precision** (``run.dtype``, `loom.runtime.precision`): what loom runs is PyTorch's automatic
mixed precision, so parameters are fp32 master weights whatever the run's dtype, and so are
their gradients and the optimizer state (``MASTER_BYTES``); ``dtype_bytes`` (`DTYPE_BYTES`:
bf16 2, fp32 4) is the width of what is computed: activations, messages, the GEMMs' operands.

**Static memory** (Rajbhandari et al., "ZeRO", SC 2020, §3.1, with fp32 weights and gradients
as autocast keeps them), per rank holding ``P`` parameters of which ``P_t`` are trainable, with
tensor-parallel degree ``t`` and ``n = data_parallel x context_parallel`` replicas of the stage
(ZeRO shards over both, as Megatron-LM's distributed optimizer does):

- parameters ``4 P / t``, divided by ``n`` under ZeRO-3; under ZeRO-2 the gathered parameters
  *and* the rank's shard, ``b P / t + 4 P / (t n)`` with ``b`` the compute width (under bf16
  FSDP2's ``MixedPrecisionPolicy`` gathers bf16 copies of the fp32 shards, `loom.runtime.zero`;
  fp32: ``4 P / t (1 + 1 / n)``) (FSDP2 with ``reshard_after_forward=False``,
  `loom.runtime.zero`, keeps the shard and holds the gathered copy from a forward to the next
  backward, which reshards it; the pass after gathers it again, `loom.cost.analytic`. The
  copy is live whenever a forward has run since the last backward, so at the stage's peak,
  when its microbatches are in flight; a layer without backward keeps it for good);
- gradients ``4 P_t / t``, divided by ``n`` under ZeRO-2 and -3 (frozen parameters have none),
  but only when the replica runs one microbatch on the stage: loom reduce-scatters after the
  stage's last backward of the iteration and accumulates the earlier microbatches' gradients
  unsharded (``accumulates``), as ``torch.distributed.pipelining`` does;
- optimizer states ``k P_t / t``, divided by ``n`` under ZeRO-1, -2, -3, with ``k = 8`` for Adam
  (first and second moments; the weights are their own master copy) and ``k = 0`` for plain SGD.

Under ZeRO-3 a layer's parameters are gathered for its forward and again for its backward:
the gathered layer and the all-gather's input (the rank's shard, cast to the compute dtype) are
live at once, ``b W (1 + 1 / n) / t`` for the largest layer of ``W`` parameters
(`zero3_gather_bytes`, in the transient working set; measured by ``benchmarks/memory.py``).

**Activations** kept from a microbatch's forward until its backward, per token and per rank
(tokens divided by the context-parallel degree), only for layers that run some backward
(`loom.cost.frozen`). A transformer block follows Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (MLSys 2023), §4.1, whose ``34 h + 5 a s`` bytes
per token (16-bit, with dropout, without FlashAttention) we take *with* FlashAttention (no
``s x s`` scores, softmax or dropout tensors: the ``5 a s`` term goes) and without dropout
(training MLLMs uses none: the two ``h``-byte masks go), generalised to grouped-query
attention and gated MLPs, and counted as loom's blocks (the zoo's and Hugging Face's) really
keep them, which `benchmarks/memory.py` measures tensor by tensor. In elements per token:

- replicated across TP (Megatron without sequence parallelism; with it, below), per norm: a LayerNorm keeps
  its input and its output (the next projection's input), ``2 h``; an RMSNorm also its
  normalised input before the weight's scale (``x / rms(x)``, which the scale's backward
  reads), ``3 h``; two norms per block;
- split across TP: ``Q, K, V`` and the attention output as the core receives them,
  ``4 q``: grouped-query attention repeats K and V to the query heads before the core (the
  zoo and Hugging Face's ``repeat_kv`` both do), so they are kept at the query width; RoPE
  keeps only its (shared) tables; and the MLP's intermediates, ``2 ffn`` (GELU MLP: the
  activation's input and output) or ``4 ffn`` (SwiGLU: gate, up, silu(gate), their product);
- the attention core's own intermediates: FlashAttention keeps the fp32 log-sum-exp of every
  query row, ``4 a / t`` bytes for ``a`` heads (its inputs Q, K, V and its output are counted
  above: the projections around the core keep them anyway);

so ``b (2 n h + (4 q + m) / t) + 4 a / t`` with ``n`` the norm's count: about ``32 h`` bytes
for GPT-3 (LayerNorm, ``q = h``, ``ffn = 4h``) against Korthikanti's ``34 h`` with dropout
masks. **Sequence parallelism** (the LLM under TP, as `loom.runtime.tensor_parallel` runs it;
Korthikanti §4.2.2): between the projections every rank holds its ``1 / t`` of the sequence,
so a norm keeps its input and internals sharded, and only its output, all-gathered to the
whole sequence for the column-parallel projections that keep it for their weights' gradient,
is whole: ``(n - h) / t + h`` elements per norm (`sp_norm_kept_elements`; an RMSNorm ``2 h /
t + h``). The final norm keeps its sharded part, the head its gathered input (and the
vocabulary-parallel loss its ``4 vocab / t`` bytes of log-softmax); a block under ``"full"``
recompute keeps its sequence shard, ``b h / t``; a stage's output passed on is a shard too.
Encoders' TP has no sequence parallelism: their norms are replicated. (Measured per block by
`MemoryMeter` on a 2-rank group, ``tests/test_memory_model.py``; the memory benchmark's
``tp2`` cases check it end to end.) A stage that hands its output on to a later stage also
keeps that output until its gradient comes back (the executor holds it for the backward):
``b`` times the last layer's output width (`stage_output_bytes_per_token`). Activation recomputation
(``ModuleSpec.recompute``) changes what a block keeps:

- ``"full"``: only its input, ``b h``; one block's full set is live again while it is
  recomputed (the *transient* working set, counted once);
- ``"selective"`` (Korthikanti §4.2, the attention core only): everything but the core's
  intermediates, ``4 a / t`` less; one block's core intermediates are live again while it is
  recomputed. Under FlashAttention that is a small saving: the ``5 a s`` scores Korthikanti
  recomputes are never stored, so selective mostly costs time (the core's forward again,
  `loom.cost.analytic`);
- ``"none"``: all of the above.

**Backward working set** (transient, one layer at a time, whatever the recompute mode): while
a block back-propagates through its MLP's down projection, the gradient of that projection's
input, ``2 ffn`` elements per token, and its weight's fp32 gradient, ``4 h ffn / t`` bytes (a
new tensor before it is accumulated), are live next to what the block keeps; the head's backward
holds the fp32 gradients of the log-probabilities and of the logits, ``8 vocab / t`` bytes per
token (`backward_working_bytes`; both measured, ``tests/test_memory_model.py``).
Under recompute the recomputed set adds to it.

Other layers keep their inputs (`activation_bytes_per_token`).

**bf16 weight copies**: under bf16 autocast every matrix product casts its fp32 weight to bf16,
and a layer whose input requires grad keeps that copy for its backward: ``b W / t`` per
microbatch in flight for a layer of ``W`` GEMM weights that runs some backward (none under
``"full"`` recompute, where the copy is made again while the block is recomputed: part of the
transient set). fp32 runs cast nothing (`weight_copy_bytes`), and neither do layers under
ZeRO-2 and -3 in bf16: FSDP2 gathers their parameters in bf16 already, and what the backward
reads is the gathered copy counted above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loom.cost.arch import LayerArch
from loom.cost.hardware import GiB
from loom.cost.model import CostModel, MicrobatchWork, Workload
from loom.plan.plan import LLM, Plan, PlanError

OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 0}  # per trainable parameter, see the module docstring
MASTER_BYTES = 4  # fp32 weights, gradients and their reduction (module docstring, "Precision")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # run.dtype -> bytes of an activation, message or GEMM operand


class OutOfMemoryError(PlanError):
    """A plan whose stages do not fit the device memory; the message names the rank, the stage
    and by how much it is over."""


@dataclass(frozen=True)
class StaticMemory:
    """Bytes per rank held for the whole run."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def static_memory(
    layers: Sequence[LayerArch],
    tensor_parallel: int,
    shards: int,
    zero_stage: int,
    optimizer: str,
    accumulates: bool = False,
    dtype_bytes: int = MASTER_BYTES,
) -> StaticMemory:
    """Parameters, gradients and optimizer states of ``layers`` on one rank (module docstring);
    ``shards`` is the number of replicas ZeRO shards over (data x context parallel);
    ``accumulates``: the replica runs several microbatches on the stage, so ZeRO-2 and -3
    gradients stay unsharded until the last backward; ``dtype_bytes``: the compute width,
    that of ZeRO-2's gathered parameters."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer = {optimizer!r}: choose one of {list(OPTIMIZER_STATE_BYTES)}")
    stored = _stored_params(layers)
    total = sum(stored)
    trainable = sum(n for n, l in zip(stored, layers) if l.trainable)
    t = tensor_parallel
    params = MASTER_BYTES * total / t
    if zero_stage >= 3:
        params /= shards
    elif zero_stage == 2:  # the gathered parameters (compute dtype) beside the rank's fp32 shard
        params = params / shards + min(dtype_bytes, MASTER_BYTES) * total / t
    return StaticMemory(
        params=params,
        grads=MASTER_BYTES * trainable / t / (shards if zero_stage >= 2 and not accumulates else 1),
        optimizer=OPTIMIZER_STATE_BYTES[optimizer] * trainable / t / (shards if zero_stage >= 1 else 1),
    )


def zero3_gather_bytes(layers: Sequence[LayerArch], tensor_parallel: int, shards: int,
                       dtype_bytes: int = MASTER_BYTES) -> float:
    """What gathering the largest of ``layers`` holds at once under ZeRO-3 (module docstring),
    gathered in the compute dtype of ``dtype_bytes``."""
    largest = max(_stored_params(layers), default=0)
    return min(dtype_bytes, MASTER_BYTES) * largest * (1 + 1 / shards) / tensor_parallel


def _stored_params(layers: Sequence[LayerArch]) -> list[int]:
    """Parameters each layer's rank stores: a tied head keeps a copy of the embedding weight
    unless the embedding is on the same stage."""
    has_embedding = any(l.kind == "embedding" for l in layers)
    return [l.params if (l.kind == "head" and has_embedding) else l.stored_params for l in layers]


def attention_core_bytes_per_token(layer: LayerArch, tensor_parallel: int) -> float:
    """What a block's attention core keeps per token beyond its inputs and output: the fp32
    log-sum-exp of each head's row (FlashAttention), heads split by TP (module docstring)."""
    return 4.0 * layer.heads / tensor_parallel if layer.kind == "block" else 0.0


def norm_kept_elements(norm: str, hidden: int) -> int:
    """Elements per token a norm keeps for its backward, its output included (module
    docstring): LayerNorm its input and output, RMSNorm also ``x / rms(x)``."""
    return (3 if norm == "rmsnorm" else 2) * hidden


def sp_norm_kept_elements(norm: str, hidden: int, tensor_parallel: int) -> float:
    """Elements per token of the full sequence a norm keeps under sequence parallelism (module
    docstring, "Sequence parallelism"): its input and internals on the rank's ``1 / t`` of the
    tokens, and its output all-gathered to the whole sequence, which the next projection keeps."""
    return (norm_kept_elements(norm, hidden) - hidden) / tensor_parallel + hidden


def activation_bytes_per_token(layer: LayerArch, tensor_parallel: int, recompute: str, dtype_bytes: int,
                               sequence_parallel: bool = False) -> float:
    """Bytes one input token of ``layer`` keeps until the backward (module docstring), on a
    rank of a ``tensor_parallel``-way group, under ``recompute`` ("none", "selective", "full");
    ``sequence_parallel``: the LLM's layout under TP (`loom.runtime.tensor_parallel`), where
    what lies between the projections is sharded over the sequence."""
    b, h, t = dtype_bytes, layer.hidden, tensor_parallel
    sp = sequence_parallel and t > 1
    if layer.scale > 1 or layer.cross or layer.kind in ("resblock", "conv") or (layer.cond and layer.kind == "projector"):
        return _generator_bytes_per_position(layer, recompute, b) / layer.scale**2
    if layer.kind == "block":
        if recompute == "full":
            return b * h / (t if sp else 1)  # the block's input: a sequence shard under SP
        mlp = (4 if layer.gated_mlp else 2) * layer.ffn
        norms = 2 * (sp_norm_kept_elements(layer.norm, h, t) if sp else norm_kept_elements(layer.norm, h))
        # Q, K, V and the output as the core receives them: K and V repeated to the query heads
        kept = b * (norms + (4 * layer.q_dim + mlp) / t)
        return kept if recompute == "selective" else kept + attention_core_bytes_per_token(layer, t)
    if layer.kind == "frontend":
        if layer.frontend == "patch":
            return b * layer.in_channels * layer.temporal_patch * layer.patch**2  # the patches
        # mel frames, conv1 output and its GELU, conv2 output, per output token
        return b * (layer.stride * layer.in_channels + 2 * layer.stride * h + h)
    if layer.kind == "norm":
        # its output is the next layer's input (the head's, all-gathered under SP)
        return b * (norm_kept_elements(layer.norm, h) - h) / (t if sp else 1)
    if layer.kind == "head":
        # its input (all-gathered to the whole sequence under SP), and the fp32 log-softmax of
        # the (vocab-parallel) logits the loss keeps
        return b * h + 4 * layer.vocab / t
    if layer.kind == "projector":
        if layer.projector == "linear":
            return b * h
        if layer.projector == "mlp":
            return b * (h + 2 * layer.out_hidden)
        return b * 4 * h  # merger: norm input, fc1 input, GELU input, fc2 input (per input token)
    return 0.0  # embedding: keeps only the token ids


def _generator_bytes_per_position(layer: LayerArch, recompute: str, b: int) -> float:
    """What a generator layer keeps per position of its own grid (module docstring of
    `loom.cost.arch`), roughly as autograd keeps it: a residual block its GroupNorm and SiLU
    inputs and both convolutions' inputs (``2 in + 4 hidden`` elements); a convolution its input
    (and its norm's); a block what a transformer block keeps, plus its cross-attention's norm,
    query and output input and a spatial transformer's norm and projections. The conditioning
    tokens' own activations (``cond`` per item, far fewer than positions) are left out."""
    h = layer.hidden
    if layer.kind == "resblock":
        return b * (2 * layer.in_channels + 4 * h) if recompute != "full" else b * layer.in_channels
    if layer.kind == "conv":
        return b * layer.in_channels * (2 if layer.norm_before else 1)
    if layer.kind == "block":
        if recompute == "full":
            return b * h
        mlp = (4 if layer.gated_mlp else 2) * layer.ffn
        kept = b * (2 * norm_kept_elements(layer.norm, h) + 4 * layer.q_dim + mlp)
        if layer.cross:
            kept += b * (norm_kept_elements(layer.norm, h) + 2 * layer.q_dim)
        if layer.proj_io:
            kept += b * 3 * h
        return kept
    return 0.0  # a generator's projector: conditioning tokens only


def stage_output_bytes_per_token(layer: LayerArch, dtype_bytes: int, sequence_shards: int = 1) -> float:
    """What a stage whose last layer is ``layer`` holds per input token of its output until the
    output's gradient comes back (module docstring): the output, in the compute dtype, on the
    rank's ``1 / sequence_shards`` of the sequence (the TP degree under sequence parallelism:
    consecutive LLM stages pass their shards on, `loom.runtime.unit`)."""
    # a generator layer's output is on its own grid (`LayerArch.out_scale`); skip tensors a cut
    # U-Net would also pass on are not counted
    return (dtype_bytes * layer.out_width / (layer.merge if layer.kind == "projector" else 1) / sequence_shards
            / layer.out_scale**2)


def weight_copy_bytes(layer: LayerArch, tensor_parallel: int, dtype_bytes: int) -> float:
    """The bf16 copy of ``layer``'s GEMM weights that autocast makes and its backward keeps
    (module docstring), on a rank of a ``tensor_parallel``-way group; 0 when nothing is cast
    (``dtype_bytes`` is the fp32 master width)."""
    if dtype_bytes >= MASTER_BYTES:
        return 0.0
    return float(layer.gemm_weights) / tensor_parallel * dtype_bytes


def backward_working_bytes(layer: LayerArch, tensor_parallel: int, dtype_bytes: int, tokens: float,
                           recompute: str = "none", sequence_parallel: bool = False) -> float:
    """What is live, beyond what the layer keeps, while ``layer`` back-propagates ``tokens``
    tokens (module docstring, "Backward working set"): a block's MLP gradients and its down
    projection's weight gradient, plus under ``full`` recompute its whole recomputed set and
    under ``selective`` (at another moment of the block's backward) its attention core's; the
    head's fp32 gradients of the log-probabilities and logits; nothing for other layers."""
    t = tensor_parallel
    if layer.kind == "head":
        return 8.0 * layer.vocab / t * tokens
    if layer.kind != "block":
        return 0.0
    mlp = 2 * dtype_bytes * layer.ffn / t * tokens + MASTER_BYTES * layer.hidden * layer.ffn / t
    if recompute == "full":  # the recomputed set, less the input the block kept
        return (activation_bytes_per_token(layer, t, "none", dtype_bytes, sequence_parallel)
                - activation_bytes_per_token(layer, t, "full", dtype_bytes, sequence_parallel)) * tokens + mlp
    if recompute == "selective":
        return max(mlp, attention_core_bytes_per_token(layer, t) * tokens)
    return mlp


# ---- the plan-level check -----------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on every rank of ``(module, stage)``; ``rank`` and ``unit`` are its first."""

    module: str
    stage: int
    rank: int
    unit: int
    params: float
    grads: float
    optimizer: float
    activations: float
    microbatches: int
    transient: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def describe(self) -> str:
        g = lambda x: f"{x / GiB:.2f}"
        parts = (f"parameters {g(self.params)}, gradients {g(self.grads)}, optimizer states "
                 f"{g(self.optimizer)}, activations {g(self.activations)} GiB for {self.microbatches} "
                 f"microbatch{'es' if self.microbatches != 1 else ''} in flight")
        if self.transient:
            parts += f", backward working set {g(self.transient)} GiB"
        return parts


def in_flight_count(plan: Plan, module: str, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` of ``module`` holds at its peak.

    GPipe holds all of a replica's microbatches. 1F1B holds as many as there are stages from
    this one to the end of the pipeline (disttrain.md §3.1: "the first PP stage requires
    storage for PP microbatches"); an encoder's pipeline continues into the LLM's, so its
    stages count the LLM's too. Interleaved 1F1B (``virtual_stages`` V over P positions) holds
    ``(P - p - 1) * 2 + (V - 1) * P + 1`` chunk activations on position ``p`` (optimus.md
    §3.11's warmup, plus the steady phase's forward); each chunk is counted for its share,
    rounded up.
    """
    spec = plan.spec(module)
    per_replica = max(len(plan.microbatches_of(module, r)) for r in range(spec.data_parallel))
    if plan.schedule == "gpipe":
        return per_replica
    if spec.virtual_stages > 1:
        pp, v = spec.pipeline_depth, spec.virtual_stages
        held = (pp - spec.position_of(stage) - 1) * 2 + (v - 1) * pp + 1
        return min(-(-held // v), per_replica)
    llm = plan.spec(LLM)
    depth = spec.num_stages - stage + (llm.pipeline_depth if module != LLM else 0)
    return min(depth, per_replica)


def worst_in_flight(plan: Plan, microbatches: Sequence[MicrobatchWork]) -> dict[tuple[str, int], list[Workload]]:
    """For every stage, the heaviest microbatches (by tokens) it may hold at once, from the
    step's per-microbatch workloads: a conservative input for `check_memory`."""
    out: dict[tuple[str, int], list[Workload]] = {}
    for spec in plan.modules:
        works = sorted((mb.get(spec.name, Workload()) for mb in microbatches), key=lambda w: w.tokens, reverse=True)
        for s in range(spec.num_stages):
            out[(spec.name, s)] = works[: in_flight_count(plan, spec.name, s)]
    return out


def stage_memory(cost: CostModel, module: str, stage: int, in_flight: Sequence[Workload]) -> MemoryBreakdown:
    """Peak memory of a rank of ``(module, stage)`` holding ``in_flight`` microbatches."""
    plan = cost.plan
    breakdown = getattr(cost, "static_breakdown", None)
    static = breakdown(module, stage) if breakdown else StaticMemory(cost.static_memory(module, stage), 0.0, 0.0)
    transient_of = getattr(cost, "transient_memory", None)
    transient = max((transient_of(module, stage, w) for w in in_flight), default=0.0) if transient_of else 0.0
    return MemoryBreakdown(
        module=module,
        stage=stage,
        rank=plan.rank_of(module, stage, 0),
        unit=plan.unit_of(module, stage, 0),
        params=static.params,
        grads=static.grads,
        optimizer=static.optimizer,
        activations=sum(cost.activation_memory(module, stage, w) for w in in_flight),
        microbatches=len(in_flight),
        transient=transient,
    )


def check_memory(
    cost: CostModel,
    in_flight: Mapping[tuple[str, int], Sequence[Workload]],
    capacity_bytes: float | None = None,
    reserved_bytes: float = 0.0,
) -> dict[tuple[str, int], MemoryBreakdown]:
    """Peak memory of every ``(module, stage)`` holding its ``in_flight`` microbatches; raises
    `OutOfMemoryError` naming each rank that does not fit and by how much.

    ``capacity_bytes`` defaults to the device memory of the cost model's cluster;
    ``reserved_bytes`` is kept free for the CUDA context and communication buffers.
    """
    device = "device"
    if capacity_bytes is None:
        cluster: Any = getattr(cost, "cluster", None)
        if cluster is None:
            raise ValueError("check_memory: the cost model has no cluster; pass capacity_bytes")
        capacity_bytes = cluster.spec.hbm_bytes
        device = cluster.spec.name
    usable = capacity_bytes - reserved_bytes
    result = {key: stage_memory(cost, key[0], key[1], list(works)) for key, works in in_flight.items()}
    over = sorted((m for m in result.values() if m.total > usable), key=lambda m: m.total - usable, reverse=True)
    if over:
        lines = [
            f"rank {m.rank} (module {m.module!r} stage {m.stage}, pipeline unit {m.unit}; every replica alike) "
            f"needs {m.total / GiB:.2f} GiB but one {device} has {usable / GiB:.2f} GiB"
            f"{' usable' if reserved_bytes else ''}: over by {(m.total - usable) / GiB:.2f} GiB ({m.describe()})"
            for m in over
        ]
        raise OutOfMemoryError(
            "the plan does not fit in memory:\n  " + "\n  ".join(lines)
            + "\n  raise tensor or pipeline parallelism, the ZeRO stage, or set recompute = \"full\""
        )
    return result
