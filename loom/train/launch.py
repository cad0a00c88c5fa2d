"""`loom train`'s supervisor: run ``torchrun`` and its workers, stop them all on Ctrl-C,
SIGTERM or the first failing rank, and leave the run directory's ``status``
(`loom.train.status`).

torchrun starts each worker in a session of its own, so a signal to ``loom train`` (or to its
terminal's process group) reaches neither. The supervisor therefore starts torchrun in a new
session too and signals every process of the run itself: torchrun's process group and each
worker (found from the pid files the workers write and from torchrun's children in
``/proc``), SIGINT first and SIGKILL after ``grace_s``. A SIGTERM to ``loom train`` instead
goes to the workers as SIGTERM, on which they save a checkpoint at the next step boundary and
exit (`loom.train.main`); the supervisor waits up to ``stop_grace_s`` for that before it stops
what is left as above. Worker output goes to
``logs/rank<R>.log``; torchrun's own to ``logs/torchrun.log``; the terminal gets rank 0's
progress lines and one line at the end.

If ``loom train`` itself dies without a chance to stop them (SIGKILL, a crash), its workers die
with it: torchrun asks the kernel (``prctl(PR_SET_PDEATHSIG)``, Linux) for SIGKILL when
``loom train`` dies (`exec_dying_with_parent` makes the request, then execs torchrun), and each worker asks the same for when torchrun dies (`die_with_parent`,
called first thing in `loom.train.main`). The run's ``status`` then still says ``running``;
``logs/loom.pid`` holds ``loom train``'s pid, so the next ``loom train`` on that run directory
can tell the run is gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loom.train.status import LOGS, SUPERVISOR_PID, read_exits, read_pids, steps_done, write_status

POLL_S = 0.05
SUPERVISOR_ENV = "LOOM_SUPERVISOR_PID"  # tells the workers which `loom train` supervises them
_PR_SET_PDEATHSIG = 1


@dataclass
class Outcome:
    status: str  # the status line written to the run directory
    message: str  # the one line printed at the end ("" when completed)
    returncode: int


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl  # noqa: B018 - present in every Linux libc; checked here, not in a forked child
    except (OSError, AttributeError):
        return None
    return libc


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing, and False). If ``expected_parent`` is given and is no longer alive (it
    died between our fork and this call, before the request counted), exit at once."""
    libc = _libc()
    ok = libc is not None and libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if expected_parent is not None and not alive(expected_parent):
        os._exit(1)
    return ok


def is_loom_process(pid: int) -> bool:
    """Whether ``pid`` runs and is (still) a loom process: a recorded pid may have been reused
    by an unrelated program since."""
    if not alive(pid):
        return False
    try:
        return b"loom" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust kill(0)


def children(ppid: int) -> list[int]:
    """Processes whose parent is ``ppid`` (from ``/proc``; empty where there is none)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == ppid:
            out.append(int(entry))
    return out


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Runs one ``loom train`` launch; see the module docstring."""

    def __init__(self, cmd: list[str], run_dir: Path, world_size: int, env: dict[str, str],
                 roles: dict[int, str] | None = None, grace_s: float = 3.0, steps: int | None = None,
                 stop_grace_s: float = 120.0):
        self.cmd, self.run_dir, self.world_size, self.env = cmd, run_dir, world_size, env
        self.steps = steps  # the run's step count, to tell a death in teardown from one mid-run
        self.roles = roles or {}
        self.grace_s = grace_s
        self.stop_grace_s = stop_grace_s  # after SIGTERM: time for the workers' final checkpoint
        self.signum: int | None = None
        self.workers: dict[int, int] = {}  # pid -> rank (-1 until its pid file names it)
        self.deaths: dict[int, float] = {}  # rank -> when it was first seen dead
        self.proc: subprocess.Popen | None = None

    # ---- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None and self.proc is not None:
            self._kill_all(signal.SIGKILL)  # a second Ctrl-C: stop waiting
        self.signum = signum

    def run(self) -> Outcome:
        logs = self.run_dir / LOGS
        logs.mkdir(parents=True, exist_ok=True)
        write_status(self.run_dir, "running")
        (logs / SUPERVISOR_PID).write_text(f"{os.getpid()}\n")
        me = os.getpid()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with open(logs / "torchrun.log", "ab") as log:
                # torchrun dies with us (a SIGKILL of `loom train` leaves nothing running): started
                # through `exec_dying_with_parent` (this module's __main__), which makes the request
                # and execs it; no preexec_fn, which is unsafe in a process with threads (torch's)
                self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(me), *self.cmd],
                                             env={**self.env, SUPERVISOR_ENV: str(me)}, stderr=log,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
                outcome = self._watch()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        write_status(self.run_dir, outcome.status)
        return outcome

    # ---- watching -------------------------------------------------------------------------
    def _refresh_workers(self) -> None:
        assert self.proc is not None
        pids = read_pids(self.run_dir)
        if len(pids) < self.world_size:
            # a worker that has not written its pid yet is found as torchrun's child; scanning
            # /proc costs more than the pid files on a loaded machine, so only until all are in
            for pid in children(self.proc.pid):
                self.workers.setdefault(pid, -1)
        for rank, pid in pids.items():
            self.workers[pid] = rank

    def _failure_seen(self) -> bool:
        # deaths first: a killed rank's peers write their (communication) records within
        # milliseconds, so the poll that sees those must also see the death that caused them;
        # records are read after, as a rank writes its record before it exits
        dead = [(rank, time.time()) for pid, rank in self.workers.items() if rank >= 0 and not alive(pid)]
        exits = read_exits(self.run_dir)
        for rank, when in dead:
            if rank not in exits:
                self.deaths.setdefault(rank, when)
        return any(e.state != "done" for e in exits.values()) or bool(self.deaths)

    def _watch(self) -> Outcome:
        assert self.proc is not None
        stop_reason = None
        while self.proc.poll() is None:
            self._refresh_workers()
            if self.signum is not None:
                stop_reason = "signal"
                break
            if self._failure_seen():
                self._settle()
                stop_reason = "failure"
                break
            time.sleep(POLL_S)
        if stop_reason is not None:
            self._teardown()
        else:
            self._refresh_workers()
            self._reap_workers()
        return self._outcome(self.proc.returncode)

    def _settle(self, seconds: float = 1.0) -> None:
        """When only communication errors are seen, give the cause a moment to show: a rank
        killed by a signal closes its sockets while it exits, before it counts as dead, so
        its peers can report first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.deaths or any(e.state == "error" for e in read_exits(self.run_dir).values()):
                return
            time.sleep(POLL_S)
            self._failure_seen()

    def _kill_all(self, sig: int) -> None:
        assert self.proc is not None
        _signal(self.proc.pid, sig, group=True)
        for pid in list(self.workers):
            # torchrun's workers lead sessions (and process groups) of their own
            try:
                leader = os.getpgid(pid) == pid
            except ProcessLookupError:
                continue
            _signal(pid, sig, group=leader)

    def _ended(self) -> bool:
        assert self.proc is not None
        self._refresh_workers()
        return self.proc.poll() is not None and not any(alive(p) for p in self.workers)

    def _teardown(self) -> None:
        """After SIGTERM to ``loom train``: SIGTERM to the workers alone (each saves a
        checkpoint at the next step boundary and exits; torchrun then ends by itself), waiting
        up to ``stop_grace_s``. Then, and after Ctrl-C or a failure, SIGINT to every process of
        the run (a worker stops at once), SIGKILL to what is left after ``grace_s``."""
        assert self.proc is not None
        if self.signum == signal.SIGTERM:
            for pid in list(self.workers):
                _signal(pid, signal.SIGTERM, group=False)
            deadline = time.monotonic() + self.stop_grace_s
            while time.monotonic() < deadline and not self._ended():
                if any(e.state in ("error", "comm") for e in read_exits(self.run_dir).values()):
                    break  # a rank failed while stopping: the others cannot finish their save
                time.sleep(POLL_S)
        self._kill_all(signal.SIGINT)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            self._refresh_workers()
            if self.proc.poll() is not None and not any(alive(p) for p in self.workers):
                break
            time.sleep(POLL_S)
        self._refresh_workers()
        self._kill_all(signal.SIGKILL)
        self.proc.wait()
        self._reap_workers()

    def _reap_workers(self, timeout: float = 5.0) -> None:
        """Wait (briefly) until no worker outlives torchrun; SIGKILL any that does."""
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in self.workers) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for pid in self.workers:
            if alive(pid):
                _signal(pid, signal.SIGKILL, group=False)

    # ---- the verdict --------------------------------------------------------------------------
    def _outcome(self, returncode: int) -> Outcome:
        where = f"run dir {self.run_dir}"
        if self.signum is not None:
            status = f"interrupted at step {steps_done(self.run_dir)}"
            name = signal.Signals(self.signum).name
            return Outcome(status, f"loom: {status} ({name}); {where} (status: {status})", 128 + self.signum)
        blame = self._blame(returncode)
        if blame is None and returncode == 0:
            return Outcome("completed", "", 0)
        if blame is None:
            status = f"failed: torchrun exited with status {returncode}"
            return Outcome(status, f"loom: {status}; see {self.run_dir / LOGS / 'torchrun.log'}", 1)
        rank, reason = blame
        role = f" ({self.roles[rank]})" if rank in self.roles else ""
        status = f"failed on rank {rank}: {reason}"
        return Outcome(status, f"loom: failed on rank {rank}{role}: {reason}; full log "
                               f"{self.run_dir / LOGS / f'rank{rank}.log'}", 1)

    def _blame(self, returncode: int = 0) -> tuple[int, str] | None:
        """The rank that failed first, and why: a Python error or a death without any record
        (a signal such as SIGKILL, or the out-of-memory killer), earliest first; else the
        earliest communication failure; else a rank stopped by a signal from outside. When
        torchrun failed and none of these was seen (a rank died after its last step, in
        teardown, as torchrun ended before the death was polled), the rank without an exit
        record, or the one torchrun's report names, with the exit code torchrun recorded."""
        exits = read_exits(self.run_dir)
        root, codes = torchrun_failures(self.run_dir / LOGS / "torchrun.log")
        causes: list[tuple[float, int, str]] = [(e.time, e.rank, e.reason) for e in exits.values() if e.state == "error"]
        causes += [(t, r, self._death_reason(r, codes.get(r))) for r, t in self.deaths.items() if r not in exits]
        for state in ("comm", "terminated"):
            if causes:
                break
            causes = [(e.time, e.rank, e.reason) for e in exits.values() if e.state == state]
        if causes:
            return min(causes)[1:]
        if returncode == 0:
            return None
        unrecorded = [r for r in range(self.world_size) if r not in exits]
        after_record = [r for r, code in codes.items() if code != 0 and r in exits]
        for candidates in (unrecorded, after_record):
            if candidates:
                rank = root if root in candidates else min(candidates)
                if rank in exits:
                    return rank, (f"{_exit_words(codes[rank])} after its exit record ({exits[rank].state}), "
                                  f"in the interpreter's teardown")
                return rank, self._death_reason(rank, codes.get(rank))
        return None

    def _death_reason(self, rank: int, code: int | None) -> str:
        """Why a rank that left no exit record ended, as far as its exit code (from torchrun's
        report, when it wrote one) and the steps logged tell."""
        if code is None:
            how = "killed by a signal without a Python error (SIGKILL, the out-of-memory killer or a native abort)"
        else:
            how = f"{_exit_words(code)} without a Python error"
        if self.steps is not None and steps_done(self.run_dir) >= self.steps:
            how += f", in teardown after the last step ({self.steps})"
        return how


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


_REPORT_ENTRY = re.compile(r"^\s*rank\s*:\s*(\d+)\b.*\n\s*exitcode\s*:\s*(-?\d+)", re.M)


def torchrun_failures(log: Path) -> tuple[int | None, dict[int, int]]:
    """From the failure report torchrun prints when a worker exits non-zero ("Root Cause
    (first observed failure)" and "Failures", each entry with ``rank : R`` and ``exitcode : C``):
    the root cause's rank and every reported rank's exit code (negative: killed by that signal).
    ``(None, {})`` when the log holds no report (torchrun was stopped, or every rank exited 0)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))  # the report is at the end
            text = f.read().decode(errors="replace")
    except OSError:
        return None, {}
    codes = {int(r): int(c) for r, c in _REPORT_ENTRY.findall(text)}
    cut = text.rfind("Root Cause")
    first = _REPORT_ENTRY.search(text, cut) if cut >= 0 else None
    return (int(first.group(1)) if first else None), codes


def exec_dying_with_parent(argv: list[str]) -> None:
    """``python -m loom.train.launch PARENT_PID CMD...``: ask to die with the parent (which must
    be ``PARENT_PID``, else it is already gone: exit), then become ``CMD`` (the request survives
    ``exec``)."""
    parent, cmd = int(argv[0]), argv[1:]
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    exec_dying_with_parent(sys.argv[1:])
