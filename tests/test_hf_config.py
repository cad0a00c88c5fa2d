"""``[model.llm] hf = "<dir>"``: a Hugging Face causal LM from a local directory, built on the
meta device from its config, its layers initialised from the directory's safetensors (only the
tensors of the layers a rank materialises are read) or, without weights, seeded by the model's
own init; refused with a one-line `ConfigError` naming ``model.llm.hf`` when it cannot work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.data.tokenizer import Tokenizer  # noqa: E402
from loom.model.weights import SafetensorsWeights  # noqa: E402
from loom.train.build import build_model  # noqa: E402
from loom.train.config import ConfigError, ModelConfig, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def save_llama(directory: Path, weights: bool = True, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, **overrides}))
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    return model


def model_config(path: Path | str) -> ModelConfig:
    cfg = load_config(ROOT / "configs/demo.toml", [f'model.llm.hf="{path}"'])
    return cfg.model


def test_weights_load_per_layer_by_name(tmp_path):
    saved = save_llama(tmp_path)
    cfg = model_config(tmp_path)
    model = build_model(cfg, Tokenizer(), seed=0, device="cpu")
    assert isinstance(model.llm, transformers.LlamaForCausalLM)
    for name, value in saved.state_dict().items():
        assert torch.equal(model.llm.state_dict()[name], value), name
    torch.testing.assert_close(model.llm.model.rotary_emb.inv_freq, saved.model.rotary_emb.inv_freq, rtol=0, atol=0)

    # a pipeline rank: built on meta, materialises its stage only, and reads only its tensors
    read: list[str] = []
    original = SafetensorsWeights.tensor

    def spy(self, name):
        read.append(name)
        return original(self, name)

    staged = build_model(cfg, Tokenizer(), seed=0, device="meta")
    SafetensorsWeights.tensor = spy
    try:
        staged.materialise("llm", "cpu", 2, 4)  # model.layers.1, model.norm
    finally:
        SafetensorsWeights.tensor = original
    assert sorted(read) == sorted(n for n in saved.state_dict() if n.startswith(("model.layers.1.", "model.norm.")))
    assert torch.equal(staged.llm.model.layers[1].mlp.up_proj.weight, saved.model.layers[1].mlp.up_proj.weight)
    assert staged.llm.model.layers[0].mlp.up_proj.weight.is_meta


def test_tied_checkpoint_gives_a_head_only_stage_the_embedding(tmp_path):
    saved = save_llama(tmp_path, tie_word_embeddings=True)  # the safetensors hold the embedding only
    staged = build_model(model_config(tmp_path), Tokenizer(), seed=0, device="meta")
    staged.materialise("llm", "cpu", 3, 5)  # norm and head: a last stage
    assert staged.llm.model.embed_tokens.weight.is_meta
    assert torch.equal(staged.llm.lm_head.weight, saved.model.embed_tokens.weight)
    whole = build_model(model_config(tmp_path), Tokenizer(), seed=0, device="cpu")
    assert whole.llm.lm_head.weight is whole.llm.model.embed_tokens.weight


def test_config_only_directory_is_seeded_by_the_models_init(tmp_path):
    save_llama(tmp_path, weights=False)
    cfg = model_config(tmp_path / "config.json")  # the config file itself works too
    a = build_model(cfg, Tokenizer(), seed=5, device="cpu").llm.state_dict()
    b = build_model(cfg, Tokenizer(), seed=5, device="cpu").llm.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.self_attn.q_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)


def test_refusals_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model.llm.hf = .*does not exist"):
        model_config(tmp_path / "missing")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4).save_pretrained(gpt2)
    with pytest.raises(ConfigError, match=r"model.llm.hf = .*model_type 'gpt2' has no loom layer adapter"):
        model_config(gpt2)
    small = tmp_path / "small"
    save_llama(small, weights=False, vocab_size=16)
    with pytest.raises(ConfigError, match=r"vocab_size \(16\) is smaller than the tokenizer's \(41 ids\)"):
        build_model(model_config(small), Tokenizer(), device="meta")
    with pytest.raises(ConfigError, match="data.pack_sequences"):
        load_config(ROOT / "configs/demo.toml", [f'model.llm.hf="{small}"', "data.pack_sequences=true"])
    tied = tmp_path / "tied"
    save_llama(tied, weights=False, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=r"plan.modules.llm.tensor_parallel = 2: model.llm.hf ties its embeddings"):
        load_config(ROOT / "configs/demo.toml", [f'model.llm.hf="{tied}"', "plan.modules.llm.tensor_parallel=2"])


@pytest.mark.multiprocess
def test_loom_train_with_an_hf_llama(tmp_path):
    save_llama(tmp_path / "llama", tie_word_embeddings=True)  # tied: summed across the 2 stages
    config = tmp_path / "text.toml"
    config.write_text(f"""
[run]
steps = 2
log_every = 1
[model]
vision = "none"
audio = "none"
[model.llm]
hf = "{tmp_path / 'llama'}"
[data]
global_batch_size = 4
[data.demo]
num_samples = 16
mix = {{ text = 1.0 }}
[plan]
num_microbatches = 2
[[plan.modules]]
name = "llm"
num_stages = 2
""")
    out = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--config", str(config), "run.name=hf",
                          f"run.out_dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["loss"] > 0 for r in rows)
    assert rows[0]["loss"] == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.2)
