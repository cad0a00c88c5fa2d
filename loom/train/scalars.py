"""TensorBoard scalars of a run (``run.tensorboard``): rank 0 writes every number of each
``metrics.jsonl`` row to ``runs/<name>/tensorboard/`` under the row's own key (``loss``,
``loss_<module>``, ``lr``, ``samples_per_s``, ``step_time_s``, ``grad_norm``, ``eval_loss``, ...),
at the row's step, so the two records cannot disagree on a name.

Needs the ``tensorboard`` package (``pip install tensorboard``, or the ``loom[tensorboard]``
extra); `loom.train.config.TrainConfig.check_launch` refuses ``run.tensorboard = true`` without
it before any process starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"  # under the run directory


def tensorboard_installed() -> bool:
    """Whether ``torch.utils.tensorboard`` can be imported (it needs the tensorboard package)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardScalars:
    """A `torch.utils.tensorboard.SummaryWriter` on ``run_dir/tensorboard``, fed the run's
    metrics rows. ``resume_step``: a resumed run's first step; TensorBoard then drops the
    events at and after it from earlier event files, as ``metrics.jsonl`` is truncated there."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(str(self.log_dir), purge_step=resume_step)

    def write(self, row: dict[str, Any]) -> None:
        """Every number of ``row`` (a ``metrics.jsonl`` row with its ``step``) as a scalar."""
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a run followed live, or killed, keeps every step written

    def close(self) -> None:
        self.writer.close()
