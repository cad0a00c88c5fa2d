"""The Hugging Face layer adapter: an unmodified HF causal LM cut into stages computes the same
logits and gradients as the HF model itself."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from loom.model import hf  # noqa: E402
from loom.model.adapter import adapter_for as layers_adapter_for  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def make_llama(attn_implementation: str = "sdpa", **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **overrides}, attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)


def input_ids(batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def run_in_stages(adapter, inputs: dict, boundaries: list[int]) -> torch.Tensor:
    """Run the layer list as consecutive stages, each rebuilding the context from the inputs."""
    layers = adapter.layers()
    x = None
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        x = run_layers(layers[start:end], x, adapter.context(inputs))
    return x


def test_adapter_layers_and_attributes():
    model = make_llama()
    adapter = hf.adapter_for(model)
    assert isinstance(adapter, hf.HFCausalLMAdapter)
    assert layers_adapter_for(model) is not None  # loom.model.layers dispatches here
    assert adapter.hidden_size == 64 and adapter.vocab_size == 128
    names = [layer.name for layer in adapter.layers()]
    assert names == ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(4)] + ["model.norm", "lm_head"]
    assert [layer.kind for layer in adapter.layers()] == ["embedding"] + ["block"] * 4 + ["norm", "head"]
    assert adapter.num_layers == 7
    for layer in adapter.layers():
        assert model.get_submodule(layer.name) is layer.module


@pytest.mark.parametrize("boundary", range(1, 7))
def test_two_stage_logits_and_gradients_equal_hf(boundary):
    model = make_llama()
    adapter = hf.adapter_for(model)
    ids = input_ids()
    targets = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(2))

    reference = model(ids).logits
    nn.functional.cross_entropy(reference.flatten(0, 1), targets.flatten()).backward()
    reference_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    logits = run_in_stages(adapter, {"input_ids": ids}, [0, boundary, adapter.num_layers])
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference_grads[name], rtol=0, atol=1e-5, msg=name)


def test_parameter_names_cover_named_parameters():
    model = make_llama()
    adapter = hf.adapter_for(model)
    names = [f"{layer.name}.{p}" for layer in adapter.layers() for p, _ in layer.module.named_parameters()]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_padding_mask_and_eager_attention():
    # The mask argument must keep the model causal for every attention implementation; with
    # eager attention a missing mask would silently attend to the future.
    ids = input_ids()
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding in the second row
    for implementation in ("sdpa", "eager"):
        model = make_llama(implementation)
        adapter = hf.adapter_for(model)
        with torch.no_grad():
            for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": padding}):
                reference = model(**inputs).logits
                logits = run_in_stages(adapter, inputs, [0, 3, 5, adapter.num_layers])
                torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_causal():
    model = make_llama("eager")
    adapter = hf.adapter_for(model)
    ids = input_ids()
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 128
    with torch.no_grad():
        before = run_in_stages(adapter, {"input_ids": ids}, [0, 7])
        after = run_in_stages(adapter, {"input_ids": changed}, [0, 7])
    torch.testing.assert_close(before[:, :6], after[:, :6], rtol=0, atol=0)
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_fallback_mask_without_masking_utils(monkeypatch):
    # transformers < 4.53 has no masking_utils: the adapter then builds a 4D additive mask.
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    for implementation in ("sdpa", "eager"):
        model = make_llama(implementation)
        adapter = hf.adapter_for(model)
        ids = input_ids()
        ctx = adapter.context({"input_ids": ids})
        assert ctx["attention_masks"]["full_attention"].shape == (2, 1, 10, 10)
        with torch.no_grad():
            logits = run_layers(adapter.layers(), None, ctx)
        monkeypatch.undo()
        with torch.no_grad():
            reference = model(ids).logits
        monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_same_layout_families(family):
    # Mistral and Qwen2 share the Llama layout; their sliding-window layers get their own mask.
    torch.manual_seed(0)
    if family == "mistral":
        config = transformers.MistralConfig(**TINY, sliding_window=4, attn_implementation="sdpa")
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=4, max_window_layers=2, attn_implementation="sdpa"
        )
        model = transformers.Qwen2ForCausalLM(config)
    adapter = hf.adapter_for(model)
    assert adapter is not None
    ids = input_ids()
    with torch.no_grad():
        reference = model(ids).logits
        logits = run_in_stages(adapter, {"input_ids": ids}, [0, 2, adapter.num_layers])
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_tied_embeddings_are_one_parameter_of_two_layers():
    # kept tied: MultimodalModel materialises the tie, loom.runtime.tied syncs it across stages
    model = make_llama(tie_word_embeddings=True)
    layers = hf.adapter_for(model).layers()
    assert layers[0].module.weight is layers[-1].module.weight


def test_other_modules_get_no_adapter():
    assert hf.adapter_for(nn.Linear(4, 4)) is None
    assert hf.adapter_for(nn.Sequential(nn.Linear(4, 4))) is None
    with pytest.raises(TypeError, match="no layer adapter"):
        layers_adapter_for(nn.Linear(4, 4))


def test_meta_build_materialised_layer_by_layer_equals_hf():
    """Per-stage initialisation of an HF model: built on meta, each layer materialised through
    the model's own ``_init_weights`` under its seed, the rotary tables recomputed; it then
    computes what HF computes with the same weights, and the order of layers does not matter."""
    from loom.model.multimodal import MultimodalModel

    config = transformers.LlamaConfig(**TINY, attn_implementation="sdpa")

    def meta_model() -> MultimodalModel:
        with torch.device("meta"):
            model = MultimodalModel({}, transformers.LlamaForCausalLM(config), {})
        model.init_seed = 5
        return model

    model = meta_model()
    count = len(model.module_layers("llm"))
    for index in reversed(range(count)):
        model.materialise("llm", "cpu", index, index + 1)
    llm = model.llm
    assert not any(t.is_meta for t in (*llm.parameters(), *llm.buffers()))
    at_once = meta_model()
    at_once.materialise("llm", "cpu")
    for key, value in llm.state_dict().items():
        assert torch.equal(value, at_once.llm.state_dict()[key]), key
    # HF's init: N(0, initializer_range) linears and embeddings, norms at one
    assert llm.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.15)
    assert torch.equal(llm.model.layers[2].input_layernorm.weight, torch.ones(TINY["hidden_size"]))

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(llm.state_dict())
    torch.testing.assert_close(llm.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(llm(ids).logits, reference(ids).logits, rtol=0, atol=0)
