"""Which rows of an encoder's output belong to which sample, for routed encoder-to-LLM edges.

An encoder emits one row per token, samples one after another in its microbatch's order (each
sample's items in order: what `collate` lays out and the LLM's placeholder merge consumes). A
`BatchLayout` may send some samples of encoder microbatch ``j`` to LLM microbatch ``k`` and
others elsewhere; the encoder side picks the rows of a message's samples (`RowMap.index`) and the
LLM side puts the rows of every incoming message back into its own sample order
(`RowMap.assemble`). Token counts come from metadata, so both sides agree without exchanging
anything (docs/architecture.md principle 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.schedule.layout import BatchLayout
from loom.plan.plan import LLM


@dataclass
class RowMap:
    """``tokens[encoder][position]``: tokens encoder ``encoder`` emits for the sample at
    ``position`` of the global batch (0 when it has no items of that modality);
    ``items[encoder][position]``: how many items of that modality the sample has."""

    layout: BatchLayout
    tokens: dict[str, list[int]]
    items: dict[str, list[int]] = field(default_factory=dict)  # items of each sample per encoder
    _starts: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict, repr=False)

    def _start_rows(self, encoder: str, j: int) -> dict[int, int]:
        key = (encoder, j)
        if key not in self._starts:
            starts, row = {}, 0
            for s in self.layout.slots[encoder][j]:
                starts[s] = row
                row += self.tokens[encoder][s]
            self._starts[key] = starts
        return self._starts[key]

    def set_order(self, encoder: str, j: int, order: list[int]) -> None:
        """Encoder microbatch ``j``'s output rows follow ``order`` instead of the slot's order
        (a split microbatch forwarded part by part)."""
        starts, row = {}, 0
        for s in order:
            starts[s] = row
            row += self.tokens[encoder][s]
        self._starts[(encoder, j)] = starts

    def index(self, encoder: str, j: int, samples: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Rows of encoder microbatch ``j``'s output that hold ``samples``, in that order."""
        starts = self._start_rows(encoder, j)
        rows: list[int] = []
        for s in samples:
            rows.extend(range(starts[s], starts[s] + self.tokens[encoder][s]))
        return torch.tensor(rows, dtype=torch.long, device=device)

    def assemble(self, encoder: str, k: int, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """LLM microbatch ``k``'s rows of ``encoder`` in its own sample order, from the
        messages ``(source microbatch, rows)`` (each in the order `BatchLayout.sources` names
        their samples). Differentiable: each message's gradient is its rows' gradient."""
        routes = dict(self.layout.sources(encoder, k))
        pieces: dict[int, torch.Tensor] = {}
        for j, x in parts:
            row = 0
            for s in routes[j]:
                n = self.tokens[encoder][s]
                pieces[s] = x[row:row + n]
                row += n
            if row != x.shape[0]:
                raise ValueError(
                    f"{encoder} microbatch {j} sent {x.shape[0]} rows to LLM microbatch {k}, the metadata of "
                    f"samples {routes[j]} says {row}: the encoder's token count disagrees with its output"
                )
        ordered = [pieces[s] for s in self.layout.slots[LLM][k] if self.tokens[encoder][s]]
        # every part stays in the graph even when empty, so its (zero) gradient is defined
        return torch.cat(ordered) if ordered else torch.cat([x for _, x in parts])
