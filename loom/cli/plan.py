"""``loom plan``: print the resolved plan, the rank roles and the schedule."""

from __future__ import annotations

import argparse

from loom.cli.common import load_train_config


def cmd_plan(args: argparse.Namespace) -> int:
    from loom.runtime.stage import trainable_stages
    from loom.schedule.generators import build_schedule
    from loom.schedule.validate import render, validate_schedule
    from loom.train.build import build_data, build_model

    cfg = load_train_config(args)
    model = build_model(cfg.model, build_data(cfg)[0], seed=cfg.run.seed)
    plan = cfg.plan
    schedule = build_schedule(plan, trainable_stages(model, plan))
    validate_schedule(schedule, plan)
    print(plan.to_toml())
    for r in range(plan.world_size):
        print("rank {} = {} stage {} replica {}".format(r, *plan.role_of(r)))
    print()
    print(render(schedule, communication=args.comm))
    return 0
