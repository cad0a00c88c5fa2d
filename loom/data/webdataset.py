"""WebDataset-style tar shards as a sample source (``data.source = "webdataset"``).

A sample is the members of a shard that share a *key* (the member name up to the first dot of
its file name, as WebDataset groups them): ``<key>.json`` holds the sample's LLaVA-style record
(`loom.data.llava`), whose media references are the *extensions* of the sample's other
members, e.g. ``{"image": ["0.png", "1.png"], "audio": "0.wav", "conversations": [...]}`` for
``<key>.0.png``, ``<key>.1.png``, ``<key>.0.wav``.

Random access by index: the shards' tar headers are read once, at construction (a header is 512
bytes; no member's data is read), into an index of each member's shard, data offset and size.
Sample ``i`` is the ``i``-th key in shard order, then member order. A media file is then a
window of its shard (`_Member`), so Pillow and soundfile read only the header bytes for `meta`
and the member's bytes for a payload; nothing is extracted.
"""

from __future__ import annotations

import glob
import io
import json
import posixpath
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loom.data.llava import Record, RecordSource, TextTokenizer
from loom.data.media import DataError


@dataclass(frozen=True)
class MemberRef:
    """Where a member's data lies: ``size`` bytes at ``offset`` of shard ``shard``."""

    shard: int
    offset: int
    size: int


class _Member(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + size)`` of a shard file."""

    def __init__(self, path: Path, ref: MemberRef) -> None:
        super().__init__()
        self._file = open(path, "rb")
        self._start, self._size, self._pos = ref.offset, ref.size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        if n == 0:
            return 0
        self._file.seek(self._start + self._pos)
        data = self._file.read(n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def shard_paths(path: str | Path) -> list[Path]:
    """The shards of ``path``: a ``.tar`` file, a directory (its ``*.tar``, sorted) or a glob
    pattern (sorted); `DataError` when there are none."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.tar"))
    elif p.is_file():
        found = [p]
    else:
        found = sorted(Path(s) for s in glob.glob(str(path)))
    if not found:
        raise DataError(f"WebDataset path {path}: no .tar shards there; check data.path (a .tar file, a directory "
                        f"of .tar files or a glob pattern)")
    return found


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name: the key runs to the first dot of the file name."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem), ext


class WebDatasetSource(RecordSource):
    """Samples of WebDataset-style tar shards (see the module's docstring)."""

    def __init__(self, path: str | Path, tokenizer: TextTokenizer, chat: bool = False) -> None:
        super().__init__(tokenizer, chat)
        self.shards = shard_paths(path)
        self.keys: list[tuple[int, str]] = []  # sample index -> (shard, key)
        self.members: dict[tuple[int, str], dict[str, MemberRef]] = {}
        for s, shard in enumerate(self.shards):
            try:
                with tarfile.open(shard, "r:") as tar:  # uncompressed: a member's bytes lie at one offset
                    for m in tar:
                        if not m.isfile():
                            continue
                        key, ext = split_key(m.name)
                        group = self.members.setdefault((s, key), {})
                        if not group:
                            self.keys.append((s, key))
                        group[ext] = MemberRef(s, m.offset_data, m.size)
            except tarfile.ReadError as e:  # "r:" refuses a compressed tar with this
                raise DataError(f"WebDataset shard {shard} is not an uncompressed tar ({' '.join(str(e).split())}); "
                                f"samples are read by offset, so decompress it (e.g. gunzip) or replace it") from e
            except (tarfile.TarError, OSError) as e:
                raise DataError(f"WebDataset shard {shard} cannot be indexed ({' '.join(str(e).split())}); replace "
                                f"the shard or drop it from data.path") from e
        for s, key in self.keys:
            if "json" not in self.members[(s, key)]:
                raise DataError(f"WebDataset shard {self.shards[s]}: sample {key!r} has no {key}.json record "
                                f"(members {sorted(self.members[(s, key)])}); add it or remove the sample's members")
        if not self.keys:
            raise DataError(f"WebDataset path {path}: the shards hold no samples; check data.path")

    def __len__(self) -> int:
        return len(self.keys)

    def _member(self, shard: int, key: str, ext: str) -> tuple[BinaryIO, str]:
        name = f"{self.shards[shard]}:{key}.{ext}"
        ref = self.members[(shard, key)].get(ext)
        if ref is None:
            raise DataError(f"member {name} is missing")
        return io.BufferedReader(_Member(self.shards[shard], ref)), name

    def _record(self, index: int) -> Any:
        shard, key = self.keys[index]
        file, name = self._member(shard, key, "json")
        with file:
            try:
                return json.loads(file.read().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"sample {index} ({self._where(index)}): {name} is not valid JSON ({e}); replace "
                                f"it") from e

    def _where(self, index: int) -> str:
        shard, key = self.keys[index]
        return f"{self.shards[shard].name} key {key}"

    def _open(self, record: Record, ref: str) -> tuple[BinaryIO, str]:
        shard, key = self.keys[record.index]
        return self._member(shard, key, ref)
