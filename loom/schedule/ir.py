"""The schedule IR (docs/architecture.md, "The schedule IR").

A schedule is, per rank, the ordered list of actions that rank performs in one training
iteration. Strictly, per *pipeline unit* (`loom.plan.plan`): the TP x CP ranks of one stage
replica run the same list together, and with TP = CP = 1 a unit is a rank. Generators (`loom.schedule.generators`) build it from a `Plan`; the validator
(`loom.schedule.validate`) proves it well formed; the executor (`loom.runtime.executor`) runs
it with real tensors and the simulator (`loom.sim`) plays it under a cost model. Both record timelines
in the same format.

Stages are named by ``(module, stage)``. Communication is explicit: a ``SEND_ACT`` on one rank
matches exactly one ``RECV_ACT`` on its peer (same microbatch, each naming the other as peer),
and likewise ``SEND_GRAD`` / ``RECV_GRAD`` for the gradient flowing back along the same edge.

Sends never block (they are posted asynchronously and completed at the end of the iteration);
receives block until the data arrives. A unit that hosts both ends of an edge (the LLM's first
position with its encoders under ``first_stage``) names itself as the peer: a local handoff. The validator's deadlock check uses exactly these
semantics.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class ActionKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    # ZB-H1's split backward (zero-bubble, Qi et al.): the input gradient the previous stage
    # waits for, and the weight gradients of the same microbatch, deferred. Their values are the
    # cost model's phase names, so the simulator prices each with one lookup.
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_ACT = "send_act"  # send this stage's output activation of a microbatch to peer
    RECV_ACT = "recv_act"  # receive an input activation of a microbatch from peer
    SEND_GRAD = "send_grad"  # send the gradient w.r.t. an input activation back to peer
    RECV_GRAD = "recv_grad"  # receive the gradient w.r.t. this stage's output from peer
    GRAD_SYNC = "grad_sync"  # all-reduce parameter gradients in the stage's data-parallel group
    OPTIMIZER_STEP = "optimizer_step"


# the compute actions that run (part of) a microbatch's backward
BACKWARDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
COMMUNICATION = {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
MATCHING = {
    ActionKind.SEND_ACT: ActionKind.RECV_ACT,
    ActionKind.RECV_ACT: ActionKind.SEND_ACT,
    ActionKind.SEND_GRAD: ActionKind.RECV_GRAD,
    ActionKind.RECV_GRAD: ActionKind.SEND_GRAD,
}


@dataclass(frozen=True)
class Action:
    """One piece of work on one rank.

    - ``module``, ``stage``: the stage this rank runs (for sends and receives: the stage on
      *this* side of the edge).
    - ``microbatch``: the microbatch index, ``-1`` for per-iteration actions (grad sync, step).
    - ``peer``, ``peer_module``, ``peer_stage``: for communication, the rank and stage on the
      other side of the edge. At the LLM's first stage, ``peer_module`` tells which encoder an
      activation came from (or a gradient goes to).
    - ``chunk``: the virtual pipeline chunk (0 until interleaved schedules exist).
    - ``samples``: the subset of the microbatch's samples the action covers (``None``: all):
      on a routed encoder-to-LLM edge the samples whose rows travel, in the LLM microbatch's
      order; on a ``BACKWARD`` one part of a split backward (Entrain, entrain.md §3.6).
    - ``peer_microbatch``: the microbatch on the other side of the edge when it differs
      (a balanced layout routes encoder microbatch ``j``'s samples to LLM microbatch ``k``);
      ``None`` means the same as ``microbatch``.
    """

    kind: ActionKind
    module: str
    stage: int
    microbatch: int = -1
    peer: int | None = None
    peer_module: str | None = None
    peer_stage: int | None = None
    chunk: int = 0
    samples: tuple[int, ...] | None = None
    peer_microbatch: int | None = None

    @property
    def other_microbatch(self) -> int:
        """The microbatch index on the peer's side of a communication."""
        return self.microbatch if self.peer_microbatch is None else self.peer_microbatch

    def short(self) -> str:
        """A compact label for traces and error messages, e.g. ``F llm.1 mb3``."""
        s = f"{_TAGS[self.kind]} {self.module}.{self.stage}"
        if self.microbatch >= 0:
            s += f" mb{self.microbatch}"
        if self.peer is not None:
            s += f"{_ARROWS[self.kind]}{self.peer}"
            if self.peer_microbatch is not None and self.peer_microbatch != self.microbatch:
                s += f".mb{self.peer_microbatch}"
        if self.kind is ActionKind.BACKWARD and self.samples is not None:
            s += f" part{list(self.samples)}"
        return s


_TAGS = {
    ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B", ActionKind.BACKWARD_INPUT: "BI",
    ActionKind.BACKWARD_WEIGHT: "W", ActionKind.SEND_ACT: "sendA", ActionKind.RECV_ACT: "recvA",
    ActionKind.SEND_GRAD: "sendG", ActionKind.RECV_GRAD: "recvG", ActionKind.GRAD_SYNC: "sync",
    ActionKind.OPTIMIZER_STEP: "step",
}
_ARROWS = {k: (" -> r" if k in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD) else " <- r") for k in ActionKind}


@dataclass
class Schedule:
    """Per-rank action lists for one iteration.

    ``needs_backward`` maps ``"module:stage"`` to whether that stage runs a backward at all
    (frozen-aware: a stage with nothing trainable in or upstream of it has none, cornstarch.md
    §3.2.1). ``kind`` is the generator's name ("gpipe", "1f1b", "zb-h1").
    """

    kind: str
    num_microbatches: int
    actions: dict[int, list[Action]]
    needs_backward: dict[str, bool] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.actions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_microbatches": self.num_microbatches,
            "needs_backward": dict(self.needs_backward),
            "actions": {str(r): [_action_to_dict(a) for a in acts] for r, acts in self.actions.items()},
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Schedule":
        actions = {
            int(r): [Action(**{**a, "kind": ActionKind(a["kind"]),
                               "samples": tuple(a["samples"]) if a.get("samples") is not None else None})
                     for a in acts]
            for r, acts in d["actions"].items()
        }
        return cls(d["kind"], d["num_microbatches"], actions, dict(d.get("needs_backward", {})))


def _action_to_dict(a: Action) -> dict[str, Any]:
    d = asdict(a)
    d["kind"] = a.kind.value
    return {k: v for k, v in d.items() if v is not None and not (k == "chunk" and v == 0)}


def stage_key(module: str, stage: int) -> str:
    return f"{module}:{stage}"
