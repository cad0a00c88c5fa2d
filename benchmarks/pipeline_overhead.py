"""Pipeline overhead: loom's production step against ``torch.distributed.pipelining.Schedule1F1B``.

Both sides train the same 2-stage LLM-only model (the zoo ``LlamaForCausalLM`` in a
``MultimodalModel`` with no encoders) on 2 gloo processes with one thread each: the same
initial weights (same seed), the same layer boundaries, the same global batches of
fixed-length text samples (so torch's static-shape pipelining applies; the run's seeded
`GlobalBatchSampler` picks them), the same loss (summed token cross-entropy over the global
batch's target-token count; torch runs with ``scale_grads=False`` so nothing else rescales it),
the same optimizer and LR schedule (`loom.train.rank.make_optimizer` and `make_lr_scheduler`:
AdamW with the run's weight decay and betas; both steps are *included* in the timed step on
both sides) and the global loss summed over the ranks.

Each side does per step what its user does:
- loom runs exactly what `loom train` runs: each rank is built by `loom.train.rank.build_rank`
  from a `TrainConfig` (`train_config`) with this benchmark's samples, and steps with
  `RankRun.step`: the `Dispatcher` (each rank loads its loader shard of the global batch,
  metadata all-gathered, the layout of policy ``none``, the payload all-to-all, collation),
  ``engine.step`` with that layout and its `RowMap` (the optimizer step is the schedule's
  ``optimizer_step`` action), the LR scheduler's step and the loss all-reduce;
- torch: every rank reads and collates the same microbatches itself and runs
  ``Schedule1F1B.step``, then the optimizer, the LR scheduler and the loss all-reduce.

Two configurations run in one invocation: ``default`` (figure ``step_time_ratio``) and
``small``, the overhead-dominated model of issue 8 point 9 (figure ``step_time_ratio_small``).
Each side of each configuration runs in its own pair of fresh processes (its own gloo group),
so each side's peak RSS is its own. The two pairs of a configuration take turns step by step
(loom, torch, torch, loom, ...): one pair computes while the other waits on a queue, so slow
phases of a shared machine hit both sides alike. A timed step runs from a barrier to a barrier.
The figure is the median over the timed steps of the paired ratio loom / torch of neighbouring
steps, with its interquartile range; lower is better, targets at most 1.10 (default) and 1.15
(small). The first step's loss must agree between the sides (a speed comparison of different
work would be worthless); the script fails otherwise.

    python benchmarks/pipeline_overhead.py [--only small] [--steps 20 --warmup 3 --hidden 64 ...]

Writes ``benchmarks/results/pipeline_overhead.json`` (docs/architecture.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (TextDataset, WorkerGroup, figure, format_table, llm_only_config, median, peak_rss_mb,
                               start_run, summarize, write_result)
from loom.data.collate import collate, split_microbatches
from loom.data.sample import Batch
from loom.data.sampler import GlobalBatchSampler
from loom.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from loom.model.layers import Layer, run_layers
from loom.model.multimodal import MultimodalModel, loss_sum
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.train.build import build_model as build_run_model
from loom.train.config import TrainConfig
from loom.train.rank import build_rank, make_lr_scheduler, make_optimizer

NAME = "pipeline_overhead"
SIDES = ("loom", "torch")
WORLD_SIZE = 2
LOSS_RTOL = 1e-4
BATCHES = 4  # the dataset holds this many global batches; the run's sampler draws from it


@dataclass
class BenchConfig:
    microbatches: int = 8
    microbatch_size: int = 2  # sequences per microbatch
    seq_len: int = 128
    hidden: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 512
    lr: float = 1e-3  # optim.lr (the rest of [optim]: the run's defaults)
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size


# the configurations of one run: figure name -> (configuration, target ratio)
CONFIGS = {
    "default": (BenchConfig(), 1.10),
    # issue 8 point 9: compute so small that the per-action overhead is what shows
    "small": (BenchConfig(microbatches=32, microbatch_size=1, seq_len=16, hidden=64, layers=2, heads=4,
                          kv_heads=2, intermediate=172, vocab=256), 1.15),
}
FIGURE = {"default": "step_time_ratio", "small": "step_time_ratio_small"}


# ---- the shared run config, model, plan and data --------------------------------------------
def train_config(cfg: BenchConfig, total_steps: int) -> TrainConfig:
    """The run both sides train: an LLM-only zoo model, two LLM stages with loom's default even
    split (the torch side cuts at the same layers), ``optim.lr``, and ``run.steps`` (every step
    the side runs, so the LR schedule is that of a run of this length)."""
    plan = Plan([ModuleSpec(LLM, num_stages=WORLD_SIZE)], num_microbatches=cfg.microbatches, schedule="1f1b")
    train = llm_only_config(cfg, plan, steps=total_steps)
    train.optim = replace(train.optim, lr=cfg.lr)
    return train.check()


def build_model(train: TrainConfig, tokenizer: Tokenizer) -> MultimodalModel:
    """The run's model (`loom.train.build.build_model`, as every loom rank builds it), with the
    plan resolved against it."""
    model = build_run_model(train.model, tokenizer, seed=train.run.seed)
    train.plan.resolve(model.layer_counts(), WORLD_SIZE)
    return model






# ---- the torch side ------------------------------------------------------------------------
class TorchStageModule(nn.Module):
    """One rank's slice of the layer list as a plain module for ``PipelineStage``: the first
    stage takes the input ids, the others the hidden states; the context (positions, RoPE
    tables) is rebuilt from the input's shape, as loom's stages rebuild it from the microbatch."""

    def __init__(self, model: MultimodalModel, layers: list[Layer], is_first: bool):
        super().__init__()
        self.blocks = nn.ModuleList(layer.module for layer in layers)  # the stage's parameters only
        self._layers = layers
        self._context = model.module_context  # a bound method, not a submodule
        self._is_first = is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x if self._is_first else torch.zeros(x.shape[:2], dtype=torch.long)
        ctx = self._context(LLM, Batch(input_ids=ids, labels=ids, modality_inputs={}, sample_ids=[]))
        return run_layers(self._layers, None if self._is_first else x, ctx)


def build_torch_pipeline(cfg: BenchConfig, train: TrainConfig, model: MultimodalModel, rank: int, num_targets: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    start, end = train.plan.layers_of(LLM, rank)
    all_layers = model.module_layers(LLM)
    mine = all_layers[start:end]
    held = {id(layer.module) for layer in mine}
    for layer in all_layers:  # release the other stage's weights, as loom's build_stages does
        if id(layer.module) not in held:
            layer.module.to("meta")
    module = TorchStageModule(model, mine, is_first=rank == 0)
    mb, length, width = cfg.microbatch_size, cfg.seq_len, cfg.hidden
    hidden = torch.empty(mb, length, width, requires_grad=True)  # the activation carries a gradient back
    if rank == 0:
        inputs, outputs = torch.zeros(mb, length, dtype=torch.long), hidden
    else:
        inputs, outputs = hidden, torch.empty(mb, length, cfg.vocab, requires_grad=True)
    stage = PipelineStage(module, rank, WORLD_SIZE, torch.device("cpu"), input_args=inputs, output_args=outputs)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, labels) / num_targets

    schedule = Schedule1F1B(stage, cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    optimizer = make_optimizer(train.optim)([p for p in module.parameters() if p.requires_grad])
    return schedule, optimizer, make_lr_scheduler(train, optimizer)


# ---- one side, on each of its ranks --------------------------------------------------------
def _worker(rank: int, world_size: int, side: str, cfg_dict: dict, commands: list, replies, profile_dir: str | None) -> None:
    """Build the side, then run one step per command from the driver on ``commands[rank]``
    (``None`` ends) and reply with its time, loss and (loom) dispatch time; the driver makes
    the two sides take turns."""
    warmup, total = cfg_dict.pop("_warmup"), cfg_dict.pop("_total")
    cfg = BenchConfig(**cfg_dict)
    train = train_config(cfg, total)
    data = TextDataset(cfg, BATCHES)
    num_targets = cfg.global_batch * (cfg.seq_len - 1)  # every position but the last predicts

    if side == "loom":
        run = build_rank(train, torch.device("cpu"), data=(data.tokenizer, data))

        def step(i: int) -> tuple[float, float]:
            done = run.step(i)
            return done.loss, done.dispatch_s
    else:
        model = build_model(train, data.tokenizer)
        schedule, optimizer, scheduler = build_torch_pipeline(cfg, train, model, rank, num_targets)
        sampler = GlobalBatchSampler(len(data), cfg.global_batch, seed=train.run.seed)  # the run's batches
        del model

        def step(i: int) -> tuple[float, float]:
            samples = [data[k] for k in sampler.batch(i)]
            parts = split_microbatches(samples, cfg.microbatches)
            batches = [collate(p, data.tokenizer, {}) for p in parts]
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(torch.cat([b.input_ids for b in batches]), return_outputs=False)
            else:
                schedule.step(target=torch.cat([b.labels for b in batches]), losses=losses, return_outputs=False)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.tensor([sum(float(l.detach()) for l in losses)], dtype=torch.float64)
            dist.all_reduce(loss)  # as loom's step: the global loss on every rank
            return float(loss), 0.0

    profiler = cProfile.Profile() if profile_dir is not None else None
    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        timed = i >= warmup
        dist.barrier()
        if timed and profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        loss, dispatch_s = step(i)
        dist.barrier()
        elapsed = time.perf_counter() - start
        if timed and profiler is not None:
            profiler.disable()
        replies.put(("step", rank, i, elapsed, loss, dispatch_s))
    if side == "loom":
        run.close()
    if profiler is not None:
        profiler.dump_stats(str(Path(profile_dir) / f"{side}_rank{rank}.prof"))
    replies.put(("done", rank, peak_rss_mb()))


class Side(WorkerGroup):
    """A side's pair of processes and the queues that drive them."""

    def __init__(self, side: str, cfg: BenchConfig, warmup: int, total: int, profile_dir: str | None):
        super().__init__(side, _worker, WORLD_SIZE, {**asdict(cfg), "_warmup": warmup, "_total": total},
                         extra=(profile_dir,))
        self.losses: list[float] = []
        self.dispatch: list[float] = []
        self.peak_rss_mb = 0.0

    def step(self, i: int) -> float:
        got = self.command(i)
        elapsed = max(r[3] for r in got)  # both ranks leave at the closing barrier: the slower clock
        self.losses.append(got[-1][4])  # the global loss, all-reduced: the same on every rank
        self.dispatch.append(max(r[5] for r in got))
        return elapsed

    def finish(self) -> None:
        self.peak_rss_mb = max(self.close())


def run_config(name: str, cfg: BenchConfig, steps: int, warmup: int, profile: Path | None) -> dict:
    """Both sides of one configuration, taking turns; returns their per-step times and more."""
    train = train_config(cfg, warmup + steps)
    model = build_model(train, TextDataset(cfg, BATCHES).tokenizer)
    bounds = train.plan.spec(LLM).stage_boundaries
    params = sum(p.numel() for p in model.parameters())
    del model
    print(f"[{name}] 2-stage LLM ({params / 1e6:.2f} M parameters, layer boundaries {bounds}), "
          f"{cfg.microbatches} microbatches x {cfg.microbatch_size} x {cfg.seq_len} tokens; "
          f"{warmup} warmup + {steps} timed steps per side")
    profile_dir = None
    if profile is not None:
        (profile / name).mkdir(parents=True, exist_ok=True)
        profile_dir = str(profile / name)
    t0 = time.perf_counter()
    sides = {side: Side(side, cfg, warmup, warmup + steps, profile_dir) for side in SIDES}
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        for side in sides.values():
            side.wait_ready()
        for i in range(warmup + steps):
            # one side's pair of processes runs while the other's waits on its queue; the order
            # alternates (ABBA...) so neither side always follows the other
            for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
                elapsed = sides[side].step(i)
                if i >= warmup:
                    times[side].append(elapsed)
            if i >= warmup and ((i - warmup + 1) % 10 == 0 or i + 1 == warmup + steps):
                print(f"  step {i + 1:3d}: loss loom {sides['loom'].losses[-1]:.6f} torch {sides['torch'].losses[-1]:.6f}; "
                      f"time loom {times['loom'][-1] * 1e3:.1f} ms, torch {times['torch'][-1] * 1e3:.1f} ms")
        for side in sides.values():
            side.finish()
    finally:
        for side in sides.values():
            for p in side.procs:
                if p.is_alive():
                    p.terminate()
    # the same work on both sides: the same loss on the first step (and, as a check of the
    # optimizer step, on the later ones)
    loom_losses, torch_losses = sides["loom"].losses, sides["torch"].losses
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(loom_losses, torch_losses)]
    print(f"  first-step loss: loom {loom_losses[0]:.6f}, torch {torch_losses[0]:.6f} (relative difference "
          f"{rel[0]:.2e}; largest over all {len(rel)} steps {max(rel):.2e}); {time.perf_counter() - t0:.0f} s")
    if rel[0] > LOSS_RTOL:
        raise SystemExit(f"[{name}] loom and torch compute different losses on the first step ({loom_losses[0]} vs "
                         f"{torch_losses[0]}): the sides do not do the same work, the timing would be meaningless")
    return {"times": times, "ratios": [a / b for a, b in zip(times["loom"], times["torch"])],
            "dispatch": sides["loom"].dispatch[warmup:], "rss": {s: sides[s].peak_rss_mb for s in SIDES},
            "bounds": bounds, "first_step_loss": {"loom": loom_losses[0], "torch": torch_losses[0]}}


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--only", choices=list(CONFIGS), default=None, help="run one configuration (default: both)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side and configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side before them")
    for f in fields(BenchConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                            help="override this field in every configuration run")
    parser.add_argument("--out", type=Path, default=None, help="results directory; default benchmarks/results")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write cProfile stats of every rank's timed steps into this directory")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step also sets torch's stage up)")
    args.configs = {}
    for name in [args.only] if args.only else list(CONFIGS):
        cfg = replace(CONFIGS[name][0], **{f.name: getattr(args, f.name) for f in fields(BenchConfig)
                                           if getattr(args, f.name) is not None})
        if cfg.microbatches < WORLD_SIZE:
            parser.error(f"--microbatches {cfg.microbatches}: Schedule1F1B needs at least {WORLD_SIZE} (one per stage)")
        if cfg.seq_len < 3 or cfg.vocab <= len(SPECIAL_TOKENS):
            parser.error(f"--seq-len {cfg.seq_len} / --vocab {cfg.vocab}: need at least 3 tokens per sample and more "
                         f"than {len(SPECIAL_TOKENS)} ids (the tokenizer's specials)")
        args.configs[name] = cfg
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start_run()
    print(f"{NAME}: loom (build_rank + RankRun.step, as loom train) vs torch Schedule1F1B, 2 gloo processes x "
          f"1 thread per side, the sides taking turns step by step (optimizer and LR scheduler steps included)")
    t0 = time.perf_counter()
    runs = {name: run_config(name, cfg, args.steps, args.warmup, args.profile) for name, cfg in args.configs.items()}

    figures, rows, config = {}, [], {"world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo",
                                     "schedule": "1f1b", "steps": args.steps, "warmup": args.warmup,
                                     "optimizer": "loom.train.rank.make_optimizer (AdamW, [optim] weight decay, betas "
                                                  "0.9/0.95) and make_lr_scheduler on both sides, steps included in "
                                                  "the timed step",
                                     "loom_path": "loom.train.rank.build_rank + RankRun.step (Dispatcher.dispatch with "
                                                  "policy none, engine.step(layout=, rows=), LR scheduler, loss "
                                                  "all-reduce), as loom train",
                                     "torch_path": "each rank collates the microbatches, Schedule1F1B.step, optimizer "
                                                  "and LR scheduler steps, loss all-reduce",
                                     "timing": "barrier to barrier per step; the sides take turns step by step; "
                                               "figure = median of the paired per-step ratios loom / torch, spread IQR",
                                     "configurations": {}}
    print()
    for name, run in runs.items():
        suffix = "" if name == "default" else f"_{name}"
        target = CONFIGS[name][1]
        ratio = summarize(run["ratios"], "ratio", better="lower")
        figures[FIGURE[name]] = ratio
        figures[f"loom_step_ms{suffix}"] = summarize([t * 1e3 for t in run["times"]["loom"]], "ms", better="lower", digits=2)
        figures[f"torch_step_ms{suffix}"] = summarize([t * 1e3 for t in run["times"]["torch"]], "ms", better="lower", digits=2)
        figures[f"loom_dispatch_ms{suffix}"] = summarize([t * 1e3 for t in run["dispatch"]], "ms", better="lower", digits=2)
        figures[f"loom_peak_rss_mb{suffix}"] = figure(run["rss"]["loom"], "MB", better="lower", digits=1)
        figures[f"torch_peak_rss_mb{suffix}"] = figure(run["rss"]["torch"], "MB", better="lower", digits=1)
        for side in SIDES:
            rows.append([f"{name}: {side}", median(run["times"][side]) * 1e3, min(run["times"][side]) * 1e3,
                         median(run["dispatch"]) * 1e3 if side == "loom" else "-", run["rss"][side]])
        verdict = "within" if ratio["value"] <= target else "ABOVE"
        print(f"{FIGURE[name]} (loom / torch, paired median) = {ratio['value']:.3f}, IQR {ratio['spread']} "
              f"({verdict} the target {target:.2f})")
        config["configurations"][name] = {**asdict(args.configs[name]), "target": target,
                                          "stage_boundaries": run["bounds"], "first_step_loss": run["first_step_loss"]}
    print()
    print(format_table(["configuration: side", "median step (ms)", "min step (ms)", "dispatch (ms)", "peak RSS (MB)"], rows))
    print(f"total {time.perf_counter() - t0:.0f} s")
    path = write_result(NAME, figures, config, results_dir=args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
