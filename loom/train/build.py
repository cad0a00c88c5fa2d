"""From a `TrainConfig` to the objects a run needs: tokenizer, dataset, model, token counts.

Every rank calls `build_model` with the same seed, so every rank (and the single-process
reference) starts from identical weights.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from loom.data.collate import MODALITIES
from loom.data.demo import DemoDataset
from loom.data.sample import SampleMeta
from loom.data.tokenizer import Tokenizer
from loom.model.multimodal import ModalityEncoder, MultimodalModel
from loom.model.zoo import AudioEncoder, LlamaForCausalLM, VisionEncoder
from loom.train.config import ConfigError, ModelConfig, TrainConfig


def build_model(cfg: ModelConfig, tokenizer: Tokenizer, seed: int = 0) -> MultimodalModel:
    """The tiny-zoo `MultimodalModel` described by ``cfg``, initialised from ``seed``."""
    torch.manual_seed(seed)
    encoders: dict[str, ModalityEncoder] = {}
    if cfg.vision is not None:
        encoders["vision"] = ModalityEncoder(VisionEncoder(cfg.vision), projector=cfg.projector)
    if cfg.audio is not None:
        encoders["audio"] = ModalityEncoder(AudioEncoder(cfg.audio), projector=cfg.projector)
    llm_cfg = cfg.llm
    if llm_cfg.vocab_size < tokenizer.vocab_size:
        llm_cfg = dataclasses.replace(llm_cfg, vocab_size=tokenizer.vocab_size)
    model = MultimodalModel(
        encoders,
        LlamaForCausalLM(llm_cfg),
        placeholder_ids={name: tokenizer.token_id(MODALITIES[name][0]) for name in encoders},
    )
    if cfg.freeze:
        try:
            model.freeze(*cfg.freeze)
        except ValueError as e:
            raise ConfigError(f"model.freeze: {e}") from e
    return model


def token_counters(model: MultimodalModel) -> dict[str, Callable]:
    """Per encoder, the function from an item's metadata to its number of tokens."""
    return {name: enc.num_tokens for name, enc in model.encoders.items()}


def num_targets(meta: SampleMeta) -> int:
    """Target tokens of a sample from metadata alone: every text token after BOS predicts
    nothing but the next text token, and modality markers are never targets (the collation's
    label rule, `loom.data.collate.collate`)."""
    return meta.text_tokens - len(meta.images) - len(meta.audios) - 1


def build_data(cfg: TrainConfig) -> tuple[Tokenizer, DemoDataset]:
    return Tokenizer(), DemoDataset(cfg.data.demo)
