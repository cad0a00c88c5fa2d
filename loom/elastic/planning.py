"""The generations of an elastic run, decided by the supervisor with Oobleck's planner
(`loom.planner.oobleck`): the first from the node count (templates for every size of the node
specification, the best instantiation with Eq. 2.6's batch distribution; oobleck.md §3.2-§3.5),
each next one after failures (reinstantiation: simple, borrow, merge, §3.6; redistribution of
the same global batch, §3.8), or a stop beyond ``f`` (fewer than ``(f + 1) n0`` nodes or ``f + 1``
pipelines, or a layer whose every holder was lost: `layer_copies` refuses it).

One process per node (``ranks_per_node = 1``): a node's id is its rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from loom.elastic.config import ElasticConfig
from loom.elastic.layout import Generation
from loom.plan.plan import Plan
from loom.planner.oobleck import (Instantiation, LayerTimes, NodeSpecification, OobleckError, PipelineTemplate, best_instantiation,
                                  instantiate, layer_copies, layer_holders, node_specification, pipelines_of,
                                  plan_templates, reinstantiate, template_plan)


@dataclass
class ElasticPlanner:
    """Everything the supervisor needs to decide generations: the run's base plan (modules,
    schedule), its layer counts, the templates per node count and the batch."""

    base: Plan
    layer_counts: Mapping[str, int]
    spec: NodeSpecification
    templates: dict[int, PipelineTemplate]
    batch: int
    el: ElasticConfig

    @classmethod
    def build(cls, base: Plan, layer_counts: Mapping[str, int], times: LayerTimes, batch: int,
              el: ElasticConfig) -> "ElasticPlanner":
        """Templates for every size of the node specification from per-layer times ``times``
        (the LLM's layers; the encoders as the first stage's extra)."""
        spec = node_specification(el.nodes, el.f, el.min_nodes)
        templates = plan_templates(times, spec.template_sizes, gpus_per_node=el.ranks_per_node, tensor_parallel=1)
        return cls(base, dict(layer_counts), spec, templates, batch, el)

    def instantiation(self, gen: Generation) -> Instantiation:
        """The priced instantiation behind ``gen``'s pipelines: Eq. 2.6's samples and times,
        each pipeline's microbatches (what `_generation` built its plans from)."""
        inst = instantiate(self.templates, [len(p) for p in gen.pipelines], self.batch, self.el.microbatch_size)
        # instantiate prices sizes smallest first, the order reinstantiate returns and we keep
        assert list(inst.pipeline_sizes) == [len(p) for p in gen.pipelines]
        return inst

    def _generation(self, number: int, node_lists: list[list[int]], lost: list[int]) -> Generation:
        inst = self.instantiation(Generation(number, node_lists, [], [], lost))
        plans = [template_plan(self.templates[len(p)], self.base, m, self.layer_counts)
                 for p, m in zip(node_lists, inst.microbatches)]
        return Generation(number, [list(p) for p in node_lists], plans, list(inst.distribution.samples), lost)

    def first(self) -> Generation:
        inst = best_instantiation(self.templates, self.el.nodes, self.el.f, self.batch, self.el.microbatch_size)
        nodes = [list(p.nodes) for p in inst.pipelines(self.templates, list(range(self.el.nodes)))]
        return self._generation(0, nodes, [])

    def next(self, prev: Generation, lost: set[int]) -> Generation:
        """The layout after the cumulative ``lost`` ranks died; ``stop`` set beyond ``f``."""
        number, gone = prev.number + 1, sorted(lost)
        survivors = sorted(r for p in prev.pipelines for r in p if r not in lost)
        try:
            nodes = reinstantiate(prev.pipelines, lost, self.spec.template_sizes, self.el.f)
            num_layers = self.layer_counts["llm"]
            layer_copies(layer_holders(pipelines_of(prev.pipelines, self.templates), num_layers),
                         layer_holders(pipelines_of(nodes, self.templates), num_layers), lost)
        except OobleckError as e:
            return Generation(number, [survivors], [], [], gone, stop=f"f = {self.el.f}: {e}")
        return self._generation(number, nodes, gone)
