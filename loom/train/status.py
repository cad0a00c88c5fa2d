"""What a run directory says about its run: the ``status`` file and the per-rank records.

``runs/<name>/status`` is one line of text:

- ``running`` while `loom train` supervises the run,
- ``completed`` when every step ran,
- ``interrupted at step N`` after Ctrl-C or SIGTERM (steps ``0 .. N-1`` completed),
- ``failed on rank R: <reason>`` when a rank failed (``failed: <reason>`` if no rank is to blame).

``runs/<name>/logs/`` holds each rank's full output (``rank<R>.log``), its process id
(``rank<R>.pid``, written at start) and its exit record (``rank<R>.exit.json``: ``state`` one of
``done``, ``error``, ``comm`` (a failure of communication, usually another rank's death),
``terminated`` (stopped by a signal), the one-line ``reason`` and the wall-clock ``time``),
plus the launcher's own output (``torchrun.log``) and ``loom train``'s process id
(``loom.pid``), by which a ``running`` status whose ``loom train`` was killed is told from a live run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATUS = "status"
LOGS = "logs"
SUPERVISOR_PID = "loom.pid"
METRICS = "metrics.jsonl"


def write_status(run_dir: Path, text: str) -> None:
    """Replace the run's status line (atomically, so a reader never sees half a line)."""
    tmp = run_dir / f".{STATUS}.tmp"
    tmp.write_text(text.splitlines()[0] + "\n" if text else "\n")
    os.replace(tmp, run_dir / STATUS)


def read_status(run_dir: Path) -> str | None:
    try:
        return (run_dir / STATUS).read_text().strip()
    except OSError:
        return None


def read_supervisor_pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / LOGS / SUPERVISOR_PID).read_text())
    except (OSError, ValueError):
        return None


def steps_done(run_dir: Path) -> int:
    """Steps recorded in ``metrics.jsonl`` (0 when none): the step a stopped run was in."""
    try:
        lines = (run_dir / METRICS).read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"]) + 1
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the stop
    return 0


@dataclass
class RankExit:
    """How one rank ended (``logs/rank<R>.exit.json``)."""

    rank: int
    pid: int
    state: str  # done | error | comm | terminated
    reason: str
    time: float

    def write(self, run_dir: Path) -> None:
        path = run_dir / LOGS / f"rank{self.rank}.exit.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)


def read_exits(run_dir: Path) -> dict[int, RankExit]:
    out: dict[int, RankExit] = {}
    for path in (run_dir / LOGS).glob("rank*.exit.json"):
        try:
            out_rank = RankExit(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[out_rank.rank] = out_rank
    return out


def write_pid(run_dir: Path, rank: int) -> None:
    (run_dir / LOGS / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")


def read_pids(run_dir: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for path in (run_dir / LOGS).glob("rank*.pid"):
        try:
            out[int(path.name[4:-4])] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return out


# Messages of a collective or point-to-point operation whose peer went away: the symptom of
# another rank's failure, never the cause, so the launcher blames a rank that failed otherwise.
_COMM_WORDS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out",
               "timeout", "socket", "peer")


def classify(exc: BaseException) -> tuple[str, str]:
    """``(state, one-line reason)`` for an exception that ended a rank."""
    first = (str(exc).strip().splitlines() or [""])[0]
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if isinstance(exc, Terminated):
        return "terminated", str(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    if "DistError" in names or "DistBackendError" in names or any(w in first.lower() for w in _COMM_WORDS):
        return "comm", reason
    return "error", reason


class Terminated(BaseException):
    """Raised in a worker by its SIGTERM / SIGINT handler (a BaseException, so the training
    code's ``except Exception`` does not swallow it)."""


def now() -> float:
    return time.time()
