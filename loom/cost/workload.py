"""The metadata-to-workload rule: what each module computes for a set of samples, from their
metadata alone (docs/architecture.md principle 4). Token counts per encoder item come from the module's
architecture; the LLM's sequence is the text plus every encoder's merged tokens, each generation
request's marker expanded to the generator's ``cond_tokens`` positions; a generator's workload is
its requests' positions at its base resolution (`loom.cost.arch`), one segment per request.

The simulator, the balancing policies and the partitioner all cost samples through this rule,
so a layout decided on metadata is priced exactly as the simulator plays it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from loom.cost.arch import ModelArch, ModuleArch
from loom.cost.model import MicrobatchWork, Workload
from loom.data.collate import GENERATORS
from loom.data.sample import AudioMeta, GenerationMeta, ImageMeta, SampleMeta
from loom.plan.plan import LLM

# which metadata field holds an encoder's items, by the encoder architecture's kind
ITEM_FIELDS = {"vision": "images", "audio": "audios"}


class WorkloadError(ValueError):
    """Metadata the model cannot cost (a modality without an encoder, an unknown batching)."""


def _unknown_kind(name: str, kind: str) -> str:
    return (f"encoder {name!r} has kind {kind!r}, which metadata cannot cost (known kinds: {sorted(ITEM_FIELDS)}); "
            f"set the encoder's architecture kind to one of them, or add the kind's item field to "
            f"loom.cost.workload.ITEM_FIELDS and its token rule to _item_tokens")


def sample_work(arch: ModelArch, metas: list[SampleMeta], llm_batching: str = "packed") -> MicrobatchWork:
    """Per-module `Workload` of a microbatch of samples, from metadata only."""
    work: MicrobatchWork = {}
    kinds = {arch.module(n).kind for n in arch.encoder_names}
    for kind, field_name in ITEM_FIELDS.items():
        if kind not in kinds and any(getattr(m, field_name) for m in metas):
            raise WorkloadError(
                f"the data has {field_name} but the model has no {kind} encoder: add one under "
                f"[model] encoders, or choose a data.mix without {field_name}"
            )
    llm_lengths = [m.text_tokens - len(m.images) - len(m.audios) for m in metas]
    for name in arch.generator_names:
        module = arch.module(name)
        lengths = []
        for b, meta in enumerate(metas):
            for g in meta.generations:
                if g.generator == name:
                    lengths.append(module.num_tokens(g))
                    llm_lengths[b] += module.cond_tokens - 1
        work[name] = Workload.of_lengths(lengths)
    _check_generators(arch, (g.generator for m in metas for g in m.generations))
    for name in arch.encoder_names:
        module = arch.module(name)
        field_name = ITEM_FIELDS.get(module.kind)
        if field_name is None:
            raise WorkloadError(_unknown_kind(name, module.kind))
        lengths = []
        for b, meta in enumerate(metas):
            for item in getattr(meta, field_name):
                lengths.append(module.num_tokens(item))
                llm_lengths[b] += module.llm_tokens(item)
        work[name] = Workload.of_lengths(lengths)
    if llm_batching not in ("packed", "padded"):
        raise WorkloadError(f"data.llm_batching = {llm_batching!r}: choose 'packed' or 'padded'")
    work[LLM] = Workload.of_lengths(llm_lengths) if llm_batching == "packed" else Workload.padded(llm_lengths)
    return work


def _check_generators(arch: ModelArch, asked) -> None:
    known = set(arch.generator_names)
    missing = sorted({g for g in asked if g not in known})
    if missing:
        raise WorkloadError(f"the data asks generators {missing} for images but the model has "
                            f"{arch.generator_names or 'no generator'}: add one to the model, or choose data without "
                            f"generation requests")


# ---- the same rule over arrays (the balancing hot path), and the metadata's wire form ----------
# Segment names a sample's ``segments`` may hold, coded on the wire by their index here.
SEGMENT_NAMES: tuple[str, ...] = ("text", "image", "audio", "generate")  # generate: a generation request
_SEGMENT_CODE = {name: code for code, name in enumerate(SEGMENT_NAMES)}
# generator names a generation request may name, coded on the wire by their index here
GENERATOR_NAMES: tuple[str, ...] = tuple(GENERATORS)
_GENERATOR_CODE = {name: code for code, name in enumerate(GENERATOR_NAMES)}

# A rank's row (`MetadataArrays.to_flat`): a header ``[samples, images, audios, segments, error
# bytes, generations]``; per sample, field after field: ``sample_id``, ``text_tokens``,
# ``image_count``, ``audio_count``, ``segment_count``, ``generation_count``, ``target_tokens``
# (-1: the default count, `SampleMeta.target_tokens` None); then ``(height,
# width)`` per image, ``(num_samples, sample_rate)`` per audio clip, one code per segment, the
# payload error's UTF-8 bytes and ``(height, width, generator code)`` per generation request.
# Each per-sample field is a run of the row, so `from_gathered` copies it out of the gathered
# table for every rank at once (a strided slice when the ranks' sample counts agree).
HEADER = 6
PER_SAMPLE = 7
# ints per sample of the dispatcher's first all-gather round: the per-sample fields and room for
# a few items and segments (a LLaVA-like sample with one image takes 10); a larger share (many
# items, a long error message) takes a second round
GATHER_INTS_PER_SAMPLE = 16


def gather_capacity(batch_size: int, world_size: int) -> int:
    """Width of every rank's row in the dispatcher's first metadata all-gather: fixed from the
    batch size alone, so every rank pads to it without asking the others."""
    if batch_size < 0 or world_size < 1:
        raise WorkloadError(f"gather_capacity(batch_size={batch_size}, world_size={world_size}): the batch "
                            f"size must be >= 0 and the world size >= 1")
    return HEADER + GATHER_INTS_PER_SAMPLE * -(-batch_size // world_size)


def padded_row(row: np.ndarray, width: int) -> np.ndarray:
    """A rank's `to_flat` row cut or zero-padded to ``width`` values: what it contributes to
    one all-gather round (the header always fits, so every rank reads every row's length)."""
    if width < HEADER:
        raise WorkloadError(f"a gathered metadata row needs at least its {HEADER}-value header; width = {width}")
    out = np.zeros(width, dtype=np.int64)
    k = min(width, row.size)
    out[:k] = row[:k]
    return out


def row_lengths(table: np.ndarray) -> np.ndarray:
    """Every row's full length, from the headers of a gathered ``(ranks, width)`` table."""
    h = np.asarray(table, dtype=np.int64)[:, :HEADER]
    return HEADER + PER_SAMPLE * h[:, 0] + 2 * h[:, 1] + 2 * h[:, 2] + h[:, 3] + h[:, 4] + 3 * h[:, 5]


def gathered_bytes(batch_size: int, lengths: Sequence[int] | np.ndarray) -> int:
    """Bytes every rank receives in the dispatcher's metadata all-gather when the ranks' rows
    have ``lengths`` (one per rank): the first round's table (every row padded to
    `gather_capacity`) and, when a row exceeds the capacity, a second round at the longest
    row's length."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    ranks = int(lengths.size)
    capacity = gather_capacity(batch_size, max(ranks, 1))
    longest = int(lengths.max(initial=0))
    return 8 * ranks * (capacity + (longest if longest > capacity else 0))


def _block(table: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Every row's values ``[start[r], stop[r])`` of a 2-D table, back to back in row order, in
    one pass: a slice when every row's block sits at the same columns, a mask otherwise."""
    lo, hi = int(start.min()), int(stop.max())
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    if (start == lo).all() and (stop == hi).all():
        return table[:, lo:hi].reshape(-1)
    cols = np.arange(lo, hi)
    if (start == lo).all():  # one bound per row to compare (the common case: equal shards)
        return table[:, lo:hi][cols < stop[:, None]]
    return table[:, lo:hi][(cols >= start[:, None]) & (cols < stop[:, None])]


def _bounds(count: np.ndarray) -> np.ndarray:
    """``[0, cumsum(count)...]``: sample ``s``'s items are ``[bounds[s], bounds[s + 1])``."""
    out = np.zeros(count.size + 1, dtype=np.int64)
    np.cumsum(count, out=out[1:])
    return out


@dataclass(frozen=True)
class MetadataArrays:
    """A batch's metadata as int64 arrays: the wire form the dispatcher all-gathers (one
    `to_flat` row per rank, `from_gathered` for the table) and what the policies cost, with no
    Python object per sample. It holds everything a `SampleMeta` does (`metas` / `meta` build
    them back where a consumer needs objects).

    Per sample ``s``: ``sample_id[s]``, ``text_tokens[s]`` (text tokens with one marker per item,
    as `SampleMeta`), and how many images, audio clips, segments and generation requests it has
    (``image_count``, ``audio_count``, ``segment_count``, ``generation_count``). The items follow
    in sample order: ``image_hw`` holds ``(height, width)`` per image, ``audio_samples`` /
    ``audio_rate`` each clip's length and sample rate, ``segment_code`` each segment as an index
    of `SEGMENT_NAMES`, ``generation_hw`` / ``generation_code`` each requested image's size and
    generator (an index of `GENERATOR_NAMES`). ``error_bytes`` holds the UTF-8 bytes of payload
    errors, ``error_owner`` the part (rank) each byte came from. ``target_tokens[s]`` is
    `SampleMeta.target_tokens`, -1 for ``None``. ``image_owner`` / ``audio_owner`` /
    ``segment_owner`` (each item's sample) are derived."""

    sample_id: np.ndarray
    text_tokens: np.ndarray
    image_count: np.ndarray
    image_hw: np.ndarray  # (images, 2)
    audio_count: np.ndarray
    audio_samples: np.ndarray
    audio_rate: np.ndarray
    segment_count: np.ndarray
    segment_code: np.ndarray
    error_owner: np.ndarray
    error_bytes: np.ndarray
    generation_count: np.ndarray
    generation_hw: np.ndarray  # (generations, 2)
    generation_code: np.ndarray
    target_tokens: np.ndarray | None = None  # per sample; None: -1 for every sample

    def __post_init__(self) -> None:
        if self.target_tokens is None:  # frozen: set once, here
            object.__setattr__(self, "target_tokens", np.full(self.text_tokens.shape[0], -1, dtype=np.int64))

    @property
    def num_samples(self) -> int:
        return int(self.text_tokens.shape[0])

    @property
    def row_length(self) -> int:
        """Values of `to_flat`."""
        return (HEADER + PER_SAMPLE * self.num_samples + 2 * self.image_hw.shape[0] + 2 * self.audio_samples.size
                + self.segment_code.size + self.error_bytes.size + 3 * self.generation_code.size)

    # each item's sample (ascending), computed on first use: costing and parsing use the counts
    @cached_property
    def image_owner(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_samples, dtype=np.int64), self.image_count)

    @cached_property
    def audio_owner(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_samples, dtype=np.int64), self.audio_count)

    @cached_property
    def segment_owner(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_samples, dtype=np.int64), self.segment_count)

    @cached_property
    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(images, audios, segments)``: sample ``s``'s items of each are ``[b[s], b[s + 1])``."""
        return _bounds(self.image_count), _bounds(self.audio_count), _bounds(self.segment_count)

    @cached_property
    def generation_bounds(self) -> np.ndarray:
        """Sample ``s``'s generation requests are ``[b[s], b[s + 1])``."""
        return _bounds(self.generation_count)

    @staticmethod
    def from_metas(metas: Sequence[SampleMeta], error: str | None = None) -> "MetadataArrays":
        """The arrays of ``metas`` (and a payload ``error`` message, if any)."""
        n = len(metas)
        hw = [(m.height, m.width) for meta in metas for m in meta.images]
        clips = [(m.num_samples, m.sample_rate) for meta in metas for m in meta.audios]
        try:
            codes = [_SEGMENT_CODE[name] for meta in metas for name in meta.segments]
        except KeyError:
            sid, bad = next((m.sample_id, s) for m in metas for s in m.segments if s not in _SEGMENT_CODE)
            raise WorkloadError(
                f"sample {sid}: segment {bad!r} is not one of the metadata codec's segment names "
                f"{SEGMENT_NAMES}; name the sample's segments from them, or add the name to "
                f"loom.cost.workload.SEGMENT_NAMES") from None
        clip_a = np.asarray(clips, dtype=np.int64).reshape(-1, 2)
        err = np.frombuffer((error or "").encode(), dtype=np.uint8).astype(np.int64)
        try:
            gens = [(g.height, g.width, _GENERATOR_CODE[g.generator]) for meta in metas for g in meta.generations]
        except KeyError:
            sid, bad = next((m.sample_id, g.generator) for m in metas for g in m.generations
                            if g.generator not in _GENERATOR_CODE)
            raise WorkloadError(
                f"sample {sid}: generator {bad!r} is not one of the metadata codec's generator names "
                f"{GENERATOR_NAMES}; add its marker to loom.data.collate.GENERATORS") from None
        gen_a = np.asarray(gens, dtype=np.int64).reshape(-1, 3)

        def per_sample(values) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=n)

        return MetadataArrays(
            per_sample(m.sample_id for m in metas), per_sample(m.text_tokens for m in metas),
            per_sample(len(m.images) for m in metas), np.asarray(hw, dtype=np.int64).reshape(-1, 2),
            per_sample(len(m.audios) for m in metas), clip_a[:, 0].copy(), clip_a[:, 1].copy(),
            per_sample(len(m.segments) for m in metas), np.asarray(codes, dtype=np.int64),
            np.zeros(err.size, dtype=np.int64), err,
            per_sample(len(m.generations) for m in metas), gen_a[:, :2].copy(), gen_a[:, 2].copy(),
            per_sample(-1 if m.target_tokens is None else m.target_tokens for m in metas))

    def to_flat(self) -> np.ndarray:
        """One int64 row (see `HEADER`): what a rank contributes to the metadata all-gather
        (`from_flat` / `from_gathered` read it back)."""
        head = [self.num_samples, self.image_hw.shape[0], self.audio_samples.size, self.segment_code.size,
                self.error_bytes.size, self.generation_code.size]
        clips = np.stack([self.audio_samples, self.audio_rate], axis=1)
        gens = np.concatenate([self.generation_hw, self.generation_code[:, None]], axis=1)
        return np.concatenate([
            np.array(head, dtype=np.int64), self.sample_id, self.text_tokens, self.image_count, self.audio_count,
            self.segment_count, self.generation_count, self.target_tokens, self.image_hw.reshape(-1), clips.reshape(-1),
            self.segment_code, self.error_bytes, gens.reshape(-1)]).astype(np.int64, copy=False)

    @staticmethod
    def from_flat(flat: np.ndarray) -> "MetadataArrays":
        """One `to_flat` row back (its length must be exactly what its header says)."""
        flat = np.asarray(flat, dtype=np.int64)
        if flat.ndim != 1 or flat.size < HEADER or int(row_lengths(flat[None])[0]) != flat.size:
            raise WorkloadError(f"flat metadata of shape {flat.shape} does not match its {HEADER}-value header; "
                                f"build it with MetadataArrays.to_flat")
        return MetadataArrays.from_gathered(flat[None])

    @staticmethod
    def from_gathered(rows: np.ndarray | Sequence[np.ndarray]) -> "MetadataArrays":
        """The global batch from every rank's `to_flat` row, in rank order: the ``(ranks, width)``
        table a padded all-gather returns (values past a row's length are ignored), or a list of
        rows. A handful of array passes whatever the rank count; ``error_owner`` is the row."""
        if isinstance(rows, np.ndarray) and rows.ndim == 2:
            table = rows if rows.dtype == np.int64 else rows.astype(np.int64)
        else:
            rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
            table = np.zeros((len(rows), max((r.size for r in rows), default=HEADER)), dtype=np.int64)
            for k, r in enumerate(rows):
                table[k, :r.size] = r
            if rows and (row_lengths(table) > [r.size for r in rows]).any():
                raise WorkloadError("gathered metadata rows are shorter than their headers say; build each with "
                                    "MetadataArrays.to_flat")
        ranks, width = table.shape
        if ranks == 0:
            return MetadataArrays.from_metas([])
        # the headers, copied once as contiguous columns: the checks and the field offsets read them
        head = table[:, :HEADER].T.copy() if width >= HEADER else None
        if head is None or (head < 0).any() or (
                HEADER + PER_SAMPLE * head[0] + 2 * head[1] + 2 * head[2] + head[3] + head[4] + 3 * head[5]
                > width).any():
            raise WorkloadError("gathered metadata rows are shorter than their headers say (or the headers are "
                                "negative); build each with MetadataArrays.to_flat")
        n, i, a, s, e, g = head
        if (n == n[0]).all() and n[0] > 0:  # every rank sent as many samples: each field is a strided slice
            fields = table[:, HEADER:HEADER + PER_SAMPLE * int(n[0])].reshape(ranks, PER_SAMPLE, int(n[0]))
            sample_id, text, image_count, audio_count, segment_count, generation_count, targets = (
                fields[:, k, :].reshape(-1) for k in range(PER_SAMPLE))
            counts = (image_count, audio_count, segment_count, generation_count)
            row_starts = np.arange(0, ranks * int(n[0]), int(n[0]))
            per_row = np.stack([np.add.reduceat(c, row_starts) for c in counts], axis=1)
        else:
            sample_id, text, image_count, audio_count, segment_count, generation_count, targets = (
                _block(table, HEADER + k * n, HEADER + (k + 1) * n) for k in range(PER_SAMPLE))
            counts = (image_count, audio_count, segment_count, generation_count)
            last = np.cumsum(n)
            per_row = np.stack([(c := _bounds(count))[last] - c[last - n] for count in counts], axis=1)
        negative = min(c.min(initial=0) for c in counts) < 0
        # every row's per-sample counts must add up to its header's
        if negative or not np.array_equal(per_row, np.stack([i, a, s, g], axis=1)):
            raise WorkloadError("gathered metadata rows have item or segment counts that disagree with their "
                                "headers; build each with MetadataArrays.to_flat")
        start = HEADER + PER_SAMPLE * n
        hw = _block(table, start, start + 2 * i).reshape(-1, 2)
        clips = _block(table, start + 2 * i, start + 2 * i + 2 * a).reshape(-1, 2)
        start = start + 2 * i + 2 * a
        codes = _block(table, start, start + s)
        err = _block(table, start + s, start + s + e)
        gens = _block(table, start + s + e, start + s + e + 3 * g).reshape(-1, 3)
        if codes.size and (codes.min() < 0 or codes.max() >= len(SEGMENT_NAMES)):
            raise WorkloadError(f"gathered metadata holds a segment code outside 0..{len(SEGMENT_NAMES) - 1} "
                                f"({SEGMENT_NAMES}); build each row with MetadataArrays.to_flat")
        if gens.size and (gens[:, 2].min() < 0 or gens[:, 2].max() >= len(GENERATOR_NAMES)):
            raise WorkloadError(f"gathered metadata holds a generator code outside 0..{len(GENERATOR_NAMES) - 1} "
                                f"({GENERATOR_NAMES}); build each row with MetadataArrays.to_flat")
        return MetadataArrays(sample_id, text, image_count, hw, audio_count, clips[:, 0].copy(), clips[:, 1].copy(),
                              segment_count, codes, np.repeat(np.arange(ranks, dtype=np.int64), e), err,
                              generation_count, gens[:, :2].copy(), gens[:, 2].copy(), targets)

    @staticmethod
    def concat(parts: Sequence["MetadataArrays"]) -> "MetadataArrays":
        """The global batch from the ranks' shards, in rank order (``error_owner`` becomes the
        part's index)."""
        def cat(values: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(values).astype(np.int64, copy=False) if values else np.zeros(0, dtype=np.int64)

        return MetadataArrays(
            cat([p.sample_id for p in parts]), cat([p.text_tokens for p in parts]),
            cat([p.image_count for p in parts]), cat([p.image_hw.reshape(-1) for p in parts]).reshape(-1, 2),
            cat([p.audio_count for p in parts]), cat([p.audio_samples for p in parts]),
            cat([p.audio_rate for p in parts]), cat([p.segment_count for p in parts]),
            cat([p.segment_code for p in parts]),
            cat([np.full(p.error_bytes.size, k, dtype=np.int64) for k, p in enumerate(parts)]),
            cat([p.error_bytes for p in parts]), cat([p.generation_count for p in parts]),
            cat([p.generation_hw.reshape(-1) for p in parts]).reshape(-1, 2),
            cat([p.generation_code for p in parts]), cat([p.target_tokens for p in parts]))

    def errors(self) -> dict[int, str]:
        """The payload error messages, by the part (rank) that sent them."""
        if not self.error_bytes.size:
            return {}
        cut = np.flatnonzero(np.diff(self.error_owner)) + 1
        return {int(owner[0]): bytes(chunk.astype(np.uint8).tolist()).decode(errors="replace")
                for owner, chunk in zip(np.split(self.error_owner, cut), np.split(self.error_bytes, cut))}

    def metas(self) -> list[SampleMeta]:
        """Every sample's `SampleMeta` (a Python object per sample: only where a consumer needs them)."""
        images = [ImageMeta(h, w) for h, w in self.image_hw.tolist()]
        audios = [AudioMeta(k, r) for k, r in zip(self.audio_samples.tolist(), self.audio_rate.tolist())]
        names = [SEGMENT_NAMES[c] for c in self.segment_code.tolist()]
        gens = self._generations(slice(None))
        ib, ab, sb = (b.tolist() for b in self.bounds)
        gb = self.generation_bounds.tolist()
        return [SampleMeta(sid, text, tuple(images[ib[k]:ib[k + 1]]), tuple(audios[ab[k]:ab[k + 1]]),
                           tuple(names[sb[k]:sb[k + 1]]), tuple(gens[gb[k]:gb[k + 1]]), None if t < 0 else t)
                for k, (sid, text, t) in enumerate(zip(self.sample_id.tolist(), self.text_tokens.tolist(),
                                                       self.target_tokens.tolist()))]

    def _generations(self, rows: slice) -> list[GenerationMeta]:
        return [GenerationMeta(GENERATOR_NAMES[c], h, w)
                for (h, w), c in zip(self.generation_hw[rows].tolist(), self.generation_code[rows].tolist())]

    def meta(self, s: int) -> SampleMeta:
        """Sample ``s``'s `SampleMeta`."""
        if not 0 <= s < self.num_samples:
            raise IndexError(f"sample {s} of a batch of {self.num_samples}: use 0 <= s < {self.num_samples}")

        i, a, g = (slice(int(b[s]), int(b[s + 1])) for b in self.bounds)
        gb = self.generation_bounds
        return SampleMeta(int(self.sample_id[s]), int(self.text_tokens[s]),
                          tuple(ImageMeta(h, w) for h, w in self.image_hw[i].tolist()),
                          tuple(AudioMeta(k, r) for k, r in zip(self.audio_samples[a].tolist(),
                                                                self.audio_rate[a].tolist())),
                          tuple(SEGMENT_NAMES[c] for c in self.segment_code[g].tolist()),
                          tuple(self._generations(slice(int(gb[s]), int(gb[s + 1])))),
                          None if self.target_tokens[s] < 0 else int(self.target_tokens[s]))


@dataclass(frozen=True)
class SampleTokens:
    """Per module, every sample's ``tokens`` and ``attn_sq`` (sum over its attention segments
    of length², as `Workload`) as int64 arrays; ``llm_lengths`` is the LLM sequence length."""

    tokens: dict[str, np.ndarray]
    attn_sq: dict[str, np.ndarray]
    llm_lengths: np.ndarray


def _item_tokens(module: ModuleArch, meta: MetadataArrays) -> tuple[np.ndarray, np.ndarray]:
    """`ModuleArch.num_tokens` of every item of the module's kind, vectorised: (each sample's
    item count, each item's tokens)."""
    if module.item_tokens:  # a fixed count per item (`ModuleArch.item_tokens`)
        count = meta.image_count if module.kind == "vision" else meta.audio_count
        items = meta.image_hw.shape[0] if module.kind == "vision" else meta.audio_samples.size
        return count, np.full(items, module.item_tokens, dtype=np.int64)
    if module.kind == "vision":
        hw = meta.image_hw
        if module.resize and hw.size:  # Qwen2-VL's processor resizes first (`ModuleArch.resize`)
            from loom.data.hf_processor import smart_resize

            hw = smart_resize(hw, *module.resize)
        if hw.size and 0 <= hw.min() and hw.max() < 2**31:  # int32 floor division: twice as fast, same values
            h = hw.astype(np.int32)
            h //= module.patch
            return meta.image_count, h[:, 0].astype(np.int64) * h[:, 1]
        return meta.image_count, (hw[:, 0] // module.patch) * (hw[:, 1] // module.patch)
    if module.kind == "audio":
        frames = 1 + meta.audio_samples // module.hop_length  # centred STFT frames
        return meta.audio_count, (frames - 1) // module.layers[0].stride + 1
    raise WorkloadError(_unknown_kind(module.name, module.kind))


def per_sample_sum(count: np.ndarray, values: np.ndarray, bounds: np.ndarray | None = None) -> np.ndarray:
    """Each sample's sum of its items' ``values`` (items in sample order, ``count[s]`` of them
    for sample ``s``, ``count >= 0``), exactly: the items themselves (a copy) when no sample has
    two, else in two array passes over the running sum. ``bounds``: ``_bounds(count)``, when the
    caller already has it."""
    if count.size and int(count.max()) <= 1:
        # at most one item per sample (LLaVA-like data): a copy, or a scatter past the text-only samples
        if values.size == count.size:
            return values.copy()
        out = np.zeros(count.size, dtype=values.dtype)
        out[count.astype(bool)] = values
        return out
    cum = np.zeros(values.size + 1, dtype=values.dtype)
    np.cumsum(values, out=cum[1:])
    return np.diff(cum[_bounds(count) if bounds is None else bounds])  # one gather, not two


def sample_tokens(arch: ModelArch, meta: MetadataArrays | Sequence[SampleMeta]) -> SampleTokens:
    """`sample_work` of every sample on its own (packed), from metadata arrays: the per-sample
    quantities the balancing policies cost, with no Python object per sample."""
    if not isinstance(meta, MetadataArrays):
        meta = MetadataArrays.from_metas(meta)
    kinds = {arch.module(e).kind for e in arch.encoder_names}
    for kind, items in (("vision", meta.image_hw.shape[0]), ("audio", meta.audio_samples.size)):
        if kind not in kinds and items:
            field_name = ITEM_FIELDS[kind]
            raise WorkloadError(
                f"the data has {field_name} but the model has no {kind} encoder: add one under "
                f"[model] encoders, or choose a data.mix without {field_name}"
            )
    llm = (meta.text_tokens - meta.image_count).astype(np.int64, copy=False)  # a new array: summed in place
    llm -= meta.audio_count
    tokens: dict[str, np.ndarray] = {}
    attn_sq: dict[str, np.ndarray] = {}
    for name in arch.encoder_names:
        module = arch.module(name)
        count, t = _item_tokens(module, meta)  # a new array
        t = t.astype(np.int64, copy=False)
        top = int(count.max()) if count.size else 0
        if top == 1 and t.size == count.size:  # one item per sample: the items' values are the samples'
            tokens[name], attn_sq[name] = t, t * t
            llm += t // module.merge if module.merge != 1 else t
            continue
        # the items' bounds, once per batch, where some sample has several items
        bounds = meta.bounds[0 if module.kind == "vision" else 1] if top > 1 else None
        tokens[name] = per_sample_sum(count, t, bounds)
        attn_sq[name] = per_sample_sum(count, t * t, bounds)
        llm += per_sample_sum(count, t // module.merge if module.merge != 1 else t, bounds)
    if meta.generation_code.size:
        _check_generators(arch, (GENERATOR_NAMES[c] for c in np.unique(meta.generation_code).tolist()))
    generators = arch.generator_names
    owner = np.repeat(np.arange(meta.num_samples), meta.generation_count) if generators else None
    for name in generators:
        module = arch.module(name)
        mine = meta.generation_code == _GENERATOR_CODE[name] if name in _GENERATOR_CODE else \
            np.zeros(meta.generation_code.shape, dtype=bool)
        hw = meta.generation_hw[mine].astype(np.int64)
        per = (hw[:, 0] // module.patch) * (hw[:, 1] // module.patch)
        tokens[name] = np.bincount(owner[mine], weights=per, minlength=meta.num_samples).astype(np.int64)
        attn_sq[name] = np.bincount(owner[mine], weights=per * per, minlength=meta.num_samples).astype(np.int64)
        llm += np.bincount(owner[mine], minlength=meta.num_samples) * (module.cond_tokens - 1)
    tokens[LLM] = np.maximum(llm, 0)
    attn_sq[LLM] = tokens[LLM] * tokens[LLM]
    return SampleTokens(tokens, attn_sq, llm)
