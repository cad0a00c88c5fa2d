"""Optimus's model planner (optimus.md §2.3, §3.3, memory §2.7): the encoder plans colocated
with a given LLM plan, their memory per rank, and the microbatch partitions over the encoder
pipelines.

Given the LLM's plan ``(DP_llm, PP_llm, TP_llm)`` over ``n = DP_llm PP_llm TP_llm`` ranks, an
encoder plan has ``PP_enc | PP_llm`` and ``TP_enc | TP_llm`` (optimus.md §2.3 item 2), so
``DP_enc = n / (PP_enc TP_enc)`` and every LLM pipeline hosts ``m = DP_enc / DP_llm =
(PP_llm / PP_enc) (TP_llm / TP_enc)`` encoder pipelines.

**Colocation map** (the paper leaves it open, optimus.md §7 point 2; decided here): inside one
LLM pipeline, encoder pipeline ``j = a * g + b`` (``g = TP_llm / TP_enc``, ``a < PP_llm /
PP_enc``, ``b < g``) runs its stage ``s`` on LLM stage ``a * PP_enc + s``, on that stage's
tensor-parallel ranks ``b * TP_enc .. (b + 1) * TP_enc - 1``: encoder pipelines tile the LLM
pipeline along PP in blocks of ``PP_enc`` consecutive stages (Fig. 5: pipeline 1 on LLM stages
1-2, pipeline 2 on stages 3-4) and along TP in slices of ``TP_enc`` ranks. Every rank hosts
exactly one encoder stage of one encoder pipeline and one LLM stage, so encoder pipelines never
compete for a device; they interact only through the global ordering of §3.6. The LLM pipeline
replicas (DP_llm of them) each host their own ``m`` encoder pipelines, laid out alike.

**Memory per rank** (§2.7): the paper's ``MEM_model = k (DP_enc phi_enc + DP_llm phi_llm) / n``
and ``MEM_overhead = k (DP_enc - DP_llm) phi_enc / n`` (`paper_model_memory`,
`paper_overhead_memory`, k = 6 in the paper) are reported as they are; pruning uses loom's own
memory model (`loom.cost.memory`), which applies rank by rank: the static memory of the
encoder stage's layers at ``TP_enc`` (ZeRO over ``DP_enc``) plus the LLM stage's at
``TP_llm`` (ZeRO over ``DP_llm``), the LLM stage's activations for the microbatches 1F1B
keeps in flight (``PP_llm - p`` on stage ``p``) with sequence parallelism, and its backward
working set. Encoder stages are split by layer count (`loom.plan.plan.even_boundaries`;
optimus.md §7 point 15), the LLM's likewise unless boundaries are given.

**Encoder activations** (optimus.md §7 point 11: the paper omits them as negligible, but the
coarse schedule runs all of a pipeline's forwards before the LLM and all its backwards after,
so it holds every one of its microbatches' activations at once): counted. Each rank's memory
left after the rest gives how many encoder microbatches it may hold (`max_in_flight`); a
partition that gives a pipeline more is not enumerated, and a plan that cannot hold one is
pruned.

**Partitions** (§2.3 item 5): the ``N_mb`` LLM microbatches are split over the ``m`` encoder
pipelines as compositions (every part at least 1, as the paper's ``[1,7] .. [7,1]`` example),
``binom(N_mb - 1, m - 1)`` of them (`compositions`, `count_partitions`). The blow-up (§7
point 12: 2.6 million for ``N_mb = 32, m = 8``) is capped in two steps, decided here:

1. symmetry: pipelines ``j`` with the same ``a`` sit on the same LLM stages and see the same
   LLM timeline, so permuting their parts gives the same schedule; only partitions whose parts
   are non-increasing inside each such group are enumerated (`EncoderCandidate.partitions`).
   This is exact: no distinct schedule is lost;
2. a band: if more than ``max_partitions`` remain, only those whose parts all lie within ``d``
   of the balanced share ``N_mb / m`` are kept, with ``d`` the widest band within the cap (the
   balanced partitions, ``d < 1``, are always kept). This is a heuristic and says so in
   `EncoderCandidate.partition_band`.

A plan with ``m > N_mb`` has no partition with positive parts and is pruned (§7 point 12).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache

from loom.cost import comm
from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch import LLM, LayerArch, ModelArch
from loom.cost.hardware import Cluster
from loom.cost.kernels import Kernel, stage_kernels
from loom.cost.memory import (
    activation_bytes_per_token,
    backward_working_bytes,
    stage_output_bytes_per_token,
    static_memory,
)
from loom.cost.model import Workload
from loom.plan.plan import ModuleSpec, Plan, PlanError, even_boundaries

PAPER_BYTES_PER_PARAM = 6  # optimus.md §2.7: k = 6, bf16 parameters and fp32 gradients


class OptimusPlanError(PlanError):
    """Bad input to the Optimus planner; the message names the field and the fix."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class LLMParallel:
    """The LLM's plan: ``data_parallel`` x ``pipeline_parallel`` x ``tensor_parallel`` ranks."""

    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int

    def __post_init__(self) -> None:
        for name in ("data_parallel", "pipeline_parallel", "tensor_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise OptimusPlanError(f"LLMParallel.{name} = {v!r}: must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.pipeline_parallel * self.tensor_parallel

    def rank(self, stage: int, replica: int, tensor: int) -> int:
        """Global rank of (stage, replica, tensor rank), in loom's layout (stage-major, then
        replica, then TP: `loom.plan.plan`)."""
        return (stage * self.data_parallel + replica) * self.tensor_parallel + tensor


@dataclass(frozen=True)
class EncoderParallel:
    """An encoder plan colocated with the LLM's (optimus.md §2.3 item 2)."""

    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the ranks of LLM stage ``llm_stage`` (hosting ``encoder_stage``), by loom's
    memory model: ``static`` (parameters, gradients and optimizer states of the encoder stage
    and the LLM stage), ``llm_activations`` (1F1B's microbatches in flight), ``transient`` (the
    LLM stage's backward working set) and ``encoder_activations_per_microbatch``."""

    llm_stage: int
    encoder_stage: int
    static: float
    llm_activations: float
    transient: float
    encoder_activations_per_microbatch: float

    def total(self, encoder_microbatches: int = 1) -> float:
        return (self.static + self.llm_activations + self.transient
                + encoder_microbatches * self.encoder_activations_per_microbatch)

    def fits(self, limit: float, most: int) -> int:
        """How many encoder microbatches (at most ``most``) these ranks can hold within ``limit``."""
        free = limit - self.total(0)
        if self.encoder_activations_per_microbatch <= 0:
            return most if free >= 0 else 0
        return max(0, min(most, int(free // self.encoder_activations_per_microbatch)))


@dataclass(frozen=True)
class ColocationMemory:
    """Bytes per rank of a colocated plan (module docstring): ``paper_model`` and
    ``paper_overhead`` are optimus.md §2.7's formulas with ``k`` bytes per parameter; ``ranks``
    is loom's memory model per LLM stage (all TP ranks and replicas of a stage alike)."""

    paper_model: float
    paper_overhead: float
    ranks: tuple[RankMemory, ...]

    def total(self, encoder_microbatches: int = 1) -> float:
        """The most bytes any rank holds with ``encoder_microbatches`` encoder microbatches."""
        return max(r.total(encoder_microbatches) for r in self.ranks)

    def worst(self, encoder_microbatches: int = 1) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total(encoder_microbatches))


@dataclass(frozen=True)
class EncoderCandidate:
    """One encoder plan that fits: its degrees, ``m`` encoder pipelines per LLM pipeline, its
    memory, and ``max_in_flight``, the most encoder microbatches a pipeline may hold at once
    (module docstring, §7 point 11)."""

    encoder: EncoderParallel
    llm: LLMParallel
    m: int
    memory: ColocationMemory
    max_in_flight: int

    @property
    def groups(self) -> int:
        """``PP_llm / PP_enc``: blocks of LLM stages, each hosting ``group_size`` pipelines."""
        return self.llm.pipeline_parallel // self.encoder.pipeline_parallel

    @property
    def group_size(self) -> int:
        """``TP_llm / TP_enc``: encoder pipelines side by side on the same LLM stages."""
        return self.llm.tensor_parallel // self.encoder.tensor_parallel

    def llm_stage(self, pipeline: int, stage: int) -> int:
        """The LLM stage that hosts encoder ``stage`` of encoder ``pipeline`` (module docstring)."""
        return (pipeline // self.group_size) * self.encoder.pipeline_parallel + stage

    def tensor_ranks(self, pipeline: int) -> range:
        """The LLM tensor-parallel ranks (of the hosting stage) encoder ``pipeline`` runs on."""
        b = pipeline % self.group_size
        return range(b * self.encoder.tensor_parallel, (b + 1) * self.encoder.tensor_parallel)

    def ranks(self, pipeline: int, stage: int, replica: int = 0) -> tuple[int, ...]:
        """Global ranks of encoder ``stage`` of ``pipeline`` in LLM replica ``replica``."""
        p = self.llm_stage(pipeline, stage)
        return tuple(self.llm.rank(p, replica, t) for t in self.tensor_ranks(pipeline))

    def count_partitions(self, num_microbatches: int, band: float | None = None) -> int:
        """How many partitions `partitions` enumerates (within ``band`` of the balanced share)."""
        lo, hi = self._bounds(num_microbatches, band)
        return _count_grouped(num_microbatches, (self.group_size,) * self.groups, lo, hi)

    def partition_band(self, num_microbatches: int, max_partitions: int | None) -> float | None:
        """The band of step 2 of the module docstring's cap: None when every symmetric
        partition fits within ``max_partitions`` (exhaustive), else the widest ``d``."""
        if max_partitions is None or self.count_partitions(num_microbatches) <= max_partitions:
            return None
        share = num_microbatches / self.m
        band = 0.0
        for d in range(1, num_microbatches + 1):
            if self.count_partitions(num_microbatches, float(d)) > max_partitions:
                break
            band = float(d)
        # d < 1 keeps the balanced partitions (floor / ceil of the share) even past the cap
        return band if band >= 1 else max(share - math.floor(share), math.ceil(share) - share, 0.0)

    def partitions(self, num_microbatches: int, max_partitions: int | None = 4096) -> Iterator[tuple[int, ...]]:
        """Partitions of ``num_microbatches`` over the ``m`` pipelines: part ``j`` is pipeline
        ``j``'s count, every part in ``1 .. max_in_flight``, non-increasing inside each group of
        symmetric pipelines, within the band of `partition_band` (module docstring)."""
        band = self.partition_band(num_microbatches, max_partitions)
        lo, hi = self._bounds(num_microbatches, band)
        yield from _grouped(num_microbatches, (self.group_size,) * self.groups, lo, hi)

    def _bounds(self, n: int, band: float | None) -> tuple[int, int]:
        lo, hi = 1, min(n, self.max_in_flight)
        if band is not None:
            share = n / self.m
            lo, hi = max(lo, math.ceil(share - band - 1e-9)), min(hi, math.floor(share + band + 1e-9))
        return lo, hi


@dataclass(frozen=True)
class PrunedPlan:
    """An encoder plan the planner dropped, and why."""

    encoder: EncoderParallel
    reason: str


@dataclass(frozen=True)
class PlannerResult:
    """The model planner's answer: the candidates that fit, in enumeration order (PP_enc,
    then TP_enc, ascending), and the pruned plans with their reasons."""

    llm: LLMParallel
    num_microbatches: int
    candidates: tuple[EncoderCandidate, ...]
    pruned: tuple[PrunedPlan, ...] = field(default=())


# ---- the paper's formulas (§2.7) ---------------------------------------------------------------


def paper_model_memory(phi_enc: float, phi_llm: float, dp_enc: int, dp_llm: int, world_size: int,
                       k: float = PAPER_BYTES_PER_PARAM) -> float:
    """``MEM_model = k (DP_enc phi_enc + DP_llm phi_llm) / n_gpu`` bytes (optimus.md §2.7)."""
    return k * (dp_enc * phi_enc + dp_llm * phi_llm) / world_size


def paper_overhead_memory(phi_enc: float, dp_enc: int, dp_llm: int, world_size: int,
                          k: float = PAPER_BYTES_PER_PARAM) -> float:
    """``MEM_overhead = k (DP_enc - DP_llm) phi_enc / n_gpu`` bytes (optimus.md §2.7)."""
    return k * (dp_enc - dp_llm) * phi_enc / world_size


# ---- partitions (§2.3 item 5) ------------------------------------------------------------------


def compositions(n: int, m: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``n`` microbatches over ``m`` pipelines with each part >= 1, in
    lexicographic order (``n = 8, m = 2``: ``(1, 7) .. (7, 1)``)."""
    if m < 1 or n < m:
        return
    if m == 1:
        yield (n,)
        return
    for first in range(1, n - m + 2):
        for rest in compositions(n - first, m - 1):
            yield (first, *rest)


def count_partitions(n: int, m: int) -> int:
    """``binom(n - 1, m - 1)``: how many `compositions` there are (optimus.md §3.8)."""
    return math.comb(n - 1, m - 1) if 1 <= m <= n else 0


@cache
def _count_nonincreasing(total: int, parts: int, lo: int, hi: int) -> int:
    """Non-increasing sequences of ``parts`` integers in ``[lo, hi]`` summing to ``total``."""
    if parts == 0:
        return 1 if total == 0 else 0
    if total < parts * lo or total > parts * hi:
        return 0
    return sum(_count_nonincreasing(total - first, parts - 1, lo, first) for first in range(lo, hi + 1))


def _count_grouped(total: int, groups: tuple[int, ...], lo: int, hi: int) -> int:
    if lo > hi:
        return 0
    ways = {0: 1}  # sum so far -> count
    for g in groups:
        nxt: dict[int, int] = {}
        for s, c in ways.items():
            for t in range(g * lo, g * hi + 1):
                k = _count_nonincreasing(t, g, lo, hi)
                if k and s + t <= total:
                    nxt[s + t] = nxt.get(s + t, 0) + c * k
        ways = nxt
    return ways.get(total, 0)


def _nonincreasing(total: int, parts: int, lo: int, hi: int) -> Iterator[tuple[int, ...]]:
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in range(min(hi, total - lo * (parts - 1)), lo - 1, -1):
        if first * parts < total:
            break  # the rest cannot exceed ``first``
        for rest in _nonincreasing(total - first, parts - 1, lo, first):
            yield (first, *rest)


def _grouped(total: int, groups: tuple[int, ...], lo: int, hi: int) -> Iterator[tuple[int, ...]]:
    """Partitions over consecutive groups, non-increasing inside each group."""
    if not groups:
        if total == 0:
            yield ()
        return
    g, rest = groups[0], groups[1:]
    n_rest = sum(rest)
    for t in range(max(g * lo, total - n_rest * hi), min(g * hi, total - n_rest * lo) + 1):
        for head in _nonincreasing(t, g, lo, hi):
            for tail in _grouped(total - t, rest, lo, hi):
                yield head + tail


# ---- memory per rank (loom's model) -------------------------------------------------------------


def _stage_layers(layers: Sequence[LayerArch], stages: int, stage: int,
                  boundaries: Sequence[int] | None = None) -> list[LayerArch]:
    b = list(boundaries) if boundaries is not None else even_boundaries(len(layers), stages)
    return list(layers[b[stage]:b[stage + 1]])


def _activation_bytes(layers: Sequence[LayerArch], tp: int, recompute: str, dtype_bytes: int, tokens: int,
                      sequence_parallel: bool, hands_on: bool) -> float:
    kept = sum(activation_bytes_per_token(l, tp, recompute, dtype_bytes, sequence_parallel) for l in layers)
    if hands_on and layers:
        kept += stage_output_bytes_per_token(layers[-1], dtype_bytes, tp if sequence_parallel else 1)
    return kept * tokens


def plan_encoders(
    arch: ModelArch,
    llm: LLMParallel,
    num_microbatches: int,
    *,
    llm_tokens: int,
    encoder_tokens: dict[str, int],
    memory_limit: float,
    zero_stage: int = 1,
    optimizer: str = "adam",
    dtype_bytes: int = 2,
    llm_recompute: str = "full",
    encoder_recompute: str = "none",
    llm_boundaries: Sequence[int] | None = None,
    k: float = PAPER_BYTES_PER_PARAM,
) -> PlannerResult:
    """The model planner (optimus.md §3.3) for a given LLM plan: every encoder plan ``(DP_enc,
    PP_enc, TP_enc)`` with ``PP_enc | PP_llm`` and ``TP_enc | TP_llm``, its memory per rank
    (module docstring), pruned by ``memory_limit`` bytes per rank.

    ``num_microbatches`` is ``N_mb``, the microbatches of one LLM pipeline; ``llm_tokens`` the
    tokens of one LLM microbatch and ``encoder_tokens[e]`` those of one microbatch of encoder
    ``e`` (each encoder microbatch is a whole LLM microbatch's encoder input, §2.3 item 5).
    Every encoder of ``arch`` gets the same plan (§3.7). ZeRO stage, optimizer, dtype and
    recompute modes are loom's (`loom.cost.memory`); ``k`` is the paper's bytes per parameter,
    for the reported ``paper_model`` and ``paper_overhead`` only.
    """
    encoders = arch.encoder_names
    if not encoders:
        raise OptimusPlanError("plan_encoders: the model has no encoder; Optimus colocates encoders with the LLM")
    if num_microbatches < 1:
        raise OptimusPlanError(f"num_microbatches = {num_microbatches}: must be at least 1")
    if memory_limit <= 0:
        raise OptimusPlanError(f"memory_limit = {memory_limit}: give the bytes one rank may use (> 0)")
    missing = [e for e in encoders if e not in encoder_tokens]
    if missing:
        raise OptimusPlanError(f"encoder_tokens lacks {missing}: give one microbatch's tokens for every encoder")
    llm_layers = arch.module(LLM).layers
    if llm.pipeline_parallel > len(llm_layers):
        raise OptimusPlanError(f"LLMParallel.pipeline_parallel = {llm.pipeline_parallel} exceeds the LLM's "
                               f"{len(llm_layers)} layers")
    n = llm.world_size
    phi_llm = arch.module(LLM).params
    phi_enc = sum(arch.module(e).params for e in encoders)
    # the LLM's part of every rank, per LLM stage p (independent of the encoder plan)
    llm_static, llm_act, llm_transient = [], [], []
    for p in range(llm.pipeline_parallel):
        layers = _stage_layers(llm_layers, llm.pipeline_parallel, p, llm_boundaries)
        llm_static.append(static_memory(layers, llm.tensor_parallel, llm.data_parallel, zero_stage, optimizer,
                                        accumulates=num_microbatches > 1).total)
        in_flight = min(llm.pipeline_parallel - p, num_microbatches)  # 1F1B (loom.cost.memory.in_flight_count)
        llm_act.append(in_flight * _activation_bytes(layers, llm.tensor_parallel, llm_recompute, dtype_bytes,
                                                     llm_tokens, True, p < llm.pipeline_parallel - 1))
        llm_transient.append(max((backward_working_bytes(l, llm.tensor_parallel, dtype_bytes, llm_tokens,
                                                         llm_recompute, True) for l in layers), default=0.0))
    candidates, pruned = [], []
    for pp in divisors(llm.pipeline_parallel):
        for tp in divisors(llm.tensor_parallel):
            dp = n // (pp * tp)
            plan = EncoderParallel(dp, pp, tp)
            m = dp // llm.data_parallel
            too_deep = [e for e in encoders if pp > arch.module(e).num_layers]
            if too_deep:
                pruned.append(PrunedPlan(plan, f"PP_enc = {pp} exceeds the layers of {too_deep}"))
                continue
            heads = [l.heads for e in encoders for l in arch.module(e).layers if l.kind == "block"]
            if any(h % tp for h in heads):
                pruned.append(PrunedPlan(plan, f"TP_enc = {tp} does not divide the encoders' attention heads"))
                continue
            if m > num_microbatches:
                pruned.append(PrunedPlan(plan, f"m = {m} encoder pipelines exceed N_mb = {num_microbatches} "
                                               "microbatches (every pipeline needs one; optimus.md §7 point 12)"))
                continue
            ranks = []
            for p in range(llm.pipeline_parallel):
                s = p % pp
                enc_static = enc_act = 0.0
                for e in encoders:
                    layers = _stage_layers(arch.module(e).layers, pp, s)
                    enc_static += static_memory(layers, tp, dp, zero_stage, optimizer,
                                                accumulates=num_microbatches > m).total
                    # every encoder stage hands its output on (the last one to the LLM)
                    enc_act += _activation_bytes(layers, tp, encoder_recompute, dtype_bytes, encoder_tokens[e],
                                                 False, True)
                ranks.append(RankMemory(p, s, enc_static + llm_static[p], llm_act[p], llm_transient[p], enc_act))
            memory = ColocationMemory(
                paper_model=paper_model_memory(phi_enc, phi_llm, dp, llm.data_parallel, n, k),
                paper_overhead=paper_overhead_memory(phi_enc, dp, llm.data_parallel, n, k),
                ranks=tuple(ranks),
            )
            fits = min(r.fits(memory_limit, num_microbatches) for r in ranks)
            if fits < 1:
                w = memory.worst(1)
                pruned.append(PrunedPlan(plan, f"needs {w.total(1) / 1e9:.2f} GB on LLM stage {w.llm_stage} (encoder "
                                               f"stage {w.encoder_stage}) with one encoder microbatch, over the "
                                               f"limit of {memory_limit / 1e9:.2f} GB"))
                continue
            candidates.append(EncoderCandidate(plan, llm, m, memory, fits))
    return PlannerResult(llm, num_microbatches, tuple(candidates), tuple(pruned))


# ---- encoder stage times from a cost model ------------------------------------------------------


@dataclass(frozen=True)
class EncoderStageTimes:
    """Seconds of one encoder microbatch per encoder stage (``forward[s]``, ``backward[s]``),
    of one activation (or its gradient) between consecutive encoder stages (``transfer``), and
    between an encoder pipeline's last stage and the LLM's first stage, per group of
    pipelines (``to_llm[a]``, module docstring's ``a``). Several encoders are scheduled as one
    (optimus.md §3.7): their stage times add.

    ``layer_forward[s]`` and ``layer_backward[s]``, the seconds of each layer of stage ``s`` in
    forward order, are the units the fine schedule places (`loom.planner.optimus.fine`); they
    must add up to the stage's time. Left empty, a stage is one unit.

    ``kernel_forward[s]`` and ``kernel_backward[s]``, at kernel granularity, are stage ``s``'s
    kernels in the order each pass runs them (`loom.cost.kernels`): they replace the layers as
    the fine schedule's units, and also add up to the stage's time."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: float = 0.0
    to_llm: tuple[float, ...] = (0.0,)
    layer_forward: tuple[tuple[float, ...], ...] = ()
    layer_backward: tuple[tuple[float, ...], ...] = ()
    kernel_forward: tuple[tuple[Kernel, ...], ...] = ()
    kernel_backward: tuple[tuple[Kernel, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.forward or len(self.forward) != len(self.backward):
            raise OptimusPlanError(f"EncoderStageTimes: forward has {len(self.forward)} stages and backward "
                                   f"{len(self.backward)}; give one time per encoder stage in both")
        if min(self.forward + self.backward) < 0 or self.transfer < 0 or min(self.to_llm, default=0) < 0:
            raise OptimusPlanError("EncoderStageTimes: times must be non-negative seconds")
        for name, stage_times in (("layer_forward", self.forward), ("layer_backward", self.backward)):
            layers = getattr(self, name)
            if not layers:
                continue
            if len(layers) != len(stage_times):
                raise OptimusPlanError(f"EncoderStageTimes.{name} has {len(layers)} stages; give one tuple of layer "
                                       f"times per encoder stage ({len(stage_times)})")
            for s, (ls, total) in enumerate(zip(layers, stage_times)):
                if not ls or min(ls) < 0 or abs(sum(ls) - total) > 1e-9 * max(1.0, total):
                    raise OptimusPlanError(f"EncoderStageTimes.{name}[{s}] = {ls[:4]}... must be non-negative "
                                           f"layer times adding up to the stage's {total}")
        for name, stage_times in (("kernel_forward", self.forward), ("kernel_backward", self.backward)):
            kernels = getattr(self, name)
            if kernels and (len(kernels) != len(stage_times) or any(
                    not ks or min(k.seconds for k in ks) < 0
                    or abs(sum(k.seconds for k in ks) - total) > 1e-9 * max(1.0, total)
                    for ks, total in zip(kernels, stage_times))):
                raise OptimusPlanError(f"EncoderStageTimes.{name}: give per encoder stage ({len(stage_times)}) "
                                       "non-negative kernels adding up to the stage's time")

    @property
    def kernel_level(self) -> bool:
        return bool(self.kernel_forward)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def layers(self, direction: str, stage: int) -> tuple[float, ...]:
        """Seconds of the layers of ``stage`` in the order ``direction`` runs them (a backward
        runs them last layer first)."""
        if direction == "forward":
            return self.layer_forward[stage] if self.layer_forward else (self.forward[stage],)
        layers = self.layer_backward[stage] if self.layer_backward else (self.backward[stage],)
        return tuple(reversed(layers))

    def units(self, direction: str, stage: int) -> tuple[tuple[float, bool, int], ...]:
        """The fine schedule's units of ``stage`` in the order ``direction`` runs them, as
        ``(seconds, comm, layer)``: the kernels at kernel granularity, else the layers
        (compute, ``layer`` their index in forward order)."""
        if self.kernel_level:
            kernels = (self.kernel_forward if direction == "forward" else self.kernel_backward)[stage]
            return tuple((k.seconds, k.comm, k.layer) for k in kernels)
        n = len(self.layers("forward", stage))
        return tuple((d, False, i if direction == "forward" else n - 1 - i)
                     for i, d in enumerate(self.layers(direction, stage)))

    def to_llm_of(self, group: int) -> float:
        return self.to_llm[group] if len(self.to_llm) > 1 else self.to_llm[0]


def encoder_stage_times(arch: ModelArch, candidate: EncoderCandidate, cluster: Cluster,
                        work: dict[str, Workload], dtype_bytes: int = 2, recompute: str = "none",
                        kernels: bool = False) -> EncoderStageTimes:
    """`EncoderStageTimes` of ``candidate`` from loom's analytic cost model on ``cluster``, for
    one microbatch of per-encoder workload ``work`` (stages split by layer count), with each
    stage's kernels (`loom.cost.kernels`) when ``kernels``. Transfers use the colocated ranks'
    links (`loom.cost.comm`)."""
    enc, llm = candidate.encoder, candidate.llm
    encoders = arch.encoder_names
    # a one-replica plan of the encoders at (PP_enc, TP_enc): the per-stage compute times; its
    # ranks fill nodes as the colocated TP slices do (TP_enc divides TP_llm, inside a node)
    plan = Plan([ModuleSpec(e, num_stages=enc.pipeline_parallel, tensor_parallel=enc.tensor_parallel,
                            recompute=recompute) for e in encoders] + [ModuleSpec(LLM)], num_microbatches=1)
    if cluster.num_gpus < plan.world_size:
        raise OptimusPlanError(f"cluster.num_gpus = {cluster.num_gpus} is smaller than one encoder pipeline "
                               f"({plan.world_size - 1} ranks)")
    cost = AnalyticCostModel(arch, plan, cluster, dtype_bytes=dtype_bytes)
    # several encoders' layers of a stage run as one encoder's (optimus.md §3.7), in plan order
    lf = [tuple(c.forward for e in encoders for c in cost.layer_costs(e, s, work[e]))
          for s in range(enc.pipeline_parallel)]
    lb = [tuple(c.backward for e in encoders for c in cost.layer_costs(e, s, work[e]))
          for s in range(enc.pipeline_parallel)]
    fwd, bwd = [sum(x) for x in lf], [sum(x) for x in lb]

    def message(stage: int, src: int, dst: int) -> float:
        nbytes = 0.0
        for e in encoders:
            _, hi = plan.layers_of(e, stage)
            last = arch.module(e).layers[hi - 1]
            nbytes += stage_output_bytes_per_token(last, dtype_bytes) * work[e].tokens
        return comm.p2p_time(nbytes, comm.link_for(cluster, [src, dst])) if src != dst else 0.0

    transfer = 0.0
    if enc.pipeline_parallel > 1:  # consecutive encoder stages sit on consecutive LLM stages
        transfer = max(message(s, candidate.ranks(0, s)[0], candidate.ranks(0, s + 1)[0])
                       for s in range(enc.pipeline_parallel - 1))
    last = enc.pipeline_parallel - 1
    to_llm = tuple(message(last, candidate.ranks(a * candidate.group_size, last)[0], llm.rank(0, 0, 0))
                   for a in range(candidate.groups))
    kf: tuple[tuple[Kernel, ...], ...] = ()
    kb: tuple[tuple[Kernel, ...], ...] = ()
    if kernels:
        # a stage's layers numbered across its encoders, in plan order (as ``lf``)
        def numbered(direction: str, s: int) -> tuple[Kernel, ...]:
            out, base = [], 0
            for e in encoders:
                ks = stage_kernels(cost, e, s, direction, work[e])
                out.append([dataclasses.replace(k, layer=k.layer + base) for k in ks])
                base += len(cost.layer_costs(e, s, work[e]))
            return tuple(k for ks in (out if direction == "forward" else out[::-1]) for k in ks)
        kf = tuple(numbered("forward", s) for s in range(enc.pipeline_parallel))
        kb = tuple(numbered("backward", s) for s in range(enc.pipeline_parallel))
    return EncoderStageTimes(tuple(fwd), tuple(bwd), transfer, to_llm, tuple(lf), tuple(lb), kf, kb)
