"""Checkpoints and resume (`loom.train.checkpoint`, issue 13 item 3), through `loom train`.

One reference run (2N steps, the LLM in 2 pipeline stages x 2 ZeRO-3 replicas, a checkpoint
every N steps saved asynchronously, ``run.checkpoint_async``), then two resumes from its step-N
checkpoint in copies of its run directory
(the run as a stop after step N would have left it): under the same plan the losses of every
step equal the reference's exactly; under another plan (the LLM in 1 stage, 1 replica, no ZeRO)
the first resumed step's loss equals it within 1e-5 relative, and a SIGTERM there ends the
run with a checkpoint at a step boundary. The refusals (another model's checkpoint, a bad
``run.checkpoint_every``) and the order of a save's writes are checked without launching.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.train.checkpoint import CheckpointMeta, SafeReader, latest_checkpoint, truncate_log
from loom.train.status import read_exits, read_status

ROOT = Path(__file__).resolve().parent.parent
# the demo without its audio encoder (one process fewer per launch): vision, then the LLM
TINY = ['model.audio="none"', 'plan.modules=[{name="vision"}, {name="llm"}]', "model.vision.hidden_size=32",
        "data.demo.mix={text=0.3, image=0.4, multi_image=0.3}",
        "model.llm.hidden_size=32",
        "model.llm.intermediate_size=64", "data.global_batch_size=8"]
ZERO3 = ["plan.modules.llm.num_stages=2", "plan.modules.llm.data_parallel=2", "plan.modules.llm.zero_stage=3"]
ONE_STAGE = ["plan.modules.llm.num_stages=1", "plan.modules.llm.data_parallel=1", "plan.modules.llm.zero_stage=0"]
N = 2


def loom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))), "one row per step, in order"
    return {r["step"]: r["loss"] for r in rows}


def logged_steps(run: Path) -> int:
    """Rows of ``metrics.jsonl`` so far (a line being written does not count)."""
    count = 0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            json.loads(line)
        except ValueError:
            break
        count += 1
    return count


def stopped_after(reference: Path, dest: Path, step: int, crashed: bool) -> Path:
    """A copy of the finished run ``reference`` as a stop right after ``step``'s checkpoint
    would have left it: later checkpoints gone, ``latest`` naming ``step_<step>``; the metrics
    of later steps kept if it ``crashed`` (a resume runs and logs them again), else cut at the
    step (a SIGTERM's stop)."""
    shutil.copytree(reference, dest)
    if not crashed:
        truncate_log(dest / "metrics.jsonl", step)
    for ckpt in (dest / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (dest / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return dest


@pytest.mark.multiprocess
def test_resume_is_exact_and_reshards_to_another_plan(tmp_path, capsys):
    out = loom("train", "--config", str(ROOT / "configs/demo.toml"), f"run.steps={2 * N}", "run.name=a",
               f"run.out_dir={tmp_path}", f"run.checkpoint_every={N}", "run.checkpoint_async=true", "run.log_every=1",
               *TINY, *ZERO3, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # the step-N save ran in the background (DCP async_save, ZeRO-3 DTensor shards staged on CPU)
    # while step N ran, and was completed at a later step boundary; the last one is synchronous
    lines = out.stdout.splitlines()
    began = next(i for i, t in enumerate(lines) if f"checkpoint step_{N} saving in the background" in t)
    ended = next(i for i, t in enumerate(lines) if f"checkpoint step_{N} saved in the background" in t)
    assert began < next(i for i, t in enumerate(lines) if t.startswith(f"step {N:5d}/")) < ended, out.stdout
    a = tmp_path / "a"
    reference = losses(a)
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == sorted(["latest", f"step_{2 * N}", f"step_{N}"])
    assert latest_checkpoint(a) == a / "checkpoints" / f"step_{2 * N}"
    meta = CheckpointMeta.read(a / "checkpoints" / f"step_{N}")
    assert meta.step == N and meta.world_size == 5 and "llm.lm_head.weight" in meta.params
    assert meta.plan["modules"][1]["zero_stage"] == 3
    # every rank wrote its shards: ZeRO-3 shards and the encoders' whole parameters
    assert len(list((a / "checkpoints" / f"step_{N}").glob("__*_0.distcp"))) == 5

    # two resumes from the step-N checkpoint, side by side (each launch's start-up is mostly one
    # process on one core): the same plan, and another plan (2 ranks, the LLM whole) stopped by SIGTERM
    b = stopped_after(a, tmp_path / "b", N, crashed=True)
    c = stopped_after(a, tmp_path / "c", N, crashed=False)
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", "train", "--resume", str(c), "run.steps=1000",
                             "run.log_every=1", *ONE_STAGE], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # the same plan: every step's loss equals the uninterrupted run's
        out = loom("train", "--resume", str(b), cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"resumed from {b / 'checkpoints' / f'step_{N}'} at step {N}" in out.stdout
        assert losses(b) == reference, "the resumed run's losses (steps before N kept, N.. run again)"
        assert read_status(b) == "completed" and latest_checkpoint(b) == b / "checkpoints" / f"step_{2 * N}"

        # another plan: DCP reshards by name; then SIGTERM saves and stops
        for _ in range(4800):  # polls, not a time limit on the code under test
            if proc.poll() is not None or logged_steps(c) > N:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    why = stdout + stderr
    assert proc.returncode == 128 + signal.SIGTERM, why
    got = losses(c)
    assert got[N] == pytest.approx(reference[N], rel=1e-5), why
    assert all(got[s] == reference[s] for s in range(N)), "the steps before the checkpoint are kept"
    status = read_status(c)
    assert status.startswith("interrupted at step "), why
    stop = int(status.split()[-1])
    assert stop == len(got) > N, why  # stopped at a step boundary: every logged step is in the checkpoint
    assert latest_checkpoint(c) == c / "checkpoints" / f"step_{stop}", why
    assert CheckpointMeta.read(c / "checkpoints" / f"step_{stop}").world_size == 2
    exits = read_exits(c)
    assert sorted(exits) == [0, 1] and all(e.state == "terminated" and f"step_{stop} saved" in e.reason
                                              for e in exits.values()), why
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(f"loom: interrupted at step {stop}"), why

    # another model's checkpoint is refused before any process starts, naming it and the parameter
    from loom.cli import main

    before = (c / "status").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(c), "model.llm.intermediate_size=96"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"checkpoint {c / 'checkpoints' / f'step_{stop}'}" in err, err
    assert "is of another model: parameter 'llm.model.layers.0.mlp" in err and "[96, 32]" in err, err
    assert (c / "status").read_text() == before and not (c / "logs" / "rank2.pid").exists()
    assert main(["train", "--resume", str(c), "--overwrite"]) == 2


def test_bad_values_are_refused_naming_the_field(tmp_path, capsys):
    from loom.cli import main

    base = ["train", "--config", str(ROOT / "configs/demo.toml"), "--dry-run", f"run.out_dir={tmp_path}"]
    assert main(base + ["run.checkpoint_every=-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error: run.checkpoint_every = -3: must not be negative") and "\n" not in err
    assert not any(tmp_path.iterdir())
    assert main(base + ['run.checkpoint_every="often"']) == 2
    assert "run.checkpoint_every" in capsys.readouterr().err
    assert main(base + ["run.checkpoint_async=true"]) == 2  # nothing periodic to put in the background
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error: run.checkpoint_async = true: only the periodic saves") and "\n" not in err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "--resume" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "has no checkpoint" in capsys.readouterr().err


def test_latest_is_written_after_a_complete_save_only(tmp_path, monkeypatch):
    """In one process (a world of 1): a save that fails inside DCP leaves ``latest`` naming the
    previous checkpoint and no ``meta.json`` in the partial one; ``meta.json`` is written
    before ``latest`` (by rename, never in place)."""
    import torch.distributed.checkpoint as dcp

    from loom.train import checkpoint as ck
    from loom.train.config import load_config
    from loom.train.rank import build_rank

    cfg = load_config(None, ["model.vision=\"none\"", "model.audio=\"none\"", "model.llm.hidden_size=16",
                             "model.llm.num_layers=1", "model.llm.intermediate_size=32", "model.llm.num_heads=2",
                             "model.llm.num_kv_heads=1", 'plan.modules=[{name="llm"}]', "plan.num_microbatches=1",
                             "data.global_batch_size=2", 'data.demo.mix={text=1.0}'])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        run = build_rank(cfg, torch.device("cpu"))
        run.step(0)
        saver = ck.Checkpointer(run, tmp_path)
        order: list[str] = []
        write = ck._write_atomically
        monkeypatch.setattr(ck, "_write_atomically", lambda path, text: (order.append(path.name), write(path, text)))
        saver.save(1)
        assert order == ["meta.json", "latest"] and latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"

        def broken(state_dict, storage_writer):  # a crash mid-save: some shards written, then gone
            (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"partial")
            raise RuntimeError("disk full")

        monkeypatch.setattr(dcp, "save", broken)
        with pytest.raises(RuntimeError, match="disk full"):
            saver.save(2)
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
        assert not (tmp_path / "checkpoints" / "step_2" / "meta.json").exists()
        monkeypatch.undo()
        # a fresh rank loads the complete one: its parameters equal the saved ones
        saved = {n: p.detach().clone() for n, p in run.engine.named_parameters().items()}
        again = build_rank(cfg, torch.device("cpu"))
        assert ck.Checkpointer(again, tmp_path).load(latest_checkpoint(tmp_path)) == 1
        for n, p in again.engine.named_parameters().items():
            torch.testing.assert_close(p.detach(), saved[n], rtol=0, atol=0)
        assert again.scheduler.last_epoch == 1 and again.optimizer.state, "the schedule and AdamW's moments"
    finally:
        dist.destroy_process_group()


def test_async_save_is_complete_only_once_written_and_failures_raise(tmp_path, monkeypatch):
    """``run.checkpoint_async`` in one process (a world of 1): while DCP's background write is
    held, `latest` still names the previous checkpoint and `poll` says nothing; the step after
    the save changes the parameters in place and the checkpoint still holds the values at the
    save (staged copies); a write that fails raises at the next step boundary (`poll`) naming
    the checkpoint directory, leaving `latest` on the previous one."""
    import threading

    import torch.distributed.checkpoint as dcp

    from loom.train import checkpoint as ck
    from loom.train.config import load_config
    from loom.train.rank import build_rank

    cfg = load_config(None, ["model.vision=\"none\"", "model.audio=\"none\"", "model.llm.hidden_size=16",
                             "model.llm.num_layers=1", "model.llm.intermediate_size=32", "model.llm.num_heads=2",
                             "model.llm.num_kv_heads=1", 'plan.modules=[{name="llm"}]', "plan.num_microbatches=1",
                             "data.global_batch_size=2", 'data.demo.mix={text=1.0}', "run.checkpoint_async=true",
                             "run.checkpoint_every=1"])
    assert cfg.run.checkpoint_async
    release, fail = threading.Event(), threading.Event()
    real = dcp.FileSystemWriter

    class HeldWriter(real):  # the write waits for `release`, then fails if `fail` is set
        def write_data(self, plan, planner):
            assert release.wait(120)
            if fail.is_set():
                raise OSError("disk full")
            return super().write_data(plan, planner)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        run = build_rank(cfg, torch.device("cpu"))
        run.step(0)
        saver = ck.Checkpointer(run, tmp_path, asynchronous=True)
        saver.save(1)  # a synchronous one first
        monkeypatch.setattr(dcp, "FileSystemWriter", HeldWriter)
        saved = {n: p.detach().clone() for n, p in run.engine.named_parameters().items()}
        blocked = saver.save_async(2)
        assert blocked >= 0 and saver.in_flight == 2
        run.step(1)  # training goes on while the save is held: the parameters change in place
        assert any(not torch.equal(p.detach(), saved[n]) for n, p in run.engine.named_parameters().items())
        assert saver.poll() is None and saver.in_flight == 2, "not finished: still in flight"
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
        assert not (tmp_path / "checkpoints" / "step_2" / "meta.json").exists()
        release.set()
        for _ in range(2400):  # polls at step boundaries, not a time limit
            done = saver.poll()
            if done is not None:
                break
            time.sleep(0.05)
        assert done is not None and done[0] == 2 and saver.in_flight is None
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"
        again = build_rank(cfg, torch.device("cpu"))
        assert ck.Checkpointer(again, tmp_path).load(latest_checkpoint(tmp_path)) == 2
        for n, p in again.engine.named_parameters().items():  # the values at the save, not after step 1
            torch.testing.assert_close(p.detach(), saved[n], rtol=0, atol=0)

        release.clear()
        fail.set()
        saver.save_async(3)
        release.set()
        with pytest.raises(ck.CheckpointError) as err:
            for _ in range(2400):
                saver.poll()
                time.sleep(0.05)
        assert f"asynchronous save of checkpoint {tmp_path / 'checkpoints' / 'step_3'} (step 3) failed" in str(err.value)
        assert "disk full" in str(err.value)
        assert saver.in_flight is None and latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"
        assert not (tmp_path / "checkpoints" / "step_3" / "meta.json").exists()
    finally:
        release.set()
        dist.destroy_process_group()


def test_checkpoint_metadata_is_never_unpickled_unsafely(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        SafeReader(tmp_path).read_metadata()


def test_truncate_log_keeps_the_steps_before_the_checkpoint(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"st')
    truncate_log(log, 2)
    assert log.read_text() == '{"step": 0}\n{"step": 1}\n'
