"""One rank of a training run: everything `loom train` builds on a rank, and its training step.

`build_rank` is the one place that turns a `TrainConfig` into a rank's model stage, engine,
dispatcher, optimizer (AdamW with the run's weight decay and betas), LR scheduler (linear
warmup, cosine decay) and sampler; `RankRun.step` is one training iteration exactly as the
training loop (`loom.train.main`) runs it: the global batch's sample indices from the seeded
sampler, the `Dispatcher` (metadata all-gather, the ``[balance]`` policy, the payload
all-to-all), ``engine.step`` under that layout (whose schedule ends with the optimizer step and
zeroes the gradients), the LR scheduler's step and the loss summed over the ranks. Benchmarks
that measure what a run pays call the same two functions, so they cannot drift from it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from loom.balance.config import BalanceConfig
from loom.cost.arch_from_model import arch_from_model
from loom.data.sampler import GlobalBatchSampler
from loom.data.tokenizer import Tokenizer
from loom.plan.plan import LLM
from loom.runtime.dispatch import Dispatched, Dispatcher, SampleSource
from loom.runtime.engine import ParallelEngine
from loom.runtime.executor import StepResult
from loom.train.build import bubble_filler, build_data, build_model, generation_specs, token_counters
from loom.train.config import ConfigError, OptimConfig, TrainConfig

ADAM_BETAS = (0.9, 0.95)  # the usual LLM pre-training betas (Llama 3, torchtitan)


def make_optimizer(optim: OptimConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The run's optimizer for a stage's parameters: AdamW at ``optim.lr`` with
    ``optim.weight_decay`` and `ADAM_BETAS`."""

    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, betas=ADAM_BETAS)

    return make


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    warm, total, floor = cfg.optim.warmup_steps, cfg.run.steps, cfg.optim.min_lr_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def make_lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's LR schedule (`lr_lambda`) on ``optimizer``, stepped once per iteration."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


@dataclass
class RankStep:
    """What one iteration gave this rank: the global batch's sample ``indices``, what the
    dispatcher gave it (``dispatched``: layout, row map, microbatches, costs), the engine's
    ``result`` (this rank's loss part and timeline), ``loss`` (summed over the ranks: the
    global batch's loss, the same on every rank) and the times of its parts (seconds, this
    rank's clock): ``dispatch_s``, ``engine_s`` (``engine.step``, its optimizer step included)
    and ``total_s`` (the whole iteration, from the sampler to the loss all-reduce)."""

    step: int
    indices: list[int]
    dispatched: Dispatched
    result: StepResult
    loss: float
    losses: dict[str, float]  # summed over the ranks per loss term: "llm" and each generator
    dispatch_s: float
    engine_s: float
    total_s: float
    skipped_samples: int = 0  # samples the ranks skipped and replaced while loading (data.on_error = "skip")


@dataclass
class RankRun:
    """A rank's share of a run, built by `build_rank`."""

    cfg: TrainConfig
    device: torch.device
    tokenizer: Tokenizer
    dataset: SampleSource
    engine: ParallelEngine
    dispatcher: Dispatcher
    sampler: GlobalBatchSampler
    scheduler: torch.optim.lr_scheduler.LambdaLR | None  # None on a rank with nothing to train
    token_counts: dict[str, Callable]  # per encoder, an item's metadata -> its tokens (`token_counters`)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.engine.optimizer

    def step(self, step: int, exact_timing: bool = False) -> RankStep:
        """One training iteration, as `loom train` runs it (``exact_timing``: synchronise the
        device around each action, for a trace)."""
        t0 = time.perf_counter()
        indices = self.sampler.batch(step)
        got = self.dispatcher.dispatch(indices, step)
        t1 = time.perf_counter()
        result = self.engine.step(got.batches, got.num_targets, step, exact_timing=exact_timing,
                                  layout=got.layout, rows=got.rows, num_generations=got.num_generations)
        t2 = time.perf_counter()
        if self.scheduler is not None:
            self.scheduler.step()
        terms = [LLM, *self.cfg.plan.generator_names]
        # the skip count rides along: one all-reduce for both
        loss = torch.tensor([*(result.module_losses.get(m, 0.0) for m in terms), len(got.skipped)], dtype=torch.float64)
        dist.all_reduce(loss)  # only the LLM's and the generators' last stages contribute
        *summed, skipped = loss.tolist()
        losses = dict(zip(terms, summed))
        return RankStep(step, indices, got, result, sum(losses.values()), losses, t1 - t0, t2 - t1,
                        time.perf_counter() - t0, skipped_samples=round(skipped))

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out split (the dataset's last ``data.eval_samples`` indices, in order, in
        global batches) through the same dispatcher and engine path as training, forward only
        (`ParallelEngine.evaluate`): per loss term (``"llm"``, each generator) its global mean over
        the split (tokens for the LLM, items for a generator, weighted as in training), the same on
        every rank. Leaves the run's state as it was. ``step``: the generators' noise seeds."""
        size, n = self.cfg.data.global_batch_size, self.cfg.data.eval_samples
        first = len(self.dataset) - n
        terms = [LLM, *self.cfg.plan.generator_names]
        sums = torch.zeros(2 * len(terms), dtype=torch.float64)  # per term: its loss summed, its count
        for start in range(first, first + n, size):
            got = self.dispatcher.dispatch(list(range(start, start + size)), step)
            counts = {LLM: got.num_targets, **got.num_generations}
            # normalised by 1: each loss term comes back summed over the batch, to be averaged over the split
            result = self.engine.evaluate(got.batches, 1, step, layout=got.layout, rows=got.rows,
                                          num_generations={g: 1 for g in got.num_generations})
            for i, m in enumerate(terms):
                sums[2 * i] += result.module_losses.get(m, 0.0)
                sums[2 * i + 1] += counts.get(m, 0) if self.dispatcher.rank == 0 else 0  # counts are global
        dist.all_reduce(sums)  # only the LLM's and the generators' last stages hold loss sums
        return {m: float(sums[2 * i] / max(1.0, float(sums[2 * i + 1]))) for i, m in enumerate(terms)}

    def close(self) -> None:
        """End the runtime's communication (`ParallelEngine.close`) before the process group goes."""
        self.engine.close()


def build_rank(cfg: TrainConfig, device: torch.device,
               data: tuple[Tokenizer, SampleSource] | None = None) -> RankRun:
    """This rank's share of the run ``cfg`` (the process group already initialised): the model
    from ``run.seed`` (`build_model`, identical on every rank) cut to this rank's stage by
    `ParallelEngine.create`, the run's optimizer and LR scheduler, the seeded
    `GlobalBatchSampler` and the `Dispatcher` under ``[balance]``. ``data`` replaces the demo
    tokenizer and dataset of `build_data` (a benchmark's own samples)."""
    tokenizer, dataset = build_data(cfg) if data is None else data
    # on meta: `ParallelEngine.create` materialises this rank's stage only (no rank holds the model)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")
    counters, arch = token_counters(model), arch_from_model(model)
    engine = ParallelEngine.create(model, cfg.plan, device, make_optimizer(cfg.optim),
                                   max_grad_norm=cfg.optim.max_grad_norm, dtype=cfg.run.dtype)
    engine.eager_forward = cfg.balance.eager_forward
    if cfg.plan.bubble_fill != "none":  # Optimus: decided above the runtime, on the simulator (loom.sim.bubble_fill)
        engine.schedule_transform = bubble_filler(cfg, model, dataset, engine.plan)
    scheduler = make_lr_scheduler(cfg, engine.optimizer) if engine.optimizer is not None else None
    held_out = cfg.data.eval_samples  # the dataset's last indices: run.eval_every's split, never trained on
    if held_out and held_out >= len(dataset):
        raise ConfigError(f"data.eval_samples = {held_out}: the dataset has {len(dataset)} samples, so none would be "
                          f"left to train on; hold out fewer (a multiple of data.global_batch_size)")
    sampler = GlobalBatchSampler(len(dataset) - held_out, cfg.data.global_batch_size, seed=cfg.run.seed)
    dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, counters, arch, cfg.balance, device,
                            pack=cfg.data.pack_sequences, generations=generation_specs(model),
                            microbatch_tokens=cfg.data.microbatch_tokens, on_error=cfg.data.on_error)
    dispatcher.held_out = held_out  # a skipped sample's replacement stays in its split
    return RankRun(cfg, device, tokenizer, dataset, engine, dispatcher, sampler, scheduler, counters)


def profiling_dispatcher(cfg: TrainConfig) -> Dispatcher:
    """The run's `Dispatcher` on this rank (the process group already initialised), on the
    CPU and without a balancing policy: what `loom profile` times to fit the dispatcher's host
    work (`loom.profile.dispatch`; the decision is priced on its own)."""
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed, device="meta")
    plan = cfg.plan.resolve(model.layer_counts(), dist.get_world_size(), generators=list(model.generators))
    return Dispatcher(plan, dataset, tokenizer, token_counters(model), arch_from_model(model), BalanceConfig(),
                      torch.device("cpu"), pack=cfg.data.pack_sequences, generations=generation_specs(model))
