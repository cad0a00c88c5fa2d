"""``loom plan --search --cluster local``: the planner's search on this machine, priced by a
profile (`loom.sim.local.LocalScenario`). A tiny demo model is profiled in-process (two token
counts, one repeat, no communication: a second or two); the search runs on 2 local ranks and
its plan file is what ``loom train --plan`` takes. Speed and the prediction's accuracy are
measured by ``benchmarks/plan_local.py``, not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.cli import main
from loom.cost.arch_from_model import arch_from_model
from loom.cost.model import Workload
from loom.cost.profile_fit import evaluate
from loom.cost.profiled import ProfiledCostModel
from loom.plan.plan import LLM, ModuleSpec, Plan
from loom.profile import profile_model
from loom.train.build import build_data, build_model
from loom.train.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.toml"
TINY = ["model.vision.hidden_size=32", "model.audio.hidden_size=32", "model.llm.hidden_size=32",
        "model.llm.intermediate_size=64"]


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> tuple[Path, object]:
    cfg = load_config(DEMO, TINY)
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=cfg.run.seed)
    profile = profile_model(model, token_counts=(16, 64, 256), repeats=1, warmup=1, measure_comm=False)
    path = profile.save(tmp_path_factory.mktemp("profile") / "profile.json")
    return path, model


def test_profiled_layer_costs_add_up_to_the_stage_compute(tiny_profile):
    """The partitioner's per-layer costs from a profile: a one-stage module's layers sum to its
    forward and backward less what belongs to no layer (context build, loss, autograd call)."""
    path, model = tiny_profile
    from loom.cost.profile_file import Profile

    profile = Profile.load(path)
    plan = Plan([ModuleSpec(m) for m in model.module_names]).resolve(model.layer_counts())
    cost = ProfiledCostModel(profile, arch_from_model(model), plan)
    work = Workload.of_lengths([40, 24])
    for m in model.module_names:
        layers = cost.module_layer_costs(m, work)
        assert len(layers) == model.layer_counts()[m]
        forward = cost.forward_time(m, 0, work)
        extra = evaluate(profile.context[m], work) if m in profile.context else 0.0
        if m == LLM:
            extra += evaluate(profile.loss["forward"], work)
        assert sum(c.forward for c in layers) == pytest.approx(forward - extra, rel=1e-6, abs=1e-9)
        backward = cost.backward_time(m, 0, work) - profile.backward_call_s
        if m == LLM:
            backward -= evaluate(profile.loss["backward_input"], work)
        assert sum(c.backward for c in layers) == pytest.approx(backward, rel=1e-6, abs=1e-9)


def test_local_search_writes_a_plan_loom_train_takes(tiny_profile, tmp_path, capsys):
    path, _ = tiny_profile
    out = tmp_path / "searched.toml"
    assert main(["plan", "--search", "--cluster", "local", "--config", str(DEMO), "--profile", str(path),
                 "--ranks", "2", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "demo-local2: 2 x local cpu rank" in printed and "best" in printed
    plan = Plan.read_file(out, field="--plan")
    assert plan.resolve({"vision": 5, "audio": 5, "llm": 7}).world_size == 2  # the demo's layer counts
    # the plan file is what `loom train --plan` takes: every check before a process starts
    assert main(["train", "--dry-run", "--config", str(DEMO), "--plan", str(out), f"run.out_dir={tmp_path}",
                 *TINY]) == 0
    assert "loom: 2 processes" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "moon"], "--cluster 'moon' is unknown"),
    (["--cluster", "local", "--ranks", "0"], "--ranks 0"),
    (["--cluster", "local", "--profile", "/nonexistent/p.json"], "no such file; run `loom profile`"),
    (["--profile", "p.json"], "--profile and --ranks price this machine"),
])
def test_bad_local_search_flags_name_the_flag(argv, message, tmp_path, capsys):
    assert main(["plan", "--search", "--config", str(DEMO), "--out", str(tmp_path / "p.toml"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_profile_of_another_model_is_refused(tiny_profile, tmp_path, capsys):
    path, _ = tiny_profile
    assert main(["plan", "--search", "--cluster", "local", "--config", str(DEMO), "--profile", str(path),
                 "--out", str(tmp_path / "p.toml")]) == 2  # the full-size demo model, not the tiny one
    err = capsys.readouterr().err
    assert "--profile" in err and "loom profile" in err
