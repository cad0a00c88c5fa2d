"""`loom train` end to end on 4 local processes, and `loom plan`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loom.plan.plan import Plan
from loom.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.vision.hidden_size=32", "model.audio.hidden_size=32", "model.llm.hidden_size=32",
        "model.llm.intermediate_size=64", "data.global_batch_size=8"]


def loom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.multiprocess
def test_train_writes_the_run_directory(tmp_path):
    out = loom("train", "--config", str(ROOT / "configs/demo.toml"), "run.steps=4", "run.name=t",
               f"run.out_dir={tmp_path}", "run.log_every=1", *TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "t"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"step", "loss", "samples_per_s", "step_time_s"} <= set(r) and r["loss"] > 0
    assert "step     3/4" in out.stdout
    cfg = load_config(run / "config.toml")
    assert cfg.run.steps == 4 and cfg.model.llm.hidden_size == 32
    plan = Plan.from_json(run / "plan.json")
    assert plan.spec("llm").stage_boundaries is not None
    trace = json.loads((run / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    forwards = [e for e in events if e["cat"] == "forward"]
    assert len(forwards) == 4 * 4  # 4 stages x 4 microbatches
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)


def test_bad_plan_fails_before_any_process_starts(tmp_path):
    out = loom("train", "--config", str(ROOT / "configs/demo.toml"), "plan.modules.llm.num_stages=20",
               f"run.out_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2
    assert "num_stages = 20" in out.stderr and "layers" in out.stderr
    assert not any(tmp_path.iterdir())


def test_plan_prints_layout_and_schedule(tmp_path):
    out = loom("plan", "--config", str(ROOT / "configs/demo.toml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 3 = llm stage 1 replica 0" in out.stdout
    assert "F llm.1 mb0" in out.stdout and "sendA" not in out.stdout
    out = loom("plan", "--config", str(ROOT / "configs/demo.toml"), "--comm", cwd=tmp_path)
    assert "sendA vision.0 mb0 -> r2" in out.stdout
