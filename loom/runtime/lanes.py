"""An encoder in lanes: a colocated encoder at TP 1 beside an LLM at TP ``t`` runs one replica on
every rank of a unit (`loom.plan.plan.Plan.lanes`), and each rank forwards a contiguous share of
the unit's encoder microbatch's items; the outputs are gathered so every rank of the unit holds
the whole output, as the LLM's TP ranks need it (the unit contract of `loom.runtime.unit`: an
output crossing modules is the full tensor on every rank).

Backward: the gradient of the whole output is the same on every rank of the unit (the LLM's
input is replicated), so each rank back-propagates its own rows of it through its own share;
the replicas' parameter gradients, each a share's, add up in the data-parallel sync over all of
the encoder's replicas (its mesh's ``dp``). Items are independent through an encoder (each
image or clip attends to itself only), so the shares compute exactly the whole microbatch's
rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def lane_share(num_items: int, lanes: int, lane: int) -> range:
    """The items lane ``lane`` of ``lanes`` forwards: contiguous, sizes differing by at most one,
    the larger first."""
    base, extra = divmod(num_items, lanes)
    start = lane * base + min(lane, extra)
    return range(start, start + base + (1 if lane < extra else 0))


class _GatherRows(torch.autograd.Function):
    """All-gather of every lane's rows in lane order; backward: this lane's rows of the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        lanes, lane = dist.get_world_size(group), dist.get_rank(group)
        count = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
        counts = [torch.zeros_like(count) for _ in range(lanes)]
        dist.all_gather(counts, count, group=group)
        rows = [int(c) for c in counts]
        padded = local.new_zeros((max(rows), *local.shape[1:]))
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(lanes)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.start, ctx.rows = sum(rows[:lane]), rows[lane]
        return torch.cat([p[:n] for p, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[ctx.start:ctx.start + ctx.rows], None


def gather_lanes(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every lane's rows of ``group`` (the unit's TP group), in lane order, differentiable."""
    return _GatherRows.apply(local, group)
