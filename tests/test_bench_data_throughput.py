"""benchmarks/data_throughput.py's plain side does loom's decoding: on written demo files its
dataset gives the same pixels, waveforms and token ids as `LlavaSource` (so ``loader_ratio``
compares the same work), and its collate pads as it says (nothing here times anything)."""

import torch

from benchmarks.data_throughput import PlainLlava, batch_sums, loader_overrides, plain_collate
from loom.data.demo import DemoConfig, DemoDataset
from loom.data.llava import LlavaSource
from loom.data.write_demo import write_demo


def test_plain_dataset_decodes_as_loom_does(tmp_path):
    ds = DemoDataset(DemoConfig(num_samples=12, seed=4))
    w = write_demo(ds, tmp_path, "llava")
    loom, plain = LlavaSource(w.llava, ds.tokenizer), PlainLlava(w.llava, ds.tokenizer)
    assert any(loom[i].images for i in range(12)) and any(loom[i].audios for i in range(12))
    for i in range(12):
        a, b = loom[i], plain[i]
        assert len(a.images) == len(b["images"]) and len(a.audios) == len(b["audios"])
        for x, y in zip(a.images + a.audios, b["images"] + b["audios"]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert b["ids"] == ds.tokenizer.encode(a.text) and len(b["ids"]) == a.meta.text_tokens
    got = plain_collate([plain[i] for i in range(4)])
    lengths = [len(plain[i]["ids"]) for i in range(4)]
    assert got["input_ids"].shape == (4, max(lengths)) and got["lengths"].tolist() == lengths
    assert got["input_ids"][0, : lengths[0]].tolist() == plain[0]["ids"]
    assert batch_sums(got["images"], got["audios"], 4, sum(lengths))[2:] == [4.0, float(sum(lengths))]


def test_loom_side_is_a_data_parallel_plan_of_the_workers():
    from loom.train.config import load_config

    cfg = load_config(None, loader_overrides("x/train.json", 3))
    assert cfg.data.source == "llava" and cfg.plan.placement == "first_stage"
    assert {m.name: m.data_parallel for m in cfg.plan.modules} == {"vision": 3, "audio": 3, "llm": 3}
