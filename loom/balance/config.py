"""The ``[balance]`` section of a run and every refusal that depends on the config alone.

`check_balance_config` is the one place those refusals live: the CLI calls it before any
process starts, and `make_layout` calls it again on every batch, so a plan the CLI accepts is a
plan every rank can lay out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.plan.plan import LLM, Plan
from loom.schedule.layout import round_size

POLICIES = ("none", "orchmllm", "disttrain", "entrain")
ORDERS = ("given", "disttrain")
JOINT = ("disttrain", "entrain")  # policies that decide every phase at once
# policies whose layouts give every phase the LLM's slots (DistTrain's microbatches hold a
# sample in every module): the only ones encoders inside the LLM's first stage can run
SHARED_SLOTS = ("disttrain",)


class BalanceError(ValueError):
    """A balancing request that cannot be met; the message names the config field and the fix."""


@dataclass
class BalanceConfig:
    """``[balance]`` of a run: ``policy`` maps phase (module name, or ``"encoders"`` for every
    encoder) to a policy name; phases not named use ``default``."""

    default: str = "none"
    policy: dict[str, str] = field(default_factory=dict)
    order: str = "given"
    # extra microbatches every encoder stage forwards before its first backward (Entrain's
    # eager forward, entrain.md §3.6); each holds one more microbatch of activations
    eager_forward: int = 0
    # Entrain's eager forward as part of its policy (entrain.md §3.6: "as many forward passes as
    # memory constraints allow"): the ``entrain`` policy deepens the encoders' warmup by up to this
    # many microbatches beyond ``eager_forward``, as deep as its 1F1B prediction finds faster
    # (ties: shallower). Each holds one more microbatch of encoder activations; 0 turns it off
    entrain_eager_max: int = 2
    # ranks that share a node (consecutive global ranks); above 1, OrchMLLM's node-wise
    # rearrangement (orchmllm.md §3.10) permutes each round's balanced bins over the round's
    # slots so fewer payload bytes cross nodes. 1: every rank its own node, rearrangement off
    ranks_per_node: int = 1
    # seconds node-wise rearrangement may take per step, over every round and balanced phase (the
    # heuristic always runs; the MILP gets what is left, orchmllm.md §3.10)
    nodewise_time_limit: float = 0.05
    # the smallest predicted gain (a fraction of the given layout's step time, by the policies' own
    # cost model, loom.balance.predict) worth a rearranged layout: below it the decision, the
    # payload exchange and the routed rows cost more than they save, and the given layout is kept
    min_gain: float = 0.01

    def policy_of(self, phase: str) -> str:
        if phase in self.policy:
            return self.policy[phase]
        if phase != LLM and "encoders" in self.policy:
            return self.policy["encoders"]
        return self.default

    def check(self, phases: list[str] | None = None) -> "BalanceConfig":
        """The config's own values (and, given the plan's phases, that they name real modules
        and combine); `check_balance_config` adds what depends on the plan and batch."""
        for where, name in [("balance.default", self.default)] + [(f"balance.policy.{k}", v) for k, v in self.policy.items()]:
            if name not in POLICIES:
                raise BalanceError(f"{where} = {name!r} is not a policy; choose one of {list(POLICIES)}")
        if self.order not in ORDERS:
            raise BalanceError(f"balance.order = {self.order!r}: choose one of {list(ORDERS)}")
        if isinstance(self.eager_forward, bool) or not isinstance(self.eager_forward, int) or self.eager_forward < 0:
            raise BalanceError(f"balance.eager_forward = {self.eager_forward!r}: use 0 or more extra microbatches")
        if (isinstance(self.entrain_eager_max, bool) or not isinstance(self.entrain_eager_max, int)
                or self.entrain_eager_max < 0):
            raise BalanceError(f"balance.entrain_eager_max = {self.entrain_eager_max!r}: use 0 or more extra "
                               f"microbatches (0: Entrain keeps balance.eager_forward's warmup)")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise BalanceError(
                f"balance.ranks_per_node = {self.ranks_per_node!r}: use a positive integer (the ranks of one node; "
                f"1 turns node-wise rearrangement off)"
            )
        if (isinstance(self.nodewise_time_limit, bool) or not isinstance(self.nodewise_time_limit, (int, float))
                or not 0 < self.nodewise_time_limit < float("inf")):
            raise BalanceError(f"balance.nodewise_time_limit = {self.nodewise_time_limit!r}: use a positive number of "
                               f"seconds (0.05 by default) for node-wise rearrangement per step")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not self.min_gain < 1:
            raise BalanceError(f"balance.min_gain = {self.min_gain!r}: use a fraction below 1 of the predicted step "
                               f"time (0.01 by default; negative accepts layouts predicted slower)")
        if phases is not None:
            unknown = sorted(set(self.policy) - set(phases) - {"encoders"})
            if unknown:
                raise BalanceError(f"balance.policy names {unknown}, which are not modules of the plan {phases}; "
                                   f"use module names or 'encoders'")
            chosen = {p: self.policy_of(p) for p in phases}
            for joint in JOINT:
                if joint in chosen.values() and set(chosen.values()) != {joint}:
                    raise BalanceError(
                        f"balance.policy {chosen}: {joint!r} decides every phase at once; set balance.default = "
                        f"{joint!r} and name no other policy"
                    )
        return self

    def summary(self, phases: list[str]) -> dict[str, str]:
        """Each phase's policy, ``phases`` in plan order: those after the LLM are generators,
        which ``"encoders"`` does not name (they take their own entry, else ``default``)."""
        generators = set(phases[phases.index(LLM) + 1:]) if LLM in phases else set()
        return {p: self.policy.get(p, self.default) if p in generators else self.policy_of(p) for p in phases}


def check_balance_config(config: BalanceConfig, plan: Plan, global_batch_size: int) -> None:
    """Raise `BalanceError` (naming the field and the fix) for every refusal that depends only
    on the config: the balance section's values, a batch with fewer samples than microbatches,
    per-phase policies whose rounds do not divide the microbatches, and the joint policies'
    needs (equal data-parallel degrees, microbatches and, for Entrain, samples divisible by the
    replica count), and with ``plan.placement = "first_stage"`` no policy but those of
    `SHARED_SLOTS` (the encoders there run inside the LLM's first stage, on its slots;
    `loom.schedule.generators.build_schedule` refuses other layouts).
    Policy ``none`` needs nothing beyond a sample per microbatch: its identity layout runs any
    plan."""
    phases = plan.module_names
    config.check(phases)
    n, m = global_batch_size, plan.num_microbatches
    if n < m:
        raise BalanceError(
            f"data.global_batch_size = {n} is smaller than plan.num_microbatches = {m}: every microbatch "
            f"needs a sample; raise the batch size or lower the microbatch count"
        )
    chosen = set(config.summary(phases).values())
    if chosen == {"none"}:
        return
    laned = [m for m in plan.encoder_names if plan.lanes(m) > 1]
    if laned:  # a unit's replicas share each of its microbatches: the policies balance whole replicas
        raise BalanceError(f"balance.policy {config.summary(phases)} with plan.modules[{laned[0]!r}] in lanes (TP 1 "
                           f"colocated beside the LLM's TP {plan.spec(LLM).tensor_parallel}): not supported yet; set "
                           f"balance.default = 'none', or give the encoder the LLM's tensor_parallel")
    if plan.placement == "first_stage" and not chosen <= {"none", *SHARED_SLOTS}:
        # a rank runs slot j of its encoders with its LLM stage's
        raise BalanceError(f"balance.policy {config.summary(phases)} with plan.placement = {plan.placement!r}: the "
                           f"encoders run each LLM microbatch's own samples; choose balance.default = "
                           f"{' or '.join(repr(p) for p in SHARED_SLOTS)} (its microbatches hold a sample in every "
                           f"module) or 'none', or use placement = 'disaggregated' to balance per phase")
    if chosen & set(JOINT):
        (policy,) = chosen
        dp = plan.spec(LLM).data_parallel
        degrees = {s.name: s.data_parallel for s in plan.modules}
        if any(d != dp for d in degrees.values()):
            why = ("assigns each sample to one replica for encoders and LLM alike" if policy == "entrain"
                   else "balances over one set of data-parallel groups")
            raise BalanceError(
                f"balance.default = {policy!r} {why}; set every module's plan.modules.<name>.data_parallel to {dp} "
                f"(now {degrees}), or choose balance.default = 'orchmllm'"
            )
        if m % dp:
            raise BalanceError(
                f"plan.num_microbatches = {m} is not a multiple of the data-parallel degree {dp}, which "
                f"balance.default = {policy!r} needs (every replica runs the same count); use a multiple of {dp}"
            )
        if policy == "entrain" and n % dp:
            raise BalanceError(
                f"data.global_batch_size = {n} does not split evenly over the {dp} data-parallel replicas, which "
                f"Entrain's DP-level assignment needs (entrain.md §3.4, B/DP samples each); use a multiple of {dp}"
            )
        return
    r = round_size(plan)
    if m % r:
        balanced = sorted(p for p, v in config.summary(phases).items() if v != "none")
        raise BalanceError(
            f"plan.num_microbatches = {m} is not a multiple of the round size {r} (lcm of the modules' "
            f"data_parallel): balancing {balanced} rearranges one microbatch of every replica at a time; use a "
            f"multiple of {r}, or balance.default = 'none'"
        )
