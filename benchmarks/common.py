"""What every benchmark shares: spawning gloo processes, peak memory, machine information,
the result JSON of docs/architecture.md ("Benchmarks") and a plain-text table."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from loom.data.sample import Sample, SampleMeta
from loom.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from loom.model.zoo import LlamaConfig
from loom.plan.plan import Plan
from loom.runtime.local import start_local
from loom.train.config import ModelConfig, TrainConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# ---- processes ---------------------------------------------------------------------------
# Process start-up is loom's own local launcher (`loom.runtime.local`), shared with the tests.


def get_from(queue: Any, procs: Sequence[mp.Process], timeout: float = 600.0) -> Any:
    """``queue.get()`` that fails instead of hanging when a worker died or ``timeout`` passed."""
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"worker process(es) failed: {[(p.name, p.exitcode) for p in dead]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the workers within {timeout:.0f} s")


def join_all(procs: Sequence[mp.Process], timeout: float = 120.0) -> None:
    for p in procs:
        p.join(timeout)
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.terminate()
    if bad:
        raise RuntimeError(f"worker process(es) did not exit cleanly: {bad}")


class WorkerGroup:
    """A set of fresh gloo processes driven step by step through queues, so several groups can
    take turns on one machine. The worker ``fn(rank, world_size, name, *args, commands,
    replies, ...)`` convention: it puts ``("ready", rank)`` once built, then for every command
    from ``commands[rank]`` (``None`` ends) one ``("step", rank, ...)`` reply, and at the end
    ``("done", rank, peak_rss_mb)``."""

    def __init__(self, name: str, fn: Any, world_size: int, *args: Any, extra: tuple = ()):
        ctx = mp.get_context("spawn")
        self.name, self.world_size = name, world_size
        self.commands = [ctx.Queue() for _ in range(world_size)]
        self.replies = ctx.Queue()
        self.procs = start_local(fn, world_size, name, *args, self.commands, self.replies, *extra)

    def replies_of(self, kind: str) -> list[tuple]:
        """One reply of ``kind`` from every rank, in rank order."""
        got = [get_from(self.replies, self.procs) for _ in range(self.world_size)]
        assert all(r[0] == kind for r in got), f"{self.name}: expected {kind!r} replies, got {got}"
        return sorted(got, key=lambda r: r[1])

    def wait_ready(self) -> None:
        self.replies_of("ready")

    def command(self, value: Any) -> list[tuple]:
        """Send ``value`` to every rank and return their step replies."""
        for q in self.commands:
            q.put(value)
        return self.replies_of("step")

    def close(self) -> list[float]:
        """End the workers; returns each rank's peak RSS in MB."""
        for q in self.commands:
            q.put(None)
        peaks = [r[2] for r in self.replies_of("done")]
        join_all(self.procs)
        return peaks


# ---- measurements ------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (MiB); Linux reports KiB, macOS bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on; ``write_result`` adds ``load_avg_1m``."""
    return {"cpus": os.cpu_count(), "torch": torch.__version__.split("+")[0], "device": "cpu"}


def load_avg_1m() -> float | None:
    """The 1-minute load average (None where the platform has none): a busy machine explains
    noisy timings, so every result records it at the start and at the end of its run."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# The start of the run: set when a benchmark imports this module, reset by ``start_run()``
# (a benchmark that runs others inside it, or waits before measuring, calls it itself).
_run_start_load: float | None = load_avg_1m()


def start_run() -> None:
    """Mark the start of a benchmark run: records the load average ``write_result`` reports
    as the first of ``machine.load_avg_1m``."""
    global _run_start_load
    _run_start_load = load_avg_1m()


# what `loom bench` itself writes into the tree: not a change to the code a result measures
BENCH_OUTPUTS = ("benchmarks/results", "docs/reproduction.md")


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """``commit`` (HEAD) and ``dirty`` (uncommitted changes outside what a benchmark run itself
    rewrites: ``benchmarks/results/`` and ``docs/reproduction.md``, which ``paper_setups``
    generates) of the checkout a result comes from; both None outside git."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "dirty": None}
    # pathspecs from the top of the work tree, wherever ``repo`` is inside it
    status = git("status", "--porcelain", "--", ":(top)", *(f":(top,exclude){p}" for p in BENCH_OUTPUTS))
    return {"commit": head.strip(), "dirty": None if status is None else bool(status.strip())}


# ---- output ------------------------------------------------------------------------------
BETTER = ("lower", "higher")
SPREAD_KINDS = ("iqr", "min-max")


def figure(value: float, unit: str, better: str, spread: Sequence[float] | None = None,
           spread_is: str | None = None, digits: int = 4) -> dict[str, Any]:
    """One figure of docs/architecture.md's result format. ``better`` says which direction is good;
    ``spread`` is ``[lo, hi]`` over the repeats, ``spread_is`` how it was taken ("iqr" for
    the interquartile range, "min-max" for fewer than 5 repeats); ``summarize`` builds both."""
    if better not in BETTER:
        raise ValueError(f"figure(better={better!r}): pass better='lower' or better='higher' "
                         "(which direction of this figure is an improvement)")
    if (spread is None) != (spread_is is None):
        raise ValueError(f"figure(spread={spread!r}, spread_is={spread_is!r}): give both or neither")
    out: dict[str, Any] = {"value": round(float(value), digits), "unit": unit, "better": better,
                           "spread": None, "spread_is": None}
    if spread is not None:
        if spread_is not in SPREAD_KINDS:
            raise ValueError(f"figure(spread_is={spread_is!r}): use one of {SPREAD_KINDS}")
        if len(spread) != 2 or not float(spread[0]) <= float(spread[1]):
            raise ValueError(f"figure(spread={list(spread)!r}): give [lo, hi] with lo <= hi")
        out["spread"] = [round(float(spread[0]), digits), round(float(spread[1]), digits)]
        out["spread_is"] = spread_is
    return out


def spread_of(values: Sequence[float]) -> tuple[list[float], str]:
    """The interquartile range of ``values`` for 5 or more of them, else their [min, max]
    (quartiles of 3 or 4 numbers say little): ``(spread, spread_is)``."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread_of(values=[]): needs at least one value (repeats >= 1)")
    if len(vals) >= 5:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
        return [q1, q3], "iqr"
    return [min(vals), max(vals)], "min-max"


def summarize(values: Sequence[float], unit: str, better: str, digits: int = 4) -> dict[str, Any]:
    """A figure over repeated measurements: the median, with ``spread_of`` as its spread."""
    spread, kind = spread_of(values)
    return figure(median(values), unit, better, spread, kind, digits)


def write_result(name: str, figures: dict[str, dict[str, Any]], config: dict[str, Any],
                 machine: dict[str, Any] | None = None, results_dir: Path | None = None) -> Path:
    """Write ``<results_dir>/<name>.json`` in docs/architecture.md's format; returns its path. Adds where
    the result comes from: ``commit``, ``dirty``, ``date`` (UTC) and ``machine.load_avg_1m``
    as [at ``start_run()`` or import, now]."""
    for key, fig in figures.items():
        missing = {"value", "unit", "better", "spread", "spread_is"} - set(fig)
        if missing:
            raise ValueError(f"write_result({name!r}): figure {key!r} lacks {sorted(missing)}; "
                             "build it with figure(value, unit, better=...) or summarize(...)")
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    info = dict(machine or machine_info())
    info["load_avg_1m"] = [_run_start_load, load_avg_1m()]
    data = {"benchmark": name, "figures": figures, "config": config, "machine": info,
            **git_state(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[c if isinstance(c, str) else f"{c:.1f}" if isinstance(c, float) else str(c)
                                           for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_parts(parts: Sequence[tuple[str, Callable[[], tuple[dict[str, Any], Any]]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run each named part of a benchmark (a callable returning its figures and details); print
    the figures against their targets (`target_table`) and each part's details; return both."""
    figures, details = {}, {}
    for name, run in parts:
        f, d = run()
        figures.update(f)
        details[name] = d
    print(target_table(figures))
    for name, d in details.items():
        print(f"{name}: {d}")
    return figures, details


def target_table(figures: dict[str, dict[str, Any]]) -> str:
    """The figures against their targets (a ``[low, high]`` range or a bound in the direction of
    ``better``), a row each: median, unit, spread, what the spread is, target, met."""
    rows = []
    for name, f in figures.items():
        target = f["target"]
        if isinstance(target, list):
            met = target[0] <= f["value"] <= target[1]
        else:
            met = f["value"] <= target if f["better"] == "lower" else f["value"] >= target
        spread = f"{f['spread'][0]}-{f['spread'][1]}" if "spread" in f else "-"
        rows.append((name, f"{f['value']}", f["unit"], spread, f.get("spread_is", "-"), str(target),
                     "yes" if met else "NO"))
    return format_table(("figure", "median", "unit", "spread", "spread is", "target", "met"), rows)


# ---- data ----------------------------------------------------------------------------------
class TextDataset:
    """``batches`` global batches of text samples of exactly ``cfg.seq_len`` token ids (BOS,
    random words, EOS; ``cfg`` gives ``vocab``, ``seed``, ``global_batch`` and ``seq_len``): a
    random-access dataset, as the `Dispatcher` reads one."""

    def __init__(self, cfg: Any, batches: int):
        words = [f"w{i}" for i in range(cfg.vocab - len(SPECIAL_TOKENS))]
        self.tokenizer = Tokenizer(words)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.samples = []
        for i in range(batches * cfg.global_batch):
            picks = torch.randint(0, len(words), (cfg.seq_len - 2,), generator=gen).tolist()
            self.samples.append(Sample(SampleMeta(i, cfg.seq_len, segments=("text",)), " ".join(words[w] for w in picks)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


def llm_only_config(cfg: Any, plan: Plan, **run: Any) -> TrainConfig:
    """The `TrainConfig` of an LLM-only zoo Llama of ``cfg``'s sizes (``vocab``, ``hidden``,
    ``layers``, ``heads``, ``kv_heads``, ``intermediate``, ``seq_len``; ``seed``,
    ``global_batch``) under ``plan``, with ``run`` fields set (``steps``, ``dtype``...). The
    benchmarks feed it their own text batches; its demo data is text-only so the config check
    (no image or audio samples for a model without encoders) holds."""
    model = ModelConfig(vision=None, audio=None, llm=LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=cfg.heads,
        num_kv_heads=cfg.kv_heads, intermediate_size=cfg.intermediate, max_seq_len=cfg.seq_len))
    train = TrainConfig(model=model, plan=plan)
    train.run = replace(train.run, seed=cfg.seed, **run)
    train.data = replace(train.data, global_batch_size=cfg.global_batch,
                         demo=replace(train.data.demo, mix={"text": 1.0}))
    return train
