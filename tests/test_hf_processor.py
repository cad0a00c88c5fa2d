"""Hugging Face image processors and feature extractors (`loom.data.hf_processor`), read from
local directories written here with ``save_pretrained``: for every sample of the generated demo
set (`loom data write-demo`'s LLaVA files), the token count derived from the files' headers
equals the count of the processor's output after decoding and the rows the encoder emits on
it; the processor gets the same input as from Pillow / soundfile directly; mismatched
processors and clips are refused with errors that name them."""

from __future__ import annotations

import pytest
import soundfile
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from loom.data.demo import DemoConfig, DemoDataset  # noqa: E402
from loom.data.hf_processor import load_processor  # noqa: E402
from loom.data.llava import LlavaSource  # noqa: E402
from loom.data.sample import AudioMeta, ImageMeta  # noqa: E402
from loom.data.write_demo import write_demo  # noqa: E402
from loom.model.hf_qwen2vl import qwen2vl_encoder_from_config  # noqa: E402
from loom.model.hf_vision import HFVisionEncoder, vision_model_from_config  # noqa: E402
from loom.model.hf_whisper import whisper_encoder_from_config  # noqa: E402

NUM_SAMPLES = 48
RATE = 16000  # Whisper's rate: its extractor's mel filters reach 8 kHz


def processors() -> dict:
    """Tiny processors of each family, sized for the demo's 16..64 pixel images and <= 2 s clips:
    Qwen2-VL between 24x24 and 40x40 pixels, so some images grow and some shrink."""
    return {
        "qwen2_vl": transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                          min_pixels=24 * 24, max_pixels=40 * 40),
        "siglip": transformers.SiglipImageProcessorPil(size={"height": 16, "width": 16}),
        "clip": transformers.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        "whisper": transformers.WhisperFeatureExtractor(feature_size=8, sampling_rate=RATE, hop_length=160,
                                                        chunk_length=2, n_fft=400),
    }


def encoders() -> dict:
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    return {
        "qwen2_vl": qwen2vl_encoder_from_config(transformers.Qwen2VLVisionConfig(
            depth=1, embed_dim=16, hidden_size=24, num_heads=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2)),
        "siglip": HFVisionEncoder(vision_model_from_config(transformers.SiglipVisionConfig(**vision))),
        "clip": HFVisionEncoder(vision_model_from_config(transformers.CLIPVisionConfig(**vision))),
        "whisper": whisper_encoder_from_config(transformers.WhisperConfig(
            d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, decoder_layers=1,
            decoder_attention_heads=2, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=100, vocab_size=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's processor directory, and the demo set written as LLaVA JSON + PNG / WAV."""
    root = tmp_path_factory.mktemp("hf_processor")
    dirs = {}
    for family, proc in processors().items():
        proc.save_pretrained(root / family)
        dirs[family] = root / family
    demo = DemoDataset(DemoConfig(num_samples=NUM_SAMPLES, seed=5, sample_rate=RATE))
    written = write_demo(demo, root / "demo", "llava")
    return dirs, LlavaSource(written.llava, demo.tokenizer), root / "demo"


@pytest.mark.parametrize("family", ["qwen2_vl", "siglip", "clip", "whisper"])
def test_header_token_counts_equal_the_processors_and_the_encoders_on_every_demo_sample(saved, family):
    dirs, source, root = saved
    encoder = encoders()[family]
    proc = load_processor(dirs[family])
    assert proc.family == family
    bound = proc.for_encoder(encoder)
    field, key = ("audios", "waveforms") if family == "whisper" else ("images", "images")
    record_field = "audio" if family == "whisper" else "image"
    items = checked = 0
    sizes = set()
    for i in range(len(source)):
        meta, sample = source.meta(i), source[i]  # headers only; then decoded
        metas = getattr(meta, field)
        if not metas:
            continue
        from_headers = [bound.num_tokens(m) for m in metas]
        out = bound({key: getattr(sample, field)})
        from_processor = proc.output_tokens(out, encoder)
        assert from_headers == from_processor, f"sample {i}"
        with torch.no_grad():
            rows = encoder(**out).shape[0]
        assert rows == sum(from_headers), f"sample {i}"
        # the processor got what Pillow / soundfile give it from the files themselves
        files = source.record(i).images if family != "whisper" else source.record(i).audios
        if family == "whisper":
            direct = proc.source([soundfile.read(root / f, dtype="float32")[0] for f in files], sampling_rate=RATE,
                                 return_tensors="pt")["input_features"]
            assert torch.equal(out["input_features"], direct)
        else:
            direct = proc.source(images=[Image.open(root / f) for f in files], return_tensors="pt")["pixel_values"]
            ours = out["pixel_values"] if family == "qwen2_vl" else torch.stack(out["images"])
            assert torch.equal(ours, direct)
        items += len(metas)
        checked += 1
        sizes.update((m.height, m.width) if family != "whisper" else (m.num_samples,) for m in metas)
        assert record_field in source._record(i)
    assert checked >= 10 and items >= checked and len(sizes) > 3  # many samples and sizes seen
    if family == "qwen2_vl":  # smart_resize both grew and shrank images: the counts vary
        counts = {bound.num_tokens(ImageMeta(*s)) for s in sizes}
        assert len(counts) > 2 and min(counts) >= 9 and max(counts) <= 25
    elif family == "whisper":
        assert {bound.num_tokens(AudioMeta(n, RATE)) for (n,) in sizes} == {100}
    else:
        assert {bound.num_tokens(ImageMeta(*s)) for s in sizes} == {16 + (family == "clip")}


def test_an_empty_microbatch_passes_through(saved):
    dirs, _, _ = saved
    for family, encoder in encoders().items():
        bound = load_processor(dirs[family]).for_encoder(encoder)
        key = "waveforms" if family == "whisper" else "images"
        out = encoder(**bound({key: []}))
        assert out.shape[0] == 0, family


def test_mismatches_are_refused(saved, tmp_path):
    dirs, _, _ = saved
    enc = encoders()
    with pytest.raises(ValueError, match="at 8000 Hz.*takes 16000 Hz"):
        load_processor(dirs["whisper"]).for_encoder(enc["whisper"]).num_tokens(AudioMeta(4000, 8000))
    with pytest.raises(ValueError, match="takes audio clips"):
        load_processor(dirs["whisper"]).item_meta(ImageMeta(8, 8))
    with pytest.raises(ValueError, match=r"makes 16x16 images but encoder HFVisionEncoder takes image_size = 32"):
        big = HFVisionEncoder(vision_model_from_config(transformers.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
            patch_size=4)))
        load_processor(dirs["siglip"]).for_encoder(big)
    with pytest.raises(ValueError, match=r"\(patch_size, merge_size, temporal_patch_size\) = \(4, 2, 2\)"):
        load_processor(dirs["qwen2_vl"]).for_encoder(enc["siglip"])
    with pytest.raises(ValueError, match=r"\(feature_size, frames\) = \(8, 200\).*\(8, 40\)"):
        load_processor(dirs["whisper"]).for_encoder(whisper_encoder_from_config(transformers.WhisperConfig(
            d_model=16, encoder_layers=1, encoder_attention_heads=2, decoder_layers=1, decoder_attention_heads=2,
            num_mel_bins=8, max_source_positions=20, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1)))
    with pytest.raises(ValueError, match="is not a directory"):
        load_processor(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        load_processor(tmp_path)
    transformers.ViTImageProcessor().save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="holds a ViTImageProcessor"):
        load_processor(tmp_path / "vit")
    bound = load_processor(dirs["qwen2_vl"]).for_encoder(enc["qwen2_vl"])
    with pytest.raises(ValueError, match="got waveforms; it processes images"):
        bound({"waveforms": [torch.zeros(10)]})


def test_a_full_processor_directory_gives_its_media_half(saved, tmp_path):
    """An ``AutoProcessor`` directory (``processor_config.json``: a tokenizer beside the image
    processor or feature extractor) is read too, as its media half."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<s>",
                                                eos_token="</s>")
    made = processors()
    transformers.CLIPProcessor(image_processor=made["clip"], tokenizer=fast).save_pretrained(tmp_path / "clip")
    transformers.WhisperProcessor(feature_extractor=made["whisper"], tokenizer=fast).save_pretrained(tmp_path / "wh")
    assert (tmp_path / "clip" / "processor_config.json").is_file()
    clip, whisper = load_processor(tmp_path / "clip"), load_processor(tmp_path / "wh")
    assert (clip.family, clip.out_size, whisper.family) == ("clip", (16, 16), "whisper")
    assert whisper.source.nb_max_frames == 200


def test_smart_resize_is_the_processors_size_for_size():
    """The vectorised rule the cost model and balancer use equals Qwen2-VL's own ``smart_resize``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    from loom.data.hf_processor import smart_resize

    sizes = [(h, w) for h in range(3, 200, 7) for w in range(2, 260, 11) if max(h, w) / min(h, w) <= 200]
    for factor, lo, hi in ((28, 56 * 56, 28 * 28 * 1280), (8, 24 * 24, 40 * 40), (8, 16 * 16, 48 * 48), (4, 1, 64)):
        ours = smart_resize(sizes, factor, lo, hi).tolist()
        assert ours == [list(theirs(h, w, factor, lo, hi)) for h, w in sizes], (factor, lo, hi)


def test_encoders_from_the_config_directories_count_as_their_processors(tmp_path):
    """``[model.vision] hf`` / ``[model.audio] hf`` = configs/hf/tiny-qwen2-vl / tiny-whisper: the
    processor saved beside each config becomes the encoder's input step, so the model's token
    counts, the cost model's (`arch_from_model`) and the collated rows agree, from metadata; a
    Whisper directory without its feature extractor is refused naming the field."""
    import dataclasses
    from pathlib import Path

    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.workload import sample_work
    from loom.data.collate import collate, count_tokens
    from loom.model.zoo import LlamaConfig
    from loom.train.build import build_data, build_model, token_counters
    from loom.train.config import AudioEncoderConfig, ConfigError, ModelConfig, TrainConfig, VisionEncoderConfig

    hf = Path(__file__).resolve().parents[1] / "configs" / "hf"
    llm = LlamaConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model_cfg = ModelConfig(vision=VisionEncoderConfig(hf=str(hf / "tiny-qwen2-vl")),
                            audio=AudioEncoderConfig(hf=str(hf / "tiny-whisper")), llm=llm)
    cfg = TrainConfig(model=model_cfg)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=8,
                                   demo=DemoConfig(num_samples=16, seed=3, sample_rate=RATE))
    cfg.check()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=0)
    arch, counts = arch_from_model(model), token_counters(model)
    samples = [dataset[i] for i in range(8)]
    assert any(s.images for s in samples) and any(s.audios for s in samples)
    for s in samples:
        for item in s.meta.images:
            assert counts["vision"](item) == arch.module("vision").llm_tokens(item)
        for item in s.meta.audios:
            assert counts["audio"](item) == arch.module("audio").llm_tokens(item) == 100
    for s in samples:  # the sequence length collation makes (count_tokens) is the cost model's
        assert count_tokens(s.meta, counts)["llm"] == sample_work(arch, [s.meta])["llm"].tokens
    batch = collate(samples, tokenizer, counts, placeholder_ids=model.placeholder_ids)
    loss = model.loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.encoders["vision"].encoder.parameters())
    bare = tmp_path / "whisper-without-extractor"
    bare.mkdir()
    (bare / "config.json").write_text((hf / "tiny-whisper" / "config.json").read_text())
    cfg.model.audio = AudioEncoderConfig(hf=str(bare))
    with pytest.raises(ConfigError, match="model.audio.hf = .*takes what its processor makes.*has none"):
        build_model(cfg.model, tokenizer, seed=0, device="meta")



def test_the_processor_field_overrides_or_removes_the_directorys_own(saved, tmp_path):
    """``model.<name>.processor``: another directory's processor, ``"none"``, or refused naming
    the field (unreadable, or without ``hf``)."""
    from pathlib import Path

    from loom.data.tokenizer import Tokenizer
    from loom.train.build import build_model
    from loom.train.config import ConfigError, ModelConfig, TrainConfig, VisionEncoderConfig

    dirs, _, _ = saved
    hf = str(Path(__file__).resolve().parents[1] / "configs" / "hf" / "tiny-qwen2-vl")

    def vision(**fields):
        cfg = ModelConfig(vision=VisionEncoderConfig(hf=hf, **fields), audio=None)
        return build_model(cfg, Tokenizer(), device="meta").encoders["vision"]

    big = ImageMeta(64, 64)
    assert vision().num_tokens(big) == 36  # its own: at most 48 x 48 pixels
    assert vision(processor=str(dirs["qwen2_vl"])).num_tokens(big) == 25  # the other: at most 40 x 40
    none = vision(processor="none")
    assert none.before_encoder is None and none.num_tokens(big) == 64  # the images as they come
    with pytest.raises(ConfigError, match="model.vision.processor = .*is not a directory"):
        vision(processor=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"model.vision.processor = .*\(4, 2, 2\) but encoder"):
        build_model(ModelConfig(vision=VisionEncoderConfig(hf=str(Path(hf).parent / "tiny-siglip"),
                                                           processor=str(dirs["qwen2_vl"])), audio=None),
                    Tokenizer(), device="meta")
    cfg = TrainConfig(model=ModelConfig(vision=VisionEncoderConfig(processor=str(dirs["siglip"]))))
    with pytest.raises(ConfigError, match="model.vision.processor"):
        cfg.check()
