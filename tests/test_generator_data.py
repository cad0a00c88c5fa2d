"""Generation requests in the data (issue 11): demo samples that ask for an image, collation of
generation markers and targets with per-sample, per-step noise seeds, metadata counts that agree
with collation, and the errors that name the sample and the field."""

from __future__ import annotations

import pytest
import torch

from loom.data.collate import GenerationSpec, collate, count_tokens, generation_seed, target_count
from loom.data.demo import DemoConfig, DemoDataset
from loom.data.sample import GenerationMeta, Sample, SampleMeta
from loom.data.tokenizer import GEN_IMAGE_MARKER, Tokenizer
from loom.model.generator import ModalityGenerator
from loom.model.multimodal import ModalityEncoder, MultimodalModel
from loom.model.zoo import LlamaConfig, LlamaForCausalLM, VisionConfig, VisionEncoder
from loom.model.zoo.diffusion import DiffusionConfig, DiffusionGenerator

COND = 3
TOKENIZER = Tokenizer(extra_tokens=[GEN_IMAGE_MARKER])
GENS = {"image": GenerationSpec(COND, (3, 16, 16))}
COUNTS = {"vision": lambda m: (m.height // 8) * (m.width // 8)}


def dataset(n: int = 40, mix: dict[str, float] | None = None) -> DemoDataset:
    return DemoDataset(DemoConfig(num_samples=n, seed=2, mix=mix or {"image": 1, "generate": 1, "text": 1}), TOKENIZER)


def test_generate_samples_describe_their_target_and_ask_once():
    ds = dataset(mix={"generate": 1})
    for i in range(6):
        s = ds[i]
        assert s.text.split()[-1] == GEN_IMAGE_MARKER and s.text.count(GEN_IMAGE_MARKER) == 1
        assert s.meta.generations == (GenerationMeta("image", 16, 16),) and s.meta.segments == ("text", "generate")
        assert s.targets[0].shape == (3, 16, 16) and 0 <= s.targets[0].min() and s.targets[0].max() <= 1
        assert ds.meta(i) == s.meta  # metadata without rendering agrees with the sample
    assert DemoDataset(DemoConfig(num_samples=4, seed=2, mix={"generate": 1}), TOKENIZER)[1].targets[0].equal(
        ds[1].targets[0])  # a pure function of (seed, index)


def test_collation_expands_generation_markers_and_masks_their_labels():
    ds = dataset()
    samples = [ds[i] for i in range(12)]
    batch = collate(samples, TOKENIZER, COUNTS, generations=GENS, step=7)
    gid = TOKENIZER.token_id(GEN_IMAGE_MARKER)
    asked = sum(len(s.targets) for s in samples)
    assert asked >= 2 and batch.num_generations("image") == asked
    assert int((batch.input_ids == gid).sum()) == COND * asked
    next_is_gen = torch.zeros_like(batch.labels, dtype=torch.bool)
    next_is_gen[:, :-1] = batch.input_ids[:, 1:] == gid
    assert (batch.labels[next_is_gen] == -100).all()  # generation positions are never targets
    assert batch.num_targets == sum(target_count(s.meta) for s in samples)
    lengths = (batch.input_ids != TOKENIZER.pad_id).sum(1).tolist()
    assert lengths == [count_tokens(s.meta, COUNTS, GENS)["llm"] for s in samples]
    targets = [t for s in samples for t in s.targets]
    assert all(a is b for a, b in zip(batch.generation_inputs["image"]["targets"], targets))
    seeds = [generation_seed(s.meta.sample_id, i, 7) for s in samples for i in range(len(s.targets))]
    assert batch.generation_inputs["image"]["seeds"] == seeds
    again = collate(samples, TOKENIZER, COUNTS, generations=GENS, step=8)
    assert again.generation_inputs["image"]["seeds"] != seeds  # new noise every step
    packed = collate(samples, TOKENIZER, COUNTS, generations=GENS, step=7, pack=True)
    assert int((packed.input_ids == gid).sum()) == COND * asked and packed.num_targets == batch.num_targets


def test_collated_microbatches_sum_to_the_whole_batch():
    """Loss and gradients of a generator model on collated demo data: the microbatches, each
    normalised by the global counts, give the whole batch's (reference semantics)."""
    samples = [dataset()[i] for i in range(8)]

    def model() -> MultimodalModel:
        torch.manual_seed(0)
        return MultimodalModel(
            {"vision": ModalityEncoder(VisionEncoder(VisionConfig(hidden_size=16, num_layers=1, num_heads=2)))},
            LlamaForCausalLM(LlamaConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                                         num_kv_heads=2, intermediate_size=64)),
            {"vision": TOKENIZER.token_id("<image>")},
            {"image": ModalityGenerator(DiffusionGenerator(DiffusionConfig(image_size=16, hidden_size=16, num_layers=1,
                                                                           num_heads=2, cond_tokens=COND)))},
            {"image": TOKENIZER.token_id(GEN_IMAGE_MARKER)})

    whole = collate(samples, TOKENIZER, COUNTS, generations=GENS, step=3)
    ref = model()
    loss = ref.loss(whole)
    loss.backward()
    parts = model()
    total = 0.0
    for chunk in (samples[:3], samples[3:5], samples[5:]):
        mb = collate(chunk, TOKENIZER, COUNTS, generations=GENS, step=3)
        part = parts.loss(mb, num_targets=whole.num_targets, num_generations={"image": whole.num_generations("image")})
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-6)
    for (n, a), (_, b) in zip(ref.named_parameters(), parts.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=n)


def sample_asking(generator: str = "image", size: int = 16, markers: int = 1) -> Sample:
    text = "one shape : a red circle ." + f" {GEN_IMAGE_MARKER}" * markers
    meta = SampleMeta(sample_id=42, text_tokens=len(TOKENIZER.encode(text)),
                      generations=(GenerationMeta(generator, size, size),))
    return Sample(meta, text, targets=[torch.rand(3, size, size)])


def test_bad_generation_requests_name_the_sample_and_the_field():
    with pytest.raises(ValueError, match=r"sample 42: meta.generations\[0\] asks generator 'image'.*no generator"):
        collate([sample_asking()], TOKENIZER, COUNTS)  # a model without a generator
    with pytest.raises(ValueError, match=r"sample 42: meta.generations\[0\] is a \[3, 32, 32\] image.*image_size"):
        collate([sample_asking(size=32)], TOKENIZER, COUNTS, generations=GENS)
    with pytest.raises(ValueError, match=r"sample 42: the text has 2 <gen_image> markers.*for 1 images"):
        collate([sample_asking(markers=2)], TOKENIZER, COUNTS, generations=GENS)
    with pytest.raises(ValueError, match=r"meta.generations\[0\] asks generator 'video'"):
        count_tokens(sample_asking("video").meta, COUNTS, GENS)
    bad = sample_asking()
    bad.targets = [torch.rand(3, 8, 8)]
    with pytest.raises(ValueError, match=r"sample 42: targets\[0\] has shape \(3, 8, 8\), meta.generations\[0\]"):
        collate([bad], TOKENIZER, COUNTS, generations=GENS)
    with pytest.raises(ValueError, match=r"mix\['generate'\].*extra_tokens"):
        DemoDataset(DemoConfig(num_samples=2, mix={"generate": 1}))  # the default tokenizer has no marker
    with pytest.raises(ValueError, match="gen_image_size"):
        DemoConfig(gen_image_size=4)


def test_generation_requests_travel_in_the_metadata_codec():
    """The dispatcher's all-gathered metadata carries each request's size and generator, so
    every rank knows the whole batch's generator work from metadata alone."""
    import numpy as np

    from loom.cost.workload import GENERATOR_NAMES, MetadataArrays, WorkloadError

    metas = [dataset(mix={"generate": 1, "image": 1}).meta(i) for i in range(7)]
    assert any(m.generations for m in metas) and any(not m.generations for m in metas)
    arrays = MetadataArrays.from_metas(metas)
    assert MetadataArrays.from_flat(arrays.to_flat()).metas() == metas
    # uneven shards, gathered as rows of a padded table
    rows = [MetadataArrays.from_metas(part).to_flat() for part in (metas[:3], metas[3:4], metas[4:])]
    table = np.zeros((3, max(r.size for r in rows) + 5), dtype=np.int64)
    for k, r in enumerate(rows):
        table[k, :r.size] = r
    gathered = MetadataArrays.from_gathered(table)
    assert gathered.metas() == metas and [gathered.meta(s) for s in range(7)] == metas
    assert MetadataArrays.concat([MetadataArrays.from_metas(metas[:2]), MetadataArrays.from_metas(metas[2:])]).metas() \
        == metas
    bad = arrays.to_flat()
    bad[-1] = len(GENERATOR_NAMES)  # the last request's generator code
    with pytest.raises(WorkloadError, match="generator code"):
        MetadataArrays.from_flat(bad)
    with pytest.raises(WorkloadError, match="generator 'video'"):
        MetadataArrays.from_metas([SampleMeta(1, 4, generations=(GenerationMeta("video", 16, 16),))])
