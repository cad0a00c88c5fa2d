"""Surviving rank failures without a restart (issue 14; Oobleck, oobleck.md §3.6-§3.10), on real
processes: one elastic launch of 6 gloo workers (f = 1, templates of 2 nodes and up; encoders in
the first stage of each of 2 pipelined LLM replicas) under `loom.elastic.supervisor`.

A random rank is SIGKILLed when it starts a random step: the survivors (the same processes)
detect it, re-form heterogeneous pipelines (2 + 3 nodes from templates of 2 to 4), copy the lost layers and their AdamW
state from the other replica, redo the interrupted step with the same samples and go on. Later two
more ranks are killed at once, leaving 3 nodes, below (f + 1) * n0 = 4: the run ends with a clear
message and the survivors' checkpoint, which holds the single-process model's state after the
committed steps. Every committed step's loss (and gradient norm, clipped globally) equals the
single-process run's on the same global batch, and its samples are exactly that batch, each step
once.

The survivors' save becomes a regular loom checkpoint (``checkpoints/step_<N>``, ``latest``):
``loom train --resume`` continues the run from it elastically with every node back (a second
launch, the run's remaining steps), and, in this process, under a one-process plan without
``[elastic]``; both give the single-process losses at every following step."""

from __future__ import annotations

import json
import os
import shutil
import random
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.data.sampler import GlobalBatchSampler
from loom.data.collate import collate
from loom.elastic.supervisor import Kill
from loom.cli import main
from loom.runtime.local import free_port
from loom.train.build import build_data, build_model, token_counters
from loom.train.checkpoint import latest_checkpoint
from loom.train.config import config_to_toml, load_config
from loom.train.elastic import elastic_planner, launch
from loom.train.rank import make_lr_scheduler, make_optimizer
from loom.train.status import read_exits, read_pids

DEMO = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
BATCH = 12
MAX_NORM = 0.5  # below the demo model's early gradient norms: clipping acts on every step


MODEL = [f"data.global_batch_size={BATCH}", "data.demo.num_samples=96",
         "model.vision.hidden_size=32", "model.vision.num_layers=1", "model.audio.hidden_size=32",
         "model.audio.num_layers=1", "model.llm.hidden_size=32", "model.llm.intermediate_size=64",
         f"optim.max_grad_norm={MAX_NORM}"]


def _config(steps: int):
    return load_config(DEMO, [f"run.steps={steps}", *MODEL, "elastic.nodes=6", "elastic.f=1", "elastic.min_nodes=2",
                              "elastic.timeout_s=20"])


def _reference(cfg, steps: int, snapshot: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The single-process run: its loss and gradient norm per step and its parameters after
    ``snapshot`` steps."""
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg.optim)(params)
    scheduler = make_lr_scheduler(cfg, optimizer)
    sampler = GlobalBatchSampler(len(dataset), BATCH, seed=cfg.run.seed)
    losses, norms = [], []
    snap = {}
    for step in range(steps):
        if step == snapshot:
            snap = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = model.loss(collate([dataset[i] for i in sampler.batch(step)], tokenizer, token_counters(model)))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach()))
    if snapshot == steps:
        snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, norms, snap


@pytest.mark.multiprocess
def test_survives_a_kill_then_stops_beyond_f_with_a_checkpoint_then_resumes(tmp_path, monkeypatch):
    seed = int(os.environ.get("LOOM_ELASTIC_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    first_step = rng.choice([1, 2])
    second_step = first_step + 2
    cfg = _config(steps=second_step + 3)
    victim = rng.randrange(6)
    # the second failure: two ranks at once outside one surviving pipeline, so one copy of every
    # layer is left on 3 nodes (fewer than (f + 1) * n0 = 4): beyond f, with a checkpoint
    planner = elastic_planner(cfg)
    g1 = planner.next(planner.first(), {victim})
    keep = min(g1.pipelines, key=len)
    second = rng.sample([r for r in g1.members if r not in keep], 2)
    note = f"seed {seed}: rank {victim} killed at step {first_step}, ranks {second} at step {second_step}"

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(cfg))
    out = launch(cfg, run, run / "config.toml", kills=[Kill([victim], first_step), Kill(second, second_step)],
                 echo=False, planner=planner)

    # beyond f: a clear message naming the numbers, a checkpoint, no hang
    assert out.returncode == 2, (note, out.message)
    assert "3 nodes remain" in out.message and "(f + 1) x n0 = 2 x 2 = 4" in out.message, out.message
    gens = out.generations
    assert [g.number for g in gens] == [0, 1, 2] and gens[1].pipelines == g1.pipelines and gens[2].stop, note
    survivors = [r for r in range(6) if r not in {victim, *second}]

    # the survivors are the processes that started: same PIDs, every generation, to the end
    pids, exits = read_pids(run), read_exits(run)
    received = 0
    for r in survivors:
        assert exits[r].pid == pids[r] and exits[r].state == "stopped", (note, r, exits[r])
        log = (run / "logs" / f"rank{r}.log").read_text()
        assert "generation 0," in log and "generation 1," in log and "beyond f" in log, (note, r)
    for r in range(6):  # the second failure's ranks ran generation 1 too
        got = re.search(r"generation 1, .* received (\d+) parameters", (run / "logs" / f"rank{r}.log").read_text())
        received += int(got.group(1)) if got else 0
    assert received > 0, note  # the re-formed pipelines copied layers (with their AdamW state)

    # every committed step once, in order; its samples exactly the global batch; its loss the reference's
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))) and len(steps) >= second_step, (note, steps)
    _, dataset = build_data(cfg)
    sampler = GlobalBatchSampler(len(dataset), BATCH, seed=cfg.run.seed)
    consumed = []
    for r in rows:
        got = [i for share in r["samples"] for i in share]
        assert got == sampler.batch(r["step"]), (note, r["step"])
        consumed += got
    assert len(consumed) == len(steps) * BATCH
    assert {r["generation"] for r in rows} == {0, 1} and all(
        r["pipelines"] == [len(p) for p in g1.pipelines] for r in rows if r["generation"] == 1), note
    assert len({len(p) for p in g1.pipelines}) > 1, g1.pipelines  # heterogeneous pipelines after the failure
    ref_losses, ref_norms, ref_params = _reference(cfg, cfg.run.steps, snapshot=len(steps))
    for r in rows:
        assert r["loss"] == pytest.approx(ref_losses[r["step"]], rel=1e-5), (note, r["step"])
        # clipping by the global norm across heterogeneous pipelines (after the layer-wise sum)
        assert r["grad_norm"] == pytest.approx(ref_norms[r["step"]], rel=1e-4), (note, r["step"])
    assert all(n > MAX_NORM for n in ref_norms), ref_norms

    # the survivors' checkpoint: the reference model's state after the committed steps
    ckpt = run / "checkpoints" / f"elastic_step_{len(steps)}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == len(steps) and manifest["missing"] == [], note
    saved = {}
    for name in manifest["files"]:
        saved.update(torch.load(ckpt / name, weights_only=True)["params"])
    trainable = {n for n, p in ref_params.items()}
    assert set(saved) == trainable
    for n, t in saved.items():
        torch.testing.assert_close(t, ref_params[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{note}: {n}: {m}")

    # ... joined into a regular checkpoint that `loom train --resume` continues from: elastically,
    # every node back (the run's config.toml; a new generation 0), the remaining steps exact
    done = len(steps)
    assert latest_checkpoint(run) == run / "checkpoints" / f"step_{done}", note
    assert f"continue with loom train --resume {run}" in out.message, out.message
    monkeypatch.delenv("LOOM_KILL", raising=False)
    assert main(["train", "--resume", str(run)]) == 0, note
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(cfg.run.steps)), note
    assert {r["generation"] for r in rows[done:]} == {0} and rows[done]["pipelines"] == rows[0]["pipelines"], note
    for r in rows[done:]:
        assert r["loss"] == pytest.approx(ref_losses[r["step"]], rel=1e-5), (note, "elastic resume", r["step"])
    log = (run / "logs" / f"rank{victim}.log").read_text()  # the lost ranks are back, from the checkpoint
    assert f"resumed from {run / 'checkpoints' / f'step_{done}'} at step {done}" in log, note

    # ... or under a plan without [elastic]: one process (this one), all modules on it
    plain_run = tmp_path / "plain"
    shutil.copytree(run / "checkpoints" / f"step_{done}", plain_run / "checkpoints" / f"step_{done}")
    plain = load_config(DEMO, [f"run.steps={done + 1}", *MODEL, 'plan.placement="first_stage"',
                               "plan.modules.llm.num_stages=1"])
    assert plain.elastic is None and plain.plan.world_size == 1
    from loom.train.main import train

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    threads = torch.get_num_threads()
    try:
        train(plain, plain_run, plain_run / "checkpoints" / f"step_{done}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
    row = json.loads((plain_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == done and row["loss"] == pytest.approx(ref_losses[done], rel=1e-5), (note, "plain resume")
