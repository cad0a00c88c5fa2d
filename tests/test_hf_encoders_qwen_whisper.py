"""The Qwen2-VL vision tower and the Whisper encoder as loom encoders (`loom.model.hf_qwen2vl`,
`loom.model.hf_whisper`): cut into 2 stages they compute the model's own output (Qwen2-VL's
merged ``pooler_output`` over images of different sizes, Whisper's ``last_hidden_state``) and
parameter gradients; per-layer materialising equals the whole model's; configurations whose
forward they do not reproduce are refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.model.hf_qwen2vl import Qwen2VLVisionEncoder, patchify, qwen2vl_encoder_from_config  # noqa: E402
from loom.model.hf_whisper import WhisperAudioEncoder, whisper_encoder_from_config  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402
from reference import assert_layerwise_init_equals_whole  # noqa: E402

QWEN = dict(depth=3, embed_dim=32, hidden_size=48, num_heads=4, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2)
WHISPER = dict(d_model=16, encoder_layers=3, encoder_attention_heads=2, encoder_ffn_dim=32, decoder_layers=1,
               decoder_attention_heads=2, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=20,
               vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def qwen_config(**over):
    return transformers.Qwen2VLVisionConfig(**{**QWEN, **over})


def whisper_config(**over):
    return transformers.WhisperConfig(**{**WHISPER, **over})


def _bent(encoder):
    torch.manual_seed(0)
    for p in encoder.parameters():  # move norms and biases off their init so that a skipped one shows
        p.data.add_(0.05 * torch.randn_like(p))
    return encoder


def _check_two_stages(encoder, inputs, reference_fn, cut):
    g = torch.Generator().manual_seed(1)
    reference = reference_fn()
    weights = torch.randn(reference.shape, generator=g)
    (reference * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}
    encoder.zero_grad(set_to_none=True)

    layers = encoder.layers()
    x = run_layers(layers[:cut], None, encoder.context(inputs))
    out = run_layers(layers[cut:], x, encoder.context(inputs))  # each stage builds its own context
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    (out * weights).sum().backward()
    assert grads and set(grads) == {n for n, p in encoder.named_parameters() if p.grad is not None}
    for name, p in encoder.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-5, msg=name)
    return layers


def test_qwen2vl_two_stages_equal_the_models_forward_and_gradients():
    torch.manual_seed(0)
    enc = _bent(qwen2vl_encoder_from_config(transformers.Qwen2VLConfig(vision_config=QWEN)))
    g = torch.Generator().manual_seed(2)
    images = [torch.rand(3, 16, 24, generator=g), torch.rand(3, 8, 8, generator=g), torch.rand(3, 24, 8, generator=g)]
    ctx = enc.context({"images": images})
    assert ctx["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2], [1, 6, 2]]
    layers = _check_two_stages(enc, {"images": images},
                               lambda: enc.model(ctx["pixel_values"], ctx["image_grid_thw"]).pooler_output, cut=2)
    assert [l.kind for l in layers] == ["frontend", "block", "block", "block", "head"]
    assert [l.name for l in layers][::4] == ["model.patch_embed", "model.merger"]
    assert all(a.module is b.module for a, b in zip(layers, enc.layers()))
    # variable token counts per image, from the image size alone
    from loom.data.sample import ImageMeta

    counts = [enc.num_tokens(ImageMeta(*im.shape[1:])) for im in images]
    assert counts == [6, 1, 3] and enc(images=images).shape == (sum(counts), QWEN["hidden_size"])


def test_qwen2vl_patches_are_the_image_processors():
    """Raw images are cut exactly as the Hugging Face processor cuts them (no resize, no
    normalisation), and its output is taken as it is."""
    enc = qwen2vl_encoder_from_config(qwen_config())
    proc = transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, do_resize=False,
                                                 do_rescale=False, do_normalize=False)
    g = torch.Generator().manual_seed(3)
    images = [torch.rand(3, 16, 24, generator=g), torch.rand(3, 8, 16, generator=g)]
    made = proc(images=[im.numpy() for im in images], return_tensors="pt", input_data_format="channels_first")
    ctx = enc.context({"images": images})
    assert torch.equal(ctx["pixel_values"], made["pixel_values"])
    assert torch.equal(ctx["image_grid_thw"], made["image_grid_thw"])
    assert torch.equal(enc(pixel_values=made["pixel_values"], image_grid_thw=made["image_grid_thw"]),
                       enc(images=images))
    assert patchify(images[0], 4, 2, 2).shape == (24, 3 * 2 * 4 * 4)


def test_whisper_two_stages_equal_the_models_forward_and_gradients():
    enc = _bent(whisper_encoder_from_config(whisper_config()))
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(2, 8, 40, generator=g)
    layers = _check_two_stages(enc, {"input_features": feats},
                               lambda: enc.model(feats).last_hidden_state.flatten(0, 1), cut=2)
    assert [l.kind for l in layers] == ["frontend", "block", "block", "block", "norm"]
    # the front-end's parameters keep the model's names; the positions stay frozen, as in the model
    assert {n for n, _ in layers[0].module.named_parameters()} == {
        "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "embed_positions.weight"}
    assert enc.num_tokens(None) == 20 and not enc.model.embed_positions.weight.requires_grad
    # the same modules at every call: runtimes tell a stage's layers apart by module identity
    assert all(a.module is b.module for a, b in zip(enc.layers(), enc.layers()))
    assert all(a.module is b.module for a, b in zip(layers, enc.layers()))


@pytest.mark.parametrize("family", ["qwen2vl", "whisper"])
def test_in_a_multimodal_model_materialised_per_layer(family):
    from loom.model.multimodal import ModalityEncoder, MultimodalModel
    from loom.model.zoo import LlamaConfig, LlamaForCausalLM

    def build() -> MultimodalModel:
        with torch.device("meta"):
            enc = (qwen2vl_encoder_from_config(qwen_config()) if family == "qwen2vl"
                   else whisper_encoder_from_config(whisper_config()))
            model = MultimodalModel({"media": ModalityEncoder(enc, projector="mlp")},
                                    LlamaForCausalLM(LlamaConfig(hidden_size=64)), {"media": 5})
        model.init_seed = 4
        return model

    a, b = build(), build()
    assert_layerwise_init_equals_whole(a, b, "media")
    enc = a.encoders["media"]
    if family == "qwen2vl":
        # the rotary table, a context module, is recomputed (to_empty leaves it garbage)
        fresh = qwen2vl_encoder_from_config(qwen_config()).model.rotary_pos_emb.inv_freq
        assert torch.equal(enc.encoder.model.rotary_pos_emb.inv_freq, fresh)
        out, empty = enc(images=[torch.rand(3, 16, 8)]), enc(images=[])
        assert out.shape == (2, 64)
    else:
        from transformers.models.whisper.modeling_whisper import sinusoids

        assert torch.equal(enc.encoder.model.embed_positions.weight, sinusoids(20, 16))
        out, empty = enc(input_features=torch.randn(1, 8, 40)), enc(waveforms=[])
        assert out.shape == (20, 64)
    assert empty.shape == (0, 64) and empty.grad_fn is not None


def test_what_the_adapters_do_not_reproduce_is_refused():
    with pytest.raises(ValueError, match="encoder_layerdrop = 0.1"):
        whisper_encoder_from_config(whisper_config(encoder_layerdrop=0.1))
    with pytest.raises(ValueError, match="dropout = 0.1"):
        whisper_encoder_from_config(whisper_config(dropout=0.1))
    enc = whisper_encoder_from_config(whisper_config())
    with pytest.raises(ValueError, match="not waveforms"):
        enc.context({"waveforms": [torch.zeros(100)]})
    with pytest.raises(ValueError, match=r"2 \* max_source_positions = 40"):
        enc.context({"input_features": torch.zeros(1, 8, 30)})
    qwen = qwen2vl_encoder_from_config(qwen_config())
    with pytest.raises(ValueError, match="multiples of patch_size \\* spatial_merge_size = 8"):
        qwen.context({"images": [torch.rand(3, 12, 8)]})
    with pytest.raises(ValueError, match="not a Qwen2-VL vision config"):
        qwen2vl_encoder_from_config(whisper_config())
    with pytest.raises(ValueError, match="not the Qwen2-VL vision tower"):
        Qwen2VLVisionEncoder(enc.model)
    with pytest.raises(ValueError, match="not a Whisper encoder"):
        WhisperAudioEncoder(qwen.model)


@pytest.mark.parametrize("family", ["qwen2vl", "whisper"])
def test_registered_and_loaded_from_a_full_models_checkpoint(family, tmp_path):
    """``[model.<name>] hf = DIR`` of a whole Qwen2-VL / Whisper model: the registry builds its
    vision tower / encoder, and each layer reads its tensors from the checkpoint by name."""
    from loom.model.hf_encoders import encoder_from_config, encoder_weights, load_encoder_config
    from loom.model.multimodal import ModalityEncoder, MultimodalModel
    from loom.model.zoo import LlamaConfig, LlamaForCausalLM

    if family == "whisper":
        full, inside = transformers.WhisperForConditionalGeneration(whisper_config()), "model.encoder."
    else:
        text = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 1e4})
        full = transformers.Qwen2VLForConditionalGeneration(
            transformers.Qwen2VLConfig(vision_config=QWEN, text_config=text))
        inside = "model.visual."
    full.save_pretrained(tmp_path)
    with torch.device("meta"):
        enc = encoder_from_config(load_encoder_config(tmp_path))
        model = MultimodalModel({"media": ModalityEncoder(enc, projector="linear")},
                                LlamaForCausalLM(LlamaConfig(hidden_size=64)), {"media": 5})
    assert isinstance(enc, WhisperAudioEncoder if family == "whisper" else Qwen2VLVisionEncoder)
    model.pretrained["media"] = encoder_weights(tmp_path)
    model.materialise("media", "cpu")
    saved = full.state_dict()
    loaded = model.encoders["media"].encoder.model.state_dict()
    assert loaded and all(torch.equal(v, saved[inside + k]) for k, v in loaded.items())
