"""Every Hugging Face causal-LM family the adapter supports (`loom.model.hf.SUPPORTED_MODEL_TYPES`),
cut into 2 stages, computes the model's own logits and every parameter gradient; what a family's
forward does beyond the decoder loop (Gemma's embedding scale, Gemma2 / Gemma3's final logit
softcap and per-type rotary tables) is reproduced, and an unsupported model is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from loom.model import hf  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**SHAPE)
    if family == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=4)
    if family == "qwen2":
        return transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    if family == "qwen3":
        return transformers.Qwen3Config(**SHAPE, head_dim=8)
    if family == "phi3":
        return transformers.Phi3Config(**SHAPE, pad_token_id=0)
    if family == "gemma":
        return transformers.GemmaConfig(**SHAPE, head_dim=8)
    if family == "gemma2":
        # softcaps small enough to bend the values: a dropped cap would fail the comparison
        return transformers.Gemma2Config(**SHAPE, head_dim=8, sliding_window=4, final_logit_softcapping=0.5,
                                         attn_logit_softcapping=2.0)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=4, sliding_window_pattern=2,
                                             final_logit_softcapping=0.5)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    model.train()
    for p in model.parameters():  # bend norms away from their init so that a skipped one shows
        p.data.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_equal_the_models_forward_and_gradients(family):
    model = _model(family)
    adapter = hf.adapter_for(model)
    assert adapter is not None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 9), generator=g)
    targets = torch.randint(0, SHAPE["vocab_size"], ids.shape, generator=g)

    reference = model(ids).logits
    nn.functional.cross_entropy(reference.flatten(0, 1), targets.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    layers = adapter.layers()
    x = run_layers(layers[:3], None, adapter.context({"input_ids": ids}))  # stage 0: embedding, 2 blocks
    logits = run_layers(layers[3:], x, adapter.context({"input_ids": ids}))  # stage 1: 2 blocks, norm, head
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-5, msg=name)


def test_gemma2_softcap_is_in_the_head_layer():
    model = _model("gemma2")
    logits = run_layers(hf.adapter_for(model).layers(), None, hf.adapter_for(model).context(
        {"input_ids": torch.arange(8)[None]}))
    assert logits.abs().max() <= 0.5  # cap * tanh(.)


def test_unsupported_family_is_refused():
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM(config)
    model.config.model_type = "my_llama_variant"
    with pytest.raises(ValueError, match="model_type 'my_llama_variant' has no loom layer adapter"):
        hf.adapter_for(model)
    gemma3 = _config("gemma3")
    gemma3.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        hf.check_supported_config(gemma3)
