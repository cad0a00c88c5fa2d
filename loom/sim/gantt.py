"""PNG Gantt charts of timelines (docs/architecture.md, "The schedule IR": timelines export "to a PNG Gantt
chart").

Works on any list of `TimelineEvent`s, simulated or measured by the executor: one row per rank
(a pipeline unit's first rank), forwards, backwards, the optimizer step and communication in
their own colours. Communication bars are drawn thinner, so a receive that mostly waits reads as
what it is, a bubble. matplotlib is imported only when a chart is drawn, and through its Agg
canvas directly, so no global backend is switched and no display is needed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from loom.plan.plan import LLM

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "backward_input": "#DD8452",  # ZB-H1's input pass: the backward's colour
    "backward_weight": "#E8B04A",  # its deferred weight pass, a lighter shade
    "optimizer_step": "#8172B3",
    "grad_sync": "#C44E52",
    "send_act": "#9A9A9A",
    "recv_act": "#C8C8C8",
    "send_grad": "#9A9A9A",
    "recv_grad": "#C8C8C8",
    "dispatch": "#55A868",
    "clip": "#937860",
    "encoder_forward": "#8FB8DE",  # an encoder's work in lighter shades: where it sits is the point of
    "encoder_backward": "#F2B98C",  # a placement (first_stage, colocated, Optimus's bubble fill)
}
LEGEND = {"forward": "forward", "backward": "backward", "encoder_forward": "encoder forward",
          "encoder_backward": "encoder backward", "backward_weight": "weight pass (zb-h1)", "optimizer_step": "optimizer step",
          "grad_sync": "grad sync", "recv_act": "receive (incl. wait)", "dispatch": "dispatch",
          "clip": "clip norm (incl. wait)"}
_COMPUTE = {"forward", "backward", "backward_input", "backward_weight", "optimizer_step", "dispatch", "encoder_forward",
            "encoder_backward"}
_ENCODER_KIND = {"forward": "encoder_forward", "backward": "encoder_backward", "backward_input": "encoder_backward",
                 "backward_weight": "encoder_backward"}
_MAX_LABELS = 4000  # beyond this, text labels cost more than they tell


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 1.0:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def chart_events(events: Iterable) -> list:
    """``events`` as the chart draws them: an encoder's compute under its own kinds
    (``encoder_forward``, ``encoder_backward``), so it shows in its own colours beside the LLM's."""
    return [dataclasses.replace(e, kind=_ENCODER_KIND[e.kind]) if e.module not in (LLM, "") and e.kind in _ENCODER_KIND
            else e for e in events]


def plot_gantt(events: Iterable, path: str | Path, title: str | None = None,
               role_names: dict[int, str] | None = None, width_in: float = 14.0, dpi: int = 100,
               span_s: float | None = None) -> Path:
    """Draw ``events`` (`TimelineEvent`s) as a Gantt chart and write it to ``path`` (PNG).

    Times are shifted so the earliest event starts at 0 (measured timelines carry wall-clock
    times). ``role_names`` (rank -> text) labels the rows; bars wide enough for it carry their
    microbatch number. ``span_s`` fixes the time axis's length (charts to set side by side)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = chart_events(events)
    ranks = sorted({e.rank for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    t0 = min((e.start_s for e in events), default=0.0)
    span = max((e.end_s for e in events), default=0.0) - t0
    if span_s is not None:
        span = max(span, span_s)
    scale, unit = _time_unit(span)
    names = [f"r{r}" + (f" {role_names[r]}" if role_names and r in role_names else "") for r in ranks]

    # The layout is computed here rather than by tight_layout, which would draw everything twice:
    # rows of 0.22 in (squeezed past a few hundred ranks), room on the left for the row names,
    # and the legend in a strip below the axes.
    tick_size = 7 if len(ranks) <= 64 else 5
    axes_h = min(0.22 * max(len(ranks), 1), 56.0)
    top_in, bottom_in = (0.45 if title else 0.15), 0.85
    height_in = axes_h + top_in + bottom_in
    left_in = 0.25 + 0.6 * tick_size / 72 * max((len(n) for n in names), default=1)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((left_in / width_in, bottom_in / height_in, 1 - (left_in + 0.2) / width_in, axes_h / height_in))

    # One collection of rectangles per kind: far cheaper to draw than one artist per bar.
    boxes: dict[str, list] = defaultdict(list)
    for e in events:
        if e.end_s > e.start_s:
            x0, x1 = (e.start_s - t0) * scale, (e.end_s - t0) * scale
            h = 0.4 if e.kind in _COMPUTE else 0.15
            y = row[e.rank]
            boxes[e.kind].append(((x0, y - h), (x1, y - h), (x1, y + h), (x0, y + h)))
    for kind, verts in boxes.items():
        # a hairline white edge keeps back-to-back compute bars apart
        edge = 0.4 if kind in _COMPUTE else 0.0
        ax.add_collection(PolyCollection(verts, facecolors=COLOURS.get(kind, "#555555"), edgecolors="white",
                                         linewidths=edge))

    # Microbatch numbers where a bar is wide enough for the text (about 7 px per character).
    axes_px = (width_in - left_in - 0.2) * dpi
    labelled = 0
    if span > 0:
        for e in events:
            if e.kind not in ("forward", "backward", "backward_input", "backward_weight", *_ENCODER_KIND.values()) \
                    or e.microbatch < 0 or labelled >= _MAX_LABELS:
                continue
            text = str(e.microbatch)
            if (e.end_s - e.start_s) / span * axes_px < 7 * len(text) + 4:
                continue
            ax.text((e.start_s - t0 + (e.end_s - e.start_s) / 2) * scale, row[e.rank], text,
                    ha="center", va="center", fontsize=7, color="white")
            labelled += 1

    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(names, fontsize=tick_size)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # first rank on top
    ax.set_xlim(0, span * scale if span > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if title:
        ax.set_title(title, fontsize=10)
    present = {e.kind for e in events}
    handles = [Patch(facecolor=COLOURS[k], label=label) for k, label in LEGEND.items()
               if k in present or (k == "recv_act" and "recv_grad" in present)
               or (k == "backward" and "backward_input" in present)]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path, format="png")
    return Path(path)
