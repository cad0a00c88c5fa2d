"""Modality generators after the LLM (issue 11; disttrain.md §1): the tiny diffusion generator,
`ModalityGenerator` in the model tree, the loss normalisation that makes splitting the batch
exact, freezing per part, and the errors for bad generation inputs."""

from __future__ import annotations

import pytest
import torch

from loom.data.sample import Batch
from loom.model.generator import ModalityGenerator
from loom.model.layers import run_layers
from loom.model.multimodal import IGNORE_INDEX, ModalityEncoder, MultimodalModel
from loom.model.zoo import LlamaConfig, LlamaForCausalLM, VisionConfig, VisionEncoder
from loom.model.zoo.diffusion import DiffusionConfig, DiffusionGenerator, draw_noise, noise_schedule

VOCAB, IMAGE_ID, GEN_ID = 40, 38, 39
COND = 3


def make_model(seed: int = 0, weight: float = 1.0, projector: str = "mlp") -> MultimodalModel:
    torch.manual_seed(seed)
    vision = ModalityEncoder(VisionEncoder(VisionConfig(patch_size=4, hidden_size=16, num_layers=1, num_heads=2)))
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=64))
    gen = ModalityGenerator(DiffusionGenerator(DiffusionConfig(image_size=8, patch_size=4, hidden_size=16,
                                                               num_layers=1, num_heads=2, cond_tokens=COND)),
                            projector=projector, loss_weight=weight)
    return MultimodalModel({"vision": vision}, llm, {"vision": IMAGE_ID}, {"image": gen}, {"image": GEN_ID})


def make_batch(samples: list[dict]) -> Batch:
    """Right-padded rows from ``{"id", "text": [ids], "images": [...], "targets": [...]}``;
    ``IMAGE_ID`` in the text is already expanded (4 patches per 8x8 image at patch 4), each
    ``GEN_ID`` group is ``COND`` long."""
    length = max(len(s["text"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX)
    for b, s in enumerate(samples):
        row = torch.tensor(s["text"])
        ids[b, :len(row)] = row
        nxt = row[1:].clone()
        nxt[(nxt == IMAGE_ID) | (nxt == GEN_ID)] = IGNORE_INDEX
        labels[b, :len(row) - 1] = nxt
    return Batch(ids, labels, {"vision": {"images": [im for s in samples for im in s["images"]]}},
                 [s["id"] for s in samples],
                 generation_inputs={"image": {"targets": [t for s in samples for t in s["targets"]],
                                              "seeds": [1000 * s["id"] + i for s in samples
                                                        for i in range(len(s["targets"]))]}})


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    img = lambda: torch.rand(3, 8, 8, generator=g)  # noqa: E731
    return [
        {"id": 0, "text": [1, 5, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 7, GEN_ID, GEN_ID, GEN_ID, 2],
         "images": [img()], "targets": [img()]},
        {"id": 1, "text": [1, 9, 10, 11, 2], "images": [], "targets": []},
        {"id": 2, "text": [1, 6, GEN_ID, GEN_ID, GEN_ID, 8, GEN_ID, GEN_ID, GEN_ID, 12, 2], "images": [],
         "targets": [img(), img()]},
    ]


def grads(model: MultimodalModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_noise_is_the_seeds_and_the_schedule_is_ddpm():
    cfg = DiffusionConfig(image_size=8, patch_size=4)
    t1, e1 = draw_noise(7, cfg)
    t2, e2 = draw_noise(7, cfg)
    assert t1 == t2 and torch.equal(e1, e2) and e1.shape == (3, 8, 8)
    assert draw_noise(8, cfg)[1].ne(e1).any()
    a = noise_schedule(cfg)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    assert a[0] == pytest.approx(1 - 1e-4) and a[-1] == pytest.approx(torch.prod(1 - betas).item())
    assert torch.all(a[1:] < a[:-1])


def test_generator_layers_cover_its_parameters_and_any_cut_equals_the_whole():
    model = make_model()
    batch = make_batch(samples())
    names = [f"{layer.name}.{n}" for m in model.module_names for layer in model.module_layers(m)
             for n, _ in layer.module.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert model.module_names == ["vision", "llm", "image"]
    with torch.no_grad():
        states = model.llm_outputs(batch)["generate"]["image"]
        assert states.shape == (3 * COND, 32)  # three images to generate, COND states each
        layers, ctx = model.module_layers("image"), model.module_context("image", batch)
        whole = run_layers(layers, states, ctx)
        for cut in range(1, len(layers)):
            assert torch.equal(run_layers(layers[cut:], run_layers(layers[:cut], states, ctx), ctx), whole)


def test_splitting_the_batch_never_changes_loss_or_gradients():
    """Microbatches of any split, each normalised by the global counts, sum to the whole
    batch's loss and gradients (what every parallel run relies on)."""
    data = samples()
    whole = make_model()
    full = make_batch(data)
    loss = whole.loss(full)
    loss.backward()
    ref = grads(whole)
    counts = {"image": full.num_generations("image")}
    for split in ([[0], [1], [2]], [[0, 2], [1]], [[2], [0, 1]]):
        model = make_model()
        total = 0.0
        for part in split:
            mb = make_batch([data[i] for i in part])
            part_loss = model.loss(mb, num_targets=full.num_targets, num_generations=counts)
            part_loss.backward()
            total += part_loss.item()
        assert total == pytest.approx(loss.item(), rel=1e-6)
        got = grads(model)
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_the_generator_loss_adds_with_its_weight():
    data = samples()
    batch = make_batch(data)
    with torch.no_grad():
        lm_only = make_model(weight=0.0).loss(batch)
        both = make_model(weight=1.0).loss(batch)
        double = make_model(weight=2.0).loss(batch)
    assert both > lm_only
    assert (double - lm_only).item() == pytest.approx(2 * (both - lm_only).item(), rel=1e-5)


def test_a_frozen_generator_with_a_trainable_projector_still_trains_the_llm():
    batch = make_batch(samples())
    model = make_model().freeze("image.generator")
    model.loss(batch).backward()
    got = grads(model)
    assert not any(n.startswith("generators.image.generator.") for n in got)
    assert any(n.startswith("generators.image.projector.") for n in got)
    # the LLM's gradients include the generator's path: they differ from the LM loss alone
    lm = make_model(weight=0.0).freeze("image.generator")
    lm.loss(batch).backward()
    head_side = "llm.model.norm.weight"
    assert not torch.allclose(got[head_side], grads(lm)[head_side])
    with pytest.raises(ValueError, match="image.decoder"):
        model.freeze("image.decoder")


def test_an_empty_microbatch_keeps_every_generator_parameter_in_the_graph():
    model = make_model()
    batch = make_batch([samples()[1]])  # no image to generate
    model.loss(batch, num_generations={"image": 3}).backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None}
    assert {n for n, _ in model.named_parameters() if n.startswith("generators.")} <= names


def test_training_lowers_the_generator_loss():
    torch.manual_seed(0)
    model = make_model(projector="linear")
    batch = make_batch(samples())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def gen_loss() -> float:
        with torch.no_grad():
            states = model.llm_outputs(batch)["generate"]["image"]
            return model.generator_loss_sum("image", batch, states).item() / 3

    start = gen_loss()
    for _ in range(40):
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()
    assert gen_loss() < 0.7 * start  # the same noise every step: the denoiser fits it


def test_bad_generation_inputs_name_the_field():
    model = make_model()
    data = samples()
    data[2]["targets"][1] = torch.rand(3, 16, 16)
    with pytest.raises(ValueError, match=r"targets\[2\] has shape \(3, 16, 16\).*image_size"):
        model.loss(make_batch(data))
    data = samples()
    data[0]["text"] = data[0]["text"][:-2] + [2]  # one generation token short
    with pytest.raises(ValueError, match="generator 'image'.*8 LLM states.*3 items"):
        model.loss(make_batch(data))
    with pytest.raises(ValueError, match="generation_ids lacks"):
        MultimodalModel({}, make_model().llm, {}, {"image": make_model().generators["image"]}, {})
