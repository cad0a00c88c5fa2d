"""`loom simulate`: scenarios from published configs, the two comparison plans, traces, errors."""

import json
import re

import pytest

from loom.cli import main
from loom.cost.model_configs import load_model_arch
from loom.data.sample import ImageMeta, SampleMeta
from loom.cost.workload import sample_work
from loom.planner.baselines import megatron_plan
from loom.sim.scenario import load_scenario

SMALL = """
name = "small"
[model]
llm = "llama3-8b"
encoders = { vision = "vit-h-14" }
projector = "mlp"
freeze = ["vision.encoder"]
[cluster]
gpu = "H100"
num_gpus = 64
gpus_per_node = 8
[data]
mix = "llava"
global_batch_size = 128
[parallel]
tensor_parallel = 4
data_parallel = 2
microbatches_per_pipeline = 8
"""


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_workload_follows_metadata():
    arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    meta = SampleMeta(0, text_tokens=50, images=(ImageMeta(224, 336),), segments=("image", "text"))
    work = sample_work(arch, [meta, SampleMeta(1, text_tokens=30, segments=("text",))])
    tokens = (224 // 14) * (336 // 14)
    assert work["vision"].tokens == tokens and work["vision"].attn_sq == tokens**2
    assert work["llm"].tokens == (50 - 1 + tokens) + 30 and work["llm"].segments == 2


def test_compare_prints_both_plans_and_writes_traces(tmp_path, capsys):
    rc = main(["simulate", "--config", write(tmp_path, SMALL), "--compare", "--json", "--no-png",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    plans = {r["plan"]: r for r in result["plans"]}
    assert set(plans) == {"first-stage", "megatron-style", "optimus", "frozen-aware"}
    for r in plans.values():
        assert r["simulated"] and r["iteration_time_s"] > 0 and 0 < r["mfu"] < 1 and r["world_size"] <= 64
        trace = json.loads(open(r["trace"]).read())
        assert any(e["ph"] == "X" and e["cat"] == "forward" for e in trace["traceEvents"])
    assert plans["megatron-style"]["layout"].startswith("vision 1x2x4")
    # Megatron-LM's own layout: every rank in the LLM's pipeline, the encoder inside its first stage
    assert plans["first-stage"]["layout"] == "vision in llm.0, llm 8x2x4x1" and plans["first-stage"]["world_size"] == 64
    # Optimus's: a vision replica on every TP group of the LLM's pipeline, its work in the LLM's bubbles
    assert plans["optimus"]["layout"] == "vision dp 16 tp 4 on the llm's units, llm 8x2x4x1"


def test_table_output(tmp_path, capsys):
    assert main(["simulate", "--config", write(tmp_path, SMALL), "--compare", "--no-png",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "megatron-style" in out and "frozen-aware" in out and "first-stage" in out and "MFU" in out
    assert "(simulated)" in out


@pytest.mark.parametrize("change, words", [
    (('gpu = "H100"', 'gpu = "B300"'), ["cluster.gpu", "'B300'", "H100"]),
    (('mix = "llava"', 'mix = "memes"'), ["data.mix", "'memes'", "llava"]),
    (('llm = "llama3-8b"', 'llm = "llama9"'), ["llama9"]),
    (("[parallel]", "[parallel]\nstages = 3"), ["unknown field", "stages"]),
])
def test_bad_scenarios_name_the_field(tmp_path, capsys, change, words):
    rc = main(["simulate", "--config", write(tmp_path, SMALL.replace(*change)), "--compare", "--no-png",
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    for w in words:
        assert w in err, (w, err)


def _simulate_oversized(tmp_path, placement: str = "disaggregated") -> int:
    """``loom simulate`` of Llama-3-70B in a 2-stage x DP 2 plan that cannot fit; its exit code."""
    text = SMALL.replace('llm = "llama3-8b"', 'llm = "llama3-70b"') + f"""
[plans.tiny]
num_microbatches = 16
placement = "{placement}"
[[plans.tiny.modules]]
name = "vision"
data_parallel = 2
[[plans.tiny.modules]]
name = "llm"
num_stages = 2
data_parallel = 2
"""
    return main(["simulate", "--config", write(tmp_path, text), "--no-png", "--out", str(tmp_path / "out")])


def test_plan_that_does_not_fit_memory_names_rank_and_excess(tmp_path, capsys):
    rc = _simulate_oversized(tmp_path)
    err = capsys.readouterr().err
    assert rc == 2
    assert "does not fit" in err and "rank " in err and "over by" in err and "GiB" in err


def test_a_placement_that_overcommits_a_rank_names_what_it_holds(tmp_path, capsys):
    """first_stage puts the encoder beside the LLM's first stage: the rank that holds both is
    named with everything it holds, and the placement is named as a way out."""
    rc = _simulate_oversized(tmp_path, "first_stage")
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(r"rank [01] \(vision stage 0 \+ llm stage 0, replica [01]\) needs", err) and "over by" in err, err
    assert "placement = 'disaggregated' instead of 'first_stage'" in err, err


def test_missing_scenario_file(tmp_path, capsys):
    assert main(["simulate", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shipped_scenario_loads():
    scenario = load_scenario("configs/sim/llama3-70b-vith-1024xh100.toml")
    plan = megatron_plan(scenario)
    assert plan.world_size == 1024 and plan.spec("vision").num_stages == 1


@pytest.mark.parametrize("change, overrides, words", [
    (("tensor_parallel = 4", "tensor_parallel = 0"), [], ["parallel.tensor_parallel = 0"]),
    (("num_gpus = 64", "num_gpus = 1.5"), [], ["cluster.num_gpus = 1.5"]),
    ((), ["data.llm_batching=ragged"], ["data.llm_batching = 'ragged'"]),
    ((), ["parallel.zero_stage=5"], ["parallel.zero_stage = 5"]),
    ((), ["totally.bogus=3"], ["'totally'"]),
    ((), ["cluster.gpu.kind=3"], ["cluster.gpu is not a table"]),
])
def test_load_scenario_refuses_what_the_cli_refuses(tmp_path, change, overrides, words):
    """The Python API checks every value, the file's and the overrides', as `loom simulate` does."""
    from loom.sim.scenario import ScenarioError

    text = SMALL.replace(*change) if change else SMALL
    with pytest.raises(ScenarioError) as e:
        load_scenario(write(tmp_path, text), overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_load_scenario_applies_overrides(tmp_path):
    scenario = load_scenario(write(tmp_path, SMALL), ["cluster.num_gpus=128", "parallel.tensor_parallel=8"])
    assert scenario.cluster.num_gpus == 128 and scenario.degrees.tensor_parallel == 8


def test_first_stage_runs_only_the_policies_that_keep_the_llms_slots(tmp_path, capsys):
    """Encoders inside the LLM's first stage run its slots: DistTrain's layout (a sample of every
    module per microbatch) applies, a per-phase policy is skipped with a note."""
    with open(write(tmp_path, SMALL)) as f:
        text = f.read()
    scenario = tmp_path / "fs.toml"
    scenario.write_text(text + '\n[plans.fs]\nplacement = "first_stage"\nnum_microbatches = 8\n'
                        '[[plans.fs.modules]]\nname = "vision"\ndata_parallel = 2\ntensor_parallel = 4\n'
                        '[[plans.fs.modules]]\nname = "llm"\nnum_stages = 8\ndata_parallel = 2\ntensor_parallel = 4\n')
    rc = main(["simulate", "--config", str(scenario), "--json", "--no-png", "--policy", "orchmllm,disttrain",
               "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads(captured.out)["plans"]
    assert [r.get("policy") for r in rows] == ["none", "disttrain"]
    assert "only disttrain of the policies applies" in captured.err
