"""Attention over packed sequences: every segment (an image, a clip, an LLM sample) attends only
to itself, at the cost of its own length² (what varlen kernels do on GPUs, and what the cost
model and the balancers assume)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def block_diagonal_mask(lengths: list[int], device: torch.device | str) -> torch.Tensor:
    """``[N, N]`` boolean mask (True = may attend) letting each packed item see only itself.
    What `segment_attention` computes without materialising it (kept as its test oracle)."""
    segment_ids = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, dtype=torch.long, device=device)
    )
    return segment_ids[:, None] == segment_ids[None, :]


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool = False
) -> torch.Tensor:
    """Attention of a packed sequence ``[heads, N, head_dim]`` in which each segment (item, or
    a packed LLM sample with ``causal``) attends only to itself: the block-diagonal mask's
    result, at the cost of the blocks alone (sum of length², what the cost model and the
    balancers assume; a dense ``[N, N]`` mask would cost N²). Segments of equal length run as
    one batched call, as varlen kernels do on GPUs."""
    if not any(lengths):
        # no items: an empty result that stays in the graph, so the block's parameters get
        # (zero) gradients exactly as with the dense mask
        return q * 0
    out = torch.empty_like(q)
    starts, offset = [], 0
    for n in lengths:
        starts.append(offset)
        offset += n
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(starts[i])
    for n, firsts in by_length.items():
        idx = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)[None, :]).reshape(-1)
        # [heads, G*n, d] -> [G, heads, n, d]
        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(1, idx).view(t.shape[0], len(firsts), n, t.shape[2]).transpose(0, 1)
        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), is_causal=causal)
        out.index_copy_(1, idx, o.transpose(0, 1).reshape(q.shape[0], len(firsts) * n, q.shape[2]))
    return out


class AttentionCore(nn.Module):
    """The scaled-dot-product core of attention (``softmax(q k^T / sqrt(d)) v``, no parameters)
    as a module of its own, so that it can be wrapped from outside: selective activation
    checkpointing recomputes only this part (`loom.runtime.recompute`). ``lengths`` None: one
    dense sequence per batch row; otherwise `segment_attention` over a packed sequence."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int] | None,
                causal: bool, attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                ) -> torch.Tensor:
        if attend is not None:  # context parallelism: the runtime's attention (its mask, its gather)
            return attend(q, k, v)
        if lengths is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return segment_attention(q, k, v, lengths, causal=causal)
