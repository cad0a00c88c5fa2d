"""loom's data loader on LLaVA-format files against a plain ``torch.utils.data.DataLoader``, and
checkpoint save / load seconds of the demo model (issue 13).

    python -m benchmarks.data_throughput [--workers 2 --repeats 5 --steps 24 --warmup 2 --samples 512]

What runs:

1. ``loom data write-demo --format llava`` of the default config's demo set into a temporary
   directory (``train.json``, PNG images, WAV clips), as a user writes it;
2. **loom**: ``--workers`` gloo processes, each building its rank with `loom.train.rank.build_rank`
   as ``loom train`` does, for configs/demo.toml with ``data.source = "llava"`` on those files
   and a plan of ``--workers`` data-parallel replicas with the encoders on the LLM's rank
   (``plan.placement = "first_stage"``, one stage: one process per replica). Each timed step is
   what a training step of ``loom train`` runs before its engine step: the seeded
   `GlobalBatchSampler`'s global batch, then `Dispatcher.dispatch` (every rank reads and decodes
   its loader shard of the files, the metadata all-gather, the ``[balance]`` layout, the payload
   all-to-all, the collation into microbatches). The step is synchronous, as in training: the
   next one starts when every rank has its microbatches;
3. **plain**: a ``torch.utils.data.DataLoader`` with ``num_workers = --workers`` over the same
   ``train.json``, given the same global batches (the same sampler) as its ``batch_sampler``, each
   worker doing the same decoding (Pillow to float32 ``[3, H, W]`` in [0, 1], soundfile to
   float32, the same tokenizer on the turns' text) and the collation a user would write (text
   ids right-padded into one tensor, images and clips as lists). It prefetches
   (``prefetch_factor`` 2 per worker, the default); its timed span starts after ``--warmup``
   batches and the sampler holds batches beyond the timed ones, so the workers are as far ahead
   at the end as at the start (steady state).

Both sides load the same ``--steps`` global batches per repeat (repeat ``r`` takes steps
``r * steps ...``), alternating which goes first; the script fails unless both delivered the same
pixels, samples and text tokens (sums over the timed batches).

4. **checkpoints**: the default config (configs/demo.toml: vision, audio, the LLM in 2 stages,
   4 gloo processes, as ``loom train`` runs it by default) after one training step (AdamW's
   moments exist), saved with `loom.train.checkpoint.Checkpointer.save` (synchronous DCP) and
   loaded back with `Checkpointer.load`, each timed from a barrier to a barrier (the slowest
   rank); and the asynchronous save (``run.checkpoint_async``): the seconds `save_async` blocks
   the caller (the CPU copy of the state), then until `wait` returns.

Figures:

- ``loom_samples_per_s`` / ``plain_samples_per_s`` (higher): global-batch samples loaded per
  second, median over repeats, spread;
- ``loader_ratio`` (lower; 1.0 means as fast): per repeat, plain samples/s over loom's; > 1
  means loom is slower;
- ``checkpoint_save_s`` / ``checkpoint_load_s`` (lower): the demo model's synchronous save and
  its load, seconds, median over repeats, spread;
- ``checkpoint_async_blocking_s`` / ``checkpoint_async_total_s`` (lower): the asynchronous save's
  time blocking the training loop, and until it is complete.

Writes ``benchmarks/results/data_throughput.json`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `loom` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import (WorkerGroup, format_table, machine_info, median, peak_rss_mb, start_run, summarize,
                               write_result)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG = REPO_ROOT / "configs" / "demo.toml"
CHECKPOINT_RANKS = 4  # configs/demo.toml's plan: vision, audio, the LLM in 2 stages


def write_llava(out: Path, samples: int) -> Path:
    """``loom data write-demo --format llava`` of the default config into ``out``; the JSON file."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    args = ["data", "write-demo", "--out", str(out), "--format", "llava", "--num-samples", str(samples)]
    print("  $ loom " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"loom data write-demo failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return out / "train.json"


def loader_overrides(path: Path, workers: int) -> list[str]:
    """configs/demo.toml on the LLaVA files, with ``workers`` data-parallel replicas, each one
    process (the encoders on the LLM's rank)."""
    return ['data.source="llava"', f'data.path="{path}"', 'plan.placement="first_stage"',
            "plan.modules.llm.num_stages=1"] + [f"plan.modules.{m}.data_parallel={workers}"
                                                 for m in ("vision", "audio", "llm")]


# ---- what both sides delivered ---------------------------------------------------------------
def batch_sums(images: list[torch.Tensor], audios: list[torch.Tensor], samples: int, text_tokens: int) -> list[float]:
    """What a loader delivered, to check both sides did the same work: the sum of every pixel,
    of every audio sample, the number of samples and of text tokens."""
    return [float(sum(float(t.double().sum()) for t in images)), float(sum(float(t.double().sum()) for t in audios)),
            float(samples), float(text_tokens)]


# ---- loom: build_rank's sampler and dispatcher, on each rank ----------------------------------
def _loader_worker(rank: int, world_size: int, name: str, config: str, overrides: list, commands: list,
                   replies) -> None:
    """Build the rank as ``loom train`` does (`build_rank`), then per command (a list of steps)
    run the sampler and `Dispatcher.dispatch` of each step, barrier to barrier; reply with the
    seconds and what this rank got (`batch_sums`)."""
    from loom.train.config import load_config
    from loom.train.rank import build_rank

    cfg = load_config(config, overrides)
    run = build_rank(cfg, torch.device("cpu"))
    replies.put(("ready", rank))
    while (steps := commands[rank].get()) is not None:
        images: list[torch.Tensor] = []
        audios: list[torch.Tensor] = []
        samples = 0
        dist.barrier()
        t0 = time.perf_counter()
        got = [run.dispatcher.dispatch(run.sampler.batch(step), step) for step in steps]
        dist.barrier()
        seconds = time.perf_counter() - t0
        tokens = 0
        for done in got:
            for batch in done.batches.values():
                images += batch.modality_inputs.get("vision", {}).get("images", [])
                audios += batch.modality_inputs.get("audio", {}).get("waveforms", [])
                samples += len(batch.sample_ids)
            tokens += int(done.metadata.text_tokens.sum()) if rank == 0 else 0  # the global batch's, once
        replies.put(("step", rank, seconds, batch_sums(images, audios, samples, tokens)))
    run.close()
    replies.put(("done", rank, peak_rss_mb()))


# ---- plain: a DataLoader over the same files --------------------------------------------------
class PlainLlava(torch.utils.data.Dataset):
    """The LLaVA file as a user's own dataset would read it: a record, its images decoded with
    Pillow to float32 ``[3, H, W]`` in [0, 1], its clips with soundfile to float32 (channels
    averaged), the turns' text tokenized (every ``<image>`` / ``<audio>`` marker a word)."""

    def __init__(self, path: Path, tokenizer: Any):
        self.root, self.tokenizer = path.parent, tokenizer
        self.records = json.loads(path.read_text())

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import numpy as np
        import soundfile
        from PIL import Image

        rec = self.records[index]
        images = []
        for ref in _refs(rec.get("image")):
            with Image.open(self.root / ref) as im:
                rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
            images.append(torch.from_numpy(rgb.transpose(2, 0, 1).copy()).float() / 255)
        audios = []
        for ref in _refs(rec.get("audio")):
            data, _ = soundfile.read(self.root / ref, dtype="float32", always_2d=True)
            audios.append(torch.from_numpy(np.ascontiguousarray(data.mean(axis=1, dtype=np.float32))))
        text = " ".join(" ".join(t["value"] for t in rec["conversations"]).replace("<image>", " <image> ")
                        .replace("<audio>", " <audio> ").split())
        return {"ids": self.tokenizer.encode(text), "images": images, "audios": audios}


def _refs(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def plain_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Text ids right-padded into one ``[B, L]`` tensor (pad 0) with their lengths; images and
    clips as lists, in sample order."""
    lengths = torch.tensor([len(it["ids"]) for it in items])
    ids = torch.zeros(len(items), int(lengths.max()), dtype=torch.long)
    for i, it in enumerate(items):
        ids[i, : len(it["ids"])] = torch.tensor(it["ids"])
    return {"input_ids": ids, "lengths": lengths, "images": [im for it in items for im in it["images"]],
            "audios": [a for it in items for a in it["audios"]]}


def plain_run(dataset: PlainLlava, batches: list[list[int]], warmup: int, timed: int,
              workers: int) -> tuple[float, list[float]]:
    """Seconds to receive ``timed`` batches after ``warmup`` from a DataLoader with ``workers``
    processes over ``batches`` (which holds more after the timed ones), and `batch_sums` of them."""
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers, collate_fn=plain_collate)
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    got = [next(it) for _ in range(timed)]
    seconds = time.perf_counter() - t0
    del it  # the workers stop
    sums = batch_sums([im for b in got for im in b["images"]], [a for b in got for a in b["audios"]],
                      sum(len(b["lengths"]) for b in got), sum(int(b["lengths"].sum()) for b in got))
    return seconds, sums


# ---- checkpoints: the demo model through loom's Checkpointer ---------------------------------
def _checkpoint_worker(rank: int, world_size: int, name: str, config: str, run_dir: str, commands: list,
                       replies) -> None:
    """The demo config's rank after one training step; per command ``(kind, step)`` one timed
    save ("sync", `Checkpointer.save`), load ("load", `Checkpointer.load` of ``step_<step>``) or
    asynchronous save ("async": `save_async`, then `wait`), barrier to barrier."""
    from loom.train.checkpoint import Checkpointer, step_dir
    from loom.train.config import load_config
    from loom.train.rank import build_rank

    cfg = load_config(config, [])
    run = build_rank(cfg, torch.device("cpu"))
    run.step(0)  # AdamW's moments exist: the checkpoint a run writes
    saver = Checkpointer(run, Path(run_dir), asynchronous=True)
    replies.put(("ready", rank))
    while (command := commands[rank].get()) is not None:
        kind, step = command
        dist.barrier()
        t0 = time.perf_counter()
        blocked = None
        if kind == "sync":
            saver.save(step)
        elif kind == "load":
            assert saver.load(step_dir(Path(run_dir), step)) == step
        else:
            saver.save_async(step)
            blocked = time.perf_counter() - t0
            saver.wait()
        dist.barrier()
        replies.put(("step", rank, time.perf_counter() - t0, blocked))
    run.close()
    replies.put(("done", rank, peak_rss_mb()))


def checkpoint_figures(work: Path, repeats: int) -> tuple[dict[str, list[float]], float]:
    """Per repeat, the slowest rank's seconds of each kind; and the checkpoint's size in MB."""
    run_dir = work / "ckpt_run"
    run_dir.mkdir()
    group = WorkerGroup("checkpoint", _checkpoint_worker, CHECKPOINT_RANKS, str(CONFIG), str(run_dir))
    group.wait_ready()
    times: dict[str, list[float]] = {"sync": [], "load": [], "async_blocking": [], "async": []}
    size_mb = 0.0
    try:
        for r in range(repeats):
            sync_step, async_step = 2 * r + 1, 2 * r + 2
            order = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
            for kind in order:
                got = group.command((kind, sync_step if kind == "sync" else async_step))
                times[kind].append(max(g[2] for g in got))
                if kind == "async":
                    times["async_blocking"].append(max(g[3] for g in got))
            got = group.command(("load", sync_step))
            times["load"].append(max(g[2] for g in got))
            ckpt = run_dir / "checkpoints" / f"step_{sync_step}"
            size_mb = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
            print(f"  repeat {r}: save {times['sync'][-1]:.3f} s, load {times['load'][-1]:.3f} s, async blocks "
                  f"{times['async_blocking'][-1]:.3f} s of {times['async'][-1]:.3f} s ({size_mb:.1f} MB)", flush=True)
            for step in (sync_step, async_step):  # keep the disk use to one repeat's
                shutil.rmtree(run_dir / "checkpoints" / f"step_{step}")
    finally:
        group.close()
    return times, size_mb


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="loom's ranks and the DataLoader's worker processes")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per side")
    ap.add_argument("--steps", type=int, default=24, help="global batches per timed repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed global batches before the first repeat")
    ap.add_argument("--samples", type=int, default=512, help="samples written by loom data write-demo")
    ap.add_argument("--skip-checkpoints", action="store_true", help="only the loader figures")
    args = ap.parse_args(argv)
    if min(args.workers, args.repeats, args.steps, args.samples) < 1 or args.warmup < 0:
        raise SystemExit("--workers, --repeats, --steps and --samples must be at least 1, --warmup at least 0")
    start_run()
    work = Path(tempfile.mkdtemp(prefix="data_throughput_"))
    try:
        print("1. the LLaVA-format demo set", flush=True)
        path = write_llava(work / "llava", args.samples)

        from loom.data.sampler import GlobalBatchSampler
        from loom.train.build import build_data
        from loom.train.config import load_config

        overrides = loader_overrides(path, args.workers)
        cfg = load_config(CONFIG, overrides)
        tokenizer, dataset = build_data(cfg)
        sampler = GlobalBatchSampler(len(dataset), cfg.data.global_batch_size, seed=cfg.run.seed)  # build_rank's
        plain = PlainLlava(path, tokenizer)
        batch = cfg.data.global_batch_size

        print(f"2. loom ({args.workers} ranks) and a plain DataLoader ({args.workers} workers), alternating",
              flush=True)
        group = WorkerGroup("loom", _loader_worker, args.workers, str(CONFIG), overrides)
        group.wait_ready()
        measured: dict[str, list[float]] = {"loom": [], "plain": []}
        try:
            group.command(list(range(args.warmup)))  # untimed: files and code warm
            for r in range(args.repeats):
                first = args.warmup + r * args.steps
                steps = list(range(first, first + args.steps))
                sums: dict[str, list[float]] = {}
                for side in (["loom", "plain"] if r % 2 == 0 else ["plain", "loom"]):
                    if side == "loom":
                        got = group.command(steps)
                        seconds = max(g[2] for g in got)
                        sums[side] = [sum(g[3][k] for g in got) for k in range(4)]
                    else:
                        # the warmup batches and those after the timed ones: the same kind of batches
                        ahead = [sampler.batch(s) for s in range(first - args.warmup, first)]
                        after = [sampler.batch(s) for s in range(first + args.steps, first + args.steps + 2 * args.workers)]
                        seconds, sums[side] = plain_run(plain, ahead + [sampler.batch(s) for s in steps] + after,
                                                        len(ahead), args.steps, args.workers)
                    measured[side].append(args.steps * batch / seconds)
                for a, b in zip(sums["loom"], sums["plain"]):
                    if abs(a - b) > 1e-6 * max(1.0, abs(b)):
                        raise SystemExit(f"repeat {r}: loom and the plain loader delivered different data "
                                         f"(pixels, audio, samples, text tokens): {sums['loom']} vs {sums['plain']}")
                print(f"  repeat {r}: loom {measured['loom'][-1]:.1f} samples/s, plain {measured['plain'][-1]:.1f} "
                      f"samples/s", flush=True)
        finally:
            loom_peak = group.close()

        ratios = [p / q for p, q in zip(measured["plain"], measured["loom"])]
        figures = {
            "loader_ratio": summarize(ratios, "ratio", "lower"),
            "loom_samples_per_s": summarize(measured["loom"], "samples/s", "higher"),
            "plain_samples_per_s": summarize(measured["plain"], "samples/s", "higher"),
        }
        rows = [("loom", median(measured["loom"]), ""), ("plain DataLoader", median(measured["plain"]), ""),
                ("loader_ratio (plain / loom)", figures["loader_ratio"]["value"], str(figures["loader_ratio"]["spread"]))]
        size_mb = None
        if not args.skip_checkpoints:
            print(f"3. checkpoints of the demo model ({CHECKPOINT_RANKS} ranks)", flush=True)
            times, size_mb = checkpoint_figures(work, args.repeats)
            figures.update({
                "checkpoint_save_s": summarize(times["sync"], "s", "lower"),
                "checkpoint_load_s": summarize(times["load"], "s", "lower"),
                "checkpoint_async_blocking_s": summarize(times["async_blocking"], "s", "lower"),
                "checkpoint_async_total_s": summarize(times["async"], "s", "lower"),
            })
            rows += [(f"checkpoint {k}", figures[f"checkpoint_{k}"]["value"], str(figures[f"checkpoint_{k}"]["spread"]))
                     for k in ("save_s", "load_s", "async_blocking_s", "async_total_s")]
        print(format_table(("figure", "median", "spread"), [(n, f"{v:.3f}", s) for n, v, s in rows]))
        path_out = write_result("data_throughput", figures, {
            "config": "configs/demo.toml", "data": f"loom data write-demo --format llava --num-samples {args.samples}",
            "workers": args.workers, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
            "global_batch_size": batch, "loom_plan": overrides[2:],
            "loom_timing": "per repeat, sampler + Dispatcher.dispatch of each step on every rank (build_rank's), "
                           "barrier to barrier, the slowest rank",
            "plain_timing": "DataLoader(num_workers=workers, prefetch_factor=2) over the same batches, from the batch "
                            "after the warmup to the last timed one (more batches queued after it)",
            "checkpoint": None if args.skip_checkpoints else
            f"configs/demo.toml on {CHECKPOINT_RANKS} gloo ranks after one step, {size_mb:.1f} MB; Checkpointer.save / "
            f"load / save_async + wait, barrier to barrier, the slowest rank",
            "loom_peak_rss_mb": loom_peak,
        }, machine=machine_info())
        print(f"wrote {path_out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
