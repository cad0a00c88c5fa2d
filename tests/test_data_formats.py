"""Real data formats: LLaVA-style JSON with PNG / WAV files and WebDataset tar shards, written
from the demo set (`loom.data.write_demo`), read back (`loom.data.llava`, `loom.data.webdataset`),
with metadata from file headers and one-line errors for bad input."""

import dataclasses
import io
import json
import shutil
import tarfile

import pytest
import torch

from loom.data.collate import collate, count_tokens
from loom.data.demo import DemoConfig, DemoDataset
from loom.data.llava import LlavaSource, conversation_text
from loom.data.media import DataError, quantise_audio, quantise_image
from loom.data.webdataset import WebDatasetSource
from loom.data.write_demo import conversations, write_demo
from loom.model.zoo import AudioConfig, AudioEncoder, VisionConfig, VisionEncoder

NUM_SAMPLES = 64


@pytest.fixture(scope="module")
def demo():
    return DemoDataset(DemoConfig(num_samples=NUM_SAMPLES, seed=3))


@pytest.fixture(scope="module")
def written(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_formats")
    return out, write_demo(demo, out, "both", samples_per_shard=16)


def sources(demo, written):
    out, w = written
    return [LlavaSource(w.llava, demo.tokenizer), WebDatasetSource(out / "shards", demo.tokenizer)]


def test_write_demo_lays_out_both_formats(written):
    out, w = written
    assert w.llava == out / "train.json" and w.num_samples == NUM_SAMPLES
    assert [p.name for p in w.shards] == [f"shard-00000{k}.tar" for k in range(4)]
    records = json.loads(w.llava.read_text())
    assert len(records) == NUM_SAMPLES and {"id", "conversations"} <= set(records[0])
    with tarfile.open(w.shards[0]) as tar:
        assert tar.getnames()[0] == "0000000.json"


@pytest.mark.parametrize("fmt", ["llava", "webdataset"])
def test_formats_yield_the_demo_samples(demo, written, fmt):
    """Every sample: the demo's metadata and text, and its pixels and waveforms at the formats'
    8-bit / 16-bit levels, bit for bit; metadata from headers alone equals the decoded one."""
    src = sources(demo, written)[["llava", "webdataset"].index(fmt)]
    assert len(src) == NUM_SAMPLES
    kinds = set()
    for i in range(NUM_SAMPLES):
        want, got = demo[i], src[i]
        kinds.add(demo.kind(i))
        assert src.meta(i) == got.meta == want.meta, i
        assert got.text == want.text
        got.check_payload()
        assert len(got.images) == len(want.images) and len(got.audios) == len(want.audios)
        for a, b in zip(want.images, got.images):
            assert b.dtype == torch.float32 and torch.equal(quantise_image(a), b)
            assert (quantise_image(a) - a).abs().max() <= 0.5 / 255 + 1e-7
        for a, b in zip(want.audios, got.audios):
            assert b.dtype == torch.float32 and torch.equal(quantise_audio(a), b)
    assert kinds == {"text", "image", "multi_image", "audio", "image_audio"}


def test_header_token_counts_equal_the_decoded_samples(demo, written):
    """The token counts `count_tokens` derives from header metadata equal the collated rows of
    the decoded samples, for every sample (both formats)."""
    counts = {"vision": VisionEncoder(VisionConfig()).num_tokens, "audio": AudioEncoder(AudioConfig()).num_tokens}
    for src in sources(demo, written):
        for i in range(NUM_SAMPLES):
            n = count_tokens(src.meta(i), counts)
            batch = collate([src[i]], demo.tokenizer, counts)
            assert batch.input_ids.shape[1] == n["llm"], i
            assert sum(counts["vision"](m) for m in src[i].meta.images) == n["vision"]


def test_conversations_round_trip_the_text():
    text = "<audio> a low tone . <image> one shape : a red square ."
    turns = conversations(text)
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    assert conversation_text([t["value"] for t in turns]) == text
    assert conversation_text(["<image>\nWhat is it?", "A cat.<image>x"]) == "<image> What is it? A cat. <image> x"


# ---- bad input -----------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    """A fresh 8-sample set to break."""
    ds = DemoDataset(DemoConfig(num_samples=8, seed=3))
    return ds, write_demo(ds, tmp_path, "both", samples_per_shard=4), tmp_path


def _first_with(ds, field):
    return next(i for i in range(len(ds)) if getattr(ds.meta(i), field))


def _first_media(ds, w, field: str, key: str) -> tuple[int, dict, str]:
    """The first sample with ``field`` items: its index, its LLaVA record and its first ``key`` file."""
    i = _first_with(ds, field)
    rec = json.loads(w.llava.read_text())[i]
    return i, rec, rec[key] if isinstance(rec[key], str) else rec[key][0]


def _one_line_error(fn, *needles):
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_missing_media_file_names_file_and_sample(small):
    ds, w, out = small
    i, rec, ref = _first_media(ds, w, "images", "image")
    (out / ref).unlink()
    src = LlavaSource(w.llava, ds.tokenizer)
    for fn in (lambda: src.meta(i), lambda: src[i]):
        _one_line_error(fn, str(out / ref), "is missing", f"sample {i}", repr(rec["id"]), "train.json entry",
                        'data.on_error = "skip"')


def test_truncated_png_fails_on_decode_naming_it(small):
    ds, w, out = small
    i, rec, ref = _first_media(ds, w, "images", "image")
    data = (out / ref).read_bytes()
    (out / ref).write_bytes(data[: len(data) // 2])
    src = LlavaSource(w.llava, ds.tokenizer)
    assert src.meta(i) == ds.meta(i)  # the header is intact: metadata still reads
    _one_line_error(lambda: src[i], str(out / ref), "does not decode", f"sample {i}", repr(rec["id"]))


def test_corrupt_wav_header_names_it(small):
    ds, w, out = small
    i, rec, ref = _first_media(ds, w, "audios", "audio")
    (out / ref).write_bytes(b"not a wav file at all")
    src = LlavaSource(w.llava, ds.tokenizer)
    _one_line_error(lambda: src.meta(i), str(out / ref), "audio header", f"sample {i}")


def test_more_image_markers_than_images_names_the_sample(small):
    ds, w, out = small
    records = json.loads(w.llava.read_text())
    i = _first_with(ds, "images")
    records[i]["conversations"][0]["value"] += " <image>"
    w.llava.write_text(json.dumps(records))
    src = LlavaSource(w.llava, ds.tokenizer)
    n = len(ds.meta(i).images)
    for fn in (lambda: src.meta(i), lambda: src[i]):
        _one_line_error(fn, f"sample {i}", repr(records[i]["id"]), f"{n + 1} <image> markers but {n} image files")


def test_webdataset_missing_and_truncated_members(small):
    ds, w, out = small
    i = _first_with(ds, "images")
    shard = w.shards[i // 4]
    key = f"{i:07d}"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar if m.isfile()]
    broken = out / "broken"
    broken.mkdir()
    with tarfile.open(broken / shard.name, "w") as tar:  # the first image truncated
        for m, data in members:
            if m.name == f"{key}.0.png":
                data = data[: len(data) // 2]
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    src = WebDatasetSource(broken, ds.tokenizer)
    j = i % 4
    assert src.meta(j) == dataclasses.replace(ds.meta(i), sample_id=j)  # the header is intact
    _one_line_error(lambda: src[j], f"{shard.name}:{key}.0.png", "does not decode", f"sample {j}")
    shutil.rmtree(broken)
    broken.mkdir()
    with tarfile.open(broken / shard.name, "w") as tar:  # the first image gone
        for m, data in members:
            if m.name != f"{key}.0.png":
                tar.addfile(m, io.BytesIO(data))
    src = WebDatasetSource(broken, ds.tokenizer)
    for fn in (lambda: src.meta(j), lambda: src[j]):
        _one_line_error(fn, f"{shard.name}:{key}.0.png is missing", f"sample {j}", f"key {key}")


def test_json_lines_and_shard_files_read_alike(demo, written, tmp_path):
    out, w = written
    lines = tmp_path / "train.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in json.loads(w.llava.read_text())) + "\n")
    a, b = LlavaSource(lines, demo.tokenizer, root=out), LlavaSource(w.llava, demo.tokenizer)
    one = WebDatasetSource(w.shards[1], demo.tokenizer)  # a single shard: its 16 samples, from index 0
    for i in (0, 5, 17, 63):
        assert a.meta(i) == b.meta(i) and a[i].text == b[i].text
    assert len(one) == 16 and one[0].text == demo[16].text


def test_compressed_shards_are_refused_naming_them(demo, written, tmp_path):
    import gzip

    (tmp_path / "s.tar").write_bytes(gzip.compress(written[1].shards[0].read_bytes()))
    _one_line_error(lambda: WebDatasetSource(tmp_path / "s.tar", demo.tokenizer), "s.tar",
                    "not an uncompressed tar", "decompress")


def test_bad_files_and_paths_name_them(tmp_path, demo):
    _one_line_error(lambda: LlavaSource(tmp_path / "nope.json", demo.tokenizer), "nope.json", "data.path")
    (tmp_path / "bad.json").write_text("[{")
    _one_line_error(lambda: LlavaSource(tmp_path / "bad.json", demo.tokenizer), "bad.json", "not valid JSON")
    _one_line_error(lambda: WebDatasetSource(tmp_path / "none", demo.tokenizer), "no .tar shards", "data.path")


# ---- a Hugging Face tokenizer (data.tokenizer) ---------------------------------------------------


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHAT_SPECIALS = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def save_word_tokenizer(path, chat=False):
    """A Hugging Face word-level tokenizer over the demo's words (and a few question words), with
    BOS / EOS and no modality markers (HFTokenizer adds them), saved to ``path`` as
    `AutoTokenizer` loads it; with ``chat``, also `CHAT_TEMPLATE` and its special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loom.data.demo_words import demo_vocabulary

    words = ["[UNK]", "<s>", "</s>", *demo_vocabulary(), "what", "it", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if chat:
        tok.add_special_tokens(CHAT_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path, len(words)


def test_hf_tokenizer_keeps_markers_whole_and_wraps_the_text(tmp_path):
    from loom.data.hf_tokenizer import HFTokenizer

    path, n = save_word_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(path, extra_tokens=["<gen_image>"])
    assert tok.vocab_size == n + 3 and [tok.token_id(m) for m in ("<image>", "<audio>", "<gen_image>")] == [n, n + 1, n + 2]
    ids = tok.encode("<image> one shape : a red square .")
    assert ids[:2] == [1, n] and ids[-1] == 2 and len(ids) == 10 and 0 not in ids  # <s> <image> ... </s>, no [UNK]
    assert tok.encode("<image>one") == [1, n, tok.token_id("one"), 2] and tok.encode("cat") == [1, 0, 2]
    assert tok.pad_id == 2 and tok.decode(ids) == "<s> <image> one shape : a red square . </s>"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="does not load with AutoTokenizer"):
        HFTokenizer(tmp_path / "empty")


def test_sources_count_tokens_with_an_hf_tokenizer(demo, written, tmp_path):
    from loom.data.hf_tokenizer import HFTokenizer

    out, w = written
    tok = HFTokenizer(save_word_tokenizer(tmp_path / "tok")[0])
    counts = {"vision": VisionEncoder(VisionConfig()).num_tokens, "audio": AudioEncoder(AudioConfig()).num_tokens}
    for src in (LlavaSource(w.llava, tok), WebDatasetSource(out / "shards", tok)):
        for i in range(0, NUM_SAMPLES - 1, 3):
            sample = src[i]
            assert src.meta(i) == sample.meta and sample.meta.text_tokens == len(tok.encode(sample.text))
            batch = collate([sample, src[i + 1]], tok, counts)
            assert batch.input_ids.shape[1] == max(count_tokens(src.meta(k), counts)["llm"] for k in (i, i + 1))
            assert batch.num_targets == sum(s.meta.text_tokens - len(s.meta.images) - len(s.meta.audios) - 1
                                            for s in (sample, src[i + 1]))


def test_chat_template_puts_the_loss_on_assistant_turns_only(tmp_path):
    """A hand-built example: one user turn with an image, one assistant turn; only the assistant
    turn's tokens (and its end-of-turn token) are labels, and the metadata counts exactly them."""
    from loom.data.hf_tokenizer import HFTokenizer
    from loom.data.media import encode_png

    tok = HFTokenizer(save_word_tokenizer(tmp_path / "tok", chat=True)[0], chat=True)
    (tmp_path / "cat.png").write_bytes(encode_png(torch.rand(3, 16, 16)))
    (tmp_path / "chat.json").write_text(json.dumps([{"id": "x", "image": "cat.png", "conversations": [
        {"from": "human", "value": "<image> what is it ?"}, {"from": "gpt", "value": "one shape : a red square ."}]}]))
    src = LlavaSource(tmp_path / "chat.json", tok, chat=True)
    sample = src[0]
    assert sample.text == "<|user|> <image> what is it ? <|end|> <|assistant|> one shape : a red square . <|end|> "
    assert src.meta(0) == sample.meta and sample.meta.target_tokens == 8 and sample.meta.segments == (
        "text", "image", "text")
    counts = {"vision": VisionEncoder(VisionConfig()).num_tokens}  # a 16 x 16 image: 4 placeholders
    batch = collate([sample], tok, counts)
    t = tok.token_id
    U, A, END, P = t("<|user|>"), t("<|assistant|>"), t("<|end|>"), t("<image>")
    answer = [t(w) for w in "one shape : a red square .".split()]
    assert batch.input_ids[0].tolist() == [U, P, P, P, P, t("what"), t("is"), t("it"), t("?"), END, A, *answer, END]
    assert batch.labels[0].tolist() == [-100] * 10 + [*answer, END, -100]
    assert batch.num_targets == 8 == count_tokens(sample.meta, counts)["llm"] - 11  # 19 positions, 8 targets
    from loom.data.collate import target_count

    assert target_count(sample.meta) == 8
    # the dispatcher's path: flagged ids through collate_ids give the same labels
    samples, ids, error, skipped = _loader(src, tok, "raise", counts)._load([0], [0])
    assert error is None and sum(i < 0 for i in ids[0]) == 8  # the user turn and the assistant prompt
    from loom.data.collate import collate_ids

    assert torch.equal(collate_ids([sample.meta], ids, tok, counts)[1], batch.labels)
    # a role the template does not know, and a tokenizer without a template
    (tmp_path / "bad.json").write_text(json.dumps([{"id": "y", "conversations": [{"from": "robot", "value": "a"}]}]))
    _one_line_error(lambda: LlavaSource(tmp_path / "bad.json", tok, chat=True).meta(0), "sample 0", "'robot'",
                    "no chat role")
    with pytest.raises(ValueError, match="has no chat template"):
        HFTokenizer(save_word_tokenizer(tmp_path / "plain")[0], chat=True)


def test_chat_metadata_survives_the_gather_codec():
    from loom.cost.workload import MetadataArrays
    from loom.data.sample import ImageMeta, SampleMeta

    metas = [SampleMeta(0, 12, (ImageMeta(16, 16),), (), ("text", "image", "text"), (), 5), SampleMeta(1, 7)]
    arrays = MetadataArrays.from_flat(MetadataArrays.from_metas(metas).to_flat())
    assert arrays.metas() == metas and arrays.meta(0).target_tokens == 5 and arrays.meta(1).target_tokens is None
    parts = [MetadataArrays.from_metas(metas[:1]).to_flat(), MetadataArrays.from_metas(metas[1:]).to_flat()]
    assert MetadataArrays.from_gathered(parts).metas() == metas


def test_bad_tokenizer_directory_names_data_tokenizer(tmp_path):
    from loom.train.build import build_data
    from loom.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.tokenizer = .*nope.*does not exist"):
        build_data(load_config(None, [f"data.tokenizer={tmp_path / 'nope'}"]))


# ---- data.on_error, the dispatcher and `loom train` ---------------------------------------------


def _loader(source, tokenizer, on_error, counts=None):
    """A `Dispatcher` reduced to what `_load` (its loader shard's reading) uses: no process group."""
    from loom.runtime.dispatch import Dispatcher

    d = Dispatcher.__new__(Dispatcher)
    d.rank, d.dataset, d.tokenizer, d.generations, d.on_error = 0, source, tokenizer, {}, on_error
    d._counts = dict(counts or {})
    return d


def test_on_error_raise_names_the_file_and_skip_replaces_by_the_next_index(small):
    ds, w, out = small
    i, rec, ref = _first_media(ds, w, "images", "image")
    (out / ref).unlink()
    src = LlavaSource(w.llava, ds.tokenizer)
    samples, ids, error, skipped = _loader(src, ds.tokenizer, "raise")._load([i, 0], [0, 1])
    assert samples == [] and skipped == [] and "\n" not in error
    assert f"dataset index {i}" in error and str(out / ref) in error and "is missing" in error
    samples, ids, error, skipped = _loader(src, ds.tokenizer, "skip")._load([i, 0], [0, 1])
    assert error is None and [s.meta.sample_id for s in samples] == [(i + 1) % len(src), 0]
    assert len(skipped) == 1 and str(out / ref) in skipped[0] and f"dataset index {i}" in skipped[0]
    assert [len(t) for t in ids] == [s.meta.text_tokens for s in samples]
    # an image the vision encoder refuses (a side its patch size does not divide) fails as its sample
    from PIL import Image

    j = next(k for k in range(len(src)) if k != i and ds.meta(k).images)
    rec_j = json.loads(w.llava.read_text())[j]
    ref_j = rec_j["image"] if isinstance(rec_j["image"], str) else rec_j["image"][0]
    Image.new("RGB", (20, 16)).save(out / ref_j)
    counts = {"vision": VisionEncoder(VisionConfig()).num_tokens}
    samples, ids, error, skipped = _loader(src, ds.tokenizer, "raise", counts)._load([j], [0])
    assert f"dataset index {j}" in error and "multiples of the patch size" in error
    samples, ids, error, skipped = _loader(src, ds.tokenizer, "skip", counts)._load([j], [0])
    assert error is None and samples[0].meta.sample_id != j and len(skipped) == 1
    # every index failing: "skip" gives up with an error instead of looping
    for f in (out / "images").iterdir():
        f.unlink()
    (out / "train.json").write_text(json.dumps([rec] * 70))
    src = LlavaSource(w.llava, ds.tokenizer)
    samples, ids, error, skipped = _loader(src, ds.tokenizer, "skip")._load([0], [0])
    assert "gave up after 64" in error and len(skipped) == 64


def test_write_demo_command_refuses_bad_flags_in_one_line(tmp_path, capsys):
    from loom.cli import main

    (tmp_path / "file").write_text("")
    for flags, needle in ((["--format", "tar"], "--format tar"), (["--num-samples", "0"], "--num-samples 0"),
                          (["--samples-per-shard", "0"], "--samples-per-shard 0")):
        assert main(["data", "write-demo", "--out", str(tmp_path / "d"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("loom: error: ") and needle in err and err.count("\n") == 1
    assert main(["data", "write-demo", "--out", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["data", "write-demo", "--out", str(tmp_path / "d"), "--num-samples", "3", "--format", "webdataset",
                 "data.demo.seed=5"]) == 0
    assert "data.source=\"webdataset\"" in capsys.readouterr().out
    src = WebDatasetSource(tmp_path / "d" / "shards", DemoDataset(DemoConfig(num_samples=3, seed=5)).tokenizer)
    assert src[2].text == DemoDataset(DemoConfig(num_samples=3, seed=5))[2].text
    assert not (tmp_path / "d" / "train.json").exists()


def test_data_config_fields_are_checked():
    from loom.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.source"):
        load_config(None, ['data.source="parquet"']).check()
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ['data.source="llava"']).check()
    with pytest.raises(ConfigError, match="data.on_error"):
        load_config(None, ['data.on_error="ignore"']).check()
    with pytest.raises(ConfigError, match="data.chat_template"):
        load_config(None, ["data.chat_template=true", 'data.source="llava"', "data.path=x.json"]).check()


@pytest.mark.multiprocess
def test_train_on_llava_chats_with_an_hf_tokenizer_skipping_a_broken_sample(tmp_path):
    """`loom data write-demo`, then 2 steps of `loom train` on the LLaVA file, with a Hugging Face
    tokenizer and its chat template (data.tokenizer, data.chat_template), one sample of the first
    global batch broken and data.on_error = "skip": the run completes, each skip is a line naming
    the file in a rank's log, metrics.jsonl's skipped_samples add up to them, and the loss
    normaliser is the assistant turns' tokens of the batch as loaded (the replacement's)."""
    from loom.data.hf_tokenizer import HFTokenizer

    import subprocess
    import sys
    from pathlib import Path

    from loom.data.sampler import GlobalBatchSampler

    def loom(*args):
        return subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)

    data = tmp_path / "data"
    got = loom("data", "write-demo", "--out", str(data), "--num-samples", "32", "--format", "llava")
    assert got.returncode == 0 and "data.path=" in got.stdout, got.stderr
    records = json.loads((data / "train.json").read_text())
    first = GlobalBatchSampler(32, 8, seed=0).batch(0)
    broken = next(i for i in first if "image" in records[i])
    ref = records[broken]["image"] if isinstance(records[broken]["image"], str) else records[broken]["image"][0]
    (data / ref).unlink()
    tiny = ["model.vision.hidden_size=32", "model.audio.hidden_size=32", "model.llm.hidden_size=32",
            "model.llm.intermediate_size=64", "data.global_batch_size=8",
            'plan.placement="first_stage"']  # 2 processes: the encoders in the LLM's first stage
    got = loom("train", "run.steps=2", "run.name=t", f"run.out_dir={tmp_path}", *tiny, 'data.source="llava"',
               f"data.path={data / 'train.json'}", 'data.on_error="skip"',
               f"data.tokenizer={save_word_tokenizer(tmp_path / 'tok', chat=True)[0]}", "data.chat_template=true")
    assert got.returncode == 0, got.stdout + got.stderr
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    logged = [line for log in sorted(Path(tmp_path / "t" / "logs").glob("rank*.log"))
              for line in log.read_text().splitlines() if line.startswith("loom: skipped")]
    assert [r["step"] for r in rows] == [0, 1] and all(r["loss"] > 0 for r in rows)
    assert sum(r["skipped_samples"] for r in rows) == len(logged) >= 1
    assert all(str(data / ref) in line for line in logged)
    src = LlavaSource(data / "train.json", HFTokenizer(tmp_path / "tok", chat=True), chat=True)
    loaded = [(i + 1) % 32 if i == broken else i for i in first]
    assert rows[0]["target_tokens"] == sum(src.meta(i).target_tokens for i in loaded)
