"""The model tree: call order, merge, freezing, layer lists, and the placeholder check."""

import dataclasses

import pytest
import torch

from loom.data.collate import collate
from loom.data.demo import DemoConfig
from loom.model.layers import run_layers
from loom.model.multimodal import ModalityEncoder, MultimodalModel
from loom.model.zoo import LlamaConfig, LlamaForCausalLM, VisionConfig, VisionEncoder
from loom.train.build import build_data, build_model, num_targets, token_counters
from loom.train.config import ModelConfig, TrainConfig


def small_model_config(**kw) -> ModelConfig:
    from loom.model.zoo import AudioConfig

    small = dict(hidden_size=32, num_layers=2, num_heads=2)
    return ModelConfig(vision=VisionConfig(**small), audio=AudioConfig(**small),
                       llm=LlamaConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=64),
                       **kw)


@pytest.fixture(scope="module")
def setup():
    cfg = TrainConfig(model=small_model_config())
    cfg.data = dataclasses.replace(cfg.data, demo=DemoConfig(num_samples=32, seed=1))
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=0)
    batch = collate([dataset[i] for i in range(6)], tokenizer, token_counters(model))
    return cfg, tokenizer, dataset, model, batch


def test_layer_lists_cover_every_parameter_once(setup):
    _, _, _, model, _ = setup
    names = []
    for m in model.module_names:
        for layer in model.module_layers(m):
            names += [f"{layer.name}.{n}" for n, _ in layer.module.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_any_cut_of_every_module_equals_the_whole(setup):
    _, _, _, model, batch = setup
    with torch.no_grad():
        ref = model(batch)
        feats = {}
        for name in model.encoders:
            layers, ctx = model.module_layers(name), model.module_context(name, batch)
            x = run_layers(layers[:2], None, ctx)
            feats[name] = run_layers(layers[2:], x, ctx)
        layers, ctx = model.module_layers("llm"), model.module_context("llm", batch)
        x = run_layers(layers[:1], feats, ctx)
        out = run_layers(layers[1:], x, ctx)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_loss_target_count_follows_from_metadata(setup):
    _, _, dataset, _, batch = setup
    assert batch.num_targets == sum(num_targets(dataset.meta(i)) for i in range(6))


def test_placeholder_count_mismatch_is_an_error(setup):
    _, tokenizer, dataset, model, _ = setup
    counts = token_counters(model)
    wrong = {**counts, "vision": lambda meta: counts["vision"](meta) + 1}
    i = next(i for i in range(32) if dataset.meta(i).images)
    batch = collate([dataset[i]], tokenizer, wrong)
    with pytest.raises(ValueError, match="'vision' produced .* tokens but the batch has .* placeholder"):
        model(batch)


def test_freezing_is_requires_grad_and_frozen_grads_are_absent(setup):
    cfg, tokenizer, _, _, batch = setup
    model = build_model(cfg.model, tokenizer, seed=0).freeze("vision.encoder", "audio", "llm")
    model.loss(batch).backward()
    for name, p in model.named_parameters():
        trainable = name.startswith("encoders.vision.projector.")
        assert p.requires_grad == trainable, name
        assert (p.grad is not None) == trainable, name
    model.unfreeze("llm")
    assert all(p.requires_grad for p in model.llm.parameters())
    with pytest.raises(ValueError, match="unknown part 'video'"):
        model.freeze("video")
    with pytest.raises(ValueError, match="'.encoder' or '.projector'"):
        model.freeze("vision.head")


def test_callbacks_run_in_cornstarch_order():
    calls = []
    torch.manual_seed(0)
    enc = ModalityEncoder(
        VisionEncoder(VisionConfig(hidden_size=16, num_layers=1, num_heads=2)),
        projector="linear",
        before_encoder=lambda inputs: calls.append("before_encoder") or inputs,
        after_encoder=lambda inputs, out: calls.append("after_encoder") or out * 2,
        after_projector=lambda inputs, out: calls.append("after_projector") or out,
    )
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                       intermediate_size=32))
    MultimodalModel({"vision": enc}, llm, {"vision": 3})
    image = torch.rand(3, 16, 8)
    out = enc(images=[image])
    assert calls == ["before_encoder", "after_encoder", "after_projector"]
    assert out.shape == (2, 16)
    # after_encoder's doubling happens between the encoder and the projector
    torch.testing.assert_close(out, enc.projector(enc.encoder(images=[image]) * 2))


def test_unmodified_hugging_face_llm_as_the_backbone(setup):
    transformers = pytest.importorskip("transformers")
    _, tokenizer, dataset, _, _ = setup
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    vision = ModalityEncoder(VisionEncoder(VisionConfig(hidden_size=16, num_layers=1, num_heads=2)), projector="mlp")
    model = MultimodalModel({"vision": vision}, hf, {"vision": tokenizer.token_id("<image>")})
    i = next(i for i in range(32) if dataset.meta(i).images and not dataset.meta(i).audios)
    batch = collate([dataset[i]], tokenizer, {"vision": vision.num_tokens})
    logits = model(batch)
    assert logits.shape == (*batch.input_ids.shape, tokenizer.vocab_size)
    assert [l.name for l in model.module_layers("llm")][:2] == ["llm.model.embed_tokens", "llm.model.layers.0"]
    model.loss(batch).backward()
    assert vision.projector[0].weight.grad is not None


def test_packed_sequences_match_padded_rows() -> None:
    """One packed row per microbatch (positions and causal attention restart per sample, the
    last token of a sample predicts nothing) gives the padded batch's loss and gradients."""
    import dataclasses

    from loom.data.collate import collate
    from loom.data.demo import DemoConfig
    from loom.model.zoo import LlamaConfig, VisionConfig
    from loom.train.build import build_data, build_model, token_counters
    from loom.train.config import ModelConfig, TrainConfig

    cfg = TrainConfig(model=ModelConfig(vision=VisionConfig(hidden_size=32, num_layers=1, num_heads=2), audio=None,
                                        llm=LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                        intermediate_size=64)))
    cfg.data = dataclasses.replace(cfg.data, demo=DemoConfig(num_samples=16, seed=2, mix={"text": 1, "multi_image": 1}))
    tokenizer, dataset = build_data(cfg)
    samples = [dataset[i] for i in range(6)]
    results = []
    for pack in (False, True):
        model = build_model(cfg.model, tokenizer, seed=4)
        batch = collate(samples, tokenizer, token_counters(model), pack=pack)
        assert (batch.segments is not None) == pack
        loss = model.loss(batch)
        loss.backward()
        results.append((batch.num_targets, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (t0, l0, g0), (t1, l1, g1) = results
    assert t0 == t1
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
