"""``loom plan``: print the resolved plan, each module's mesh, the rank roles with their mesh
coordinates (`loom.runtime.mesh` builds the meshes from the same layout), and the schedule.

A config with ``[elastic]`` (docs/elastic.md) runs no single plan: ``loom plan`` prints what the
elastic runtime runs first, from the same functions (`loom.train.elastic.elastic_planner`,
`loom.elastic.planning.ElasticPlanner.first`): the node specification, each pipeline template,
the first instantiation (pipelines as ranks, Eq. 2.6's samples) and each pipeline's plan and
schedule."""

from __future__ import annotations

import argparse
from pathlib import Path

from loom.cli.common import load_train_config
from loom.plan.plan import MESH_DIMS


def cmd_plan(args: argparse.Namespace) -> int:
    if args.search:
        from loom.cli.search import cmd_search
        from loom.sim.scenario import read_scenario_tables

        if args.config and Path(args.config).is_file() and "elastic" in read_scenario_tables(Path(args.config)):
            from loom.cli.common import CliError

            raise CliError(f"--search with {args.config}: its [elastic] section makes Oobleck's templates decide the "
                           f"stages; run loom plan --config {args.config} without --search to see them")

        return cmd_search(args)
    if args.cluster is not None or args.profile is not None or args.ranks is not None:
        from loom.cli.common import CliError

        raise CliError("--cluster, --profile and --ranks go with --search (loom plan --search --cluster local)")
    from loom.runtime.stage import trainable_stages
    from loom.schedule.generators import build_schedule
    from loom.schedule.validate import render, validate_schedule
    from loom.train.build import bubble_filler, build_data, build_model

    cfg = load_train_config(args)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")  # layout only
    if cfg.elastic is not None:
        return _elastic_plan(cfg, model, args.comm)
    plan = cfg.plan
    schedule = build_schedule(plan, trainable_stages(model, plan))
    if plan.bubble_fill != "none":  # the order the run executes: the fill `loom train` applies
        schedule = bubble_filler(cfg, model, dataset, plan)(schedule, plan)
    validate_schedule(schedule, plan)
    print(plan.to_toml())
    for m in plan.modules:
        print("mesh {}: ({}) = ({})".format(m.name, ", ".join(MESH_DIMS), ", ".join(map(str, plan.mesh_shape(m.name)))))
        if m.zero_stage:  # loom.runtime.zero: who shards with whom
            shard = m.shard_degree or m.data_parallel
            print(f"zero {m.name}: ZeRO-{m.zero_stage} sharded over {shard} replicas"
                  + (f", {m.data_parallel // shard} shard groups replicated (hybrid)" if shard < m.data_parallel else ""))
    _print_ranks(plan)
    print()
    print(render(schedule, communication=args.comm))
    return 0


def _print_ranks(plan, ranks: list[int] | None = None) -> None:
    """Each rank's role and mesh coordinate; ``ranks``: the global rank of each of the plan's
    (an elastic pipeline's), else the plan's own."""
    for r in range(plan.world_size):
        c = plan.coordinate_of(r)
        hosted = plan.stages_of(r)
        if len(hosted) == 1:
            where = f"{c.module} stage {c.stage} replica {c.replica}"
        elif all(m == c.module for m, _, _ in hosted):  # virtual stages
            where = f"{c.module} stages " + ", ".join(str(s) for _, s, _ in hosted) + f" (chunks) replica {c.replica}"
        else:  # encoders hosted beside the LLM's stages (first_stage, colocated)
            where = " + ".join(f"{m} stage {s} replica {d}" for m, s, d in hosted)
        name = f"rank {r}" if ranks is None else f"rank {ranks[r]} (pipeline rank {r})"
        print(f"{name} = {where}; "
              f"mesh ({', '.join(MESH_DIMS)}) = ({', '.join(map(str, c.index))})")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _elastic_plan(cfg, model, comm: bool) -> int:
    """What an ``[elastic]`` run runs first (module docstring): the supervisor's own planner and
    generation 0, each pipeline's plan and schedule as its workers build them."""
    from loom.cli.common import CliError
    from loom.planner.oobleck import OobleckError, TemplateError
    from loom.runtime.stage import trainable_stages
    from loom.schedule.generators import build_schedule
    from loom.schedule.validate import render, validate_schedule
    from loom.train.elastic import elastic_planner

    el = cfg.elastic
    try:
        planner = elastic_planner(cfg)
        gen = planner.first()
    except (OobleckError, TemplateError) as e:
        raise CliError(f"[elastic]: {e}") from e
    inst = planner.instantiation(gen)
    spec = planner.spec
    print(f"# elastic run (docs/elastic.md): {el.nodes} nodes of {el.ranks_per_node} rank(s), f = {el.f}, n0 = "
          f"{el.min_nodes}; templates of {', '.join(map(str, spec.template_sizes))} nodes (oobleck.md §3.2); "
          f"the run stops, saving, below (f + 1) x n0 = {spec.min_surviving_nodes} nodes")
    encoders = [m for m in cfg.plan.module_names if m != "llm"]
    for n, t in sorted(planner.templates.items()):
        b = t.stage_boundaries
        stages = ", ".join(f"[{b[s]}, {b[s + 1]}) {_ms(t.stage_times[s])}" for s in range(t.num_stages))
        print(f"template {n} nodes: {t.num_stages} stages, LLM layers (of {planner.layer_counts['llm']}) and F + B "
              f"per microbatch (analytic): {stages}"
              + (f" ({' + '.join(encoders)} in stage 0)" if encoders else "")
              + f"; planned {_ms(t.iteration_time)} over {t.planning_microbatches} microbatches")
    print(f"generation 0 (the best instantiation, §3.5): pipelines {gen.pipelines}; samples per step {gen.samples} "
          f"of {cfg.data.global_batch_size} (Eq. 2.6, {el.microbatch_size} per microbatch); predicted "
          + ", ".join(_ms(t) for t in inst.distribution.times) + " per pipeline")
    for i, (ranks, plan) in enumerate(zip(gen.pipelines, gen.plans)):
        schedule = build_schedule(plan, trainable_stages(model, plan))
        validate_schedule(schedule, plan)
        print()
        print(f"# pipeline {i}: ranks {ranks}, template {len(ranks)} nodes, {gen.samples[i]} samples in "
              f"{plan.num_microbatches} microbatches")
        print(plan.to_toml())
        _print_ranks(plan, ranks)
        print()
        print(render(schedule, communication=comm))
    return 0
