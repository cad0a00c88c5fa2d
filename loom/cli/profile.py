"""``loom profile``: time every layer of the config's model on this machine (`loom.profile`),
under the config's ``run.dtype`` (bf16: the runtime's autocast), and write the profile JSON,
which records that dtype. Every flag is checked, and the output made sure to be writable,
before anything is built or measured."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from loom.cli.common import CliError, default_config, plan_overrides
from loom.train.config import load_config

# check_settings names profile_model's arguments; the command names its flags
_FLAGS = {"token_counts": "--tokens", "repeats": "--repeats", "device": "--device", "threads": "--threads",
          "co_runners": "--co-runners"}


def parse_tokens(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise CliError(f"--tokens {text!r}: not a list of whole numbers; write token counts separated by "
                       f"commas, e.g. --tokens 64,256,1024") from None
    return counts


def check_out(out: Path) -> None:
    """Refuse an output path that cannot be written, before any work."""
    if out.is_dir():
        raise CliError(f"--out {str(out)!r} is a directory; give a file path such as {out / 'profile.json'}")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out {str(out)!r}: cannot create its directory ({e.strerror}); choose a writable path") from None
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CliError(f"--out {str(out)!r}: not writable; choose a writable path")


def cmd_profile(args: argparse.Namespace) -> int:
    from torch import device as torch_device

    from loom.profile import check_settings, profile_model
    from loom.train.build import build_data, build_model

    token_counts = parse_tokens(args.tokens)
    try:
        check_settings(token_counts=token_counts, repeats=args.repeats, device=args.device, threads=args.threads,
                       co_runners=args.co_runners)
    except ValueError as e:
        text = str(e)
        for name, flag in _FLAGS.items():
            if text.startswith(f"{name} = "):
                text = flag + " " + text[len(name) + 3:]
        raise CliError(text) from None
    cfg = load_config(default_config(args), plan_overrides(args))
    if cfg.model.generator is not None:
        raise CliError("model.generator: loom profile does not time generator layers yet; profile the model "
                       "without it (model.generator=none)")
    hf = [name for name, enc in cfg.model.encoder_configs().items() if getattr(enc, "hf", "")]
    if hf:  # its synthetic inputs are the zoo encoders' (loom.profile.inputs)
        raise CliError(f"model.{hf[0]}.hf: loom profile times the zoo's encoders only, not Hugging Face ones yet; "
                       "train without run.profile (the analytic cost model prices them) or profile a zoo encoder")
    try:
        check_settings(device=args.device, dtype=cfg.run.dtype)  # bf16 on a CUDA device without it
    except ValueError as e:
        raise CliError(str(e).replace("dtype = ", "run.dtype = ", 1)) from None
    out = Path(args.out) if args.out else Path(cfg.run.out_dir) / cfg.run.name / "profile.json"
    check_out(out)
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    print(f"loom: profiling {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {args.device} "
          f"with {args.threads} thread(s), {cfg.run.dtype}, token counts {list(token_counts)}, {args.repeats} "
          f"repeats", flush=True)
    profile = profile_model(model, token_counts=token_counts, repeats=args.repeats, device=args.device,
                            threads=args.threads, measure_comm=not args.no_comm, co_runners=args.co_runners,
                            dtype=cfg.run.dtype)
    if not args.no_dispatch:
        from loom.profile.dispatch import measure_dispatch
        from loom.train.rank import profiling_dispatcher

        world = cfg.plan.resolve(model.layer_counts()).world_size
        print(f"loom: timing the dispatcher's host work on {world} local processes", flush=True)
        profile.dispatch = measure_dispatch(profiling_dispatcher, (cfg,), world)
        d = profile.dispatch
        print("dispatch host work (CPU time per step, by rank): " + ", ".join(
            f"r{r} {a * 1e3:.2f} ms + {c * 1e6:.1f} us/sample" for r, (a, c) in enumerate(zip(d["fixed_s"],
                                                                                             d["per_sample_s"]))))
    world = cfg.plan.resolve(model.layer_counts()).world_size
    if not args.no_contention and torch_device(args.device).type == "cpu" and world > 1:
        from loom.profile.contention import measure_contention

        print(f"loom: timing the layers' CPU beside {world - 1} co-running processes (the plan's other ranks)",
              flush=True)
        profile.contention = measure_contention(model, world - 1, token_counts=token_counts, device=args.device,
                                                threads=args.threads, dtype=cfg.run.dtype)
        print(f"contention: {profile.contention['cpu_ratio']:.3f} x the solo CPU time with {world} ranks computing")
    profile.save(out)
    print(profile.table())
    print(f"profiled in {profile.settings['seconds']:.1f} s; wrote {out} (model signature {profile.signature_hash})")
    return 0
