"""What one generation of an elastic run looks like: its pipelines (the nodes' ranks, each an
instance of a pipeline template), each pipeline's one-replica `Plan`, and its share of the
global batch (Eq. 2.6, whole samples). The supervisor decides every generation
(`first_generation`, `next_generation`) and publishes it in the store; the workers only read
it, so every survivor builds the same layout (oobleck.md §3.6, "deterministic order").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from loom.plan.plan import Plan


class BeyondTolerance(RuntimeError):
    """More failed than ``[elastic] f`` allows: fewer than f + 1 pipelines, too few nodes, or a
    layer without a surviving copy. The message names the numbers."""


@dataclass
class Generation:
    """One layout of the run. ``pipelines[i]``: the ranks of pipeline ``i``, stage order (a node's
    ranks together); ``plans[i]``: its one-replica plan; ``samples[i]``: its samples of every
    global batch. ``lost``: every rank lost so far. ``stop``: set when this generation cannot be
    formed (beyond ``f``): the reason, in words."""

    number: int
    pipelines: list[list[int]]
    plans: list[Plan]
    samples: list[int]
    lost: list[int] = field(default_factory=list)
    stop: str = ""

    @property
    def members(self) -> list[int]:
        return sorted(r for p in self.pipelines for r in p)

    def pipeline_of(self, rank: int) -> int:
        for i, p in enumerate(self.pipelines):
            if rank in p:
                return i
        raise KeyError(f"rank {rank} is in no pipeline of generation {self.number}")

    def shares(self, indices: list[int]) -> list[list[int]]:
        """The global batch ``indices`` cut into the pipelines' contiguous shares (Eq. 2.6's
        counts): the same samples whatever the layout, so a redone step computes the same."""
        if sum(self.samples) != len(indices):
            raise ValueError(f"generation {self.number} splits {sum(self.samples)} samples, the batch has {len(indices)}")
        out, at = [], 0
        for n in self.samples:
            out.append(indices[at:at + n])
            at += n
        return out

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "pipelines": self.pipelines, "plans": [p.to_dict() for p in self.plans],
                           "samples": self.samples, "lost": self.lost, "stop": self.stop})

    @classmethod
    def from_json(cls, text: str) -> "Generation":
        d = json.loads(text)
        return cls(d["number"], d["pipelines"], [Plan.from_dict(p) for p in d["plans"]], d["samples"], d["lost"],
                   d["stop"])
