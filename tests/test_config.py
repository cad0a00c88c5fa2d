"""Configuration loading: defaults, overrides, and errors that name the field and the fix."""

import pytest

from loom.train.config import ConfigError, config_to_toml, load_config


def test_demo_config_loads_and_round_trips(tmp_path):
    cfg = load_config("configs/demo.toml")
    assert cfg.plan.world_size == 4 and cfg.plan.encoder_names == ["vision", "audio"]
    (tmp_path / "resolved.toml").write_text(config_to_toml(cfg))
    again = load_config(tmp_path / "resolved.toml")
    assert again == cfg


def test_overrides_reach_nested_fields_and_plan_modules():
    cfg = load_config("configs/demo.toml", ["run.steps=7", "model.llm.num_layers=6",
                                            'model.freeze=["vision.encoder"]', "plan.modules.llm.num_stages=3",
                                            "plan.schedule=gpipe"])
    assert cfg.run.steps == 7 and cfg.model.llm.num_layers == 6 and cfg.model.freeze == ["vision.encoder"]
    assert cfg.plan.spec("llm").num_stages == 3 and cfg.plan.schedule == "gpipe"


def test_stage_count_override_on_a_resolved_config(tmp_path):
    from loom.train.build import build_data, build_model

    cfg = load_config("configs/demo.toml")
    tokenizer, _ = build_data(cfg)
    cfg.plan.resolve(build_model(cfg.model, tokenizer).layer_counts())
    (tmp_path / "resolved.toml").write_text(config_to_toml(cfg))
    again = load_config(tmp_path / "resolved.toml", ["plan.modules.llm.num_stages=3"])
    assert again.plan.spec("llm").stage_boundaries is None and again.plan.spec("llm").num_stages == 3


def test_disabling_an_encoder():
    cfg = load_config(None, ["model.audio=none", "model.vision=none",
                             'plan.modules=[{name="llm", num_stages=2}]', 'data.demo.mix={text=1.0}'])
    assert cfg.model.audio is None and cfg.plan.world_size == 2


@pytest.mark.parametrize("text, words", [
    ("[run]\nsteps = 'ten'\n", ["run.steps", "int"]),
    ("[run]\nstep = 10\n", ["unknown field", "'step'", "steps"]),
    ("[model]\nprojector = 'qformer'\n", ["model.projector", "'linear' or 'mlp'"]),
    ("[run]\ndevice = 'tpu'\n", ["run.device"]),
    ("[model.llm]\nhidden = 3\n", ["unknown field", "'hidden'", "model.llm"]),
    ("[data]\nglobal_batch_size = 2\n", ["global_batch_size = 2", "num_microbatches = 4"]),
    ("[[plan.modules]]\nname = 'video'\n[[plan.modules]]\nname = 'llm'\n", ["'video'", "unknown module name"]),
    ("[run\nsteps = 3\n", ["not valid TOML"]),
])
def test_bad_configs_name_the_field(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="unreadable|not valid TOML"):
        load_config(binary)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["run.steps"])
