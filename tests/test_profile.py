"""The profiler (`loom.profile`) and `ProfiledCostModel` (issue 3 item 2; entrain.md §3.1):
profiles round-trip through JSON, a profile of another model is refused with a clear error, a
real (quick) profile gives a usable frozen-aware cost model, bad settings are refused before
anything runs. The fit itself is tested in test_profile_fit.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.cost.arch_from_model import arch_from_model
from loom.cost.model import Workload
from loom.cost.profile_comm import Communication
from loom.cost.profile_file import Profile, ProfileError, model_signature
from loom.cost.profile_fit import LinearFit, evaluate
from loom.cost.profiled import ProfiledCostModel
from loom.data.tokenizer import Tokenizer
from loom.model.zoo import LlamaConfig, VisionConfig
from loom.plan.plan import LLM, ModuleSpec, Plan, PlanError
from loom.profile import check_settings, profile_model
from loom.train.build import build_model
from loom.train.config import ModelConfig


def tiny_model(llm_hidden: int = 32, freeze: list[str] | None = None, vision: bool = True):
    cfg = ModelConfig(
        vision=VisionConfig(hidden_size=32, num_layers=1, num_heads=2) if vision else None,
        audio=None,
        llm=LlamaConfig(hidden_size=llm_hidden, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64),
        projector="linear",
        freeze=freeze or [],
    )
    return build_model(cfg, Tokenizer(), seed=0)


@pytest.fixture(scope="module")
def quick_profile() -> Profile:
    torch.manual_seed(0)
    return profile_model(tiny_model(), token_counts=(16, 64, 256), repeats=1, warmup=1, measure_comm=False)


# ---- files and the model check ---------------------------------------------------------------
def test_profile_round_trips_through_json(quick_profile: Profile, tmp_path: Path):
    path = quick_profile.save(tmp_path / "p.json")
    json.loads(path.read_text())  # plain JSON, no pickle
    back = Profile.load(path)
    assert back.path == str(path)
    assert back.to_dict() == quick_profile.to_dict()
    assert back.signature_hash == quick_profile.signature_hash
    w = Workload.of_lengths([40, 24])
    for m, layers in quick_profile.layers.items():
        for a, b in zip(layers, back.layers[m]):
            for phase in ("forward", "backward_input", "backward_weight"):
                assert a.time(phase, w) == b.time(phase, w)


def test_contention_round_trips_and_older_files_have_none(quick_profile: Profile, tmp_path: Path):
    """The CPU slowdown beside co-runners (`loom.profile.contention`) survives the file; a file
    without the field (written before it existed) loads with none."""
    measured = {"busy": 4, "cpu_ratio": 1.07, "solo_s": [1.5, 1.4], "shared_s": [1.6, 1.5], "passes": 2}
    with_contention = Profile.from_dict(quick_profile.to_dict())
    with_contention.contention = dict(measured)
    back = Profile.load(with_contention.save(tmp_path / "c.json"))
    assert back.contention == measured
    old = quick_profile.to_dict()
    del old["contention"]
    assert Profile.from_dict(old).contention == {}


@pytest.mark.parametrize("argument,value", [("co_runners", 0), ("co_runners", True), ("passes", 0)])
def test_contention_settings_are_refused_before_any_process_starts(argument: str, value):
    from loom.profile.contention import measure_contention

    kwargs = {"co_runners": 1, "passes": 1} | {argument: value}
    with pytest.raises(ValueError, match=argument):
        measure_contention(tiny_model(), **kwargs)


def test_profile_of_another_model_is_refused_with_a_clear_error(quick_profile: Profile, tmp_path: Path):
    path = quick_profile.save(tmp_path / "tiny.json")
    other = tiny_model(llm_hidden=48)  # same layers, wider LLM
    prof = Profile.load(path)
    plan = Plan([ModuleSpec("vision"), ModuleSpec(LLM)])
    with pytest.raises(ProfileError) as err:
        ProfiledCostModel(prof, other, plan)
    msg = str(err.value)
    assert str(path) in msg and "loom profile" in msg
    # names the first difference: the vision projector, whose output is the LLM's width
    assert "module 'vision'" in msg and "projector" in msg and "[32, 32] in the profile but [48, 32] in the model" in msg
    assert prof.signature_hash in msg and "another model" in msg
    # a model with other modules: the module is named
    with pytest.raises(ProfileError, match="module 'vision'"):
        prof.check_matches(tiny_model(vision=False))
    # the same model passes
    ProfiledCostModel(prof, tiny_model(), plan)
    # a profile cannot price context parallelism's all-gather: refused, naming the field
    with pytest.raises(PlanError, match=r"plan.modules\['llm'\].context_parallel = 2: a profile times"):
        ProfiledCostModel(prof, tiny_model(), Plan([ModuleSpec("vision"), ModuleSpec(LLM, context_parallel=2)]))


def test_bad_profile_files_are_clear_errors(quick_profile: Profile, tmp_path: Path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match="does not exist.*loom profile"):
        Profile.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        Profile.load(bad)
    bad.write_text(json.dumps({"benchmark": "x"}))
    with pytest.raises(ProfileError, match="not a loom profile"):
        Profile.load(bad)
    d = quick_profile.to_dict()
    d["signature"]["llm"][1][0] = "llm.model.layers.9"  # edited by hand
    bad.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="hash"):
        Profile.load(bad)


def test_signature_names_layers_and_parameter_shapes():
    sig = model_signature(tiny_model())
    assert list(sig) == ["vision", "llm"]
    names = [layer[0] for layer in sig["llm"]]
    assert names[0] == "llm.model.embed_tokens" and names[-1] == "llm.lm_head"
    head = dict((p[0], p[1]) for p in sig["llm"][-1][1])
    assert head["weight"][1] == 32


# ---- a real quick profile ----------------------------------------------------------------------
def test_quick_real_profile_gives_positive_costs_growing_with_tokens(quick_profile: Profile):
    assert quick_profile.layer_counts() == {"vision": 4, "llm": 5}
    assert quick_profile.device["kind"] == "cpu" and quick_profile.device["torch"]
    assert quick_profile.optimizer["per_param_s"] >= 0 and quick_profile.matmul_flops_per_s > 0
    for layers in quick_profile.layers.values():
        for layer in layers:
            assert all(c >= 0 for c in layer.forward) and layer.time("forward", Workload.of_lengths([64])) > 0
    model = tiny_model()
    plan = Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)], num_microbatches=2)
    cost = ProfiledCostModel(quick_profile, model, plan)
    for module, stage in (("vision", 0), (LLM, 0), (LLM, 1)):
        for kind in ("forward", "backward"):
            small = cost.stage_time(module, stage, kind, Workload.padded([16] * 2))
            large = cost.stage_time(module, stage, kind, Workload.padded([256] * 2))
            assert 0 < small < large, (module, stage, kind)
    w = {"vision": Workload.of_lengths([16, 16]), LLM: Workload.padded([40, 40])}
    assert cost.model_flops(w) > 0 and cost.peak_flops_per_rank() > 0
    assert cost.static_memory(LLM, 0) > 0
    assert cost.activation_memory(LLM, 1, w[LLM]) > 0
    assert cost.optimizer_time(LLM, 0) > 0
    # without communication measurements transfers are free; single-replica stages never sync
    assert cost.transfer_time(0, 1, "vision", 0, w["vision"]) == 0.0 and cost.grad_sync_time(LLM, 0) == 0.0
    # an architecture (arch_from_model) works as the model too
    ProfiledCostModel(quick_profile, arch_from_model(model), plan)


def test_frozen_aware_backward_in_the_profiled_model(quick_profile: Profile):
    plan = lambda: Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)], num_microbatches=2)
    w = Workload.padded([64] * 2)
    full = ProfiledCostModel(quick_profile, tiny_model(), plan())
    # frozen LLM after a frozen encoder: no backward anywhere
    frozen = ProfiledCostModel(quick_profile, tiny_model(freeze=["vision", "llm"]), plan())
    for module, stage in (("vision", 0), (LLM, 0), (LLM, 1)):
        assert frozen.stage_time(module, stage, "backward", w) == 0.0
        assert frozen.activation_memory(module, stage, w) == 0.0
        assert frozen.optimizer_time(module, stage) == 0.0
        assert frozen.stage_time(module, stage, "forward", w) == full.stage_time(module, stage, "forward", w)
    # frozen LLM after a trainable projector: the LLM back-propagates input gradients only
    proj = ProfiledCostModel(quick_profile, tiny_model(freeze=["vision.encoder", "llm"]), plan())
    for stage in (0, 1):
        b = proj.stage_time(LLM, stage, "backward", w)
        assert 0 < b < full.stage_time(LLM, stage, "backward", w)
    layers = quick_profile.layers[LLM]
    expected = sum(layers[i].time("backward_input", w) for i in range(3, 5))
    expected += evaluate(quick_profile.loss["backward_input"], w) + quick_profile.backward_call_s
    assert proj.stage_time(LLM, 1, "backward", w) == pytest.approx(expected)
    assert proj.optimizer_time(LLM, 0) == 0.0 and proj.optimizer_time("vision", 0) > 0
    # per-module flags without a model give the same answer
    flags = ProfiledCostModel(quick_profile, None, plan(), trainable={"vision": [False, False, False, True], LLM: False})
    assert flags.stage_time(LLM, 1, "backward", w) == pytest.approx(expected)


def test_a_module_subset_serves_a_model_of_just_that_module(quick_profile: Profile):
    llm_only = tiny_model(vision=False)
    with pytest.raises(ProfileError):
        quick_profile.check_matches(llm_only)
    sub = quick_profile.subset([LLM])
    sub.check_matches(llm_only)
    plan = Plan([ModuleSpec(LLM, num_stages=2)], num_microbatches=2)
    cost = ProfiledCostModel(sub, llm_only, plan)
    w = Workload.padded([32] * 2)
    full = ProfiledCostModel(quick_profile, tiny_model(), Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)]))
    assert cost.stage_time(LLM, 1, "forward", w) == pytest.approx(full.stage_time(LLM, 1, "forward", w))
    with pytest.raises(ProfileError, match="audio"):
        quick_profile.subset(["audio"])


def test_message_costs_are_charged_to_the_compute_around_them(quick_profile: Profile):
    """Each send's post and each receive's completion cost their rank CPU time (the simulator's
    sends and receives take none), and the wire time is what the waiting receiver sees beyond
    its own receive cost."""
    import dataclasses

    const = lambda s: LinearFit(s, 0.0, [])
    comm = Communication(send_post=const(1e-3), recv_ready=const(2e-3), latency=const(5e-3), all_reduce=const(4e-3))
    with_comm = dataclasses.replace(quick_profile, comm=comm)
    plan = lambda: Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2)], num_microbatches=2)
    a = ProfiledCostModel(quick_profile, tiny_model(), plan())
    b = ProfiledCostModel(with_comm, tiny_model(), plan())
    w = Workload.padded([32] * 2)
    d = lambda m, s, k: b.stage_time(m, s, k, w) - a.stage_time(m, s, k, w)
    assert d("vision", 0, "forward") == pytest.approx(1e-3)  # posts its output
    assert d(LLM, 0, "forward") == pytest.approx(2e-3 + 1e-3)  # receives the vision tokens, posts on
    assert d(LLM, 1, "forward") == pytest.approx(2e-3)  # receives; the loss stage sends nothing
    assert d(LLM, 1, "backward") == pytest.approx(1e-3)  # posts the gradient back
    assert d(LLM, 0, "backward") == pytest.approx(2e-3 + 1e-3)  # receives it, posts one to vision
    assert d("vision", 0, "backward") == pytest.approx(2e-3)
    assert b.transfer_time(0, 1, LLM, 0, w) == pytest.approx(5e-3 - 2e-3)
    assert b.transfer_time(1, 1, LLM, 0, w) == 0.0
    # the communicator threads' CPU: none measured, none charged; else the fits at the message's bytes
    assert b.transfer_cpu(0, 1, LLM, 0, w) == (0.0, 0.0)
    nbytes = b.activation_bytes(LLM, 0, w)
    threads = dataclasses.replace(quick_profile, comm=dataclasses.replace(
        comm, thread_send=LinearFit(1e-4, 1e-9, [[0, 1e-4]]), thread_recv=LinearFit(2e-4, 0.0, [[0, 2e-4]])))
    c = ProfiledCostModel(threads, tiny_model(), plan())
    assert c.transfer_cpu(0, 1, LLM, 0, w) == pytest.approx((1e-4 + nbytes * 1e-9, 2e-4))
    assert c.transfer_cpu(1, 1, LLM, 0, w) == (0.0, 0.0)
    assert Communication.from_dict(threads.comm.to_dict()).thread_cpu(1e6) == pytest.approx((1e-4 + 1e-3, 2e-4))
    # frozen encoder: no gradient goes back to it
    frozen = ProfiledCostModel(with_comm, tiny_model(freeze=["vision"]), plan())
    base = ProfiledCostModel(quick_profile, tiny_model(freeze=["vision"]), plan())
    assert frozen.stage_time(LLM, 0, "backward", w) - base.stage_time(LLM, 0, "backward", w) == pytest.approx(2e-3)
    # data parallel: the gradient all-reduce, ring-scaled from the 2 measured ranks
    dp = Plan([ModuleSpec("vision"), ModuleSpec(LLM, data_parallel=4)], num_microbatches=4)
    sync = ProfiledCostModel(with_comm, tiny_model(), dp).grad_sync_time(LLM, 0)
    assert sync == pytest.approx(4e-3 * 3)  # alpha per ring step: (n - 1) / (2 - 1)


def test_loom_profile_command_writes_a_loadable_profile(tmp_path: Path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "p.json"
    tiny = ["model.vision.hidden_size=32", "model.audio.hidden_size=32", "model.llm.hidden_size=32",
            "model.llm.intermediate_size=64"]
    run = subprocess.run([sys.executable, "-m", "loom.cli", "profile", "--config", str(root / "configs/demo.toml"),
                          "--out", str(out), "--tokens", "16,64", "--repeats", "1", "--no-comm", "--no-contention",
                          *tiny],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "model.layers.0" in run.stdout and str(out) in run.stdout
    prof = Profile.load(out)
    assert list(prof.layers) == ["vision", "audio", "llm"] and prof.comm is None and prof.contention == {}
    # the dispatcher's host work, timed on the demo plan's 4 local ranks, survives the file
    assert "dispatch host work" in run.stdout and int(prof.dispatch["world_size"]) == 4
    host = prof.dispatch_host_seconds(16, 4)
    assert len(host) == 4 and min(host) > 0 and prof.dispatch_host_seconds(16, 8) is None


def test_dispatch_fit_is_each_ranks_line():
    """Two ranks, batches of 8 and 16 twice each (one outlier): rank 0 takes 0.25 ms per sample,
    rank 1 3 ms + 0.5 ms per sample; the fit recovers both from the medians, a negative
    intercept is clipped at 0, and a profile reads the lines back per rank."""
    from loom.profile.dispatch import fit_dispatch

    fast = [[8, 0.002], [8, 0.002], [8, 0.009], [16, 0.004], [16, 0.004], [16, 0.004]]
    slow = [[8, 0.007], [8, 0.007], [8, 0.007], [16, 0.011], [16, 0.011], [16, 0.011]]
    fit = fit_dispatch([fast, slow], world_size=2)
    assert fit["fixed_s"] == pytest.approx([0.0, 0.003], abs=1e-12)
    assert fit["per_sample_s"] == pytest.approx([0.00025, 0.0005])
    assert np.allclose(fit["median_s"], [[0.002, 0.004], [0.007, 0.011]]) and fit["world_size"] == 2
    steep = fit_dispatch([[[8, 0.001], [16, 0.005]]], world_size=1)
    assert steep["fixed_s"] == [0.0] and steep["per_sample_s"] == pytest.approx([0.0005])


@pytest.mark.parametrize("argument, value", [
    ("token_counts", ()), ("token_counts", (64, 2)), ("token_counts", "abc"), ("token_counts", (64.5,)),
    ("repeats", 0), ("warmup", -1), ("threads", 0), ("co_runners", -1), ("device", "tpu"), ("device", "cuda:99"),
    ("dtype", "fp16"),
])
def test_bad_profile_settings_are_refused_naming_the_argument(argument: str, value):
    if argument == "device" and value.startswith("cuda") and torch.cuda.device_count() > 99:
        pytest.skip("this machine has a CUDA device 99")
    with pytest.raises(ValueError) as info:
        check_settings(**{argument: value})
    assert str(info.value).startswith(f"{argument} = ")
    with pytest.raises(ValueError, match=f"^{argument} = "):  # before any model is touched
        profile_model(None, **{argument: value})


def test_a_bf16_profile_times_bf16_layers_and_is_refused_for_another_dtype(quick_profile: Profile, tmp_path: Path):
    """``dtype="bf16"`` (a run's ``run.dtype``): every forward the profiler times runs under
    the runtime's autocast (`loom.runtime.precision`), so the LLM's projections compute in bf16;
    the profile records its dtype, and `load_profile_for` refuses it for a run of another."""
    from loom.cost.profile_file import load_profile_for

    model = tiny_model()
    seen: list[torch.dtype] = []
    proj = model.llm.model.layers[0].self_attn.q_proj
    handle = proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    try:
        prof = profile_model(model, token_counts=(16, 64), repeats=1, warmup=0, measure_comm=False, dtype="bf16")
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the saved-bytes run, the chained and the lone forwards
    assert prof.dtype == "bf16" and quick_profile.dtype == "fp32"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    path = prof.save(tmp_path / "bf16.json")
    assert json.loads(path.read_text())["dtype"] == "bf16"
    assert load_profile_for(path, tiny_model(), "bf16").dtype == "bf16"
    with pytest.raises(ProfileError) as err:
        load_profile_for(path, tiny_model(), "fp32")
    msg = str(err.value)
    assert str(path) in msg and '"dtype": \'bf16\'' in msg and "run.dtype = 'fp32'" in msg
    assert "loom profile" in msg and "run.dtype=fp32" in msg
    # a file from before the field holds fp32 timings (all the profiler ran then)
    old = quick_profile.to_dict()
    del old["dtype"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile_for(tmp_path / "old.json", tiny_model()).dtype == "fp32"
    with pytest.raises(ProfileError, match="run.dtype = 'bf16'"):
        load_profile_for(tmp_path / "old.json", tiny_model(), "bf16")
    old["dtype"] = "fp8"
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(ProfileError, match="\"dtype\": 'fp8'"):
        Profile.load(tmp_path / "bad.json")


def test_optimizer_steps_are_timed_with_their_tensors_out_of_cache():
    """On a CPU the optimizer bench writes twice the last-level cache before each timed step
    (a run's optimizer step finds its tensors evicted by the step's other work)."""
    from loom.profile.optimizer import OptimizerBench, evict_caches, last_level_cache_bytes

    llc = last_level_cache_bytes()
    assert llc > 0
    bench = OptimizerBench(torch.device("cpu"))
    assert bench._evict is not None and bench._evict.numel() * bench._evict.element_size() >= 2 * llc
    buf = torch.zeros(8)
    evict_caches(buf)
    evict_caches(None)  # a GPU bench evicts nothing
    assert torch.equal(buf, torch.ones(8))
    bench.run_pass(keep=True)
    fit = bench.fit()
    assert all(np.isfinite(v) and v >= 0 for v in fit.values()) and fit["per_param_s"] > 0


def test_each_layer_has_a_cold_start_that_the_file_keeps(quick_profile: Profile, tmp_path: Path):
    """The profiler times every layer's cold start on a CPU (its chained forward and backward
    right after a cache eviction, less warm) and the file keeps it; files written before it was
    measured load with none."""
    for layers in quick_profile.layers.values():
        for layer in layers:
            assert np.isfinite(layer.cold_forward_s) and np.isfinite(layer.cold_backward_s)
    # at least one layer of the model: the passes did measure something
    assert any(layer.cold_forward_s != 0.0 or layer.cold_backward_s != 0.0
               for layers in quick_profile.layers.values() for layer in layers)
    back = Profile.load(quick_profile.save(tmp_path / "p.json"))
    assert [l.cold_forward_s for l in back.layers[LLM]] == [l.cold_forward_s for l in quick_profile.layers[LLM]]
    old = quick_profile.to_dict()
    for layers in old["layers"].values():
        for layer in layers:
            del layer["cold_forward_s"], layer["cold_backward_s"]
    assert all(l.cold_forward_s == 0.0 == l.cold_backward_s for l in Profile.from_dict(old).layers[LLM])


def test_cold_start_of_a_stage_sums_the_layers_it_runs(quick_profile: Profile):
    """`ProfiledCostModel.cold_start_time`: a stage's forward pays its layers' cold forwards, a
    backward those of the layers that back-propagate (a frozen LLM after a trainable projector:
    the input part only; a frozen model: none), a recomputing backward their forwards too."""
    prof = Profile.from_dict(quick_profile.to_dict())
    for m, layers in prof.layers.items():
        for i, layer in enumerate(layers):
            layer.cold_forward_s, layer.cold_backward_s = 1.0 + i, 10.0 * (1 + i)
    plan = lambda recompute="none": Plan([ModuleSpec("vision"), ModuleSpec(LLM, num_stages=2, recompute=recompute)],
                                         num_microbatches=2)
    cost = ProfiledCostModel(prof, tiny_model(), plan())
    start, end = cost.plan.layers_of(LLM, 1)
    forward = sum(1.0 + i for i in range(start, end))
    backward = sum(10.0 * (1 + i) for i in range(start, end))
    assert cost.cold_start_time(LLM, 1, "forward") == pytest.approx(forward)
    for kind in ("backward", "backward_input", "backward_weight"):
        assert cost.cold_start_time(LLM, 1, kind) == pytest.approx(backward)
    again = ProfiledCostModel(prof, tiny_model(), plan("full"))
    assert again.cold_start_time(LLM, 1, "backward") == pytest.approx(backward + forward)
    assert again.cold_start_time(LLM, 1, "backward_weight") == pytest.approx(backward)
    proj = ProfiledCostModel(prof, tiny_model(freeze=["vision.encoder", "llm"]), plan())
    assert proj.cold_start_time(LLM, 1, "backward_input") == pytest.approx(backward)
    assert proj.cold_start_time(LLM, 1, "backward_weight") == 0.0
    frozen = ProfiledCostModel(prof, tiny_model(freeze=["vision", "llm"]), plan())
    assert frozen.cold_start_time(LLM, 1, "backward") == 0.0
    assert frozen.cold_start_time(LLM, 1, "forward") == pytest.approx(forward)


def test_backward_by_layer_splits_one_backward_at_the_layer_outputs():
    """`backward_by_layer` reads a chained backward per layer with hooks on the outputs: a time
    per layer, none negative, summing to at most the call; a layer whose input carries no
    gradient (the first one's output is not a float tensor here) gets 0."""
    from loom.profile.layers import backward_by_layer

    torch.manual_seed(0)
    w = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]
    x = torch.randn(4, 16)
    outputs, h = [], x
    for k in range(3):
        h = torch.tanh(h @ w[k])
        outputs.append(h)
    times = backward_by_layer(outputs, lambda: outputs[-1].sum().backward())
    assert len(times) == 3 and all(t >= 0 for t in times) and times[0] > 0
    assert all(v.grad is not None for v in w)
    h = torch.tanh(x @ w[0]).detach()  # layer 0's output carries no gradient: layer 1's input has no hook
    outputs = [h, torch.tanh(h @ w[1]), None]
    outputs[2] = torch.tanh(outputs[1] @ w[2])
    times = backward_by_layer(outputs, lambda: outputs[-1].sum().backward())
    assert times[1] == 0.0 and times[0] > 0 and times[2] > 0
