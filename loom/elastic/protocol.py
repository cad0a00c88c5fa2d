"""The pure rules of recovery, apart from any process: the atomic-step decision and the copy
plan of missing layers. Both are functions of what every survivor reads from the store, so every
survivor reaches the same answer.

Atomic steps (gap G17 of oobleck.md: "discard partial gradients and redo the iteration with the
new plan"): after its gradients are synchronised and before its optimizer step, each rank of a
generation writes its vote for the step once (``ok`` with its loss share, or ``abort`` after a
communication error). The step commits iff every member voted ``ok``. A member that died without
voting can never vote, which the supervisor's failure notice makes final; a member still alive
and silent is waited for (its own error or timeout makes it vote ``abort``). Votes are written
once and never removed, so a rank that voted ``ok`` and then died still counts, and every
survivor, whenever it reads, decides the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

OK, ABORT = "ok", "abort"


def decide(members: Iterable[int], votes: Mapping[int, str], dead: Iterable[int]) -> str | None:
    """``"commit"``, ``"abort"`` or None (undecided yet: a live member has not voted).
    ``votes[rank]``: ``"ok"`` or ``"abort"`` for the members that voted; ``dead``: ranks the
    supervisor saw die."""
    dead = set(dead)
    undecided = False
    for m in members:
        v = votes.get(m)
        if v == ABORT:
            return "abort"
        if v is None:
            if m in dead:
                return "abort"  # it can never vote
            undecided = True
    return None if undecided else "commit"


def copy_plan(needs: Mapping[int, Iterable[str]], haves: Mapping[int, Iterable[str]]) -> dict[tuple[int, int], list[str]]:
    """Which surviving rank sends which parameters (and their optimizer state) to which rank
    (oobleck.md §3.7, gap G16: the optimizer state travels too): for every name rank ``r`` needs
    and does not have, the lowest rank that has it. ``{(source, receiver): sorted names}``.
    Raises `LookupError` naming a parameter no survivor holds (its every copy was lost)."""
    holders: dict[str, list[int]] = {}
    for r in sorted(haves):
        for n in haves[r]:
            holders.setdefault(n, []).append(r)
    out: dict[tuple[int, int], list[str]] = {}
    for r in sorted(needs):
        have = set(haves.get(r, ()))
        for n in sorted(set(needs[r]) - have):
            if n not in holders:
                raise LookupError(n)
            out.setdefault((holders[n][0], r), []).append(n)
    return dict(sorted(out.items()))


def sync_groups(held: Mapping[int, Iterable[str]]) -> dict[tuple[int, ...], list[str]]:
    """Layer-wise gradient synchronisation across heterogeneous pipelines (oobleck.md §3.9): the
    parameters grouped by the set of ranks holding them (one per pipeline), each group one
    all-reduce over those ranks. ``{holder ranks: sorted names}``, sets of one rank left out."""
    by_name: dict[str, list[int]] = {}
    for r in sorted(held):
        for n in held[r]:
            by_name.setdefault(n, []).append(r)
    out: dict[tuple[int, ...], list[str]] = {}
    for n, ranks in sorted(by_name.items()):
        if len(ranks) > 1:
            out.setdefault(tuple(ranks), []).append(n)
    return dict(sorted(out.items()))
