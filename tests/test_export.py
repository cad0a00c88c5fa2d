"""``loom export RUN_DIR --hf OUT_DIR`` (`loom.train.export`, issue 13): a run's checkpoint as a
Hugging Face model directory that ``transformers`` loads with no missing or unexpected keys and
whose logits equal loom's. Each run is trained one step and checkpointed in this process (a
world of 1 over a gloo HashStore), so the export reads trained weights, not the source's."""

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from loom.cli import main  # noqa: E402
from loom.model.adapter import adapter_for  # noqa: E402
from loom.model.layers import run_layers  # noqa: E402
from loom.train.checkpoint import Checkpointer  # noqa: E402
from loom.train.config import config_to_toml, load_config  # noqa: E402
from loom.train.build import build_data, build_model  # noqa: E402
from loom.train.export import ExportError, _hf_tensors, export_run, zoo_llama_config  # noqa: E402
from loom.train.rank import build_rank  # noqa: E402

TEXT_ONLY = ['model.vision="none"', 'model.audio="none"', 'plan.modules=[{name="llm"}]', "plan.num_microbatches=1",
             "data.global_batch_size=2", "data.demo.mix={text=1.0}"]
ZOO = ["model.llm.hidden_size=16", "model.llm.num_layers=2", "model.llm.intermediate_size=32",
       "model.llm.num_heads=2", "model.llm.num_kv_heads=1", "model.llm.rope_theta=500.0", "model.llm.norm_eps=1e-6"]
HF_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=1e-6)
IDS = torch.tensor([[3, 17, 5, 9, 30, 2, 11], [8, 1, 40, 7, 7, 12, 4]])


def hf_source(directory: Path, tied: bool) -> Path:
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE, tie_word_embeddings=tied)).save_pretrained(
        directory)
    return directory


def trained_run(tmp: Path, overrides: list[str],
                probe: Callable[[torch.nn.Module], Any] | None = None) -> tuple[Path, torch.Tensor]:
    """``tmp/run``: a run of ``overrides`` after one step, checkpointed as step_1, and loom's
    logits of `IDS` through the LLM's layer list (with ``probe``: and ``probe(model)`` of the
    trained model, as a third item)."""
    cfg = load_config(None, overrides)
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        run = build_rank(cfg, torch.device("cpu"))
        run.step(0)
        with torch.no_grad():  # weights far from the 0.02-std init: attention (and so RoPE) then matters
            for param in run.engine.named_parameters().values():
                if param.dim() > 1:
                    param.mul_(8)
        Checkpointer(run, run_dir).save(1)
        llm = adapter_for(run.engine.executor.model.llm)
        with torch.no_grad():
            logits = run_layers(llm.layers(), None, llm.context({"input_ids": IDS}))
            probed = probe(run.engine.executor.model) if probe is not None else None
    finally:
        dist.destroy_process_group()
    return (run_dir, logits) if probe is None else (run_dir, logits, probed)


def load_exported(out: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        return model, model.eval()(input_ids=IDS).logits


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    return trained_run(tmp_path_factory.mktemp("zoo"), TEXT_ONLY + ZOO)


def test_hf_llama_with_a_vision_encoder_round_trips(tmp_path, capsys):
    source = hf_source(tmp_path / "src", tied=False)
    run_dir, logits = trained_run(tmp_path, [
        f'model.llm.hf="{source}"', 'model.audio="none"', "model.vision.hidden_size=16", "model.vision.num_layers=1",
        'plan.modules=[{name="vision"}, {name="llm"}]', 'plan.placement="first_stage"', "plan.num_microbatches=1",
        "data.global_batch_size=2", "data.demo.mix={text=1.0, image=1.0}", "data.demo.max_image_size=16"])
    out = tmp_path / "out"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    model, exported = load_exported(out)
    torch.testing.assert_close(exported, logits)
    source_embed = transformers.LlamaForCausalLM.from_pretrained(source).model.embed_tokens.weight
    assert not torch.equal(model.model.embed_tokens.weight, source_embed), "the trained weights, not the source's"
    assert (out / "generation_config.json").read_text() == (source / "generation_config.json").read_text()
    # the vision encoder and its projector: loom's names, described, and loadable into loom's model
    index = json.loads((out / "loom_modules.json").read_text())
    assert list(index["modules"]) == ["encoders.vision"] and index["step"] == 1
    assert index["modules"]["encoders.vision"]["config"]["hidden_size"] == 16
    with safe_open(out / "loom_modules.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == set(index["modules"]["encoders.vision"]["tensors"])
    assert any(n.startswith("encoders.vision.projector.") for n in names)
    assert (out / "loom_config.toml").read_text() == (run_dir / "config.toml").read_text()
    cfg = load_config(out / "loom_config.toml")
    loom_model = build_model(cfg.model, build_data(cfg)[0], device="cpu")
    loaded = loom_model.load_state_dict(load_file(out / "loom_modules.safetensors"), strict=False)
    assert not loaded.unexpected_keys and all(k.startswith("llm.") for k in loaded.missing_keys)


def test_tied_hf_llama_writes_what_save_pretrained_writes(tmp_path):
    source = hf_source(tmp_path / "src", tied=True)
    run_dir, logits = trained_run(tmp_path, [f'model.llm.hf="{source}"', *TEXT_ONLY])
    result = export_run(run_dir, tmp_path / "out")
    assert result.llm == "hf" and result.loom_modules == []
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f, safe_open(source / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys()) and "lm_head.weight" not in f.keys()
    model, exported = load_exported(tmp_path / "out")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(exported, logits)
    assert not (tmp_path / "out" / "loom_modules.json").exists()


def test_zoo_llama_exports_as_hf_llama(zoo_run, tmp_path):
    run_dir, logits = zoo_run
    result = export_run(run_dir, tmp_path / "out", step=1)
    assert (result.llm, result.model_type, result.step) == ("zoo", "llama", 1)
    model, exported = load_exported(tmp_path / "out")
    assert model.config.rms_norm_eps == 1e-6 and model.config.rope_parameters["rope_theta"] == 500.0
    torch.testing.assert_close(exported, logits)


def test_an_llm_that_does_not_map_onto_hf_is_refused():
    config = zoo_llama_config(load_config(None, ZOO).model.llm, vocab_size=41)
    model = transformers.LlamaForCausalLM(config)
    state = dict(model.state_dict())
    with pytest.raises(ExportError, match=r"does not map onto LlamaForCausalLM .*unexpected \['model.layers.0.self_attn.qkv"):
        _hf_tensors(config, {**state, "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(1)}, "the zoo Llama")
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ExportError, match=r"model.norm.weight has shape \[3\] in the checkpoint and \[16\]"):
        _hf_tensors(config, state, "the zoo Llama")


def test_refusals_are_one_line_and_name_the_fix(zoo_run, tmp_path, capsys):
    run_dir, _ = zoo_run

    def error(*args: str) -> str:
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("loom: error: ") and err.count("\n") == 1, err
        return err

    assert "no such run directory" in error(str(tmp_path / "missing"), "--hf", str(tmp_path / "o"))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.toml").write_text((run_dir / "config.toml").read_text())
    assert "has no complete checkpoint" in error(str(tmp_path / "bare"), "--hf", str(tmp_path / "o"))
    assert "no complete checkpoint step_7; complete ones: ['step_1']" in error(
        str(run_dir), "--hf", str(tmp_path / "o"), "--step", "7")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    assert "not empty" in error(str(run_dir), "--hf", str(busy)) and (busy / "keep").exists()
    assert "overlaps the run directory" in error(str(run_dir), "--hf", str(run_dir / "hf"), "--overwrite")
    assert main(["export", str(run_dir), "--hf", str(busy), "--overwrite"]) == 0
    assert not (busy / "keep").exists() and (busy / "model.safetensors").is_file()
    # a checkpoint of another model than config.toml builds
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoints").symlink_to(run_dir / "checkpoints")
    (other / "config.toml").write_text(config_to_toml(load_config(None, TEXT_ONLY + ZOO + ["model.llm.hidden_size=32"])))
    assert "is of another model" in error(str(other), "--hf", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists(), "nothing is written before every check passed"


# ---- Hugging Face encoders as Hugging Face directories -------------------------------------------
HF_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "hf"
# [model.<name>] hf = configs/hf/<dir>: each registered family, two under the zoo's names
HF_ENCODERS = {"siglip": "tiny-siglip", "clip": "tiny-clip", "vision": "tiny-qwen2-vl", "audio": "tiny-whisper"}


def encoder_inputs(qwen_dir: Path = HF_CONFIGS / "tiny-qwen2-vl",
                   whisper_dir: Path = HF_CONFIGS / "tiny-whisper") -> dict[str, dict[str, Any]]:
    """One input per encoder: pixels for SigLIP / CLIP, what the processors in ``qwen_dir`` and
    ``whisper_dir`` (by default the sources') make of an image (Qwen2-VL) and of a clip (Whisper)."""
    g = torch.Generator().manual_seed(5)
    image = (torch.rand(3, 40, 56, generator=g) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    clip = (torch.rand(12000, generator=g) - 0.5).numpy()
    qwen = transformers.AutoImageProcessor.from_pretrained(qwen_dir)([image], return_tensors="pt")
    whisper = transformers.AutoFeatureExtractor.from_pretrained(whisper_dir)([clip], sampling_rate=16000,
                                                                            return_tensors="pt")
    pixels = torch.rand(2, 3, 32, 32, generator=g)
    return {"siglip": {"images": list(pixels)}, "clip": {"images": list(pixels)},
            "vision": {"pixel_values": qwen["pixel_values"], "image_grid_thw": qwen["image_grid_thw"]},
            "audio": {"input_features": whisper["input_features"]}}


def loom_encoder_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each trained encoder's output on `encoder_inputs`, before its projector."""
    return {name: model.encoders[name].encoder(**inputs) for name, inputs in encoder_inputs().items()}


@pytest.fixture(scope="module")
def hf_encoders_run(tmp_path_factory) -> tuple[Path, torch.Tensor, dict[str, torch.Tensor]]:
    return trained_run(tmp_path_factory.mktemp("hf_encoders"), [
        *(f'model.{name}.hf="{HF_CONFIGS / d}"' for name, d in HF_ENCODERS.items()), *ZOO,
        'plan.modules=[{name="siglip"}, {name="clip"}, {name="vision"}, {name="audio"}, {name="llm"}]',
        'plan.placement="first_stage"', "plan.num_microbatches=1", "data.global_batch_size=2",
        "data.demo.mix={image_audio=1.0}", "data.demo.sample_rate=16000", "data.demo.max_image_size=32"],
        probe=loom_encoder_outputs)


def test_hf_encoders_export_as_hf_directories(hf_encoders_run, tmp_path, capsys):
    run_dir, logits, loom_out = hf_encoders_run
    out = tmp_path / "out"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Hugging Face encoders audio (WhisperEncoder), clip (CLIPVisionModel)" in printed, printed
    torch.testing.assert_close(load_exported(out)[1], logits)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    classes = {"siglip": transformers.AutoModel, "clip": transformers.AutoModel,
               "vision": Qwen2VisionTransformerPretrainedModel, "audio": WhisperEncoder}
    index = json.loads((out / "loom_modules.json").read_text())
    inputs = encoder_inputs(out / "vision", out / "audio")  # by the processors of the exported directories
    for name, cls in classes.items():
        model, info = cls.from_pretrained(out / name, output_loading_info=True)
        assert not any(info.values()), (name, info)
        assert next(model.parameters()).dtype == torch.float32
        src = json.loads((HF_CONFIGS / HF_ENCODERS[name] / "config.json").read_text())
        got = json.loads((out / name / "config.json").read_text())
        changed = {k for k in src if k != "transformers_version" and got.get(k) != src[k]}
        assert changed == ({"vision_use_head"} if name == "siglip" else set()), (name, changed)
        with torch.no_grad():
            if name == "vision":
                hf_out = model(inputs[name]["pixel_values"], grid_thw=inputs[name]["image_grid_thw"]).pooler_output
            elif name == "audio":
                hf_out = model(inputs[name]["input_features"]).last_hidden_state.flatten(0, 1)
            else:
                hf_out = model(pixel_values=torch.stack(inputs[name]["images"])).last_hidden_state.flatten(0, 1)
        torch.testing.assert_close(hf_out, loom_out[name], rtol=1e-5, atol=1e-5, msg=name)
        entry = index["modules"][f"encoders.{name}"]
        assert entry["kind"] == "hf_encoder" and entry["hf"]["directory"] == name
        assert set(entry["tensors"]) and all(".projector." in k for k in entry["tensors"]), entry["tensors"]
        assert entry["hf"]["untrained"] == ({"post_layernorm.weight": "init", "post_layernorm.bias": "init"}
                                            if name == "clip" else {}), name
    # the processors beside them, as the source had them
    for name, auto in (("vision", transformers.AutoImageProcessor), ("audio", transformers.AutoFeatureExtractor)):
        assert (out / name / "preprocessor_config.json").read_text() == (
            HF_CONFIGS / HF_ENCODERS[name] / "preprocessor_config.json").read_text()
        assert type(auto.from_pretrained(out / name)).__name__ == type(auto.from_pretrained(
            HF_CONFIGS / HF_ENCODERS[name])).__name__
    assert not (out / "siglip" / "preprocessor_config.json").exists()  # the source has none
    with safe_open(out / "loom_modules.safetensors", "pt") as f:
        assert all(".projector." in k for k in f.keys())
    # the whole model rebuilds from the export: loom's projectors plus each HF directory's tensors
    cfg = load_config(out / "loom_config.toml")
    loom_model = build_model(cfg.model, build_data(cfg)[0], device="cpu")
    hf_state = {f"encoders.{n}.encoder.model.{k}": v for n in classes for k, v in load_file(out / n / "model.safetensors").items()}
    loaded = loom_model.load_state_dict({**load_file(out / "loom_modules.safetensors"), **hf_state}, strict=False)
    assert all(k.startswith("llm.") for k in loaded.missing_keys), loaded.missing_keys
    assert set(loaded.unexpected_keys) == {"encoders.clip.encoder.model.post_layernorm.weight",
                                           "encoders.clip.encoder.model.post_layernorm.bias"}


def test_an_hf_encoder_that_does_not_map_onto_its_class_is_refused():
    from loom.train.export import _hf_encoder

    cfg = load_config(None, [f'model.siglip.hf="{HF_CONFIGS / "tiny-siglip"}"'])
    enc_cfg = cfg.model.encoder_configs()["siglip"]
    from loom.model.hf_encoders import encoder_from_config, load_encoder_config

    prefix = "encoders.siglip.encoder.model."
    state = {prefix + k: v for k, v in encoder_from_config(load_encoder_config(enc_cfg.hf)).model.state_dict().items()}
    exported = _hf_encoder(cfg, "siglip", enc_cfg, state)
    assert exported.cls == "SiglipVisionModel" and not exported.untrained and not exported.config.vision_use_head
    with pytest.raises(ExportError, match=r"model.siglip.hf = .*does not map onto SiglipVisionModel .*head.probe"):
        _hf_encoder(cfg, "siglip", enc_cfg, {**state, prefix + "head.probe": torch.zeros(1)})
    with pytest.raises(ExportError, match=r"does not map onto SiglipVisionModel \(missing \['post_layernorm.bias'\]"):
        _hf_encoder(cfg, "siglip", enc_cfg, {k: v for k, v in state.items() if not k.endswith("post_layernorm.bias")})
    state[prefix + "post_layernorm.weight"] = torch.ones(3)
    with pytest.raises(ExportError, match=r"post_layernorm.weight has shape \[3\] in the checkpoint and \[64\]"):
        _hf_encoder(cfg, "siglip", enc_cfg, state)
