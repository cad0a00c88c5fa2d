"""Parallelism overhead: loom's production step against a plain PyTorch loop of the same
technique (issue 9, Acceptance). Case ``fsdp``: ZeRO 3 with DP 2 against a ``fully_shard``
training loop. Case ``tp``: TP 2 (sequence parallel) against a ``parallelize_module`` loop.

Both sides train the same LLM-only zoo model (one stage, 2 data-parallel replicas, ZeRO 3) on 2
gloo processes with one thread each: the same initial weights (same seed), the same global
batches of fixed-length text samples (the run's seeded `GlobalBatchSampler`, the benchmark
dataset of `benchmarks.pipeline_overhead`), each replica the same microbatches
(`Plan.microbatches_of`), the same loss (summed token cross-entropy over the global batch's
target-token count, gradients SUM-reduced), the same optimizer and LR schedule
(`loom.train.rank.make_optimizer` / `make_lr_scheduler`, their steps inside the timed step).

Each side does per step what its user does:
- loom runs what `loom train` runs: `loom.train.rank.build_rank` from a `TrainConfig` with
  ``zero_stage = 3``, stepping with `RankRun.step` (Dispatcher, ``engine.step``: FSDP2 per
  layer via `loom.runtime.zero`, reduction on the last microbatch's backward, optimizer step;
  LR scheduler; loss all-reduce);
- plain: every rank builds the model, ``fully_shard``s each LLM layer
  (``reshard_after_forward=True``, SUM reduction), and per step collates its microbatches, runs
  forward and backward per microbatch with gradient sync on the last only, then the optimizer,
  the LR scheduler and the loss all-reduce.

Case ``tp`` trains the same model and data with one unit of 2 ranks (``tensor_parallel = 2``, no
data parallelism: both ranks run every microbatch):
- loom: ``build_rank`` + ``RankRun.step`` as above, TP through `loom.runtime.tensor_parallel`
  (each stage layer split as it is materialised, the loss under ``loss_parallel``);
- plain: every rank builds the model and applies ``parallelize_module`` itself to the LLM with
  the same plan written out (`plain_tp_plan`: q/k/v/gate/up column-wise, o/down row-wise onto
  the sequence, norms ``SequenceParallel``, the embedding vocabulary-parallel, the head
  column-wise with vocabulary-sharded logits), then per step runs forward and backward per
  microbatch, the loss and its backward under ``loss_parallel``, the optimizer and the LR
  scheduler.

The two sides run in their own pairs of fresh processes and take turns step by step (ABBA), as
in `benchmarks.pipeline_overhead`; a timed step runs from a barrier to a barrier. The figures
``fsdp_step_time_ratio`` and ``tp_step_time_ratio`` are the medians of the paired per-step
ratios loom / plain with their IQR; lower is better, target at most 1.10 each. The first step's
loss must agree between the sides.

    python benchmarks/parallel_overhead.py [--only fsdp|tp] [--steps 20 --warmup 3 --hidden 256 ...]

Writes ``benchmarks/results/parallel_overhead.json`` (docs/architecture.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import (
    TextDataset,
    WorkerGroup,
    format_table,
    llm_only_config,
    median,
    peak_rss_mb,
    start_run,
    summarize,
    write_result,
)
from loom.data.collate import collate, split_microbatches
from loom.data.sampler import GlobalBatchSampler
from loom.model.layers import run_layers
from loom.model.multimodal import loss_sum
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.train.build import build_model
from loom.train.config import TrainConfig
from loom.train.rank import build_rank, make_lr_scheduler, make_optimizer

NAME = "parallel_overhead"
SIDES = ("loom", "plain")
WORLD_SIZE = 2
LOSS_RTOL = 1e-4
TARGET = 1.10
CASES = ("fsdp", "tp")
BATCHES = 4  # the dataset holds this many global batches; the run's sampler draws from it


@dataclass
class BenchConfig:
    microbatches: int = 4  # per global batch (2 per replica)
    microbatch_size: int = 2
    seq_len: int = 128
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 512
    lr: float = 1e-3
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size


def train_config(cfg: BenchConfig, total_steps: int, case: str = "fsdp") -> TrainConfig:
    """The run both sides train: an LLM-only zoo model, one stage, on 2 ranks: DP 2 with ZeRO 3
    (case ``fsdp``) or TP 2 (case ``tp``)."""
    spec = (ModuleSpec(LLM, data_parallel=WORLD_SIZE, zero_stage=3) if case == "fsdp"
            else ModuleSpec(LLM, tensor_parallel=WORLD_SIZE))
    train = llm_only_config(cfg, Plan([spec], num_microbatches=cfg.microbatches), steps=total_steps)
    train.optim = replace(train.optim, lr=cfg.lr)
    return train.check()


def plain_tp_plan() -> dict:
    """The TP plan with sequence parallelism for the zoo Llama, as a user writes it for
    ``parallelize_module`` on the whole LLM (the plan `loom.runtime.tensor_parallel` applies)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    blocks = "model.layers.*."
    gather = {"self_attn": 5, "mlp": 1}  # positional inputs: the hidden states first
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for sub, n in gather.items():
        plan[blocks + sub] = PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n - 1),
                                                desired_input_layouts=(Replicate(),) + (None,) * (n - 1))
    for norm in ("input_layernorm", "post_attention_layernorm"):
        plan[blocks + norm] = SequenceParallel()
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        plan[blocks + proj] = ColwiseParallel()
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        plan[blocks + proj] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def _worker(rank: int, world_size: int, side: str, cfg_dict: dict, commands: list, replies) -> None:
    cfg_dict.pop("_warmup")  # the parent decides which steps are timed
    total, case = cfg_dict.pop("_total"), cfg_dict.pop("_case")
    cfg = BenchConfig(**cfg_dict)
    train = train_config(cfg, total, case)
    data = TextDataset(cfg, BATCHES)
    num_targets = cfg.global_batch * (cfg.seq_len - 1)  # every position but the last predicts

    if side == "loom":
        run = build_rank(train, torch.device("cpu"), data=(data.tokenizer, data))

        def step(i: int) -> float:
            return run.step(i).loss
    elif case == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        model = build_model(train.model, data.tokenizer, seed=train.run.seed)
        train.plan.resolve(model.layer_counts(), WORLD_SIZE)
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        parallelize_module(model.llm, mesh, plain_tp_plan())
        layers = model.module_layers(LLM)
        optimizer = make_optimizer(train.optim)([p for l in layers for p in l.module.parameters()])
        scheduler = make_lr_scheduler(train, optimizer)
        sampler = GlobalBatchSampler(len(data), cfg.global_batch, seed=train.run.seed)

        def step(i: int) -> float:
            parts = split_microbatches([data[k] for k in sampler.batch(i)], cfg.microbatches)
            total_loss = torch.zeros((), dtype=torch.float64)
            for part in parts:  # one unit, no data parallelism: every rank runs every microbatch
                batch = collate(part, data.tokenizer, {})
                logits = run_layers(layers, None, model.module_context(LLM, batch))
                with loss_parallel():  # vocabulary-sharded logits: the loss and its backward
                    loss = loss_sum(logits, batch.labels) / num_targets
                    loss.backward()
                total_loss += (loss.to_local() if isinstance(loss, DTensor) else loss).detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return float(total_loss)  # every rank holds the full (replicated) loss
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = build_model(train.model, data.tokenizer, seed=train.run.seed)
        train.plan.resolve(model.layer_counts(), WORLD_SIZE)
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        layers = model.module_layers(LLM)
        for layer in layers:
            fully_shard(layer.module, mesh=mesh, reshard_after_forward=True)
            layer.module.set_gradient_divide_factor(1.0)  # SUM: the loss is already a global mean
            layer.module.set_force_sum_reduction_for_comms(True)
        optimizer = make_optimizer(train.optim)([p for l in layers for p in l.module.parameters()])
        scheduler = make_lr_scheduler(train, optimizer)
        sampler = GlobalBatchSampler(len(data), cfg.global_batch, seed=train.run.seed)  # the run's batches
        mine = train.plan.microbatches_of(LLM, rank)

        def step(i: int) -> float:
            parts = split_microbatches([data[k] for k in sampler.batch(i)], cfg.microbatches)
            total_loss = torch.zeros((), dtype=torch.float64)
            for n, j in enumerate(mine):
                last = n == len(mine) - 1
                for layer in layers:
                    layer.module.set_requires_gradient_sync(last, recurse=False)
                    layer.module.set_is_last_backward(last)
                batch = collate(parts[j], data.tokenizer, {})
                logits = run_layers(layers, None, model.module_context(LLM, batch))
                loss = loss_sum(logits, batch.labels) / num_targets
                loss.backward()
                total_loss += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(total_loss)
            return float(total_loss)

    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        dist.barrier()
        start = time.perf_counter()
        loss = step(i)
        dist.barrier()
        replies.put(("step", rank, i, time.perf_counter() - start, loss))
    if side == "loom":
        run.close()
    replies.put(("done", rank, peak_rss_mb()))


def run_case(case: str, cfg: BenchConfig, steps: int, warmup: int) -> dict:
    """Both sides of ``case``, taking turns; their per-step times, losses and peak RSS."""
    sides = {s: WorkerGroup(s, _worker, WORLD_SIZE, {**asdict(cfg), "_warmup": warmup, "_total": warmup + steps,
                                                    "_case": case})
             for s in SIDES}
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    losses: dict[str, list[float]] = {s: [] for s in SIDES}
    rss = {}
    try:
        for g in sides.values():
            g.wait_ready()
        for i in range(warmup + steps):
            for s in (SIDES if i % 2 == 0 else SIDES[::-1]):  # ABBA: neither side always follows the other
                got = sides[s].command(i)
                losses[s].append(got[0][4])
                if i >= warmup:
                    times[s].append(max(r[3] for r in got))
        for s, g in sides.items():
            rss[s] = max(g.close())
    finally:
        for g in sides.values():
            for p in g.procs:
                if p.is_alive():
                    p.terminate()
    rel = abs(losses["loom"][0] - losses["plain"][0]) / max(abs(losses["plain"][0]), 1e-12)
    print(f"  first-step loss: loom {losses['loom'][0]:.6f}, plain {losses['plain'][0]:.6f} (relative difference "
          f"{rel:.2e})")
    if rel > LOSS_RTOL:
        raise SystemExit(f"[{case}] loom and the plain loop compute different losses on the first step: the sides do "
                         f"not do the same work, the timing would be meaningless")
    return {"times": times, "ratios": [a / b for a, b in zip(times["loom"], times["plain"])], "rss": rss,
            "first_step_loss": {s: losses[s][0] for s in SIDES}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--only", choices=list(CASES), default=None, help="run one case (default: all)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side before them")
    for f in fields(BenchConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                            help="override this field of the configuration")
    parser.add_argument("--out", type=Path, default=None, help="results directory; default benchmarks/results")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    args.cfg = replace(BenchConfig(), **{f.name: getattr(args, f.name) for f in fields(BenchConfig)
                                         if getattr(args, f.name) is not None})
    if args.cfg.microbatches < WORLD_SIZE:
        parser.error(f"--microbatches {args.cfg.microbatches}: each of the {WORLD_SIZE} replicas needs one")
    return args


DESCRIPTION = {
    "fsdp": ("loom ZeRO 3 (build_rank + RankRun.step) vs a plain fully_shard loop, DP 2",
             ("fully_shard per LLM layer (reshard_after_forward=True, SUM reduction), forward/backward per "
              "microbatch with gradient sync on the last, optimizer and LR scheduler steps, loss all-reduce")),
    "tp": ("loom TP 2 with sequence parallelism (build_rank + RankRun.step) vs a plain parallelize_module loop",
           ("parallelize_module on the LLM with plain_tp_plan (q/k/v/gate/up column-wise, o/down row-wise onto the "
            "sequence, SequenceParallel norms, vocabulary-parallel embedding and head), forward/backward per "
            "microbatch with the loss under loss_parallel, optimizer and LR scheduler steps")),
}
EXTRA = {"fsdp": {"zero_stage": 3}, "tp": {"tensor_parallel": WORLD_SIZE, "sequence_parallel": True}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start_run()
    cfg = args.cfg
    t0 = time.perf_counter()
    figures: dict = {}
    config: dict = {"world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo", "steps": args.steps,
                    "warmup": args.warmup,
                    "loom_path": "loom.train.rank.build_rank + RankRun.step (ZeRO 3 through loom.runtime.zero, TP "
                                 "through loom.runtime.tensor_parallel), as loom train",
                    "timing": "barrier to barrier per step; the sides take turns step by step; figure = median of "
                              "the paired per-step ratios loom / plain, spread IQR"}
    for case in ([args.only] if args.only else CASES):
        what, plain_path = DESCRIPTION[case]
        print(f"{NAME} [{case}]: {what}, 2 gloo processes x 1 thread per side, {cfg.microbatches} microbatches x "
              f"{cfg.microbatch_size} x {cfg.seq_len} tokens; {args.warmup} warmup + {args.steps} timed steps per side")
        run = run_case(case, cfg, args.steps, args.warmup)
        ratio = summarize(run["ratios"], "ratio", better="lower")
        figures[f"{case}_step_time_ratio"] = ratio
        for s in SIDES:
            figures[f"{case}_{s}_step_ms"] = summarize([t * 1e3 for t in run["times"][s]], "ms", "lower", digits=2)
        verdict = "within" if ratio["value"] <= TARGET else "ABOVE"
        print(f"{case}_step_time_ratio (loom / plain, paired median) = {ratio['value']:.3f}, IQR {ratio['spread']} "
              f"({verdict} the target {TARGET:.2f})")
        print(format_table(["side", "median step (ms)", "min step (ms)", "peak RSS (MB)"],
                           [[s, median(run["times"][s]) * 1e3, min(run["times"][s]) * 1e3, run["rss"][s]]
                            for s in SIDES]))
        config[case] = {**asdict(cfg), **EXTRA[case], "target": TARGET, "first_step_loss": run["first_step_loss"],
                        "plain_path": plain_path}
    print(f"total {time.perf_counter() - t0:.0f} s")
    path = write_result(NAME, figures, config, results_dir=args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
