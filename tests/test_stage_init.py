"""Per-stage initialisation (issue 9 point 2): a 4-stage LLM on 4 gloo processes, built on the
meta device; each rank materialises its own stage's layers and nothing else, holds exactly its
stage's share of the parameter bytes, starts from the single-process model's values layer by
layer, and trains to the reference loss and gradients. The same holds for a Hugging Face LLM
behind a zoo vision encoder, whose rotary tables every LLM stage recomputes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import loom.model.multimodal as multimodal
from loom.data.demo import DemoConfig
from loom.model.multimodal import ModalityEncoder, MultimodalModel
from loom.model.zoo import LlamaConfig, VisionConfig, VisionEncoder
from loom.plan.plan import ModuleSpec, Plan
from loom.runtime.engine import ParallelEngine
from loom.runtime.local import run_local
from loom.train.build import build_data, build_model
from loom.train.config import ModelConfig, TrainConfig
from reference import assert_matches_reference, identity_step, reference_backward, save_rank

pytestmark = pytest.mark.multiprocess

STAGES = 4  # 9 layers over 4 stages: uneven stages; more ranks would only cost start-up time
GLOBAL_BATCH = 4
SEED = 11


def _config() -> TrainConfig:
    # 6 blocks + embedding, norm and head: 9 layers over the stages
    llm = LlamaConfig(hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=64)
    cfg = TrainConfig(model=ModelConfig(vision=None, audio=None, llm=llm),
                      plan=Plan([ModuleSpec("llm", num_stages=STAGES)], num_microbatches=4))
    demo = DemoConfig(num_samples=16, seed=SEED, mix={"text": 1.0})
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _worker(rank: int, world_size: int, out: str) -> None:
    cfg = _config()
    tokenizer, dataset = build_data(cfg)
    made: list[str] = []
    original = multimodal.materialise

    def recording(layer, device, init):  # every layer this process ever gives memory to
        made.append(layer.name)
        original(layer, device, init)

    multimodal.materialise = recording
    try:
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        made_by_build = list(made)
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    finally:
        multimodal.materialise = original
    held = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    held_bytes = _param_bytes(p for p in model.parameters() if not p.is_meta)
    held_buffers = sorted(n for n, b in model.named_buffers() if not b.is_meta)

    _, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
    save_rank(Path(out) / f"rank{rank}.pt", loss, engine.stage.named_parameters(),
              made=made, made_by_build=made_by_build, held=held, held_bytes=held_bytes, held_buffers=held_buffers,
              stage_layers=[l.name for l in engine.stage.layers],
              mesh=tuple(engine.meshes["llm"].get_coordinate()))


def _reference():
    cfg = _config()
    tokenizer, dataset = build_data(cfg)
    model = build_model(cfg.model, tokenizer, seed=SEED)
    return cfg, model, reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)


def test_each_rank_materialises_only_its_stage(tmp_path):
    run_local(_worker, STAGES, str(tmp_path))
    cfg, model, ref_loss = _reference()
    plan = cfg.plan.resolve(model.layer_counts(), STAGES)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(STAGES)]
    layers = model.module_layers("llm")
    total = 0
    for rank, res in enumerate(results):
        start, end = plan.layers_of("llm", rank)
        mine = layers[start:end]
        assert res["made_by_build"] == [], f"rank {rank}: build_model(device='meta') allocated layers"
        assert res["made"] == res["stage_layers"] == [l.name for l in mine], f"rank {rank} materialised {res['made']}"
        share = _param_bytes(p for l in mine for p in l.module.parameters())
        assert res["held_bytes"] == share, f"rank {rank}: {res['held_bytes']} parameter bytes, its stage has {share}"
        total += share
        expected = {f"{l.name}.{n}": p for l in mine for n, p in l.module.named_parameters()}
        assert sorted(res["held"]) == sorted(expected)
        for name, value in res["held"].items():  # per-layer init equals the single process's
            torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=f"rank {rank} {name}")
        assert res["held_buffers"] == [], "the zoo Llama keeps no buffers"
        assert res["mesh"] == plan.coordinate_of(rank).index == (rank, 0, 0, 0)  # the engine's module mesh
    assert total == _param_bytes(model.parameters())  # the stages partition the model
    assert_matches_reference(results, model, ref_loss)


def _hf_config() -> TrainConfig:
    cfg = TrainConfig(plan=Plan([ModuleSpec("vision"), ModuleSpec("llm", num_stages=2)], num_microbatches=2))
    demo = DemoConfig(num_samples=16, seed=SEED, mix={"text": 0.4, "image": 0.6})
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _hf_model(tokenizer, device: str) -> MultimodalModel:
    """A zoo ViT feeding an unmodified HF Llama, built on meta; ``device != "meta"``
    materialises every layer (the single-process reference)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        vision = ModalityEncoder(VisionEncoder(VisionConfig(hidden_size=16, num_layers=1, num_heads=2)), projector="mlp")
        model = MultimodalModel({"vision": vision}, transformers.LlamaForCausalLM(config),
                                {"vision": tokenizer.token_id("<image>")})
    model.init_seed = SEED
    if device != "meta":
        for name in model.module_names:
            model.materialise(name, device)
    return model


def _hf_worker(rank: int, world_size: int, out: str) -> None:
    cfg = _hf_config()
    tokenizer, dataset = build_data(cfg)
    model = _hf_model(tokenizer, "meta")
    engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
    held = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    buffers = {n: b.clone() for n, b in model.named_buffers() if not b.is_meta}
    _, loss = identity_step(engine, model, dataset, tokenizer, GLOBAL_BATCH)
    save_rank(Path(out) / f"rank{rank}.pt", loss, engine.stage.named_parameters(), held=held,
              buffers=buffers, stage_layers=[l.name for l in engine.stage.layers])


def test_hugging_face_llm_stages_materialise_their_layers_and_rotary_tables(tmp_path):
    pytest.importorskip("transformers")
    run_local(_hf_worker, 3, str(tmp_path))
    cfg = _hf_config()
    tokenizer, dataset = build_data(cfg)
    model = _hf_model(tokenizer, "cpu")
    loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    rotary = sorted(n for n in buffers if "rotary_emb" in n)
    assert rotary, "the HF Llama keeps its rotary tables as buffers"
    for rank, res in enumerate(results):
        stage = set(res["stage_layers"])
        assert {n for n in res["held"]} == {n for n in params if any(n.startswith(f"{l}.") for l in stage)}
        for name, value in res["held"].items():
            torch.testing.assert_close(value, params[name].detach(), rtol=0, atol=0, msg=f"rank {rank} {name}")
        # every LLM stage builds the context (rotary tables) itself; the vision rank holds none
        assert sorted(n for n in res["buffers"] if "rotary_emb" in n) == (rotary if rank > 0 else [])
        for name, value in res["buffers"].items():
            torch.testing.assert_close(value, buffers[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
    assert_matches_reference(results, model, loss)
