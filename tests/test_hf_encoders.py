"""Hugging Face vision encoders (SigLIP, CLIP vision) as loom encoders (`loom.model.hf_vision`):
cut into 2 stages they compute the model's own ``last_hidden_state`` and parameter gradients
for images resized to the config's size; in a `MultimodalModel` they feed the LLM through a
projector sized from their config."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.model.hf_vision import HFVisionEncoder, vision_model_from_config  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402
from reference import assert_layerwise_init_equals_whole  # noqa: E402

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
              patch_size=4)


def _encoder(family: str) -> HFVisionEncoder:
    torch.manual_seed(0)
    config = (transformers.SiglipVisionConfig(**VISION) if family == "siglip"
              else transformers.CLIPVisionConfig(**VISION, projection_dim=16))
    model = vision_model_from_config(config)
    for p in model.parameters():  # bend norms away from their init so that a skipped one shows
        p.data.add_(0.05 * torch.randn_like(p))
    return HFVisionEncoder(model)


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_two_stages_equal_the_models_forward_and_gradients(family):
    enc = _encoder(family)
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 16, 24, generator=g), torch.rand(3, 32, 16, generator=g)]
    inputs = {"images": images}
    pixels = enc.context(inputs)["pixel_values"]
    reference = enc.model(pixel_values=pixels).last_hidden_state.flatten(0, 1)
    weights = torch.randn(reference.shape, generator=g)
    (reference * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    enc.zero_grad(set_to_none=True)

    layers = enc.layers()
    assert layers[0].kind == "frontend" and enc.num_tokens(None) * 2 == reference.shape[0]
    x = run_layers(layers[:2], None, enc.context(inputs))
    out = run_layers(layers[2:], x, enc.context(inputs))
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    (out * weights).sum().backward()
    assert set(grads) == {n for n, p in enc.named_parameters() if p.grad is not None}
    for name, p in enc.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_in_a_multimodal_model_materialised_per_layer(family):
    from loom.model.multimodal import ModalityEncoder, MultimodalModel
    from loom.model.zoo import LlamaConfig, LlamaForCausalLM

    def build() -> MultimodalModel:
        with torch.device("meta"):
            enc = _encoder(family)
            model = MultimodalModel({"camera": ModalityEncoder(enc, projector="mlp")},
                                    LlamaForCausalLM(LlamaConfig(hidden_size=64)), {"camera": 5})
        model.init_seed = 4
        return model

    a, b = build(), build()
    assert a.encoders["camera"].projector[0].in_features == 32  # from the encoder's config
    assert_layerwise_init_equals_whole(a, b, "camera")
    tokens = a.encoders["camera"](images=[torch.rand(3, 8, 8)])
    assert tokens.shape == (a.encoders["camera"].num_tokens(None), 64)
    empty = a.encoders["camera"](images=[])
    assert empty.shape == (0, 64) and empty.grad_fn is not None


def test_other_models_are_refused():
    with pytest.raises(ValueError, match="not a vision encoder loom adapts"):
        vision_model_from_config(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="not a SigLIP or CLIP"):
        HFVisionEncoder(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)))
