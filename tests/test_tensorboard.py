"""run.tensorboard: the metrics rows as TensorBoard scalars, and its refusal without the package."""

import pytest

from loom.train import scalars
from loom.train.config import ConfigError, load_config
from loom.train.scalars import TensorBoardScalars, tensorboard_installed


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(not tensorboard_installed(), reason="needs the tensorboard package (pip install tensorboard)")
def test_metrics_rows_land_as_scalars(tmp_path):
    rows = [{"step": s, "loss": 2.0 - s / 10, "loss_llm": 1.5, "lr": 1e-3 * (s + 1), "samples_per_s": 40.0,
             "step_time_s": 0.25, "target_tokens": 321, "grad_norm": 0.5} for s in range(3)]
    rows[2]["eval_loss"] = 1.25
    board = TensorBoardScalars(tmp_path)
    for r in rows:
        board.write(r)
    board.close()
    assert (tmp_path / "tensorboard").is_dir()
    got = read_scalars(tmp_path / "tensorboard")
    assert set(got) == {"loss", "loss_llm", "lr", "samples_per_s", "step_time_s", "target_tokens", "grad_norm",
                        "eval_loss"}
    assert [s for s, _ in got["loss"]] == [0, 1, 2]
    assert got["loss"][1][1] == pytest.approx(1.9) and got["lr"][2][1] == pytest.approx(3e-3)
    assert got["eval_loss"] == [(2, 1.25)]
    # a resumed run from step 1: TensorBoard drops the old file's steps from 1 on
    board = TensorBoardScalars(tmp_path, resume_step=1)
    board.write({"step": 1, "loss": 7.0})
    board.close()
    assert read_scalars(tmp_path / "tensorboard")["loss"] == [(0, pytest.approx(2.0)), (1, 7.0)]


def test_tensorboard_without_the_package_is_refused_before_launch(monkeypatch):
    cfg = load_config("configs/demo.toml", ["run.tensorboard=true"])
    monkeypatch.setattr(scalars, "tensorboard_installed", lambda: False)
    with pytest.raises(ConfigError) as e:
        cfg.check_launch()
    message = str(e.value)
    assert "\n" not in message and "run.tensorboard" in message and "pip install tensorboard" in message
    load_config("configs/demo.toml").check_launch()  # off: no package needed
