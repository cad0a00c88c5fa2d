"""Balancing policies: from a global batch's metadata to a `BatchLayout` (docs/architecture.md principle 4).

One function, `make_layout`, is what the runtime's dispatcher, the simulator and the quality
benchmark all call, so the three see the same decisions. Per phase (each encoder and the LLM)
the config names a policy:

- ``none``: equal-count contiguous microbatches (`split_microbatches`), every phase alike;
- ``orchmllm``: post-balancing of each phase on its own (orchmllm.md §3.4-3.5). Inside each
  *round* (one microbatch of every replica, `layout.round_size`) the round's samples are
  rebalanced over the round's slots: LPT on per-sample cost for packed phases (the encoders,
  whose attention is block-diagonal per item, so the quadratic-aware additive cost is exact,
  §3.6), the fixed binary-search algorithm for padded ones (loom's LLM right-pads each
  microbatch, §3.5). Encoder outputs then go straight to the LLM slot of their sample
  (rearrangement composition, §2.1);
- ``disttrain``: one layout for all phases (disttrain.md §3.3-3.5): balance the global batch
  over the LLM's data-parallel groups, LPT into microbatches inside each group, then order them
  for 1F1B with Algorithm 3;
- ``entrain``: one joint decision for all phases (entrain.md §3.4-3.5): DP-level assignment,
  K_eff, stratified microbatches (for a right-padded LLM, microbatches of similar row cost
  where the 1F1B prediction finds them faster: `loom.balance.entrain_policy`), pairwise
  deferral of LLM work one microbatch forward, the interleaved overloaded/underloaded order.
  Needs equal data-parallel degrees (the encoders form the "single unified encoder module" of
  §2.3).

``order`` (``given`` or ``disttrain``) reorders whole rounds for the per-phase policies with
DistTrain's Algorithm 3; ``disttrain`` and ``entrain`` bring their own order.

A generator after the LLM (disttrain.md §1) is a phase too (`_with_generators`): ``disttrain``
counts its work in its one layout for every phase; ``orchmllm`` and ``entrain`` rebalance it on
its own inside each round of LLM slots (its states then travel by sample, as encoder outputs
do); under ``none`` it runs the LLM's slots.

Per-sample cost is the module's forward FLOPs (`loom.balance.costs`, arrays from metadata
arrays). A policy never makes a step slower than ``none`` by its own cost model: where the
predicted gain in step time (`loom.balance.predict`: the layout's 1F1B pipeline over every
replica; on a colocated plan each rank's encoders before and after it) is below
``balance.min_gain`` of the given layout's, the given layout is kept and the layout says so
(``kept_given``, ``predicted_gain``, and why in ``kept_why``). A per-phase policy whose rounds
hold one slot each (every module at data-parallel degree 1, ``order = "given"``) has nothing
to balance (`nothing_to_balance`): the given layout is kept at once, without deciding, so the
step runs exactly what ``none`` runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from loom.balance.config import JOINT, ORDERS, POLICIES, BalanceConfig, BalanceError, check_balance_config
from loom.balance.costs import SampleCosts, sample_costs
from loom.balance.disttrain_policy import disttrain_layout
from loom.balance.entrain_policy import entrain_layout
from loom.balance.lpt import quantised_lpt
from loom.balance.orchmllm import nonempty_bins, orchmllm_layout, place_bins, slot_arrays
from loom.balance.predict import predict_steps
from loom.plan.plan import LLM, Plan
from loom.schedule.layout import BatchLayout, contiguous_layout, max_over_mean, round_size, token_budget_sizes

__all__ = ["JOINT", "ORDERS", "POLICIES", "BalanceConfig", "BalanceError", "SampleCosts", "check_balance_config",
           "load_stats", "make_layout", "nothing_to_balance", "sample_costs"]


# ---- the policies ----------------------------------------------------------------------------
def nothing_to_balance(config: BalanceConfig, plan: Plan) -> str:
    """Why ``config``'s layout on ``plan`` is the given one by construction, or "" when its
    policies decide. Every module with one replica makes every round one slot: a per-phase
    policy (``orchmllm``, the paper's data-parallel setting) can then only leave each sample in
    its microbatch, unless ``order`` reorders the rounds. Depends on the config alone."""
    plan = plan.without_generators()  # make_layout decides the encoders and the LLM first
    chosen = set(config.summary(plan.module_names).values())
    if chosen == {"none"}:
        return "policy none"
    if config.order == "given" and round_size(plan) == 1 and not chosen & set(JOINT):
        return "nothing to balance: every round holds one slot (every data_parallel is 1)"
    return ""


def make_layout(config: BalanceConfig, plan: Plan, costs: SampleCosts, llm_batching: str = "padded",
                microbatch_tokens: int = 0) -> BatchLayout:
    """The layout of one global batch (``len(costs.llm_lengths)`` samples) under ``config``.

    ``microbatch_tokens`` > 0 (``data.microbatch_tokens``) cuts the batch into contiguous
    microbatches of at most that many LLM tokens (`token_budget_sizes`), at least
    ``plan.num_microbatches`` of them; it runs under the ``none`` policy only (the balancing
    policies choose their own microbatches).

    ``llm_batching`` says how the LLM batches a microbatch: ``"padded"`` (loom's runtime
    right-pads, so OrchMLLM's padded algorithm applies) or ``"packed"`` (LPT on the
    quadratic-aware per-sample cost, as for the encoders; the simulator's default).

    Raises `BalanceError` when the batch cannot be split under the constraints (fewer samples
    than microbatches, a policy that needs equal data-parallel degrees, rounds that do not
    divide the microbatch count)."""
    if plan.generator_names:
        gens = set(plan.generator_names)
        inner = dataclasses.replace(config, policy={k: v for k, v in config.policy.items() if k not in gens})
        return _with_generators(make_layout(inner, plan.without_generators(), costs, llm_batching, microbatch_tokens),
                                plan, costs, config.summary(plan.module_names))
    phases = plan.module_names
    if llm_batching not in ("padded", "packed"):
        raise BalanceError(f"llm_batching = {llm_batching!r}: choose 'padded' or 'packed'")
    n = costs.num_samples
    check_balance_config(config, plan, n)
    chosen = config.summary(phases)
    if microbatch_tokens > 0:
        if set(chosen.values()) != {"none"}:
            raise BalanceError(f"data.microbatch_tokens = {microbatch_tokens} with balance policies {chosen}: a token "
                               f"budget cuts the batch under the 'none' policy only; set data.microbatch_tokens = 0 or "
                               f"balance.default = \"none\"")
        try:
            sizes = token_budget_sizes(costs.llm_lengths, microbatch_tokens, plan.num_microbatches, round_size(plan))
        except ValueError as e:
            raise BalanceError(str(e)) from e
        return contiguous_layout(n, len(sizes), phases, sizes=sizes).check(n, phases)
    given = contiguous_layout(n, plan.num_microbatches, phases)
    if set(chosen.values()) == {"none"}:
        return given.check(n, phases)
    if why := nothing_to_balance(config, plan):
        # keep the given layout without deciding, so the step runs exactly what `none` runs
        given.policy, given.kept_given = dict(chosen), True
        given.predicted_gain = {"total": 0.0} | {p: 0.0 for p in phases}
        given.kept_why = why
        return given.check(n, phases)
    padded = llm_batching == "padded"
    if set(chosen.values()) == {"disttrain"}:
        layout = disttrain_layout(plan, costs, padded)
    elif set(chosen.values()) == {"entrain"}:
        layout = entrain_layout(plan, costs, padded, config.eager_forward, config.entrain_eager_max)
    else:
        layout = orchmllm_layout(plan, costs, chosen, config.order, padded, config.ranks_per_node,
                                 config.nodewise_time_limit)
    layout.check(n, phases)
    layout.check_routes(plan)
    # never slower than `none` by the policy's own cost model (issue 8): keep the given layout
    # where the predicted gain does not pay for the decision and the exchange; the model is the
    # layout's 1F1B step time (`loom.balance.predict`), per phase its busiest stage's compute
    before, after = predict_steps([given, layout], plan, costs, padded, eager=config.eager_forward)
    if layout.eager_forward > config.eager_forward:  # the policy's own warmup (Entrain's eager forward)
        after = predict_steps([layout], plan, costs, padded, eager=layout.eager_forward)[0]
    gain = (before.step - after.step) / before.step if before.step > 0 else 0.0
    layout.predicted_gain = {"total": round(gain, 6)} | {
        p: round((before.busy[p] - after.busy[p]) / before.busy[p], 6) if before.busy[p] > 0 else 0.0 for p in phases}
    if gain < config.min_gain:
        given.policy = dict(chosen)
        given.kept_given = True
        given.predicted_gain = layout.predicted_gain
        given.kept_why = f"predicted gain {gain:.4f} below balance.min_gain = {config.min_gain}"
        return given
    return layout


def _with_generators(layout: BatchLayout, plan: Plan, costs: SampleCosts, chosen: dict[str, str]) -> BatchLayout:
    """``layout`` (of the encoders and the LLM) with a generator phase each. Under ``none`` and
    ``disttrain`` (one layout for every phase; it counts the generator's work in its decision) a
    generator runs the LLM's slots; under ``orchmllm`` and ``entrain`` it is a phase of its own:
    the samples of each round of LLM slots are rebalanced over the round's generator slots by LPT
    on their generator cost (`generator_slots`), and the LLM's last stage sends each generator
    microbatch its samples' states (routed rows, like encoder outputs into the LLM). A layout
    kept as given keeps the LLM's slots for the generator too."""
    arrays = dict(layout.arrays)
    own = []
    for g in plan.generator_names:
        if chosen[g] in ("orchmllm", "entrain") and not layout.kept_given:
            index = generator_slots(layout, plan, costs.work[g], g)
            arrays[g] = slot_arrays(index, layout.num_microbatches)
            own.append((g, index))
        else:
            arrays[g] = arrays[LLM]
    rearranged = {g for g, _ in own}
    policy = {**layout.policy, **{g: chosen[g] if g in rearranged else layout.policy[LLM] for g in plan.generator_names}}
    out = BatchLayout(None, policy, arrays=arrays, kept_given=layout.kept_given,
                      predicted_gain=layout.predicted_gain)
    for g, index in own:
        out.set_slot_index(g, index)
    out.kept_why, out.contiguous, out.nodewise = layout.kept_why, layout.contiguous, layout.nodewise
    out.eager_forward = layout.eager_forward  # the encoders' warmup the inner policy chose
    out.unpermuted_slot = dict(layout.unpermuted_slot)
    if LLM in out.unpermuted_slot:
        out.unpermuted_slot.update({g: out.unpermuted_slot[LLM] for g in plan.generator_names})
    out.known_slot_costs = layout.known_slot_costs
    out.check_routes(plan)
    return out


def generator_slots(layout: BatchLayout, plan: Plan, work: np.ndarray, generator: str) -> np.ndarray:
    """Each sample's slot of ``generator`` as a phase of its own (orchmllm.md §3.4's
    post-balancing on the generator's cost): every round's samples (those of its LLM slots, so
    the states stay in the round, `BatchLayout.check_routes`) go into the round's slots by LPT,
    no slot empty, the heaviest bin on the least loaded replica so far (`place_bins`)."""
    r, m = round_size(plan), layout.num_microbatches
    llm_round = layout.slot_index(LLM) // r
    out = np.empty(llm_round.size, dtype=np.int64)
    carried = np.zeros(plan.spec(generator).data_parallel)
    for t in range(m // r):
        members = np.flatnonzero(llm_round == t)
        cost = work[members]
        bins, _ = nonempty_bins(quantised_lpt(cost, r).rank_of_sample, cost, r)
        slot_of_bin = place_bins(np.bincount(bins, weights=cost, minlength=r), carried.size, carried)
        out[members] = t * r + slot_of_bin[bins]
    return out


# ---- what a layout achieved ------------------------------------------------------------------
def load_stats(layout: BatchLayout, plan: Plan, costs: SampleCosts) -> dict[str, dict[str, float]]:
    """Per phase, max/mean of the load (summed per-sample cost) across data-parallel replicas
    and across microbatch slots: 1.0 is perfect balance. What the run directory records and
    the quality benchmark prints."""
    stats: dict[str, dict[str, float]] = {}
    m = layout.num_microbatches
    for phase in (p for p in layout.arrays if p in costs.work):  # generators are not costed yet
        dp = plan.spec(phase).data_parallel
        per_slot = np.bincount(layout.slot_index(phase), weights=costs.work[phase], minlength=m)
        per_replica = [float(per_slot[r::dp].sum()) for r in range(dp)]
        stats[phase] = {"replicas": round(max_over_mean(per_replica), 4),
                        "microbatches": round(max_over_mean(per_slot.tolist()), 4)}
    return stats
