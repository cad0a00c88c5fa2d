"""``loom export RUN_DIR --hf OUT_DIR [--step N] [--overwrite]``: a run's checkpoint as a
Hugging Face model directory (`loom.train.export`), in this process (no torchrun)."""

from __future__ import annotations

import argparse

from loom.cli.common import CliError
from loom.train.export import export_run


def cmd_export(args: argparse.Namespace) -> int:
    if args.step is not None and args.step < 0:
        raise CliError(f"--step {args.step}: must not be negative; pass the N of a checkpoints/step_N")
    result = export_run(args.run_dir, args.hf, step=args.step, overwrite=args.overwrite)
    extra = "".join([
        (f"; Hugging Face encoders {', '.join(f'{n} ({c})' for n, c in result.hf_encoders.items())} in "
         f"{result.out_dir}/<name>/, their projectors in loom_modules.safetensors") if result.hf_encoders else "",
        (f"; loom's {', '.join(result.loom_modules)} in {result.out_dir / 'loom_modules.safetensors'}"
         if result.loom_modules else "")])
    print(f"loom: exported {result.checkpoint} (step {result.step}) as {result.model_type} "
          f"({result.llm_tensors} tensors) to {result.out_dir}{extra}")
    return 0
