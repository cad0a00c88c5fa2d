"""Tests of the demo dataset, the tokenizer, collation and microbatch splitting (CPU, fast)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loom.data import (
    IGNORE_INDEX,
    AudioMeta,
    DemoConfig,
    DemoDataset,
    ImageMeta,
    Sample,
    SampleMeta,
    Tokenizer,
    collate,
    count_tokens,
    demo_vocabulary,
    split_microbatches,
)
from loom.data.demo import COLOURS, SHAPES, TONES

# Stand-ins for the real encoders' token counts: one token per 8x8 patch; audio as a conv
# front-end of hop 128 followed by a stride-2 downsampling.
TOKEN_COUNTS = {
    "vision": lambda m: (m.height // 8) * (m.width // 8),
    "audio": lambda m: ((1 + m.num_samples // 128) - 1) // 2 + 1,
}


@pytest.fixture(scope="module")
def dataset() -> DemoDataset:
    return DemoDataset(DemoConfig(seed=0, num_samples=5000))


def _same_sample(a: Sample, b: Sample) -> bool:
    return (
        a.meta == b.meta
        and a.text == b.text
        and len(a.images) == len(b.images)
        and all(torch.equal(x, y) for x, y in zip(a.images, b.images))
        and len(a.audios) == len(b.audios)
        and all(torch.equal(x, y) for x, y in zip(a.audios, b.audios))
    )


# --- demo dataset ----------------------------------------------------------------------------


def test_samples_are_deterministic_and_seeded():
    ds = DemoDataset(DemoConfig(seed=3, num_samples=100))
    again = DemoDataset(DemoConfig(seed=3, num_samples=100))
    other = DemoDataset(DemoConfig(seed=4, num_samples=100))
    # Access order must not matter: read backwards on one, forwards on the other.
    backwards = {i: ds[i] for i in reversed(range(30))}
    for i in range(30):
        assert _same_sample(backwards[i], again[i])
    assert sum(_same_sample(ds[i], other[i]) for i in range(30)) < 3
    assert [ds.meta(i) for i in range(30)] != [other.meta(i) for i in range(30)]


def test_meta_matches_payload(dataset: DemoDataset):
    tokenizer = dataset.tokenizer
    for i in range(300):
        sample = dataset[i]
        assert dataset.meta(i) == sample.meta
        sample.check_payload()
        meta = sample.meta
        assert meta.sample_id == i
        assert meta.text_tokens == len(tokenizer.encode(sample.text))
        assert sample.text.split().count("<image>") == len(meta.images)
        assert sample.text.split().count("<audio>") == len(meta.audios)
        assert meta.segments.count("image") == len(meta.images)
        assert meta.segments.count("audio") == len(meta.audios)
        for image, image_meta in zip(sample.images, meta.images):
            assert image.dtype == torch.float32
            assert 0.0 <= image.min() and image.max() <= 1.0
            assert image_meta.height % 8 == 0 and image_meta.width % 8 == 0
            assert 16 <= image_meta.height <= 64 and 16 <= image_meta.width <= 64
        for clip, audio_meta in zip(sample.audios, meta.audios):
            assert clip.dtype == torch.float32
            assert -1.0 <= clip.min() and clip.max() <= 1.0
            assert audio_meta.sample_rate == 8000
            assert 0.25 - 1e-3 <= audio_meta.seconds <= 2.0 + 1e-3


def test_segments_follow_text_order(dataset: DemoDataset):
    for i in range(200):
        sample = dataset[i]
        expected = []
        for word in sample.text.split():
            kind = {"<image>": "image", "<audio>": "audio"}.get(word, "text")
            if kind != "text" or not expected or expected[-1] != "text":
                expected.append(kind)
        assert sample.meta.segments == tuple(expected)


def test_modality_mix_matches_config(dataset: DemoDataset):
    n = 2000
    counts: dict[str, int] = {}
    for i in range(n):
        meta = dataset.meta(i)
        images, audios = len(meta.images), len(meta.audios)
        if images == 0 and audios == 0:
            kind = "text"
        elif audios == 0:
            kind = "image" if images == 1 else "multi_image"
        elif images == 0:
            kind = "audio"
        else:
            kind = "image_audio"
        assert kind == dataset.kind(i)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, prob in dataset.config.mix.items():
        # 2000 draws: a standard deviation is at most ~1.1 points; allow about 4.
        assert abs(counts.get(kind, 0) / n - prob) < 0.045, (kind, counts)


def test_mix_respects_zero_weights():
    ds = DemoDataset(DemoConfig(num_samples=300, mix={"audio": 1.0, "text": 0.0}))
    for i in range(300):
        meta = ds.meta(i)
        assert len(meta.audios) == 1 and not meta.images


def test_token_counts_are_skewed(dataset: DemoDataset):
    llm = [count_tokens(dataset.meta(i), TOKEN_COUNTS)["llm"] for i in range(1000)]
    # Heterogeneous like real MLLM data: short text-only rows next to long multi-image rows.
    assert min(llm) < 15 and max(llm) > 150
    vision = [TOKEN_COUNTS["vision"](im) for i in range(1000) for im in dataset.meta(i).images]
    assert min(vision) == 4 and max(vision) == 64


def _colour_pixels(image: torch.Tensor) -> dict[str, int]:
    r, g, b = image[0], image[1], image[2]
    masks = {
        "red": (r > 0.6) & (g < 0.4) & (b < 0.4),
        "green": (g > 0.6) & (r < 0.4) & (b < 0.4),
        "blue": (b > 0.6) & (r < 0.4) & (g < 0.5),
        "yellow": (r > 0.6) & (g > 0.6) & (b < 0.4),
    }
    return {name: int(mask.sum()) for name, mask in masks.items()}


def test_images_show_the_described_shapes(dataset: DemoDataset):
    number_words = ["zero", "one", "two", "three", "four"]
    checked = 0
    for i in range(300):
        sample = dataset[i]
        # Each image's caption runs from its marker to the next " ." in the text.
        captions = [part.split(" . ")[0] for part in (" " + sample.text).split(" <image> ")[1:]]
        assert len(captions) == len(sample.images)
        for image, caption in zip(sample.images, captions):
            words = caption.replace(" .", "").split()
            count = number_words.index(words[0])
            assert 1 <= count <= 4
            assert words[1] == ("shape" if count == 1 else "shapes")
            assert sum(w in SHAPES for w in words) == count
            mentioned = {w for w in words if w in COLOURS}
            pixels = _colour_pixels(image)
            for colour in COLOURS:
                if colour in mentioned:
                    assert pixels[colour] >= 3, (i, caption, pixels)
                else:
                    assert pixels[colour] == 0, (i, caption, pixels)
            checked += 1
    assert checked > 200


def test_audio_tones_match_text(dataset: DemoDataset):
    checked = 0
    for i in range(300):
        sample = dataset[i]
        if not sample.audios:
            continue
        caption = sample.text.split("<audio>")[1].split(" .")[0]
        tones = [w for w in caption.split() if w in TONES]
        assert 1 <= len(tones) <= 3
        clip = sample.audios[0].numpy()
        bounds = np.linspace(0, len(clip), len(tones) + 1).round().astype(int)
        for pitch, start, stop in zip(tones, bounds[:-1], bounds[1:]):
            spectrum = np.abs(np.fft.rfft(clip[start:stop]))
            freqs = np.fft.rfftfreq(stop - start, d=1 / 8000)
            peak = freqs[int(np.argmax(spectrum))]
            assert abs(peak - TONES[pitch]) < 60, (i, caption, pitch, peak)
        checked += 1
    assert checked > 30


def test_meta_renders_nothing_and_a_sample_renders_each_payload_once(dataset: DemoDataset, monkeypatch):
    # what keeps generation cheap, counted instead of timed: metadata (what balancing reads
    # for a whole global batch) draws only the recipe; a sample renders each image and clip once
    import loom.data.demo as demo

    calls = {"image": 0, "audio": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(demo, "_render_image", counted("image", demo._render_image))
    monkeypatch.setattr(demo, "_render_audio", counted("audio", demo._render_audio))
    metas = [dataset.meta(i) for i in range(200)]
    assert calls == {"image": 0, "audio": 0}
    for i in range(200):
        dataset[i]
    assert calls == {"image": sum(len(m.images) for m in metas), "audio": sum(len(m.audios) for m in metas)}
    assert calls["image"] > 0 and calls["audio"] > 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("patch_size", 0),
        ("min_image_size", 20),
        ("max_image_size", 60),
        ("min_image_size", 72),
        ("max_shapes", 5),
        ("max_shapes", 0),
        ("max_images", 1),
        ("sample_rate", 2000),
        ("min_audio_seconds", 0.0),
        ("max_audio_seconds", 0.1),
        ("max_tones", 0),
        ("num_samples", 0),
        ("seed", -1),
        ("mix", {"image": -0.1, "text": 1.0}),
        ("mix", {"image": 0.0, "text": 0.0}),
        ("mix", {"video": 1.0}),
        ("mix", {"image": float("nan")}),
    ],
)
def test_bad_config_raises(field, value):
    with pytest.raises(ValueError, match=field):
        DemoConfig(**{field: value})


def test_config_mutated_after_construction_is_rechecked():
    config = DemoConfig()
    config.min_image_size = 12
    with pytest.raises(ValueError, match="min_image_size"):
        DemoDataset(config)


def test_index_out_of_range(dataset: DemoDataset):
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    with pytest.raises(IndexError):
        dataset.meta(-1)


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_covers_everything_the_generator_says(dataset: DemoDataset):
    tokenizer = Tokenizer()
    assert tokenizer.pad_id == 0
    assert tokenizer.tokens[:6] == ["<pad>", "<bos>", "<eos>", "<unk>", "<image>", "<audio>"]
    assert tokenizer.vocab_size == 6 + len(demo_vocabulary())
    assert Tokenizer().tokens == tokenizer.tokens  # deterministic order
    for i in range(500):
        text = dataset.text(i)
        ids = tokenizer.encode(text)
        assert tokenizer.unk_id not in ids, text
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert tokenizer.decode(ids, skip_special=True) == text
        assert tokenizer.encode(text, add_special=False) == ids[1:-1]


def test_tokenizer_unknown_and_case():
    tokenizer = Tokenizer()
    assert tokenizer.encode("A RED zebra", add_special=False) == [
        tokenizer.token_id("a"),
        tokenizer.token_id("red"),
        tokenizer.unk_id,
    ]
    assert tokenizer.token_id("<image>") == 4 and tokenizer.token_id("<audio>") == 5
    assert tokenizer.token_id("zebra") == tokenizer.unk_id
    with pytest.raises(ValueError):
        tokenizer.decode([tokenizer.vocab_size])


# --- collation -------------------------------------------------------------------------------


def test_collate_expands_markers_and_shifts_labels(dataset: DemoDataset):
    tokenizer = dataset.tokenizer
    samples = [dataset[i] for i in range(40)]
    for group in split_microbatches(samples, 5):
        batch = collate(group, tokenizer, TOKEN_COUNTS)
        assert batch.sample_ids == [s.meta.sample_id for s in group]
        assert batch.input_ids.shape == batch.labels.shape
        assert batch.input_ids.dtype == torch.long and batch.labels.dtype == torch.long
        image_id, audio_id = tokenizer.token_id("<image>"), tokenizer.token_id("<audio>")
        lengths = []
        for b, sample in enumerate(group):
            counts = count_tokens(sample.meta, TOKEN_COUNTS)
            row, labels = batch.input_ids[b], batch.labels[b]
            length = counts["llm"]
            lengths.append(length)
            # Sequence length from metadata equals the collated length before padding.
            assert int((row != tokenizer.pad_id).sum()) == length
            assert (row[length:] == tokenizer.pad_id).all()
            assert row[0] == tokenizer.bos_id and row[length - 1] == tokenizer.eos_id
            assert int((row == image_id).sum()) == counts["vision"]
            assert int((row == audio_id).sum()) == counts["audio"]
            assert counts["vision"] == sum(TOKEN_COUNTS["vision"](m) for m in sample.meta.images)
            # The non-placeholder ids are the text's ids without the markers.
            text_ids = [t for t in tokenizer.encode(sample.text) if t not in (image_id, audio_id)]
            assert [t for t in row[:length].tolist() if t not in (image_id, audio_id)] == text_ids
            for t in range(batch.input_ids.shape[1]):
                nxt = int(row[t + 1]) if t + 1 < length else None
                if nxt is None or nxt in (image_id, audio_id):
                    assert labels[t] == IGNORE_INDEX
                else:
                    assert labels[t] == nxt
        assert batch.input_ids.shape[1] == max(lengths)
        # Items of all samples, in sample order.
        images = [im for s in group for im in s.images]
        waveforms = [a for s in group for a in s.audios]
        assert len(batch.modality_inputs["vision"]["images"]) == len(images)
        assert all(x is y for x, y in zip(batch.modality_inputs["vision"]["images"], images))
        assert all(x is y for x, y in zip(batch.modality_inputs["audio"]["waveforms"], waveforms))
        # Targets: every position but the last, minus those followed by a placeholder.
        expected_targets = 0
        for s in group:
            counts = count_tokens(s.meta, TOKEN_COUNTS)
            expected_targets += counts["llm"] - 1 - counts["vision"] - counts["audio"]
        assert batch.num_targets == expected_targets


def test_collate_custom_placeholders_masked_by_position():
    tokenizer = Tokenizer()
    red = tokenizer.token_id("red")
    sample = Sample(
        meta=SampleMeta(
            sample_id=7, text_tokens=6, images=(ImageMeta(16, 24),), segments=("image", "text")
        ),
        text="<image> a red .",
        images=[torch.zeros(3, 16, 24)],
    )
    # A placeholder id equal to a real word's id must still never be a target.
    batch = collate(
        [sample], tokenizer, {"vision": TOKEN_COUNTS["vision"]}, placeholder_ids={"vision": red}
    )
    row, labels = batch.input_ids[0].tolist(), batch.labels[0].tolist()
    words = [tokenizer.token_id(w) for w in "a red .".split()]
    assert row == [tokenizer.bos_id] + [red] * 6 + words + [tokenizer.eos_id]
    assert labels[:6] == [IGNORE_INDEX] * 6
    assert labels[6:] == row[7:] + [IGNORE_INDEX]
    assert list(batch.modality_inputs) == ["vision"]


def test_collate_rejects_marker_item_mismatch():
    tokenizer = Tokenizer()
    sample = Sample(
        meta=SampleMeta(sample_id=11, text_tokens=6, images=(ImageMeta(16, 16),)),
        text="<image> <image> a red circle .",
        images=[torch.zeros(3, 16, 16)],
    )
    with pytest.raises(ValueError, match=r"sample 11.*vision.*2.*1"):
        collate([sample], tokenizer, TOKEN_COUNTS)
    no_marker = Sample(
        meta=SampleMeta(sample_id=12, text_tokens=4, audios=(AudioMeta(800, 8000),)),
        text="a low tone .",
        audios=[torch.zeros(800)],
    )
    with pytest.raises(ValueError, match=r"sample 12.*audio.*0.*1"):
        collate([no_marker], tokenizer, TOKEN_COUNTS)


def test_collate_rejects_payload_mismatch_and_uncovered_modality(dataset: DemoDataset):
    tokenizer = dataset.tokenizer
    sample = next(dataset[i] for i in range(100) if dataset[i].images)
    broken = dataclasses.replace(sample, images=[torch.zeros(3, 8, 8)] + sample.images[1:])
    with pytest.raises(ValueError, match="images"):
        collate([broken], tokenizer, TOKEN_COUNTS)
    with pytest.raises(ValueError, match="vision"):
        collate([sample], tokenizer, {"audio": TOKEN_COUNTS["audio"]})
    with pytest.raises(ValueError, match="vision"):
        count_tokens(sample.meta, {"audio": TOKEN_COUNTS["audio"]})
    with pytest.raises(ValueError, match="video"):
        collate([sample], tokenizer, {**TOKEN_COUNTS, "video": lambda m: 1})


def test_collate_text_only_batch_keeps_requested_encoders(dataset: DemoDataset):
    texts = [dataset[i] for i in range(200) if not dataset[i].images and not dataset[i].audios][:3]
    batch = collate(texts, dataset.tokenizer, TOKEN_COUNTS)
    assert batch.modality_inputs == {"vision": {"images": []}, "audio": {"waveforms": []}}
    assert batch.num_targets == sum(s.meta.text_tokens - 1 for s in texts)


# --- microbatches ----------------------------------------------------------------------------


def test_split_microbatches_neither_drops_nor_duplicates():
    for n in range(1, 40):
        items = list(range(n))
        for m in range(1, n + 1):
            parts = split_microbatches(items, m)
            assert len(parts) == m
            assert [x for part in parts for x in part] == items  # contiguous, order kept
            sizes = [len(p) for p in parts]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_microbatches_rejects_too_few_items():
    with pytest.raises(ValueError, match=r"3 items into 4 microbatches"):
        split_microbatches([1, 2, 3], 4)
    with pytest.raises(ValueError):
        split_microbatches([1, 2, 3], 0)
