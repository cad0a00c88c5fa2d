"""PNG Gantt charts of timelines (DESIGN.md, "The schedule IR": timelines export "to a PNG Gantt
chart").

Works on any list of `TimelineEvent`s, simulated or measured by the executor: one row per rank
(a pipeline unit's first rank), forwards, backwards, the optimizer step and communication in
their own colours. Communication bars are drawn thinner, so a receive that mostly waits reads as
what it is, a bubble. matplotlib is imported only when a chart is drawn, and through its Agg
canvas directly, so no global backend is switched and no display is needed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer_step": "#8172B3",
    "grad_sync": "#C44E52",
    "send_act": "#9A9A9A",
    "recv_act": "#C8C8C8",
    "send_grad": "#9A9A9A",
    "recv_grad": "#C8C8C8",
}
LEGEND = {"forward": "forward", "backward": "backward", "optimizer_step": "optimizer step",
          "grad_sync": "grad sync", "recv_act": "receive (incl. wait)"}
_COMPUTE = {"forward", "backward", "optimizer_step"}
_MAX_LABELS = 4000  # beyond this, text labels cost more than they tell


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 1.0:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def plot_gantt(events: Iterable, path: str | Path, title: str | None = None,
               role_names: dict[int, str] | None = None, width_in: float = 14.0, dpi: int = 100) -> Path:
    """Draw ``events`` (`TimelineEvent`s) as a Gantt chart and write it to ``path`` (PNG).

    Times are shifted so the earliest event starts at 0 (measured timelines carry wall-clock
    times). ``role_names`` (rank -> text) labels the rows; bars wide enough for it carry their
    microbatch number."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = list(events)
    ranks = sorted({e.rank for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min((e.start_s for e in events), default=0.0)
    span = max((e.end_s for e in events), default=0.0) - t0
    scale, unit = _time_unit(span)

    # Rows of 0.22 in up to a few hundred ranks, then squeezed, so huge plans stay drawable.
    height_in = min(2.0 + 0.22 * len(ranks), 60.0)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.end_s > e.start_s:
            bars[(row[e.rank], e.kind)].append(((e.start_s - t0) * scale, (e.end_s - e.start_s) * scale))
    for (y, kind), spans in bars.items():
        h = 0.8 if kind in _COMPUTE else 0.3
        ax.broken_barh(spans, (y - h / 2, h), facecolors=COLOURS.get(kind, "#555555"), linewidth=0)

    # Microbatch numbers where a bar is wide enough for the text (about 7 px per character).
    axes_px = width_in * dpi * 0.8
    labelled = 0
    if span > 0:
        for e in events:
            if e.kind not in ("forward", "backward") or e.microbatch < 0 or labelled >= _MAX_LABELS:
                continue
            text = str(e.microbatch)
            if (e.end_s - e.start_s) / span * axes_px < 7 * len(text) + 4:
                continue
            ax.text((e.start_s - t0 + (e.end_s - e.start_s) / 2) * scale, row[e.rank], text,
                    ha="center", va="center", fontsize=7, color="white")
            labelled += 1

    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"r{r}" + (f" {role_names[r]}" if role_names and r in role_names else "") for r in ranks],
                       fontsize=7 if len(ranks) <= 64 else 4)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # first rank on top
    ax.set_xlim(0, span * scale if span > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if title:
        ax.set_title(title, fontsize=10)
    present = {e.kind for e in events}
    handles = [Patch(facecolor=COLOURS[k], label=label) for k, label in LEGEND.items()
               if k in present or (k == "recv_act" and "recv_grad" in present)]
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=7, framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return Path(path)
