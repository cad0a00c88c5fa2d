"""`loom train` stops cleanly: Ctrl-C / SIGTERM stop every worker and mark the run
interrupted; a rank killed with SIGKILL ends the run with one line naming it (issue 8, point 13).
Worker processes are found from the pid files they write into the run directory."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom.train.launch import alive
from loom.train.status import read_pids, read_status

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.vision.hidden_size=32", "model.audio.hidden_size=32", "model.llm.hidden_size=32",
        "model.llm.intermediate_size=64", "data.global_batch_size=8"]


def start_long_run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    cmd = [sys.executable, "-m", "loom.cli", "train", "--config", str(ROOT / "configs/demo.toml"), "run.steps=2000",
           f"run.name={name}", f"run.out_dir={tmp_path}", "run.log_every=1", *TINY]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, tmp_path / name


def diagnose(run_dir: Path, lines: int = 15) -> str:
    """The run directory's account of a run (status, exit records, the ends of torchrun's and
    every rank's log), for a failing assertion's message: a failure under load shows its cause."""
    out = [f"status: {read_status(run_dir)}"]
    for path in sorted((run_dir / "logs").glob("*")) if (run_dir / "logs").is_dir() else []:
        if path.suffix in (".log", ".json"):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def wait_for_training(proc: subprocess.Popen, run_dir: Path, world: int = 4) -> dict[int, int]:
    """Wait until a step is logged and every rank wrote its pid; returns rank -> pid."""
    for _ in range(1200):  # polls, not a time limit on the code under test
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}\n{diagnose(run_dir)}")
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip() and len(read_pids(run_dir)) == world:
            return read_pids(run_dir)
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"no training step within the wait\n{diagnose(run_dir)}")


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float) -> str:
    """``loom train``'s stderr once it exits within ``timeout`` s; else it is killed and the
    assertion says what the run directory shows."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"loom train still running {timeout} s later: {proc.communicate()}\n"
                             f"{diagnose(run_dir)}") from None


def alive_at(pids, deadline: float) -> list[int]:
    """The processes of ``pids`` still alive at ``deadline`` (``time.monotonic()``), polling until
    then (an early return once all are gone)."""
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_worker_and_marks_the_run(tmp_path, sig):
    proc, run_dir = start_long_run(tmp_path, "sig")
    pids = wait_for_training(proc, run_dir)
    proc.send_signal(sig)
    deadline = time.monotonic() + 10  # the bound, from the signal
    err = finish(proc, run_dir, 120)
    why = f"stderr: {err!r}\n{diagnose(run_dir)}"
    assert alive_at(pids.values(), deadline) == [], "workers alive 10 s after the signal\n" + why
    assert proc.returncode == 128 + sig, why
    status = read_status(run_dir)
    assert status is not None and status.startswith("interrupted at step "), why
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom: interrupted at step "), why
    assert int(status.split()[-1]) >= 1  # a step was logged before the signal


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_run_with_one_line_naming_it(tmp_path):
    proc, run_dir = start_long_run(tmp_path, "kill")
    pids = wait_for_training(proc, run_dir)
    os.kill(pids[2], signal.SIGKILL)
    deadline = time.monotonic() + 10
    err = finish(proc, run_dir, 10)  # the bound: the run ends within 10 s of the kill
    why = f"stderr: {err!r}\n{diagnose(run_dir)}"
    assert alive_at(pids.values(), deadline) == [], why
    assert proc.returncode == 1, why
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom: failed on rank 2 (llm stage 0 replica 0): killed"), why
    assert read_status(run_dir).startswith("failed on rank 2: killed")
    assert (run_dir / "logs" / "rank0.log").is_file()


@pytest.mark.multiprocess
def test_workers_die_with_a_killed_loom_train_and_the_next_one_says_so(tmp_path):
    """SIGKILL of `loom train` itself (nothing can forward it): torchrun and the workers die with
    it, and the next `loom train` on that run directory names the stale ``running`` status."""
    proc, run_dir = start_long_run(tmp_path, "orphan")
    pids = wait_for_training(proc, run_dir)
    proc.kill()
    deadline = time.monotonic() + 10
    proc.communicate(timeout=60)
    assert alive_at(pids.values(), deadline) == [], "workers outlived their loom train by 10 s"
    assert read_status(run_dir) == "running"
    again = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--config", str(ROOT / "configs/demo.toml"),
                            "--dry-run", "run.name=orphan", f"run.out_dir={tmp_path}", *TINY], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "status: running, but no process of it is alive" in lines[0], again.stderr
    assert "--overwrite" in lines[0]


def _record(run_dir: Path, rank: int, state: str, reason: str, when: float) -> None:
    from loom.train.status import RankExit

    RankExit(rank, 1000 + rank, state, reason, when).write(run_dir)


def test_blame_prefers_the_cause_over_its_symptoms(tmp_path):
    """The launcher names the first rank that failed by itself: a Python error or a death with no
    record beat the communication errors they cause in the others, whatever their order."""
    from loom.train.launch import Supervisor

    (tmp_path / "logs").mkdir()
    sup = Supervisor([], tmp_path, 4, {}, roles={2: "llm stage 0 replica 0"})
    _record(tmp_path, 0, "comm", "RuntimeError: Connection reset by peer", 1.0)
    _record(tmp_path, 1, "done", "", 0.5)
    sup.deaths = {2: 2.0}
    assert sup._blame() == (2, "killed by a signal without a Python error (SIGKILL, the out-of-memory killer or a "
                               "native abort)")
    out = sup._outcome(1)
    assert out.status.startswith("failed on rank 2: killed") and "(llm stage 0 replica 0)" in out.message
    _record(tmp_path, 3, "error", "ValueError: bad sample", 3.0)
    sup.deaths = {}
    assert sup._blame() == (3, "ValueError: bad sample")
    assert "\n" not in sup._outcome(1).message


def test_classify_names_the_exception_in_one_line():
    from loom.train.status import Terminated, classify

    assert classify(ValueError("bad\nmore")) == ("error", "ValueError: bad")
    assert classify(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))[0] == "comm"
    assert classify(Terminated("stopped by SIGTERM")) == ("terminated", "stopped by SIGTERM")


FAKE_TORCHRUN = r'''
import os, subprocess, sys
run_dir, abort_after_record = sys.argv[1], sys.argv[2] == "1"
rank_code = """
import json, os, sys, time
from pathlib import Path
from loom.train.status import RankExit, write_pid
run_dir, rank, abort_after_record = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
write_pid(run_dir, rank)
time.sleep(0.3)
if rank == 2 and not abort_after_record:
    os.abort()  # a native abort in teardown: no Python error, no record
RankExit(rank, os.getpid(), "done", "", time.time()).write(run_dir)
if rank == 2:
    os.abort()  # after its record: in the interpreter's teardown
"""
open(os.path.join(run_dir, "metrics.jsonl"), "w").write('{"step": 0}\n')  # the run's one step
procs = [subprocess.Popen([sys.executable, "-c", rank_code, run_dir, str(r), sys.argv[2]]) for r in range(4)]
codes = [p.wait() for p in procs]
print("Root Cause (first observed failure):\n[0]:\n  rank      : 2 (local_rank: 2)\n"
      f"  exitcode  : {codes[2]} (pid: {procs[2].pid})", file=sys.stderr)
sys.exit(1)
'''


@pytest.mark.parametrize("after_record", [False, True])
def test_a_rank_dying_in_teardown_after_the_last_step_is_named(tmp_path, after_record):
    """Every step ran, then rank 2 aborts (before or after writing its exit record) and the
    launcher exits 1: the run fails on rank 2, not on "torchrun exited with status 1"."""
    from loom.train.launch import Supervisor

    cmd = [sys.executable, "-c", FAKE_TORCHRUN, str(tmp_path), "1" if after_record else "0"]
    out = Supervisor(cmd, tmp_path, 4, dict(os.environ), roles={2: "llm stage 0 replica 0"}, steps=1).run()
    assert out.returncode == 1
    assert out.status.startswith("failed on rank 2: killed by"), out.status
    if after_record:  # seen only when the launcher ends: its report gives the signal
        assert out.status.startswith("failed on rank 2: killed by SIGABRT after its exit record (done)")
        assert "interpreter's teardown" in out.status
    else:  # seen dead without a record while the launcher runs, or from its report afterwards
        assert "in teardown after the last step (1)" in out.status
    assert out.message.startswith("loom: failed on rank 2 (llm stage 0 replica 0): killed by")
    assert read_status(tmp_path) == out.status and "\n" not in out.message
