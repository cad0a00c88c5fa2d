"""LLaVA-style conversation records as a sample source (``data.source = "llava"``).

A record is one JSON object::

    {"id": "000012",
     "image": "images/000012_0.png" | ["...", ...],      # optional, relative to the root
     "audio": "audio/000012_0.wav" | ["...", ...],        # optional, relative to the root
     "conversations": [{"from": "human", "value": "<image>"},
                       {"from": "gpt", "value": "one shape : a red square ."}]}

The sample's text is the turns' values joined by single spaces, with every ``<image>`` /
``<audio>`` marker made a word of its own (LLaVA writes ``"<image>\\nWhat is ..."``); its
``k``-th ``<image>`` marker stands for the ``k``-th image, likewise for audio, and the counts
must match. Sample ``i`` is the ``i``-th record (``SampleMeta.sample_id = i``); the record's
``id`` names it in errors.

With ``chat`` (``data.chat_template``, a `loom.data.hf_tokenizer.HFTokenizer` with a chat
template) the text is instead the conversation rendered by the template (roles ``human`` /
``user``, ``gpt`` / ``assistant``, ``system``), and the loss covers the assistant turns only:
the sample's ``target_spans`` and ``meta.target_tokens``.

`RecordSource` holds what the LLaVA file and the WebDataset shards (`loom.data.webdataset`)
share: parsing a record, metadata from the media files' headers (`meta`, no payload decoded),
and the decoded sample (`__getitem__`), whose metadata equals `meta`'s. A subclass says where
record ``i`` is (`_record`, `_where`) and how to open one of its media files (`_open`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar


from loom.data.collate import flagged_ids, flagged_target_count
from loom.data.media import DataError, audio_length, decode_audio, decode_image, image_size
from loom.data.sample import AudioMeta, ImageMeta, Sample, SampleMeta
from loom.data.tokenizer import AUDIO_MARKER, IMAGE_MARKER

SKIP_HINT = 'or set data.on_error = "skip" to skip such samples'
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(AUDIO_MARKER)})")
T = TypeVar("T")


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class TextTokenizer(Protocol):
    """What a record source needs of a tokenizer: the ids of a text, BOS/EOS included, and a
    marker's id (with ``chat``: also ``encode_offsets`` and ``render_chat``, as `HFTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...

    def token_id(self, token: str) -> int: ...


@dataclass(frozen=True)
class Record:
    """A parsed record: its ``text`` (markers as words) and its media references, in order."""

    index: int
    id: str
    text: str
    images: tuple[str, ...]
    audios: tuple[str, ...]
    turns: tuple[tuple[str, str], ...] = ()  # (the record's "from", "value"), in order
    target_spans: tuple[tuple[int, int], ...] | None = None  # with chat: the assistant turns in text


def conversation_text(values: list[str]) -> str:
    """The turns' values as one text: joined by spaces, each marker a word, whitespace collapsed."""
    return " ".join(_MARKERS.sub(r" \1 ", " ".join(values)).split())


def text_segments(text: str) -> tuple[str, ...]:
    """Segment order of a text: each marker its own segment (wherever it stands), runs of
    anything else "text"."""
    segments: list[str] = []
    for part in _MARKERS.split(text):
        if part in (IMAGE_MARKER, AUDIO_MARKER):
            segments.append("image" if part == IMAGE_MARKER else "audio")
        elif part.strip() and (not segments or segments[-1] != "text"):
            segments.append("text")
    return tuple(segments)


def _refs(raw: dict[str, Any], key: str) -> tuple[str, ...] | None:
    value = raw.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def parse_record(raw: Any, index: int, where: str) -> Record:
    """Check one record and read its text and media references; a one-line `DataError` naming
    the sample, the record and the fix otherwise."""
    if not isinstance(raw, dict):
        raise DataError(f"sample {index} ({where}): a record must be a JSON object, got {type(raw).__name__}; "
                        f"write {{\"id\": ..., \"conversations\": [...]}}")
    rid = str(raw.get("id", index))
    name = f"sample {index} (id {rid!r}, {where})"
    turns = raw.get("conversations")
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
        raise DataError(f"{name}: 'conversations' must be a non-empty list of {{\"from\": ..., \"value\": \"...\"}} "
                        f"turns; fix the record {SKIP_HINT}")
    images, audios = _refs(raw, "image"), _refs(raw, "audio")
    for key, refs in (("image", images), ("audio", audios)):
        if refs is None:
            raise DataError(f"{name}: {key!r} must be a path or a list of paths; fix the record {SKIP_HINT}")
    text = conversation_text([t["value"] for t in turns])
    words = text.split()
    for marker, key, refs in ((IMAGE_MARKER, "image", images), (AUDIO_MARKER, "audio", audios)):
        n = words.count(marker)
        if n != len(refs):
            raise DataError(f"{name}: {n} {marker} markers but {len(refs)} {key} files; give each {key} "
                            f"one marker in the conversation, {SKIP_HINT}")
    turns_ = tuple((str(t.get("from", "")), t["value"]) for t in turns)
    return Record(index, rid, text, images, audios, turns_)


def chat_record(rec: Record, tokenizer: Any, where: str) -> Record:
    """``rec`` with its conversation rendered by ``tokenizer``'s chat template (`HFTokenizer.
    render_chat`) and the assistant turns as ``target_spans``."""
    name = f"sample {rec.index} (id {rec.id!r}, {where})"
    unknown = sorted({role for role, _ in rec.turns if role not in ROLES})
    if unknown:
        raise DataError(f"{name}: turns from {unknown} have no chat role; use 'from' values of {sorted(ROLES)} "
                        f"{SKIP_HINT}")
    try:
        text, spans = tokenizer.render_chat([(ROLES[role], value) for role, value in rec.turns])
    except ValueError as e:
        raise DataError(f"{name}: {' '.join(str(e).split())}") from e
    return dataclasses.replace(rec, text=text, target_spans=spans)


class RecordSource:
    """Samples from LLaVA-style records: `meta` from the media headers, `__getitem__` decoded.
    ``tokenizer`` counts ``text_tokens`` (the run's tokenizer)."""

    def __init__(self, tokenizer: TextTokenizer, chat: bool = False) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self._markers: Sequence[int] = (tokenizer.token_id(IMAGE_MARKER), tokenizer.token_id(AUDIO_MARKER))

    # -- what a subclass provides ----------------------------------------------------------------
    def __len__(self) -> int:
        raise NotImplementedError

    def _record(self, index: int) -> Any:
        """The raw record ``index`` (a JSON value)."""
        raise NotImplementedError

    def _where(self, index: int) -> str:
        """Where record ``index`` is, for messages (e.g. ``train.json entry 12``)."""
        raise NotImplementedError

    def _open(self, record: Record, ref: str) -> tuple[BinaryIO, str]:
        """The media file ``ref`` of ``record`` opened for reading, and its name for messages;
        `DataError` when it is missing."""
        raise NotImplementedError

    # -- the source ------------------------------------------------------------------------------
    def record(self, index: int) -> Record:
        """Record ``index``, parsed and checked."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} is out of range: the source has {len(self)} samples")
        rec = parse_record(self._record(index), index, self._where(index))
        return chat_record(rec, self.tokenizer, self._where(index)) if self.chat else rec

    def meta(self, index: int) -> SampleMeta:
        """Sample ``index``'s metadata from the record and its media files' headers: no pixel or
        waveform is decoded."""
        rec = self.record(index)
        images = tuple(ImageMeta(*self._read(rec, ref, image_size)) for ref in rec.images)
        audios = tuple(AudioMeta(*self._read(rec, ref, audio_length)) for ref in rec.audios)
        return self._meta(rec, images, audios)

    def __getitem__(self, index: int) -> Sample:
        rec = self.record(index)
        images = [self._read(rec, ref, decode_image) for ref in rec.images]
        decoded = [self._read(rec, ref, decode_audio) for ref in rec.audios]
        audios = [clip for clip, _ in decoded]
        meta = self._meta(rec, tuple(ImageMeta(int(im.shape[1]), int(im.shape[2])) for im in images),
                          tuple(AudioMeta(int(clip.shape[0]), rate) for clip, rate in decoded))
        return Sample(meta=meta, text=rec.text, images=images, audios=audios, target_spans=rec.target_spans)

    def _meta(self, rec: Record, images: tuple[ImageMeta, ...], audios: tuple[AudioMeta, ...]) -> SampleMeta:
        ids = flagged_ids(self.tokenizer, rec.text, rec.target_spans)
        targets = None if rec.target_spans is None else flagged_target_count(ids, self._markers)
        return SampleMeta(sample_id=rec.index, text_tokens=len(ids), images=images, audios=audios,
                          segments=text_segments(rec.text), target_tokens=targets)

    def _read(self, rec: Record, ref: str, read: Callable[[BinaryIO, str], T]) -> T:
        """``read(file, name)`` on media file ``ref``, its errors naming the sample too."""
        try:
            file, name = self._open(rec, ref)
            with file:
                return read(file, name)
        except DataError as e:
            raise DataError(f"sample {rec.index} (id {rec.id!r}, {self._where(rec.index)}): {e}; replace the file "
                            f"{SKIP_HINT}") from e


def _missing(path: Path) -> DataError:
    return DataError(f"file {path} is missing")


class LlavaSource(RecordSource):
    """Samples of a LLaVA-style JSON file (a list of records) or JSON Lines file (``.jsonl``, one
    record a line), media paths relative to ``root`` (default: the file's directory)."""

    def __init__(self, path: str | Path, tokenizer: TextTokenizer, root: str | Path | None = None,
                 chat: bool = False) -> None:
        super().__init__(tokenizer, chat)
        self.path = Path(path)
        self.root = Path(root) if root else self.path.parent
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(f"LLaVA file {self.path} cannot be read ({e.strerror or e}); check data.path") from e
        try:
            if self.path.suffix == ".jsonl":
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"LLaVA file {self.path} is not valid JSON (line {e.lineno}: {e.msg}); fix the file") from e
        if not isinstance(records, list) or not records:
            raise DataError(f"LLaVA file {self.path}: expected a non-empty JSON list of records; fix data.path")
        self.records: list[Any] = records

    def __len__(self) -> int:
        return len(self.records)

    def _record(self, index: int) -> Any:
        return self.records[index]

    def _where(self, index: int) -> str:
        return f"{self.path.name} entry {index}"

    def _open(self, record: Record, ref: str) -> tuple[BinaryIO, str]:
        path = self.root / ref
        try:
            return open(path, "rb"), str(path)
        except FileNotFoundError as e:
            raise _missing(path) from e
        except OSError as e:
            raise DataError(f"file {path} cannot be opened ({e.strerror or e})") from e

