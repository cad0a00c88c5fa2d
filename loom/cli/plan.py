"""``loom plan``: print the resolved plan, each module's mesh, the rank roles with their mesh
coordinates (`loom.runtime.mesh` builds the meshes from the same layout), and the schedule."""

from __future__ import annotations

import argparse

from loom.cli.common import load_train_config
from loom.plan.plan import MESH_DIMS


def cmd_plan(args: argparse.Namespace) -> int:
    if args.search:
        from loom.cli.search import cmd_search

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
    for r in range(plan.world_size):
        c = plan.coordinate_of(r)
        hosted = plan.stages_of(r)
        if len(hosted) == 1:
            where = f"{c.module} stage {c.stage} replica {c.replica}"
        elif all(m == c.module for m, _, _ in hosted):  # virtual stages
            where = f"{c.module} stages " + ", ".join(str(s) for _, s, _ in hosted) + f" (chunks) replica {c.replica}"
        else:  # encoders hosted beside the LLM's stages (first_stage, colocated)
            where = " + ".join(f"{m} stage {s} replica {d}" for m, s, d in hosted)
        print(f"rank {r} = {where}; "
              f"mesh ({', '.join(MESH_DIMS)}) = ({', '.join(map(str, c.index))})")
    print()
    print(render(schedule, communication=args.comm))
    return 0
