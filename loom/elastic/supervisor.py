"""The supervisor of an elastic run: the "centralised CPU process" of oobleck.md §3.10.

It hosts the `TCPStore` (which outlives every worker), starts the workers itself (``torchrun``'s
agent would stop or restart all of them on one failure, giving them new PIDs), watches them, and
when one dies publishes a failure notice: the dead ranks, then the next generation
(`loom.elastic.planning`) decided once for all. It never stops the survivors; they notice the
loss through a communication error, a timeout or the notice itself, and re-form. Deaths within
``settle_s`` of each other count as one failure (a node's processes, simultaneous kills).

For demos and tests, ``kills`` SIGKILLs ranks when a rank starts a step (``LOOM_KILL=RANK[,RANK...]@STEP[;...]`` in `loom train`'s environment).
It prints the run's progress from ``metrics.jsonl`` and the events (deaths, generations).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

from torch.distributed import TCPStore

from loom.elastic.coordination import STORE_ENV, Coordinator
from loom.elastic.layout import Generation

POLL_S = 0.02
STOP_EXIT = 3  # loom.elastic.stop.STOP_EXIT (not imported: the supervisor loads no model code)


@dataclass
class Kill:
    """SIGKILL ``ranks`` once ``ranks[0]`` has started step ``step`` (plus ``delay_s``)."""

    ranks: list[int]
    step: int
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Kill":
        """``"RANK[,RANK...]@STEP"``, e.g. ``"3@5"`` or ``"1,2@9"``."""
        try:
            ranks, step = text.split("@")
            return cls([int(r) for r in ranks.split(",")], int(step))
        except ValueError as e:
            raise ValueError(f"LOOM_KILL {text!r}: expected RANK[,RANK...]@STEP, e.g. 3@5") from e


@dataclass
class ElasticOutcome:
    status: str
    message: str
    returncode: int
    generations: list[Generation] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ElasticSupervisor:
    """Runs one elastic launch; see the module docstring. ``cmd``: the worker's command line
    (each gets ``RANK``, ``WORLD_SIZE``, the store's address and this process's pid);
    ``next_generation(prev, lost)``: the layout after the cumulative ``lost`` ranks died."""

    def __init__(self, cmd: list[str], run_dir: Path, first: Generation, num_ranks: int,
                 next_generation: Callable[[Generation, set[int]], Generation], env: dict[str, str] | None = None,
                 ranks_per_node: int = 1, kills: list[Kill] | None = None, settle_s: float = 0.3,
                 stall_s: float = 120.0, echo: bool = True, log_every: int = 1):
        self.cmd, self.run_dir, self.num_ranks = cmd, run_dir, num_ranks
        self.gen, self.next_generation = first, next_generation
        self.env = dict(os.environ if env is None else env)
        self.ranks_per_node = ranks_per_node
        self.kills = list(kills or [])
        self.settle_s, self.stall_s, self.echo, self.log_every = settle_s, stall_s, echo, log_every
        self.procs: dict[int, subprocess.Popen] = {}
        self.exits: dict[int, int] = {}
        self.dead: set[int] = set()
        self.generations = [first]
        self.signum: int | None = None

    def _say(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)

    def _event(self, row: dict) -> None:
        with open(self.run_dir / "elastic.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signum = signum

    def run(self) -> ElasticOutcome:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        port = free_port()
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        coord = Coordinator(store)
        coord.publish(self.gen)
        self._event({"event": "start", "time": time.time(), "pipelines": self.gen.pipelines,
                     "samples": self.gen.samples})
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for r in range(self.num_ranks):
                env = {**self.env, "RANK": str(r), "WORLD_SIZE": str(self.num_ranks), STORE_ENV: f"127.0.0.1:{port}",
                       "LOOM_SUPERVISOR_PID": str(os.getpid())}
                # the worker's output goes to its log from the start (it redirects itself once loaded)
                with open(self.run_dir / "logs" / f"rank{r}.log", "ab") as log:
                    self.procs[r] = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                     stderr=log, start_new_session=True)
            self._say(f"loom: workers started, pids {[p.pid for p in self.procs.values()]} (ranks 0..{self.num_ranks - 1}); "
                      f"pipelines {self.gen.pipelines}, samples per step {self.gen.samples}")
            return self._watch(coord)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._kill_all(signal.SIGKILL)

    def _kill_all(self, sig: int) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _watch(self, coord: Coordinator) -> ElasticOutcome:
        pending: dict[int, float] = {}  # deaths seen, not yet published
        metrics = self.run_dir / "metrics.jsonl"
        # bytes of metrics.jsonl read (a resumed run's earlier steps are not shown again); the last row's generation
        printed = metrics.stat().st_size if metrics.exists() else 0
        shown_generation = 0 if printed == 0 else -1  # a resumed run shows its first step
        last_progress = time.monotonic()
        while True:
            if self.signum is not None:
                self._kill_all(signal.SIGINT)
                time.sleep(1.0)
                name = signal.Signals(self.signum).name
                return ElasticOutcome(f"interrupted ({name})", f"loom: interrupted ({name})", 128 + self.signum,
                                      self.generations)
            for r, p in self.procs.items():
                if r in self.exits:
                    continue
                code = p.poll()
                if code is None:
                    continue
                self.exits[r] = code
                if code not in (0, STOP_EXIT):
                    why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    pending.setdefault(r, time.time())
                    self._event({"event": "death", "rank": r, "pid": p.pid, "code": code, "time": time.time()})
                    self._say(f"loom: rank {r} (pid {p.pid}) {why}")
            if pending and time.time() - min(pending.values()) >= self.settle_s and not self.gen.stop:
                self._publish(coord, set(pending))
                pending.clear()
            self._kill_due(coord)
            if metrics.exists() and metrics.stat().st_size > printed:
                with open(metrics, "rb") as f:
                    f.seek(printed)
                    chunk = f.read()
                complete = chunk[:chunk.rfind(b"\n") + 1]  # whole lines only
                printed += len(complete)
                for line in complete.decode().splitlines():
                    last_progress = time.monotonic()
                    row = json.loads(line)
                    if row["step"] % self.log_every == 0 or row["generation"] != shown_generation:
                        took = "(its leader died: from the votes)" if row["step_time_s"] is None else \
                            f"{row['step_time_s'] * 1e3:6.0f} ms"
                        self._say(f"step {row['step']:4d}  loss {row['loss']:.4f}  generation {row['generation']}  "
                                  f"pipelines {row['pipelines']}  {took}")
                    shown_generation = row["generation"]
            if len(self.exits) == len(self.procs):
                return self._outcome()
            if time.monotonic() - last_progress > self.stall_s:
                self._kill_all(signal.SIGKILL)
                return ElasticOutcome("failed: no progress", f"loom: no step completed for {self.stall_s:.0f} s; "
                                      f"stopped every worker (see {self.run_dir / 'logs'})", 1, self.generations)
            time.sleep(POLL_S)

    def _publish(self, coord: Coordinator, new: set[int]) -> None:
        per = self.ranks_per_node
        nodes = {r // per for r in new}
        lost = {r for node in nodes for r in range(node * per, (node + 1) * per)}
        for r in lost - new:  # the rest of a lost node goes with it
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, signal.SIGKILL)
        self.dead |= lost
        coord.mark_dead(self.dead)
        self.gen = self.next_generation(self.gen, set(self.dead))
        self.generations.append(self.gen)
        coord.publish(self.gen)
        self._event({"event": "generation", "generation": self.gen.number, "time": time.time(),
                     "lost": sorted(self.dead), "pipelines": self.gen.pipelines, "samples": self.gen.samples,
                     "stop": self.gen.stop})
        if self.gen.stop:
            self._say(f"loom: beyond f: {self.gen.stop}; the survivors save their state and stop")
        else:
            self._say(f"loom: generation {self.gen.number}: ranks {sorted(self.dead)} lost; pipelines "
                      f"{self.gen.pipelines}, samples per step {self.gen.samples}")

    def _kill_due(self, coord: Coordinator) -> None:
        for kill in list(self.kills):
            if coord.progress_of(kill.ranks[0]) >= kill.step:
                if kill.delay_s:
                    time.sleep(kill.delay_s)
                for r in kill.ranks:
                    p = self.procs[r]
                    if p.poll() is None:
                        os.kill(p.pid, signal.SIGKILL)
                        self._event({"event": "kill", "rank": r, "pid": p.pid, "step": kill.step, "time": time.time()})
                        self._say(f"loom: LOOM_KILL: SIGKILL to rank {r} (pid {p.pid}) at step {kill.step}")
                self.kills.remove(kill)

    def _outcome(self) -> ElasticOutcome:
        if self.gen.stop:
            saved = sorted((self.run_dir / "checkpoints").glob("elastic_step_*"), key=lambda p: int(p.name.split("_")[-1]))
            where = saved[-1] if saved else "nothing saved"
            return ElasticOutcome("stopped: beyond f", f"loom: stopped beyond f: {self.gen.stop}; the survivors' state "
                                  f"at the last committed step is in {where}", 2, self.generations)
        survivors = {r: c for r, c in self.exits.items() if r not in self.dead}
        bad = {r: c for r, c in survivors.items() if c != 0}
        if bad or not survivors:
            return ElasticOutcome("failed", f"loom: elastic run failed: exit statuses {bad}; see "
                                  f"{self.run_dir / 'logs'}", 1, self.generations)
        lost = ""
        if self.dead:
            kept = sorted(self.procs[r].pid for r in survivors)
            lost = f" after losing ranks {sorted(self.dead)}; the survivors' processes ran to the end (pids {kept})"
        return ElasticOutcome("completed", f"loom: completed{lost}; run dir {self.run_dir}", 0, self.generations)


def worker_command(config: Path, run_dir: Path, resume: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "loom.train.elastic", "--config", str(config), "--run-dir", str(run_dir),
            *(["--resume", str(resume)] if resume is not None else [])]
