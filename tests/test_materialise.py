"""Per-layer materialisation (loom.model.materialise): a model built on the meta device gets its
layers' values one layer at a time, each from a seed of (run seed, module, layer index), so a
layer's values do not depend on which other layers are materialised, nor in which order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from loom.model.layers import Layer
from loom.model.materialise import SeededInit, check_untied, is_meta, layer_seed, materialise, reset_parameters
from loom.model.multimodal import MultimodalModel
from loom.model.zoo import AudioConfig, LlamaConfig, LlamaForCausalLM, VisionConfig
from loom.model.zoo.audio import mel_filterbank
from loom.train.build import build_data, build_model
from loom.train.config import ModelConfig, TrainConfig


def _model_config(**kw) -> ModelConfig:
    small = dict(hidden_size=32, num_layers=2, num_heads=2)
    return ModelConfig(vision=VisionConfig(**small), audio=AudioConfig(**small),
                       llm=LlamaConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64),
                       projector="mlp", **kw)


def _build(device: str = "cpu", seed: int = 3, **kw) -> MultimodalModel:
    cfg = TrainConfig(model=_model_config(**kw))
    return build_model(cfg.model, build_data(cfg)[0], seed=seed, device=device)


def _layer_state(model: MultimodalModel, name: str, index: int) -> dict[str, torch.Tensor]:
    layer = model.module_layers(name)[index]
    return {f"{layer.name}.{k}": v for k, v in layer.module.state_dict(keep_vars=False).items()}


def test_meta_build_allocates_nothing_and_keeps_the_global_stream():
    before = torch.random.get_rng_state()
    model = _build("meta")
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    reference = _build("cpu")
    assert not any(p.is_meta for p in reference.parameters())
    # per-layer seeds run under fork_rng: building never moves the caller's random stream
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_layer_has_the_same_values_whatever_else_is_materialised():
    reference = _build("cpu")
    model = _build("meta")
    # one LLM block, then the audio projector, then the vision stem: any subset, any order
    model.materialise("llm", "cpu", 3, 4)
    model.materialise("audio", "cpu", 3, 4)
    model.materialise("vision", "cpu", 0, 1)
    done = {("llm", 3), ("audio", 3), ("vision", 0)}
    for name in model.module_names:
        for index, layer in enumerate(model.module_layers(name)):
            if (name, index) in done:
                for key, value in _layer_state(model, name, index).items():
                    torch.testing.assert_close(value, _layer_state(reference, name, index)[key], rtol=0, atol=0)
            else:
                assert is_meta(layer.module), f"{name} layer {index} was materialised"


def test_seeds_differ_by_run_module_and_layer():
    reference, other_seed = _build("cpu", seed=3), _build("cpu", seed=4)
    blocks = [reference.module_layers("llm")[i].module for i in (1, 2)]
    assert not torch.equal(blocks[0].self_attn.q_proj.weight, blocks[1].self_attn.q_proj.weight)
    assert not torch.equal(blocks[0].self_attn.q_proj.weight,
                           other_seed.module_layers("llm")[1].module.self_attn.q_proj.weight)
    vision, audio = (reference.module_layers(n)[1].module for n in ("vision", "audio"))
    assert not torch.equal(vision.qkv.weight, audio.qkv.weight)  # same shapes, different modules
    assert len({layer_seed(3, m, i) for m in ("llm", "vision") for i in range(4)}) == 8


def test_each_architecture_gets_its_own_init():
    model = _build("cpu")
    llm = model.module_layers("llm")
    block = llm[1].module
    assert block.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)  # Llama: N(0, 0.02)
    assert torch.equal(block.input_layernorm.weight, torch.ones(32))
    assert torch.equal(llm[-2].module.weight, torch.ones(32))  # final RMSNorm
    vit_block = model.module_layers("vision")[1].module
    assert torch.equal(vit_block.attn_norm.weight, torch.ones(32)) and torch.equal(vit_block.attn_norm.bias, torch.zeros(32))
    bound = 1 / 32**0.5  # PyTorch's Linear init (encoders, projectors): |w| <= 1/sqrt(fan_in)
    assert vit_block.qkv.weight.abs().max().item() <= bound and vit_block.qkv.weight.std().item() > bound / 4
    projector = model.module_layers("vision")[-1].module
    assert projector[0].weight.abs().max().item() <= bound


def test_derived_buffers_are_recomputed():
    model = _build("meta")
    frontend = model.module_layers("audio")[0].module
    model.materialise("audio", "cpu", 0, 1)
    cfg = AudioConfig(hidden_size=32, num_layers=2, num_heads=2)
    torch.testing.assert_close(frontend.mel_filters, mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.n_mels), rtol=0, atol=0)


def test_frozen_flags_survive_materialisation():
    model = _build("meta", freeze=["vision.encoder", "llm"])
    model.materialise("vision", "cpu")
    model.materialise("llm", "cpu", 0, 2)
    layers = model.module_layers("vision")
    assert all(not p.requires_grad for layer in layers[:-1] for p in layer.module.parameters())
    assert all(p.requires_grad for p in layers[-1].module.parameters())  # the projector trains
    assert all(not p.requires_grad and not p.is_meta for l in model.module_layers("llm")[:2] for p in l.module.parameters())


def test_a_loader_plugs_into_the_same_seam():
    """What a pretrained-weight loader will be: a `LayerInit` whose ``weights`` copies tensors."""
    reference = _build("cpu")
    model = _build("meta")

    @dataclasses.dataclass
    class CopyFrom:
        source: nn.Module

        def weights(self, module: nn.Module) -> None:
            module.load_state_dict(self.source.state_dict())

        def buffers(self, module: nn.Module) -> None:
            pass

    for layer, source in zip(model.module_layers("llm"), reference.module_layers("llm")):
        materialise(layer, "cpu", CopyFrom(source.module))
    for key, value in model.llm.state_dict().items():
        assert torch.equal(value, reference.llm.state_dict()[key]), key


def test_tied_weights_of_the_llm_stay_tied():
    # a tie between the LLM's layers is declared (MultimodalModel.ties) and kept; any other
    # sharing is refused (check_untied, below)
    with torch.device("meta"):
        llm = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2))
    llm.lm_head.weight = llm.model.embed_tokens.weight
    model = MultimodalModel({}, llm, {})
    model.materialise("llm", "cpu")
    assert llm.lm_head.weight is llm.model.embed_tokens.weight and not llm.lm_head.weight.is_meta


def test_a_module_without_an_init_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(TypeError, match="Scale holds parameters but has no reset_parameters"):
        materialise(Layer("x", module, lambda x, ctx: x), "cpu", SeededInit(0, "m", 0))
    with pytest.raises(TypeError, match="init_layer_weights"):
        reset_parameters(module.to_empty(device="cpu"))


def test_tied_parameters_are_found_across_modules():
    shared = nn.Linear(2, 2)
    a, b = nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2))
    b[0].weight = shared.weight
    layers = {"m": [Layer("a", a, lambda x, ctx: x), Layer("b", b, lambda x, ctx: x)]}
    with pytest.raises(ValueError, match="m: b.0.weight is the same tensor as m: a.0.weight"):
        check_untied(layers)
