"""Which rows of an encoder's output belong to which sample, for routed encoder-to-LLM edges
(and which rows of the LLM's states belong to which sample, for routed LLM-to-generator edges).

An encoder emits one row per token, samples one after another in its microbatch's order (each
sample's items in order: what `collate` lays out and the LLM's placeholder merge consumes). A
`BatchLayout` may send some samples of encoder microbatch ``j`` to LLM microbatch ``k`` and
others elsewhere; the encoder side picks the rows of a message's samples (`RowMap.index`) and the
LLM side puts the rows of every incoming message back into its own sample order
(`RowMap.assemble`). Token counts come from metadata, so both sides agree without exchanging
anything (docs/architecture.md principle 4). A generator's rows (``tokens[generator]``) are the
LLM's states at its generation positions, ``cond_tokens`` per request: the LLM's last stage
picks them in its own slot's order (``slot_phase = "llm"``), the generator assembles them into
its slot's order.
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

    def _start_rows(self, encoder: str, j: int, slot_phase: str | None = None) -> dict[int, int]:
        phase = encoder if slot_phase is None else slot_phase
        key = (encoder, j) if slot_phase is None else (encoder, j, phase)
        if key not in self._starts:
            starts, row = {}, 0
            for s in self.layout.slots[phase][j]:
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

    def index(self, encoder: str, j: int, samples: tuple[int, ...], device: torch.device,
              slot_phase: str | None = None) -> torch.Tensor:
        """Rows of encoder microbatch ``j``'s output that hold ``samples``, in that order
        (``slot_phase``: whose microbatch ``j`` the rows are laid out by, when not the module's
        own: the LLM's, for its states of a generator)."""
        starts = self._start_rows(encoder, j, slot_phase)
        rows: list[int] = []
        for s in samples:
            rows.extend(range(starts[s], starts[s] + self.tokens[encoder][s]))
        return torch.tensor(rows, dtype=torch.long, device=device)

    def assemble(self, encoder: str, k: int, parts: list[tuple[int, torch.Tensor]],
                 src: str | None = None, dst: str = LLM) -> torch.Tensor:
        """Microbatch ``k`` of ``dst`` (the LLM) gets its rows of ``encoder`` in its own sample
        order, from the messages ``(source microbatch, rows)`` of phase ``src`` (the encoder;
        the LLM for a generator's rows), each in the order `BatchLayout.routes_in` names their
        samples. Differentiable: each message's gradient is its rows' gradient."""
        src = encoder if src is None else src
        routes = dict(self.layout.routes_in(src, dst, k))
        pieces: dict[int, torch.Tensor] = {}
        for j, x in parts:
            row = 0
            for s in routes[j]:
                n = self.tokens[encoder][s]
                pieces[s] = x[row:row + n]
                row += n
            if row != x.shape[0]:
                raise ValueError(
                    f"{src} microbatch {j} sent {x.shape[0]} rows of {encoder} to {dst} microbatch {k}, the metadata "
                    f"of samples {routes[j]} says {row}: the token count disagrees with the output"
                )
        ordered = [pieces[s] for s in self.layout.slots[dst][k] if self.tokens[encoder][s]]
        # every part stays in the graph even when empty, so its (zero) gradient is defined
        return torch.cat(ordered) if ordered else torch.cat([x for _, x in parts])
