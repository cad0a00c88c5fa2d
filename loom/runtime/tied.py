"""Tied embeddings across pipeline stages, as Megatron-LM's embedding group.

A model whose input embedding and output head share one weight (``tie_word_embeddings``:
Gemma, small Qwen2, Llama-3.2) is one `loom.model.materialise.Tie`. Where both layers sit on
one stage the stage holds the single shared tensor, as the model does. Where they sit on
different stages, each stage holds its own copy, initialised equal (`MultimodalModel.materialise`),
and after each backward (and the data-parallel sync) the two copies' gradients are summed by one
all-reduce over the pair of ranks that hold them: each copy then carries the gradient of the
tied weight, ``d loss / d embedding + d loss / d head``, which is what the single process
computes, and equal optimizer steps keep the copies equal. The global gradient norm (clipping)
counts the tie once, through its first holder.

One pair group per data-parallel replica, built on every rank in the same order (group
creation is collective). Tensor and context parallelism, ZeRO and a tie split over two virtual
stages of one rank are refused with a `PlanError`: their shards and buckets are not paired yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom.model.multimodal import MultimodalModel
from loom.plan.plan import Plan, PlanError
from loom.runtime.stage import Stage


@dataclass
class TiedCopy:
    """This rank's copy of a weight tied to a copy on another pipeline stage."""

    name: str  # the parameter's name in the full model
    param: nn.Parameter
    group: dist.ProcessGroup  # the two ranks that hold the copies
    counts_in_norm: bool  # the first holder's copy counts the tie in the global gradient norm


def _stage_of(plan: Plan, module: str, layer: int) -> int:
    for s in range(plan.spec(module).num_stages):
        start, end = plan.layers_of(module, s)
        if start <= layer < end:
            return s
    raise PlanError(f"layer {layer} of {module!r} is on no stage")


def tied_copies(model: MultimodalModel, plan: Plan, rank: int, stages: list[Stage]) -> list[TiedCopy]:
    """The tied copies ``rank`` holds and the pair group each syncs over. Collective: every rank
    calls it, after `build_stages`, in the same order."""
    out = []
    held = {n: p for st in stages for n, p in st.named_parameters().items()}
    for tie in model.ties:
        spec = plan.spec(tie.module)
        first, second = _stage_of(plan, tie.module, tie.first[0]), _stage_of(plan, tie.module, tie.second[0])
        if first == second:
            continue  # one stage holds the tie whole, as the model does
        layers = model.module_layers(tie.module)
        names = (f"{layers[tie.first[0]].name}.{tie.first[1]}", f"{layers[tie.second[0]].name}.{tie.second[1]}")
        where = f"plan.modules[{tie.module!r}]"
        if spec.tensor_parallel > 1 or spec.context_parallel > 1 or spec.zero_stage > 0:
            raise PlanError(f"{where}: {names[0]} and {names[1]} are tied (tie_word_embeddings) and sit on stages "
                            f"{first} and {second}; loom sums tied copies across stages without tensor or context "
                            "parallelism or ZeRO only: set tensor_parallel = 1, context_parallel = 1 and "
                            "zero_stage = 0, or untie the model (tie_word_embeddings = false)")
        if spec.position_of(first) == spec.position_of(second):
            raise PlanError(f"{where}: {names[0]} and {names[1]} are tied and sit on two virtual stages of one "
                            f"rank ({first} and {second}); choose stage boundaries or virtual_stages that put them "
                            "on one stage or on different ranks")
        for replica in range(spec.data_parallel):
            pair = [plan.rank_of(tie.module, first, replica), plan.rank_of(tie.module, second, replica)]
            group = dist.new_group(pair)
            if rank in pair:
                name = names[pair.index(rank)]
                param = held[name]
                if param.requires_grad:
                    out.append(TiedCopy(name, param, group, counts_in_norm=rank == pair[0]))
    return out


def sync_tied(copies: list[TiedCopy]) -> None:
    """Sum each tied copy's gradient with its partner's (one all-reduce over the pair); a
    missing gradient joins as zeros. Call after the data-parallel sync, before clipping and
    the optimizer step."""
    for copy in copies:
        if copy.param.grad is None:
            copy.param.grad = torch.zeros_like(copy.param)
        dist.all_reduce(copy.param.grad, group=copy.group)
