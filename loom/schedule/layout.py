"""Which samples each phase's microbatch slots hold in one iteration (the balancers' output).

A *phase* is a module of the plan (each encoder, and the LLM). One iteration has ``M``
microbatch *slots*; slot ``j`` of module ``m`` runs on replica ``j % dp_m`` (the plan's
round-robin rule), so a layout decides at once which data-parallel replica and which microbatch
of that replica's pipeline each sample goes to, per phase. Phases may disagree: a sample can
sit in encoder slot ``j`` and LLM slot ``k`` (OrchMLLM rearranges each phase on its own;
Entrain defers a sample's LLM work one microbatch). The routes between them are what the
schedule generator turns into activation edges and the executor into per-sample row exchanges.

Samples are named by their *position* in the global batch (``0..B-1``); the dispatcher maps
positions to dataset indices. `BatchLayout.check` is the "no sample dropped or duplicated"
guarantee every policy's output passes through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.plan.plan import LLM, Plan


class LayoutError(ValueError):
    """A layout that loses, duplicates or misroutes samples; the message names the phase."""


Slots = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class BatchLayout:
    """``slots[phase][j]``: positions (in the global batch) of the samples of slot ``j`` of
    ``phase``, in the order they are collated. ``policy`` records what produced it."""

    slots: dict[str, Slots]
    policy: dict[str, str] = field(default_factory=dict)

    @property
    def num_microbatches(self) -> int:
        return len(self.slots[LLM])

    @property
    def encoders(self) -> list[str]:
        return [p for p in self.slots if p != LLM]

    def slot_of(self, phase: str) -> dict[int, int]:
        """position -> slot of ``phase``."""
        return {s: j for j, slot in enumerate(self.slots[phase]) for s in slot}

    def is_identity(self) -> bool:
        """Every encoder slot holds exactly its LLM slot's samples (then the routes are the
        plain ``j -> j`` edges)."""
        return all(self.slots[e] == self.slots[LLM] for e in self.encoders)

    # ---- routes between an encoder and the LLM -------------------------------------------
    def consumers(self, encoder: str, j: int) -> list[tuple[int, tuple[int, ...]]]:
        """LLM slots fed by encoder slot ``j``, ascending: ``(k, positions)`` with the positions
        in LLM slot ``k``'s order (the order the rows are sent in)."""
        mine = set(self.slots[encoder][j])
        out = []
        for k, slot in enumerate(self.slots[LLM]):
            part = tuple(s for s in slot if s in mine)
            if part:
                out.append((k, part))
        return out

    def sources(self, encoder: str, k: int) -> list[tuple[int, tuple[int, ...]]]:
        """Encoder slots feeding LLM slot ``k``, ascending: ``(j, positions)``, the positions in
        LLM slot ``k``'s order (what `consumers` sends)."""
        slot_of = self.slot_of(encoder)
        by_source: dict[int, list[int]] = {}
        for s in self.slots[LLM][k]:
            by_source.setdefault(slot_of[s], []).append(s)
        return [(j, tuple(by_source[j])) for j in sorted(by_source)]

    # ---- checks --------------------------------------------------------------------------
    def check(self, batch_size: int, phases: list[str] | None = None) -> "BatchLayout":
        """Every phase's slots partition ``range(batch_size)`` into the same number of
        non-empty slots; raises `LayoutError` naming the phase, slot and sample otherwise."""
        if LLM not in self.slots:
            raise LayoutError(f"layout has no {LLM!r} phase; it has {sorted(self.slots)}")
        if phases is not None and sorted(phases) != sorted(self.slots):
            raise LayoutError(f"layout phases {sorted(self.slots)} differ from the plan's modules {sorted(phases)}")
        m = self.num_microbatches
        for phase, slots in self.slots.items():
            if len(slots) != m:
                raise LayoutError(f"phase {phase!r} has {len(slots)} slots, the LLM {m}: every phase needs the same count")
            seen: dict[int, int] = {}
            for j, slot in enumerate(slots):
                if not slot:
                    raise LayoutError(f"phase {phase!r} slot {j} is empty: every microbatch needs a sample")
                for s in slot:
                    if not 0 <= s < batch_size:
                        raise LayoutError(f"phase {phase!r} slot {j} names sample {s}, outside 0..{batch_size - 1}")
                    if s in seen:
                        raise LayoutError(f"phase {phase!r}: sample {s} is in slots {seen[s]} and {j} (duplicated)")
                    seen[s] = j
            if len(seen) != batch_size:
                missing = sorted(set(range(batch_size)) - set(seen))
                raise LayoutError(f"phase {phase!r} drops samples {missing[:10]} (of {batch_size})")
        return self

    def check_routes(self, plan: Plan) -> None:
        """Every encoder-to-LLM route stays within a round or goes one round forward.

        A *round* is ``R = lcm(data-parallel degrees)`` consecutive slots: the same number of
        microbatches of every replica of every module. Routes inside a round keep each
        replica's t-th microbatch depending only on the others' t-th ones, so the 1F1B order
        cannot deadlock; one round forward is Entrain's one-hop deferral (entrain.md §3.5.2),
        which the encoder's 1F1B lookahead (>= one own microbatch) covers. The validator's
        deadlock play remains the proof; this check gives the clear message.

        An identity layout (every encoder slot equal to its LLM slot) needs no rounds: its
        routes are the plan's own ``j -> j`` edges, which any microbatch count runs."""
        if self.is_identity():
            return
        r = round_size(plan)
        if self.num_microbatches % r:
            raise LayoutError(
                f"layout has {self.num_microbatches} microbatches, not a multiple of the round size {r} "
                f"(the lcm of the modules' data_parallel degrees)"
            )
        llm_slot = self.slot_of(LLM)
        for e in self.encoders:
            for j, slot in enumerate(self.slots[e]):
                for s in slot:
                    hop = llm_slot[s] // r - j // r
                    if hop not in (0, 1):
                        raise LayoutError(
                            f"sample {s}: {e} slot {j} feeds LLM slot {llm_slot[s]}, {hop} rounds of {r} slots "
                            f"away; routes must stay in the round or defer by one"
                        )


def max_over_mean(values: list[float] | tuple[float, ...]) -> float:
    """``max / mean`` of loads; 1.0 (nothing to balance) for an empty or all-zero list. The
    balance figure of the run directory, ``loom simulate --policy`` and the benchmarks."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def round_size(plan: Plan) -> int:
    return math.lcm(*(m.data_parallel for m in plan.modules))


def identity_layout(slots: list[list[int]] | Slots, phases: list[str], policy: str = "none") -> BatchLayout:
    """Every phase holds the same slots (the unbalanced layout, and DistTrain's)."""
    fixed = tuple(tuple(s) for s in slots)
    return BatchLayout({p: fixed for p in phases}, {p: policy for p in phases})
