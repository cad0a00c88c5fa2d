"""Timelines of what ran: per rank, per action, start and end.

The executor records one `TimelineEvent` per action it runs; the simulator (`loom.sim`) emits the same
records for simulated ranks, so the two can be overlaid (docs/architecture.md, "The schedule IR").
Timelines export to the Chrome trace format, which Perfetto and chrome://tracing open: one
process per rank, compute on thread 0 and communication on thread 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

_COMM_KINDS = {"send_act", "recv_act", "send_grad", "recv_grad", "grad_sync"}


@dataclass
class TimelineEvent:
    rank: int
    kind: str  # an ActionKind value
    label: str  # Action.short()
    module: str
    stage: int
    microbatch: int
    start_s: float  # wall-clock seconds (time.time()); writers shift them to start at 0
    end_s: float
    step: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def to_chrome_trace(events: Iterable[TimelineEvent], role_names: dict[int, str] | None = None) -> dict:
    """Chrome trace-event JSON (``ph: "X"`` complete events, microseconds)."""
    trace = []
    ranks = set()
    for e in events:
        ranks.add(e.rank)
        trace.append({
            "name": e.label,
            "cat": e.kind,
            "ph": "X",
            "pid": e.rank,
            "tid": 1 if e.kind in _COMM_KINDS else 0,
            "ts": round(e.start_s * 1e6, 3),
            "dur": round(max(e.end_s - e.start_s, 0.0) * 1e6, 3),
            "args": {"module": e.module, "stage": e.stage, "microbatch": e.microbatch, "step": e.step},
        })
    for r in sorted(ranks):
        name = f"rank {r}" + (f" ({role_names[r]})" if role_names and r in role_names else "")
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": name}})
        trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "communication"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path, role_names: dict[int, str] | None = None) -> None:
    Path(path).write_text(json.dumps(to_chrome_trace(events, role_names)))


def events_to_dicts(events: Iterable[TimelineEvent]) -> list[dict]:
    return [asdict(e) for e in events]


def events_from_dicts(rows: Iterable[dict]) -> list[TimelineEvent]:
    return [TimelineEvent(**r) for r in rows]
