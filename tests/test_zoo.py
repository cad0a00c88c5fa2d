"""The tiny model zoo: token counts from metadata, the layer-list contract, isolation of packed
items, causality, and parameter naming."""

from __future__ import annotations

import itertools

import pytest
import torch

from loom.data.sample import AudioMeta, ImageMeta
from loom.model.adapter import adapter_for
from loom.model.layers import LayerAdapter, run_layers
from loom.model.zoo import (
    AudioConfig,
    AudioEncoder,
    LlamaConfig,
    LlamaForCausalLM,
    VisionConfig,
    VisionEncoder,
)


def make_vision() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(VisionConfig())


def make_audio() -> AudioEncoder:
    torch.manual_seed(0)
    return AudioEncoder(AudioConfig())


def make_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig())


def vision_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    sizes = [(16, 24), (8, 8), (32, 16)]
    return {"images": [torch.rand(3, h, w, generator=g) for h, w in sizes]}


def audio_inputs() -> dict:
    g = torch.Generator().manual_seed(2)
    return {"waveforms": [torch.randn(1000, generator=g), torch.randn(300, generator=g), torch.randn(50, generator=g)]}


def llama_inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 256, (2, 12), generator=g)}


MODELS = {
    "vision": (make_vision, vision_inputs),
    "audio": (make_audio, audio_inputs),
    "llama": (make_llama, llama_inputs),
}


def all_cuts(num_layers: int, max_stages: int = 3) -> list[list[int]]:
    """Every way to cut ``num_layers`` layers into 2 .. ``max_stages`` non-empty stages, as
    lists of boundaries (including 0 and num_layers)."""
    cuts = []
    for num_stages in range(2, max_stages + 1):
        for inner in itertools.combinations(range(1, num_layers), num_stages - 1):
            cuts.append([0, *inner, num_layers])
    return cuts


@pytest.mark.parametrize("name", sorted(MODELS))
def test_implements_layer_adapter(name):
    make, _ = MODELS[name]
    model = make()
    assert isinstance(model, LayerAdapter)
    assert adapter_for(model) is model
    assert model.num_layers == len(model.layers())
    assert isinstance(model.hidden_size, int)
    kinds = [layer.kind for layer in model.layers()]
    assert kinds[0] in ("frontend", "embedding")
    assert kinds[-1] in ("norm", "head")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_equals_every_cut(name):
    make, make_inputs = MODELS[name]
    model = make()
    inputs = make_inputs()
    with torch.no_grad():
        reference = model(**inputs)
        layers = model.layers()
        for cut in all_cuts(len(layers)):
            x = None
            for start, end in zip(cut[:-1], cut[1:]):
                # Each stage rebuilds the context from the raw inputs, as a pipeline stage does.
                x = run_layers(layers[start:end], x, model.context(inputs))
            torch.testing.assert_close(x, reference, rtol=0, atol=0, msg=f"cut {cut}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_and_parameter_names_cover_named_parameters(name):
    make, _ = MODELS[name]
    model = make()
    names = []
    for layer in model.layers():
        assert model.get_submodule(layer.name) is layer.module
        names += [f"{layer.name}.{p}" for p, _ in layer.module.named_parameters()]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_construction_is_deterministic(name):
    make, _ = MODELS[name]
    a, b = make().state_dict(), make().state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", sorted(MODELS))
def test_backward_reaches_every_parameter(name):
    make, make_inputs = MODELS[name]
    model = make()
    model(**make_inputs()).square().mean().backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname


# --- vision ----------------------------------------------------------------------------------


def test_vision_token_counts_follow_metadata():
    model = make_vision()
    sizes = [(8, 8), (16, 24), (32, 8), (40, 48), (64, 64)]
    images = [torch.rand(3, h, w) for h, w in sizes]
    expected = [model.num_tokens(ImageMeta(height=h, width=w)) for h, w in sizes]
    assert expected == [(h // 8) * (w // 8) for h, w in sizes]
    for img, n in zip(images, expected):
        assert model(images=[img]).shape == (n, model.hidden_size)
    assert model(images=images).shape == (sum(expected), model.hidden_size)


def test_vision_images_are_isolated():
    model = make_vision()
    g = torch.Generator().manual_seed(5)
    a, b = torch.rand(3, 16, 24, generator=g), torch.rand(3, 24, 8, generator=g)
    n_a = model.num_tokens(ImageMeta(16, 24))
    with torch.no_grad():
        alone = model(images=[a])
        first = model(images=[a, b])
        second = model(images=[b, a])
    torch.testing.assert_close(first[:n_a], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[-n_a:], alone, rtol=1e-5, atol=1e-5)


def test_vision_positions_distinguish_patches():
    # Identical patches at different (row, col) must not get identical outputs.
    model = make_vision()
    with torch.no_grad():
        out = model(images=[torch.ones(3, 16, 16)])
    assert not torch.allclose(out[0], out[1])
    assert not torch.allclose(out[0], out[2])


def test_vision_empty_input():
    model = make_vision()
    out = model(images=[])
    assert out.shape == (0, model.hidden_size)
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()  # no crash; every gradient is zero
    assert model.patch_embed.proj.weight.grad is not None


def test_vision_rejects_bad_image_size():
    model = make_vision()
    with pytest.raises(ValueError, match=r"images\[1\].*\(3, 16, 12\).*patch size 8"):
        model(images=[torch.rand(3, 16, 16), torch.rand(3, 16, 12)])
    with pytest.raises(ValueError, match="patch size 8"):
        model.num_tokens(ImageMeta(height=10, width=16))
    with pytest.raises(ValueError, match=r"images\[0\]"):
        model(images=[torch.rand(1, 16, 16)])


# --- audio -----------------------------------------------------------------------------------


def test_audio_token_counts_follow_metadata():
    model = make_audio()
    for num_samples in [0, 1, 127, 128, 129, 255, 256, 257, 1000, 4000, 8000]:
        n = model.num_tokens(AudioMeta(num_samples=num_samples, sample_rate=8000))
        frames = 1 + num_samples // 128
        assert n == (frames - 1) // 2 + 1
        assert model(waveforms=[torch.randn(num_samples)]).shape == (n, model.hidden_size), num_samples


def test_audio_rejects_other_sample_rate():
    model = make_audio()
    with pytest.raises(ValueError, match="16000 Hz"):
        model.num_tokens(AudioMeta(num_samples=16000, sample_rate=16000))


def test_audio_clips_are_isolated():
    model = make_audio()
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(900, generator=g), torch.randn(2000, generator=g)
    n_a = model.num_tokens(AudioMeta(900, 8000))
    with torch.no_grad():
        alone = model(waveforms=[a])
        first = model(waveforms=[a, b])
        second = model(waveforms=[b, a])
    torch.testing.assert_close(first[:n_a], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[-n_a:], alone, rtol=1e-5, atol=1e-5)


def test_audio_empty_input():
    model = make_audio()
    out = model(waveforms=[])
    assert out.shape == (0, model.hidden_size)
    assert out.grad_fn is not None
    out.sum().backward()


def test_audio_mel_filterbank_is_a_non_persistent_buffer():
    model = make_audio()
    filters = model.frontend.mel_filters
    assert filters.shape == (32, 256 // 2 + 1)
    assert "frontend.mel_filters" not in model.state_dict()
    assert (filters >= 0).all() and (filters.max(dim=1).values > 0).all()  # every filter covers some bin


# --- llama -----------------------------------------------------------------------------------


def test_llama_shapes():
    model = make_llama()
    logits = model(**llama_inputs())
    assert logits.shape == (2, 12, 256)
    assert model.vocab_size == 256 and model.hidden_size == 64
    kinds = [layer.kind for layer in model.layers()]
    assert kinds == ["embedding"] + ["block"] * 4 + ["norm", "head"]


def test_llama_is_causal():
    model = make_llama()
    ids = llama_inputs()["input_ids"]
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    with torch.no_grad():
        before, after = model(input_ids=ids), model(input_ids=changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_llama_embedding_ignores_x():
    model = make_llama()
    inputs = llama_inputs()
    embed = model.layers()[0]
    ctx = model.context(inputs)
    torch.testing.assert_close(embed(None, ctx), embed(torch.zeros(1), ctx))


def test_llama_rejects_too_long_input():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(input_ids=torch.zeros(1, 9, dtype=torch.long))


def test_llama_matches_hugging_face_llama():
    # Same parameter names and the same math as HF's LlamaForCausalLM: the state dict loads as is.
    transformers = pytest.importorskip("transformers")
    model = make_llama()
    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    hf_model = transformers.LlamaForCausalLM(hf_config)
    hf_model.load_state_dict(model.state_dict(), strict=True)
    ids = llama_inputs()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids), hf_model(ids).logits, rtol=1e-5, atol=1e-5)


# --- device ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_matches_cpu(name):
    make, make_inputs = MODELS[name]
    model = make()
    inputs = make_inputs()
    with torch.no_grad():
        reference = model(**inputs)
        model.cuda()
        cuda_inputs = {k: [t.cuda() for t in v] if isinstance(v, list) else v.cuda() for k, v in inputs.items()}
        out = model(**cuda_inputs)
        empty_key = next(iter(inputs))
        if name != "llama":
            assert model(**{empty_key: []}).device.type == "cuda"
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-3, atol=1e-3)


def test_segment_attention_equals_the_block_diagonal_mask() -> None:
    """Per-segment attention (what the encoders run) equals dense attention under the
    block-diagonal mask, for mixed and repeated lengths and empty segments."""
    import torch.nn.functional as F

    from loom.model.zoo.attention import block_diagonal_mask, segment_attention

    torch.manual_seed(0)
    lengths = [4, 9, 4, 0, 1, 9, 16]
    n = sum(lengths)
    q, k, v = (torch.randn(3, n, 8) for _ in range(3))
    dense = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=block_diagonal_mask(lengths, "cpu")).squeeze(0)
    torch.testing.assert_close(segment_attention(q, k, v, lengths), dense, rtol=1e-5, atol=1e-6)
