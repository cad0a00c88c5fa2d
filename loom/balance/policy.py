"""Balancing policies: from a global batch's metadata to a `BatchLayout` (DESIGN.md principle 4).

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
  K_eff, stratified microbatches, pairwise deferral of LLM work one microbatch forward, the
  interleaved overloaded/underloaded order. Needs equal data-parallel degrees (the encoders
  form the "single unified encoder module" of §2.3).

``order`` (``given`` or ``disttrain``) reorders whole rounds for the per-phase policies with
DistTrain's Algorithm 3; ``disttrain`` and ``entrain`` bring their own order.

Per-sample cost is the module's forward FLOPs from the cost model's architecture description
(`loom.cost.flops`), which carries the quadratic attention term; the decisions only compare
costs, so the hardware's rate cancels.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.balance.config import JOINT, ORDERS, POLICIES, BalanceConfig, BalanceError, check_balance_config
from loom.balance.disttrain import balance_dp_groups, reorder_microbatches
from loom.balance.entrain import entrain_replica_plans
from loom.schedule.layout import BatchLayout, LayoutError, identity_layout, max_over_mean, round_size
from loom.balance.orchmllm import lpt_balance, padded_balance
from loom.cost.arch import ModelArch
from loom.cost.flops import attention_flops, gemm_flops
from loom.cost.model import Workload
from loom.data.collate import split_microbatches
from loom.data.sample import SampleMeta
from loom.plan.plan import LLM, Plan

# ---- per-sample costs ------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleCosts:
    """Per phase, each sample's forward FLOPs; the LLM's token lengths and its per-token
    (``alpha``) and per-token² (``beta``) FLOPs for the padded algorithm."""

    work: dict[str, list[float]]
    llm_lengths: list[int]
    llm_alpha: float
    llm_beta: float


def _coefficients(arch: ModelArch, name: str) -> tuple[float, float]:
    """Forward FLOPs of module ``name`` per token and per attention length² (both are linear
    in a `Workload`'s ``tokens`` and ``attn_sq``, so two evaluations give every sample's cost)."""
    layers = arch.module(name).layers
    return (sum(gemm_flops(l, Workload(tokens=1)).forward for l in layers),
            sum(attention_flops(l, Workload(attn_sq=1)).forward for l in layers))


def sample_costs(arch: ModelArch, metas: list[SampleMeta]) -> SampleCosts:
    """Costs of every sample of a batch, from metadata only."""
    from loom.cost.workload import sample_work  # the one metadata -> Workload rule

    per_sample = [sample_work(arch, [m]) for m in metas]
    coef = {name: _coefficients(arch, name) for name in arch.module_names}
    work = {name: [coef[name][0] * w[name].tokens + coef[name][1] * w[name].attn_sq for w in per_sample]
            for name in arch.module_names}
    alpha, beta = coef[LLM]
    return SampleCosts(work, [w[LLM].tokens for w in per_sample], alpha, beta)


# ---- the policies ----------------------------------------------------------------------------
def make_layout(config: BalanceConfig, plan: Plan, costs: SampleCosts, llm_batching: str = "padded") -> BatchLayout:
    """The layout of one global batch (``len(costs.llm_lengths)`` samples) under ``config``.

    ``llm_batching`` says how the LLM batches a microbatch: ``"padded"`` (loom's runtime
    right-pads, so OrchMLLM's padded algorithm applies) or ``"packed"`` (LPT on the
    quadratic-aware per-sample cost, as for the encoders; the simulator's default).

    Raises `BalanceError` when the batch cannot be split under the constraints (fewer samples
    than microbatches, a policy that needs equal data-parallel degrees, rounds that do not
    divide the microbatch count)."""
    phases = plan.module_names
    if llm_batching not in ("padded", "packed"):
        raise BalanceError(f"llm_batching = {llm_batching!r}: choose 'padded' or 'packed'")
    n = len(costs.llm_lengths)
    check_balance_config(config, plan, n)
    chosen = config.summary(phases)
    if set(chosen.values()) == {"disttrain"}:
        layout = _disttrain(plan, costs)
    elif set(chosen.values()) == {"entrain"}:
        layout = _entrain(plan, costs)
    else:
        layout = _per_phase(plan, costs, chosen, config.order, llm_batching == "padded")
    layout.check(n, phases)
    layout.check_routes(plan)
    return layout


def _phase_total(costs: SampleCosts, phases: list[str]) -> list[float]:
    return [sum(costs.work[p][s] for p in phases) for s in range(len(costs.llm_lengths))]


def _bins_nonempty(bins: list[list[int]], cost: list[float]) -> list[list[int]]:
    """Move the cheapest sample of the fullest bin into each empty one (zero-cost samples, e.g.
    text-only ones in an encoder phase, all land on one bin under LPT). Keeps every sample."""
    for b in range(len(bins)):
        if not bins[b]:
            donor = max(range(len(bins)), key=lambda i: (len(bins[i]), -i))
            s = min(bins[donor], key=lambda x: (cost[x], x))
            bins[donor].remove(s)
            bins[b].append(s)
    return [sorted(x) for x in bins]


def _balance_bins(samples: list[int], num_bins: int, phase: str, costs: SampleCosts, padded: bool) -> list[list[int]]:
    """OrchMLLM post-balancing of ``samples`` over ``num_bins``: the padded algorithm for a
    padded LLM, LPT on per-sample cost for everything packed."""
    cost = costs.work[phase]
    if phase == LLM and padded:
        lengths = [costs.llm_lengths[s] for s in samples]
        a = padded_balance(lengths, num_bins, alpha=costs.llm_alpha, beta=costs.llm_beta)
    else:
        a = lpt_balance([cost[s] for s in samples], num_bins)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i, b in enumerate(a.rank_of_sample):
        bins[int(b)].append(samples[i])
    return _bins_nonempty(bins, cost)


def _per_phase(plan: Plan, costs: SampleCosts, chosen: dict[str, str], order: str, llm_padded: bool) -> BatchLayout:
    n, m = len(costs.llm_lengths), plan.num_microbatches
    r = round_size(plan)
    base = split_microbatches(list(range(n)), m)
    if any(p != "none" for p in chosen.values()) and m % r:
        raise BalanceError(
            f"plan.num_microbatches = {m} is not a multiple of the round size {r} (lcm of the modules' "
            f"data_parallel): balancing rearranges one microbatch of every replica at a time; use a multiple of {r}"
        )
    rounds = [[s for j in range(t * r, t * r + r) for s in base[j]] for t in range(m // r)] if m % r == 0 else []
    slots: dict[str, list[tuple[int, ...]]] = {}
    for phase, policy in chosen.items():
        if policy == "none":
            slots[phase] = [tuple(b) for b in base]
            continue
        dp = plan.spec(phase).data_parallel
        carried = [0.0] * dp  # each replica's load over the rounds placed so far
        slots[phase] = []
        for rnd in rounds:
            bins = _balance_bins(rnd, r, phase, costs, llm_padded)
            slots[phase].extend(_place_bins(bins, [sum(costs.work[phase][s] for s in b) for b in bins], dp, carried))
    if order == "disttrain" and m // r > 1 and rounds:
        perm = _round_order(plan, costs, slots, r)
        slots = {p: [s for t in perm for s in v[t * r:(t + 1) * r]] for p, v in slots.items()}
    return BatchLayout({p: tuple(v) for p, v in slots.items()}, dict(chosen))


def _place_bins(bins: list[list[int]], loads: list[float], dp: int, carried: list[float]) -> list[tuple[int, ...]]:
    """Put one round's balanced bins on its slots (slot ``b`` is replica ``b % dp``'s): the
    heaviest bin to the replica with the least load so far. Any permutation keeps the round's
    balance (orchmllm.md §2.2's observation behind node-wise rearrangement); this one also
    balances each replica's total over the iteration, which is what its data-parallel peers wait
    for at the gradient all-reduce. Updates ``carried``."""
    free = list(range(len(bins)))
    placed: list[tuple[int, ...]] = [()] * len(bins)
    for b in sorted(range(len(bins)), key=lambda i: (-loads[i], i)):
        slot = min(free, key=lambda x: (carried[x % dp], x))
        free.remove(slot)
        placed[slot] = tuple(bins[b])
        carried[slot % dp] += loads[b]
    return placed


def _round_order(plan: Plan, costs: SampleCosts, slots: dict[str, list[tuple[int, ...]]], r: int) -> list[int]:
    """DistTrain Algorithm 3 over rounds: a round's encoder time is its slowest encoder slot,
    its LLM time the slowest LLM slot (per LLM stage)."""
    encoders = plan.encoder_names
    rounds = len(slots[LLM]) // r

    def slowest(phase: str, t: int) -> float:
        return max(sum(costs.work[phase][s] for s in slot) for slot in slots[phase][t * r:(t + 1) * r])

    enc = [max([slowest(e, t) for e in encoders] or [0.0]) for t in range(rounds)]
    p_llm = plan.spec(LLM).num_stages
    llm = [slowest(LLM, t) / p_llm for t in range(rounds)]
    depth = 1 + p_llm
    return reorder_microbatches(enc, llm, depth)


def _disttrain(plan: Plan, costs: SampleCosts) -> BatchLayout:
    """DistTrain: groups over the LLM's replicas, LPT microbatches, Algorithm 3 order."""
    n, m = len(costs.llm_lengths), plan.num_microbatches
    dp = plan.spec(LLM).data_parallel
    if any(s.data_parallel != dp for s in plan.modules):
        raise BalanceError(
            f"balance.default = 'disttrain' balances over one set of data-parallel groups; set every module's "
            f"data_parallel to {dp} (now {[s.data_parallel for s in plan.modules]})"
        )
    if m % dp:
        raise BalanceError(f"plan.num_microbatches = {m} is not a multiple of the LLM's data_parallel = {dp}")
    k = m // dp
    total = _phase_total(costs, plan.module_names)
    groups = balance_dp_groups(total, dp)
    if any(len(g) < k for g in groups):
        # a group with fewer samples than its microbatches (it drew the heavy ones): Algorithm 2
        # with equal counts (disttrain.md §3.3, defect 2) when they divide, else the lightest
        # samples of the fullest groups move over; n >= dp * k, so both succeed
        groups = balance_dp_groups(total, dp, equal_counts=True) if n % dp == 0 else _fill_counts(groups, k, total)
    per_group: list[list[tuple[int, ...]]] = []
    p_llm = plan.spec(LLM).num_stages
    for g in groups:
        mbs = balance_dp_groups([total[s] for s in g], k)
        mbs = [sorted(g[i] for i in mb) for mb in mbs]
        mbs = _bins_nonempty([list(x) for x in mbs], total)
        enc = [sum(costs.work[e][s] for e in plan.encoder_names for s in mb) for mb in mbs]
        llm = [sum(costs.work[LLM][s] for s in mb) / p_llm for mb in mbs]
        order = reorder_microbatches(enc, llm, 1 + p_llm)
        per_group.append([tuple(mbs[i]) for i in order])
    slots = [per_group[j % dp][j // dp] for j in range(m)]
    return identity_layout(slots, plan.module_names, "disttrain")


def _entrain(plan: Plan, costs: SampleCosts) -> BatchLayout:
    """Entrain: replica assignment, K_eff, stratified microbatches, deferral, interleaving."""
    dp = plan.spec(LLM).data_parallel
    if any(s.data_parallel != dp for s in plan.modules):
        raise BalanceError(
            f"balance.default = 'entrain' assigns each sample to one replica for encoders and LLM alike; set every "
            f"module's data_parallel to {dp} (now {[s.data_parallel for s in plan.modules]})"
        )
    m = plan.num_microbatches
    if m % dp:
        raise BalanceError(f"plan.num_microbatches = {m} is not a multiple of the LLM's data_parallel = {dp}")
    n = len(costs.llm_lengths)
    if n % dp:
        raise BalanceError(
            f"data.global_batch_size = {n} does not split evenly over the {dp} data-parallel replicas, which "
            f"Entrain's DP-level assignment needs (entrain.md §3.4, B/DP samples each); use a multiple of {dp}"
        )
    enc = _phase_total(costs, plan.encoder_names)
    llm = costs.work[LLM]
    k = m // dp
    # K_eff differs per replica; every replica runs the same count (the schedule's microbatches
    # are round-robin over replicas), so shrink to the smallest until they agree.
    while True:
        plans = entrain_replica_plans(enc, llm, dp, k)
        counts = {p.num_microbatches for p in plans}
        if counts == {k} or k == 1:
            break
        k = min(counts)
    llm_slots: list[tuple[int, ...]] = []
    enc_slots: list[tuple[int, ...]] = []
    for j in range(dp * k):
        p = plans[j % dp]
        enc_slots.append(tuple(sorted(p.encoder_microbatches[j // dp])))
        llm_slots.append(tuple(sorted(p.llm_microbatches[j // dp])))
    llm_slots = _keep_llm_nonempty(enc_slots, llm_slots, dp)
    slots = {e: tuple(enc_slots) for e in plan.encoder_names}
    slots[LLM] = tuple(llm_slots)
    return BatchLayout(slots, {p: "entrain" for p in plan.module_names})


def _fill_counts(groups: list[list[int]], k: int, cost: list[float]) -> list[list[int]]:
    """Every group at least ``k`` samples: the cheapest sample of the fullest group moves to a
    short one until none is short (deterministic; keeps every sample)."""
    groups = [list(g) for g in groups]
    for g in groups:
        while len(g) < k:
            donor = max(groups, key=len)
            s = min(donor, key=lambda x: (cost[x], x))
            donor.remove(s)
            g.append(s)
    return [sorted(g) for g in groups]


def _keep_llm_nonempty(enc: list[tuple[int, ...]], llm: list[tuple[int, ...]], dp: int) -> list[tuple[int, ...]]:
    """Entrain may defer every sample of an overloaded microbatch (entrain.md §7 gap 9); loom
    keeps the last one in place so no LLM microbatch is empty."""
    llm = [list(x) for x in llm]
    for j, slot in enumerate(llm):
        if not slot:
            if j + dp >= len(llm):
                raise LayoutError(f"entrain left LLM microbatch {j} empty with nowhere to take a sample from")
            s = max(enc[j])
            llm[j + dp].remove(s)
            slot.append(s)
    return [tuple(sorted(x)) for x in llm]


# ---- what a layout achieved ------------------------------------------------------------------
def load_stats(layout: BatchLayout, plan: Plan, costs: SampleCosts) -> dict[str, dict[str, float]]:
    """Per phase, max/mean of the load (summed per-sample cost) across data-parallel replicas
    and across microbatch slots: 1.0 is perfect balance. What the run directory records and
    the quality benchmark prints."""
    stats: dict[str, dict[str, float]] = {}
    for phase, slots in layout.slots.items():
        dp = plan.spec(phase).data_parallel
        per_slot = [sum(costs.work[phase][s] for s in slot) for slot in slots]
        per_replica = [sum(per_slot[j] for j in range(r, len(per_slot), dp)) for r in range(dp)]
        stats[phase] = {"replicas": round(max_over_mean(per_replica), 4),
                        "microbatches": round(max_over_mean(per_slot), 4)}
    return stats

