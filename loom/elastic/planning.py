"""The generations of an elastic run from the Oobleck planner (`loom.planner.oobleck`): the first
one from the node count (instantiation, oobleck.md §3.4-§3.5) and each next one after failures
(reinstantiation, §3.6; batch redistribution, §3.8)."""

from __future__ import annotations

from loom.elastic.config import ElasticConfig
from loom.elastic.layout import Generation
from loom.plan.plan import LLM, ModuleSpec, Plan


def pipeline_plan(base: Plan, encoders: list[str], num_nodes: int, samples: int, el: ElasticConfig) -> Plan:
    """A one-replica plan of ``num_nodes`` nodes: the encoders in the LLM's first stage, the LLM
    in one stage per rank, ``samples`` samples in microbatches of ``el.microbatch_size``."""
    stages = num_nodes * el.ranks_per_node
    llm = base.spec(LLM)
    modules = [ModuleSpec(e) for e in encoders] + [ModuleSpec(LLM, num_stages=stages, recompute=llm.recompute)]
    return Plan(modules, num_microbatches=max(1, -(-samples // el.microbatch_size)), schedule=base.schedule,
                placement="first_stage")


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` whole samples in proportion to ``weights`` (largest remainder)."""
    w = sum(weights)
    base = [total * x // w for x in weights]
    order = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % w))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def first_generation(base: Plan, encoders: list[str], num_ranks: int, batch: int, el: ElasticConfig) -> Generation:
    nodes = num_ranks // el.ranks_per_node
    count = el.f + 1
    sizes = _split(nodes, [1] * count)
    pipelines, at = [], 0
    for n in sizes:
        pipelines.append([r for node in range(at, at + n) for r in range(node * el.ranks_per_node,
                                                                         (node + 1) * el.ranks_per_node)])
        at += n
    return _generation(0, base, encoders, pipelines, [], batch, el)


def _generation(number: int, base: Plan, encoders: list[str], pipelines: list[list[int]], lost: list[int],
                batch: int, el: ElasticConfig) -> Generation:
    samples = _split(batch, [len(p) for p in pipelines])
    plans = [pipeline_plan(base, encoders, len(p) // el.ranks_per_node, s, el) for p, s in zip(pipelines, samples)]
    return Generation(number, pipelines, plans, samples, lost)


def next_generation(prev: Generation, lost: set[int], base: Plan, encoders: list[str], batch: int,
                    el: ElasticConfig) -> Generation:
    """The layout after ``lost`` ranks (cumulative) died (oobleck.md §3.6: simple reinstantiation,
    borrowing, merging); ``stop`` set when beyond ``f``."""
    n0 = el.min_nodes * el.ranks_per_node
    pipes = [[r for r in p if r not in lost] for p in prev.pipelines]
    survivors = sorted(r for p in pipes for r in p)
    new = [p for p in pipes if len(p) >= n0]  # (1) simple: a template of the remaining size exists
    merge: list[list[int]] = []
    for p in (p for p in pipes if 0 < len(p) < n0):
        while len(p) < n0:  # (2) borrow from the biggest pipeline that stays at n0 or more
            donors = [q for q in new if len(q) > n0]
            if not donors:
                break
            p.append(max(donors, key=len).pop())
        (new if len(p) >= n0 else merge).append(p)
    while merge:  # (3) merge what is still too small, with each other first
        p = merge.pop(0)
        while len(p) < n0 and merge:
            p += merge.pop(0)
        if len(p) < n0:
            if not new:
                break
            p += new.pop(new.index(min(new, key=len)))
        new.append(p)
    stop = ""
    if len(new) < el.f + 1:
        stop = (f"{len(survivors)} ranks left, {len(lost)} lost: they form {len(new)} pipeline(s) of at least "
                f"min_nodes = {el.min_nodes} nodes, and f = {el.f} needs {el.f + 1} (at least "
                f"{(el.f + 1) * el.min_nodes} nodes)")
    if stop:
        return Generation(prev.number + 1, [survivors], [], [], sorted(lost), stop=stop)
    new = [sorted(p) for p in new]
    new.sort(key=lambda q: (len(q), min(q)))
    return _generation(prev.number + 1, base, encoders, new, sorted(lost), batch, el)
