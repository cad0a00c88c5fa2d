"""The zoo Llama under context parallelism (cornstarch.md §3.3.6) against the single-process
model, fp32, on packed multimodal rows (images and clips inside text, several samples per row):
each rank runs its tokens (positions and labels follow them), its loss is its tokens' share of
the row's mean, and parameter gradients summed over the CP group equal the reference's.

Two masks: ``item_attention="causal"`` is today's LLM mask, so the reference is the plain model
on the packed row (``segments``); ``"bidirectional"`` (an image's tokens see each other) is the
BAM's default, and the reference is the same model in one process attending with the BAM's
dense mask through the same hook."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.balance.context import distribute_tokens
from loom.data.bam import Span, bitfield_mask, dense_mask
from loom.model.zoo.llama import LlamaConfig, LlamaForCausalLM
from loom.runtime.context_parallel import rank_context
from loom.runtime.local import run_local

ROW = [[Span("text", 5), Span("vision", 9), Span("text", 7)],
       [Span("text", 3), Span("audio", 6), Span("text", 4), Span("vision", 5), Span("text", 6)],
       [Span("text", 8), Span("vision", 4), Span("text", 3)]]


@dataclass
class DenseMask:
    """The single-process reference's attention hook: every token, the BAM's dense mask."""

    mask: torch.Tensor  # bool [T, T]

    @property
    def tokens(self) -> torch.Tensor:
        return torch.arange(self.mask.shape[0])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), attn_mask=self.mask)


def _loss_sum(model: LlamaForCausalLM, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    logits = model(**inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _check(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=48))
    segments = [sum(s.length for s in spans) for spans in ROW]
    length = sum(segments)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, length), generator=g)
    labels = torch.randint(0, 64, (1, length), generator=g)
    ends = np.cumsum(segments) - 1
    labels[0, ends] = -100  # no next token across samples (collation's shifted labels)
    count = int((labels != -100).sum())
    for mode in ("causal", "bidirectional"):
        bam = bitfield_mask(ROW, item_attention=mode)
        model.zero_grad()
        if mode == "causal":
            ref = _loss_sum(model, {"input_ids": ids, "segments": segments}, labels) / count
        else:
            ref = _loss_sum(model, {"input_ids": ids, "context_parallel": DenseMask(torch.from_numpy(dense_mask(bam)))},
                            labels) / count
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for method in ("lpt", "random"):
            d = distribute_tokens(bam, world, 4, method=method, seed=3)
            rc = rank_context(bam, d, rank)
            model.zero_grad()
            loss = _loss_sum(model, {"input_ids": ids, "context_parallel": rc}, rc.select(labels)) / count
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            where = f"rank {rank} cp {world} {mode} {method}"
            torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
            for n, p in model.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                torch.testing.assert_close(grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {n}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
def test_llama_context_parallel_equals_single_process(cp: int) -> None:
    run_local(_check, cp)
