"""`Plan` and `ModuleSpec`: how a multimodal model is laid out over ranks (docs/architecture.md, "Plans
and schedules are data").

A plan lists, per module (encoders in graph order, then ``"llm"``), its data-parallel degree
and its pipeline stages with layer boundaries, plus the microbatching and the schedule kind.
Placement here is *disaggregated*: every module has ranks of its own and the encoders run in
parallel on disjoint ranks (Cornstarch modality parallelism, ``cornstarch.md`` §3.1).

A *pipeline unit* is one (module, pipeline position, replica): the group of
``tensor_parallel x context_parallel`` ranks that run that position's stages of one replica
together. A position hosts one stage, or ``virtual_stages`` of them (interleaved 1F1B: stage
``s`` lives on position ``s % pipeline_depth``, `ModuleSpec.hosted_stages`). Schedules (the IR)
and the simulator address units; with TP = CP = 1 a unit is a rank.

Rank layout (as Cornstarch's ``[global_stage, dp, cp, tp]`` mesh): modules in plan order, inside
a module position-major, then replica, then CP, then TP, so TP groups are contiguous ranks
(inside a node) and unit ``offset(m) + p * dp(m) + d`` owns ranks starting at
``rank_offset(m) + (p * dp(m) + d) * cp(m) * tp(m)``. Equivalently, a module's ranks reshaped
to ``MESH_DIMS`` = ``(pp, dp, cp, tp)`` sizes ``(pipeline_depth, data_parallel, context_parallel,
tensor_parallel)`` form its device mesh, and `Plan.coordinate_of` is a rank's index in it.
"""

from __future__ import annotations

import dataclasses

import json
import tomllib
from dataclasses import asdict, dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tomli_w

LLM = "llm"
MESH_DIMS = ("pp", "dp", "cp", "tp")  # a module mesh's dimension names, outermost first
SCHEDULES = ("gpipe", "1f1b", "zb-h1")  # zb-h1: zero-bubble (Qi et al.), loom.schedule.generators
# disaggregated: every module on ranks of its own; first_stage: the encoders run inside the LLM's
# first pipeline position (Megatron-LM's layout, cornstarch.md §3.1's baseline); colocated: every
# rank also hosts one replica of each encoder (OrchMLLM's and Optimus's setups, data-parallel
# encoders over all of the LLM's ranks)
PLACEMENTS = ("disaggregated", "first_stage", "colocated")
# what a colocated schedule does with the encoders' work: keep Optimus's coarse order (forwards
# first, backwards last) or move it into the LLM's pipeline bubbles (loom.sim.bubble_fill)
BUBBLE_FILLS = ("none", "optimus")
# activation checkpointing per module: nothing, the attention core of every block, or every block
RECOMPUTE_MODES = ("none", "selective", "full")


class PlanError(ValueError):
    """A plan that does not fit the world size or the model; the message names the field."""


@dataclass
class ModuleSpec:
    """One module's parallel layout.

    ``stage_boundaries`` has ``num_stages + 1`` increasing layer indices from 0 to the module's
    layer count; stage ``s`` holds layers ``[b[s], b[s+1])``. ``None`` means an even split by
    layer count, filled in by ``Plan.resolve``.
    """

    name: str
    data_parallel: int = 1
    num_stages: int = 1
    stage_boundaries: list[int] | None = None
    tensor_parallel: int = 1
    context_parallel: int = 1
    zero_stage: int = 0  # optimizer-state (1), gradient (2) and parameter (3) sharding over DP
    # ZeRO 2/3 hybrid sharding: the consecutive replicas one shard group spans (a divisor of
    # data_parallel; None = data_parallel, plain sharding); the groups replicate each other
    shard_degree: int | None = None
    recompute: str = "none"  # activation checkpointing: one of RECOMPUTE_MODES
    # model chunks per pipeline rank (Megatron's virtual pipeline, interleaved 1F1B, optimus.md
    # §3.11): the ``num_stages`` stages are dealt round-robin over ``num_stages //
    # virtual_stages`` pipeline positions, stage ``s`` on position ``s % pipeline_depth``
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        check_recompute(self.name, self.recompute)

    @property
    def pipeline_depth(self) -> int:
        """Pipeline positions (ranks along the pipeline): ``num_stages / virtual_stages``."""
        return max(1, self.num_stages // max(1, self.virtual_stages))

    def position_of(self, stage: int) -> int:
        """The pipeline position hosting ``stage`` (chunk ``stage // pipeline_depth`` there)."""
        return stage % self.pipeline_depth

    def hosted_stages(self, position: int) -> list[int]:
        """The stages of pipeline position ``position``, chunk by chunk."""
        return list(range(position, self.num_stages, self.pipeline_depth))

    @property
    def num_units(self) -> int:
        return self.data_parallel * self.pipeline_depth

    @property
    def ranks_per_unit(self) -> int:
        return self.tensor_parallel * self.context_parallel

    @property
    def num_ranks(self) -> int:
        return self.num_units * self.ranks_per_unit


class MeshCoordinate(NamedTuple):
    """Where a rank sits in its module's mesh (dimensions `MESH_DIMS`)."""

    module: str
    stage: int  # pp
    replica: int  # dp
    context: int  # cp
    tensor: int  # tp

    @property
    def index(self) -> tuple[int, int, int, int]:
        """The rank's index in its module's mesh, ordered as `MESH_DIMS`."""
        return self.stage, self.replica, self.context, self.tensor


def check_recompute(module: str, value: Any) -> None:
    """``ModuleSpec.recompute`` must be a mode name; the booleans of older configs are refused
    (not mapped), so a plan always says which checkpointing it runs."""
    if isinstance(value, str) and value in RECOMPUTE_MODES:
        return
    hint = f' (the old boolean: {str(value).lower()} is now "{"full" if value else "none"}")' if isinstance(value, bool) else ""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    raise PlanError(f"plan.modules[{module!r}].recompute = {shown}: use one of \"none\", \"selective\" "
                    f"(attention core only) or \"full\" (every block){hint}")


def check_virtual_stages(plan: "Plan", m: ModuleSpec) -> None:
    """``virtual_stages`` (interleaved 1F1B, optimus.md §3.11): it must divide the stages (every
    chunk is a stage, cut like any other: layer counts need not divide, the boundaries say
    where) and leave each replica whole rounds of ``pipeline_depth`` microbatches; what the
    runtime does not run with it yet is refused here, so the simulator refuses it too."""
    where, v = f"plan.modules[{m.name!r}]", m.virtual_stages
    if not isinstance(v, int) or v < 1:
        raise PlanError(f"{where}.virtual_stages = {v!r}: must be an integer, at least 1 (1: no interleaving)")
    if v == 1:
        return
    if m.name != LLM and plan.placement == "colocated":
        # a colocated encoder cut into chunks, all on its unit: the bubble fill moves each chunk's
        # work on its own (layer granularity, optimus.md §3.5)
        if v != m.num_stages:
            raise PlanError(f"{where}.virtual_stages = {v} with num_stages = {m.num_stages}: a colocated encoder runs "
                            f"all its stages on each unit, so virtual_stages must equal num_stages")
        return
    if m.name != LLM:
        raise PlanError(f"{where}.virtual_stages = {v}: interleaved pipelines are supported on the {LLM!r} module only "
                        f"(and chunked colocated encoders); set it to 1 on encoders")
    if m.num_stages % v:
        raise PlanError(f"{where}.virtual_stages = {v} does not divide num_stages = {m.num_stages}: the stages are "
                        f"dealt round-robin over num_stages / virtual_stages pipeline positions; make num_stages a "
                        f"multiple of {v}")
    if m.num_stages // v < 2:
        raise PlanError(f"{where}.virtual_stages = {v} with num_stages = {m.num_stages} leaves one pipeline position: "
                        f"interleaving needs at least 2 (num_stages = 2 x virtual_stages or more)")
    rounds = m.data_parallel * m.pipeline_depth
    if plan.num_microbatches % rounds:
        raise PlanError(f"plan.num_microbatches = {plan.num_microbatches} with {where}.virtual_stages = {v}: each of the "
                        f"{m.data_parallel} replicas needs a multiple of the {m.pipeline_depth} pipeline positions "
                        f"(Megatron's interleaving rule); use a multiple of {rounds}")
    if m.context_parallel > 1:
        raise PlanError(f"{where}.virtual_stages = {v} with context_parallel = {m.context_parallel} is not supported "
                        f"yet: use virtual_stages = 1 with context parallelism, or context_parallel = 1")
    if m.zero_stage >= 2:  # FSDP2 wraps one stage per rank today
        raise PlanError(f"{where}.virtual_stages = {v} with zero_stage = {m.zero_stage} is not supported yet: use "
                        f"zero_stage = 1 (optimizer-state sharding) with virtual stages, or virtual_stages = 1")
    if plan.schedule == "zb-h1":
        raise PlanError(f"plan.schedule = 'zb-h1' with {where}.virtual_stages = {v} is not supported: use "
                        f"plan.schedule = '1f1b' (interleaved 1F1B) or virtual_stages = 1")


def check_first_stage(plan: "Plan") -> None:
    """``placement = "first_stage"`` (Megatron-LM's layout): each encoder runs whole, as one
    stage, on every replica of the LLM's first pipeline position, so it takes the LLM's data
    parallelism and TP; what the runtime does not run with it yet is refused here."""
    llm = plan.spec(LLM)
    if llm.context_parallel > 1 or llm.zero_stage >= 2:
        bad = "context_parallel" if llm.context_parallel > 1 else "zero_stage"
        raise PlanError(f"plan.placement = 'first_stage' with plan.modules['llm'].{bad} = {getattr(llm, bad)} is not "
                        f"supported yet: use placement = 'disaggregated' for it")
    _check_guests(plan, "runs each encoder whole on the LLM's first pipeline position, replica for replica",
                  data_parallel=llm.data_parallel, tensor_parallel=llm.tensor_parallel, zero_stage=llm.zero_stage)


def _check_guests(plan: "Plan", how: str, only: str | None = None, **want: int) -> None:
    """Every encoder (or encoder ``only``) of a placement that hosts it on the LLM's ranks: one
    stage (colocated: one pipeline position, its stages chunks on it), no CP, and the degrees
    ``want`` gives."""
    for m in plan.modules:
        if m.name not in plan.encoder_names or (only is not None and m.name != only):
            continue
        stages = m.virtual_stages if plan.placement == "colocated" else 1
        for name, value in {"num_stages": stages, "context_parallel": 1, **want}.items():
            if getattr(m, name) != value:
                raise PlanError(f"plan.placement = {plan.placement!r} {how}: plan.modules[{m.name!r}].{name} = "
                                f"{getattr(m, name)} must be {value}, or use placement = 'disaggregated'")


def check_colocated(plan: "Plan") -> None:
    """``placement = "colocated"``: every pipeline unit of the LLM (its TP group) also runs one
    replica of each encoder, whole, at the LLM's TP degree (data parallelism over all the LLM's
    units, OrchMLLM's and Optimus's setups). Encoders with stages or a TP of their own over the
    LLM's ranks (Optimus's model planner) and an LLM with CP are refused here: the runtime does
    not run them yet."""
    llm = plan.spec(LLM)
    if llm.context_parallel > 1:
        raise PlanError(f"plan.placement = 'colocated' with plan.modules['llm'].context_parallel = "
                        f"{llm.context_parallel} is not supported yet: use placement = 'disaggregated' for it")
    if llm.zero_stage:  # the rank's one optimizer would span two data-parallel groups
        raise PlanError(f"plan.placement = 'colocated' with plan.modules['llm'].zero_stage = {llm.zero_stage} is not "
                        f"supported yet: use zero_stage = 0 with it")
    tp = llm.tensor_parallel
    for m in plan.modules:
        if m.name not in plan.encoder_names:
            continue
        if plan.lanes(m.name) > 1:  # lanes: a replica on every TP rank
            _check_guests(plan, f"runs an encoder at TP 1 beside the LLM's TP {tp} as one replica per rank "
                                f"({llm.num_units} units x {tp} lanes), each a share of its unit's items",
                          data_parallel=llm.num_units * tp, virtual_stages=1, zero_stage=0, only=m.name)
        else:
            _check_guests(plan, f"runs one replica of each encoder, whole, on every one of the LLM's {llm.num_units} "
                                f"pipeline units (TP groups of {tp}), or at TP 1 one on every rank",
                          data_parallel=llm.num_units, tensor_parallel=tp, zero_stage=0, only=m.name)


def even_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """Split ``num_layers`` into ``num_stages`` contiguous runs whose sizes differ by at most
    one; earlier stages take the extra layer."""
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


@dataclass
class Plan:
    modules: list[ModuleSpec]
    num_microbatches: int = 4
    schedule: str = "1f1b"
    placement: str = "disaggregated"
    bubble_fill: str = "none"  # one of BUBBLE_FILLS; "optimus" needs placement = "colocated"

    # ---- lookups -------------------------------------------------------------------------
    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.modules]

    @property
    def encoder_names(self) -> list[str]:
        """The modules before the LLM (encoders, in graph order)."""
        names = self.module_names
        return names[:names.index(LLM)] if LLM in names else names

    @property
    def generator_names(self) -> list[str]:
        """The modules after the LLM (generators, fed by its last stage: disttrain.md §1)."""
        names = self.module_names
        return names[names.index(LLM) + 1:] if LLM in names else []

    def without_generators(self) -> "Plan":
        """The plan of the encoders and the LLM alone (the same ranks: generators come last)."""
        if not self.generator_names:
            return self
        return dataclasses.replace(self, modules=self.modules[:self.module_names.index(LLM) + 1])

    def spec(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise PlanError(f"plan.modules has no module named {name!r}; it has {self.module_names}")

    def hosted_by_llm(self, name: str) -> bool:
        """Whether module ``name`` runs on the LLM's ranks rather than its own (``first_stage``,
        ``colocated``)."""
        return self.placement in ("first_stage", "colocated") and name in self.encoder_names

    def _owners(self) -> list[ModuleSpec]:
        """The modules with ranks of their own, in plan order."""
        return [m for m in self.modules if not self.hosted_by_llm(m.name)]

    @property
    def world_size(self) -> int:
        return sum(m.num_ranks for m in self._owners())

    def rank_offset(self, name: str) -> int:
        """The first rank of module ``name``'s block (a hosted encoder's is the LLM's: its
        replicas sit on the LLM's first position, which leads the LLM's block)."""
        self.spec(name)
        if self.hosted_by_llm(name):
            name = LLM
        offset = 0
        for m in self._owners():
            if m.name == name:
                return offset
            offset += m.num_ranks
        raise PlanError(f"plan.modules has no module named {name!r}; it has {self.module_names}")

    def rank_of(self, name: str, stage: int, replica: int, tp: int = 0, cp: int = 0) -> int:
        spec = self.spec(name)
        unit = spec.position_of(stage) * spec.data_parallel + replica
        return self.rank_offset(name) + (unit * spec.context_parallel + cp) * spec.tensor_parallel + tp

    def role_of(self, rank: int) -> tuple[str, int, int]:
        """``(module, position, replica)`` of ``rank``: its pipeline position is the first stage
        it hosts (the only one unless the module has virtual stages, `stages_of`)."""
        offset = 0
        for m in self._owners():
            if 0 <= rank < offset + m.num_ranks:
                position, replica = divmod((rank - offset) // m.ranks_per_unit, m.data_parallel)
                return m.name, position, replica
            offset += m.num_ranks
        raise PlanError(f"rank {rank} is outside the plan's world size {self.world_size}")

    def stages_of(self, rank: int) -> list[tuple[str, int, int]]:
        """Every ``(module, stage, replica)`` that ``rank`` hosts, chunk by chunk."""
        return self.stages_of_unit(self.unit_of(*self.role_of(rank)))

    def coordinate_of(self, rank: int) -> MeshCoordinate:
        """``rank``'s module and its (position, replica, context, tensor) index in that module's
        mesh: the inverse of `rank_of` (for a stage's first chunk), and the rank's `DeviceMesh`
        coordinate at runtime."""
        offset = 0
        for m in self._owners():
            if 0 <= rank < offset + m.num_ranks:
                unit_and_cp, tp = divmod(rank - offset, m.tensor_parallel)
                unit, cp = divmod(unit_and_cp, m.context_parallel)
                stage, replica = divmod(unit, m.data_parallel)
                return MeshCoordinate(m.name, stage, replica, cp, tp)
            offset += m.num_ranks
        raise PlanError(f"rank {rank} is outside the plan's world size {self.world_size}")

    def mesh_shape(self, name: str) -> tuple[int, int, int, int]:
        """Sizes of module ``name``'s mesh, ordered as `MESH_DIMS`."""
        m = self.spec(name)
        return m.pipeline_depth, m.data_parallel, m.context_parallel, m.tensor_parallel

    # ---- pipeline units (what the IR addresses) ----------------------------------------------
    @property
    def num_units(self) -> int:
        return sum(m.num_units for m in self._owners())

    def unit_of(self, name: str, stage: int, replica: int) -> int:
        if self.hosted_by_llm(name):
            self.spec(name)
            if self.placement == "colocated":  # replica r on the LLM's unit r (r // lanes: one per TP rank)
                return replica // self.lanes(name)
            return self.unit_of(LLM, 0, replica)  # on the LLM's first position, replica for replica
        offset = 0
        for m in self._owners():
            if m.name == name:
                return offset + m.position_of(stage) * m.data_parallel + replica
            offset += m.num_units
        raise PlanError(f"plan.modules has no module named {name!r}; it has {self.module_names}")

    def role_of_unit(self, unit: int) -> tuple[str, int, int]:
        """``(module, position, replica)`` of a pipeline unit: its first stage (`stages_of_unit`)."""
        offset = 0
        for m in self._owners():
            if 0 <= unit < offset + m.num_units:
                position, replica = divmod(unit - offset, m.data_parallel)
                return m.name, position, replica
            offset += m.num_units
        raise PlanError(f"unit {unit} is outside the plan's {self.num_units} pipeline units")

    def stages_of_unit(self, unit: int) -> list[tuple[str, int, int]]:
        """Every ``(module, stage, replica)`` a pipeline unit hosts, in graph order: one stage, or
        ``virtual_stages`` of them (interleaved pipelines), after the hosted encoders' on the
        LLM's first position (``first_stage``) or on every unit (``colocated``: unit ``u`` hosts
        replica ``u`` of each encoder)."""
        name, position, replica = self.role_of_unit(unit)
        guests = [e for e in self.encoder_names if self.hosted_by_llm(e)]
        if self.placement == "colocated":  # every chunk of each encoder (one, unless cut into chunks)
            hosted = [(e, s, unit * self.lanes(e)) for e in guests for s in range(self.spec(e).num_stages)]
        else:
            hosted = [(e, 0, replica) for e in guests] if position == 0 else []
        return hosted + [(name, s, replica) for s in self.spec(name).hosted_stages(position)]

    def replica_of_microbatch(self, name: str, microbatch: int) -> int:
        """Which data-parallel replica of ``name`` runs ``microbatch`` (round-robin, so edges
        between modules of different DP degrees route each microbatch explicitly). An encoder in
        lanes (`lanes`) runs each microbatch on all the replicas of one unit, each a share of
        its items: the unit's first replica names it."""
        lanes = self.lanes(name)
        if lanes > 1:
            return microbatch % (self.spec(name).data_parallel // lanes) * lanes
        return microbatch % self.spec(name).data_parallel

    def lanes(self, name: str) -> int:
        """How many replicas of module ``name`` share each pipeline unit: the LLM's TP degree for a
        colocated encoder at TP 1 beside an LLM at TP > 1 (one replica per TP rank, each
        forwarding a share of the unit's encoder microbatch, `loom.runtime.executor`), else 1."""
        if self.placement != "colocated" or name == LLM:
            return 1
        llm, spec = self.spec(LLM), self.spec(name)
        return llm.tensor_parallel if llm.tensor_parallel > 1 and spec.tensor_parallel == 1 else 1

    def item_shares(self, name: str) -> int:
        """How many ways a pipeline unit of module ``name`` splits each microbatch's items: an
        encoder in lanes (`lanes`); a generator at TP > 1, whose TP ranks each hold a whole
        replica of it and run a share of the images (DistTrain runs encoder and generator so
        inside a TP group, and Megatron-LM replicates a generator too small to shard over it,
        disttrain.md §2, §4.1); else 1."""
        if name in self.generator_names:
            return self.spec(name).tensor_parallel
        return self.lanes(name)

    def microbatches_of(self, name: str, replica: int) -> list[int]:
        """The microbatches `replica_of_microbatch` gives ``replica`` of ``name``, in order."""
        lanes = self.lanes(name)
        if replica % lanes:  # not a unit's first replica: its lanes share the leader's microbatches
            return []
        return list(range(replica // lanes, self.num_microbatches, self.spec(name).data_parallel // lanes))

    def layers_of(self, name: str, stage: int) -> tuple[int, int]:
        b = self.spec(name).stage_boundaries
        if b is None:
            raise PlanError(f"plan.modules[{name!r}].stage_boundaries is unresolved; call Plan.resolve first")
        return b[stage], b[stage + 1]

    # ---- checks --------------------------------------------------------------------------
    def resolve(self, layer_counts: dict[str, int], world_size: int | None = None,
                generators: Sequence[str] = ()) -> "Plan":
        """Check the plan against the model (``layer_counts``: module name -> number of layers;
        ``generators``: which of its modules are generators, which the plan must list after the
        LLM: a `MultimodalModel`'s ``generators``, a `ModelArch`'s ``generator_names``) and, if
        given, the world size; fill in default stage boundaries. Returns ``self``."""
        if not self.modules:
            raise PlanError("plan.modules is empty: list at least the 'llm' module")
        names = self.module_names
        if len(set(names)) != len(names):
            raise PlanError(f"plan.modules names a module twice: {names}; give each module one entry")
        if LLM not in names:
            raise PlanError(f"plan.modules has no {LLM!r} module: list the encoders, then {LLM!r}, then any generators, "
                            f"in graph order; got {names}")
        for n in names:
            if n not in layer_counts:
                raise PlanError(
                    f"plan.modules[{n!r}]: unknown module name; the model has {sorted(layer_counts)}"
                )
        missing = [n for n in layer_counts if n not in names]
        if missing:
            raise PlanError(f"plan.modules lacks {missing}: every module of the model needs a spec; add a "
                            f"[plan.modules.<name>] table for each")
        if set(self.generator_names) != set(generators):
            raise PlanError(f"plan.modules lists {names}: the modules after {LLM!r} are generators, but the model's "
                            f"generators are {sorted(generators)}; list the encoders, then {LLM!r}, then the generators, "
                            f"in graph order")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan.schedule = {self.schedule!r}: choose one of {list(SCHEDULES)}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"plan.placement = {self.placement!r}: choose one of {list(PLACEMENTS)}")
        if self.bubble_fill not in BUBBLE_FILLS:
            raise PlanError(f"plan.bubble_fill = {self.bubble_fill!r}: choose one of {list(BUBBLE_FILLS)}")
        if self.bubble_fill != "none" and self.placement != "colocated":
            raise PlanError(f"plan.bubble_fill = {self.bubble_fill!r} moves colocated encoders' work into the LLM's "
                            f"bubbles, but plan.placement = {self.placement!r}: set placement = 'colocated' or "
                            f"bubble_fill = 'none'")
        if self.num_microbatches < 1:
            raise PlanError(f"plan.num_microbatches = {self.num_microbatches}: must be at least 1")
        if self.generator_names and self.placement != "disaggregated":
            raise PlanError(f"plan.placement = {self.placement!r} with generators {self.generator_names}: generators run "
                            f"on ranks of their own after the LLM; use placement = 'disaggregated'")
        for g in self.generator_names:
            # a generator runs pipelined, data-parallel (ZeRO) and at TP as image-sharing
            # replicas (`item_shares`); the runtime and the simulator both take exactly that
            spec = self.spec(g)
            for field_, value in (("context_parallel", spec.context_parallel), ("virtual_stages", spec.virtual_stages)):
                if value > 1:
                    raise PlanError(f"plan.modules[{g!r}].{field_} = {value}: a generator runs pipelined, "
                                    f"data-parallel (with ZeRO) and over TP ranks that share its images; there is no "
                                    f"{field_} for it; set it to 1")
            if spec.tensor_parallel > 1 and spec.zero_stage >= 2:
                raise PlanError(f"plan.modules[{g!r}].zero_stage = {spec.zero_stage} with tensor_parallel = "
                                f"{spec.tensor_parallel}: a generator's TP ranks each hold it whole and share its "
                                f"images, which FSDP does not shard over; use zero_stage 0 or 1, or tensor_parallel = 1")
        for m in self.modules:
            where = f"plan.modules[{m.name!r}]"
            if m.data_parallel < 1:
                raise PlanError(f"{where}.data_parallel = {m.data_parallel}: must be at least 1")
            if m.num_stages < 1:
                raise PlanError(f"{where}.num_stages = {m.num_stages}: must be at least 1")
            for degree in ("tensor_parallel", "context_parallel"):
                if getattr(m, degree) < 1:
                    raise PlanError(f"{where}.{degree} = {getattr(m, degree)}: must be at least 1")
            if m.zero_stage not in (0, 1, 2, 3):
                raise PlanError(f"{where}.zero_stage = {m.zero_stage}: choose 0, 1, 2 or 3")
            if self.schedule == "zb-h1" and m.context_parallel > 1:  # CP's split backward is untested
                raise PlanError(f"plan.schedule = 'zb-h1' with {where}.context_parallel = {m.context_parallel} is "
                                f"not supported: use plan.schedule = '1f1b' with context parallelism")
            if m.shard_degree is not None and (m.shard_degree < 1 or m.data_parallel % m.shard_degree):
                raise PlanError(f"{where}.shard_degree = {m.shard_degree}: must divide data_parallel = "
                                f"{m.data_parallel}; choose a divisor, or leave it unset to shard over every replica")
            n_layers = layer_counts[m.name]
            check_virtual_stages(self, m)
            if m.num_stages > n_layers:
                raise PlanError(
                    f"{where}.num_stages = {m.num_stages} exceeds the module's {n_layers} layers; use at most "
                    f"{n_layers} stages"
                )
            if m.data_parallel // self.lanes(m.name) > self.num_microbatches:  # lanes share a unit's microbatches
                raise PlanError(
                    f"{where}.data_parallel = {m.data_parallel} exceeds plan.num_microbatches = "
                    f"{self.num_microbatches}: every replica needs at least one microbatch"
                )
            if m.stage_boundaries is None:
                m.stage_boundaries = even_boundaries(n_layers, m.num_stages)
            b = list(m.stage_boundaries)
            if len(b) != m.num_stages + 1:
                raise PlanError(
                    f"{where}.stage_boundaries has {len(b)} entries; {m.num_stages} stages need "
                    f"{m.num_stages + 1} (0, the cut points, {n_layers})"
                )
            if b[0] != 0 or b[-1] != n_layers:
                raise PlanError(
                    f"{where}.stage_boundaries = {b} out of range: must start at 0 and end at the "
                    f"module's layer count {n_layers}"
                )
            if any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
                raise PlanError(f"{where}.stage_boundaries = {b}: must strictly increase (no empty stage)")
        if self.placement == "first_stage":
            check_first_stage(self)
        if self.placement == "colocated":
            check_colocated(self)
        if world_size is not None and world_size != self.world_size:
            detail = " + ".join(
                f"{m.name} {m.pipeline_depth}x{m.data_parallel}x{m.tensor_parallel}x{m.context_parallel}"
                for m in self.modules
            )
            raise PlanError(
                f"plan needs {self.world_size} ranks ({detail}, pipeline x data x tensor x context "
                f"parallel) but the "
                f"world size is {world_size}: change the degrees or launch {self.world_size} processes"
            )
        return self

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        known = {"modules", "num_microbatches", "schedule", "placement", "bubble_fill"}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"plan has unknown fields {sorted(unknown)}; known fields are {sorted(known)}")
        mods = d.pop("modules", None)
        if not isinstance(mods, list):
            raise PlanError("plan.modules must be a list of module specs ([[plan.modules]] in TOML)")
        specs = []
        spec_fields = {"name", "data_parallel", "num_stages", "stage_boundaries", "tensor_parallel",
                       "context_parallel", "zero_stage", "recompute", "shard_degree", "virtual_stages"}
        for i, m in enumerate(mods):
            if not isinstance(m, dict) or "name" not in m:
                raise PlanError(f"plan.modules[{i}] must be a table with a 'name'")
            bad = set(m) - spec_fields
            if bad:
                raise PlanError(f"plan.modules[{i}] ({m['name']!r}) has unknown fields {sorted(bad)}; known: {sorted(spec_fields)}")
            specs.append(ModuleSpec(**m))
        return cls(modules=specs, **d)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        p = Path(text_or_path)
        text = p.read_text() if p.suffix == ".json" and p.exists() else str(text_or_path)
        return cls.from_dict(json.loads(text))

    @classmethod
    def read_file(cls, path: str | Path, field: str = "--plan") -> "Plan":
        """A plan file: TOML (a ``[plan]`` table, as ``loom plan --search`` writes) or JSON
        (`to_json`). ``field`` names where the path came from in the error of a missing or
        unreadable file."""
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"{field} = {str(p)!r}: no such plan file; give the path of a plan TOML "
                            f"(loom plan --search writes one)")
        try:
            if p.suffix == ".json":
                return cls.from_json(p)
            return cls.from_toml(p)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{field} = {str(p)!r}: not a valid plan file ({e}); write it as [plan] with "
                            f"[[plan.modules]] tables") from e
        except TypeError as e:  # a field of the wrong kind
            raise PlanError(f"{field} = {str(p)!r}: {e}") from e

    @classmethod
    def from_toml(cls, path: str | Path) -> "Plan":
        with open(path, "rb") as f:
            data = tomllib.load(f)
        return cls.from_dict(data.get("plan", data))

    def to_toml_table(self) -> dict[str, Any]:
        """The ``[plan]`` table as TOML data: `to_dict` without the unset fields (TOML has no
        null; an absent ``stage_boundaries`` or ``shard_degree`` reads back as None)."""
        d = self.to_dict()
        d["modules"] = [{k: v for k, v in m.items() if v is not None} for m in d["modules"]]
        return d

    def to_toml(self) -> str:
        """The plan as a TOML document with a ``[plan]`` table and ``[[plan.modules]]`` entries
        (`from_toml` and ``plan = "@file"`` in a run config read it back)."""
        return tomli_w.dumps({"plan": self.to_toml_table()})
