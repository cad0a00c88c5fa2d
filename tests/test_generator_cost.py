"""Generators in the cost model and the simulator (issue 11, item 4; disttrain.md §1, §3.1):
layer descriptions that count the real parameters, FLOPs that follow image resolution, the
generator's workload and the LLM's longer sequence from metadata, the frozen-aware rule across
the LLM -> generator edge, and `loom simulate` pricing DistTrain's disaggregated layout next to
the Megatron-style one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loom.cost.arch import LayerArch, ModelArch
from loom.cost.arch_from_model import arch_from_model
from loom.cost.flops import layer_flops, model_flops
from loom.cost.frozen import backward_needs
from loom.cost.model import Workload
from loom.cost.model_configs import load_model_arch, load_module_config
from loom.cost.workload import WorkloadError, sample_tokens, sample_work
from loom.data.collate import count_tokens
from loom.data.demo import DemoConfig
from loom.data.sample import GenerationMeta, ImageMeta, SampleMeta
from loom.model.zoo import LlamaConfig, VisionConfig
from loom.model.zoo.diffusion import DiffusionConfig
from loom.plan.plan import LLM
from loom.sim.scenario import load_scenario
from loom.train.build import build_data, build_model, generation_specs, token_counters
from loom.train.config import ModelConfig, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "configs/sim/disttrain-mllm9b-sd21-96xh100.toml"


def test_sd21_unet_counts_its_published_parameters_layer_for_layer():
    """configs/models/sd21-unet.toml, assembled by `unet_layers`, has exactly the released
    UNet2DConditionModel's 865,910,724 parameters (its down, mid and up blocks as diffusers lays
    them out), and its forward at 512x512 is the ~0.8 TFLOPs the model is known for."""
    cfg = load_module_config("sd21-unet")
    arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"}, "mlp", generators={"image": "sd21-unet"})
    unet = arch.module("image")
    assert arch.module_names == ["vision", LLM, "image"] and arch.generator_names == ["image"]
    assert sum(l.params for l in unet.layers[1:]) == cfg.published_params == 865_910_724
    assert unet.layers[0].kind == "projector" and unet.layers[0].cond == 77
    assert {l.scale for l in unet.layers} == {1, 2, 4, 8}  # four resolution levels
    latents = 64 * 64  # a 512x512 image through the VAE's factor 8
    forward = sum(layer_flops(l, Workload(latents, latents**2, 1)).forward for l in unet.layers)
    assert 0.7e12 < forward < 0.9e12


def test_generator_flops_follow_image_resolution():
    """The same U-Net at 1024x1024 costs more than 4x its 512x512 forward (4x the positions, and
    self-attention quadratic in them); a DiT block's cross-attention and per-item work scale with
    the items, its self-attention with their positions squared."""
    arch = load_model_arch("llama3-8b", generators={"image": "sd21-unet"})
    unet = arch.module("image")

    def forward(side: int, items: int = 1) -> float:
        n = (side // unet.patch) ** 2
        return sum(layer_flops(l, Workload(items * n, items * n * n, items)).forward for l in unet.layers)

    assert forward(1024) > 4.5 * forward(512)
    assert forward(512, items=3) == pytest.approx(3 * forward(512))
    block = LayerArch("b", "block", 64, heads=4, kv_heads=4, ffn=256, cross=64, cond=4)
    one, two = (layer_flops(block, Workload(16 * k, 256 * k, k)).forward for k in (1, 2))
    assert two == pytest.approx(2 * one)  # per item: linear in items at a fixed resolution
    coarse = dataclasses.replace(block, scale=2)
    assert layer_flops(coarse, Workload(64, 64**2, 1)).forward == pytest.approx(
        layer_flops(block, Workload(16, 16**2, 1)).forward)  # a 2x coarser grid: a quarter of the positions


def _tiny_config() -> TrainConfig:
    model = ModelConfig(vision=VisionConfig(hidden_size=32, num_layers=1, num_heads=2), audio=None,
                        llm=LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
                        generator=DiffusionConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2,
                                                  num_heads=2, cond_tokens=3))
    cfg = TrainConfig(model=model)
    cfg.data = dataclasses.replace(cfg.data, demo=DemoConfig(num_samples=32, seed=1,
                                                             mix={"text": 0.2, "image": 0.3, "generate": 0.5}))
    return cfg


def test_the_zoo_generators_description_and_workload_come_from_metadata():
    """`arch_from_model` describes the zoo DiT behind its projector layer for layer (it checks
    every layer's parameter count against the module); per sample, the generator's work is its
    requests' patches and the LLM's sequence gains cond_tokens - 1 positions per request, as
    collation expands them, in both the list and the array rule."""
    cfg = _tiny_config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer)
    arch = arch_from_model(model)
    assert arch.module_names == ["vision", LLM, "image"]
    assert [l.kind for l in arch.module("image").layers] == ["projector", "frontend", "block", "block", "conv"]
    metas = [dataset.meta(i) for i in range(16)]
    assert any(m.generations for m in metas)
    counts = token_counters(model)
    lengths = [count_tokens(m, counts, generation_specs(model))[LLM] for m in metas]
    assert sample_tokens(arch, metas).tokens[LLM].tolist() == lengths
    patches = (16 // 4) ** 2
    for m in metas:
        work = sample_work(arch, [m])
        assert work["image"] == Workload.of_lengths([patches] * len(m.generations))
        assert work[LLM].tokens == count_tokens(m, counts, generation_specs(model))[LLM]
    assert sample_tokens(arch, metas).tokens["image"].tolist() == [patches * len(m.generations) for m in metas]


def test_requests_for_a_generator_the_model_lacks_are_refused_by_name():
    arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    meta = SampleMeta(7, 20, (ImageMeta(224, 224),), (), ("image", "text", "generate"),
                      (GenerationMeta("image", 512, 512),))
    for rule in (sample_work, sample_tokens):
        with pytest.raises(WorkloadError, match=r"asks generators \['image'\].*no generator"):
            rule(arch, [meta])


def test_the_frozen_rule_carries_across_the_llm_into_the_generator():
    """A generator starts from the LLM's propagation flag (cornstarch.md §3.2.2 across
    DistTrain's LLM -> generator edge): with the LLM trainable, a frozen generator still passes
    input gradients back; with everything before it frozen, only its trainable projector's
    weights and what follows it in the chain run backward."""
    base = load_model_arch("llama3-8b", {"vision": "vit-h-14"}, generators={"image": "sd21-unet"})
    needs = backward_needs(base.with_freeze(["image.generator", "vision"]))
    gen = needs["image"]
    assert gen[0].weight and gen[0].input  # the projector trains and feeds the LLM's gradient
    assert all(n.input and not n.weight for n in gen[1:])
    needs = backward_needs(base.with_freeze(["vision", "llm", "image.generator"]))
    assert not any(n.any for n in needs[LLM])
    assert needs["image"][0] == needs["image"][0].__class__(weight=True, input=False)  # nothing upstream trains
    assert all(n.input and not n.weight for n in needs["image"][1:])
    with pytest.raises(ValueError, match=r"after 'image' use '.generator' or '.projector'"):
        base.with_freeze(["image.encoder"])


def test_model_arch_keeps_encoders_before_and_generators_after_the_llm():
    arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"}, generators={"image": "sd21-unet"})
    m = arch.modules
    with pytest.raises(ValueError, match="out of place"):
        ModelArch({"image": m["image"], LLM: m[LLM]})
    with pytest.raises(ValueError, match="out of place"):
        ModelArch({LLM: m[LLM], "vision": m["vision"]})
    assert model_flops(arch, {"image": Workload(4096, 4096**2, 1)}) > 0


def test_simulate_prices_disttrain_next_to_megatron_style():
    """The bundled DistTrain scenario: the Megatron-style plan puts the encoder and the generator
    at the LLM's TP and DP (extra stages, replicated over TP), the file's disaggregated plan gives
    each module its own GPUs and degrees; the simulator prices both, the generator's stage and
    the LLM -> generator transfers included, and the disaggregated one is faster (the paper's
    finding, here from the cost model)."""
    from loom.planner.baselines import megatron_plan

    scenario = load_scenario(SCENARIO)
    mega = megatron_plan(scenario)
    assert [(m.name, m.tensor_parallel, m.data_parallel) for m in mega.modules] == [
        ("vision", 8, 4), (LLM, 8, 4), ("image", 8, 4)]
    results = {name: scenario.run(plan) for name, plan in (("megatron", mega),
                                                            ("disaggregated", scenario.plans["disaggregated"]))}
    for r in results.values():
        kinds = {(e.module, e.kind) for e in r.timeline}
        assert ("image", "forward") in kinds and ("image", "backward") in kinds
        assert any(e.module == LLM and e.kind == "send_act" for e in r.timeline)
    assert results["disaggregated"].samples_per_s > 1.3 * results["megatron"].samples_per_s
    # the conditioning states, not the LLM's vocabulary-wide logits, cross the LLM -> generator edge
    plan = scenario.plans["disaggregated"]
    cost = scenario.cost_model(plan)
    work = Workload(4096, 4096**2, 1)
    last_llm = plan.unit_of(LLM, 0, 0)
    first_gen = plan.unit_of("image", 0, 0)
    t = cost.condition_transfer_time(last_llm, first_gen, "image", work)
    assert 0 < t < cost.transfer_time(last_llm, first_gen, LLM, 0, Workload(4096, 4096**2, 1))
