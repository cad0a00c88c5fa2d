"""Oobleck's planning (oobleck.md §3): which pipeline templates to build, how to instantiate them
over the nodes there are, and how to re-form pipelines after nodes fail, as pure functions.

API (stable names; `loom.elastic` builds on them):

- `node_specification(num_nodes, fault_tolerance, min_nodes, memory_min_nodes=None)`: the
  template sizes ``n0 .. N - f n0`` (§3.2, Theorem 1), extended to ``2 n0 - 1`` so that Theorem
  2's merge always has a template (§3.6's precondition). `NodeSpecification`.
- `plan_templates(times, node_counts, gpus_per_node, tensor_parallel=...)`: the fastest
  `PipelineTemplate` per node count (§3.3, Eqs. 2.1-2.4), exact; `LayerTimes` holds the
  per-layer costs (`loom.planner.oobleck_costs.layer_times` reads them off loom's cost models).
- `template_plan(template, base, num_microbatches)`: the loom `Plan` of one pipeline replica
  built from a template (``data_parallel = 1``), which a `ParallelEngine` runs.
- `enumerate_instantiations(template_sizes, num_nodes, fault_tolerance)`: every feasible
  ``X = (x_0, .., x_{p-1})`` (Eq. 2.5, §3.4, with the ``f + 1`` filter), in the DP's order.
- `distribute_batch` (`loom.balance.oobleck`, Eq. 2.6): samples per pipeline, exactly;
  `instantiate(templates, pipeline_sizes, B, b)` prices given pipelines with it.
- `best_instantiation(templates, num_nodes, fault_tolerance, global_batch, microbatch_size)`:
  the ``X`` of highest throughput with its batch distribution (§3.5). `Instantiation`.
- `reinstantiate(pipelines, lost_nodes, template_sizes, fault_tolerance)`: the new pipelines as
  lists of node ids after failures (§3.6: simple, borrow, merge, the artifact's order).
- `pipelines_of(node_lists, templates)`, `layer_holders(pipelines, num_layers)` and
  `layer_copies(before, after)`: who holds each layer before and after, and what each new
  holder must copy from which surviving one (§3.7).

`loom.planner.oobleck_failures` plays failure traces over all of this (``loom simulate
--failures``, docs/elastic.md). Errors are `OobleckError` (a `ValueError`) naming the numbers: ``f`` too large for the nodes,
a node count no template set covers, fewer than ``f + 1`` pipelines left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from loom.balance.oobleck import BatchDistribution, distribute_batch
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.planner.oobleck_templates import LayerTimes, PipelineTemplate, TemplateError, plan_templates

__all__ = [
    "Instantiation", "LayerCopy", "LayerTimes", "NodeSpecification", "OobleckError", "Pipeline", "PipelineTemplate",
    "TemplateError", "best_instantiation", "distribute_batch", "enumerate_instantiations", "instantiate",
    "layer_copies", "layer_holders", "memory_min_nodes", "node_specification", "pipelines_of", "plan_templates",
    "reinstantiate", "template_plan",
]


class OobleckError(ValueError):
    """A fault-tolerance setting or a cluster that Oobleck's guarantees do not cover; the message
    names the numbers and the fix."""


# ---- node specification (§3.2) ------------------------------------------------------------------
@dataclass(frozen=True)
class NodeSpecification:
    """``template_sizes``: the consecutive node counts ``n0 ..`` to build templates for."""

    num_nodes: int
    fault_tolerance: int
    min_nodes: int
    template_sizes: tuple[int, ...]

    @property
    def min_surviving_nodes(self) -> int:
        """``(f + 1) n0``: below this Oobleck cannot keep ``f + 1`` replicas (§2.3)."""
        return (self.fault_tolerance + 1) * self.min_nodes


def memory_min_nodes(model_bytes: float, activation_bytes: float, gpu_bytes: float, gpus_per_node: int) -> int:
    """The fewest nodes that hold one pipeline: the model's states (parameters, gradients, Adam
    moments) plus one microbatch's activations through every layer, over the nodes' memory (the
    artifact's ``6 x params + activations``, with loom's memory model's bytes; oobleck.md §3.2)."""
    if gpu_bytes <= 0 or gpus_per_node < 1:
        raise OobleckError(f"gpu memory {gpu_bytes} bytes x {gpus_per_node} GPUs per node: both must be positive")
    return max(1, math.ceil((model_bytes + activation_bytes) / (gpu_bytes * gpus_per_node)))


def node_specification(num_nodes: int, fault_tolerance: int, min_nodes: int,
                       memory_min_nodes: int | None = None) -> NodeSpecification:
    """Template sizes ``n0 .. N - f n0`` (oobleck.md §3.2): any ``N'`` in ``[(f+1) n0, N]`` is then
    ``f`` pipelines of ``n0`` plus one of ``N' - f n0`` (Theorem 1, constructively). The range is
    extended to ``2 n0 - 1`` (at most ``N``) when ``N - f n0`` is below it, so that a merge of two
    pipelines short of ``n0`` (§3.6, Theorem 2: sizes ``n0 .. 2 n0 - 1``) always has a template,
    which the theorem's proof assumes. ``min_nodes`` is ``n0``: the user's, which must be at
    least ``memory_min_nodes`` (`memory_min_nodes`) when that is given."""
    N, f, n0 = num_nodes, fault_tolerance, min_nodes
    for name, value, least in (("num_nodes", N, 1), ("fault_tolerance", f, 0), ("min_nodes", n0, 1)):
        if not isinstance(value, int) or value < least:
            raise OobleckError(f"{name} = {value!r}: must be an integer of at least {least}")
    if memory_min_nodes is not None and n0 < memory_min_nodes:
        raise OobleckError(f"min_nodes = {n0} is below the {memory_min_nodes} nodes one pipeline needs in memory "
                           f"(parameters, gradients, optimizer states and activations): use min_nodes >= "
                           f"{memory_min_nodes}")
    if (f + 1) * n0 > N:
        raise OobleckError(f"fault_tolerance f = {f} needs (f + 1) x n0 = {f + 1} x {n0} = {(f + 1) * n0} nodes for "
                           f"f + 1 pipeline replicas of at least {n0} nodes, but there are {N}: use f <= {N // n0 - 1} "
                           f"or at least {(f + 1) * n0} nodes")
    top = max(N - f * n0, min(2 * n0 - 1, N))
    return NodeSpecification(N, f, n0, tuple(range(n0, top + 1)))


# ---- instantiation (§3.4, Eq. 2.5) -------------------------------------------------------------
def enumerate_instantiations(template_sizes: Sequence[int], num_nodes: int, fault_tolerance: int,
                             limit: int = 200_000) -> list[tuple[int, ...]]:
    """Every ``X`` with ``sum_j x_j n_j = N`` and ``sum_j x_j >= f + 1`` (§3.4), by Eq. 2.5's
    coin-change DP ``X(p', N') = X(p'-1, N') ++ theta(X(p', N' - n_{p'-1}), p'-1)`` (the p'-th
    template has ``n_{p'-1}`` nodes, gap G3; ``X(., 0)`` is the zero vector), in its order:
    templates ``{2, 3, 4}`` on 7 nodes give ``[(2, 1, 0), (0, 1, 1)]`` (Fig. 2.7). ``limit``
    bounds the lists (they grow like integer partitions); past it the error says so."""
    sizes = list(template_sizes)
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or sizes != sorted(set(sizes)):
        raise OobleckError(f"template_sizes = {sizes}: give increasing positive node counts")
    if num_nodes < 0:
        raise OobleckError(f"num_nodes = {num_nodes}: must be non-negative")
    p = len(sizes)
    zero = (0,) * p
    previous = [[zero]] + [[] for _ in range(num_nodes)]  # X(0, N'): only N' = 0 is reachable
    for q in range(1, p + 1):
        n, current = sizes[q - 1], []
        for total in range(num_nodes + 1):
            options = list(previous[total])
            if total >= n:
                options += [x[:q - 1] + (x[q - 1] + 1,) + x[q:] for x in current[total - n]]
            if len(options) > limit:
                raise OobleckError(f"more than {limit} ways to place {total} nodes on templates {sizes}: "
                                   f"too many to enumerate; use fewer template sizes or raise limit")
            current.append(options)
        previous = current
    return [x for x in previous[num_nodes] if sum(x) >= fault_tolerance + 1]


@dataclass(frozen=True)
class Pipeline:
    """One instantiated pipeline: a template over ``nodes`` (node ids, in stage order)."""

    template: PipelineTemplate
    nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != self.template.num_nodes:
            raise OobleckError(f"a {self.template.num_nodes}-node template placed on {len(self.nodes)} nodes "
                               f"{list(self.nodes)}")

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The global ranks (``node * gpus_per_node + local GPU``) running ``stage``."""
        node, local = self.template.stage_placement()[stage]
        M = self.template.gpus_per_node
        first = self.nodes[node] * M + local
        return tuple(range(first, first + self.template.stage_gpus[stage]))


def pipelines_of(node_lists: Sequence[Sequence[int]], templates: Mapping[int, PipelineTemplate]) -> list[Pipeline]:
    """Pipelines from node lists (as `reinstantiate` returns them): each on the template of its size."""
    out = []
    for nodes in node_lists:
        if len(nodes) not in templates:
            raise OobleckError(f"no template for a pipeline of {len(nodes)} nodes {list(nodes)}; the templates have "
                               f"{sorted(templates)} nodes")
        out.append(Pipeline(templates[len(nodes)], tuple(nodes)))
    return out


@dataclass(frozen=True)
class Instantiation:
    """One ``X`` with its pipelines (node counts, smallest first), its batch distribution and
    step time (the slowest pipeline plus the gradient sync), and throughput in samples/s."""

    counts: tuple[int, ...]
    pipeline_sizes: tuple[int, ...]
    distribution: BatchDistribution
    microbatches: tuple[int, ...]
    sync_time: float
    step_time: float
    throughput: float

    def pipelines(self, templates: Mapping[int, PipelineTemplate], node_ids: Sequence[int]) -> list[Pipeline]:
        """The pipelines over ``node_ids``, consecutive runs in order of `pipeline_sizes`."""
        if len(node_ids) != sum(self.pipeline_sizes):
            raise OobleckError(f"{len(node_ids)} node ids for pipelines of {list(self.pipeline_sizes)} nodes")
        out, start = [], 0
        for n in self.pipeline_sizes:
            out.append(Pipeline(templates[n], tuple(node_ids[start:start + n])))
            start += n
        return out


def instantiate(templates: Mapping[int, PipelineTemplate], pipeline_sizes: Sequence[int], global_batch: int,
                microbatch_size: int, *, sync_time: Callable[[tuple[int, ...]], float] | None = None,
                min_microbatches: int = 1, objective: str = "eq2.6",
                counts: tuple[int, ...] = ()) -> Instantiation:
    """Price pipelines of ``pipeline_sizes`` nodes: Eq. 2.6's distribution of ``global_batch``
    samples (`loom.balance.oobleck`, each pipeline at least ``min_microbatches`` samples, one per
    microbatch), their microbatches of ``microbatch_size`` samples (the last may be short), and
    the step time ``max_i t_i + sync_time(sizes)`` (``sync_time``: the layer-wise gradient sync
    across the pipelines, §3.9; 0 when not given)."""
    sizes = tuple(sorted(pipeline_sizes))
    missing = sorted({n for n in sizes if n not in templates})
    if missing:
        raise OobleckError(f"no template for pipelines of {missing} nodes; the templates have {sorted(templates)}")
    if microbatch_size < 1:
        raise OobleckError(f"microbatch_size = {microbatch_size}: must be at least 1 sample")
    chosen = [templates[n] for n in sizes]
    dist = distribute_batch([t.fill for t in chosen], [t.bottleneck / microbatch_size for t in chosen], global_batch,
                            [min_microbatches] * len(chosen), objective)
    sync = float(sync_time(sizes)) if sync_time is not None else 0.0
    step = dist.step_time + sync
    return Instantiation(counts, sizes, dist, tuple(-(-s // microbatch_size) for s in dist.samples), sync, step,
                         global_batch / step if step > 0 else math.inf)


def best_instantiation(templates: Mapping[int, PipelineTemplate], num_nodes: int, fault_tolerance: int,
                       global_batch: int, microbatch_size: int, *,
                       sync_time: Callable[[tuple[int, ...]], float] | None = None, min_microbatches: int = 1,
                       objective: str = "eq2.6") -> Instantiation:
    """The feasible ``X`` (`enumerate_instantiations`) of highest throughput (§3.5): each priced by
    `instantiate`; ties go to the first in Eq. 2.5's order."""
    sizes = sorted(templates)
    options = enumerate_instantiations(sizes, num_nodes, fault_tolerance)
    if not options:
        raise OobleckError(f"{num_nodes} nodes cannot form {fault_tolerance + 1} or more pipelines from templates of "
                           f"{sizes} nodes: keep at least (f + 1) x n0 = {(fault_tolerance + 1) * sizes[0]} nodes, or "
                           f"build templates up to N - f x n0 (node_specification)")
    best: Instantiation | None = None
    for x in options:
        pipeline_sizes = [n for n, k in zip(sizes, x) for _ in range(k)]
        inst = instantiate(templates, pipeline_sizes, global_batch, microbatch_size, sync_time=sync_time,
                           min_microbatches=min_microbatches, objective=objective, counts=x)
        if best is None or inst.throughput > best.throughput:
            best = inst
    return best


# ---- the loom plan of a template ---------------------------------------------------------------
def template_plan(template: PipelineTemplate, base: Plan, num_microbatches: int,
                  layer_counts: Mapping[str, int] | None = None) -> Plan:
    """The `Plan` of one pipeline instantiated from ``template``: the LLM in the template's
    stages and boundaries at its TP degree, ``data_parallel = 1``, the encoders of ``base`` whole
    inside the first stage (``placement = "first_stage"``, how a template hosts them), and
    ``base``'s schedule and recompute. Resolved against ``layer_counts`` when given. A template
    whose stages have unequal GPU counts (``tensor_parallel = "mixed"``) is refused: a plan has
    one TP degree per module."""
    t = template.tensor_parallel
    if t is None:
        raise OobleckError(f"template of {template.num_nodes} nodes has stages on {list(template.stage_gpus)} GPUs: a "
                           f"loom Plan runs one tensor_parallel degree per module; plan templates with "
                           f"tensor_parallel='uniform'")
    if base.generator_names:
        raise OobleckError(f"base plan has generators {base.generator_names}: Oobleck templates cover the encoders "
                           f"and the LLM only (placement first_stage); drop the generators")
    if num_microbatches < 1:
        raise OobleckError(f"num_microbatches = {num_microbatches}: a pipeline runs at least one microbatch")
    llm = base.spec(LLM)
    modules = [ModuleSpec(m.name, tensor_parallel=t, recompute=m.recompute) for m in base.modules
               if m.name in base.encoder_names]
    modules.append(ModuleSpec(LLM, num_stages=template.num_stages, stage_boundaries=list(template.stage_boundaries),
                              tensor_parallel=t, recompute=llm.recompute))
    schedule = base.schedule if base.schedule in ("1f1b", "gpipe") else "1f1b"
    plan = Plan(modules, num_microbatches=num_microbatches, schedule=schedule,
                placement="first_stage" if len(modules) > 1 else "disaggregated")
    if layer_counts is not None:
        try:
            plan.resolve(dict(layer_counts), template.num_nodes * template.gpus_per_node)
        except PlanError as e:
            raise OobleckError(f"the plan of the {template.num_nodes}-node template is not valid: {e}") from e
    return plan


# ---- reinstantiation after failures (§3.6) -----------------------------------------------------
def reinstantiate(pipelines: Sequence[Sequence[int]], lost_nodes: Sequence[int] | set[int],
                  template_sizes: Sequence[int], fault_tolerance: int) -> list[list[int]]:
    """The pipelines after ``lost_nodes`` fail (oobleck.md §3.6, Fig. 2.8), as node lists:

    1. *simple*: a pipeline keeps its surviving nodes if a template of that size exists (every
       size from ``n0`` up, by `node_specification`); a pipeline with none left is gone;
    2. *borrow*: a pipeline short of ``n0`` takes nodes, one at a time, from the currently
       largest pipeline (the first in order among equals) that has more than ``n0``, the
       donor's last node each time (the artifact's ``_find_biggest_pipeline``);
    3. *merge*: when no pipeline can give a node, the short pipelines are merged in order, each
       with the next short one or, when none is left, the next full one (Theorem 2: every merged
       size in ``[n0, 2 n0 - 1]`` has a template).

    Unaffected pipelines keep their nodes; the result is sorted by (size, smallest node id), the
    artifact's deterministic order. Raises `OobleckError` when fewer than ``(f + 1) n0`` nodes or
    ``f + 1`` pipelines remain (Oobleck then saves and exits, §2.5), or a size has no template."""
    sizes = sorted(set(template_sizes))
    if not sizes:
        raise OobleckError("template_sizes is empty: run node_specification first")
    n0, f = sizes[0], fault_tolerance
    lost = set(lost_nodes)
    seen = [x for p in pipelines for x in p]
    if len(seen) != len(set(seen)):
        raise OobleckError("a node appears in two pipelines: each node belongs to one pipeline")
    work = [[x for x in p if x not in lost] for p in pipelines]
    work = [p for p in work if p]
    remaining = sum(len(p) for p in work)
    if remaining < (f + 1) * n0:
        raise OobleckError(f"{remaining} nodes remain after losing {sorted(lost & set(seen))}: fewer than (f + 1) x n0 "
                           f"= {f + 1} x {n0} = {(f + 1) * n0}, so f + 1 = {f + 1} pipeline replicas cannot be kept; "
                           f"save progress and restart from a checkpoint once enough nodes are back")
    stuck = False
    for p in work:  # borrow (in pipeline order)
        while len(p) < n0:
            donors = [d for d in work if d is not p and len(d) > n0]
            if not donors:
                stuck = True
                break
            donor = max(donors, key=len)  # max keeps the first of equals
            p.append(donor.pop())
    if stuck:  # merge
        short = [p for p in work if len(p) < n0]
        full = [p for p in work if len(p) >= n0]
        while short:
            merged = short.pop(0)
            while len(merged) < n0:
                if short:
                    merged = merged + short.pop(0)
                else:
                    merged = merged + full.pop(0)  # full is non-empty: the node count check above
            full.append(merged)
        work = full
    if len(work) < f + 1:
        raise OobleckError(f"only {len(work)} pipelines can be formed from the {remaining} remaining nodes: fewer than "
                           f"f + 1 = {f + 1} replicas; save progress and restart from a checkpoint")
    uncovered = sorted({len(p) for p in work if len(p) not in sizes})
    if uncovered:
        raise OobleckError(f"pipelines of {uncovered} nodes have no template (templates: {sizes}): build templates for "
                           f"n0 .. N - f x n0 and up to 2 n0 - 1 (node_specification)")
    return sorted(work, key=lambda p: (len(p), min(p)))


# ---- layer ownership and copies (§3.7) ---------------------------------------------------------
def layer_holders(pipelines: Sequence[Pipeline], num_layers: int) -> list[list[tuple[int, ...]]]:
    """For each layer, for each pipeline (in order), the ranks of the stage holding it (a TP
    group: each rank a shard)."""
    out: list[list[tuple[int, ...]]] = [[] for _ in range(num_layers)]
    for p in pipelines:
        if p.template.stage_boundaries[-1] != num_layers:
            raise OobleckError(f"a template of {p.template.stage_boundaries[-1]} layers for a {num_layers}-layer model")
        for s in range(p.template.num_stages):
            lo, hi = p.template.stage_boundaries[s], p.template.stage_boundaries[s + 1]
            for layer in range(lo, hi):
                out[layer].append(p.stage_ranks(s))
    return out


@dataclass(frozen=True)
class LayerCopy:
    """Layer ``layer`` must be copied to the ranks ``receivers`` (a new holder group that did not
    hold it, as one group, before) from the surviving group ``source``."""

    layer: int
    receivers: tuple[int, ...]
    source: tuple[int, ...]


def layer_copies(before: Sequence[Sequence[tuple[int, ...]]], after: Sequence[Sequence[tuple[int, ...]]],
                 lost_ranks: Sequence[int] | set[int] = ()) -> list[LayerCopy]:
    """What to copy after a reinstantiation (§3.7, the artifact's ``_copy_model_states``): for each
    layer, every holder group of ``after`` (`layer_holders` of the new pipelines) that is not a
    holder group of ``before`` copies from a group of ``before`` whose ranks all survive (none in
    ``lost_ranks``), preferring one of the same size (same TP sharding), then the first. Raises
    when a layer has no surviving holder: the model state is lost (Fig. 2.2a)."""
    lost = set(lost_ranks)
    out = []
    for layer, (old, new) in enumerate(zip(before, after, strict=True)):
        old_groups = [tuple(g) for g in old]
        alive = [g for g in old_groups if not lost.intersection(g)]
        for group in (tuple(g) for g in new):
            if group in alive:
                continue
            if not alive:
                raise OobleckError(f"layer {layer} has no surviving holder (held by {old_groups}, lost ranks "
                                   f"{sorted(lost)}): its model state is gone; restart from a checkpoint")
            same = [g for g in alive if len(g) == len(group)]
            out.append(LayerCopy(layer, group, (same or alive)[0]))
    return out
