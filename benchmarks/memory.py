"""Memory: the measured peak memory of every rank next to the cost model's prediction for the
same plan (issue 9, "benchmarks/memory.py").

Each case trains a zoo Llama (LLM only; wide hidden size, long sequences, several microbatches,
so that activations and the weights' states are tens to hundreds of MB) on fresh gloo
processes with one thread each, through the production path: every rank is built by
`loom.train.rank.build_rank` from a `TrainConfig` and steps with `RankRun.step`, as ``loom
train`` does (the `Dispatcher` with policy ``none``, ``engine.step`` with its optimizer step,
the LR scheduler, the loss all-reduce). The cases:

- ``recompute = "none" | "selective" | "full"`` on a 2-stage 1F1B pipeline (so the two ranks
  hold different numbers of microbatches in flight);
- ``zero_stage = 0 | 1 | 2 | 3`` at data-parallel degree 2 (one stage; `loom.runtime.zero`:
  ZeroRedundancyOptimizer for 1, FSDP2 ``fully_shard`` per layer for 2 and 3);
- ``tp2`` and ``tp2_full``: tensor-parallel degree 2 (one stage), with the sequence
  parallelism the runtime always runs the LLM's TP with (`loom.runtime.tensor_parallel`), under
  recompute ``"none"`` and ``"full"`` (which keeps each block's input sequence shard);
- ``zero0_bf16``, ``zero2_bf16``, ``zero3_bf16``: ZeRO 0, 2 and 3 as above under ``run.dtype =
  "bf16"`` (CPU autocast; FSDP2 gathers bf16 copies of the fp32 shards). Every other case is
  fp32.

**Measured**, per rank: the peak bytes of live tensors during one training step after the
first (the first creates AdamW's moments, so the second is the steady state), counted by
`loom.profile.memory_meter.MemoryMeter` (every storage from the operator that creates it to
its release; the tensors alive at the step's start, parameters and optimizer state, counted
first). RSS would be too coarse: allocator caches and the interpreter are not what the model
predicts.

**Predicted**, per rank: what ``loom simulate`` reports for the same plan, the simulator's peak
memory per pipeline unit (`loom.sim.memory`, under `loom.cost.analytic.AnalyticCostModel` with
``run.dtype``'s bytes and AdamW): the schedule `engine.schedule_for` runs for the step's layout,
each slot's workload from the step's sample metadata.

Figure ``memory_model_median_abs_rel_error``: the median over cases and ranks of
``|predicted - measured| / measured``, spread the interquartile range over them; better lower,
target at most 0.15.

    python benchmarks/memory.py [--cases none,...,zero3,tp2,tp2_full,zero0_bf16,zero2_bf16,zero3_bf16] [--layers 8 ...]

Writes ``benchmarks/results/memory.json`` (docs/benchmarks.md).
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

from benchmarks.common import (TextDataset, WorkerGroup, figure, format_table, llm_only_config, median, peak_rss_mb,
                               spread_of, start_run, write_result)
from loom.balance.policy import make_layout, sample_costs
from loom.cost.analytic import AnalyticCostModel
from loom.cost.arch_from_model import arch_from_model
from loom.cost.hardware import Cluster
from loom.cost.memory import DTYPE_BYTES
from loom.cost.workload import sample_work
from loom.data.sampler import GlobalBatchSampler
from loom.data.tokenizer import SPECIAL_TOKENS
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.profile.memory_meter import MemoryMeter
from loom.runtime.stage import trainable_stages
from loom.schedule.generators import build_schedule
from loom.sim.simulator import simulate
from loom.train.build import build_model
from loom.train.config import TrainConfig
from loom.train.rank import build_rank

NAME = "memory"
WORLD_SIZE = 2
BATCHES = 2  # global batches in the data set; the run's sampler draws from them
MiB = 2**20
TARGET = 0.15


@dataclass
class BenchConfig:
    """The model and batch every case trains (its plan is the case's)."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1376
    vocab: int = 512
    seq_len: int = 512
    microbatches: int = 4
    microbatch_size: int = 1
    seed: int = 0

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size


# case name -> the LLM's ModuleSpec (world size 2)
CASES: dict[str, ModuleSpec] = {
    "none": ModuleSpec(LLM, num_stages=2, recompute="none"),
    "selective": ModuleSpec(LLM, num_stages=2, recompute="selective"),
    "full": ModuleSpec(LLM, num_stages=2, recompute="full"),
    "zero0": ModuleSpec(LLM, data_parallel=2, zero_stage=0),
    "zero1": ModuleSpec(LLM, data_parallel=2, zero_stage=1),
    "zero2": ModuleSpec(LLM, data_parallel=2, zero_stage=2),
    "zero3": ModuleSpec(LLM, data_parallel=2, zero_stage=3),
    "tp2": ModuleSpec(LLM, tensor_parallel=2),
    "tp2_full": ModuleSpec(LLM, tensor_parallel=2, recompute="full"),
    "zero0_bf16": ModuleSpec(LLM, data_parallel=2, zero_stage=0),
    "zero2_bf16": ModuleSpec(LLM, data_parallel=2, zero_stage=2),
    "zero3_bf16": ModuleSpec(LLM, data_parallel=2, zero_stage=3),
}
# cases that run in bf16 (run.dtype; autocast, and FSDP2 gathering bf16 under ZeRO-2/3); the rest fp32
BF16_CASES = {"zero0_bf16", "zero2_bf16", "zero3_bf16"}


def train_config(cfg: BenchConfig, spec: ModuleSpec, dtype: str = "fp32") -> TrainConfig:
    """The run a case trains: the zoo Llama of ``cfg`` under the plan of one LLM ``spec``, in
    ``dtype`` (``run.dtype``), 1F1B."""
    plan = Plan([replace(spec)], num_microbatches=cfg.microbatches, schedule="1f1b")
    train = llm_only_config(cfg, plan, steps=10, dtype=dtype)
    return train.check()




# ---- measured ------------------------------------------------------------------------------
def _worker(rank: int, world_size: int, case: str, cfg_dict: dict, commands: list, replies) -> None:
    """Build the case's rank as ``loom train`` does, then per command ``(step, measure)`` run
    that step, under a `MemoryMeter` when ``measure``, and reply with its peak live bytes."""
    cfg = BenchConfig(**cfg_dict)
    train = train_config(cfg, CASES[case], "bf16" if case in BF16_CASES else "fp32")
    data = TextDataset(cfg, BATCHES)
    run = build_rank(train, torch.device("cpu"), data=(data.tokenizer, data))
    replies.put(("ready", rank))
    while (command := commands[rank].get()) is not None:
        step, measure = command
        if not measure:
            done = run.step(step)
            replies.put(("step", rank, step, None, None, done.loss))
            continue
        meter = MemoryMeter("cpu")
        with meter:
            meter.track_live()  # what the step starts with: parameters, optimizer state, data
            start_bytes = meter.live_bytes
            done = run.step(step)
        meter.close()
        replies.put(("step", rank, step, meter.peak_bytes, start_bytes, done.loss))
    run.close()
    replies.put(("done", rank, peak_rss_mb()))


def measure(case: str, cfg: BenchConfig, steps: int) -> dict:
    """Per rank: the peak live bytes of each measured step (after one unmeasured step)."""
    group = WorkerGroup(case, _worker, WORLD_SIZE, asdict(cfg))  # the group's name is the case
    try:
        group.wait_ready()
        group.command((0, False))
        got = [group.command((1 + i, True)) for i in range(steps)]
        rss = group.close()
    finally:
        for p in group.procs:
            if p.is_alive():
                p.terminate()
    return {"peak": [[r[3] for r in g] for g in got], "start": [[r[4] for r in g] for g in got],
            "loss": got[-1][0][5], "rss_mb": rss}


# ---- predicted -----------------------------------------------------------------------------
def predict(case: str, cfg: BenchConfig, step: int) -> list[float]:
    """Per rank: the simulator's peak memory of the rank's pipeline unit for step ``step``,
    as ``loom simulate`` computes it (module docstring)."""
    train = train_config(cfg, CASES[case], "bf16" if case in BF16_CASES else "fp32")
    data = TextDataset(cfg, BATCHES)
    model = build_model(train.model, data.tokenizer, seed=train.run.seed, device="meta")
    plan = train.plan.resolve(model.layer_counts(), WORLD_SIZE)
    arch = arch_from_model(model)
    batching = "packed" if train.data.pack_sequences else "padded"
    sampler = GlobalBatchSampler(len(data), train.data.global_batch_size, seed=train.run.seed)
    metas = [data[i].meta for i in sampler.batch(step)]
    layout = make_layout(train.balance, plan, sample_costs(arch, metas), batching)
    schedule = build_schedule(plan, trainable_stages(model, plan), layout=layout, eager=train.balance.eager_forward)
    layout_plan = replace(plan, num_microbatches=layout.num_microbatches)
    cost = AnalyticCostModel(arch, layout_plan, Cluster("H100", num_gpus=WORLD_SIZE),
                             dtype_bytes=DTYPE_BYTES[train.run.dtype])
    work = [{phase: sample_work(arch, [metas[s] for s in slots[j]], batching)[phase]
             for phase, slots in layout.slots.items()} for j in range(layout.num_microbatches)]
    per_sample = [sample_work(arch, [m], batching) for m in metas]
    result = simulate(schedule, layout_plan, cost, work, sample_work=per_sample)
    return [result.peak_memory[plan.unit_of(*plan.role_of(r))] for r in range(WORLD_SIZE)]


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated cases among {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per case (after one unmeasured)")
    for f in fields(BenchConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                            help="the model and batch of every case")
    parser.add_argument("--out", type=Path, default=None, help="results directory; default benchmarks/results")
    args = parser.parse_args(argv)
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.case_list if c not in CASES]
    if unknown or not args.case_list:
        parser.error(f"--cases {args.cases!r}: choose among {', '.join(CASES)}")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: measure at least one step")
    args.cfg = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
    if args.cfg.seq_len < 3 or args.cfg.vocab <= len(SPECIAL_TOKENS):
        parser.error(f"--seq-len {args.cfg.seq_len} / --vocab {args.cfg.vocab}: need at least 3 tokens per "
                     f"sample and more than {len(SPECIAL_TOKENS)} ids (the tokenizer's specials)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = args.cfg
    start_run()
    print(f"{NAME}: measured peak live-tensor memory per rank (MemoryMeter, build_rank + RankRun.step as loom "
          f"train) against the simulator's peak memory (AnalyticCostModel), {WORLD_SIZE} gloo processes x 1 thread; "
          f"Llama {cfg.layers} layers, hidden {cfg.hidden}, {cfg.microbatches} microbatches x {cfg.microbatch_size} "
          f"x {cfg.seq_len} tokens")
    t0 = time.perf_counter()
    rows, errors, per_case = [], [], {}
    for case in args.case_list:
        got = measure(case, cfg, args.steps)
        predicted = predict(case, cfg, 1)
        spec = CASES[case]
        per_case[case] = {"plan": {"data_parallel": spec.data_parallel, "num_stages": spec.num_stages,
                                   "tensor_parallel": spec.tensor_parallel, "zero_stage": spec.zero_stage,
                                   "recompute": spec.recompute, "dtype": "bf16" if case in BF16_CASES else "fp32"},
                          "ranks": []}
        for r in range(WORLD_SIZE):
            measured = max(step[r] for step in got["peak"])  # the steps' peaks agree to a few bytes
            err = abs(predicted[r] - measured) / measured
            errors.append(err)
            rows.append([f"{case} rank {r}", measured / MiB, predicted[r] / MiB, got["start"][-1][r] / MiB,
                         f"{(predicted[r] - measured) / measured:+.3f}"])
            per_case[case]["ranks"].append({"measured_bytes": measured, "predicted_bytes": predicted[r],
                                            "step_start_bytes": got["start"][-1][r],
                                            "peak_rss_mb": round(got["rss_mb"][r], 1)})
        print(f"  {case}: measured {[round(step[r] / MiB, 1) for step in got['peak'] for r in range(WORLD_SIZE)]} MiB, "
              f"predicted {[round(p / MiB, 1) for p in predicted]} MiB ({time.perf_counter() - t0:.0f} s)")
    spread, kind = spread_of(errors)
    figures = {"memory_model_median_abs_rel_error": figure(median(errors), "ratio", better="lower",
                                                           spread=spread, spread_is=kind)}
    print()
    print(format_table(["case", "measured peak (MiB)", "predicted (MiB)", "at step start (MiB)", "rel. error"], rows))
    value = figures["memory_model_median_abs_rel_error"]["value"]
    print(f"memory_model_median_abs_rel_error = {value:.3f}, {kind} {spread} "
          f"({'within' if value <= TARGET else 'ABOVE'} the target {TARGET})")
    config = {"world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo",
              "dtype": "fp32; bf16 for " + ", ".join(sorted(BF16_CASES)),
              "model": asdict(cfg), "schedule": "1f1b", "optimizer": "AdamW (loom.train.rank.make_optimizer)",
              "measured": "peak live tensor bytes during step 2 (loom.profile.memory_meter.MemoryMeter), the tensors "
                          "alive at its start included",
              "predicted": "loom.sim.simulate(...).peak_memory of the rank's unit under AnalyticCostModel "
                           "(as loom simulate), the step's layout and workloads",
              "target": TARGET, "cases": per_case}
    path = write_result(NAME, figures, config, results_dir=args.out)
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
