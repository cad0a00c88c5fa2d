"""Activation checkpointing per module (issue 9 point 6): ``ModuleSpec.recompute`` = "none" |
"selective" | "full", the old boolean refused, the runtime's wrapping (`loom.runtime.recompute`)
equal to the plain model in loss and every gradient (one process, and a pipelined gloo run), and
the cost model and simulator pricing selective between none and full."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.data.collate import collate
from loom.model.layers import run_layers
from loom.model.zoo.attention import AttentionCore
from loom.plan.plan import ModuleSpec, Plan, PlanError
from loom.planner.baselines import megatron_plan
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.runtime.recompute import apply_recompute
from loom.schedule.ir import ActionKind
from loom.sim.scenario import ScenarioError, load_scenario
from loom.train.build import build_data, build_model, token_counters
from reference import assert_matches_reference, save_rank
from reference import global_batch, identity_step, reference_backward
from test_parallel_reference import GLOBAL_BATCH, SEED, _config

SCENARIO = "configs/sim/llama3-70b-vith-1024xh100.toml"


def _model_and_batch(case: str = "multimodal_1f1b"):
    cfg = _config(case)
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    indices, targets = global_batch(dataset, GLOBAL_BATCH)
    batch = collate([dataset[i] for i in indices], tokenizer, token_counters(model))
    return cfg, model, batch, targets


def _recompute_all(model, cfg, mode: str) -> int:
    return sum(apply_recompute(model.module_layers(m), mode, m) for m in cfg.plan.module_names)


# ---- the field ------------------------------------------------------------------------------------


def test_recompute_takes_a_mode_and_refuses_the_old_boolean():
    assert ModuleSpec("llm").recompute == "none"
    for mode in ("none", "selective", "full"):
        assert Plan.from_dict({"modules": [{"name": "llm", "recompute": mode}]}).modules[0].recompute == mode
    with pytest.raises(PlanError, match=r"plan.modules\['llm'\].recompute = true: .*true is now \"full\""):
        Plan.from_dict({"modules": [{"name": "llm", "recompute": True}]})
    with pytest.raises(PlanError, match=r"recompute = false: .*false is now \"none\""):
        ModuleSpec("vision", recompute=False)
    with pytest.raises(PlanError, match=r"recompute = 'attention'"):
        ModuleSpec("vision", recompute="attention")
    # the plan's TOML writes the mode back
    plan = Plan([ModuleSpec("llm", recompute="selective")])
    assert 'recompute = "selective"' in plan.to_toml()
    with pytest.raises(ScenarioError, match=r"parallel.recompute = true: .*true is now \"full\""):
        load_scenario(SCENARIO, ["parallel.recompute=true"])
    with pytest.raises(ScenarioError, match=r"parallel.recompute = 'some'"):
        load_scenario(SCENARIO, ['parallel.recompute="some"'])


# ---- the runtime, one process ---------------------------------------------------------------------


def test_modes_wrap_blocks_or_attention_cores_and_keep_values(monkeypatch):
    calls = {"core": 0}
    plain_forward = AttentionCore.forward

    def counting(self, *args, **kwargs):
        calls["core"] += 1
        return plain_forward(self, *args, **kwargs)

    monkeypatch.setattr(AttentionCore, "forward", counting)
    results = {}
    for mode in ("none", "selective", "full"):
        cfg, model, batch, targets = _model_and_batch()
        wrapped = _recompute_all(model, cfg, mode)
        blocks = sum(1 for m in cfg.plan.module_names for l in model.module_layers(m) if l.kind == "block")
        assert wrapped == (0 if mode == "none" else blocks)  # one core per block
        assert _recompute_all(model, cfg, mode) == 0  # applying twice wraps once
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        calls["core"] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss(batch, targets)
        forward_cores = calls["core"]
        loss.backward()
        # the cores run again in the backward under selective and full only
        assert calls["core"] - forward_cores == (0 if mode == "none" else forward_cores), mode
        results[mode] = (float(loss.detach()), sum(saved),
                         {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    loss0, saved0, grads0 = results["none"]
    for mode in ("selective", "full"):
        loss, _, grads = results[mode]
        assert loss == loss0
        assert grads.keys() == grads0.keys()
        for n in grads0:
            torch.testing.assert_close(grads[n], grads0[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{mode} {n}: {m}")
    # bytes kept for the backward: selective drops the attention cores' intermediates, full
    # keeps only the checkpointed blocks' inputs
    assert saved0 > results["selective"][1] > results["full"][1]


def test_split_backward_over_checkpointed_blocks():
    """The executor's split backward on a later encoder stage (entrain.md §3.6): several
    ``backward`` calls over one graph with ``retain_graph``, each with some rows of the output
    gradient; with checkpointed blocks the parts give what they give without checkpointing."""
    grads = {}
    parts = 2
    for mode in ("none", "full", "selective"):
        cfg, model, batch, _ = _model_and_batch()
        _recompute_all(model, cfg, mode)
        layers = model.module_layers("vision")
        out = run_layers(layers, None, model.module_context("vision", batch))
        g = torch.linspace(-1, 1, out.numel()).view_as(out)
        rows = torch.arange(out.shape[0]) % parts
        for p in range(parts):
            torch.autograd.backward(out, g * (rows == p).unsqueeze(-1), retain_graph=p < parts - 1)
        grads[mode] = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    for mode in ("full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{mode} {n}: {m}")


def test_selective_needs_an_attention_core():
    cfg, model, _, _ = _model_and_batch()
    layers = model.module_layers("llm")
    for l in layers:  # a block without the zoo's core (as the Hugging Face adapter's)
        for name, child in list(l.module.named_modules()):
            if isinstance(child, AttentionCore):
                parent = l.module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else l.module
                setattr(parent, name.rsplit(".", 1)[-1], torch.nn.Identity())
    with pytest.raises(PlanError, match=r"plan.modules\['llm'\].recompute = \"selective\": block .* use recompute = \"full\""):
        apply_recompute(layers, "selective", "llm")
    assert apply_recompute(layers, "full", "llm") == cfg.model.llm.num_layers


# ---- the runtime, pipelined on gloo ---------------------------------------------------------------

MODES = {  # two plans in one launch: every module runs both modes somewhere
    "a": {"vision": "full", "audio": "selective", "llm": "selective"},
    "b": {"vision": "selective", "audio": "full", "llm": "full"},
}


def _recompute_config(variant: str):
    cfg = _config("multimodal_1f1b")
    cfg.plan = dataclasses.replace(cfg.plan, modules=[dataclasses.replace(m, recompute=MODES[variant][m.name])
                                                      for m in cfg.plan.modules])
    return cfg


def _recompute_worker(rank: int, world_size: int, out: str) -> None:
    for variant in MODES:
        cfg = _recompute_config(variant)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
        result, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
        wrapped = sum(1 for l in engine.stage.layers for m in l.module.modules() if getattr(m, "_loom_recompute", False))
        save_rank(Path(out) / f"{variant}{rank}.pt", float(loss), engine.stage.named_parameters(), wrapped=wrapped,
                  blocks=sum(l.kind == "block" for l in engine.stage.layers))
        engine.close()


@pytest.mark.multiprocess
def test_pipelined_recompute_matches_the_plain_single_process(tmp_path: Path) -> None:
    world = 4
    run_local(_recompute_worker, world, str(tmp_path))
    cfg = _recompute_config("a")
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)  # no checkpointing: the reference
    loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    for variant in MODES:
        results = [torch.load(tmp_path / f"{variant}{r}.pt", weights_only=True) for r in range(world)]
        # every block of every stage was checkpointed (full) or had its core checkpointed (selective)
        assert all(res["wrapped"] == res["blocks"] for res in results), variant
        assert sum(res["blocks"] for res in results) > 0
        assert_matches_reference(results, model, loss)


# ---- cost model and simulator ---------------------------------------------------------------------


def test_selective_lies_between_none_and_full_in_time_and_memory():
    times, memory, backward = {}, {}, {}
    for mode in ("none", "selective", "full"):
        scenario = load_scenario(SCENARIO, [f'parallel.recompute="{mode}"', "parallel.microbatches_per_pipeline=8"])
        plan = megatron_plan(scenario)
        assert all(m.recompute == mode for m in plan.modules)
        result = scenario.run(plan)
        times[mode], memory[mode] = result.iteration_time, max(result.peak_memory.values())
        work = scenario.microbatch_work(scenario.metas(), plan.num_microbatches)[0]
        from loom.cost.analytic import AnalyticCostModel

        cost = AnalyticCostModel(scenario.arch, plan, scenario.cluster)
        backward[mode] = cost.stage_time("llm", 1, "backward", work["llm"])
    assert backward["none"] < backward["selective"] < backward["full"]
    assert times["none"] < times["selective"] < times["full"]
    assert memory["none"] > memory["selective"] > memory["full"]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_hugging_face_llama_selective_and_full(attn_implementation):
    """Hugging Face Llama blocks through the adapter: selective wraps each attention module's
    attention function (its own config names a checkpointed twin), full the whole block; the
    gradients equal the plain model's and the bytes kept fall from none to selective to full."""
    pytest.importorskip("transformers")
    from test_hf_adapter import input_ids, make_llama, run_in_stages

    from loom.model.adapter import adapter_for

    results = {}
    for mode in ("none", "selective", "full"):
        model = make_llama(attn_implementation)
        adapter = adapter_for(model)
        layers = adapter.layers()
        blocks = sum(l.kind == "block" for l in layers)
        assert apply_recompute(layers, mode, "llm") == (0 if mode == "none" else blocks)
        assert apply_recompute(layers, mode, "llm") == 0  # applying twice wraps once
        assert model.config._attn_implementation == attn_implementation  # the model's masks keep theirs
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_in_stages(adapter, {"input_ids": input_ids()}, [0, 3, len(layers)])
        out.float().pow(2).mean().backward()
        results[mode] = (float(out.detach().sum()), sum(saved),
                         {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for mode in ("selective", "full"):
        assert results[mode][0] == results["none"][0]
        for n, g in results["none"][2].items():
            torch.testing.assert_close(results[mode][2][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{mode} {n}: {m}")
    assert results["none"][1] > results["selective"][1] > results["full"][1]


def _split_backward_worker(rank: int, world_size: int, out: str) -> None:
    """Entrain's balanced step (routed edges, split backward into a 2-stage vision encoder) with
    every vision block checkpointed and the LLM's attention cores checkpointed."""
    from test_balance_runtime import SEED as BALANCE_SEED, _config as balance_config

    from loom.cost.arch_from_model import arch_from_model
    from loom.runtime.dispatch import Dispatcher

    cfg, balance = balance_config("deeppacked-entrain")
    cfg.plan = dataclasses.replace(cfg.plan, modules=[
        dataclasses.replace(m, recompute="full" if m.name == "vision" else "selective") for m in cfg.plan.modules])
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=BALANCE_SEED)
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, token_counters(model), arch_from_model(model), balance,
                            torch.device("cpu"), pack=cfg.data.pack_sequences)
    got = dispatcher.dispatch(list(range(cfg.data.global_batch_size)))
    schedule = engine.schedule_for(got.layout)
    split = sum(1 for a in schedule.actions[rank] if a.samples is not None and a.kind is ActionKind.BACKWARD)
    result = engine.step(got.batches, got.num_targets, 0, layout=got.layout, rows=got.rows)
    loss = torch.tensor([result.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    save_rank(Path(out) / f"rank{rank}.pt", float(loss), engine.stage.named_parameters(), split=split,
              role=cfg.plan.role_of(rank))
    engine.close()


@pytest.mark.multiprocess
def test_split_backward_with_checkpointed_blocks_matches_single_process(tmp_path: Path) -> None:
    from test_balance_runtime import _reference as balance_reference

    run_local(_split_backward_worker, 4, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    # the vision stages really ran split backwards (parts of a microbatch, entrain.md §3.6)
    assert any(r["split"] for r in results if r["role"][0] == "vision")
    model, ref_loss, _ = balance_reference("deeppacked-entrain")
    assert_matches_reference(results, model, ref_loss)
