"""Predicted step time of a layout: the policies' own cost model of one iteration.

`make_layout` keeps the given layout unless a policy's layout is predicted faster by more than
``balance.min_gain`` (issue 8). Summing each round's slowest slot cannot tell
two layouts apart when a module has one replica: the sum is then the module's total work
whatever the layout. What a layout changes there is how the encoders' and the LLM's work pair
up microbatch by microbatch in the pipeline, so the prediction plays the 1F1B pipeline itself.

The model, per data-parallel replica of the LLM (a *lane*):

- the stages are the encoders' stages (each encoder a chain, the encoders in parallel) feeding
  the LLM's first stage, then the LLM's stages (cornstarch.md §3.1, as `build_schedule` lays
  them out); microbatch slot ``k`` of every phase sits in lane ``k % dp_llm`` at position
  ``k // dp_llm`` (the plan's round-robin rule, `Plan.replica_of_microbatch`);
- a slot's forward time on a stage is its phase's cost of the slot's samples (`SampleCosts`:
  summed for packed phases, row count x longest row for right-padded LLM rows) split evenly
  over the module's stages; an encoder's is scaled by ``dp_llm / dp_enc``, the share of an
  encoder replica one LLM replica uses (DistTrain's objective, disttrain.md §3.1 eq. 1-2), and
  where one lane uses several encoder replicas, by their max-over-mean load (the slowest paces);
  backward is the phase's backward-to-forward FLOP ratio x forward (`SampleCosts.backward_ratio`:
  2 when trainable, less for frozen layers that only pass input gradients on, 0 for a frozen
  encoder before any trainable layer, as `loom.cost.frozen` prices them);
- each rank runs loom's 1F1B order (`loom.schedule.generators`: warmup from `warmup_lookahead`, one
  forward / one backward, drain), and every operation ends at ``max(end of the rank's previous
  operation, end of its dependency) + its own time``: DistTrain's GETINTERVAL recurrence
  ``E[s][j] = max(E[s][j-1], E[s-1][j]) + t[s][j]`` with 1F1B's backward flow added
  (disttrain.md §3.4, digest gap 6). The LLM's first stage waits for the latest encoder
  forward that feeds the slot (through a layout's routes: OrchMLLM's rearrangement, Entrain's
  one-round deferral), an encoder's backward for the LLM slots its samples went to in the
  round, and the part of it whose gradients come from a later round runs before the replica's
  next backward (the split backward of entrain.md §3.6, as `build_schedule` lays it out);
- the step is the latest lane's end: gradient synchronisation waits for the slowest replica.
  With the LLM the bottleneck, its steady phase is paced by the per-microbatch LLM times whose
  largest, T*, Entrain's deferral minimises (entrain.md §3.5.2); with equal microbatches the
  step is DistTrain's ``T_warmup + T_steady`` (disttrain.md §3.1, eq. 1-2).

A colocated plan (an encoder replica on every unit of the LLM, OrchMLLM's and Optimus's
setting) is no pipeline of encoder and LLM ranks: each unit runs its encoder forwards, then
its share of the LLM's 1F1B, then its encoder backwards (`_colocated_step`).

Communication, gradient synchronisation and the optimizer are left out (they do not depend on
the layout, or are priced by the dispatcher's own cost). With equal data-parallel degrees this
is exactly a play of the schedule loom runs with free communication (the tests play it, for
every policy's layouts); with unequal ones, routes that reach a later position of a lane
(rounds longer than ``dp_llm``) are read at the current position, and an encoder is one lane's
share of it: an estimate (within ~15 % of the play in the tests' mixed plans), not a simulation
(`loom.sim` is the simulation). Loops run over positions and stages only; every
operation is one NumPy operation over the lanes (and over several layouts at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.balance.costs import SampleCosts
from loom.plan.plan import LLM, Plan
from loom.schedule.generators import warmup_lookahead
from loom.schedule.layout import BatchLayout, round_size

__all__ = ["Prediction", "predict_step", "predict_steps", "slot_costs", "pipeline_times"]


@dataclass(frozen=True)
class Prediction:
    """``step``: the predicted step time (cost units of `SampleCosts`); ``lanes``: each LLM
    replica's end; ``busy``: per phase, the compute (forward + backward) of its busiest stage
    replica, the phase's share of the step."""

    step: float
    lanes: np.ndarray
    busy: dict[str, float]


def slot_costs(layout: BatchLayout, costs: SampleCosts, llm_padded: bool = True) -> dict[str, np.ndarray]:
    """Per phase, each slot's forward cost: the sum of its samples' costs, or for a right-padded
    LLM (``llm_padded``) its row count times its longest row's cost. Taken as they are from
    ``layout.known_slot_costs`` when the policy that built the layout recorded them for these
    costs (the loads it balanced: the same padded products, the same sums up to rounding), and
    read without a gather from a contiguous layout."""
    known = layout.known_slot_costs
    known = known[2] if known is not None and known[0] is costs and known[1] == llm_padded else {}
    out = {}
    for phase, (order, bounds) in layout.arrays.items():
        if phase in known:
            out[phase] = known[phase]
            continue
        starts = bounds[:-1]
        padded = phase == LLM and llm_padded
        # a padded slot's longest row, then its cost: the row cost is increasing in the length
        # (alpha, beta >= 0), so this is the largest `llm_padded_weight` of the slot, bit for bit
        w = costs.llm_lengths if padded else costs.work[phase]
        if not layout.contiguous:
            w = w[order]
        if not w.size:
            out[phase] = np.zeros(len(starts))
        elif padded:
            longest = np.maximum.reduceat(w, starts).astype(np.float64)
            out[phase] = (costs.llm_alpha * longest + costs.llm_beta * longest * longest) * np.diff(bounds)
        else:
            out[phase] = np.add.reduceat(w, starts)
    return out


def _grid(per_slot: np.ndarray, lanes: int, positions: int) -> np.ndarray:
    """Slot ``k`` at ``[k // lanes, k % lanes]``; missing slots (uneven counts) cost 0."""
    g = np.zeros(positions * lanes)
    g[:per_slot.size] = per_slot
    return g.reshape(positions, lanes)


def _routes(layout: BatchLayout, encoder: str, lanes: int, plan: Plan,
            llm_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An encoder's routes to the LLM on the lanes' grid (flat index ``position * lanes +
    lane`` = slot), from the slot of every sample in each phase (``llm_index``: the LLM's):

    - feeders: for each sample in LLM slot order, the encoder slot it comes from, read no later
      than its LLM slot's position (the LLM's forward waits for the latest of them);
    - consumers: for each sample in encoder slot order, the LLM slot whose backward sends its
      gradient, read no later than the encoder slot's position; a sample deferred to a later
      round counts at its own slot (its gradient is waited for by the split part);
    - the split backward: per sample, the encoder slot whose backward covers it: the part of a
      slot whose samples reach a later round (Entrain's deferral) runs just before the
      replica's next backward, as `build_schedule` lays it out (entrain.md §3.6), at the slot
      itself for a replica's last one; None when no sample is deferred (every slot's backward
      covers its own samples).

    A layout of one round that is one position of every lane (OrchMLLM at one microbatch per
    replica) can defer nothing and needs no capping: its routes are two gathers."""
    order, bounds = layout.arrays[LLM]
    e_order, e_bounds = layout.arrays[encoder]
    m, r, dp = len(bounds) - 1, round_size(plan), plan.spec(encoder).data_parallel
    enc_index = layout.slot_index(encoder)
    # indices valid by construction: "clip" skips the bounds check and error path of fancy indexing
    enc_of = np.take(enc_index, order, mode="clip")
    to = np.take(llm_index, e_order, mode="clip")
    if m == r == lanes:
        return enc_of, to, None
    enc_slot = np.repeat(np.arange(m), np.diff(e_bounds))
    to = np.where(to // r > enc_slot // r, enc_slot, to)
    if r == lanes:  # a round is one position: routes in the round or one back need no capping
        feeders, consumers = enc_of, to
    else:
        llm_slot = np.repeat(np.arange(m), np.diff(bounds))
        feeders = np.minimum(enc_of // lanes, llm_slot // lanes) * lanes + enc_of % lanes
        consumers = np.minimum(to // lanes, enc_slot // lanes) * lanes + to % lanes
    deferred = llm_index // r > enc_index // r
    if not deferred.any():
        return feeders, consumers, None
    split = np.where(deferred & (enc_index + dp < m), enc_index + dp, enc_index)
    return feeders, consumers, split


def pipeline_times(plan: Plan, forward: dict[str, np.ndarray], *, backward_ratio: "float | dict[str, float]" = 2.0,
                   extra_warmup: int = 0, routed: bool = False,
                   feeders: "dict[str, np.ndarray | None] | None" = None,
                   llm_bounds: np.ndarray | None = None,
                   backward: dict[str, np.ndarray] | None = None,
                   consumers: "dict[str, tuple[np.ndarray, np.ndarray]] | None" = None) -> tuple[np.ndarray, dict[str, float]]:
    """The 1F1B recurrence over the lanes of one or more layouts of ``plan``.

    ``forward[phase]``: ``(positions, lanes)`` grids of per-stage forward times (lanes of several
    layouts side by side). ``routed``: the schedule is a layout's (encoders look ``2 (R - 1)``
    slots further ahead, `warmup_lookahead`); ``extra_warmup``: Entrain's eager forward.
    ``feeders[e]`` / ``llm_bounds`` and ``consumers[e]`` (with the encoder's slot bounds): the
    routes of `_routes` (one layout only); ``backward``: per phase, grids of backward times
    where they are not ``backward_ratio`` x forward (split backwards); ``backward_ratio``: one
    ratio, or one per phase. Returns each lane's end and per phase the compute of its busiest
    stage replica."""
    names = plan.module_names
    encoders = [m for m in names if m != LLM]
    positions, lanes = forward[LLM].shape
    look = warmup_lookahead(plan, "1f1b", 2 * (round_size(plan) - 1) if routed else 0, extra_warmup)
    # nodes in topological order: every encoder's stages, then the LLM's
    nodes: list[tuple[str, int]] = [(m, s) for m in encoders + [LLM] for s in range(plan.spec(m).num_stages)]
    # warmup in lane positions: a lookahead of D slots is D / dp_llm positions of a lane
    warm = [min(int(look[n] // plan.spec(LLM).data_parallel), positions) for n in nodes]
    fwd = [forward[m] for m, _ in nodes]
    backward = backward or {}
    ratio = backward_ratio if isinstance(backward_ratio, dict) else {m: backward_ratio for m in names}
    bwd = [backward[m] if m in backward else ratio[m] * forward[m] for m, _ in nodes]
    last = {m: max(i for i, n in enumerate(nodes) if n[0] == m) for m in names}
    llm0 = nodes.index((LLM, 0))
    # forward predecessors: the stage before in the module; the LLM's first: every encoder's last
    f_dep = [[i - 1] if s > 0 else ([last[e] for e in encoders] if m == LLM else []) for i, (m, s) in enumerate(nodes)]
    # backward dependency: the next stage of the module; an encoder's last: the LLM's first
    b_dep = [i + 1 if i != last[m] else (llm0 if m != LLM else None) for i, (m, _) in enumerate(nodes)]
    f_end = [np.empty((positions, lanes)) for _ in nodes]
    b_end = [np.empty((positions, lanes)) for _ in nodes]
    feeders = feeders or {}

    def ready(i: int, q: int) -> np.ndarray | None:
        deps = f_dep[i]
        if not deps:
            return None
        if i != llm0:
            return f_end[deps[0]][q]
        out = None
        for e, d in zip(encoders, deps):
            idx = feeders.get(e)
            if idx is None:
                r = f_end[d][q]
            else:  # the latest feeding encoder slot of each LLM slot at position q
                lo, hi = llm_bounds[q * lanes], llm_bounds[min((q + 1) * lanes, len(llm_bounds) - 1)]
                r = np.zeros(lanes)
                if hi > lo:
                    starts = llm_bounds[q * lanes:(q + 1) * lanes] - lo
                    r[:starts.size] = np.maximum.reduceat(np.take(f_end[d].reshape(-1), idx[lo:hi], mode="clip"),
                                                          starts)
            out = r if out is None else np.maximum(out, r)
        return out

    # the forward dependency of a stage inside its module, read without a call
    chained = [f_end[d[0]] if d and i != llm0 else None for i, d in enumerate(f_dep)]
    consumers = consumers or {}
    enc_of = {last[e]: e for e in encoders if e in consumers}

    def grad_ready(i: int, k: int) -> np.ndarray:
        """When the gradients for position ``k`` of node ``i`` have all arrived."""
        d = b_dep[i]
        if i not in enc_of:
            return b_end[d][k]
        idx, eb = consumers[enc_of[i]]
        lo, hi = eb[k * lanes], eb[min((k + 1) * lanes, len(eb) - 1)]
        out = np.zeros(lanes)
        if hi > lo:
            starts = eb[k * lanes:(k + 1) * lanes] - lo
            out[:starts.size] = np.maximum.reduceat(np.take(b_end[d].reshape(-1), idx[lo:hi], mode="clip"), starts)
        return out

    for q in range(positions):
        for i in range(len(nodes)):
            w = warm[i]
            prev = None if q == 0 else (f_end[i][q - 1] if q <= w else b_end[i][q - w - 1])
            up = chained[i][q] if chained[i] is not None else (ready(i, q) if i == llm0 else None)
            if prev is None and up is None:
                f_end[i][q] = fwd[i][q]
            else:
                t = prev if up is None else (up if prev is None else np.maximum(prev, up))
                np.add(t, fwd[i][q], out=f_end[i][q])
        for i in reversed(range(len(nodes))):  # steady-phase backwards B(i, q - w_i)
            k = q - warm[i]
            if k < 0:
                continue
            d = b_dep[i]
            if d is None:  # the LLM's last stage: its backward follows its own forward
                np.add(f_end[i][q], bwd[i][k], out=b_end[i][k])
                continue
            np.maximum(f_end[i][q], grad_ready(i, k), out=b_end[i][k])
            b_end[i][k] += bwd[i][k]
    for k in range(positions):  # drain backwards, in order, downstream first
        for i in reversed(range(len(nodes))):
            if k <= positions - 1 - warm[i]:
                continue
            prev = b_end[i][k - 1] if k > 0 else f_end[i][positions - 1]
            d = b_dep[i]
            dep = f_end[i][k] if d is None else grad_ready(i, k)
            np.maximum(prev, dep, out=b_end[i][k])
            b_end[i][k] += bwd[i][k]
    ends = np.max([b[positions - 1] for b in b_end], axis=0) if positions else np.zeros(lanes)
    busy = {m: float(max((fwd[i] + bwd[i]).sum(axis=0).max(initial=0.0)
                         for i, n in enumerate(nodes) if n[0] == m)) for m in names}
    return ends, busy


def predict_steps(layouts: Sequence[BatchLayout], plan: Plan, costs: SampleCosts, llm_padded: bool = True, *,
                  backward_ratio: float | None = None, eager: int = 0) -> list[Prediction]:
    """`predict_step` of several layouts of one batch; layouts with the same slot count and
    aligned routes run in one recurrence, side by side over their lanes. Backward costs
    ``backward_ratio`` x forward, by default each phase's own ratio (`SampleCosts.backward_ratio`:
    the frozen-aware rule, 0 for a frozen encoder nothing before trains)."""
    lanes = plan.spec(LLM).data_parallel
    ratio = {m: costs.backward_ratio_of(m) if backward_ratio is None else float(backward_ratio)
             for m in plan.module_names}
    if plan.placement == "colocated":
        return [_colocated_step(layout, plan, costs, llm_padded, ratio) for layout in layouts]
    out: list[Prediction | None] = [None] * len(layouts)
    groups: dict[tuple, list[int]] = {}
    for n, layout in enumerate(layouts):
        aligned = layout.is_identity()
        key = (layout.num_microbatches, aligned) if aligned else (n,)
        groups.setdefault(key, []).append(n)
    for members in groups.values():
        first = layouts[members[0]]
        positions = -(-first.num_microbatches // lanes)
        grids: dict[str, list[np.ndarray]] = {m: [] for m in plan.module_names}
        scales: dict[str, float] = {}
        for n in members:
            per_slot = slot_costs(layouts[n], costs, llm_padded)
            for m in plan.module_names:
                spec = plan.spec(m)
                scale = lanes / spec.data_parallel / spec.num_stages
                if spec.data_parallel > lanes:  # a lane's share of several encoder replicas runs
                    # at the pace of the slowest of them (max over mean of their loads)
                    load = np.bincount(np.arange(per_slot[m].size) % spec.data_parallel, weights=per_slot[m])
                    scale *= load.max() / load.mean() if load.mean() > 0 else 1.0
                scales[m] = scale
                grids[m].append(_grid(per_slot[m] * scale, lanes, positions))
        forward = {m: np.concatenate(g, axis=1) for m, g in grids.items()}
        routed = not first.is_identity() or first.num_microbatches != plan.num_microbatches
        feeders, bounds, backward, consumers = None, None, None, None
        if not first.is_identity():
            feeders, consumers, backward = {}, {}, {}
            bounds = first.arrays[LLM][1]
            llm_index = first.slot_index(LLM)
            for e in first.encoders:
                if first.shares_llm_slots(e):
                    continue  # this encoder's slots are the LLM's: slot k waits for slot k
                feeders[e], cons, split = _routes(first, e, lanes, plan, llm_index)
                consumers[e] = (cons, first.arrays[e][1])
                if split is not None:  # deferred samples: their backward runs with a later slot
                    per_slot = np.bincount(split, weights=costs.work[e], minlength=first.num_microbatches)
                    backward[e] = _grid(per_slot * (ratio[e] * scales[e]), lanes, positions)
        ends, _ = pipeline_times(plan, forward, backward_ratio=ratio, extra_warmup=eager,
                                 routed=routed, feeders=feeders, llm_bounds=bounds, backward=backward,
                                 consumers=consumers)
        # per phase, each lane's compute on one stage (the stages of a module cost alike)
        per_lane = {m: (forward[m] + (backward[m] if backward and m in backward else ratio[m] * forward[m])).sum(axis=0)
                    for m in plan.module_names}
        for g, n in enumerate(members):
            cols = slice(g * lanes, (g + 1) * lanes)
            mine = ends[cols]
            out[n] = Prediction(float(mine.max()), mine, {m: float(v[cols].max()) for m, v in per_lane.items()})
    return out  # type: ignore[return-value]


def _colocated_step(layout: BatchLayout, plan: Plan, costs: SampleCosts, llm_padded: bool,
                    ratio: dict[str, float]) -> Prediction:
    """A colocated plan's step: every encoder replica shares its unit with the LLM, whose
    schedule runs the unit's encoder forwards first and their backwards last (Optimus's coarse
    order, optimus.md §3; a bubble fill only shortens it). A unit's encoders run one after
    another (their sum). Where every encoder keeps the LLM's slots and the LLM has one stage,
    each unit is one lane and its step is exactly its encoder forwards, its LLM microbatches and
    its encoder backwards; otherwise rows cross units, so the LLM's 1F1B alone is bracketed by
    the slowest unit's encoder forwards and backwards (a bound). Entrain's eager forward deepens
    only the encoders' warmup, which this order already runs first."""
    per_slot = slot_costs(layout, costs, llm_padded)
    llm = plan.spec(LLM)
    lanes, units = llm.data_parallel, llm.num_units
    forward_on, backward_on, busy = np.zeros(units), np.zeros(units), {}
    for e in plan.encoder_names:
        share = plan.spec(e).data_parallel // max(1, plan.lanes(e))  # replicas per lane share a unit's items
        on_unit = np.bincount(np.arange(per_slot[e].size) % share, weights=per_slot[e], minlength=units)[:units]
        on_unit = on_unit / max(1, plan.lanes(e))
        forward_on += on_unit
        backward_on += ratio[e] * on_unit
        busy[e] = float(((1 + ratio[e]) * on_unit).max(initial=0.0))
    alone = dataclasses.replace(plan, modules=[llm], placement="disaggregated", bubble_fill="none")
    positions = -(-layout.num_microbatches // lanes)
    grid = _grid(per_slot[LLM] / llm.num_stages, lanes, positions)
    ends, llm_busy = pipeline_times(alone, {LLM: grid}, backward_ratio=ratio[LLM])
    if llm.num_stages == 1 and all(layout.shares_llm_slots(e) for e in plan.encoder_names):
        ends = forward_on + ends + backward_on  # unit d is lane d
    else:
        ends = forward_on.max(initial=0.0) + ends + backward_on.max(initial=0.0)
    return Prediction(float(ends.max(initial=0.0)), ends, busy | llm_busy)


def predict_step(layout: BatchLayout, plan: Plan, costs: SampleCosts, llm_padded: bool = True, *,
                 backward_ratio: float | None = None, eager: int = 0) -> Prediction:
    """The predicted step time of ``layout`` (see the module docstring): what `make_layout`
    compares between the given layout and a policy's."""
    return predict_steps([layout], plan, costs, llm_padded, backward_ratio=backward_ratio, eager=eager)[0]
