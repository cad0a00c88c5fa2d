"""``data.on_error = "skip"`` stays inside the sample's split (issue 13): a failing sample of the
training range is replaced by the next training index (wrapping to 0, never into the held-out
``data.eval_samples``), one of the held-out range by the next held-out index (wrapping to the
split's first, never into training)."""

import pytest

from loom.data.demo import DemoConfig, DemoDataset
from loom.data.llava import LlavaSource
from loom.data.sampler import next_in_split
from loom.data.write_demo import write_demo


def test_next_in_split_wraps_inside_each_split():
    assert [next_in_split(i, 8) for i in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert [next_in_split(i, 8, held_out=4) for i in range(8)] == [1, 2, 3, 0, 5, 6, 7, 4]
    assert [next_in_split(i, 8, held_out=1) for i in (6, 7)] == [0, 7]
    with pytest.raises(ValueError, match="held_out"):
        next_in_split(0, 8, held_out=8)


def test_a_skipped_sample_is_replaced_from_its_own_split(tmp_path):
    from loom.runtime.dispatch import Dispatcher

    ds = DemoDataset(DemoConfig(num_samples=8, seed=3))
    w = write_demo(ds, tmp_path, "llava")
    src = LlavaSource(w.llava, ds.tokenizer)
    d = Dispatcher.__new__(Dispatcher)  # what `_load` (the loader shard's reading) uses: no process group
    d.rank, d.dataset, d.tokenizer, d.generations, d.on_error, d._counts = 0, src, ds.tokenizer, {}, "skip", {}
    d.held_out = 4  # as build_rank sets it from data.eval_samples
    records = src.records
    for broken in (3, 7):  # the last index of each split: the next one over would be the other split's
        records[broken] = {"id": "bad", "conversations": "not a list"}
    samples, _, error, skipped = d._load([3, 7, 1, 5], [0, 1, 2, 3])
    assert error is None and len(skipped) == 2, skipped
    assert [s.meta.sample_id for s in samples] == [0, 4, 1, 5]
    assert "dataset index 3" in skipped[0] and "dataset index 7" in skipped[1]
    d.held_out = 0  # without a held-out split the whole set is one: 7 wraps to 0
    samples, _, error, _ = d._load([7], [0])
    assert error is None and samples[0].meta.sample_id == 0
