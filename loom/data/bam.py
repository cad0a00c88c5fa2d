"""Bitfield attention masks (BAM): a multimodal row's attention mask in a few fields per token
(cornstarch.md §3.3.1), and the block classification that lets attention skip masked tiles.

A dense ``[T, T]`` mask costs T² bits; a BAM costs a constant per token, from which any tile of
the dense mask is decoded on demand (a CP rank's rows against the all-gathered keys, §3.3.6).
Per token:

- ``bits`` (int64): bit ``k`` for ``k < 62`` says the token may attend earlier tokens of kind
  ``k`` (kind 0 is text, kind ``1 + i`` the ``i``-th modality of ``modalities``); bit 62
  (``CAUSAL_BIT``) says it attends causally at all. This is the paper's word ([P] Fig. 8, the
  causal bit of [D] §3.4.2).
- ``kind`` (int8): the token's own kind, the bit a query's word is tested against; -1 padding.
- ``sample`` (int32): which packed sample of the row it belongs to; -1 padding.
- ``item`` (int32): which image or clip of the row it belongs to, whose tokens attend each other
  in both directions; -1 for text, padding, and items whose attention is causal.

The digest's [gap] in §3.3.1 is why ``sample`` and ``item`` exist: modality bits alone cannot keep
packed samples apart, nor two images of one modality (the paper's words would let every image
attend every other image of its modality, future ones included). The decoded mask is

    allowed(q, k) = sample[q] == sample[k] >= 0 and (
        item[q] == item[k] >= 0
        or (bits[q] has CAUSAL_BIT and k <= q and bits[q] has bit kind[k]))
      or (sample[q] < 0 and k == q)

so attention restarts at every packed sample, and no token attends padding. A padding token
attends itself alone: every row keeps a key, so attention over the mask stays finite without a
guard for empty rows (the paper's word 0 attends nothing, which needs the kernel's guard,
§3.3.5), and nothing reads a padding token's output.

``item_attention`` picks what an item's tokens see (text always sees every earlier token of its
sample, as loom's LLM does):

- ``"bidirectional"`` (issue 9's mask, the default): all of their own item, and every earlier
  token of the sample, causally.
- ``"causal"``: every earlier token of the sample; exactly loom's LLM mask today (causal per
  packed sample, ``loom/model/zoo/llama.py``).
- ``"isolated"``: their own item only (the paper's Fig. 8: encoder tokens "only have 1st LSB set").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.data.collate import (MODALITIES, MODALITY_KINDS, TokenCounts, encoder_modalities, encoders_by_modality,
                               item_token_count)
from loom.data.sample import SampleMeta
from loom.data.tokenizer import Tokenizer

TEXT = "text"
CAUSAL_BIT = 1 << 62
MAX_KINDS = 62  # bits 0..61 name kinds; bit 62 is causal; bit 63 is int64's sign
ITEM_ATTENTION = ("bidirectional", "causal", "isolated")

CHUNK_PAIRS = 1 << 21  # piece pairs per chunk of `_tile_counts`: bounds its scratch arrays (~75 MB)

# Block classes of `block_mask` (cornstarch.md §3.3.1, the repo's compressed mask).
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Span:
    """``length`` consecutive tokens of one kind: ``"text"`` or an encoder name (one item)."""

    kind: str
    length: int


@dataclass(frozen=True)
class BitfieldMask:
    """The BAM of one row of ``length`` tokens (module docstring: the fields and the mask)."""

    bits: np.ndarray  # int64 [T]
    kind: np.ndarray  # int8 [T]
    sample: np.ndarray  # int32 [T]
    item: np.ndarray  # int32 [T]
    modalities: tuple[str, ...]

    def __post_init__(self) -> None:
        shapes = {name: np.shape(getattr(self, name)) for name in ("bits", "kind", "sample", "item")}
        if len(set(shapes.values())) != 1 or len(shapes["bits"]) != 1:
            raise ValueError(f"BitfieldMask fields have shapes {shapes}; give each one entry per token, [T]")

    @property
    def length(self) -> int:
        return int(self.bits.shape[0])

    def positions(self) -> np.ndarray:
        """Position of each token inside its sample (RoPE restarts per packed sample, as
        ``LlamaLM.context`` does); padding continues the last sample's count, as the unpacked
        rows' ``arange`` does."""
        t = np.arange(self.length, dtype=np.int64)
        is_start = np.zeros(self.length, dtype=bool)
        if self.length:
            valid = self.sample >= 0
            is_start[0] = True
            is_start[1:] = valid[1:] & (self.sample[1:] != self.sample[:-1])
        start = np.maximum.accumulate(np.where(is_start, t, 0)) if self.length else t
        return t - start


def bitfield_mask(
    samples: Sequence[Sequence[Span]],
    length: int | None = None,
    modalities: Sequence[str] = tuple(MODALITIES),
    item_attention: str = "bidirectional",
) -> BitfieldMask:
    """The BAM of one row holding ``samples`` back to back (a packed row, or one sample), each a
    list of spans in order, right-padded to ``length`` (default: no padding).

    Every non-text span is one item (an image, a clip) of the modality it names; two adjacent
    spans of one modality are two items. Text's word is ``CAUSAL_BIT`` and every kind's bit;
    items' words follow ``item_attention`` (module docstring)."""
    modalities = tuple(modalities)
    if item_attention not in ITEM_ATTENTION:
        raise ValueError(f"item_attention = {item_attention!r}; use one of {list(ITEM_ATTENTION)}")
    if len(modalities) + 1 > MAX_KINDS or len(set(modalities)) != len(modalities) or TEXT in modalities:
        raise ValueError(
            f"modalities = {list(modalities)}: name at most {MAX_KINDS - 1} distinct encoders, none of them "
            f"{TEXT!r}"
        )
    kind_of = {TEXT: 0, **{m: 1 + i for i, m in enumerate(modalities)}}
    kinds, lengths, sample_of = [], [], []
    for s, spans in enumerate(samples):
        for j, span in enumerate(spans):
            if span.kind not in kind_of:
                raise ValueError(
                    f"samples[{s}][{j}].kind = {span.kind!r}; use {TEXT!r} or one of {list(modalities)}"
                )
            if not isinstance(span.length, (int, np.integer)) or span.length < 1:
                raise ValueError(f"samples[{s}][{j}].length = {span.length!r}; use a positive int")
            kinds.append(kind_of[span.kind])
            lengths.append(int(span.length))
            sample_of.append(s)
    used = int(sum(lengths))
    total = used if length is None else length
    if total < used:
        raise ValueError(f"length = {length} but the samples hold {used} tokens; pad to at least {used}")
    span_kind = np.array(kinds, dtype=np.int8)
    span_len = np.array(lengths, dtype=np.int64)
    is_item = span_kind > 0
    everything = (1 << (len(modalities) + 1)) - 1
    item_word = {"bidirectional": CAUSAL_BIT | everything, "causal": CAUSAL_BIT | everything, "isolated": 0}
    span_bits = np.where(is_item, item_word[item_attention], CAUSAL_BIT | everything).astype(np.int64)
    grouped = is_item & (item_attention != "causal")
    span_item = np.where(grouped, np.cumsum(grouped) - 1, -1).astype(np.int32)

    def per_token(values: np.ndarray, fill: int, dtype) -> np.ndarray:
        out = np.full(total, fill, dtype=dtype)
        out[:used] = np.repeat(values, span_len)
        return out

    return BitfieldMask(
        bits=per_token(span_bits, 0, np.int64),
        kind=per_token(span_kind, -1, np.int8),
        sample=per_token(np.array(sample_of, dtype=np.int32), -1, np.int32),
        item=per_token(span_item, -1, np.int32),
        modalities=modalities,
    )


def sample_spans(
    meta: SampleMeta, text_ids: Sequence[int] | np.ndarray, tokenizer: Tokenizer, token_counts: TokenCounts
) -> list[Span]:
    """A sample's spans from what collation reads (``collate_ids``): its text ids, in which every
    modality marker becomes one item of ``item_token_count`` tokens, and its metadata. The spans'
    lengths sum to the sample's collated length."""
    ids = np.asarray(text_ids, dtype=np.int64)
    encoders_of = encoders_by_modality(encoder_modalities(token_counts))
    # a marker's spans are named for the encoders of its modality, in order (the modality, without one)
    marker_id = {tokenizer.token_id(kind.marker): m for m, kind in MODALITY_KINDS.items()}
    kind_of = {encoders_of.get(m, [m])[0]: kind for m, kind in MODALITY_KINDS.items()}
    at = np.flatnonzero(np.isin(ids, list(marker_id)))
    next_item = {enc: 0 for enc in kind_of}
    spans: list[Span] = []
    prev = 0
    for pos in at.tolist():  # one step per item, not per token
        modality = marker_id[int(ids[pos])]
        encs = encoders_of.get(modality, [modality])
        enc = encs[0]
        items = getattr(meta, kind_of[enc].sample_field)
        if enc not in token_counts or next_item[enc] >= len(items):
            raise ValueError(
                f"sample {meta.sample_id}: its text has more {kind_of[enc].marker} markers than "
                f"meta.{kind_of[enc].sample_field} has items, or token_counts has no {enc!r}; regenerate the "
                "sample's metadata or add the encoder to token_counts"
            )
        if pos > prev:
            spans.append(Span(TEXT, pos - prev))
        for e in encs:  # the item's tokens of every encoder of its modality
            spans.append(Span(e, item_token_count(e, token_counts[e], items[next_item[enc]], meta.sample_id)))
        next_item[enc] += 1
        prev = pos + 1
    if ids.size > prev:
        spans.append(Span(TEXT, int(ids.size) - prev))
    for enc, used in next_item.items():
        items = getattr(meta, kind_of[enc].sample_field)
        if used != len(items):
            raise ValueError(
                f"sample {meta.sample_id}: its text has {used} {kind_of[enc].marker} markers but "
                f"meta.{kind_of[enc].sample_field} has {len(items)} items; the text needs one marker per item"
            )
    return spans


def batch_masks(
    metas: Sequence[SampleMeta],
    text_ids: Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    token_counts: TokenCounts,
    pack: bool = False,
    item_attention: str = "bidirectional",
) -> list[BitfieldMask]:
    """One BAM per row of ``collate_ids(metas, text_ids, ..., pack)``: with ``pack`` a single
    row holding every sample, else one row per sample right-padded to the longest."""
    spans = [sample_spans(m, ids, tokenizer, token_counts) for m, ids in zip(metas, text_ids)]
    if pack:
        return [bitfield_mask(spans, item_attention=item_attention)]
    longest = max(sum(s.length for s in row) for row in spans)
    return [bitfield_mask([row], length=longest, item_attention=item_attention) for row in spans]


def decode(bam: BitfieldMask, rows: np.ndarray | Sequence[int], cols: np.ndarray | Sequence[int]) -> np.ndarray:
    """bool ``[len(rows), len(cols)]``: may the token at global position ``rows[i]`` attend the one
    at ``cols[j]``. Positions, not local indices, decide causality, so a CP rank decodes its
    permuted rows against the all-gathered keys directly (cornstarch.md §3.3.6)."""
    q = np.asarray(rows, dtype=np.int64)
    k = np.asarray(cols, dtype=np.int64)
    sq, sk = bam.sample[q][:, None], bam.sample[k][None, :]
    iq, ik = bam.item[q][:, None], bam.item[k][None, :]
    bq = bam.bits[q][:, None]
    kind_k = np.maximum(bam.kind[k], 0).astype(np.int64)[None, :]
    causal = ((bq & CAUSAL_BIT) != 0) & (k[None, :] <= q[:, None]) & (((bq >> kind_k) & 1) != 0)
    padding_self = (sq < 0) & (q[:, None] == k[None, :])
    return ((sq == sk) & (sq >= 0) & (((iq == ik) & (iq >= 0)) | causal)) | padding_self


def dense_mask(bam: BitfieldMask) -> np.ndarray:
    """The full bool ``[T, T]`` mask (True = may attend). T² bits: for tests and small rows."""
    t = np.arange(bam.length)
    return decode(bam, t, t)


def _pieces(bam: BitfieldMask, cuts: np.ndarray) -> np.ndarray:
    """Start positions of the maximal runs inside which every field is constant and no cut
    falls: the granularity at which the mask is made of full, empty and triangular tiles."""
    n = bam.length
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for field in (bam.bits, bam.kind, bam.sample, bam.item):
        change[1:] |= field[1:] != field[:-1]
    change[cuts[cuts < n]] = True
    return np.flatnonzero(change)


def _check_tiles(block_q: int, block_k: int | None) -> int:
    block_k = block_q if block_k is None else block_k
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"{name} = {b!r}; use a positive int (tokens per tile side)")
    return block_k


def _tile_counts(bam: BitfieldMask, block_q: int, block_k: int):
    """Yield ``(first query tile, key tiles, counts)`` chunks of `block_counts`; tiles not yielded
    hold no allowed pair.

    Cut the row wherever a field changes or a tile starts. Between two such pieces the mask is all
    True or all False (keys wholly before or after the queries), and a piece against itself is a
    lower triangle or a full square, so counts follow from the pieces' lengths; `np.add.reduceat`
    sums pieces into tiles. When every sample is one contiguous run (what `bitfield_mask` builds)
    a chunk of query pieces is paired only with the pieces of its own samples, so the work
    follows the non-empty tiles rather than the whole grid."""
    n = bam.length
    starts = _pieces(bam, np.union1d(np.arange(0, n, block_q), np.arange(0, n, block_k)))
    size = np.diff(np.append(starts, n))
    sample, item = bam.sample[starts], bam.item[starts]
    bits, kind = bam.bits[starts], np.maximum(bam.kind[starts], 0).astype(np.int64)
    num_pieces = starts.size
    q_first = np.flatnonzero(np.diff(starts // block_q, prepend=-1))  # first piece of each query tile
    # per piece, the pieces [lo, hi) that may share its sample
    run_start = np.flatnonzero(np.diff(sample, prepend=-2))
    run_end = np.append(run_start[1:], num_pieces)
    run_sample = sample[run_start]
    valid_runs = run_sample >= 0
    if np.unique(run_sample[valid_runs]).size == int(valid_runs.sum()):  # each sample one run
        run_of = np.repeat(np.arange(run_start.size), run_end - run_start)
        own = np.arange(num_pieces)
        lo = np.where(sample >= 0, run_start[run_of], own)  # padding: itself alone
        hi = np.where(sample >= 0, run_end[run_of], own + 1)
    else:
        lo, hi = np.zeros(num_pieces, np.int64), np.full(num_pieces, num_pieces)
    rows_per_chunk = max(1, CHUNK_PAIRS // max(1, num_pieces))
    t0 = 0
    while t0 < q_first.size:
        p0 = q_first[t0]
        t1 = int(np.searchsorted(q_first, p0 + rows_per_chunk, side="left"))
        t1 = max(t1, t0 + 1)
        p1 = q_first[t1] if t1 < q_first.size else num_pieces
        c0, c1 = int(lo[p0:p1].min()), int(hi[p0:p1].max())
        if c0 < c1:
            p = np.arange(p0, p1)[:, None]
            r = np.arange(c0, c1)[None, :]
            same_sample = (sample[p] == sample[r]) & (sample[p] >= 0)
            same_item = (item[p] == item[r]) & (item[p] >= 0)
            attends = ((bits[p] & CAUSAL_BIT) != 0) & (((bits[p] >> kind[r]) & 1) != 0)
            sq, sk = size[p], size[r]
            causal = np.where(r < p, sq * sk, np.where(r == p, sq * (sq + 1) // 2, 0))
            pairs = np.where(same_sample & same_item, sq * sk, np.where(same_sample & attends, causal, 0))
            pairs += np.where((sample[p] < 0) & (r == p), sq, 0)  # padding's diagonal
            by_q = np.add.reduceat(pairs, q_first[t0:t1] - p0, axis=0)
            # key segments: split where a key tile starts (and at c0, which may be mid-tile)
            k_tile = starts[c0:c1] // block_k
            k_cut = np.flatnonzero(np.diff(k_tile, prepend=-1))
            yield t0, k_tile[k_cut], np.add.reduceat(by_q, k_cut, axis=1)
        t0 = t1


def block_counts(bam: BitfieldMask, block_q: int, block_k: int | None = None) -> np.ndarray:
    """int64 ``[ceil(T / block_q), ceil(T / block_k)]``: allowed (query, key) pairs per tile,
    exact, without decoding T² pairs (`_tile_counts`)."""
    block_k = _check_tiles(block_q, block_k)
    n = bam.length
    out = np.zeros((-(-n // block_q), -(-n // block_k)), dtype=np.int64)
    for t0, k_tiles, counts in _tile_counts(bam, block_q, block_k):
        out[t0:t0 + counts.shape[0], k_tiles] = counts
    return out


def nonempty_tiles(bam: BitfieldMask, block_q: int, block_k: int | None = None) -> np.ndarray:
    """int64 per query tile: how many of its key tiles are not ``EMPTY`` (a row sum of
    `block_mask` without the grid: O(non-empty tiles) memory)."""
    block_k = _check_tiles(block_q, block_k)
    out = np.zeros(-(-bam.length // block_q), dtype=np.int64)
    for t0, _, counts in _tile_counts(bam, block_q, block_k):
        out[t0:t0 + counts.shape[0]] = (counts > 0).sum(axis=1)
    return out


def block_mask(bam: BitfieldMask, block_q: int, block_k: int | None = None) -> np.ndarray:
    """int8 tile classes (cornstarch.md §3.3.1's compressed mask): ``EMPTY`` where no pair of the
    tile may attend (the kernel skips it), ``FULL`` where every pair may (no masking needed),
    ``PARTIAL`` otherwise (the tile's mask is decoded from the two BAM slices)."""
    block_k = _check_tiles(block_q, block_k)
    n = bam.length
    out = np.zeros((-(-n // block_q), -(-n // block_k)), dtype=np.int8)  # EMPTY
    for t0, k_tiles, counts in _tile_counts(bam, block_q, block_k):
        rows = np.minimum(block_q, n - np.arange(t0, t0 + counts.shape[0]) * block_q)
        cols = np.minimum(block_k, n - k_tiles * block_k)
        full = counts == rows[:, None] * cols[None, :]
        out[t0:t0 + counts.shape[0], k_tiles] = np.where(counts == 0, EMPTY, np.where(full, FULL, PARTIAL))
    return out
