"""The metadata-to-workload rule: what each module computes for a set of samples, from their
metadata alone (docs/architecture.md principle 4). Token counts per encoder item come from the module's
architecture; the LLM's sequence is the text plus every encoder's merged tokens.

The simulator, the balancing policies and the partitioner all cost samples through this rule,
so a layout decided on metadata is priced exactly as the simulator plays it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.cost.arch import ModelArch, ModuleArch
from loom.cost.model import MicrobatchWork, Workload
from loom.data.sample import SampleMeta
from loom.plan.plan import LLM

# which metadata field holds an encoder's items, by the encoder architecture's kind
ITEM_FIELDS = {"vision": "images", "audio": "audios"}


class WorkloadError(ValueError):
    """Metadata the model cannot cost (a modality without an encoder, an unknown batching)."""


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
    for name in arch.encoder_names:
        module = arch.module(name)
        field_name = ITEM_FIELDS.get(module.kind)
        if field_name is None:
            raise WorkloadError(f"encoder {name!r} has kind {module.kind!r}; simulation knows {sorted(ITEM_FIELDS)}")
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


# ---- the same rule over arrays (the balancing hot path) ---------------------------------------
@dataclass(frozen=True)
class MetadataArrays:
    """A batch's metadata as flat int64 arrays, what the dispatcher all-gathers (one int tensor
    per rank, `to_flat` / `from_flat`) and the policies cost without a Python object per sample.

    ``text_tokens[s]``: sample ``s``'s text tokens (with one marker per item, as `SampleMeta`);
    per item, ``image_owner`` / ``audio_owner`` name the sample (ascending), ``image_hw`` holds
    ``(height, width)`` and ``audio_samples`` the waveform length."""

    text_tokens: np.ndarray
    image_owner: np.ndarray
    image_hw: np.ndarray  # (images, 2)
    audio_owner: np.ndarray
    audio_samples: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.text_tokens.shape[0])

    @staticmethod
    def from_metas(metas: Sequence[SampleMeta]) -> "MetadataArrays":
        img = [(b, m.height, m.width) for b, meta in enumerate(metas) for m in meta.images]
        aud = [(b, m.num_samples) for b, meta in enumerate(metas) for m in meta.audios]
        img_a = np.asarray(img, dtype=np.int64).reshape(-1, 3)
        aud_a = np.asarray(aud, dtype=np.int64).reshape(-1, 2)
        return MetadataArrays(np.fromiter((m.text_tokens for m in metas), dtype=np.int64, count=len(metas)),
                              img_a[:, 0].copy(), img_a[:, 1:].copy(), aud_a[:, 0].copy(), aud_a[:, 1].copy())

    def to_flat(self) -> np.ndarray:
        """One int64 array: ``[samples, images, audios, text..., image owner..., height...,
        width..., audio owner..., audio samples...]`` (`from_flat` reads it back)."""
        return np.concatenate([
            np.array([self.num_samples, self.image_owner.size, self.audio_owner.size], dtype=np.int64),
            self.text_tokens, self.image_owner, self.image_hw[:, 0], self.image_hw[:, 1],
            self.audio_owner, self.audio_samples]).astype(np.int64, copy=False)

    @staticmethod
    def from_flat(flat: np.ndarray) -> "MetadataArrays":
        flat = np.asarray(flat, dtype=np.int64)
        if flat.ndim != 1 or flat.size < 3:
            raise WorkloadError(f"flat metadata must be a 1-D int array with a 3-value header; got shape {flat.shape}")
        n, i, a = (int(x) for x in flat[:3])
        if min(n, i, a) < 0 or flat.size != 3 + n + 3 * i + 2 * a:
            raise WorkloadError(f"flat metadata header (samples {n}, images {i}, audios {a}) does not match its "
                                f"{flat.size} values; build it with MetadataArrays.to_flat")
        parts = np.split(flat[3:], np.cumsum([n, i, i, i, a]))
        return MetadataArrays(parts[0], parts[1], np.stack([parts[2], parts[3]], axis=1), parts[4], parts[5])

    @staticmethod
    def from_gathered(rows: np.ndarray | Sequence[np.ndarray]) -> "MetadataArrays":
        """The global batch from every rank's `to_flat` array (a list, or the rows of one
        zero-padded ``(ranks, width)`` int array, as a padded all-gather returns them), in rank
        order, with a few array passes whatever the rank count."""
        if not isinstance(rows, np.ndarray):
            # no padded table: the rows back to back, each field gathered by index below
            lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
            flat = np.concatenate(rows).astype(np.int64, copy=False) if len(rows) else np.zeros(0, dtype=np.int64)
        else:
            table = np.asarray(rows, dtype=np.int64)
            lengths = np.full(len(table), table.shape[1], dtype=np.int64)
            flat = table.ravel()
        row_start = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        head = flat[row_start[:, None] + np.arange(3)] if len(lengths) else np.zeros((0, 3), dtype=np.int64)
        if (lengths < 3).any() or (3 + head[:, 0] + 3 * head[:, 1] + 2 * head[:, 2] > lengths).any():
            raise WorkloadError("gathered metadata rows are shorter than their headers say; build each with "
                                "MetadataArrays.to_flat")

        def field(offset: np.ndarray, size: np.ndarray) -> np.ndarray:
            # every row's `size` values from `offset` within the row, back to back: one index pass
            before = np.cumsum(size) - size
            return flat[np.repeat(row_start + offset - before, size) + np.arange(int(size.sum()))]

        n, i, a = head[:, 0], head[:, 1], head[:, 2]
        offsets = np.cumsum(n) - n
        return MetadataArrays(field(np.full_like(n, 3), n), field(3 + n, i) + np.repeat(offsets, i),
                              np.stack([field(3 + n + i, i), field(3 + n + 2 * i, i)], axis=1),
                              field(3 + n + 3 * i, a) + np.repeat(offsets, a), field(3 + n + 3 * i + a, a))

    @staticmethod
    def concat(parts: Sequence["MetadataArrays"]) -> "MetadataArrays":
        """The global batch from the ranks' shards, in rank order (owners shifted by offset)."""
        offsets = np.cumsum([0] + [p.num_samples for p in parts])
        return MetadataArrays(
            np.concatenate([p.text_tokens for p in parts]).astype(np.int64, copy=False),
            np.concatenate([p.image_owner + o for p, o in zip(parts, offsets)]).astype(np.int64, copy=False),
            np.concatenate([p.image_hw.reshape(-1, 2) for p in parts]).astype(np.int64, copy=False),
            np.concatenate([p.audio_owner + o for p, o in zip(parts, offsets)]).astype(np.int64, copy=False),
            np.concatenate([p.audio_samples for p in parts]).astype(np.int64, copy=False))


@dataclass(frozen=True)
class SampleTokens:
    """Per module, every sample's ``tokens`` and ``attn_sq`` (sum over its attention segments
    of length², as `Workload`) as int64 arrays; ``llm_lengths`` is the LLM sequence length."""

    tokens: dict[str, np.ndarray]
    attn_sq: dict[str, np.ndarray]
    llm_lengths: np.ndarray


def _item_tokens(module: ModuleArch, meta: MetadataArrays) -> tuple[np.ndarray, np.ndarray]:
    """`ModuleArch.num_tokens` of every item of the module's kind, vectorised: (owners, tokens)."""
    if module.kind == "vision":
        hw = meta.image_hw
        return meta.image_owner, (hw[:, 0] // module.patch) * (hw[:, 1] // module.patch)
    if module.kind == "audio":
        frames = 1 + meta.audio_samples // module.hop_length  # centred STFT frames
        return meta.audio_owner, (frames - 1) // module.layers[0].stride + 1
    raise WorkloadError(f"encoder {module.name!r} has kind {module.kind!r}; costing knows {sorted(ITEM_FIELDS)}")


def sample_tokens(arch: ModelArch, meta: MetadataArrays | Sequence[SampleMeta]) -> SampleTokens:
    """`sample_work` of every sample on its own (packed), from metadata arrays: the per-sample
    quantities the balancing policies cost, with no Python object per sample."""
    if not isinstance(meta, MetadataArrays):
        meta = MetadataArrays.from_metas(meta)
    n = meta.num_samples
    kinds = {arch.module(e).kind for e in arch.encoder_names}
    for kind, owners in (("vision", meta.image_owner), ("audio", meta.audio_owner)):
        if kind not in kinds and owners.size:
            field_name = ITEM_FIELDS[kind]
            raise WorkloadError(
                f"the data has {field_name} but the model has no {kind} encoder: add one under "
                f"[model] encoders, or choose a data.mix without {field_name}"
            )
    llm = meta.text_tokens - np.bincount(meta.image_owner, minlength=n) - np.bincount(meta.audio_owner, minlength=n)
    tokens: dict[str, np.ndarray] = {}
    attn_sq: dict[str, np.ndarray] = {}
    for name in arch.encoder_names:
        module = arch.module(name)
        owner, t = _item_tokens(module, meta)
        tokens[name] = np.bincount(owner, weights=t, minlength=n).astype(np.int64)
        attn_sq[name] = np.bincount(owner, weights=t * t, minlength=n).astype(np.int64)
        llm = llm + np.bincount(owner, weights=t // module.merge, minlength=n).astype(np.int64)
    llm = llm.astype(np.int64)
    tokens[LLM] = np.where(llm > 0, llm, 0)
    attn_sq[LLM] = tokens[LLM] * tokens[LLM]
    return SampleTokens(tokens, attn_sq, llm)
