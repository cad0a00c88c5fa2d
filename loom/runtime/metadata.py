"""The dispatcher's metadata all-gather: every rank's `SampleMeta`s (and its payload error, if
any) as one int64 row, every rank's row in one ``(ranks, width)`` table from one collective.

A rank's row is `loom.cost.workload.MetadataArrays.to_flat` of its loader shard (the codec the
simulator prices and `benchmarks/balance_speed.py` decodes, so all three run the same bytes).
Every rank pads its row to `gather_capacity`, fixed from the batch size, so one ``all_gather``
suffices; a row longer than that (many items per sample, a long error message) makes every rank
run one more ``all_gather`` at the longest row's length, decided from the first round's headers,
which every rank sees alike. `MetadataArrays.from_gathered` parses the table in a few array
passes, with no Python object per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from loom.cost.workload import MetadataArrays, gather_capacity, padded_row, row_lengths
from loom.data.sample import SampleMeta


def all_gather_metadata(metas: Sequence[SampleMeta], error: str | None, batch_size: int, device: torch.device,
                        group: dist.ProcessGroup | None = None) -> MetadataArrays:
    """The global batch's metadata (every rank's ``metas``, in rank order) and every rank's
    payload ``error`` (`MetadataArrays.errors`), from one ``all_gather`` (two when a row exceeds
    the capacity every rank derives from ``batch_size``)."""
    world = dist.get_world_size(group)
    row = MetadataArrays.from_metas(metas, error).to_flat()
    table = _all_gather(padded_row(row, gather_capacity(batch_size, world)), world, device, group)
    longest = int(row_lengths(table).max())
    if longest > table.shape[1]:  # every rank sees the same headers: all take this round or none
        table = _all_gather(padded_row(row, longest), world, device, group)
    return MetadataArrays.from_gathered(table)


def _all_gather(row: np.ndarray, world: int, device: torch.device, group: dist.ProcessGroup | None) -> np.ndarray:
    out = torch.empty((world, row.size), dtype=torch.int64, device=device)
    dist.all_gather(list(out.unbind(0)), torch.from_numpy(row).to(device), group=group)
    return out.cpu().numpy()
