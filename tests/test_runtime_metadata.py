"""The dispatcher's metadata all-gather (`loom.runtime.metadata`) and the runtime's entry rules.

The codec must give back exactly the `SampleMeta`s and payload error it was given (every
field, any number of items and segments, non-ASCII text), and the gather must agree on every
rank both when every share fits the first round and when one share overflows it (the second
round every rank must take together).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.data.sample import AudioMeta, ImageMeta, SampleMeta
from loom.runtime.local import run_local
from loom.runtime.metadata import all_gather_metadata, decode, encode


def _metas(rank: int, count: int, items: int) -> list[SampleMeta]:
    return [SampleMeta(100 * rank + i, 7 + i,
                       tuple(ImageMeta(8 + k, 16 + i) for k in range(items)),
                       tuple(AudioMeta(800 * (k + 1), 8000) for k in range(i % 2)),
                       ("image",) * items + ("text", "audio") * (i % 2) + ("text",))
            for i in range(count)]


def test_codec_round_trip() -> None:
    metas = _metas(1, 4, 3) + [SampleMeta(9, 3)]
    for error in (None, "rank 1, global batch position 3: images[0] has shape (3, 4, 4) — bad"):
        values = encode(metas, error)
        assert all(isinstance(v, int) for v in values)
        assert decode(values + [0] * 5) == (metas, error)  # trailing padding is ignored
    assert decode(encode([], None)) == ([], None)


def _gather_worker(rank: int, world_size: int, out: str) -> None:
    # rank 1's samples carry many images each: its share overflows the first round's capacity
    metas = _metas(rank, 3, 40 if rank == 1 else 1)
    error = "payload of sample 101 disagrees" if rank == 1 else None
    got = all_gather_metadata(metas, error, batch_size=3 * world_size, device=torch.device("cpu"))
    small = all_gather_metadata(_metas(rank, 3, 1), None, batch_size=3 * world_size, device=torch.device("cpu"))
    # written as the codec's integers in JSON (no pickle); read back through `decode`
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"big": [encode(list(m), e) for m, e in got], "small": [encode(list(m), e) for m, e in small]}))


@pytest.mark.multiprocess
def test_all_gather_metadata_on_every_rank(tmp_path: Path) -> None:
    run_local(_gather_worker, 2, str(tmp_path))
    expected_big = [(_metas(0, 3, 1), None), (_metas(1, 3, 40), "payload of sample 101 disagrees")]
    expected_small = [(_metas(0, 3, 1), None), (_metas(1, 3, 1), None)]
    assert len(encode(*expected_big[1])) > 2 + 24 * 3, "the case must overflow the first round"
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert [decode(v) for v in res["big"]] == expected_big, f"rank {r}"
        assert [decode(v) for v in res["small"]] == expected_small, f"rank {r}"
