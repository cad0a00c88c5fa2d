"""Simulation scenarios: a model from published configs, a cluster, a data mix and one or more
plans, played by the simulator (what ``loom simulate`` runs).

The Megatron-style and frozen-aware plans that ``loom simulate --compare`` sets side by side
are built by `loom.planner.baselines` (the planner sits above the simulator).

Workloads are derived from sample metadata only: an encoder's microbatch work is its items'
token counts, the LLM's is each sample's sequence length after the encoders' tokens are merged
in (packed by default, as large-scale trainers do; ``padded`` mirrors loom's CPU runtime).

A plan also runs under a balancing policy (`Scenario.run_balanced`, `loom.balance.policy`): the
global batch's per-sample costs give a `BatchLayout`, the schedule is built with it (routed
encoder-to-LLM edges, Entrain's split backward), and each slot's workload, per phase, comes from
the samples that slot holds in that phase. The step then starts with the dispatcher's cost
(`Scenario.dispatch_cost`, `loom.sim.dispatch`): the metadata all-gather, the policy's decision
and the payload all-to-alls over the cluster's intra- and inter-node links, so a policy's cost
shows next to its gain.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch import ModelArch
from loom.cost.model_configs import load_model_arch
from loom.cost.hardware import Cluster, get_gpu
from loom.cost.memory import DTYPE_BYTES
from loom.cost.model import MicrobatchWork, Workload
from loom.cost.workload import WorkloadError, sample_work
from loom.data.sample import SampleMeta
from loom.data.synthetic import MIXES, SampleKind, SyntheticMetadata
from loom.plan.overrides import ConfigError, apply_override, typed_value
from loom.plan.plan import RECOMPUTE_MODES, Plan, PlanError
from loom.schedule.generators import build_schedule
from loom.schedule.layout import token_budget_sizes
from loom.sim.bubble_fill import fill_bubbles
from loom.balance.payload import layout_payload_bytes, sample_payload_bytes
from loom.cost.workload import MetadataArrays
from loom.sim.dispatch import DispatchCost, Links, decision_seconds_model, metadata_bytes, price_dispatch
from loom.sim.loads import PhaseLoads, phase_loads
from loom.sim.simulator import SimResult, simulate

if TYPE_CHECKING:
    from loom.schedule.layout import BatchLayout
    from loom.sim.sharing import CoreSharing
    from loom.balance.policy import BalanceConfig

class ScenarioError(WorkloadError, ConfigError):
    """A bad simulation scenario; the message names the field and the fix."""


@dataclass
class ParallelDegrees:
    """The degrees the automatic plans use: the LLM's TP and DP (encoders get the same DP, and
    ``encoder_tensor_parallel``), microbatches per pipeline, schedule, memory options."""

    tensor_parallel: int = 8
    data_parallel: int = 8
    context_parallel: int = 1
    encoder_tensor_parallel: int | None = None  # None: the LLM's
    microbatches_per_pipeline: int = 64
    schedule: str = "1f1b"
    # the LLM's model chunks per pipeline position (interleaved 1F1B, optimus.md §3.11); 1: none
    virtual_stages: int = 1
    zero_stage: int = 1
    recompute: str = "full"  # ModuleSpec.recompute of every module: "none", "selective" or "full"


@dataclass
class Scenario:
    name: str
    arch: ModelArch
    cluster: Cluster
    mix: str = "llava"
    # [data.kinds.<name>]: a custom mix (`SampleKind` fields and a weight per kind); mix is then "custom"
    kinds: dict[str, tuple[float, SampleKind]] | None = None
    seed: int = 0
    global_batch_size: int = 1024
    llm_batching: str = "packed"  # or "padded"
    degrees: ParallelDegrees = field(default_factory=ParallelDegrees)
    plans: dict[str, Plan] = field(default_factory=dict)  # explicit plans from the file
    # as in a run's config: run.dtype (activations and messages; weights, gradients and optimizer
    # state are fp32 either way) and optim.max_grad_norm (> 0: the clipping norm's all-reduce)
    dtype: str = "bf16"
    max_grad_norm: float = 0.0
    generation_size: int = 512  # data.generation_size: the side of the images generation requests ask for
    microbatch_tokens: int = 0  # data.microbatch_tokens: a token budget per microbatch, as a run's (0: off)
    # cost.efficiency: one achieved fraction of the peak for every GEMM and attention kernel;
    # None prices GEMMs by shape (`loom.cost.gemm`)
    efficiency: float | None = None
    # cost.tp_comm_overlap: price TP collectives hidden under compute (Megatron-LM's
    # --tp-comm-overlap); loom's own runtime does not overlap them (`AnalyticCostModel`)
    tp_comm_overlap: bool = False
    search: dict[str, Any] = field(default_factory=dict)  # [search]: the planner's space (loom plan --search)

    def cost_model(self, plan: Plan) -> AnalyticCostModel:
        """The analytic cost model of ``plan`` on this cluster at the scenario's ``run.dtype`` and
        ``cost.efficiency``."""
        return AnalyticCostModel(self.arch, plan, self.cluster, dtype_bytes=DTYPE_BYTES[self.dtype],
                                 efficiency=self.efficiency, tp_comm_overlap=self.tp_comm_overlap)

    # ---- data -----------------------------------------------------------------------------
    def metas(self, step: int = 0) -> list[SampleMeta]:
        """The metadata of iteration ``step``'s global batch: samples ``step * B .. (step + 1) * B - 1``
        of the mix's deterministic stream."""
        patch = next((m.patch for m in self.arch.modules.values() if m.kind == "vision"), 14)
        rate = next((m.sample_rate for m in self.arch.modules.values() if m.kind == "audio"), 16000)
        gen = next(iter(self.arch.generator_names), "image")
        stream = SyntheticMetadata(self.kinds or self.mix, seed=self.seed, patch_size=patch, sample_rate=rate,
                                   generation_size=self.generation_size, generator=gen)
        first = step * self.global_batch_size
        return [stream.meta(i) for i in range(first, first + self.global_batch_size)]

    def batch_work(self, metas: list[SampleMeta], num_microbatches: int, multiple: int = 1) -> list[MicrobatchWork]:
        """The batch's microbatches as ``loom train`` cuts it: under ``data.microbatch_tokens``
        contiguous microbatches within the budget (at least ``num_microbatches``, a multiple of
        ``multiple``: `loom.schedule.layout.token_budget_sizes`), else `microbatch_work`."""
        if not self.microbatch_tokens:
            return self.microbatch_work(metas, num_microbatches)
        sizes = self.token_budget_sizes(metas, num_microbatches, multiple)
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        return [sample_work(self.arch, metas[bounds[k]:bounds[k + 1]], self.llm_batching) for k in range(len(sizes))]

    def token_budget_sizes(self, metas: list[SampleMeta], num_microbatches: int = 1, multiple: int = 1) -> np.ndarray:
        """`loom.schedule.layout.token_budget_sizes` of the batch under ``data.microbatch_tokens``."""
        from loom.balance.costs import sample_costs

        try:
            return token_budget_sizes(sample_costs(self.arch, metas).llm_lengths, self.microbatch_tokens,
                                      num_microbatches, multiple)
        except ValueError as e:
            raise ScenarioError(str(e)) from e

    def microbatch_work(self, metas: list[SampleMeta], num_microbatches: int) -> list[MicrobatchWork]:
        if len(metas) < num_microbatches:
            raise ScenarioError(
                f"data.global_batch_size = {len(metas)} is smaller than the plan's {num_microbatches} "
                "microbatches: raise the batch size or lower microbatches_per_pipeline"
            )
        base, extra = divmod(len(metas), num_microbatches)
        work, start = [], 0
        for j in range(num_microbatches):
            size = base + (1 if j < extra else 0)
            work.append(sample_work(self.arch, metas[start:start + size], self.llm_batching))
            start += size
        return work

    def layout_work(self, metas: list[SampleMeta], layout: "BatchLayout") -> list[MicrobatchWork]:
        """Per slot, per phase, the workload of the samples the slot holds *in that phase*
        (``work[j][m]`` from ``layout.slots[m][j]``), batched as ``llm_batching`` says."""
        work: list[MicrobatchWork] = [{} for _ in range(layout.num_microbatches)]
        for phase, slots in layout.slots.items():
            for j, slot in enumerate(slots):
                work[j][phase] = sample_work(self.arch, [metas[s] for s in slot], self.llm_batching)[phase]
        return work

    def per_sample_work(self, metas: list[SampleMeta]) -> list[MicrobatchWork]:
        """Each sample's own workload (what a routed message or a backward part costs)."""
        return [sample_work(self.arch, [m], self.llm_batching) for m in metas]

    def layer_costs(self, plan: Plan, work: list[MicrobatchWork]) -> dict[str, list[float]]:
        """Frozen-aware per-layer ``T_l = F + B_w + B_d (+ R)`` (cornstarch.md §3.2.2 eqs. 3.1-3.3)
        of the mean microbatch, in seconds, from the analytic model at the plan's TP/CP: the
        partitioner's input."""
        one_stage = copy.deepcopy(plan)
        for m in one_stage.modules:
            m.num_stages, m.stage_boundaries, m.virtual_stages = 1, None, 1
        one_stage.resolve(self.arch.layer_counts(), generators=self.arch.generator_names)
        model = self.cost_model(one_stage)
        n = len(work)
        mean = {
            name: Workload(*(round(sum(getattr(w.get(name, Workload()), f) for w in work) / n)
                            for f in ("tokens", "attn_sq", "segments")))
            for name in self.arch.module_names
        }
        # the analytic model's backward is already frozen-aware (B_w only if trainable, B_d only
        # if something trainable lies at or before the layer) and includes recomputation
        return {
            name: [c.forward + c.backward for c in model.module_layer_costs(name, mean[name])]
            for name in self.arch.module_names
        }

    # ---- simulation -----------------------------------------------------------------------
    def run(self, plan: Plan, work: list[MicrobatchWork] | None = None, *, layout: "BatchLayout | None" = None,
            sample_work: list[MicrobatchWork] | None = None, dispatch: DispatchCost | None = None) -> SimResult:
        """Simulate one iteration of ``plan`` on ``work`` (default: the first global batch cut
        into equal-count microbatches). With a ``layout``, ``work`` is per slot and phase
        (`layout_work`) and ``sample_work`` per sample (`per_sample_work`); ``dispatch``
        (`dispatch_cost`) runs before the schedule."""
        return self._run(plan, work, layout, sample_work, dispatch=dispatch)[0]

    def dispatch_cost(self, plan: Plan, metas: list[SampleMeta], layout: "BatchLayout",
                      policies: dict[str, str] | str = "none", decision_seconds: float | None = None) -> DispatchCost:
        """What the dispatcher of ``loom train`` pays for this batch and layout on the cluster
        (`loom.sim.dispatch`): the metadata all-gather over the plan's ranks, the decision
        (``decision_seconds``, default `decision_seconds_model` of ``policies``) and one payload
        all-to-all per phase over the cluster's intra- and inter-node links. A layout that
        OrchMLLM's node-wise rearrangement permuted (``balance.ranks_per_node``) moves fewer
        bytes across nodes, and costs less here."""
        world = plan.world_size
        if decision_seconds is None:
            decision_seconds = decision_seconds_model(policies, len(metas))
        sizes = sample_payload_bytes(self.arch, MetadataArrays.from_metas(metas))
        payload = layout_payload_bytes(plan, layout, sizes, True, world)
        unpermuted = None
        if getattr(layout, "unpermuted_slot", None):  # node-wise rearrangement ran: price it without, too
            unpermuted = layout_payload_bytes(plan, layout, sizes, False, world)
        return price_dispatch(world, self.dispatch_links(), metadata_bytes=metadata_bytes(metas, world),
                              decision_seconds=decision_seconds, payload=payload, payload_unpermuted=unpermuted,
                              host_seconds=self.dispatch_host_seconds(len(metas), world))

    def dispatch_links(self) -> Links:
        """The links the dispatcher's collectives take: the cluster's intra- and inter-node links."""
        return Links.of_cluster(self.cluster)

    def dispatch_host_seconds(self, batch_size: int, world_size: int) -> float | list[float]:
        """The dispatcher's own CPU work per rank and step: not measured for a cluster (0)."""
        return 0.0

    def core_sharing(self, plan: Plan) -> "CoreSharing | None":
        """Ranks sharing a host's cores (`loom.sim.sharing`): none on a cluster, a device per rank."""
        return None

    def _run(self, plan: Plan, work: list[MicrobatchWork] | None, layout: "BatchLayout | None",
             sample_work: list[MicrobatchWork] | None, eager: int = 0,
             dispatch: DispatchCost | None = None) -> tuple[SimResult, AnalyticCostModel]:
        plan.resolve(self.arch.layer_counts(), generators=self.arch.generator_names)
        if plan.world_size > self.cluster.num_gpus:
            raise ScenarioError(
                f"plan needs {plan.world_size} GPUs but cluster.num_gpus = {self.cluster.num_gpus}; raise "
                f"cluster.num_gpus or lower the plan's degrees (stages x data x tensor x context parallel)"
            )
        if work is None:
            if layout is not None:
                raise ScenarioError("Scenario.run with a layout needs its per-slot work (Scenario.layout_work)")
            if self.microbatch_tokens:  # the batch as loom train cuts it: a layout of the budget's microbatches
                return self._run(plan, *self._budget_inputs(plan), eager=eager, dispatch=dispatch)
            work = self.microbatch_work(self.metas(), plan.num_microbatches)
        cost = self.cost_model(plan)
        # frozen stages run no backward
        schedule = build_schedule(plan, self.trainable_stages(plan), layout=layout, eager=eager)
        if plan.bubble_fill == "optimus":  # the encoders' work moved into the LLM's bubbles, as loom train runs it
            run_plan = plan if layout is None else dataclasses.replace(plan, num_microbatches=layout.num_microbatches)
            schedule = fill_bubbles(schedule, run_plan, cost, work, sample_work).schedule
        result = simulate(schedule, plan, cost, work, num_samples=self.global_batch_size, sample_work=sample_work,
                          dispatch=dispatch, clip=self.max_grad_norm > 0, sharing=self.core_sharing(plan))
        return result, cost

    def _budget_inputs(self, plan: Plan) -> tuple[list[MicrobatchWork], "BatchLayout", list[MicrobatchWork]]:
        """Per-slot work, layout and per-sample work of the first batch under ``data.microbatch_tokens``."""
        from loom.balance.policy import BalanceConfig, make_layout, sample_costs

        metas = self.metas()
        layout = make_layout(BalanceConfig(), plan, sample_costs(self.arch, metas), self.llm_batching,
                             self.microbatch_tokens)
        return self.layout_work(metas, layout), layout, self.per_sample_work(metas)

    def run_balanced(self, plan: Plan, balance: "BalanceConfig | str", step: int = 0,
                     metas: list[SampleMeta] | None = None, *, dispatch: bool = True,
                     decision_seconds: float | None = None) -> "BalancedRun":
        """Simulate iteration ``step`` of ``plan`` under a balancing policy (a `BalanceConfig` or
        a policy name for every phase): per-sample costs of the global batch (`sample_costs`),
        the layout (`make_layout`), the schedule built with it, and each slot's workload per
        phase from the samples it holds there. ``metas`` overrides the drawn batch. With
        ``dispatch`` (the default, as ``loom train`` always dispatches) the step starts with the
        dispatcher's cost (`dispatch_cost`, ``decision_seconds`` measured or modelled), so a
        policy's cost shows next to its gain (``result.dispatch``)."""
        from loom.balance.policy import BalanceConfig, make_layout, sample_costs

        config = BalanceConfig(default=balance) if isinstance(balance, str) else balance
        plan.resolve(self.arch.layer_counts(), generators=self.arch.generator_names)
        metas = self.metas(step) if metas is None else metas
        layout = make_layout(config, plan, sample_costs(self.arch, metas), self.llm_batching, self.microbatch_tokens)
        work = self.layout_work(metas, layout)
        cost_of_dispatch = None
        if dispatch:
            cost_of_dispatch = self.dispatch_cost(plan, metas, layout, config.summary(plan.module_names),
                                                  decision_seconds)
        result, cost = self._run(plan, work, layout, self.per_sample_work(metas), eager=config.eager_forward,
                                 dispatch=cost_of_dispatch)
        return BalancedRun(policy_label(config, plan.module_names), config.order, layout, result,
                           phase_loads(plan, cost, work), work)

    def trainable_stages(self, plan: Plan) -> dict[tuple[str, int], bool]:
        out = {}
        for m in plan.modules:
            layers = self.arch.module(m.name).layers
            for s in range(m.num_stages):
                lo, hi = plan.layers_of(m.name, s)
                out[(m.name, s)] = any(layer.trainable for layer in layers[lo:hi])
        return out

    def memory_capacity(self) -> float:
        return float(self.cluster.spec.hbm_bytes)


@dataclass
class BalancedRun:
    """One simulated iteration under a balancing policy: ``policy`` names it (one name, or
    ``phase=name`` pairs when phases differ), ``layout`` is what the policy decided, ``work[j][m]``
    slot ``j``'s workload in phase ``m``, ``loads`` the per-phase balance figures."""

    policy: str
    order: str
    layout: "BatchLayout"
    result: SimResult
    loads: PhaseLoads
    work: list[MicrobatchWork]

    def summary(self) -> dict[str, Any]:
        """The simulator's summary plus ``policy``, ``order``, the layout's microbatch count and
        ``load_max_over_mean`` (``dp`` and ``microbatch``, per phase)."""
        return {**self.result.summary(), "policy": self.policy, "order": self.order,
                "layout_microbatches": self.layout.num_microbatches, "load_max_over_mean": self.loads.summary()}


def policy_label(config: "BalanceConfig", phases: list[str]) -> str:
    chosen = config.summary(phases)
    names = set(chosen.values())
    return names.pop() if len(names) == 1 else ",".join(f"{p}={n}" for p, n in chosen.items())


# ---- loading --------------------------------------------------------------------------------
def load_scenario(path: str | Path, overrides: typing.Sequence[str] = ()) -> Scenario:
    """A scenario from TOML: ``[model]`` (llm, encoders, projector, freeze, generators),
    ``[cluster]`` (gpu, num_gpus, gpus_per_node), ``[data]`` (mix, seed, global_batch_size,
    llm_batching, generation_size, microbatch_tokens, and ``[data.kinds.<name>]`` tables
    describing a custom mix),
    ``[parallel]`` (`ParallelDegrees`), ``[run]`` (dtype, as a run's: "bf16", the default, or
    "fp32"), ``[cost]`` (efficiency: one achieved fraction of the peak for every kernel, instead of
    GEMMs priced by shape), ``[search]`` (the space of ``loom plan --search``,
    `loom.planner.search.SearchSpace`), ``[optim]`` (max_grad_norm, as a run's: > 0 prices the clipping norm's all-reduce)
    and optional ``[plans.<name>]`` tables in the plan format (or ``plans.<name> = "@path"`` of a
    plan file).
    ``overrides`` (``dotted.key=value``, `loom.plan.overrides`) apply to those tables first; every
    value, the file's and the overrides', passes `check_scenario_tables`, so this API refuses what
    ``loom simulate`` refuses."""
    p = Path(path)
    data = read_scenario_tables(p)
    for item in overrides:
        try:
            apply_override(data, item)
        except ConfigError as e:  # as a ScenarioError: everything this API refuses is one
            raise ScenarioError(str(e)) from e
    return scenario_from_dict(data, p.stem)


def read_scenario_tables(path: Path) -> dict[str, Any]:
    """The parsed TOML tables of a scenario file (`load_scenario` without building it)."""
    if not path.is_file():
        raise ScenarioError(f"scenario file {str(path)!r} does not exist; see configs/sim/ for examples")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ScenarioError(f"scenario file {str(path)!r} is not valid TOML: {e}; fix the file (configs/sim/ "
                            f"holds examples)") from e


def _schema() -> dict[str, Any]:
    """Each section's fields and types (``plans`` are checked by `Plan.from_dict` and `Plan.resolve`)."""
    return {
        "name": str,
        "model": {"llm": str, "encoders": dict[str, str], "projector": str, "freeze": list[str],
                  "generators": dict[str, str]},
        "cluster": {"gpu": str, "num_gpus": int, "gpus_per_node": int},
        "data": {"mix": str, "seed": int, "global_batch_size": int, "llm_batching": str, "generation_size": int,
                 "microbatch_tokens": int, "kinds": dict[str, dict]},
        "parallel": typing.get_type_hints(ParallelDegrees),
        "run": {"dtype": str},
        "optim": {"max_grad_norm": float},
        "cost": {"efficiency": float, "tp_comm_overlap": bool},
        # the planner's space (`loom.planner.search.SearchSpace`, which checks the choices)
        "search": {"placements": list[str], "tensor_parallel": list[int], "context_parallel": list[int],
                   "zero_stages": list[int], "recompute": list[str], "microbatch_samples": list[int],
                   "schedules": list[str], "orchestrations": int, "cornstarch": int, "entrain": int, "policies": list[str],
                   "simulate_top": int, "simulate_budget": int},
        "plans": dict[str, dict],
    }


# whole numbers that may be 0 (the others are sizes and counts, at least 1)
_ZERO_OK = {"data.seed", "parallel.zero_stage", "search.orchestrations", "search.cornstarch", "search.entrain",
            "data.microbatch_tokens"}
_CHOICES = {"data.llm_batching": ("packed", "padded"), "parallel.zero_stage": (0, 1, 2, 3),
            "parallel.recompute": RECOMPUTE_MODES, "run.dtype": tuple(DTYPE_BYTES)}


def check_scenario_tables(data: dict[str, Any]) -> None:
    """Sections, fields, types, ranges and choices of a scenario's tables: what `load_scenario`
    and ``loom simulate`` refuse alike, each with one `ScenarioError` naming the field and the fix."""
    schema = _schema()
    unknown = sorted(set(data) - set(schema))
    if unknown:
        raise ScenarioError(f"unknown section(s) {unknown} in the scenario; known: {sorted(schema)}; remove or "
                            f"rename them")
    try:
        for section, value in data.items():
            spec = schema[section]
            if not isinstance(spec, dict):
                typed_value(spec, value, section)
                continue
            if not isinstance(value, dict):
                raise ScenarioError(f"{section} = {value!r}: must be a table; write [{section}] with key = value lines")
            extra = sorted(set(value) - set(spec))
            if extra:
                raise ScenarioError(f"unknown field(s) {extra} in [{section}]; known: {sorted(spec)}; remove or "
                                    f"rename them")
            for key, v in value.items():
                where = f"{section}.{key}"
                if where == "parallel.recompute" and isinstance(v, bool):  # the old boolean
                    raise ScenarioError(f'parallel.recompute = {str(v).lower()}: use one of "none", "selective" or '
                                        f'"full" (the old boolean: {str(v).lower()} is now "{"full" if v else "none"}")')
                v = typed_value(spec[key], v, where)
                low = 0 if where in _ZERO_OK else 1
                if isinstance(v, int) and not isinstance(v, bool) and v < low:
                    raise ScenarioError(f"{where} = {v}: must be at least {low}; use a "
                                        f"{'non-negative' if low == 0 else 'positive'} whole number")
                if where == "cost.efficiency" and not 0 < v <= 1:
                    raise ScenarioError(f"{where} = {v!r}: is the achieved fraction of the GPU's peak; use a number "
                                        f"in (0, 1] such as 0.5, or leave it out to price GEMMs by shape")
                if where == "optim.max_grad_norm" and not (v >= 0 and v != float("inf")):
                    raise ScenarioError(f"{where} = {v!r}: is a gradient-norm threshold; use 0 for no clipping or a "
                                        f"positive norm such as 1.0")
                if where in _CHOICES and v not in _CHOICES[where]:
                    raise ScenarioError(f"{where} = {v!r}: unknown value; choose one of {list(_CHOICES[where])}")
    except ScenarioError:
        raise
    except ConfigError as e:  # a wrong type, from typed_value
        raise ScenarioError(str(e)) from e


def scenario_from_dict(data: dict[str, Any], default_name: str) -> Scenario:
    """A scenario from the tables of a scenario file (`load_scenario`), already parsed (and, in
    ``loom simulate``, overridden); every value is checked first (`check_scenario_tables`)."""
    check_scenario_tables(data)
    try:
        return _scenario_of_tables(data, default_name)
    except ScenarioError:
        raise
    except ValueError as e:  # from the model configs and GPU tables; the message names the field
        raise ScenarioError(str(e)) from e
    except TypeError as e:  # a value of the right type in the wrong place (e.g. a plan field)
        raise ScenarioError(f"scenario {default_name}: {e}; check the file and the overrides against "
                            f"configs/sim/") from e


def _custom_kinds(tables: dict[str, dict]) -> dict[str, tuple[float, SampleKind]]:
    """``[data.kinds.<name>]``: ``weight`` (relative, > 0) and any `SampleKind` field per kind;
    ranges are ``[low, high]`` pairs."""
    hints = typing.get_type_hints(SampleKind)
    out = {}
    for name, table in tables.items():
        where = f"data.kinds.{name}"
        if not isinstance(table, dict):
            raise ScenarioError(f"{where} = {table!r}: must be a table of SampleKind fields and a weight")
        unknown = sorted(set(table) - set(hints) - {"weight"})
        if unknown:
            raise ScenarioError(f"unknown field(s) {unknown} in [{where}]; known: {sorted([*hints, 'weight'])}")
        weight = typed_value(float, table.get("weight", 1.0), f"{where}.weight")
        if not weight > 0:
            raise ScenarioError(f"{where}.weight = {weight}: must be positive")
        fields = {}
        for key, value in table.items():
            if key == "weight":
                continue
            if hints[key] is float or hints[key] is int:
                v = typed_value(hints[key], value, f"{where}.{key}")
                if v < 0:
                    raise ScenarioError(f"{where}.{key} = {v}: must not be negative")
            else:  # a [low, high] range
                if not (isinstance(value, list) and len(value) == 2):
                    raise ScenarioError(f"{where}.{key} = {value!r}: give a [low, high] pair")
                item = typing.get_args(hints[key])[0]
                v = tuple(typed_value(item, x, f"{where}.{key}") for x in value)
                if not 0 <= v[0] <= v[1]:
                    raise ScenarioError(f"{where}.{key} = {list(v)}: need 0 <= low <= high")
            fields[key] = v
        out[name] = (weight, SampleKind(**fields))
    if not out:
        raise ScenarioError("[data.kinds] is empty: describe at least one kind of sample")
    return out


def _scenario_of_tables(data: dict[str, Any], default_name: str) -> Scenario:
    model = data.get("model", {})
    if "llm" not in model:
        raise ScenarioError("model.llm is missing: name a config in configs/models/ (e.g. 'llama3-70b')")
    arch = load_model_arch(model["llm"], model.get("encoders", {}), model.get("projector"), model.get("freeze", []),
                           model.get("generators", {}))
    cl = data.get("cluster", {})
    if "gpu" not in cl or "num_gpus" not in cl:
        raise ScenarioError("cluster.gpu and cluster.num_gpus are required; set both (e.g. gpu = 'H100', "
                            "num_gpus = 1024)")
    get_gpu(cl["gpu"], field="cluster.gpu")
    cluster = Cluster(cl["gpu"], int(cl["num_gpus"]), int(cl.get("gpus_per_node", 8)))
    dd = data.get("data", {})
    mix = dd.get("mix", "custom" if "kinds" in dd else "llava")
    kinds = _custom_kinds(dd["kinds"]) if "kinds" in dd else None
    if kinds is not None and mix != "custom":
        raise ScenarioError(f"data.mix = {mix!r} with [data.kinds] tables: the kinds are the mix; drop data.mix "
                            f"or set it to \"custom\"")
    if kinds is None and mix not in MIXES:
        raise ScenarioError(f"data.mix = {mix!r} is unknown; choose one of {sorted(MIXES)}, or describe the samples "
                            f"in [data.kinds.<name>] tables")
    plans = {}
    for name, table in data.get("plans", {}).items():
        try:
            if isinstance(table, str) and table.startswith("@"):  # a plan file (loom plan --search writes one)
                plans[name] = Plan.read_file(table[1:], field=f"plans.{name}")
                continue
            if not isinstance(table, dict):
                raise PlanError(f"must be a table in the plan format or \"@path\" of a plan file, not {table!r}")
            plans[name] = Plan.from_dict(table)
        except (PlanError, TypeError) as e:
            raise ScenarioError(f"plans.{name}: {e}") from e
    return Scenario(
        name=data.get("name", default_name), arch=arch, cluster=cluster, mix=mix, kinds=kinds,
        seed=int(dd.get("seed", 0)),
        global_batch_size=int(dd.get("global_batch_size", 1024)), llm_batching=dd.get("llm_batching", "packed"),
        degrees=ParallelDegrees(**data.get("parallel", {})), plans=plans,
        dtype=data.get("run", {}).get("dtype", "bf16"),
        max_grad_norm=float(data.get("optim", {}).get("max_grad_norm", 0.0)),
        generation_size=int(dd.get("generation_size", 512)),
        microbatch_tokens=int(dd.get("microbatch_tokens", 0)),
        efficiency=data.get("cost", {}).get("efficiency"),
        tp_comm_overlap=bool(data.get("cost", {}).get("tp_comm_overlap", False)),
        search=dict(data.get("search", {})),
    )
