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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from loom.data.sample import AudioMeta, Batch, ImageMeta, Sample, SampleMeta
from loom.data.tokenizer import AUDIO_MARKER, GEN_IMAGE_MARKER, IMAGE_MARKER, Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Modality:
    """What a kind of sample item is to collation: its text ``marker``, the key of its inputs
    in ``Batch.modality_inputs[encoder]`` and the attribute holding the items on both ``Sample``
    (payload) and ``SampleMeta`` (metadata); the model's input key for audio ("waveforms") is
    not the sample's field name ("audios")."""

    marker: str
    input_key: str
    sample_field: str


# Modality -> how its items appear. An encoder consumes one modality (`encoder_modality`).
MODALITY_KINDS: dict[str, Modality] = {
    "image": Modality(IMAGE_MARKER, "images", "images"),
    "audio": Modality(AUDIO_MARKER, "waveforms", "audios"),
}

# The encoder names that imply their modality; any other name's counter says it (`TokenCounter`).
DEFAULT_MODALITY: dict[str, str] = {"vision": "image", "audio": "audio"}

# The default names' views (encoder name -> (marker, input key) / sample field), for callers
# that name encoders vision and audio.
MODALITIES: dict[str, tuple[str, str]] = {
    name: (MODALITY_KINDS[m].marker, MODALITY_KINDS[m].input_key) for name, m in DEFAULT_MODALITY.items()}
SAMPLE_FIELDS: dict[str, str] = {name: MODALITY_KINDS[m].sample_field for name, m in DEFAULT_MODALITY.items()}


@dataclass(frozen=True)
class TokenCounter:
    """An encoder's token count of one item (``count(item_meta)``) and the ``modality`` of its
    items: what lets an encoder of any name take part in collation (`encoder_modality`)."""

    modality: str
    count: Callable[[Any], int]
    placeholder: int | None = None  # its placeholder id where it is not the modality's marker's

    def __call__(self, item: ImageMeta | AudioMeta) -> int:
        return self.count(item)


TokenCounts = Mapping[str, Callable[[ImageMeta | AudioMeta], int]]


def encoder_modality(encoder: str, count_fn: Any = None) -> str:
    """The modality encoder ``encoder`` consumes: its counter's ``modality`` (a `TokenCounter`),
    else the one its name implies (`DEFAULT_MODALITY`); a ``ValueError`` naming it otherwise."""
    modality = getattr(count_fn, "modality", None) or DEFAULT_MODALITY.get(encoder)
    if modality not in MODALITY_KINDS:
        raise ValueError(
            f"token_counts[{encoder!r}]: encoder {encoder!r} names no modality; pass "
            f"TokenCounter(modality, count) with a modality of {list(MODALITY_KINDS)} (names "
            f"{list(DEFAULT_MODALITY)} imply theirs)")
    return modality


def encoder_modalities(token_counts: TokenCounts) -> dict[str, str]:
    """Each encoder's modality (`encoder_modality`), in ``token_counts``' order. Several encoders
    may consume one modality (a second vision tower): each marker then expands to every one's
    tokens for the item, in that order."""
    return {encoder: encoder_modality(encoder, fn) for encoder, fn in token_counts.items()}


def encoders_by_modality(modalities: Mapping[str, str]) -> dict[str, list[str]]:
    """Modality -> the encoders consuming it, in order (a marker's expansion order)."""
    out: dict[str, list[str]] = {}
    for encoder, modality in modalities.items():
        out.setdefault(modality, []).append(encoder)
    return out

# Generator name -> its generation marker in the text. Each marker becomes ``cond_tokens``
# copies of itself: positions the LLM embeds as tokens, whose final hidden states condition the
# generator (loom.model.generator); like placeholders they are never next-token targets.
GENERATORS: dict[str, str] = {"image": GEN_IMAGE_MARKER}


@dataclass(frozen=True)
class GenerationSpec:
    """What collation needs of a model's generator: LLM states per item, and the
    ``[C, H, W]`` shape of the images it makes (targets must match it)."""

    cond_tokens: int
    target_shape: tuple[int, int, int]


Generations = Mapping[str, GenerationSpec]


def generation_seed(sample_id: int, item: int, step: int) -> int:
    """The noise seed of a sample's ``item``-th generation at training ``step``: a hash of the
    three, so every rank and the single process draw the same noise for it."""
    return int(np.random.SeedSequence([sample_id, item, step]).generate_state(1)[0])


def check_generations(meta: SampleMeta, generations: Generations) -> None:
    """Every generation request of ``meta`` names one of the model's ``generations`` and asks for
    an image of the size it makes; a ``ValueError`` naming the sample and the field otherwise."""
    for i, g in enumerate(meta.generations):
        spec = generations.get(g.generator)
        if spec is None:
            raise ValueError(
                f"sample {meta.sample_id}: meta.generations[{i}] asks generator {g.generator!r} for an image but the "
                f"model has no generator {g.generator!r} (it has {sorted(generations)}); add one to the model or "
                "filter such samples out")
        if (3, g.height, g.width) != tuple(spec.target_shape):
            raise ValueError(
                f"sample {meta.sample_id}: meta.generations[{i}] is a [3, {g.height}, {g.width}] image but generator "
                f"{g.generator!r} makes {list(spec.target_shape)}: resize the sample's target or the generator's "
                "image_size")


def _items_meta(meta: SampleMeta, modality: str) -> tuple[ImageMeta | AudioMeta, ...]:
    return getattr(meta, MODALITY_KINDS[modality].sample_field)


def _check_encoders(token_counts: TokenCounts) -> dict[str, str]:
    return encoder_modalities(token_counts)


def item_token_count(
    encoder: str, count_fn: Callable, item: ImageMeta | AudioMeta, sample_id: int
) -> int:
    """``count_fn(item)``, the encoder's output tokens for one item, checked to be a positive int."""
    n = count_fn(item)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"sample {sample_id}: token_counts[{encoder!r}] returned {n!r} for {item}; "
            "it must return a positive int (the encoder's output tokens for that item)"
        )
    return n


def _default_name(modality: str) -> str:
    return next(n for n, m in DEFAULT_MODALITY.items() if m == modality)


def _check_modalities_covered(meta: SampleMeta, modalities: Mapping[str, str]) -> None:
    """Every modality of ``meta``'s items has an encoder in ``modalities`` (encoder -> modality)."""
    for modality, kind in MODALITY_KINDS.items():
        items = _items_meta(meta, modality)
        if items and modality not in modalities.values():
            raise ValueError(
                f"sample {meta.sample_id} has {len(items)} {kind.sample_field} but token_counts has no "
                f"{modality} encoder (no {_default_name(modality)!r} entry); add one, or filter such samples out"
            )


def count_tokens(meta: SampleMeta, token_counts: TokenCounts,
                 generations: Generations | None = None) -> dict[str, int]:
    """Tokens each module processes for one sample, from metadata alone.

    Returns ``{encoder: total tokens of its items, ..., "llm": expanded sequence length}`` for
    every encoder in ``token_counts``, where the LLM length is the text's ids (with BOS/EOS,
    one per marker) minus the markers plus the encoder tokens that replace them (and, for each
    generation, its ``cond_tokens`` generation positions). It equals the unpadded length of the
    sample's row in ``collate``.
    """
    modalities = _check_encoders(token_counts)
    _check_modalities_covered(meta, modalities)
    counts: dict[str, int] = {}
    llm = meta.text_tokens
    for encoder, count_fn in token_counts.items():
        items = _items_meta(meta, modalities[encoder])
        total = sum(item_token_count(encoder, count_fn, item, meta.sample_id) for item in items)
        counts[encoder] = total
        llm += total  # each marker id is replaced by its item's tokens of every encoder of the modality
    for modality in set(modalities.values()):
        llm -= len(_items_meta(meta, modality))
    if meta.generations:
        check_generations(meta, generations or {})
        for g in meta.generations:
            llm += generations[g.generator].cond_tokens - 1
    counts["llm"] = llm
    return counts


def target_count(meta: SampleMeta) -> int:
    """Target tokens of a sample from metadata alone: every text token after BOS predicts
    the next text token except where that is a modality marker (expanded to placeholders,
    never targets) or a generation marker (likewise) and at the last position: `collate`'s
    label rule. A sample whose loss covers only some tokens (``meta.target_tokens``, a chat's
    assistant turns) counts those."""
    if meta.target_tokens is not None:
        return meta.target_tokens
    return meta.text_tokens - len(meta.images) - len(meta.audios) - len(meta.generations) - 1


def flagged_ids(tokenizer: Any, text: str, target_spans: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """The ids of ``text`` as collation takes them: ``tokenizer.encode(text)``, or with
    ``target_spans`` (`Sample.target_spans`) each token that does not start inside a span as
    ``~id`` (negative): not a target, so the label of the position before it is -100. The flag
    travels with the ids (the dispatcher moves them as they are) and `collate_ids` clears it."""
    if target_spans is None:
        return tokenizer.encode(text)
    ids, starts = tokenizer.encode_offsets(text)
    return [i if any(a <= s < b for a, b in target_spans) else ~i for i, s in zip(ids, starts)]


def flagged_target_count(ids: Sequence[int], marker_ids: Sequence[int]) -> int:
    """Targets of `flagged_ids` output with target spans: tokens after the first that are flagged as
    targets and are not markers (placeholders are never targets): ``SampleMeta.target_tokens``."""
    markers = set(marker_ids)
    return sum(1 for i in ids[1:] if i >= 0 and i not in markers)


def collate(
    samples: Sequence[Sample],
    tokenizer: Tokenizer,
    token_counts: TokenCounts,
    placeholder_ids: Mapping[str, int] | None = None,
    pack: bool = False,
    generations: Generations | None = None,
    step: int = 0,
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
      placeholder, a generation position or padding, and at the row's last position.
    - ``generations[name]`` (a model's generators, `GenerationSpec`): each generation marker
      expands to ``cond_tokens`` copies of itself; ``generation_inputs[name]`` holds the
      targets, in sample order, and their noise seeds for training ``step``
      (`generation_seed`).

    Raises ``ValueError`` when a sample's payload disagrees with its metadata, when its text
    has a different number of markers than items, when it has items of an encoder that
    ``token_counts`` does not cover, or asks a generator the model lacks, or for a target of
    another size than the generator makes.
    """
    if not samples:
        raise ValueError("collate: got no samples; pass at least one")
    modalities = _check_encoders(token_counts)
    modality_inputs: dict[str, dict[str, list[torch.Tensor]]] = {
        enc: {MODALITY_KINDS[m].input_key: []} for enc, m in modalities.items()
    }
    generations = dict(generations or {})
    generation_inputs: dict[str, dict[str, list]] = {g: {"targets": [], "seeds": []} for g in generations}
    all_ids: list[list[int]] = []
    for sample in samples:
        sample.check_payload()
        all_ids.append(flagged_ids(tokenizer, sample.text, sample.target_spans))
        for encoder, inputs in modality_inputs.items():
            kind = MODALITY_KINDS[modalities[encoder]]
            inputs[kind.input_key].extend(getattr(sample, kind.sample_field))
    input_ids, labels, segments = collate_ids(
        [s.meta for s in samples], all_ids, tokenizer, token_counts, placeholder_ids, pack, generations
    )  # checks every generation request against the model's generators
    for sample in samples:
        for i, (g, target) in enumerate(zip(sample.meta.generations, sample.targets)):
            generation_inputs[g.generator]["targets"].append(target)
            generation_inputs[g.generator]["seeds"].append(generation_seed(sample.meta.sample_id, i, step))
    return Batch(
        input_ids=input_ids,
        labels=labels,
        modality_inputs=modality_inputs,
        sample_ids=[s.meta.sample_id for s in samples],
        segments=segments,
        generation_inputs=generation_inputs,
    )


def collate_ids(
    metas: Sequence[SampleMeta],
    text_ids: Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    token_counts: TokenCounts,
    placeholder_ids: Mapping[str, int] | None = None,
    pack: bool = False,
    generations: Generations | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """``(input_ids, labels, segments)`` of `collate` from metadata and each sample's text ids
    alone, without any modality payload: what an LLM rank needs (the encoders' outputs arrive as
    activations). Checks that each text has one marker per item and the metadata's length.
    ``segments`` is ``None`` unless ``pack``."""
    if not metas:
        raise ValueError("collate: got no samples; pass at least one")
    modalities = _check_encoders(token_counts)
    placeholder_ids = dict(placeholder_ids or {})
    unknown = sorted(set(placeholder_ids) - set(token_counts) - set(DEFAULT_MODALITY))
    if unknown:
        raise ValueError(
            f"placeholder_ids names unknown encoders {unknown}; use names from {list(token_counts)}"
        )
    # per modality: its marker's id and the encoders that consume it; per encoder its placeholder
    # (the first encoder of a modality: the marker's id by default; a further one needs its own)
    marker = {m: tokenizer.token_id(kind.marker) for m, kind in MODALITY_KINDS.items()}
    encoders_of = encoders_by_modality(modalities)
    encoder_of = {m: encs[0] for m, encs in encoders_of.items()}
    placeholder = {}
    for m, encs in encoders_of.items():
        for j, enc in enumerate(encs):
            own = placeholder_ids.get(enc, getattr(token_counts[enc], "placeholder", None))
            if j and own is None:
                raise ValueError(
                    f"placeholder_ids has no entry for {enc!r}: a second {m} encoder (after {encs[0]!r}) needs a "
                    f"placeholder id of its own; pass token_counts=token_counters(model) or "
                    f"placeholder_ids=model.placeholder_ids")
            placeholder[enc] = marker[m] if own is None else own
    if len(set(placeholder.values())) != len(placeholder):
        raise ValueError(f"placeholder_ids {placeholder} give two encoders one id; give each its own")
    # every sample's ids back to back: the expansion and the labels are a few array passes
    rows_in = [ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64) for ids in text_ids]
    lengths = np.array([r.size for r in rows_in], dtype=np.int64)
    flat = np.concatenate(rows_in).astype(np.int64, copy=False)
    not_target = flat < 0  # `flagged_ids` marks tokens outside a sample's target spans as ~id
    if not_target.any():
        flat = np.where(not_target, ~flat, flat)
    starts = np.cumsum(lengths) - lengths
    is_marker = {m: flat == marker[m] for m in MODALITY_KINDS}
    num_markers = {m: _row_sums(mask, starts, lengths).tolist() for m, mask in is_marker.items()}
    item_tokens: dict[str, list[int]] = {enc: [] for enc in modalities}
    generations = dict(generations or {})
    gen_marker = {g: tokenizer.token_id(m) for g, m in GENERATORS.items() if tokenizer.has(m)}
    is_gen = {g: flat == mid for g, mid in gen_marker.items()}
    num_gen = {g: _row_sums(m, starts, lengths).tolist() for g, m in is_gen.items()}
    for b, (meta, n) in enumerate(zip(metas, lengths.tolist())):
        check_generations(meta, generations)
        for g in GENERATORS:
            asked = sum(1 for x in meta.generations if x.generator == g)
            found = num_gen[g][b] if g in num_gen else 0
            if found != asked:
                raise ValueError(
                    f"sample {meta.sample_id}: the text has {found} {GENERATORS[g]} markers but meta.generations "
                    f"asks generator {g!r} for {asked} images; the text needs one marker per generation"
                    + ("" if found == 0 or g in generations else f", and the model has no generator {g!r}"))
        for modality, kind in MODALITY_KINDS.items():
            num_items = len(_items_meta(meta, modality))
            found = num_markers[modality][b]
            if found != num_items:
                raise ValueError(
                    f"sample {meta.sample_id}: {encoder_of.get(modality) or _default_name(modality)} has {found} {kind.marker} markers "
                    f"in the text but {num_items} items; the text needs one marker per item"
                )
        if n != meta.text_tokens:
            raise ValueError(
                f"sample {meta.sample_id}: the text has {n} token ids but meta.text_tokens says "
                f"{meta.text_tokens}; regenerate the sample's metadata"
            )
        _check_modalities_covered(meta, modalities)
        for encoder, modality in modalities.items():
            item_tokens[encoder].extend(item_token_count(encoder, token_counts[encoder], item, meta.sample_id)
                                        for item in _items_meta(meta, modality))
    # a modality with k encoders: each of its markers first becomes k copies, the j-th for encoder j
    copies = np.ones_like(flat)
    for m, encs in encoders_of.items():
        if len(encs) > 1:
            copies[is_marker[m]] = len(encs)
    copy_index = np.zeros(flat.size, dtype=np.int64)
    if (copies > 1).any():
        at = np.repeat(np.arange(flat.size), copies)
        copy_index = np.arange(at.size) - np.repeat(np.cumsum(copies) - copies, copies)
        flat, not_target = flat[at], not_target[at]
        is_marker = {m: mask[at] for m, mask in is_marker.items()}
        is_gen = {g: mask[at] for g, mask in is_gen.items()}
        lengths = _row_sums(copies, starts, lengths)
        starts = np.cumsum(lengths) - lengths
    repeats = np.ones_like(flat)
    ids = flat.copy()
    is_placeholder = np.zeros(flat.size, dtype=bool)
    for m, encs in encoders_of.items():
        for j, encoder in enumerate(encs):
            if item_tokens[encoder]:  # each marker (copy) becomes as many placeholder ids as its item's tokens
                mask = is_marker[m] & (copy_index == j) if len(encs) > 1 else is_marker[m]
                repeats[mask] = item_tokens[encoder]
                ids[mask] = placeholder[encoder]
                is_placeholder |= mask
    for g, mask in is_gen.items():  # each generation marker becomes cond_tokens copies of itself
        if g in generations and mask.any():
            repeats[mask] = generations[g].cond_tokens
            is_placeholder |= mask
    expanded = np.repeat(ids, repeats)
    placeholder_at = np.repeat(is_placeholder | not_target, repeats)  # neither is a next-token target
    row_lengths = _row_sums(repeats, starts, lengths)
    row_ends = np.cumsum(row_lengths)
    # Next-token targets. Placeholders are masked by position, not by id, so a placeholder id that
    # equals a real word's id cannot leak into the loss; a sample's last position predicts nothing
    # (not the next sample's BOS when packed).
    targets = np.full_like(expanded, IGNORE_INDEX)
    targets[:-1] = np.where(placeholder_at[1:], IGNORE_INDEX, expanded[1:])
    targets[row_ends[row_lengths > 0] - 1] = IGNORE_INDEX
    if pack:  # one row: the samples back to back; each keeps its own shifted labels
        return torch.from_numpy(expanded)[None], torch.from_numpy(targets)[None], row_lengths.tolist()
    batch_size, length = len(rows_in), int(row_lengths.max())
    input_ids = np.full((batch_size, length), tokenizer.pad_id, dtype=np.int64)
    labels = np.full((batch_size, length), IGNORE_INDEX, dtype=np.int64)
    keep = np.arange(length) < row_lengths[:, None]  # each row's first row_lengths[b] positions, in order
    input_ids[keep] = expanded
    labels[keep] = targets
    return torch.from_numpy(input_ids), torch.from_numpy(labels), None


def _row_sums(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's sum of ``values[starts[b]:starts[b] + lengths[b]]`` (rows back to back)."""
    out = np.zeros(lengths.size, dtype=np.int64)
    filled = lengths > 0  # reduceat would read an empty row's next value
    if filled.any():
        out[filled] = np.add.reduceat(values.astype(np.int64, copy=False), starts[filled])
    return out


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
