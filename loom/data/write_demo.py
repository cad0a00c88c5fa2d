"""Write the demo set (`loom.data.demo`) as real files: LLaVA-style JSON with PNG / WAV files,
and WebDataset tar shards (``loom data write-demo``), so the file formats can be tried and
tested with nothing downloaded.

Layout under ``out``::

    train.json                  LLaVA records, media paths relative to ``out``
    images/<id>_<k>.png         8-bit RGB
    audio/<id>_<k>.wav          mono 16-bit PCM at the demo's sample rate
    shards/shard-000000.tar     <id>.json (the record, media by extension), <id>.<k>.png, <id>.<k>.wav

Pixels and waveforms are stored at the nearest 8-bit / 16-bit level, so reading them back gives
`loom.data.media.quantise_image` / `quantise_audio` of the demo's tensors, exactly. The text is
split into turns at the markers: each run of markers is a ``human`` turn, each run of words the
``gpt`` turn after it (a text-only sample is one ``gpt`` turn), and `loom.data.llava` joins them
back into the demo's text.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from loom.data.demo import DemoDataset
from loom.data.media import encode_png, encode_wav
from loom.data.sample import Sample
from loom.data.tokenizer import AUDIO_MARKER, IMAGE_MARKER

FORMATS = ("llava", "webdataset", "both")
LLAVA_FILE = "train.json"
SHARD_DIR = "shards"


@dataclass(frozen=True)
class Written:
    """What `write_demo` wrote: the LLaVA file (or None) and the shards."""

    llava: Path | None
    shards: list[Path]
    num_samples: int


def conversations(text: str) -> list[dict[str, str]]:
    """The demo ``text`` as LLaVA turns: markers in ``human`` turns, words in ``gpt`` turns."""
    turns: list[dict[str, str]] = []
    for word in text.split():
        role = "human" if word in (IMAGE_MARKER, AUDIO_MARKER) else "gpt"
        if turns and turns[-1]["from"] == role:
            turns[-1]["value"] += " " + word
        else:
            turns.append({"from": role, "value": word})
    return turns


def sample_key(index: int) -> str:
    return f"{index:07d}"


def _record(sample: Sample, key: str, images: list[str], audios: list[str]) -> dict:
    record: dict = {"id": key}
    if images:
        record["image"] = images if len(images) > 1 else images[0]
    if audios:
        record["audio"] = audios if len(audios) > 1 else audios[0]
    record["conversations"] = conversations(sample.text)
    return record


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed times: the same bytes every time
    tar.addfile(info, io.BytesIO(data))


def write_demo(dataset: DemoDataset, out: str | Path, fmt: str = "both", samples_per_shard: int = 1000) -> Written:
    """Write every sample of ``dataset`` under ``out`` in format ``fmt`` (``llava``,
    ``webdataset`` or ``both``); ``ValueError`` naming the argument when it cannot."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    if samples_per_shard < 1:
        raise ValueError(f"samples per shard = {samples_per_shard}: use at least 1")
    if dataset.config.mix.get("generate", 0) > 0:
        raise ValueError("the demo mix has 'generate' samples, whose target images these formats do not carry; "
                         "set data.demo.mix.generate = 0")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rate = dataset.config.sample_rate
    records: list[dict] = []
    shards: list[Path] = []
    tar: tarfile.TarFile | None = None
    n = len(dataset)
    try:
        for i in range(n):
            sample, key = dataset[i], sample_key(i)
            pngs = [encode_png(im) for im in sample.images]
            wavs = [encode_wav(clip, rate) for clip in sample.audios]
            if fmt in ("llava", "both"):
                images = [f"images/{key}_{k}.png" for k in range(len(pngs))]
                audios = [f"audio/{key}_{k}.wav" for k in range(len(wavs))]
                for rel, data in [*zip(images, pngs), *zip(audios, wavs)]:
                    (out / rel).parent.mkdir(exist_ok=True)
                    (out / rel).write_bytes(data)
                records.append(_record(sample, key, images, audios))
            if fmt in ("webdataset", "both"):
                if i % samples_per_shard == 0:
                    if tar is not None:
                        tar.close()
                    shards.append(out / SHARD_DIR / f"shard-{len(shards):06d}.tar")
                    shards[-1].parent.mkdir(exist_ok=True)
                    tar = tarfile.open(shards[-1], "w", format=tarfile.USTAR_FORMAT)
                images = [f"{k}.png" for k in range(len(pngs))]
                audios = [f"{k}.wav" for k in range(len(wavs))]
                record = _record(sample, key, images, audios)
                _add(tar, f"{key}.json", json.dumps(record).encode())
                for ext, data in [*zip(images, pngs), *zip(audios, wavs)]:
                    _add(tar, f"{key}.{ext}", data)
    finally:
        if tar is not None:
            tar.close()
    llava = None
    if records:
        llava = out / LLAVA_FILE
        llava.write_text(json.dumps(records, indent=1) + "\n")
    return Written(llava, shards, n)
