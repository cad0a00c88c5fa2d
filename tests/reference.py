"""Shared by the reference-semantics tests: what a worker saves and how the parent compares it
with the single-process model (docs/architecture.md principle 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loom.data.collate import collate, split_microbatches, target_count
from loom.data.sampler import GlobalBatchSampler
from loom.runtime.precision import Precision
from loom.train.build import build_data, build_model, token_counters
from loom.train.config import TrainConfig
from loom.train.rank import make_lr_scheduler, make_optimizer


def save_rank(path: Path, loss: float, named_parameters: dict[str, torch.nn.Parameter], **extra: Any) -> None:
    """A worker's result: the all-reduced loss, its stage's gradients (a TP shard's gathered
    whole: a collective over the TP group, whose ranks hold the same names in the same order),
    the parameters without one."""
    from torch.distributed.tensor import DTensor

    torch.save({
        "loss": loss,
        "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                  for n, p in named_parameters.items() if p.grad is not None},
        "no_grad": sorted(n for n, p in named_parameters.items() if p.grad is None),
        **extra,
    }, path)


def assert_matches_reference(results: list[dict[str, Any]], model: torch.nn.Module, ref_loss: float) -> None:
    """Every rank's loss equals the reference's, every gradient a rank holds equals the reference
    gradient, frozen parameters have none on either side, and every reference gradient was checked."""
    ref = dict(model.named_parameters())
    for r, res in enumerate(results):
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"rank {r} loss"
    seen: set[str] = set()
    for r, res in enumerate(results):
        for name, g in res["grads"].items():
            assert ref[name].grad is not None, f"rank {r}: {name} has a gradient but the reference has none"
            torch.testing.assert_close(g, ref[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {r} {name}: {m}")
            seen.add(name)
        for name in res["no_grad"]:
            assert ref[name].grad is None, f"rank {r}: {name} got no gradient but the reference has one"
            assert not ref[name].requires_grad, f"rank {r}: trainable {name} got no gradient"
    expected = {n for n, p in ref.items() if p.grad is not None}
    assert seen == expected, f"parameters whose gradient no rank checked: {sorted(expected - seen)}"


def global_batch(dataset, batch_size: int) -> tuple[list[int], int]:
    """The first ``batch_size`` samples of ``dataset`` and their target tokens (the loss's
    normalisation)."""
    indices = list(range(batch_size))
    return indices, sum(target_count(dataset.meta(i)) for i in indices)


def identity_step(engine, model, dataset, tokenizer, batch_size: int, step: int = 0, pack: bool = False):
    """One ``engine.step`` of this rank's microbatches of `global_batch` under the unbalanced
    layout (what the `Dispatcher` gives under policy "none"; ``pack``: each microbatch one
    packed row, as ``data.pack_sequences``); returns the step result and the loss summed over
    the ranks (the global batch's loss)."""
    indices, targets = global_batch(dataset, batch_size)
    parts = split_microbatches(indices, engine.plan.num_microbatches)
    counters = token_counters(model)
    batches = {j: collate([dataset[i] for i in parts[j]], tokenizer, counters, pack=pack)
               for j in engine.microbatches_to_load()}
    result = engine.step(batches, targets, step, layout=engine.identity_layout(batch_size))
    loss = torch.tensor([result.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    return result, float(loss)


def reference_backward(model, dataset, tokenizer, batch_size: int) -> float:
    """The single-process model's loss on `global_batch`, after its backward (gradients set)."""
    indices, targets = global_batch(dataset, batch_size)
    loss = model.loss(collate([dataset[i] for i in indices], tokenizer, token_counters(model)), targets)
    loss.backward()
    return float(loss.detach())


def single_process_losses(cfg: TrainConfig) -> list[float]:
    """The single-process run of ``cfg`` under its precision rule (`Precision.autocast` around
    the forward, fp32 parameters and AdamW, ``clip_grad_norm_``): the same model, sampler,
    optimizer and LR schedule as every rank of a parallel run."""
    precision = Precision(cfg.run.dtype, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
        counts = token_counters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(cfg.optim)(params)
        scheduler = make_lr_scheduler(cfg, optimizer)
        sampler = GlobalBatchSampler(len(dataset), cfg.data.global_batch_size, seed=cfg.run.seed)
        losses = []
        for step in range(cfg.run.steps):
            batch = collate([dataset[i] for i in sampler.batch(step)], tokenizer, counts)
            with precision.autocast():
                loss = model.loss(batch)
            loss.backward()
            if cfg.optim.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    return losses


# ---- a Hugging Face Llama as the LLM alone ----------------------------------------------------
def hf_llama(config: dict[str, Any], seed: int, device: str = "meta") -> Any:
    """A `MultimodalModel` whose LLM is an unmodified ``transformers.LlamaForCausalLM`` of
    ``config`` (no encoders), built on the meta device with ``init_seed`` ``seed``; materialised
    on ``device`` unless that is ``"meta"``."""
    import transformers

    from loom.model.multimodal import MultimodalModel

    with torch.device("meta"):
        model = MultimodalModel({}, transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)), {})
    model.init_seed = seed
    if device != "meta":
        model.materialise("llm", device)
    return model


def token_batch(vocab_size: int, samples: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (never 0) and their next-token labels, the last position unlabelled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (samples, length), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((samples, 1), -100)], dim=1)


def assert_layerwise_init_equals_whole(a: Any, b: Any, module: str) -> None:
    """Module ``module`` of ``a`` materialised one layer at a time (last first, as a stage may)
    and of ``b`` all at once, both from the same seed, hold equal tensors."""
    for index in reversed(range(len(a.module_layers(module)))):
        a.materialise(module, "cpu", index, index + 1)
    b.materialise(module, "cpu")
    for key, value in a.encoders[module].state_dict().items():
        assert torch.equal(value, b.encoders[module].state_dict()[key]), key
