"""``loom plan --search``: the planner's search (`loom.planner.search`) on a scenario TOML (the
format of ``loom simulate``, with an optional ``[search]`` table narrowing the space): a ranked
table of the plans it played and the best it only estimated, why each lost or was pruned, and
the winner written as a plan file that ``loom simulate --plan`` and ``loom train --plan`` take."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from loom.cli.common import CliError, default_config, plan_overrides

SHOWN_ESTIMATES = 8  # estimated-only rows printed below the played ones


# What a profile can price on this machine: layers timed at TP = CP = 1 and whole (no selective
# recompute); every placement, schedule, microbatch size and ZeRO stage as on a cluster, but
# Entrain's macro planning, which sizes modules with the analytic (GPU datasheet) model.
LOCAL_SPACE = {"tensor_parallel": (1,), "context_parallel": (1,), "recompute": ("none", "full"), "entrain": 0}


def cmd_search(args: argparse.Namespace) -> int:
    from loom.cli.simulate import DEFAULT_SCENARIO
    from loom.planner.search import SearchSpace, search
    from loom.sim.scenario import load_scenario

    if args.cluster == "local":
        scenario = local_scenario(args)
        space = SearchSpace(**LOCAL_SPACE)
    elif args.cluster is not None:
        raise CliError(f"--cluster {args.cluster!r} is unknown; use --cluster local (this machine, priced by its "
                       f"profile) or give a scenario TOML with --config")
    else:
        if args.profile is not None or args.ranks is not None:
            raise CliError("--profile and --ranks price this machine: use them with --cluster local")
        scenario = load_scenario(Path(args.config) if args.config else DEFAULT_SCENARIO, args.overrides)
        space = SearchSpace.from_table(scenario.search)
    result = search(scenario, space)
    out = Path(args.out) if args.out else Path("runs") / "plan" / f"{scenario.name}.toml"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(plan_file_text(scenario.name, result))
    except OSError as e:
        raise CliError(f"--out {str(out)!r}: cannot write the plan file ({e.strerror}); choose a writable path") from e
    print_search(scenario, result, out)
    return 0


def local_scenario(args: argparse.Namespace):
    """This machine as a scenario (`loom.sim.local`): the training config's model (``--config``,
    default the demo) on ``--ranks`` ranks (default: this process's cores) sharing the host, priced
    by ``--profile`` (default: where ``loom profile`` writes it for that config), on the batches
    the run's sampler draws."""
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.profile_file import ProfileError, load_profile_for
    from loom.data.sampler import GlobalBatchSampler
    from loom.runtime.local import host_cores
    from loom.sim.local import LocalScenario, local_cluster
    from loom.train.build import build_data, build_model
    from loom.train.config import load_config

    cfg = load_config(default_config(args), plan_overrides(args))
    if cfg.model.generator is not None:
        raise CliError("model.generator: loom profile does not time generator layers, so --cluster local cannot "
                       "price them; search a scenario with --config configs/sim/... instead")
    cores = host_cores()
    ranks = cores if args.ranks is None else args.ranks
    if ranks < 1:
        raise CliError(f"--ranks {ranks}: give the number of local processes to plan for (at least 1)")
    path = Path(args.profile) if args.profile else Path(cfg.run.out_dir) / cfg.run.name / "profile.json"
    if not path.is_file():
        raise CliError(f"--profile {str(path)!r}: no such file; run `loom profile` with the same config first "
                       f"(it writes {Path(cfg.run.out_dir) / cfg.run.name / 'profile.json'}) or pass --profile PATH")
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")  # shapes only
    try:
        profile = load_profile_for(path, model, cfg.run.dtype)
    except ProfileError as e:
        raise CliError(f"--profile {str(path)!r}: {e}") from e
    sampler = GlobalBatchSampler(len(dataset), cfg.data.global_batch_size, seed=cfg.run.seed)
    return LocalScenario(
        name=f"{cfg.run.name}-local{ranks}", arch=arch_from_model(model),
        cluster=local_cluster(profile, ranks, memory_bytes()), mix="the run's data",
        global_batch_size=cfg.data.global_batch_size, llm_batching="packed" if cfg.data.pack_sequences else "padded",
        dtype=cfg.run.dtype, max_grad_norm=cfg.optim.max_grad_norm, microbatch_tokens=cfg.data.microbatch_tokens,
        profile=profile, batches=lambda step: [dataset.meta(i) for i in sampler.batch(step)], cores=cores)


def memory_bytes() -> float:
    """This machine's physical memory (the ranks share it)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_file_text(scenario: str, result) -> str:
    best = result.best
    head = [f"# loom plan --search on scenario {scenario!r}: {best.layout}",
            f"# simulated iteration {best.iteration_time:.4f} s"
            + (f" under the {best.policy!r} balancing policy (set balance.default = {best.policy!r} in the run's config)"
               if best.policy != "none" else ""),
            f"# techniques: {', '.join(result.techniques)}", ""]
    return "\n".join(head) + best.plan.to_toml()


def print_search(scenario, result, out: Path) -> None:
    world, peak = scenario.cluster.num_gpus, scenario.cluster.spec.peak_bf16_flops
    print(f"{scenario.name}: {world} x {scenario.cluster.spec.name}, data mix {scenario.mix!r}, global batch "
          f"{scenario.global_batch_size}: searched {result.priced} plans in {result.seconds:.1f} s "
          f"({result.pruned_memory} over {scenario.memory_capacity() / 2**30:.0f} GiB per GPU, pruned)")
    header = ("#", "layout", "iter s", "samples/s", "MFU", "bubble", "peak GiB", "how", "verdict")
    rows = []
    played = [c for c in result.candidates if c.simulated is not None or c.verdict.startswith("pruned")]
    estimated = [c for c in result.candidates if c not in played][:SHOWN_ESTIMATES]
    for i, c in enumerate(played + estimated, 1):
        sim = c.simulated
        t = c.iteration_time
        mfu = sim.mfu if sim is not None else c.batch_flops / (t * world * peak) if c.batch_flops else None
        peak_mem = max(sim.peak_memory.values()) if sim is not None else c.estimate.peak_memory
        rows.append((str(i), c.layout + (f" [{c.policy}]" if c.policy != "none" else ""), f"{t:.3f}",
                     f"{scenario.global_batch_size / t:.1f}", f"{mfu:.1%}" if mfu else "-",
                     f"{sim.bubble_fraction:.1%}" if sim is not None else "-", f"{peak_mem / 2**30:.1f}",
                     "simulated" if sim is not None else "estimated", c.verdict))
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for j, row in enumerate([header, *rows]):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print(f"techniques of the winner: {', '.join(result.techniques)}")
    print(f"plan written to {out} (loom simulate --plan {out}; loom train --plan {out})")
