"""Pipeline overhead: loom's 1F1B executor against ``torch.distributed.pipelining.Schedule1F1B``.

Both sides train the same 2-stage LLM-only model (the zoo ``LlamaForCausalLM`` in a
``MultimodalModel`` with no encoders) on 2 gloo processes with one thread each: the same
initial weights (same seed), the same layer boundaries, the same microbatches (fixed-length
random token ids, so torch's static-shape pipelining applies), the same loss (summed token
cross-entropy over the global batch's target-token count; torch runs with
``scale_grads=False`` so nothing else rescales it) and the same optimizer (AdamW; its step is
*included* in the timed step on both sides: loom runs it as the schedule's ``optimizer_step``
action, torch right after ``Schedule1F1B.step``).

Each side runs in its own pair of fresh processes (its own gloo group), so each side's peak RSS
is its own. Both pairs start together and then take turns step by step (loom, torch, torch,
loom, ...): one pair computes while the other waits on a queue, so slow phases of a shared
machine hit both sides alike. A timed step runs from a barrier to a barrier. The first step's
loss must agree between the sides (a speed comparison of different work would be worthless);
the script fails otherwise.

    python benchmarks/pipeline_overhead.py [--steps 20 --warmup 3 --microbatches 8 ...]

Prints a table and the ratio loom/torch of the median step times (the target is at most 1.10),
and writes ``benchmarks/results/pipeline_overhead.json`` (DESIGN.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (WorkerGroup, figure, format_table, machine_info, median, peak_rss_mb,
                               write_result)
from loom.data.sample import Batch
from loom.model.layers import Layer, run_layers
from loom.model.multimodal import IGNORE_INDEX, MultimodalModel, loss_sum
from loom.model.zoo import LlamaConfig, LlamaForCausalLM
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine

NAME = "pipeline_overhead"
SIDES = ("loom", "torch")
WORLD_SIZE = 2
LOSS_RTOL = 1e-4
TARGET_RATIO = 1.10


@dataclass
class BenchConfig:
    steps: int = 20  # timed steps per side
    warmup: int = 3  # untimed steps per side before them
    microbatches: int = 8
    microbatch_size: int = 2  # sequences per microbatch
    seq_len: int = 128
    hidden: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 512
    lr: float = 1e-3
    seed: int = 0


# ---- the shared model, plan and data -------------------------------------------------------
def build_model(cfg: BenchConfig) -> MultimodalModel:
    torch.manual_seed(cfg.seed)
    llm = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=cfg.heads,
        num_kv_heads=cfg.kv_heads, intermediate_size=cfg.intermediate, max_seq_len=cfg.seq_len,
    ))
    return MultimodalModel({}, llm, {})


def build_plan(cfg: BenchConfig, model: MultimodalModel) -> Plan:
    """Two LLM stages with loom's default even split; the torch side cuts at the same layers."""
    plan = Plan([ModuleSpec(LLM, num_stages=WORLD_SIZE)], num_microbatches=cfg.microbatches, schedule="1f1b")
    return plan.resolve(model.layer_counts(), WORLD_SIZE)


def build_microbatches(cfg: BenchConfig) -> tuple[list[Batch], int]:
    """Text-only microbatches of random ids; ``labels`` are the next ids (the last position
    predicts nothing). Returns them and the global target-token count."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = []
    for j in range(cfg.microbatches):
        ids = torch.randint(0, cfg.vocab, (cfg.microbatch_size, cfg.seq_len), generator=gen)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        sample_ids = list(range(j * cfg.microbatch_size, (j + 1) * cfg.microbatch_size))
        batches.append(Batch(input_ids=ids, labels=labels, modality_inputs={}, sample_ids=sample_ids))
    return batches, sum(b.num_targets for b in batches)


def make_optimizer(cfg: BenchConfig):
    return lambda params: torch.optim.AdamW(params, lr=cfg.lr)


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


def build_torch_pipeline(cfg: BenchConfig, model: MultimodalModel, plan: Plan, rank: int, num_targets: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    start, end = plan.layers_of(LLM, rank)
    all_layers = model.module_layers(LLM)
    mine = all_layers[start:end]
    held = {id(layer.module) for layer in mine}
    for layer in all_layers:  # release the other stage's weights, as loom's build_stage does
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
    optimizer = make_optimizer(cfg)([p for p in module.parameters() if p.requires_grad])
    return schedule, optimizer


# ---- one side, on each of its ranks --------------------------------------------------------
def _worker(rank: int, world_size: int, side: str, cfg_dict: dict, commands: list, replies, profile_dir: str | None) -> None:
    """Build the side, then run one step per command from the driver on ``commands[rank]``
    (``None`` ends) and reply with its time and loss; the driver makes the two sides take turns."""
    cfg = BenchConfig(**cfg_dict)
    model = build_model(cfg)
    plan = build_plan(cfg, model)
    batches, num_targets = build_microbatches(cfg)

    if side == "loom":
        engine = ParallelEngine.create(model, plan, torch.device("cpu"), optimizer_factory=make_optimizer(cfg))
        mine = {j: batches[j] for j in engine.microbatches_to_load()}

        def step(i: int) -> float:
            return engine.step(mine, num_targets, step=i).loss
    else:
        schedule, optimizer = build_torch_pipeline(cfg, model, plan, rank, num_targets)
        all_ids = torch.cat([b.input_ids for b in batches])  # split back into the same microbatches
        all_labels = torch.cat([b.labels for b in batches])

        def step(i: int) -> float:
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(all_ids, return_outputs=False)
            else:
                schedule.step(target=all_labels, losses=losses, return_outputs=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(sum(float(l.detach()) for l in losses))

    del model, batches
    profiler = cProfile.Profile() if profile_dir is not None else None
    replies.put(("ready", rank))
    while (i := commands[rank].get()) is not None:
        timed = i >= cfg.warmup
        dist.barrier()
        if timed and profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        loss = step(i)
        dist.barrier()
        elapsed = time.perf_counter() - start
        if timed and profiler is not None:
            profiler.disable()
        replies.put(("step", rank, i, elapsed, loss))
    if profiler is not None:
        profiler.dump_stats(str(Path(profile_dir) / f"{side}_rank{rank}.prof"))
    replies.put(("done", rank, peak_rss_mb()))


class Side(WorkerGroup):
    """A side's pair of processes and the queues that drive them."""

    def __init__(self, side: str, cfg: BenchConfig, profile_dir: str | None):
        super().__init__(side, _worker, WORLD_SIZE, asdict(cfg), extra=(profile_dir,))
        self.times: list[float] = []
        self.losses: list[float] = []
        self.peak_rss_mb = 0.0

    def step(self, i: int) -> float:
        got = self.command(i)
        elapsed = max(r[3] for r in got)  # both ranks leave at the closing barrier: the slower clock
        self.losses.append(got[-1][4])  # the last stage computes the loss
        return elapsed

    def finish(self) -> None:
        self.peak_rss_mb = max(self.close())


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=" ")
    parser.add_argument("--out", type=Path, default=None, help="results directory; None: benchmarks/results")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write cProfile stats of every rank's timed steps into this directory")
    args = parser.parse_args(argv)
    cfg = BenchConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    if cfg.microbatches < WORLD_SIZE:
        parser.error(f"--microbatches {cfg.microbatches}: Schedule1F1B needs at least {WORLD_SIZE} (one per stage)")
    if cfg.steps < 1 or cfg.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step also sets torch's stage up)")
    return cfg, args


def main(argv: list[str] | None = None) -> dict:
    cfg, args = parse_args(argv)
    model = build_model(cfg)
    plan = build_plan(cfg, model)
    bounds = plan.spec(LLM).stage_boundaries
    params = sum(p.numel() for p in model.parameters())
    del model
    print(f"{NAME}: 2-stage LLM ({params / 1e6:.2f} M parameters, layer boundaries {bounds}), "
          f"{cfg.microbatches} microbatches x {cfg.microbatch_size} x {cfg.seq_len} tokens, "
          f"2 gloo processes x 1 thread per side")
    print(f"{cfg.warmup} warmup + {cfg.steps} timed steps per side, the sides taking turns step by step "
          f"(AdamW step included)")

    profile_dir = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        profile_dir = str(args.profile)
    t0 = time.perf_counter()
    sides = {name: Side(name, cfg, profile_dir) for name in SIDES}
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    try:
        for side in sides.values():
            side.wait_ready()
        print(f"  both sides set up in {time.perf_counter() - t0:.1f} s")
        for i in range(cfg.warmup + cfg.steps):
            # one side's pair of processes runs while the other's waits on its queue; the order
            # alternates (ABBA...) so neither side always follows the other
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            for name in order:
                elapsed = sides[name].step(i)
                if i >= cfg.warmup:
                    times[name].append(elapsed)
            if i < cfg.warmup or (i - cfg.warmup + 1) % 5 == 0 or i + 1 == cfg.warmup + cfg.steps:
                kind = "warmup" if i < cfg.warmup else "step"
                print(f"  {kind} {i + 1:3d}: loss loom {sides['loom'].losses[-1]:.6f} torch {sides['torch'].losses[-1]:.6f}"
                      + (f"; time loom {times['loom'][-1] * 1e3:.1f} ms, torch {times['torch'][-1] * 1e3:.1f} ms"
                         if i >= cfg.warmup else ""))
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
    print(f"first-step loss: loom {loom_losses[0]:.6f}, torch {torch_losses[0]:.6f} "
          f"(relative difference {rel[0]:.2e}; largest over all {len(rel)} steps {max(rel):.2e})")
    if rel[0] > LOSS_RTOL:
        raise SystemExit(f"loom and torch compute different losses on the first step ({loom_losses[0]} vs "
                         f"{torch_losses[0]}): the sides do not do the same work, the timing would be meaningless")

    step_ms = {name: median(times[name]) * 1e3 for name in SIDES}
    rss = {name: sides[name].peak_rss_mb for name in SIDES}
    ratio = step_ms["loom"] / step_ms["torch"]
    # the ratio of neighbouring steps cancels slow drifts of the machine's speed
    paired = median([a / b for a, b in zip(times["loom"], times["torch"])])
    print()
    print(format_table(["side", "median step (ms)", "min step (ms)", "peak RSS (MB)"],
                       [[n, step_ms[n], min(times[n]) * 1e3, rss[n]] for n in SIDES]))
    verdict = "within" if ratio <= TARGET_RATIO else "ABOVE"
    print(f"\nstep_time_ratio (loom / torch, median step times) = {ratio:.3f}  ({verdict} the target {TARGET_RATIO:.2f})")
    print(f"median of the step-by-step ratios = {paired:.3f}; total {time.perf_counter() - t0:.0f} s")

    figures = {
        "step_time_ratio": figure(ratio, "ratio"),
        "loom_peak_rss_mb": figure(rss["loom"], "MB", 1),
        "torch_peak_rss_mb": figure(rss["torch"], "MB", 1),
        "loom_step_ms": figure(step_ms["loom"], "ms", 2),
        "torch_step_ms": figure(step_ms["torch"], "ms", 2),
    }
    config = {**asdict(cfg), "world_size": WORLD_SIZE, "threads_per_process": 1, "backend": "gloo",
              "schedule": "1f1b", "stage_boundaries": bounds, "optimizer": "AdamW, step included in the timed step",
              "timing": "median over timed steps, barrier to barrier; the sides take turns step by step",
              "paired_step_time_ratio": round(paired, 4),
              "first_step_loss": {"loom": loom_losses[0], "torch": torch_losses[0]}}
    path = write_result(NAME, figures, config, machine_info(), args.out)
    print(f"wrote {path}")
    return {"figures": figures, "config": config}


if __name__ == "__main__":
    main()
