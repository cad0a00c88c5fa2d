"""Collation of samples into a ``Batch``, per-module token counts, and microbatch splitting.

The LLM sees one sequence per sample in which every modality marker (``<image>``,
``<audio>``) has been expanded to as many placeholder ids as its encoder emits tokens; the
model later scatters the projected encoder outputs into those positions. How many tokens an
encoder emits for an item is the encoder's business, so it comes in as ``token_counts``: one
function per encoder from the item's metadata (``ImageMeta`` / ``AudioMeta``) to a count. The
same functions drive ``count_tokens``, which the planner and balancer use on metadata alone
(docs/architecture.md principle 4); a test checks that both agree on the sequence length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from loom.data.sample import AudioMeta, Batch, ImageMeta, Sample, SampleMeta
from loom.data.tokenizer import AUDIO_MARKER, IMAGE_MARKER, Tokenizer

IGNORE_INDEX = -100

# Encoder name -> (text marker, key of its inputs in ``Batch.modality_inputs[name]``).
MODALITIES: dict[str, tuple[str, str]] = {
    "vision": (IMAGE_MARKER, "images"),
    "audio": (AUDIO_MARKER, "waveforms"),
}

# Encoder name -> the attribute holding its items on both ``Sample`` (payload) and
# ``SampleMeta`` (metadata). Separate from MODALITIES because the model's input key for audio
# ("waveforms") is not the sample's field name ("audios").
SAMPLE_FIELDS: dict[str, str] = {"vision": "images", "audio": "audios"}

TokenCounts = Mapping[str, Callable[[ImageMeta | AudioMeta], int]]


def _items_meta(meta: SampleMeta, encoder: str) -> tuple[ImageMeta | AudioMeta, ...]:
    return getattr(meta, SAMPLE_FIELDS[encoder])


def _check_encoders(token_counts: TokenCounts) -> None:
    unknown = sorted(set(token_counts) - set(MODALITIES))
    if unknown:
        raise ValueError(
            f"token_counts names unknown encoders {unknown}; use names from {list(MODALITIES)}"
        )


def _item_tokens(
    encoder: str, count_fn: Callable, item: ImageMeta | AudioMeta, sample_id: int
) -> int:
    n = count_fn(item)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"sample {sample_id}: token_counts[{encoder!r}] returned {n!r} for {item}; "
            "it must return a positive int (the encoder's output tokens for that item)"
        )
    return n


def _check_modalities_covered(meta: SampleMeta, token_counts: TokenCounts) -> None:
    for encoder in MODALITIES:
        items = _items_meta(meta, encoder)
        if items and encoder not in token_counts:
            raise ValueError(
                f"sample {meta.sample_id} has {len(items)} {SAMPLE_FIELDS[encoder]} but "
                f"token_counts has no {encoder!r} entry; add one, or filter such samples out"
            )


def count_tokens(meta: SampleMeta, token_counts: TokenCounts) -> dict[str, int]:
    """Tokens each module processes for one sample, from metadata alone.

    Returns ``{encoder: total tokens of its items, ..., "llm": expanded sequence length}`` for
    every encoder in ``token_counts``, where the LLM length is the text's ids (with BOS/EOS,
    one per marker) minus the markers plus the encoder tokens that replace them. It equals the
    unpadded length of the sample's row in ``collate``.
    """
    _check_encoders(token_counts)
    _check_modalities_covered(meta, token_counts)
    counts: dict[str, int] = {}
    llm = meta.text_tokens
    for encoder, count_fn in token_counts.items():
        items = _items_meta(meta, encoder)
        total = sum(_item_tokens(encoder, count_fn, item, meta.sample_id) for item in items)
        counts[encoder] = total
        llm += total - len(items)  # each marker id is replaced by the item's tokens
    counts["llm"] = llm
    return counts


def target_count(meta: SampleMeta) -> int:
    """Target tokens of a sample from metadata alone: every text token after BOS predicts
    the next text token except where that is a modality marker (expanded to placeholders,
    never targets) and at the last position: `collate`'s label rule."""
    return meta.text_tokens - len(meta.images) - len(meta.audios) - 1


def collate(
    samples: Sequence[Sample],
    tokenizer: Tokenizer,
    token_counts: TokenCounts,
    placeholder_ids: Mapping[str, int] | None = None,
    pack: bool = False,
) -> Batch:
    """Tokenize, expand markers to placeholders, right-pad and build next-token labels.

    With ``pack`` the samples go one after another into a single row ``[1, L]`` instead
    (``Batch.segments`` holds their lengths; no padding at all).

    - ``token_counts[encoder](item_meta)`` is the number of placeholder ids an item expands
      to; only encoders named here get an entry in ``modality_inputs`` (with every item of
      the batch, in sample order, possibly an empty list).
    - ``placeholder_ids[encoder]`` overrides the placeholder id (default: the tokenizer's id
      of the encoder's marker).
    - ``labels[b, t]`` is ``input_ids[b, t + 1]``, or -100 where that next position is a
      placeholder or padding, and at the row's last position.

    Raises ``ValueError`` when a sample's payload disagrees with its metadata, when its text
    has a different number of markers than items, or when it has items of an encoder that
    ``token_counts`` does not cover.
    """
    if not samples:
        raise ValueError("collate: got no samples; pass at least one")
    _check_encoders(token_counts)
    modality_inputs: dict[str, dict[str, list[torch.Tensor]]] = {
        enc: {MODALITIES[enc][1]: []} for enc in MODALITIES if enc in token_counts
    }
    all_ids: list[list[int]] = []
    for sample in samples:
        sample.check_payload()
        all_ids.append(tokenizer.encode(sample.text))
        for encoder, inputs in modality_inputs.items():
            inputs[MODALITIES[encoder][1]].extend(getattr(sample, SAMPLE_FIELDS[encoder]))
    input_ids, labels, segments = collate_ids(
        [s.meta for s in samples], all_ids, tokenizer, token_counts, placeholder_ids, pack
    )
    return Batch(
        input_ids=input_ids,
        labels=labels,
        modality_inputs=modality_inputs,
        sample_ids=[s.meta.sample_id for s in samples],
        segments=segments,
    )


def collate_ids(
    metas: Sequence[SampleMeta],
    text_ids: Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    token_counts: TokenCounts,
    placeholder_ids: Mapping[str, int] | None = None,
    pack: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """``(input_ids, labels, segments)`` of `collate` from metadata and each sample's text ids
    alone, without any modality payload: what an LLM rank needs (the encoders' outputs arrive as
    activations). Checks that each text has one marker per item and the metadata's length.
    ``segments`` is ``None`` unless ``pack``."""
    if not metas:
        raise ValueError("collate: got no samples; pass at least one")
    _check_encoders(token_counts)
    placeholder_ids = dict(placeholder_ids or {})
    unknown = sorted(set(placeholder_ids) - set(MODALITIES))
    if unknown:
        raise ValueError(
            f"placeholder_ids names unknown encoders {unknown}; use names from {list(MODALITIES)}"
        )
    marker_to_encoder = {tokenizer.token_id(marker): enc for enc, (marker, _) in MODALITIES.items()}
    placeholder = {
        enc: placeholder_ids.get(enc, tokenizer.token_id(marker))
        for enc, (marker, _) in MODALITIES.items()
    }
    rows: list[list[int]] = []
    placeholder_rows: list[list[bool]] = []
    for meta, ids_in in zip(metas, text_ids):
        for encoder, (marker, _) in MODALITIES.items():
            num_markers = sum(1 for i in ids_in if marker_to_encoder.get(i) == encoder)
            num_items = len(_items_meta(meta, encoder))
            if num_markers != num_items:
                raise ValueError(
                    f"sample {meta.sample_id}: {encoder} has {num_markers} {marker} markers in "
                    f"the text but {num_items} items; the text needs one marker per item"
                )
        if len(ids_in) != meta.text_tokens:
            raise ValueError(
                f"sample {meta.sample_id}: the text has {len(ids_in)} token ids but meta.text_tokens says "
                f"{meta.text_tokens}; regenerate the sample's metadata"
            )
        _check_modalities_covered(meta, token_counts)

        ids: list[int] = []
        is_placeholder: list[bool] = []
        next_item = {enc: 0 for enc in MODALITIES}
        for token in ids_in:
            encoder = marker_to_encoder.get(int(token))
            if encoder is None:
                ids.append(int(token))
                is_placeholder.append(False)
                continue
            item = _items_meta(meta, encoder)[next_item[encoder]]
            next_item[encoder] += 1
            n = _item_tokens(encoder, token_counts[encoder], item, meta.sample_id)
            ids.extend([placeholder[encoder]] * n)
            is_placeholder.extend([True] * n)
        rows.append(ids)
        placeholder_rows.append(is_placeholder)

    segments = [len(r) for r in rows] if pack else None
    if pack:  # one row: the samples back to back; each keeps its own shifted labels
        rows, placeholder_rows = [[t for r in rows for t in r]], [[p for r in placeholder_rows for p in r]]
        ends = set(itertools.accumulate(segments))
    batch_size, length = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((batch_size, length), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, is_placeholder) in enumerate(zip(rows, placeholder_rows)):
        row = torch.tensor(ids, dtype=torch.long)
        input_ids[b, : len(ids)] = row
        # Next-token targets. Placeholders are masked by position, not by id, so a placeholder
        # id that equals a real word's id cannot leak into the loss.
        targets = row[1:].clone()
        targets[torch.tensor(is_placeholder[1:], dtype=torch.bool)] = IGNORE_INDEX
        if pack:  # a sample's last position predicts nothing (not the next sample's BOS)
            targets[torch.tensor(sorted(e - 1 for e in ends if e < len(ids)), dtype=torch.long)] = IGNORE_INDEX
        labels[b, : len(ids) - 1] = targets
    return input_ids, labels, segments


T = TypeVar("T")


def split_microbatches(items: Sequence[T], num_microbatches: int) -> list[list[T]]:
    """Split ``items`` into ``num_microbatches`` contiguous runs whose sizes differ by at most 1.

    The first ``len(items) % num_microbatches`` runs get the extra item. Nothing is dropped or
    duplicated; order is kept.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: use at least 1")
    if len(items) < num_microbatches:
        raise ValueError(
            f"cannot split {len(items)} items into {num_microbatches} microbatches: every "
            f"microbatch needs at least one item; use at most {len(items)} microbatches or a "
            f"batch of at least {num_microbatches} samples"
        )
    base, extra = divmod(len(items), num_microbatches)
    out: list[list[Any]] = []
    start = 0
    for m in range(num_microbatches):
        size = base + (1 if m < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out
