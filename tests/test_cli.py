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
    from loom.train.scalars import tensorboard_installed

    board = tensorboard_installed()  # run.tensorboard where the package is (tests/test_tensorboard.py)
    out = loom("train", "--config", str(ROOT / "configs/demo.toml"), "run.steps=4", "run.name=t",
               f"run.out_dir={tmp_path}", "run.log_every=1", *TINY, *(["run.tensorboard=true"] if board else []),
               "run.eval_every=2", "data.eval_samples=8", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "t"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"step", "loss", "samples_per_s", "step_time_s"} <= set(r) and r["loss"] > 0
    assert "step     3/4" in out.stdout
    # run.eval_every=2: the held-out split's loss after steps 1 and 3 (the last), in the row and the log
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 3] and all(r["eval_loss"] > 0 for r in rows
                                                                          if "eval_loss" in r)
    assert "eval_loss" in next(line for line in out.stdout.splitlines() if line.startswith("step     3/4"))
    if board:  # the rows' numbers as TensorBoard scalars, step by step
        from test_tensorboard import read_scalars

        got = read_scalars(run / "tensorboard")
        assert [v for _, v in got["loss"]] == pytest.approx([r["loss"] for r in rows])
        assert {"lr", "samples_per_s", "step_time_s"} <= set(got) and [s for s, _ in got["eval_loss"]] == [1, 3]
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
    # an Optimus plan prints the order the run executes: the fill's, not the generator's
    colocated = ['plan.placement="colocated"', "plan.modules.vision.data_parallel=2", "plan.modules.audio.data_parallel=2",
                 "plan.modules.llm.num_stages=2"]
    rows = {}
    for fill in ("none", "optimus"):
        out = loom("plan", "--config", str(ROOT / "configs/demo.toml"), *colocated, f'plan.bubble_fill="{fill}"',
                   cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        rows[fill] = next(line for line in out.stdout.splitlines() if line.startswith("r0: "))
    assert rows["none"].startswith("r0: F vision.0 mb0 | F audio.0 mb0 | F vision.0 mb2")
    assert rows["optimus"] != rows["none"] and sorted(rows["optimus"].split(" | ")) == sorted(rows["none"].split(" | "))


@pytest.mark.multiprocess
def test_data_parallel_llm_with_an_odd_microbatch_count_trains(tmp_path):
    """Issue 8 point 11: a plan the CLI accepts trains (6 ranks, 3 microbatches over 2 LLM replicas)."""
    out = loom("train", "--config", str(ROOT / "configs/demo.toml"), "run.steps=1", "run.name=p11",
               f"run.out_dir={tmp_path}", "plan.modules.llm.data_parallel=2", "plan.num_microbatches=3", *TINY,
               cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "p11" / "status").read_text().strip() == "completed"
    assert len((tmp_path / "p11" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_run_directory_belongs_to_one_run(tmp_path, capsys):
    from loom.cli import main
    from loom.cli.train import claim_run_dir
    from loom.train.status import write_status

    args = ["train", "--config", str(ROOT / "configs/demo.toml"), "--dry-run", f"run.out_dir={tmp_path}", "run.name=r"]
    run = tmp_path / "r"
    assert main(args) == 0 and [p.name for p in run.iterdir()] == ["config.toml"]
    assert main(args + ["run.steps=7"]) == 0  # a dry run's config alone does not make a run
    assert load_config(run / "config.toml").run.steps == 7
    # a finished run: refused, even by --dry-run, and nothing in it changes
    write_status(run, "completed")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    before = (run / "config.toml").read_text()
    capsys.readouterr()
    assert main(args + ["run.steps=9"]) == 2
    err = capsys.readouterr().err
    assert "run.name = 'r'" in err and "already holds a run (status: completed)" in err and "--overwrite" in err
    assert "checkpoints" in err and len(err.strip().splitlines()) == 1
    assert main(args + ["--overwrite", "run.steps=9"]) == 0
    assert "would delete" in capsys.readouterr().out
    assert (run / "config.toml").read_text() == before and (run / "metrics.jsonl").is_file()
    # --overwrite without --dry-run clears it
    cfg = load_config(run / "config.toml")
    assert claim_run_dir(cfg, overwrite=True, dry_run=False) == run and not run.exists()


def test_a_stale_running_status_is_named_and_a_live_run_is_never_cleared(tmp_path):
    """A ``running`` status whose `loom train` is gone (SIGKILLed) is named as such; a run whose
    `loom train` still runs is refused even with --overwrite."""
    from loom.cli.common import CliError
    from loom.cli.train import claim_run_dir
    from loom.train.status import write_status

    cfg = load_config(ROOT / "configs/demo.toml", [f"run.out_dir={tmp_path}", "run.name=r"])
    run = tmp_path / "r"
    (run / "logs").mkdir(parents=True)
    write_status(run, "running")
    gone = subprocess.Popen([sys.executable, "-c", "pass", "loom"])
    gone.wait()
    (run / "logs" / "loom.pid").write_text(f"{gone.pid}\n")
    with pytest.raises(CliError, match="status: running, but no process of it is alive.*--overwrite"):
        claim_run_dir(cfg, overwrite=False, dry_run=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "loom"])
    try:
        (run / "logs" / "loom.pid").write_text(f"{live.pid}\n")
        with pytest.raises(CliError, match=f"still going .*process\\(es\\) \\[{live.pid}\\]"):
            claim_run_dir(cfg, overwrite=True, dry_run=False)
        assert run.is_dir()
    finally:
        live.kill()
        live.wait()
    assert claim_run_dir(cfg, overwrite=True, dry_run=False) == run and not run.exists()


@pytest.mark.multiprocess
def test_train_with_a_generator_logs_each_loss_term(tmp_path):
    """Issue 11: configs/generator.toml (vision -> 2-stage LLM -> image generator) trains through
    `loom train`; each loss term is logged and the generator's stage is in the trace."""
    out = loom("train", "--config", str(ROOT / "configs/generator.toml"), "run.steps=2", "run.name=g",
               f"run.out_dir={tmp_path}", "run.log_every=1", "model.vision.hidden_size=32",
               "model.llm.hidden_size=32", "model.llm.intermediate_size=64", "model.generator.hidden_size=32",
               "data.global_batch_size=8", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["loss_llm"] > 0 and r["loss_image"] > 0
        assert r["loss"] == pytest.approx(r["loss_llm"] + r["loss_image"], abs=1e-5)
    assert "image" in out.stdout.splitlines()[1]  # the log line names each term
    trace = json.loads((tmp_path / "g" / "trace.json").read_text())
    forwards = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "forward"]
    assert {e["pid"] for e in forwards} == {0, 1, 2, 3} and len(forwards) == 4 * 4
