"""``loom data write-demo``: the demo set written as LLaVA-style JSON with PNG / WAV files and as
WebDataset tar shards (`loom.data.write_demo`), so ``data.source = "llava"`` / ``"webdataset"``
can be trained on with nothing downloaded."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loom.cli.common import CliError, default_config


def cmd_data(args: argparse.Namespace) -> int:
    from loom.data.write_demo import FORMATS, LLAVA_FILE, SHARD_DIR, write_demo
    from loom.train.build import build_data
    from loom.train.config import load_config

    if args.action != "write-demo":  # argparse's choices already refuse others; kept for direct calls
        raise CliError(f"data {args.action!r}: unknown action; use loom data write-demo --out DIR")
    if args.format not in FORMATS:
        raise CliError(f"--format {args.format}: unknown format; choose one of {', '.join(FORMATS)}")
    if args.num_samples is not None and args.num_samples < 1:
        raise CliError(f"--num-samples {args.num_samples}: write at least 1 sample")
    if args.samples_per_shard < 1:
        raise CliError(f"--samples-per-shard {args.samples_per_shard}: use at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory; choose a directory")
    overrides = list(args.overrides) + ([f"data.demo.num_samples={args.num_samples}"] if args.num_samples else [])
    cfg = load_config(default_config(args), overrides)  # data.demo as `loom train` would generate it
    cfg.data.source = "demo"
    tokenizer, dataset = build_data(cfg)
    t0 = time.perf_counter()
    try:
        written = write_demo(dataset, out, args.format, args.samples_per_shard)
    except ValueError as e:
        raise CliError(f"loom data write-demo: {e}") from e
    where = []
    if written.llava is not None:
        where.append(f'data.source="llava" data.path={out / LLAVA_FILE}')
    if written.shards:
        where.append(f'data.source="webdataset" data.path={out / SHARD_DIR} ({len(written.shards)} shards)')
    print(f"wrote {written.num_samples} demo samples to {out} in {time.perf_counter() - t0:.1f} s; train on them "
          f"with {' or '.join(where)}")
    return 0
