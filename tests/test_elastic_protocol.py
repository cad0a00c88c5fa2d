"""The pure rules of elastic recovery (loom.elastic.protocol, loom.elastic.planning), no processes:
the commit decision, the copy plan of missing layers, the layer-wise sync groups, and the
generations after failures (oobleck.md §3.6-§3.9)."""

from __future__ import annotations

import itertools

import pytest

from loom.elastic.config import ElasticConfig
from loom.elastic.layout import Generation
from loom.elastic.planning import ElasticPlanner
from loom.elastic.protocol import copy_plan, decide, sync_groups
from loom.plan.plan import ModuleSpec, Plan
from loom.planner.oobleck import LayerTimes


def test_commit_only_when_every_member_voted_ok():
    members = [0, 2, 3]
    assert decide(members, {0: "ok", 2: "ok", 3: "ok"}, dead=[]) == "commit"
    # a member that voted ok and then died still counts: the others commit
    assert decide(members, {0: "ok", 2: "ok", 3: "ok"}, dead=[2]) == "commit"
    assert decide(members, {0: "ok", 2: "abort"}, dead=[]) == "abort"
    assert decide(members, {0: "ok", 2: "ok"}, dead=[]) is None  # 3 alive and silent: wait
    assert decide(members, {0: "ok", 2: "ok"}, dead=[3]) == "abort"  # 3 can never vote


def test_decisions_agree_whenever_survivors_read():
    """Votes only appear (write-once) and a rank is declared dead only after it stopped writing:
    every reading a survivor can make along any order of events decides the same, or not yet."""
    members = [0, 1, 2]
    for final in itertools.product(["ok", "abort", None], repeat=3):  # None: died before voting
        votes_final = {m: v for m, v in zip(members, final) if v is not None}
        dead = [m for m, v in zip(members, final) if v is None]
        outcome = decide(members, votes_final, dead)
        assert outcome is not None
        for order in itertools.permutations(list(votes_final) + [("dead", d) for d in dead]):
            seen, gone = {}, []
            for ev in order:
                if isinstance(ev, tuple):
                    gone.append(ev[1])
                else:
                    seen[ev] = votes_final[ev]
                got = decide(members, seen, gone)
                assert got in (None, outcome), (final, order, got)


def test_copy_plan_takes_the_lowest_surviving_holder_and_refuses_a_lost_layer():
    haves = {0: ["a", "b"], 2: ["c"], 3: ["a", "b", "c"]}
    needs = {0: ["a", "b", "c"], 2: ["b", "c"], 3: ["a"]}
    assert copy_plan(needs, haves) == {(2, 0): ["c"], (0, 2): ["b"]}
    with pytest.raises(LookupError, match="d"):
        copy_plan({0: ["d"]}, haves)


def test_sync_groups_bucket_parameters_by_their_holders():
    # Fig. 2.9: a 3-stage and a 2-stage pipeline of 6 layers
    held = {0: ["l0", "l1"], 1: ["l2", "l3"], 2: ["l4", "l5"], 3: ["l0", "l1", "l2"], 4: ["l3", "l4", "l5"]}
    assert sync_groups(held) == {(0, 3): ["l0", "l1"], (1, 3): ["l2"], (1, 4): ["l3"], (2, 4): ["l4", "l5"]}


def _planner(nodes: int = 6) -> ElasticPlanner:
    # 4 equal layers, the encoders' work on the first stage: templates of 2..4 nodes
    times = LayerTimes({1: [1.0] * 4}, {1: [2.0] * 4}, {1: 1.0})
    base = Plan([ModuleSpec("vision"), ModuleSpec("llm")], num_microbatches=1)
    return ElasticPlanner.build(base, {"vision": 2, "llm": 4}, times, 12, ElasticConfig(nodes=nodes, f=1, min_nodes=2))


def test_generations_after_failures():
    planner = _planner()
    g0 = planner.first()
    assert sorted(r for p in g0.pipelines for r in p) == list(range(6)) and sum(g0.samples) == 12
    assert len(g0.pipelines) >= 2 and not g0.stop
    victim = g0.pipelines[-1][0]
    g1 = planner.next(g0, {victim})
    assert victim not in g1.members and len(g1.members) == 5 and sum(g1.samples) == 12 and not g1.stop
    for p, plan in zip(g1.pipelines, g1.plans):  # one LLM stage per node, the encoders in the first
        assert plan.spec("llm").num_stages == len(p) and plan.placement == "first_stage"
        assert plan.num_microbatches == g1.samples[g1.pipelines.index(p)]
    shares = g1.shares(list(range(100, 112)))
    assert [i for s in shares for i in s] == list(range(100, 112)) and [len(s) for s in shares] == g1.samples
    keep = min(g1.pipelines, key=len)
    others = [r for r in g1.members if r not in keep][:2]
    g2 = planner.next(g1, {victim, *others})  # 3 nodes left: below (f + 1) * n0 = 4
    assert g2.stop and "3 nodes remain" in g2.stop and g2.members == sorted(set(g1.members) - set(others))
    # two 3-node pipelines losing both first stages: 4 nodes are enough, but layer 0 has no copy left
    two = Generation(0, [[0, 1, 2], [3, 4, 5]], [], [6, 6])
    g3 = planner.next(two, {0, 3})
    assert g3.stop and "layer 0 has no surviving holder" in g3.stop, g3.stop


@pytest.mark.parametrize("override, field", [
    ("elastic.f=3", "elastic.nodes = 6: f = 3 needs"),
    ('balance.default="orchmllm"', "balance = ['orchmllm']"),
    ("elastic.ranks_per_node=2", "elastic.ranks_per_node = 2"),
    ('run.device="cuda"', "run.device = 'cuda'"),
    ("plan.modules.llm.data_parallel=2", "plan.modules.llm.data_parallel = 2"),
    ("elastic.timeout_s=0", "elastic.timeout_s = 0"),
    ("data.global_batch_size=2", "data.global_batch_size = 2"),
])
def test_elastic_config_refusals_name_the_field(override, field):
    from pathlib import Path

    from loom.train.config import ConfigError, load_config

    config = Path(__file__).resolve().parent.parent / "configs" / "elastic.toml"
    with pytest.raises(ConfigError) as e:
        load_config(config, [override])
    assert field in str(e.value), str(e.value)


def test_bubble_fill_is_refused_for_an_elastic_run():
    from pathlib import Path

    from loom.train.config import ConfigError, load_config

    config = Path(__file__).resolve().parent.parent / "configs" / "elastic.toml"
    with pytest.raises(ConfigError, match="plan.bubble_fill = 'optimus'"):
        load_config(config, ['plan.bubble_fill="optimus"', 'plan.placement="colocated"'])


def test_loom_plan_prints_what_the_elastic_runtime_runs(capsys):
    """``loom plan`` on an ``[elastic]`` config: the node specification, the templates, generation
    0's pipelines and Eq. 2.6 samples, and each pipeline's plan and schedule, as the supervisor
    decides them (not the config's own [plan], which the elastic runtime never runs)."""
    from pathlib import Path

    from loom.cli import main
    from loom.train.config import load_config
    from loom.train.elastic import elastic_planner

    config = Path(__file__).resolve().parent.parent / "configs" / "elastic.toml"
    assert main(["plan", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(config)
    planner = elastic_planner(cfg)
    gen = planner.first()
    assert len(gen.pipelines) >= cfg.elastic.f + 1
    assert f"f = {cfg.elastic.f}, n0 = {cfg.elastic.min_nodes}; templates of " \
           f"{', '.join(map(str, planner.spec.template_sizes))} nodes" in out
    for n, t in planner.templates.items():
        assert f"template {n} nodes: {t.num_stages} stages" in out
    assert f"pipelines {gen.pipelines}; samples per step {gen.samples} of {cfg.data.global_batch_size}" in out
    assert sum(gen.samples) == cfg.data.global_batch_size
    for i, (ranks, plan) in enumerate(zip(gen.pipelines, gen.plans)):
        assert f"# pipeline {i}: ranks {ranks}, template {len(ranks)} nodes" in out
        assert plan.to_toml() in out
        assert plan.num_microbatches == gen.samples[i] // cfg.elastic.microbatch_size
        assert f"rank {ranks[-1]} (pipeline rank {len(ranks) - 1}) = llm stage {len(ranks) - 1}" in out
    assert out.count(f"{cfg.plan.schedule}: ") == len(gen.pipelines)  # one schedule per pipeline
    assert cfg.plan.to_toml() not in out  # the config's [plan] alone is not what runs


def test_loom_simulate_refuses_an_elastic_config_naming_the_section(capsys):
    from pathlib import Path

    from loom.cli import main

    config = Path(__file__).resolve().parent.parent / "configs" / "elastic.toml"
    for extra in ([], ["--failure-interval", "600"]):
        assert main(["simulate", "--config", str(config), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "[elastic]" in err and "--failures" in err, err
    assert main(["plan", "--search", "--config", str(config)]) == 2
    assert "[elastic]" in capsys.readouterr().err


def test_survivors_save_becomes_a_regular_checkpoint(tmp_path):
    """Beyond f the survivors' per-rank files (`loom.elastic.stop`) are joined, in one process, into
    ``checkpoints/step_<N>`` with `Checkpointer`'s keys (``latest`` names it); it reads back
    exactly, passes the resume check against the model, and a save with a parameter that had no
    surviving copy is left unjoined."""
    import json
    from pathlib import Path

    import torch

    from loom.train.build import build_data, build_model
    from loom.train.checkpoint import (CheckpointMeta, check_compatible, expected_shapes, latest_checkpoint,
                                       read_whole)
    from loom.train.config import load_config
    from loom.train.elastic import survivors_checkpoint

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "elastic.toml",
                      ["model.llm.hidden_size=32", "model.llm.intermediate_size=64", "model.vision.hidden_size=32",
                       "model.audio.hidden_size=32"])
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=7)  # another seed: the values must come from the files
    params = {n: p.detach() for n, p in model.named_parameters()}
    optim = {n: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
             for n, p in params.items()}
    saved = tmp_path / "checkpoints" / "elastic_step_3"
    saved.mkdir(parents=True)
    names = sorted(params)
    files = {"rank0.pt": names[::2], "rank3.pt": names[1::2]}
    for f, mine in files.items():
        torch.save({"step": 3, "params": {k: params[k] for k in mine}, "optim": {k: optim[k] for k in mine}}, saved / f)
    manifest = {"step": 3, "reason": "test", "files": files, "missing": []}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    ckpt = survivors_checkpoint(cfg, tmp_path, saved)
    assert ckpt == tmp_path / "checkpoints" / "step_3" == latest_checkpoint(tmp_path)
    meta = CheckpointMeta.read(ckpt)
    assert meta.step == 3 and meta.world_size == 0
    check_compatible(ckpt, meta, expected_shapes(cfg))
    step, got, got_optim = read_whole(ckpt)
    assert step == 3 and set(got) == set(params) and set(got_optim) == set(optim)
    for n in params:
        assert torch.equal(got[n], params[n])
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got_optim[n][k], optim[n][k])
    (saved / "manifest.json").write_text(json.dumps({**manifest, "missing": [names[0]]}))
    assert survivors_checkpoint(cfg, tmp_path / "other", saved) is None


def test_rows_of_a_dead_leader_are_rebuilt_from_the_votes(tmp_path):
    """A generation's first rank killed between a commit and its ``metrics.jsonl`` row: the next
    leader writes the missing rows from the votes (each committing generation's, not an aborted
    one's), in step order."""
    import json
    from datetime import timedelta
    from pathlib import Path

    from torch.distributed import TCPStore

    from loom.elastic.coordination import Coordinator
    from loom.runtime.local import free_port
    from loom.train.config import load_config
    from loom.train.elastic import ElasticWorker

    coord = Coordinator(TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=10)))
    coord.publish(Generation(0, [[0, 1], [2, 3]], [], [2, 2]))
    coord.publish(Generation(1, [[0, 1, 2]], [], [4], lost=[3]))
    ok = {0: {"loss": {"llm": 1.0}, "samples": [5, 6], "grad_norm": 2.0}, 1: {"loss": {"llm": 0.5}, "samples": None},
          2: {"loss": {"llm": 0.25}, "samples": [7, 8]}, 3: {"loss": {"llm": 0.125}, "samples": None}}
    for r in range(4):  # step 1 committed in generation 0; step 2 aborted there (rank 3 died), redone in 1
        coord.vote(0, 1, r, {**ok[r], "grad_norm": 2.0})
        coord.vote(0, 2, r, None if r == 3 else ok[r])
    for r in range(3):
        coord.vote(1, 2, r, {"loss": {"llm": 0.5}, "samples": [9, 10, 11, 12] if r == 0 else None, "grad_norm": 1.5})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 3.0}) + "\n")
    worker = ElasticWorker.__new__(ElasticWorker)  # only what backfill reads: no model, no data
    worker.cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "elastic.toml")
    worker.run_dir, worker.coord = tmp_path, coord
    worker.backfill(3, 2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["generation"] == 0 and rows[1]["loss"] == 1.875 and rows[1]["samples"] == [[5, 6], [7, 8]]
    assert rows[1]["grad_norm"] == 2.0 and rows[1]["pipelines"] == [2, 2] and rows[1]["backfilled"]
    assert rows[2]["generation"] == 1 and rows[2]["loss"] == 1.5 and rows[2]["samples"] == [[9, 10, 11, 12]]
    worker.backfill(3, 2)  # nothing missing: nothing written
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
