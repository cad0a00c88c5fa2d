"""The store every process of an elastic run shares: the supervisor hosts it (the "centralised
CPU process" of oobleck.md §3.10, which outlives any worker) and the workers read and write it.

Keys (values are text):

- ``gen``: the latest generation's number (a counter: `TCPStore.add` reads it without blocking);
  ``gen/<n>``: generation ``n``'s layout (`loom.elastic.layout.Generation`, JSON), published
  before the counter moves;
- ``dead``: every rank the supervisor saw die, JSON (written before the generation that drops
  them);
- ``vote/<n>/<step>/<rank>``: a rank's vote on a step in generation ``n``
  (`loom.elastic.protocol`): ``abort``, or ``ok`` and a JSON payload (its loss shares, and the
  sample indices its pipeline ran, from the pipeline's first rank);
- ``progress/<rank>``: the step a rank last started (the supervisor's demo kill waits on it);
- ``g<n>/...``: generation ``n``'s rendezvous: its process groups and what each rank holds.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

from torch.distributed import Store, TCPStore

from loom.elastic.layout import Generation
from loom.elastic.protocol import ABORT, OK, decide

STORE_ENV = "LOOM_ELASTIC_STORE"  # host:port of the supervisor's store, in each worker's environment
POLL_S = 0.005


def connect(address: str, timeout_s: float) -> TCPStore:
    """A worker's client of the supervisor's store at ``host:port``."""
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


class Coordinator:
    """Typed access to the shared store (module docstring)."""

    def __init__(self, store: Store):
        self.store = store

    # ---- the supervisor's side -------------------------------------------------------------
    def publish(self, gen: Generation) -> None:
        self.store.set(f"gen/{gen.number}", gen.to_json())
        if gen.number > 0:
            self.store.add("gen", 1)
        else:
            self.store.add("gen", 0)

    def mark_dead(self, ranks: set[int]) -> None:
        self.store.set("dead", json.dumps(sorted(ranks)))

    def progress_of(self, rank: int) -> int:
        key = f"progress/{rank}"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    # ---- the workers' side ------------------------------------------------------------------
    def latest(self) -> int:
        return int(self.store.add("gen", 0))

    def generation(self, number: int) -> Generation:
        return Generation.from_json(self.store.get(f"gen/{number}").decode())

    def dead(self) -> set[int]:
        return set(json.loads(self.store.get("dead"))) if self.store.check(["dead"]) else set()

    def started(self, rank: int, step: int) -> None:
        self.store.set(f"progress/{rank}", str(step))

    def vote(self, gen: int, step: int, rank: int, payload: dict | None) -> None:
        """``payload`` None: abort; else ok with it. Once per (gen, step, rank)."""
        value = ABORT if payload is None else OK + json.dumps(payload)
        self.store.set(f"vote/{gen}/{step}/{rank}", value)

    def has_voted(self, gen: int, step: int, rank: int) -> bool:
        return self.store.check([f"vote/{gen}/{step}/{rank}"])

    def votes(self, gen: int, step: int, members: list[int]) -> dict[int, str]:
        out = {}
        for m in members:
            key = f"vote/{gen}/{step}/{m}"
            if self.store.check([key]):
                out[m] = self.store.get(key).decode()
        return out

    def wait_keys(self, keys: list[str], gen: int, timeout_s: float) -> None:
        """Wait until every key exists; give up (`TimeoutError`) after ``timeout_s`` or as soon as
        a generation newer than ``gen`` is published (a member died meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if self.latest() > gen:
                raise RuntimeError(f"generation {self.latest()} published while waiting for generation {gen}'s members")
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(f"waited {timeout_s:.0f} s for {missing}")
            time.sleep(10 * POLL_S)

    def await_decision(self, gen: int, step: int, members: list[int], timeout_s: float) -> tuple[str, dict[int, dict]]:
        """Wait until every survivor decides the same (`decide`); returns the decision and, on
        commit, every member's payload."""
        deadline = time.monotonic() + timeout_s
        while True:
            votes = self.votes(gen, step, members)
            kinds = {m: (ABORT if v == ABORT else OK) for m, v in votes.items()}
            verdict = decide(members, kinds, self.dead())
            if verdict is not None:
                return verdict, ({m: json.loads(v[len(OK):]) for m, v in votes.items()} if verdict == "commit" else {})
            if time.monotonic() > deadline:
                silent = [m for m in members if m not in votes]
                raise TimeoutError(f"step {step}: ranks {silent} neither voted nor died within {timeout_s:.0f} s")
            time.sleep(POLL_S)
