"""One 2-process gloo training step per Hugging Face encoder family from the config, against the
single process on the same global batch (docs/architecture.md principle 1), all in one launch:
every family registered in `loom.model.hf_encoders.HF_ENCODERS` that has a tiny config under
configs/hf/ (a family without one fails `test_every_registered_family_has_a_tiny_config`), as
``[model.eye] hf = DIR`` (a renamed encoder), built from the config (random init) or, for the
first family, from the directory's safetensors; alternately on a rank of its own and inside the
LLM's first of 2 stages. One more case renames the zoo's encoders (``[model.eye]`` images,
``[model.ear]`` audio), another has two vision towers over the same images (a zoo ViT, then
SigLIP: each marker expands to both towers' tokens). Batches go through the `Dispatcher` (items found by modality, costs
from `arch_from_model`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from reference import assert_matches_reference, reference_backward, save_rank  # noqa: E402

from loom.balance.config import BalanceConfig  # noqa: E402
from loom.cost.arch_from_model import arch_from_model  # noqa: E402
from loom.data.demo import DemoConfig  # noqa: E402
from loom.model.hf_encoders import HF_ENCODERS  # noqa: E402
from loom.model.zoo import LlamaConfig  # noqa: E402
from loom.plan.plan import ModuleSpec, Plan  # noqa: E402
from loom.runtime.dispatch import Dispatcher  # noqa: E402
from loom.runtime.engine import ParallelEngine  # noqa: E402
from loom.runtime.local import run_local  # noqa: E402
from loom.train.build import build_data, build_model, token_counters  # noqa: E402
from loom.train.config import ENCODER_CONFIGS, AudioEncoderConfig, ModelConfig, TrainConfig, VisionEncoderConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 6
SEED = 3
MIX = {"image": {"text": 0.2, "image": 0.5, "multi_image": 0.3}, "audio": {"text": 0.3, "audio": 0.7}}


def tiny_configs() -> dict[str, Path]:
    """model_type -> the configs/hf/ directory of a tiny config of that registered family."""
    out: dict[str, Path] = {}
    for path in sorted((ROOT / "configs" / "hf").glob("*/config.json")):
        model_type = json.loads(path.read_text()).get("model_type")
        if model_type in HF_ENCODERS:
            out.setdefault(model_type, path.parent)
    return out


def _families() -> list[str]:
    return sorted(tiny_configs())


def test_every_registered_family_has_a_tiny_config():
    """Each adapter in the registry (a full SigLIP / CLIP config shares its tower's) is trained
    by the launch below through a tiny config in configs/hf/."""
    covered = {HF_ENCODERS[t].build for t in tiny_configs()}
    missing = sorted(t for t, fam in HF_ENCODERS.items() if fam.build not in covered)
    assert not missing, f"registered encoder families without a tiny config under configs/hf/: {missing}"
    assert {"siglip_vision_model", "clip_vision_model"} <= set(tiny_configs())


def _cases() -> list[str]:
    return [*_families(), "zoo-renamed", "two-towers"]


def _prepare(out: Path) -> None:
    """Each family's config directory (the first family's with safetensors: the encoder's
    layers then load from the file on every rank and in the reference)."""
    for i, model_type in enumerate(_families()):
        target = out / model_type
        shutil.copytree(tiny_configs()[model_type], target)
        if i == 0:
            from loom.model.hf_encoders import encoder_from_config, load_encoder_config

            torch.manual_seed(7)
            encoder = encoder_from_config(load_encoder_config(target))
            encoder.model.save_pretrained(target)


def _config(case: str, index: int, out: Path) -> TrainConfig:
    llm = LlamaConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    rate = DemoConfig().sample_rate
    small = dict(hidden_size=32, num_layers=1, num_heads=2)
    if case == "zoo-renamed":  # zoo encoders under free names, each consuming its modality
        encoders = {"eye": VisionEncoderConfig(**small), "ear": AudioEncoderConfig(**small, modality="audio")}
        mix = {"text": 0.2, "image": 0.3, "audio": 0.2, "image_audio": 0.3}
    elif case == "two-towers":  # a zoo ViT and a SigLIP tower over the same images, in that order
        siglip = str(ROOT / "configs" / "hf" / "tiny-siglip")
        encoders = {"eye": VisionEncoderConfig(**small), "eye2": VisionEncoderConfig(hf=siglip)}
        mix = MIX["image"]
    else:
        modality = HF_ENCODERS[case].modality
        encoders = {"eye": ENCODER_CONFIGS[modality](hf=str(out / case))}
        mix = MIX[modality]
        extractor = out / case / "preprocessor_config.json"  # a feature extractor takes clips at its rate
        if extractor.is_file() and "sampling_rate" in json.loads(extractor.read_text()):
            rate = json.loads(extractor.read_text())["sampling_rate"]
    model = ModelConfig(vision=None, audio=None, extra_encoders=encoders, llm=llm, projector="mlp")
    if index % 2 == 0 and len(encoders) == 1:  # the encoder on a rank of its own, the LLM on the other
        plan = Plan([ModuleSpec("eye"), ModuleSpec("llm")], num_microbatches=2)
    else:  # the encoders inside the LLM's first of 2 stages
        plan = Plan([*(ModuleSpec(n) for n in encoders), ModuleSpec("llm", num_stages=2)], num_microbatches=2,
                    placement="first_stage")
    cfg = TrainConfig(model=model, plan=plan)
    demo = DemoConfig(num_samples=32, seed=SEED, mix=mix, sample_rate=rate)
    cfg.data = dataclasses.replace(cfg.data, global_batch_size=GLOBAL_BATCH, demo=demo)
    return cfg


def _worker(rank: int, world_size: int, out: str) -> None:
    for index, case in enumerate(_cases()):
        cfg = _config(case, index, Path(out))
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED, device="meta")
        engine = ParallelEngine.create(model, cfg.plan, torch.device("cpu"))
        dispatcher = Dispatcher(cfg.plan, dataset, tokenizer, token_counters(model), arch_from_model(model),
                                BalanceConfig(), torch.device("cpu"), placeholder_ids=model.placeholder_ids)
        got = dispatcher.dispatch(list(range(GLOBAL_BATCH)))
        result = engine.step(got.batches, got.num_targets, 0, layout=got.layout, rows=got.rows)
        loss = torch.tensor([result.loss], dtype=torch.float64)
        dist.all_reduce(loss)
        save_rank(Path(out) / f"{case}_rank{rank}.pt", float(loss), engine.named_parameters(),
                  modules=sorted({m for m, _, _ in cfg.plan.stages_of(rank)}))
        engine.close()


@pytest.mark.multiprocess
def test_one_training_step_per_encoder_family_equals_the_single_process(tmp_path: Path) -> None:
    _prepare(tmp_path)
    run_local(_worker, 2, str(tmp_path))
    for index, case in enumerate(_cases()):
        cfg = _config(case, index, tmp_path)
        tokenizer, dataset = build_data(cfg)
        model = build_model(cfg.model, tokenizer, seed=SEED)
        if index == 0:  # loaded from the directory's safetensors, not seeded
            from safetensors.torch import load_file

            from loom.model.hf_encoders import encoder_weights

            stored = load_file(str(tmp_path / case / "model.safetensors"))
            where = encoder_weights(tmp_path / case)  # a layer's name -> the checkpoint's
            layers = model.module_layers("eye")[:-1]  # the projector is seeded
            compared = [(f"{layer.name.removeprefix('encoders.eye.encoder.')}.{n}", p) for layer in layers
                        for n, p in layer.module.named_parameters()]
            assert compared and all(torch.equal(p, stored[where.key(n)]) for n, p in compared), case
        ref_loss = reference_backward(model, dataset, tokenizer, GLOBAL_BATCH)
        results = [torch.load(tmp_path / f"{case}_rank{r}.pt", weights_only=True) for r in range(2)]
        encoder_items = sum(len(dataset.meta(i).images) + len(dataset.meta(i).audios) for i in range(GLOBAL_BATCH))
        assert encoder_items > 0, case  # the batch feeds the encoders
        try:
            assert_matches_reference(results, model, ref_loss)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from e
