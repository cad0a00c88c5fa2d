"""Bitfield attention masks (loom/data/bam.py, cornstarch.md §3.3.1): the mask decoded from the
bits against a per-token reference built from the spans, the tile classes against the dense
mask's tiles, and the BAM of collated rows against what collation lays out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.data import DemoConfig, DemoDataset
from loom.data.bam import (
    CAUSAL_BIT, EMPTY, FULL, PARTIAL, BitfieldMask, Span, batch_masks, bitfield_mask, block_counts,
    block_mask, decode, dense_mask, nonempty_tiles,
)
from loom.data.collate import collate_ids
from loom.model.zoo.attention import block_diagonal_mask

MODES = ("bidirectional", "causal", "isolated")
TOKEN_COUNTS = {
    "vision": lambda m: (m.height // 8) * (m.width // 8),
    "audio": lambda m: ((1 + m.num_samples // 128) - 1) // 2 + 1,
}


def random_row(rng: np.random.Generator) -> tuple[list[list[Span]], int]:
    """1 to 3 packed samples of text runs, images and clips (adjacent items of one modality
    included), then 0 to 5 padding tokens."""
    samples = []
    for _ in range(int(rng.integers(1, 4))):
        spans = []
        for _ in range(int(rng.integers(1, 6))):
            kind = str(rng.choice(["text", "vision", "audio"], p=[0.4, 0.35, 0.25]))
            spans.append(Span(kind, int(rng.integers(1, 7))))
        samples.append(spans)
    used = sum(s.length for spans in samples for s in spans)
    return samples, used + int(rng.integers(0, 6))


def reference_mask(samples: list[list[Span]], length: int, mode: str) -> np.ndarray:
    """Per token pair, from the spans and the rules in words: attention stays inside a sample
    (padding sees itself alone);
    text sees every earlier token of it; an item's tokens see, by mode, their whole item and the
    earlier tokens (bidirectional), the earlier tokens only (causal), or their item only."""
    owner = []  # per token: (sample, item number or None, position)
    pos = 0
    item = 0
    for s, spans in enumerate(samples):
        for span in spans:
            for _ in range(span.length):
                owner.append((s, item if span.kind != "text" else None, pos))
                pos += 1
            if span.kind != "text":
                item += 1
    mask = np.eye(length, dtype=bool)  # padding attends itself alone
    for q, (sq, iq, pq) in enumerate(owner):
        for k, (sk, ik, pk) in enumerate(owner):
            if sq != sk:
                continue
            earlier = pk <= pq
            same_item = iq is not None and iq == ik
            if iq is None or mode == "causal":
                mask[q, k] = earlier
            elif mode == "bidirectional":
                mask[q, k] = earlier or same_item
            else:
                mask[q, k] = same_item
    return mask


def tiles_of(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
    t = dense.shape[0]
    nq, nk = -(-t // bq), -(-t // bk)
    out = np.empty((nq, nk), dtype=np.int8)
    for i in range(nq):
        for j in range(nk):
            tile = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[i, j] = FULL if tile.all() else (EMPTY if not tile.any() else PARTIAL)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_decoded_mask_equals_reference_on_random_layouts(mode):
    rng = np.random.default_rng(7)
    for _ in range(60):
        samples, length = random_row(rng)
        bam = bitfield_mask(samples, length=length, item_attention=mode)
        assert np.array_equal(dense_mask(bam), reference_mask(samples, length, mode))


def test_causal_mode_is_todays_llm_mask():
    # loom's LLM today: causal inside each packed sample (segment_attention(causal=True))
    rng = np.random.default_rng(8)
    for _ in range(20):
        samples, _ = random_row(rng)
        lengths = [sum(s.length for s in spans) for spans in samples]
        today = (block_diagonal_mask(lengths, "cpu") & torch.ones(sum(lengths), sum(lengths)).tril().bool()).numpy()
        assert np.array_equal(dense_mask(bitfield_mask(samples, item_attention="causal")), today)


def test_bidirectional_differs_from_today_only_inside_items():
    samples = [[Span("text", 3), Span("vision", 4), Span("vision", 2), Span("text", 2)], [Span("audio", 3)]]
    new = dense_mask(bitfield_mask(samples))
    old = dense_mask(bitfield_mask(samples, item_attention="causal"))
    added = np.argwhere(new & ~old)
    # exactly the strict upper triangles of the three items' diagonal blocks
    expected = [(q, k) for a, n in ((3, 4), (7, 2), (11, 3)) for q in range(a, a + n) for k in range(q + 1, a + n)]
    assert sorted(map(tuple, added.tolist())) == expected
    assert not (old & ~new).any()


def test_decode_of_arbitrary_words_follows_the_formula():
    rng = np.random.default_rng(9)
    for _ in range(60):
        t = int(rng.integers(1, 40))
        bam = BitfieldMask(
            bits=(rng.integers(0, 8, t) | np.where(rng.random(t) < 0.6, CAUSAL_BIT, 0)).astype(np.int64),
            kind=rng.integers(-1, 3, t).astype(np.int8),
            # contiguous samples (what bitfield_mask builds) or scattered ones (the general path)
            sample=(np.sort if rng.random() < 0.5 else np.asarray)(rng.integers(-1, 3, t)).astype(np.int32),
            item=rng.integers(-1, 3, t).astype(np.int32),
            modalities=("vision", "audio"),
        )
        want = np.zeros((t, t), dtype=bool)
        for q in range(t):
            for k in range(t):
                if bam.sample[q] < 0:
                    want[q, k] = q == k
                    continue
                if bam.sample[q] != bam.sample[k]:
                    continue
                grouped = bam.item[q] >= 0 and bam.item[q] == bam.item[k]
                causal = (int(bam.bits[q]) & CAUSAL_BIT) and k <= q and (int(bam.bits[q]) >> max(int(bam.kind[k]), 0)) & 1
                want[q, k] = bool(grouped or causal)
        assert np.array_equal(dense_mask(bam), want)
        bq, bk = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        assert np.array_equal(block_counts(bam, bq, bk), _dense_counts(want, bq, bk))


def _dense_counts(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
    t = dense.shape[0]
    return np.array([[dense[i:i + bq, j:j + bk].sum() for j in range(0, t, bk)] for i in range(0, t, bq)])


@pytest.mark.parametrize("mode", MODES)
def test_block_classes_equal_dense_tiles(mode):
    rng = np.random.default_rng(11)
    for _ in range(40):
        samples, length = random_row(rng)
        bam = bitfield_mask(samples, length=length, item_attention=mode)
        dense = dense_mask(bam)
        bq, bk = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        assert np.array_equal(block_mask(bam, bq, bk), tiles_of(dense, bq, bk))
        assert np.array_equal(block_counts(bam, bq, bk), _dense_counts(dense, bq, bk))


def test_block_classes_on_a_long_row_with_kernel_tiles():
    # 128 x 32 tiles as the repository's kernel uses, rows of several hundred tokens, many pieces
    rng = np.random.default_rng(12)
    samples = [[Span(str(rng.choice(["text", "vision", "audio"])), int(rng.integers(1, 90))) for _ in range(8)]
               for _ in range(4)]
    bam = bitfield_mask(samples, length=sum(s.length for sp in samples for s in sp) + 17)
    assert np.array_equal(block_mask(bam, 128, 32), tiles_of(dense_mask(bam), 128, 32))


def test_text_only_row_has_causal_tiles():
    bam = bitfield_mask([[Span("text", 12)]])
    classes = block_mask(bam, 4)
    assert np.array_equal(classes, np.array([[1, 0, 0], [2, 1, 0], [2, 2, 1]]))


def test_positions_restart_per_sample_and_continue_over_padding():
    bam = bitfield_mask([[Span("text", 2), Span("vision", 2)], [Span("text", 3)]], length=9)
    assert bam.positions().tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("pack", [True, False])
def test_batch_masks_follow_collation(pack):
    ds = DemoDataset(DemoConfig(seed=1, num_samples=64))
    idx = list(range(10, 22))
    metas = [ds.meta(i) for i in idx]
    ids = [ds.tokenizer.encode(ds.text(i)) for i in idx]
    input_ids, _, segments = collate_ids(metas, ids, ds.tokenizer, TOKEN_COUNTS, pack=pack)
    bams = batch_masks(metas, ids, ds.tokenizer, TOKEN_COUNTS, pack=pack)
    assert len(bams) == input_ids.shape[0]
    placeholder = {"vision": ds.tokenizer.token_id("<image>"), "audio": ds.tokenizer.token_id("<audio>")}
    for row, bam in zip(input_ids.numpy(), bams):
        assert bam.length == row.size
        for i, enc in enumerate(bam.modalities):
            assert np.array_equal(bam.kind == 1 + i, row == placeholder[enc])
        if pack:
            assert np.bincount(bam.sample).tolist() == segments
            assert np.array_equal(bam.positions(), np.concatenate([np.arange(n) for n in segments]))
        else:
            assert np.array_equal(bam.sample < 0, row == ds.tokenizer.pad_id)
    items = sum(len(m.images) + len(m.audios) for m in metas)
    assert sum(len(set(b.item[b.item >= 0].tolist())) for b in bams) == items


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(samples=[[Span("video", 3)]]), "samples[0][0].kind = 'video'"),
        (dict(samples=[[Span("text", 0)]]), "samples[0][0].length = 0"),
        (dict(samples=[[Span("text", 5)]], length=3), "length = 3 but the samples hold 5 tokens"),
        (dict(samples=[[Span("text", 5)]], item_attention="full"), "item_attention = 'full'"),
        (dict(samples=[[Span("text", 5)]], modalities=("text",)), "modalities = ['text']"),
    ],
)
def test_bad_input_names_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        bitfield_mask(**kwargs)


def test_fields_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="BitfieldMask fields have shapes"):
        BitfieldMask(np.zeros(3, np.int64), np.zeros(3, np.int8), np.zeros(2, np.int32), np.zeros(3, np.int32), ())


def test_bad_tile_size_names_the_field():
    bam = bitfield_mask([[Span("text", 5)]])
    with pytest.raises(ValueError, match="block_k = 0"):
        block_mask(bam, 4, 0)


def test_decode_of_selected_rows_and_columns():
    samples = [[Span("text", 4), Span("audio", 5)], [Span("vision", 3), Span("text", 4)]]
    bam = bitfield_mask(samples)
    dense = dense_mask(bam)
    rows, cols = np.array([15, 2, 7]), np.array([8, 0, 15, 4, 9])
    assert np.array_equal(decode(bam, rows, cols), dense[np.ix_(rows, cols)])


def test_tile_counts_are_the_same_in_many_small_chunks(monkeypatch):
    import loom.data.bam as bam_module

    rng = np.random.default_rng(13)
    for chunk in (1, 7, 50):
        monkeypatch.setattr(bam_module, "CHUNK_PAIRS", chunk)
        for _ in range(15):
            samples, length = random_row(rng)
            bam = bitfield_mask(samples, length=length)
            dense = dense_mask(bam)
            bq, bk = int(rng.integers(1, 9)), int(rng.integers(1, 9))
            assert np.array_equal(block_counts(bam, bq, bk), _dense_counts(dense, bq, bk))
            assert np.array_equal(block_mask(bam, bq, bk), tiles_of(dense, bq, bk))
            assert np.array_equal(nonempty_tiles(bam, bq, bk), (tiles_of(dense, bq, bk) != EMPTY).sum(axis=1))


def test_sample_spans_check_markers_against_items():
    from loom.data import ImageMeta, SampleMeta, Tokenizer
    from loom.data.bam import sample_spans

    tok = Tokenizer(["a", "cat"])
    meta = SampleMeta(sample_id=3, text_tokens=5, images=(ImageMeta(16, 16), ImageMeta(8, 8)))
    ids = tok.encode("a <image> cat")  # one marker, two images
    with pytest.raises(ValueError, match="sample 3: its text has 1 <image> markers but meta.images has 2"):
        sample_spans(meta, ids, tok, TOKEN_COUNTS)
    one = SampleMeta(sample_id=4, text_tokens=5, images=(ImageMeta(16, 16),))
    assert sample_spans(one, ids, tok, TOKEN_COUNTS) == [Span("text", 2), Span("vision", 4), Span("text", 2)]
