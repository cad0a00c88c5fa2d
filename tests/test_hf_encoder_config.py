"""Encoders from the config (`loom.train.config.ModelConfig`): ``[model.<name>]`` tables of any
name with the zoo's fields or ``hf = DIR`` (`loom.model.hf_encoders`), a ``modality`` each;
refusals that name the field; the round trip of the written config; the cost description and
the metadata token rule of a Hugging Face tower against collation; weights from a directory's
safetensors; and ``loom train --dry-run`` on configs/hf/llava.toml. The 2-process training
steps are tests/test_hf_encoder_training.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.train.config import ConfigError, config_to_toml, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIGLIP = str(ROOT / "configs" / "hf" / "tiny-siglip")
IMAGES_ONLY = "data.demo.mix={text=0.2, image=0.5, multi_image=0.3}"
TINY_LLM = ["model.llm.hidden_size=32", "model.llm.num_layers=2", "model.llm.num_heads=4", "model.llm.num_kv_heads=2",
            "model.llm.intermediate_size=64"]


def _eye(*extra: str, plan: str = '[{name="eye"}, {name="llm"}]') -> list[str]:
    """A model whose only encoder is [model.eye], the default vision and audio removed."""
    return ['model.vision="none"', 'model.audio="none"', IMAGES_ONLY, f"plan.modules={plan}", *TINY_LLM, *extra]


@pytest.mark.parametrize("overrides, message", [
    # a path that does not exist / a directory of a model that is no encoder
    (_eye('model.eye.hf="/no/such/dir"'), r"model\.eye\.hf = '/no/such/dir': '/no/such/dir' does not exist"),
    (['model.vision.hf="/no/such/dir"'], r"model\.vision\.hf = '/no/such/dir'.*does not exist"),
    (_eye(f'model.eye.hf="{ROOT / "configs/hf/tiny-llama"}"'),
     r"model\.eye\.hf = .*tiny-llama.*model_type 'llama' is not an encoder loom adapts; supported: .*siglip"),
    # a further table says what it consumes
    (_eye("model.eye.hidden_size=32"), r"model\.eye\.modality = '': .*must say which sample items it consumes"),
    (_eye('model.eye.modality="video"'), r"model\.eye\.modality = 'video': unknown modality"),
    (_eye('model.eye.modality="audio"', f'model.eye.hf="{SIGLIP}"'),
     r"model\.eye\.hf = .*: a SigLIP vision encoder consumes images, but model\.eye\.modality is 'audio'"),
    (['model.vision.modality="audio"'], r"model\.vision\.modality = 'audio': \[model\.vision\] is the default image"),
    # an hf encoder's shapes come from its config
    ([f'model.vision.hf="{SIGLIP}"', "model.vision.hidden_size=32"],
     r"model\.vision\.hidden_size = 32: model\.vision\.hf builds the encoder from its Hugging Face config"),
    # plans name modules by encoder name: one naming an encoder the model lacks is refused
    (_eye(f'model.eye.hf="{SIGLIP}"', plan='[{name="vision"}, {name="llm"}]'),
     r"plan\.modules\['vision'\]: unknown module name; the model has \['eye', 'llm'\]"),
    (_eye(f'model.eye.hf="{SIGLIP}"', plan='[{name="eye", tensor_parallel=2}, {name="llm"}]'),
     r"plan\.modules\['eye'\]\.tensor_parallel = 2: model\.eye\.hf is a Hugging Face encoder"),
    ([f'model.vision.hf="{SIGLIP}"', 'run.profile="p.json"'],
     r"run\.profile = 'p\.json': loom profile does not time Hugging Face encoders yet \(model\.vision\.hf\)"),
    (['model.generator={}', "data.demo.gen_image_size=16", 'model.image.modality="image"', 'model.vision="none"'],
     r"model\.image = 'table': an encoder needs a name"),
])
def test_bad_encoder_tables_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_renamed_and_hf_encoders_round_trip(tmp_path):
    cfg = load_config(None, ['model.vision="none"', 'model.ear.modality="audio"', "model.ear.hidden_size=32",
                             f'model.eye.hf="{SIGLIP}"', 'model.audio="none"',
                             'plan.modules=[{name="ear"}, {name="eye"}, {name="llm", num_stages=2}]'])
    assert list(cfg.model.encoder_configs()) == ["ear", "eye"]  # the file's order
    assert cfg.model.extra_encoders["eye"].modality == "image"  # from the SigLIP family
    text = config_to_toml(cfg)
    assert "[model.eye]" in text and "[model.ear]" in text
    (tmp_path / "c.toml").write_text(text)
    assert load_config(tmp_path / "c.toml") == cfg
    # an override removes a further encoder as it removes vision / audio
    again = load_config(tmp_path / "c.toml", ['model.ear="none"', 'plan.modules=[{name="eye"}, {name="llm"}]',
                                              IMAGES_ONLY])
    assert list(again.model.encoder_configs()) == ["eye"]


def test_an_hf_tower_is_priced_and_counted_as_collation_expands_it():
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.workload import sample_tokens
    from loom.data.collate import collate, count_tokens
    from loom.train.build import build_data, build_model, token_counters

    cfg = load_config(None, _eye(f'model.eye.hf="{SIGLIP}"'))
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=0)
    arch = arch_from_model(model)  # checks every layer's parameter count against the module
    eye = arch.module("eye")
    assert eye.kind == "vision" and eye.item_tokens == (32 // 8) ** 2 == model.encoders["eye"].encoder.tokens_per_image
    assert eye.params == sum(p.numel() for p in model.encoders["eye"].parameters())
    metas = [dataset.meta(i) for i in range(12)]
    assert any(len(m.images) > 1 for m in metas) and any(not m.images for m in metas)
    counts = token_counters(model)
    costed = sample_tokens(arch, metas)
    by_meta = [count_tokens(m, counts) for m in metas]
    assert costed.tokens["eye"].tolist() == [c["eye"] for c in by_meta]
    assert costed.tokens["llm"].tolist() == [c["llm"] for c in by_meta]
    batch = collate([dataset[i] for i in range(12)], tokenizer, counts, model.placeholder_ids)
    assert (batch.input_ids != tokenizer.pad_id).sum(1).tolist() == [c["llm"] for c in by_meta]
    assert len(batch.modality_inputs["eye"]["images"]) == sum(len(m.images) for m in metas)
    loss = model.loss(batch)
    loss.backward()
    assert all(p.grad is not None for p in model.encoders["eye"].parameters())


def test_a_full_siglip_checkpoint_loads_its_vision_tower(tmp_path):
    from loom.train.build import build_data, build_model

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    torch.manual_seed(0)
    full = transformers.SiglipModel(transformers.SiglipConfig(vision_config=vision, text_config=text))
    full.save_pretrained(tmp_path)
    cfg = load_config(None, _eye(f'model.eye.hf="{tmp_path}"'))
    tokenizer, _ = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=0)
    mine = dict(model.encoders["eye"].encoder.named_parameters())
    theirs = dict(full.vision_model.named_parameters())
    assert mine and all(torch.equal(p, theirs[n[len("model."):]]) for n, p in mine.items())
    seeded = build_model(cfg.model, tokenizer, seed=0)
    assert torch.equal(dict(seeded.encoders["eye"].named_parameters())["projector.0.weight"],
                       dict(model.encoders["eye"].named_parameters())["projector.0.weight"])  # projectors: seeded


def test_loom_train_dry_run_with_encoders_from_hf_configs(tmp_path):
    from loom.cli import main

    assert main(["data", "write-demo", "--out", str(tmp_path / "data"), "--num-samples", "16"]) == 0
    args = ["train", "--config", str(ROOT / "configs/hf/llava.toml"), "--dry-run", f"run.out_dir={tmp_path}",
            f"data.path={tmp_path / 'data' / 'train.json'}"]
    assert main(args) == 0
    written = load_config(tmp_path / "llava" / "config.toml")
    assert list(written.model.encoder_configs()) == ["siglip", "whisper"]
    assert written.model.extra_encoders["siglip"].hf.endswith("tiny-siglip") and written.model.llm.hf


def test_a_second_vision_tower_encodes_the_same_images_after_the_first():
    """``[model.vision]`` (zoo) and ``[model.eye]`` (SigLIP) both consume the images: each
    ``<image>`` expands to the vision tokens, then the SigLIP tokens (config order), with a
    placeholder id each; collation, the BAM spans and the cost model agree on every length."""
    from loom.cost.arch_from_model import arch_from_model
    from loom.cost.workload import sample_tokens
    from loom.data.bam import sample_spans
    from loom.data.collate import collate, count_tokens
    from loom.train.build import build_data, build_model, token_counters

    cfg = load_config(None, ['model.audio="none"', f'model.eye.hf="{SIGLIP}"', "model.vision.hidden_size=32",
                             IMAGES_ONLY, *TINY_LLM])
    assert cfg.plan.module_names == ["vision", "eye", "llm"]  # the default layout places both
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=0)
    image = tokenizer.token_id("<image>")
    assert model.placeholder_ids == {"vision": image, "eye": tokenizer.vocab_size}  # past every text id
    counts, arch = token_counters(model), arch_from_model(model)
    n = 16
    metas = [dataset.meta(i) for i in range(n)]
    by_meta = [count_tokens(m, counts) for m in metas]
    assert sample_tokens(arch, metas).tokens["llm"].tolist() == [c["llm"] for c in by_meta]
    batch = collate([dataset[i] for i in range(n)], tokenizer, counts, model.placeholder_ids)
    assert (batch.input_ids != tokenizer.pad_id).sum(1).tolist() == [c["llm"] for c in by_meta]
    s = next(i for i, m in enumerate(metas) if len(m.images) >= 2)
    ids = batch.input_ids[s].tolist()
    first = ids.index(image)
    vision = [counts["vision"](item) for item in metas[s].images]
    eye = counts["eye"](metas[s].images[0])
    assert ids[first:first + vision[0] + eye] == [image] * vision[0] + [tokenizer.vocab_size] * eye
    assert [sp.kind for sp in sample_spans(metas[s], tokenizer.encode(dataset[s].text), tokenizer, counts)
            if sp.kind != "text"] == ["vision", "eye"] * len(metas[s].images)
    assert batch.modality_inputs["eye"]["images"] == batch.modality_inputs["vision"]["images"]
    model.loss(batch).backward()
    for name in ("vision", "eye"):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoders[name].parameters()), name
