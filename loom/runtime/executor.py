"""The executor: runs one rank's list of IR actions with real tensors and communication.

It is the runtime half of docs/architecture.md's "schedule IR": the same actions the validator checks (and
the simulator plays) are executed here one by one, and each is recorded in a timeline.

Every iteration runs one schedule built for its `BatchLayout` (the identity layout when no
balancing policy is set) and, where encoder rows are routed by sample, that layout's `RowMap`.
Per microbatch, everything the iteration holds (the batch, received activations, the output
kept for backward, the incoming gradient, split-backward parts) lives in one `MicrobatchState`;
each action kind has one handler. What depends only on the schedule (tags, handlers, timeline
labels, how many backward parts and sends each microbatch has) is computed once per schedule
(`ActionPlan`), so the per-action cost is a handler call and the communication itself.

A rank runs its pipeline unit's actions (``schedule.actions[unit]``); with tensor or context
parallelism a unit has several ranks, and `loom.runtime.unit.UnitPlace` says which ranks each
message goes to and comes from, who reports the loss and how gradients are counted. A unit
hosts one stage, or several (virtual stages, interleaved 1F1B): each action names its stage,
and per-microbatch state is kept per (stage, microbatch).

Semantics that make a parallel run equal the single-process reference:
- the LLM's last stage scales each microbatch's summed token loss by the *global* number of
  target tokens, so the sum over microbatches and replicas is the reference mean loss; a
  generator's last stage scales its summed item loss by its ``loss_weight`` over the *global*
  number of its items likewise;
- with generators (DistTrain's encoder -> LLM -> generator, disttrain.md §1) the LLM's last
  stage also sends each generator its final states at that generator's generation positions and
  gets their gradients back; its backward then runs on one scalar, the loss plus each state
  tensor's dot product with its received gradient, whose gradient is exactly the sum of both;
- data-parallel gradient synchronisation is therefore a SUM all-reduce (no averaging);
- frozen parameters never get a ``.grad`` (backward runs only where the schedule says a stage
  needs one, and only through tensors that require grad);
- gradient clipping (``max_grad_norm`` > 0) scales by the *global* L2 norm: each stage's first
  replica adds its gradients' squared norm (replicas hold equal gradients after the sync), one
  SUM all-reduce over the world gives the total, so every rank scales by the same
  ``min(1, max_norm / (norm + 1e-6))`` that ``torch.nn.utils.clip_grad_norm_`` applies to the
  single-process model. Ranks with an ``OPTIMIZER_STEP`` join it there, after their gradient
  sync; ranks without one (frozen stages) join after their last action, so every rank calls
  the collective once per iteration and none waits on a peer that waits on it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from loom.data.sample import Batch
from loom.model.layers import run_layers
from loom.model.multimodal import MultimodalModel, loss_sum
from loom.plan.plan import LLM, Plan
from loom.runtime.comm import P2PCommunicator
from loom.runtime.context_parallel import RankContext, microbatch_context, select_features
from loom.runtime.lanes import gather_lanes, lane_share
from loom.runtime.precision import Precision
from loom.runtime.rows import RowMap
from loom.runtime.split_backward import WeightPass, backward_input, backward_weight, fsdp_defer, fsdp_reduce
from loom.runtime.stage import Stage, move_batch
from loom.runtime.unit import UnitPlace, local_tensor, settle_gradients, sync_gradients
from loom.runtime.tied import TiedCopy, sync_tied
from loom.runtime.zero import ZeroStage
from loom.schedule.generators import backward_flow
from loom.schedule.ir import BACKWARDS, Action, ActionKind, Schedule
from loom.schedule.timeline import TimelineEvent

StageId = tuple[str, int]
Edge = tuple[StageId, StageId]
# per-microbatch state on a rank: (module, stage, microbatch); a rank may host several stages
_Key = tuple[str, int, int]
# a channel whose activation shape is leading dims both sides derive from metadata plus fixed
# trailing dims, learned from the first message on it: (dtype, trailing dims)
_ActShape = tuple[torch.dtype, tuple[int, ...]]


class StepResult:
    """``loss``: this rank's share of the global mean loss (0 unless it computes the loss);
    ``timeline``: one `TimelineEvent` per action that ran, built on first access (the training
    loop keeps only the last step's)."""

    __slots__ = ("loss", "module_losses", "grad_norm", "_rank", "_step", "_plan", "_times", "_timeline")

    def __init__(self, loss: float, rank: int, step: int, plan: "ActionPlan", times: list[float],
                 grad_norm: float | None = None, module_losses: dict[str, float] | None = None):
        self.loss = loss
        # this rank's share of each loss term by the module that computes it ("llm", each
        # generator); ``loss`` is their sum
        self.module_losses = module_losses or {}
        self.grad_norm = grad_norm  # the global gradient norm before clipping (None: clipping off)
        self._rank, self._step, self._plan, self._times = rank, step, plan, times
        self._timeline: list[TimelineEvent] | None = None

    @property
    def timeline(self) -> list[TimelineEvent]:
        if self._timeline is None:
            t, rank, step = self._times, self._rank, self._step
            self._timeline = [TimelineEvent(rank, a.kind.value, label, a.module, a.stage, a.microbatch,
                                            t[2 * i], t[2 * i + 1], step)
                              for i, (a, label) in enumerate(zip(self._plan.actions, self._plan.labels))]
        return self._timeline


@dataclass
class MicrobatchState:
    """What one microbatch holds on this rank during an iteration."""

    batch: Batch | None = None  # on the device, from the first forward until the last backward
    context: dict[str, Any] | None = None  # the module context (none for a split microbatch)
    # received activations by (source module, source microbatch); after the backward only those
    # whose gradient has still to be sent back
    inputs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    output: torch.Tensor | None = None  # the forward output (the loss at the LLM's last stage)
    parts: list[torch.Tensor] | None = None  # per-part outputs of a split forward
    out_grad: torch.Tensor | None = None  # gradient w.r.t. ``output`` from the next stage
    backward_left: int = 0  # backward actions (parts) still to run
    weight_pass: WeightPass | None = None  # ZB-H1: what the input pass left for the weight pass
    # the LLM's last stage with generators: its states per generator, and their gradients back
    sends: dict[str, torch.Tensor] | None = None
    send_grads: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ActionPlan:
    """What one schedule's action list needs at run time, computed once per schedule."""

    actions: list[Action]
    handlers: list[Callable[..., None]]
    tags: list[int]
    labels: list[str]
    backward_parts: dict[_Key, int]  # (module, stage, microbatch) -> its backward actions (split parts)
    last_send: dict[_Key, int]  # (module, stage, microbatch) -> index of its last SEND_ACT
    split: dict[_Key, list[tuple[int, ...]]]  # split-backward parts at encoder first stages
    routed: bool  # some action names samples: the iteration needs a RowMap
    last_step: int = -1  # index of the last OPTIMIZER_STEP (the rank's optimizer steps there; clipping joins the norm's all-reduce)
    last_backward: int = -1  # index of the last BACKWARD or weight pass (where ZeRO 2/3 reduce: loom.runtime.zero)


class _Iteration:
    """The state of the iteration being run (handlers read and update it)."""

    __slots__ = ("plan", "microbatches", "num_targets", "num_generations", "rows", "states", "loss_total",
                 "grad_norm", "cp", "cp_blocks", "local")

    def __init__(self, plan: ActionPlan, microbatches: dict[int, Batch], num_targets: int, rows: RowMap | None,
                 cp_blocks: dict[int, int] | None = None, num_generations: dict[str, int] | None = None):
        self.plan, self.microbatches, self.num_targets, self.rows = plan, microbatches, num_targets, rows
        self.num_generations = num_generations or {}
        self.states: dict[_Key, MicrobatchState] = {}
        # per loss-computing module, summed on the device: no host sync per microbatch
        self.loss_total: dict[str, torch.Tensor] = {}
        self.grad_norm: float | None = None
        self.cp: dict[int, RankContext] = {}  # per LLM microbatch, this rank's CP context
        self.cp_blocks = cp_blocks or {}  # per LLM microbatch, its CP block size (UnitPlace.prepare_microbatches)
        self.local: dict[int, torch.Tensor] = {}  # by tag: messages between stages the unit hosts

    def state(self, key: _Key) -> MicrobatchState:
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = MicrobatchState(backward_left=self.plan.backward_parts.get(key, 0))
        return st


class PipelineExecutor:
    """Runs this rank's actions of a schedule for one iteration at a time."""

    def __init__(
        self,
        model: MultimodalModel,
        plan: Plan,
        stages: list[Stage],
        rank: int,
        device: torch.device,
        dp_groups: dict[StageId, dist.ProcessGroup | None],
        trainable: dict[StageId, bool],
        optimizer: torch.optim.Optimizer | None = None,
        max_grad_norm: float = 0.0,
        precision: Precision | None = None,
        unit: UnitPlace | None = None,
        zero: ZeroStage | None = None,
        tied: list[TiedCopy] | None = None,
    ):
        self.model, self.plan = model, plan
        # the stages this rank hosts (one, or its chunks under virtual stages); they share the
        # module and replica, so `stage` (the first) answers for the rank as a whole
        self.stages: dict[StageId, Stage] = {(st.module, st.stage): st for st in stages}
        self.stage = stages[0]
        # run.dtype: autocast around forwards, stage outputs sent in bf16 (loom.runtime.precision)
        self.precision = precision if precision is not None else Precision(device_type=device.type)
        self.max_grad_norm = max_grad_norm or 0.0  # 0 (or None): no clipping
        self.rank, self.device, self.optimizer = rank, device, optimizer
        # the rank's pipeline unit: which actions it runs and its peers' ranks (loom.runtime.unit)
        self.unit = unit if unit is not None else UnitPlace.of(plan, rank)
        self.zero = zero  # ZeRO 2/3: FSDP reduces the stage's gradients in its last backward
        self.dp_groups = dp_groups
        self.tied = list(tied or [])  # tied embeddings across stages: gradients summed before the step
        self.needs_backward, self.grad_edges = backward_flow(plan, trainable)
        self.edge_ids = _edge_ids(plan)
        self.generators = set(plan.generator_names)
        self.comm = P2PCommunicator(device)
        self._handlers: dict[ActionKind, Callable[..., None]] = {
            ActionKind.RECV_ACT: self._recv_act,
            ActionKind.FORWARD: self._forward,
            ActionKind.SEND_ACT: self._send_act,
            ActionKind.RECV_GRAD: self._recv_grad,
            ActionKind.BACKWARD: self._backward,
            ActionKind.BACKWARD_INPUT: self._backward_input,
            ActionKind.BACKWARD_WEIGHT: self._backward_weight,
            ActionKind.SEND_GRAD: self._send_grad,
            ActionKind.GRAD_SYNC: self._grad_sync,
            ActionKind.OPTIMIZER_STEP: self._optimizer_step,
        }
        self._plans: dict[int, tuple[Schedule, ActionPlan]] = {}
        # per channel (edge, sending unit, receiving unit), the activation's trailing dims, learned
        # from its first message (see _lead_dims); None: the channel's shapes do not follow the
        # rule, its messages keep their header. Both units name a channel: with replicated stages
        # on the same units (colocated data parallelism, samples routed between replicas) a unit
        # sends and receives on the same edge, and each direction learns on its own
        self._act_shapes: dict[tuple[StageId, StageId, int, int], _ActShape | None] = {}
        # the last iteration's CP context per LLM microbatch (context parallelism; for inspection)
        self.cp_contexts: dict[int, RankContext] = {}
        # called once per training iteration after the gradients are complete on this rank (after
        # the replicas' and tied copies' sums) and before clipping and the optimizer step, with the
        # iteration's loss shares per module (device tensors); what runs above the runtime hooks in
        # here: loom.elastic's layer-wise sync across heterogeneous pipelines and its commit vote.
        # It may raise to abandon the iteration before any parameter changes.
        self.before_update: Callable[[dict[str, torch.Tensor]], None] | None = None

    # ---- one iteration -------------------------------------------------------------------
    def run(
        self,
        schedule: Schedule,
        microbatches: dict[int, Batch],
        num_targets: int,
        rows: RowMap | None = None,
        step: int = 0,
        exact_timing: bool = True,
        num_generations: dict[str, int] | None = None,
        forward_only: bool = False,
    ) -> StepResult:
        """Run this rank's actions of ``schedule`` (built for the iteration's `BatchLayout`).
        ``microbatches`` holds (at least) the microbatches this rank works on, by slot;
        ``num_targets`` is the global batch's target-token count (``num_generations``, per
        generator, its items in the global batch); ``rows`` is the layout's
        `RowMap`, which says which rows of an encoder's output belong to which sample, so
        routed messages carry exactly their samples' rows (needed when the schedule routes).

        On a GPU, ``exact_timing`` synchronises after every compute action so the timeline
        shows when kernels ran, not when they were queued; turn it off for steps whose
        timeline is not kept, so the host can run ahead."""
        plan = self.action_plan(schedule)
        microbatches, cp_blocks = self.unit.prepare_microbatches(microbatches, self.model.placeholder_ids)
        if plan.routed and rows is None:
            raise ValueError(f"rank {self.rank}: this schedule routes encoder rows by sample; pass the layout's RowMap "
                             f"as rows= (Dispatched.rows)")
        it = _Iteration(plan, microbatches, num_targets, rows, cp_blocks, num_generations)
        sync = exact_timing and self.device.type == "cuda"
        compute = (ActionKind.FORWARD, *BACKWARDS)
        times: list[float] = []
        clock = time.time
        for i, (handler, a, tag) in enumerate(zip(plan.handlers, plan.actions, plan.tags)):
            start = clock()
            handler(it, i, a, tag)
            if sync and a.kind in compute:
                torch.cuda.synchronize(self.device)
            times.append(start)
            times.append(clock())
        if plan.last_step < 0 and not forward_only and self.before_update is not None:
            self.before_update(it.loss_total)  # no optimizer step here: the hook runs after the last action
        if self.max_grad_norm > 0 and plan.last_step < 0 and not forward_only:  # no optimizer step here: join the norm now
            it.grad_norm = self._clip_gradients()
        self.comm.wait_sends()
        self.cp_contexts = it.cp
        losses = {m: float(t) for m, t in it.loss_total.items()}
        return StepResult(sum(losses.values()), self.rank, step, plan, times, it.grad_norm, losses)

    def close(self) -> None:
        """Wait for every send still in flight, so the process group can be destroyed safely
        (gloo aborts a process whose group is destroyed under a pending send)."""
        self.comm.wait_sends()

    def action_plan(self, schedule: Schedule) -> ActionPlan:
        """This rank's actions of ``schedule`` with their handlers, tags and labels (cached
        per schedule object; the engine keeps one schedule per layout)."""
        got = self._plans.get(id(schedule))
        if got is not None and got[0] is schedule:
            return got[1]
        actions = schedule.actions[self.unit.unit]
        n = schedule.num_microbatches
        backward_parts: dict[_Key, int] = {}
        last_send: dict[_Key, int] = {}
        split: dict[_Key, list[tuple[int, ...]]] = {}
        tags = []
        for i, a in enumerate(actions):
            me = (a.module, a.stage)
            if a.kind not in self._handlers:  # pragma: no cover - the validator rejects unknown kinds
                raise ValueError(f"rank {self.rank}: cannot execute {a.short()}")
            peer = (a.peer_module, a.peer_stage)
            j, k = a.microbatch, a.other_microbatch
            tag = 0
            if a.kind is ActionKind.RECV_ACT:
                tag = self._tag(peer, me, k, j, n, grad=False)
            elif a.kind is ActionKind.SEND_ACT:
                tag = self._tag(me, peer, j, k, n, grad=False)
                last_send[(a.module, a.stage, j)] = i
            elif a.kind is ActionKind.RECV_GRAD:
                tag = self._tag(me, peer, j, k, n, grad=True)
            elif a.kind is ActionKind.SEND_GRAD:
                tag = self._tag(peer, me, k, j, n, grad=True)
            elif a.kind in BACKWARDS:
                backward_parts[(a.module, a.stage, j)] = backward_parts.get((a.module, a.stage, j), 0) + 1
                if a.samples is not None and a.stage == 0 and a.module != LLM:
                    split.setdefault((a.module, a.stage, j), []).append(a.samples)
            tags.append(tag)
        # Split backwards at an encoder's first stage run their forward per part too (entrain.md
        # §7.12's first option), so each part's backward covers only its own samples.
        plan = ActionPlan(actions, [self._handlers[a.kind] for a in actions], tags, [a.short() for a in actions],
                          backward_parts, last_send, split, any(a.samples is not None for a in actions),
                          max((i for i, a in enumerate(actions) if a.kind is ActionKind.OPTIMIZER_STEP), default=-1),
                          max((i for i, a in enumerate(actions)
                               if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)), default=-1))
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[id(schedule)] = (schedule, plan)
        return plan

    # ---- one handler per action kind -----------------------------------------------------
    def _recv_act(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        src, me = (a.peer_module, a.peer_stage), (a.module, a.stage)
        channel = (src, me, a.peer, self.unit.unit)
        lead = self._lead_dims(it, src, me, a.other_microbatch, a.microbatch, a.samples)
        known = self._act_shapes.get(channel) if lead is not None else None
        if a.peer == self.unit.unit:  # from a stage this unit hosts: a local handoff
            x = it.local.pop(tag)
        elif known is not None:
            x = self.comm.recv_shaped((*lead, *known[1]), known[0], self.unit.source(a.peer), tag)
        else:
            x = self.comm.recv(self.unit.source(a.peer), tag)
            if lead is not None and channel not in self._act_shapes:
                self._act_shapes[channel] = _learn(x, lead)
        if (src, me) in self.grad_edges:
            x.requires_grad_(True)
        it.state((a.module, a.stage, a.microbatch)).inputs[(a.peer_module, a.other_microbatch)] = x

    def _forward(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        j = a.microbatch
        stage = self.stages[(a.module, a.stage)]
        st = it.state((a.module, a.stage, j))
        split = it.plan.split.get((a.module, a.stage, j))
        if st.batch is None:
            batch = self._microbatch(it.microbatches, j, a.module)
            if stage.generator and self.plan.item_shares(stage.module) > 1:  # this TP rank's share of the images
                batch = self._generator_share(batch, stage.module)
            st.batch = move_batch(batch, self.device)
            if split is None:  # a split microbatch builds one context per part
                st.context = self.model.module_context(stage.module, st.batch, self._cp_context(it, j, stage.module))
                if stage.computes_loss and stage.module == LLM and self.generators and self.unit.size > 1:
                    rc = self._cp_context(it, j, LLM)
                    st.context["gather_sequence"] = lambda x, rc=rc: self._gather_sequence(x, rc)
        with self.precision.autocast():
            if self.needs_backward[(a.module, a.stage)]:
                out = self._run_forward(it, stage, j, st, split)
            else:
                with torch.no_grad():
                    out = self._run_forward(it, stage, j, st, split)
        st.output = out

    def _run_forward(self, it: _Iteration, stage: Stage, j: int, st: MicrobatchState, split) -> torch.Tensor:
        if split is not None:
            st.parts = [self.precision.message(p) for p in self._forward_parts(stage, st.batch, j, split, it.rows)]
            out = torch.cat(st.parts)
        elif self.plan.lanes(stage.module) > 1:  # an encoder in lanes: this rank's share, then every lane's rows
            out = gather_lanes(self._lane_forward(stage, st.batch), self.unit.tp_group)
        else:
            x = self._stage_input(stage, st.inputs, j, it.rows)
            if stage.generator and stage.is_first and self.plan.item_shares(stage.module) > 1:
                share = st.batch.generation_inputs[stage.module]["share"]
                cond = self.model.generators[stage.module].cond_tokens
                x = x[share.start * cond:share.stop * cond]  # the states of this rank's images
            rc = self._cp_context(it, j, stage.module)
            if rc is not None and stage.is_first:  # the encoder tokens of this rank's placeholders
                x = {m: select_features(st.batch.input_ids == self.model.placeholder_ids[m], f, rc.tokens)
                     for m, f in x.items()}
            out = run_layers(stage.layers, self.precision.stage_input(x), st.context)
        if stage.generator and stage.computes_loss:  # the generator's summed item loss, weighted and normalised
            items = it.num_generations.get(stage.module)
            if items is None:
                raise ValueError(f"rank {self.rank}: generator {stage.module!r} computes a loss but the step got no "
                                 f"num_generations for it: pass the global batch's item count per generator "
                                 f"(Dispatched.num_generations)")
            out = out.float() * (self.model.generators[stage.module].loss_weight / max(1, items))
            self._report(it, stage.module, out)
            return out
        if stage.computes_loss:  # loss_sum upcasts the logits: the loss is fp32
            if self.generators:  # the head also gives the states each generator is conditioned on
                st.sends = {g: self.precision.message(x) for g, x in out["generate"].items()}
                out = out["logits"]
            rc = self._cp_context(it, j, stage.module)
            labels = st.batch.labels if rc is None else rc.select(st.batch.labels)  # labels follow the tokens
            with self.unit.loss_context():  # vocabulary-parallel under TP: the loss is replicated
                out = self.unit.loss_value(loss_sum(out, labels)) / it.num_targets
            self._report(it, LLM, out)
            return out
        return self.precision.message(out)  # sent in the compute dtype, graph included

    def _gather_sequence(self, x: torch.Tensor, rc: RankContext | None) -> torch.Tensor:
        """The whole sequence ``[B, L, H]`` of the final states whose share this rank holds: the
        TP rank's sequence shard (sequence parallelism, `loom.runtime.tensor_parallel`), then, under
        context parallelism, the CP rank's tokens (``rc.tokens``, put back at their positions):
        what the LLM's last stage selects each generator's states from. Differentiable: the
        gradient of the (replicated) whole is each rank's share of it."""
        if self.unit.tp_mesh is not None:
            x = DTensor.from_local(x, self.unit.tp_mesh, [Shard(1)]).full_tensor()
        if rc is None:
            return x
        group = self.unit.cp_group
        rows = gather_lanes(x.transpose(0, 1).contiguous(), group)  # every CP rank's tokens, rank by rank
        positions = gather_lanes(rc.tokens.to(x.device).view(-1, 1), group).view(-1)
        whole = rows.new_zeros((positions.numel(), *rows.shape[1:])).index_copy(0, positions, rows)
        return whole.transpose(0, 1)

    def _generator_share(self, batch: Batch, module: str) -> Batch:
        """``batch`` with only this TP rank's share of generator ``module``'s images (targets and
        seeds; `lane_share`), which ``share`` records; the rank holds a whole generator."""
        inputs = batch.generation_inputs[module]
        share = lane_share(len(inputs["targets"]), self.plan.item_shares(module), self.unit.tensor)
        mine = {"targets": [inputs["targets"][i] for i in share], "seeds": [inputs["seeds"][i] for i in share],
                "share": share}
        return dataclasses.replace(batch, generation_inputs={**batch.generation_inputs, module: mine})

    def _report(self, it: _Iteration, module: str, loss: torch.Tensor) -> None:
        # TP ranks share one replicated loss, but a generator's each hold their images' share
        if self.unit.reports_loss or module in self.generators:
            total = it.loss_total.get(module)
            it.loss_total[module] = loss.detach().double() if total is None else total + loss.detach()

    def _send_act(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        j, me = a.microbatch, (a.module, a.stage)
        st = it.states[(a.module, a.stage, j)]
        to_generator = a.peer_module in self.generators and a.module not in self.generators
        out = st.sends[a.peer_module] if to_generator else st.output
        if a.samples is not None:  # a routed edge: only the rows of the named samples
            index = (it.rows.index(a.peer_module, j, a.samples, out.device, slot_phase=LLM) if to_generator
                     else it.rows.index(a.module, j, a.samples, out.device))
            out = out.detach().index_select(0, index)
        header = True
        dst = (a.peer_module, a.peer_stage)
        lead = self._lead_dims(it, me, dst, j, a.other_microbatch, a.samples)
        if a.peer == self.unit.unit:  # to a stage this unit hosts: the receiver gets a leaf of its own
            it.local[tag] = out.detach()
            lead = None
        elif lead is not None:
            channel = (me, dst, self.unit.unit, a.peer)
            if channel not in self._act_shapes:
                self._act_shapes[channel] = _learn(out, lead)  # the receiver learns the same from this message
            elif self._act_shapes[channel] is not None:
                _check_shape(out, lead, self._act_shapes[channel], channel)
                header = False
        for peer in self.unit.destinations(a.peer) if a.peer != self.unit.unit else ():
            self.comm.send(out, peer, tag, header=header)
        self.comm.release_completed()
        if not self.needs_backward[me] and i == it.plan.last_send[(a.module, a.stage, j)]:
            del it.states[(a.module, a.stage, j)]  # nothing will flow back: drop the microbatch now

    def _recv_grad(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        # the gradient has the shape of what this rank sent: no header needed
        j = a.microbatch
        st = it.states[(a.module, a.stage, j)]
        out = st.output
        local = a.peer == self.unit.unit  # from a stage this unit hosts
        if a.peer_module in self.generators and a.module not in self.generators:  # the LLM's states' gradient
            x, g = st.sends[a.peer_module], a.peer_module
            if a.samples is None:
                st.send_grads[g] = self.comm.recv_shaped(x.shape, x.dtype, self.unit.source(a.peer), tag)
            else:  # the rows of some samples (a generator phase rearranged on its own)
                index = it.rows.index(g, j, a.samples, x.device, slot_phase=LLM)
                rows = self.comm.recv_shaped((index.numel(), *x.shape[1:]), x.dtype, self.unit.source(a.peer), tag)
                if g not in st.send_grads:
                    st.send_grads[g] = torch.zeros_like(x)
                st.send_grads[g].index_copy_(0, index, rows)
        elif a.samples is None:
            st.out_grad = it.local.pop(tag) if local else self.comm.recv_shaped(out.shape, out.dtype,
                                                                                self.unit.source(a.peer), tag)
        else:  # rows of some samples: scatter into this microbatch's pending gradient
            index = it.rows.index(a.module, j, a.samples, out.device)
            g = it.local.pop(tag) if local else self.comm.recv_shaped((index.numel(), *out.shape[1:]), out.dtype,
                                                                       self.unit.source(a.peer), tag)
            if st.out_grad is None:
                st.out_grad = torch.zeros_like(out)
            st.out_grad.index_copy_(0, index, g)

    def _backward(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        j, key = a.microbatch, (a.module, a.stage, a.microbatch)
        st = it.states[key]
        if st.sends is not None:
            _join_generator_grads(st)
        out = st.output
        # each part consumes the gradient rows received since the previous part
        grad, st.out_grad = (None if self.stages[(a.module, a.stage)].computes_loss else st.out_grad), None
        st.backward_left -= 1
        last_part = st.backward_left == 0
        if self.zero is not None:
            self.zero.before_backward(i == it.plan.last_backward)
        # An output can be independent of everything trainable for one microbatch (a frozen LLM
        # stage whose microbatch has no image tokens to merge): then there is nothing to
        # propagate and the input gradient sent back is zero.
        if st.parts is not None:  # a split backward over per-part forwards: this part's rows only
            part = it.plan.split[(a.module, a.stage, j)].index(a.samples)
            first_row = sum(t.shape[0] for t in st.parts[:part])
            piece = st.parts[part]
            if piece.requires_grad:
                torch.autograd.backward(piece, grad[first_row:first_row + piece.shape[0]])
            st.parts[part] = piece.detach()
        elif out.requires_grad:
            # A split backward on a later encoder stage (entrain.md §3.6) runs the stage's graph
            # once per part with that part's rows of the gradient (zeros elsewhere); by
            # linearity the parts sum to the whole; the graph is kept until the last.
            with self.unit.loss_context():
                torch.autograd.backward(out, grad, retain_graph=not last_part)
        if last_part:
            # keep only the inputs whose gradients still have to be sent back
            st.inputs = {k: t for k, t in st.inputs.items() if t.requires_grad}
            if st.inputs:
                st.batch = st.context = st.output = st.parts = st.out_grad = None
            else:
                del it.states[key]

    def _backward_input(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        """ZB-H1's input pass (`loom.runtime.split_backward`): only the gradients of the
        received activations, which the SEND_GRADs after it ship; the weights wait for
        `_backward_weight`, from the same graph."""
        st = it.states[(a.module, a.stage, a.microbatch)]
        if st.sends is not None:
            _join_generator_grads(st)
        grad, st.out_grad = (None if self.stages[(a.module, a.stage)].computes_loss else st.out_grad), None
        st.backward_left -= 1
        if self.zero is not None:
            fsdp_defer(self.zero.modules)
        if st.output.requires_grad:
            with self.unit.loss_context():
                st.weight_pass = backward_input(st.output, grad, list(st.inputs.values()))
        st.inputs = {k: t for k, t in st.inputs.items() if t.requires_grad}
        st.batch = st.context = st.output = None  # the graph lives on in the weight pass

    def _backward_weight(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        """ZB-H1's weight pass: the parameters' gradients of the microbatch, accumulated into
        ``.grad`` as a whole backward would."""
        key = (a.module, a.stage, a.microbatch)
        st = it.states[key]
        st.backward_left -= 1
        if self.zero is not None:
            fsdp_defer(self.zero.modules)
        if st.weight_pass is not None:
            with self.unit.loss_context():
                backward_weight(st.weight_pass)
            st.weight_pass = None
        if self.zero is not None and i == it.plan.last_backward:
            fsdp_reduce(self.zero.modules)  # ZeRO 2/3 reduce after the stage's last weight pass
        if not st.inputs and st.backward_left == 0:
            del it.states[key]

    def _send_grad(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        key = (a.module, a.stage, a.microbatch)
        st = it.states[key]
        x = st.inputs.pop((a.peer_module, a.other_microbatch))
        g = x.grad if x.grad is not None else torch.zeros_like(x)  # input unused (no tokens)
        if self.unit.cp_group is not None and a.peer_module != a.module:
            # each CP rank merged the encoder tokens of its own placeholders: the whole
            # gradient is the sum over the CP group (cornstarch.md §3.3.6), sent by the leader
            dist.all_reduce(g, group=self.unit.cp_group)
        if a.module in self.generators and a.peer_module == LLM and self.unit.tp_group is not None:
            dist.all_reduce(g, group=self.unit.tp_group)  # each TP rank's images' rows: the leader sends the sum
        if a.peer == self.unit.unit:  # to a stage this unit hosts
            it.local[tag] = g
        for peer in self.unit.destinations(a.peer) if a.peer != self.unit.unit else ():
            self.comm.send(g, peer, tag, header=False)  # the peer sent x: it knows the shape
        self.comm.release_completed()
        if not st.inputs and st.backward_left == 0:
            del it.states[key]

    def _grad_sync(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        if self.zero is None or not self.zero.shards_gradients:  # FSDP reduced them in backward
            # SUM all-reduce over the stage's replicas, one flat bucket (TP shards sync their
            # local parts: `loom.runtime.unit.sync_gradients`)
            me = (a.module, a.stage)
            params = self.stages[me].trainable_parameters()
            if a.module in self.generators and self.unit.tp_group is not None:
                sync_gradients(params, self.unit.tp_group)  # each TP rank's images' share, summed first
            sync_gradients(params, self.dp_groups.get(me))

    def _optimizer_step(self, it: _Iteration, i: int, a: Action, tag: int) -> None:
        # one optimizer holds every hosted stage's parameters: it steps at the last stage's share
        if i != it.plan.last_step:
            return
        sync_tied(self.tied)  # tied copies on other stages: the pair's gradient sum (loom.runtime.tied)
        settle_gradients(self._trainable_parameters())  # TP gradients in their parameters' placements
        if self.before_update is not None:
            self.before_update(it.loss_total)
        if self.max_grad_norm > 0:
            it.grad_norm = self._clip_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    # ---- helpers -------------------------------------------------------------------------
    def _lead_dims(self, it: _Iteration, src: StageId, dst: StageId, src_mb: int, dst_mb: int,
                   samples: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The leading dims of the activation on edge ``src -> dst`` that both sides derive from
        metadata, or None where they cannot: between LLM stages the microbatch's ``input_ids``
        shape; from an encoder to the LLM (with the layout's `RowMap`) the message's row count,
        the tokens of its samples. The trailing dims are learned from the edge's first message.
        Edges into a generator keep their header (its states' count is the microbatch's generation
        positions)."""
        if dst[0] in self.generators:
            return None
        if src[0] == LLM:
            st = it.states.get((*src, src_mb))  # this rank's own state when it sends
            batch = st.batch if st is not None and st.batch is not None else self._microbatch(it.microbatches, src_mb)
            rc = self._cp_context(it, src_mb, LLM)  # under CP, this rank's tokens of the rows
            return tuple(batch.input_ids.shape) if rc is None else (batch.input_ids.shape[0], rc.tokens.numel())
        if dst[0] == LLM and it.rows is not None:
            tokens = it.rows.tokens[src[0]]
            members = samples if samples is not None else it.rows.layout.slot(src[0], src_mb)
            return (sum(tokens[s] for s in members),)
        return None

    def _stage_input(self, stage: Stage, received: dict[tuple[str, int], torch.Tensor], j: int,
                     rows: RowMap | None) -> Any:
        if stage.is_first and stage.module != LLM and not stage.generator:
            return None  # encoder first stages read the microbatch from their context
        if stage.is_first and stage.module == LLM:  # the LLM's first stage merges every encoder's tokens
            parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
            for (module, source), x in received.items():
                parts.setdefault(module, []).append((source, x))
            if rows is None or all(len(p) == 1 and p[0][0] == j for p in parts.values()):
                # each encoder's microbatch j feeds LLM microbatch j whole: its rows are in order
                return {m: p[0][1] for m, p in parts.items()}
            return {m: rows.assemble(m, j, sorted(p, key=lambda t: t[0])) for m, p in parts.items()}
        parts = sorted((source, x) for (_, source), x in received.items())
        if stage.is_first and stage.generator and rows is not None and [k for k, _ in parts] != [j]:
            # the LLM's states of this generator microbatch's samples from every LLM microbatch
            # holding them (a generator phase rearranged on its own), in its own sample order
            return rows.assemble(stage.module, j, parts, src=LLM, dst=stage.module)
        ((_, x),) = parts
        return x

    def _lane_forward(self, stage: Stage, batch: Batch) -> torch.Tensor:
        """This rank's share of an encoder microbatch's items in lanes (`loom.runtime.lanes`)."""
        module = stage.module
        key, items = next(iter(batch.modality_inputs[module].items()))
        share = lane_share(len(items), self.plan.lanes(module), self.unit.tensor)
        sub = dataclasses.replace(batch, modality_inputs={module: {key: [items[i] for i in share]}})
        return run_layers(stage.layers, None, self.model.module_context(module, sub))

    def _forward_parts(self, stage: Stage, batch: Batch, j: int, parts: list[tuple[int, ...]],
                       rows: RowMap) -> list[torch.Tensor]:
        """Forward of an encoder microbatch one part at a time (each part's samples in the
        microbatch's order); the rows of the concatenated output follow the parts, which
        ``rows`` is told so routed messages still pick the right rows."""
        module = stage.module
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
            outs.append(run_layers(stage.layers, None, self.model.module_context(module, sub)))
            order.extend(members)
        rows.set_order(module, j, order)
        return outs

    def _cp_context(self, it: _Iteration, j: int, module: str) -> RankContext | None:
        """This rank's `RankContext` of LLM microbatch ``j`` under context parallelism (None
        otherwise): built from the microbatch's metadata once per iteration, the same on every
        stage of the unit's CP rank, so activations between LLM stages keep its tokens."""
        if self.unit.cp_group is None or module != LLM:
            return None
        rc = it.cp.get(j)
        if rc is None:
            batch = self._microbatch(it.microbatches, j)
            placeholders = {n: i for n, i in self.model.placeholder_ids.items() if n in self.model.encoders}
            rc = it.cp[j] = microbatch_context(batch.input_ids, batch.segments, placeholders, self.unit.cp_size,
                                               self.unit.context, self.unit.cp_group, it.cp_blocks.get(j))
        return rc

    def _microbatch(self, microbatches: dict[Any, Batch], j: int, module: str = LLM) -> Batch:
        """Slot ``j``'s `Batch`; an encoder this rank hosts beside the LLM whose slot holds other
        samples than the LLM's (a balanced colocated layout) has its own, under ``(module, j)``."""
        own = microbatches.get((module, j))
        if own is not None:
            return own
        if j not in microbatches:
            raise KeyError(f"rank {self.rank} runs microbatch {j} but was not given it (has {sorted(map(str, microbatches))})")
        return microbatches[j]

    def _tag(self, src: StageId, dst: StageId, src_mb: int, dst_mb: int, num_mb: int, grad: bool) -> int:
        """One tag per (edge, sender microbatch, receiver microbatch, direction)."""
        return ((src_mb * num_mb + dst_mb) * len(self.edge_ids) + self.edge_ids[(src, dst)]) * 2 + int(grad)

    def _clip_gradients(self) -> float:
        """Scale this rank's gradients by the global norm's clip coefficient (module docstring);
        returns the norm before clipping. A collective over the world: every rank calls it once
        per iteration."""
        params = [p for p in self._trainable_parameters() if p.grad is not None]
        # every TP shard once, a replicated parameter once per unit, the first replica only
        if self.zero is not None and self.zero.shards_gradients:  # every dp shard once (loom.runtime.zero)
            local = self.zero.grad_norm_sq(params).to(self.device)
        else:
            # a stage's replicas hold the same gradients after the sync: count its first one only
            # (a colocated encoder's replicas sit on every LLM unit, not only on other LLM replicas)
            # and a tie across stages once, through its first holder's copy (loom.runtime.tied)
            twins = {id(c.param) for c in self.tied if not c.counts_in_norm}
            first = [p for st in self.stages.values() if st.replica == 0 for p in st.trainable_parameters()
                     if p.grad is not None and id(p) not in twins]
            local = self.unit.grad_norm_sq(first).to(self.device)
        dist.all_reduce(local)
        norm = local.sqrt()
        if params:
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            grads = [local_tensor(p.grad.detach()) for p in params]
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return float(norm)

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for st in self.stages.values() for p in st.trainable_parameters()]

def _learn(x: torch.Tensor, ids: tuple[int, ...]) -> _ActShape | None:
    """The shape rule of a channel from its first message: the leading dims both sides derive
    (`PipelineExecutor._lead_dims`), then fixed trailing dims; None when ``x`` does not start
    with them (the channel's messages then keep their header)."""
    if tuple(x.shape[:len(ids)]) != ids or x.dim() <= len(ids):
        return None
    return x.dtype, tuple(x.shape[len(ids):])


def _check_shape(out: torch.Tensor, lead: tuple[int, ...], known: _ActShape, channel: tuple) -> None:
    if out.dtype != known[0] or tuple(out.shape) != (*lead, *known[1]):
        raise RuntimeError(
            f"stage {channel[0]} sends a {out.dtype} activation of shape {tuple(out.shape)} to {channel[1]} on unit "
            f"{channel[3]}, but the first message on that edge set the rule {lead} + {known[1]} ({known[0]}): the "
            f"receiver allocates by that rule, so the stage's output must keep it (leading dims from the "
            f"microbatch's metadata, fixed trailing dims)"
        )


def _edge_ids(plan: Plan) -> dict[Edge, int]:
    edges: list[Edge] = []
    for m in plan.modules:
        for s in range(m.num_stages - 1):
            edges.append(((m.name, s), (m.name, s + 1)))
        if m.name in plan.encoder_names:
            edges.append(((m.name, m.num_stages - 1), (LLM, 0)))
        elif m.name in plan.generator_names:
            edges.append(((LLM, plan.spec(LLM).num_stages - 1), (m.name, 0)))
    return {e: i for i, e in enumerate(edges)}


def _join_generator_grads(st: MicrobatchState) -> None:
    """The LLM's last stage with generators, before its backward: one scalar, the loss plus each
    generator's states dotted with their received gradient (detached), so one backward gives the
    loss's gradient plus exactly each received one (d<x, g>/dx = g) through the shared graph."""
    total = st.output if st.output.requires_grad else None
    for g, x in st.sends.items():
        grad = st.send_grads.pop(g, None)
        if grad is not None and x.requires_grad:
            term = (x * grad).sum().float()
            total = term if total is None else total + term
    st.sends = None
    if total is not None:
        st.output = total
