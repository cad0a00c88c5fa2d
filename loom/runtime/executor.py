"""The executor: runs one rank's list of IR actions with real tensors and communication.

It is the runtime half of DESIGN.md's "schedule IR": the same actions the validator checks (and
the simulator plays) are executed here one by one, and each is recorded in a timeline.

Semantics that make a parallel run equal the single-process reference:
- the LLM's last stage scales each microbatch's summed token loss by the *global* number of
  target tokens, so the sum over microbatches and replicas is the reference mean loss;
- data-parallel gradient synchronisation is therefore a SUM all-reduce (no averaging);
- frozen parameters never get a ``.grad`` (backward runs only where the schedule says a stage
  needs one, and only through tensors that require grad).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loom.data.sample import Batch
from loom.model.layers import run_layers
from loom.model.multimodal import MultimodalModel, loss_sum
from loom.plan.plan import LLM, Plan
from loom.runtime.comm import P2PCommunicator
from loom.runtime.rows import RowMap
from loom.runtime.stage import Stage, move_batch
from loom.schedule.timeline import TimelineEvent
from loom.schedule.generators import backward_flow
from loom.schedule.ir import Action, ActionKind, Schedule

StageId = tuple[str, int]


@dataclass
class StepResult:
    loss: float  # this rank's share of the global mean loss (0 unless it computes the loss)
    timeline: list[TimelineEvent] = field(default_factory=list)


class PipelineExecutor:
    """Runs ``schedule.actions[rank]`` for one iteration at a time."""

    def __init__(
        self,
        model: MultimodalModel,
        plan: Plan,
        schedule: Schedule,
        stage: Stage,
        rank: int,
        device: torch.device,
        dp_groups: dict[StageId, dist.ProcessGroup | None],
        trainable: dict[StageId, bool],
        optimizer: torch.optim.Optimizer | None = None,
    ):
        self.model, self.plan, self.schedule, self.stage = model, plan, schedule, stage
        self.rank, self.device, self.optimizer = rank, device, optimizer
        self.actions = schedule.actions[rank]
        self.dp_group = dp_groups.get((stage.module, stage.stage))
        self.needs_backward, self.grad_edges = backward_flow(plan, trainable)
        self.edge_ids = _edge_ids(plan)
        self.comm = P2PCommunicator(device)

    # ---- one iteration -------------------------------------------------------------------
    def run(
        self,
        microbatches: dict[int, Batch],
        num_targets: int,
        step: int = 0,
        exact_timing: bool = True,
        schedule: Schedule | None = None,
        rows: "RowMap | None" = None,
    ) -> StepResult:
        """Run the iteration. ``microbatches`` holds (at least) the microbatches this rank
        works on, by global index; ``num_targets`` is the global batch's target-token count.

        A balanced iteration passes its own ``schedule`` (built for its `BatchLayout`) and the
        layout's `RowMap`, which says which rows of an encoder's output belong to which sample,
        so routed messages carry exactly their samples' rows.

        On a GPU, ``exact_timing`` synchronises after every compute action so the timeline
        shows when kernels ran, not when they were queued; turn it off for steps whose
        timeline is not kept, so the host can run ahead."""
        me: StageId = (self.stage.module, self.stage.stage)
        actions = self.actions if schedule is None else schedule.actions[self.rank]
        num_mb = (self.schedule if schedule is None else schedule).num_microbatches
        backward_parts = _count(actions, ActionKind.BACKWARD)
        # a routed forward output leaves in several messages: it is kept until the last one
        last_send = {a.microbatch: i for i, a in enumerate(actions) if a.kind is ActionKind.SEND_ACT}
        # Split backwards at an encoder's first stage run their forward per part too (entrain.md
        # §7.12's first option), so each part's backward covers only its own samples.
        split = _parts(actions) if self.stage.is_first and self.stage.module != LLM else {}
        part_outputs: dict[int, list[torch.Tensor]] = {}
        # mb -> {(source module, source microbatch): received activation}
        inputs: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        saved: dict[int, tuple[dict[tuple[str, int], torch.Tensor], torch.Tensor | None]] = {}
        out_grads: dict[int, torch.Tensor] = {}
        contexts: dict[int, dict[str, Any]] = {}
        batches: dict[int, Batch] = {}
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on device: no sync per microbatch
        events: list[TimelineEvent] = []
        sync = exact_timing and self.device.type == "cuda"

        for i, a in enumerate(actions):
            start = time.time()
            j = a.microbatch
            if a.kind is ActionKind.RECV_ACT:
                x = self.comm.recv(a.peer, self._tag((a.peer_module, a.peer_stage), me, a.other_microbatch, j, num_mb, grad=False))
                if ((a.peer_module, a.peer_stage), me) in self.grad_edges:
                    x.requires_grad_(True)
                inputs.setdefault(j, {})[(a.peer_module, a.other_microbatch)] = x
            elif a.kind is ActionKind.FORWARD:
                if j not in batches:
                    batches[j] = move_batch(self._microbatch(microbatches, j), self.device)
                    if j not in split:  # a split microbatch builds one context per part
                        contexts[j] = self.model.module_context(self.stage.module, batches[j])
                received = inputs.pop(j, {})
                with torch.set_grad_enabled(self.needs_backward[me]):
                    if j in split:
                        part_outputs[j] = self._forward_parts(batches[j], j, split[j], rows)
                        out = torch.cat(part_outputs[j])
                    else:
                        out = run_layers(self.stage.layers, self._stage_input(received, j, rows), contexts[j])
                    if self.stage.computes_loss:
                        out = loss_sum(out, batches[j].labels) / num_targets
                        loss_total += out.detach()
                saved[j] = (received, out)
            elif a.kind is ActionKind.SEND_ACT:
                out = saved[j][1]
                if a.samples is not None:  # a routed edge: only the rows of the named samples
                    out = out.detach().index_select(0, rows.index(self.stage.module, j, a.samples, out.device))
                self.comm.send(out, a.peer, self._tag(me, (a.peer_module, a.peer_stage), j, a.other_microbatch, num_mb, grad=False))
                if not self.needs_backward[me] and i == last_send[j]:
                    saved.pop(j)  # nothing will flow back: drop the activation now
            elif a.kind is ActionKind.RECV_GRAD:
                g = self.comm.recv(a.peer, self._tag(me, (a.peer_module, a.peer_stage), j, a.other_microbatch, num_mb, grad=True))
                if a.samples is None:
                    out_grads[j] = g
                else:  # rows of some samples: scatter into this microbatch's pending gradient
                    out = saved[j][1]
                    if j not in out_grads:
                        out_grads[j] = torch.zeros_like(out)
                    out_grads[j].index_copy_(0, rows.index(self.stage.module, j, a.samples, out.device), g)
            elif a.kind is ActionKind.BACKWARD:
                received, out = saved[j]
                grad = None if self.stage.computes_loss else out_grads.pop(j)
                backward_parts[j] -= 1
                last_part = backward_parts[j] == 0
                # An output can be independent of everything trainable for one microbatch (a
                # frozen LLM stage whose microbatch has no image tokens to merge): then there is
                # nothing to propagate and the input gradient sent back is zero.
                if j in part_outputs:  # a split backward over per-part forwards: this part's rows only
                    part = split[j].index(a.samples)
                    first_row = sum(t.shape[0] for t in part_outputs[j][:part])
                    piece = part_outputs[j][part]
                    if piece.requires_grad:
                        torch.autograd.backward(piece, grad[first_row:first_row + piece.shape[0]])
                    part_outputs[j][part] = piece.detach()
                    if last_part:
                        del part_outputs[j]
                elif out.requires_grad:
                    # A split backward on a later encoder stage (entrain.md §3.6) runs the stage's
                    # graph once per part with that part's rows of the gradient (zeros elsewhere);
                    # by linearity the parts sum to the whole; the graph is kept until the last.
                    torch.autograd.backward(out, grad, retain_graph=not last_part)
                if last_part:
                    # keep only the inputs whose gradients still have to be sent back
                    pending = {k: t for k, t in received.items() if t.requires_grad}
                    if pending:
                        saved[j] = (pending, None)
                    else:
                        saved.pop(j)
                    contexts.pop(j, None)
                    batches.pop(j, None)
            elif a.kind is ActionKind.SEND_GRAD:
                received, _ = saved[j]
                key = (a.peer_module, a.other_microbatch)
                x = received[key]
                g = x.grad if x.grad is not None else torch.zeros_like(x)  # input unused (no tokens)
                self.comm.send(g, a.peer, self._tag((a.peer_module, a.peer_stage), me, a.other_microbatch, j, num_mb, grad=True))
                del received[key]
                if not received:
                    saved.pop(j)
            elif a.kind is ActionKind.GRAD_SYNC:
                self._sync_gradients()
            elif a.kind is ActionKind.OPTIMIZER_STEP:
                if self.optimizer is not None:
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            else:  # pragma: no cover - the validator rejects unknown kinds
                raise ValueError(f"rank {self.rank}: cannot execute {a.short()}")
            if sync and a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                torch.cuda.synchronize(self.device)
            events.append(_event(self.rank, a, start, time.time(), step))
            if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                self.comm.release_completed()

        self.comm.wait_sends()
        return StepResult(float(loss_total), events)

    # ---- helpers -------------------------------------------------------------------------
    def _stage_input(self, received: dict[tuple[str, int], torch.Tensor], j: int, rows: "RowMap | None") -> Any:
        if self.stage.is_first and self.stage.module != LLM:
            return None  # encoder first stages read the microbatch from their context
        if self.stage.is_first:  # the LLM's first stage merges every encoder's tokens
            parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
            for (module, source), x in received.items():
                parts.setdefault(module, []).append((source, x))
            if rows is None:
                return {m: x for m, ((_, x),) in parts.items()}
            return {m: rows.assemble(m, j, sorted(p, key=lambda t: t[0])) for m, p in parts.items()}
        (x,) = received.values()
        return x

    def _forward_parts(self, batch: Batch, j: int, parts: list[tuple[int, ...]], rows: "RowMap") -> list[torch.Tensor]:
        """Forward of an encoder microbatch one part at a time (each part's samples in the
        microbatch's order); the rows of the concatenated output follow the parts, which
        ``rows`` is told so routed messages still pick the right rows."""
        module = self.stage.module
        slot = rows.layout.slots[module][j]
        key, items = next(iter(batch.modality_inputs[module].items()))
        first_item, n = {}, 0
        for s in slot:
            first_item[s] = n
            n += rows.items[module][s]
        outs, order = [], []
        for part in parts:
            members = [s for s in slot if s in set(part)]
            sub_items = [items[i] for s in members for i in range(first_item[s], first_item[s] + rows.items[module][s])]
            sub = dataclasses.replace(batch, modality_inputs={module: {key: sub_items}},
                                      sample_ids=[batch.sample_ids[slot.index(s)] for s in members])
            outs.append(run_layers(self.stage.layers, None, self.model.module_context(module, sub)))
            order.extend(members)
        rows.set_order(module, j, order)
        return outs

    def _microbatch(self, microbatches: dict[int, Batch], j: int) -> Batch:
        if j not in microbatches:
            raise KeyError(f"rank {self.rank} runs microbatch {j} but was not given it (has {sorted(microbatches)})")
        return microbatches[j]

    def _tag(self, src: StageId, dst: StageId, src_mb: int, dst_mb: int, num_mb: int, grad: bool) -> int:
        """One tag per (edge, sender microbatch, receiver microbatch, direction)."""
        return ((src_mb * num_mb + dst_mb) * len(self.edge_ids) + self.edge_ids[(src, dst)]) * 2 + int(grad)

    def _sync_gradients(self) -> None:
        """SUM all-reduce of the stage's trainable gradients across its data-parallel replicas,
        in one flat bucket."""
        if self.dp_group is None:
            return
        params = self.stage.trainable_parameters()
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g


def _edge_ids(plan: Plan) -> dict[tuple[StageId, StageId], int]:
    edges: list[tuple[StageId, StageId]] = []
    for m in plan.modules:
        for s in range(m.num_stages - 1):
            edges.append(((m.name, s), (m.name, s + 1)))
        if m.name != LLM:
            edges.append(((m.name, m.num_stages - 1), (LLM, 0)))
    return {e: i for i, e in enumerate(edges)}


def _count(actions: list[Action], kind: ActionKind) -> dict[int, int]:
    counts: dict[int, int] = {}
    for a in actions:
        if a.kind is kind:
            counts[a.microbatch] = counts.get(a.microbatch, 0) + 1
    return counts


def _parts(actions: list[Action]) -> dict[int, list[tuple[int, ...]]]:
    """Microbatch -> the sample tuples of its split-backward parts, in schedule order."""
    parts: dict[int, list[tuple[int, ...]]] = {}
    for a in actions:
        if a.kind is ActionKind.BACKWARD and a.samples is not None:
            parts.setdefault(a.microbatch, []).append(a.samples)
    return parts


def _event(rank: int, a: Action, start: float, end: float, step: int) -> TimelineEvent:
    return TimelineEvent(rank, a.kind.value, a.short(), a.module, a.stage, a.microbatch, start, end, step)
