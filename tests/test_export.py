"""``loom export RUN_DIR --hf OUT_DIR`` (`loom.train.export`, issue 13): a run's checkpoint as a
Hugging Face model directory that ``transformers`` loads with no missing or unexpected keys and
whose logits equal loom's. Each run is trained one step and checkpointed in this process (a
world of 1 over a gloo HashStore), so the export reads trained weights, not the source's."""

import json
from datetime import timedelta
from pathlib import Path

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


def trained_run(tmp: Path, overrides: list[str]) -> tuple[Path, torch.Tensor]:
    """``tmp/run``: a run of ``overrides`` after one step, checkpointed as step_1, and loom's
    logits of `IDS` through the LLM's layer list."""
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
    finally:
        dist.destroy_process_group()
    return run_dir, logits


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
