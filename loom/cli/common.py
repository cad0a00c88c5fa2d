"""What the ``loom`` subcommands share: the default config, loading a training config with its
plan checked against the model, and the one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

from loom.train.config import TrainConfig, load_config

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "demo.toml"


class CliError(ValueError):
    """A bad flag or argument; the message names it and the fix (printed as one line)."""


def default_config(args: argparse.Namespace) -> Path | None:
    """``--config``, or the bundled demo config when it exists (an editable install)."""
    if args.config is not None:
        return Path(args.config)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def plan_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides, with ``--plan FILE`` as ``plan="@FILE"`` first (so an override may still
    change one of its fields)."""
    plan = getattr(args, "plan", None)
    return ([f'plan="@{plan}"'] if plan else []) + list(args.overrides)


def load_train_config(args: argparse.Namespace) -> TrainConfig:
    """The config of ``--config`` and the overrides, with the plan resolved against the real
    model now, so a bad plan fails before any process starts."""
    from loom.train.build import build_data, build_model, profiled_boundaries

    cfg = load_config(default_config(args), plan_overrides(args))
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    if cfg.run.profile:
        profiled_boundaries(cfg, model, dataset)
    cfg.plan.resolve(model.layer_counts(), generators=list(model.generators))
    return cfg
