"""The metadata codec (`loom.cost.workload.MetadataArrays`) and the dispatcher's all-gather of it
(`loom.runtime.metadata`).

The codec must give back exactly the `SampleMeta`s and payload errors it was given (every
field, any number of items and segments, non-ASCII text), parse a gathered table the same as
the ranks' rows one by one, refuse rows it cannot read with a message naming the fix, and the
gather must agree on every rank both when every row fits the first round and when one row
overflows it (the second round every rank must take together).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.cost.workload import (HEADER, SEGMENT_NAMES, MetadataArrays, WorkloadError, gather_capacity, gathered_bytes,
                                padded_row, row_lengths)
from loom.data.sample import AudioMeta, ImageMeta, SampleMeta
from loom.runtime.local import run_local
from loom.runtime.metadata import all_gather_metadata
from loom.sim.dispatch import metadata_bytes


def _metas(rank: int, count: int, items: int) -> list[SampleMeta]:
    return [SampleMeta(100 * rank + i, 7 + i,
                       tuple(ImageMeta(8 + k, 16 + i) for k in range(items)),
                       tuple(AudioMeta(800 * (k + 1), 8000) for k in range(i % 2)),
                       ("image",) * items + ("text", "audio") * (i % 2) + ("text",))
            for i in range(count)]


def _random_metas(rng: random.Random, count: int, first_id: int) -> list[SampleMeta]:
    out = []
    for i in range(count):
        images = tuple(ImageMeta(rng.randint(1, 900), rng.randint(1, 900))
                       for _ in range(rng.choice([0, 0, 1, 1, 2, 7])))
        audios = tuple(AudioMeta(rng.randint(1, 10**6), rng.choice([8000, 16000, 44100]))
                       for _ in range(rng.choice([0, 0, 0, 1, 3])))
        segments = tuple(rng.choice(SEGMENT_NAMES) for _ in range(rng.randint(0, 9)))
        out.append(SampleMeta(first_id + i, rng.randint(1, 5000), images, audios, segments))
    return out


def _assert_same(got: MetadataArrays, want: MetadataArrays) -> None:
    for f in dataclasses.fields(MetadataArrays):
        assert np.array_equal(getattr(got, f.name), getattr(want, f.name)), f.name


def test_codec_round_trip_random_batches() -> None:
    rng = random.Random(3)
    for trial in range(20):
        metas = _random_metas(rng, rng.randint(0, 12), 1000 * trial)
        error = rng.choice([None, "rank 1, global batch position 3: images[0] has shape (3, 4, 4) — bad ✗"])
        arrays = MetadataArrays.from_metas(metas, error)
        flat = arrays.to_flat()
        assert flat.dtype == np.int64 and flat.size == arrays.row_length == int(row_lengths(flat[None])[0])
        back = MetadataArrays.from_flat(flat)
        assert back.metas() == metas and [back.meta(s) for s in range(len(metas))] == metas
        assert back.errors() == ({0: error} if error else {})
        # zero padding past the row's length is ignored
        assert MetadataArrays.from_gathered(padded_row(flat, flat.size + 7)[None]).metas() == metas
    assert MetadataArrays.from_flat(MetadataArrays.from_metas([]).to_flat()).metas() == []


def test_from_gathered_equals_concat_of_rank_parses() -> None:
    rng = random.Random(5)
    for ranks, per in ((1, 5), (4, 3), (7, 2), (5, 0)):
        parts = [MetadataArrays.from_metas(_random_metas(rng, per + (r % 2), 100 * r),  # unequal shards too
                                           f"rank {r} failed" if r == 2 else None) for r in range(ranks)]
        rows = [p.to_flat() for p in parts]
        width = max(r.size for r in rows) + 3
        table = np.stack([padded_row(r, width) for r in rows])
        whole = MetadataArrays.concat([MetadataArrays.from_flat(r) for r in rows])
        _assert_same(MetadataArrays.from_gathered(table), whole)
        _assert_same(MetadataArrays.from_gathered(rows), whole)
        assert MetadataArrays.from_gathered(table).metas() == [m for p in parts for m in p.metas()]
        assert MetadataArrays.from_gathered(table).errors() == ({2: "rank 2 failed"} if ranks > 2 else {})
    # ranks with no samples at all (a batch smaller than the world), one with an error
    empty = [MetadataArrays.from_metas([], "no samples" if r == 1 else None).to_flat() for r in range(3)]
    got = MetadataArrays.from_gathered(np.stack([padded_row(r, 20) for r in empty]))
    assert got.metas() == [] and got.errors() == {1: "no samples"}
    # equal shards take the strided path; the same batch in unequal shards the masked one
    metas = _random_metas(rng, 24, 0)
    cuts = {"equal": [(0, 6), (6, 12), (12, 18), (18, 24)], "unequal": [(0, 7), (7, 12), (12, 24), (24, 24)]}
    rows = {k: [MetadataArrays.from_metas(metas[a:b]).to_flat() for a, b in v] for k, v in cuts.items()}
    width = max(r.size for v in rows.values() for r in v)
    equal, unequal = (np.stack([padded_row(r, width) for r in rows[k]]) for k in ("equal", "unequal"))
    assert MetadataArrays.from_gathered(equal).metas() == MetadataArrays.from_gathered(unequal).metas() == metas


def test_codec_refuses_what_it_cannot_read() -> None:
    with pytest.raises(WorkloadError, match="segment 'video'.*SEGMENT_NAMES"):
        MetadataArrays.from_metas([SampleMeta(4, 3, segments=("text", "video"))])
    flat = MetadataArrays.from_metas(_metas(0, 3, 2)).to_flat()
    with pytest.raises(WorkloadError, match="does not match"):
        MetadataArrays.from_flat(flat[:-1])
    with pytest.raises(WorkloadError, match="shorter than their headers"):
        MetadataArrays.from_gathered([flat, flat[:-1]])
    bad = flat.copy()
    bad[HEADER + 2 * 3] += 1  # sample 0 claims one image more than its row's header
    with pytest.raises(WorkloadError, match="disagree with their headers"):
        MetadataArrays.from_gathered(np.stack([flat, bad]))
    bad = flat.copy()
    bad[-1] = len(SEGMENT_NAMES)  # the last segment's code
    with pytest.raises(WorkloadError, match="segment code"):
        MetadataArrays.from_flat(bad)


def test_gathered_bytes_price_the_padded_table() -> None:
    assert gather_capacity(10, 4) == HEADER + 16 * 3
    assert gathered_bytes(10, [20, 20, 30, 10]) == 8 * 4 * (HEADER + 48)  # every row fits: one round
    assert gathered_bytes(10, [20, 200, 30, 10]) == 8 * 4 * (HEADER + 48 + 200)  # one overflows: a second round
    with pytest.raises(WorkloadError, match="world size"):
        gather_capacity(10, 0)


def _gather_worker(rank: int, world_size: int, out: str) -> None:
    import loom.runtime.metadata as runtime_metadata

    received = []  # bytes of every table this rank receives, to compare with the simulator's price
    collective = runtime_metadata._all_gather

    def counted(row, world, device, group):
        table = collective(row, world, device, group)
        received.append(table.nbytes)
        return table

    runtime_metadata._all_gather = counted
    # rank 1's samples carry many images each: its row overflows the first round's capacity
    metas = _metas(rank, 3, 40 if rank == 1 else 1)
    error = "payload of sample 101 disagrees — ✗" if rank == 1 else None
    got = all_gather_metadata(metas, error, batch_size=3 * world_size, device=torch.device("cpu"))
    big_bytes = sum(received)
    small = all_gather_metadata(_metas(rank, 3, 1), None, batch_size=3 * world_size, device=torch.device("cpu"))
    # written as the codec's own rows in JSON (no pickle); read back through `from_flat`
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        {"big": got.to_flat().tolist(), "big_errors": got.errors(), "small": small.to_flat().tolist(),
         "big_bytes": big_bytes, "small_bytes": sum(received) - big_bytes}))


@pytest.mark.multiprocess
def test_all_gather_metadata_on_every_rank(tmp_path: Path) -> None:
    run_local(_gather_worker, 2, str(tmp_path))
    big = _metas(0, 3, 1) + _metas(1, 3, 40)
    assert MetadataArrays.from_metas(_metas(1, 3, 40)).row_length > gather_capacity(6, 2), \
        "the case must overflow the first round"
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert MetadataArrays.from_flat(np.array(res["big"])).metas() == big, f"rank {r}"
        assert res["big_errors"] == {"1": "payload of sample 101 disagrees — ✗"}, f"rank {r}"
        assert MetadataArrays.from_flat(np.array(res["small"])).metas() == _metas(0, 3, 1) + _metas(1, 3, 1)
        # the simulator prices exactly the tables the runtime gathered (the error's bytes aside)
        assert res["small_bytes"] == metadata_bytes(_metas(0, 3, 1) + _metas(1, 3, 1), world_size=2)
        assert res["big_bytes"] == metadata_bytes(big, world_size=2) + 8 * 2 * len(
            "payload of sample 101 disagrees — ✗".encode())


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [0, 1, 0, 1, 1], [2, 0, 3, 1], [0, 0, 0], [], [0, 5]])
def test_per_sample_sum_matches_a_loop_on_every_path(counts: list[int]) -> None:
    """`per_sample_sum`'s paths (one item per sample, at most one, several; with and without the
    caller's bounds) give each sample's exact sum of its items, in a new array."""
    from loom.cost.workload import _bounds, per_sample_sum

    count = np.asarray(counts, dtype=np.int64)
    values = np.arange(3, 3 + int(count.sum()), dtype=np.int64) ** 3
    want, k = [], 0
    for c in counts:
        want.append(int(values[k:k + c].sum()))
        k += c
    for bounds in (None, _bounds(count)):
        got = per_sample_sum(count, values, bounds)
        assert got.dtype == values.dtype and got.tolist() == want
        assert not np.shares_memory(got, values)
