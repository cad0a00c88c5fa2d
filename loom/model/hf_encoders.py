"""Hugging Face encoders from a config: the registry from a config's ``model_type`` to the loom
encoder that adapts it (`HF_ENCODERS`), and what ``[model.<encoder>] hf = DIR`` needs: reading
the config, building the encoder on the caller's device, and its checkpoint's tensors.

An entry (`HFEncoderFamily`) says which modality the encoder consumes (``"image"`` or
``"audio"``: the sample items and the text marker, `loom.data.collate.MODALITY_KINDS`) and how to
build the loom encoder (an ``nn.Module`` with the layer contract of `loom.model.layers`,
``num_tokens(item_meta)`` and ``hidden_size``) from the config. To add a family, add an entry:

    HF_ENCODERS["whisper"] = HFEncoderFamily("audio", build_whisper_encoder, "Whisper encoder")

A checkpoint's tensors are found by the encoder's layer names (`EncoderWeights`): the adapters
name a layer by its path inside the Hugging Face model (``model.embeddings``), and a bare
encoder's ``save_pretrained`` stores it without the ``model.`` (``embeddings...``), a full
dual-encoder model (SigLIP, CLIP) under ``vision_model.``; both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from loom.model.hf import read_config
from loom.model.weights import SafetensorsWeights

MODALITY_NAMES = ("image", "audio")  # what an encoder may consume (loom.data.collate.MODALITY_KINDS)


@dataclass(frozen=True)
class HFEncoderFamily:
    """One registered Hugging Face encoder family: the modality its items are (``"image"`` /
    ``"audio"``), ``build(config)`` -> the loom encoder, allocated where the caller's device
    context says (``torch.device("meta")`` for a rank that materialises only its stage), and a
    name for messages."""

    modality: str
    build: Callable[[Any], nn.Module]
    title: str

    def __post_init__(self) -> None:
        if self.modality not in MODALITY_NAMES:
            raise ValueError(f"HFEncoderFamily {self.title!r}: modality = {self.modality!r}; use one of "
                             f"{list(MODALITY_NAMES)}")


def _hf_vision(config: Any) -> nn.Module:
    from loom.model.hf_vision import HFVisionEncoder, vision_model_from_config

    return HFVisionEncoder(vision_model_from_config(config))


def _qwen2vl(config: Any) -> nn.Module:
    from loom.model.hf_qwen2vl import qwen2vl_encoder_from_config

    return qwen2vl_encoder_from_config(config)


def _whisper(config: Any) -> nn.Module:
    from loom.model.hf_whisper import whisper_encoder_from_config

    return whisper_encoder_from_config(config)


# config.model_type -> its family. A full SigLIP / CLIP / Qwen2-VL config builds its vision
# tower, a Whisper config its encoder.
HF_ENCODERS: dict[str, HFEncoderFamily] = {
    "siglip_vision_model": HFEncoderFamily("image", _hf_vision, "SigLIP vision"),
    "siglip": HFEncoderFamily("image", _hf_vision, "SigLIP (its vision tower)"),
    "clip_vision_model": HFEncoderFamily("image", _hf_vision, "CLIP vision"),
    "clip": HFEncoderFamily("image", _hf_vision, "CLIP (its vision tower)"),
    "qwen2_vl_vision": HFEncoderFamily("image", _qwen2vl, "Qwen2-VL vision"),
    "qwen2_vl": HFEncoderFamily("image", _qwen2vl, "Qwen2-VL (its vision tower)"),
    "whisper": HFEncoderFamily("audio", _whisper, "Whisper encoder"),
}


def encoder_family(config: Any) -> HFEncoderFamily:
    """The registered family of ``config`` (by ``model_type``); a ``ValueError`` naming it and
    the supported types otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in HF_ENCODERS:
        raise ValueError(f"model_type {model_type!r} is not an encoder loom adapts; supported: "
                         f"{', '.join(sorted(HF_ENCODERS))} (loom.model.hf_encoders.HF_ENCODERS)")
    return HF_ENCODERS[model_type]


def load_encoder_config(path: str | Path) -> Any:
    """The Hugging Face config at ``path`` (a model directory or its ``config.json``) of a
    registered encoder family; a one-line ``ValueError`` naming the path otherwise."""
    config = read_config(path)
    encoder_family(config)
    return config


def encoder_from_config(config: Any) -> nn.Module:
    """The loom encoder of ``config``'s family, built under the caller's device context."""
    return encoder_family(config).build(config)


class EncoderWeights:
    """A directory's safetensors read by an encoder's layer names: a name ``model.<path>`` is
    looked up as ``<path>`` (a bare encoder's checkpoint) or ``vision_model.<path>`` /
    ``audio_model.<path>`` (a full model's), whichever the files hold; other names as they are.
    The interface of `SafetensorsWeights` that `loom.model.weights.PretrainedInit` reads."""

    # (a full Qwen2-VL model holds its vision tower under visual. / model.visual., a full Whisper
    # model its encoder under model.encoder.)
    BASES = ("", "vision_model.", "audio_model.", "model.", "visual.", "model.visual.", "encoder.", "model.encoder.")

    def __init__(self, files: list[Path]) -> None:
        self.source = SafetensorsWeights(files)
        self.files = self.source.files

    def key(self, name: str) -> str:
        rest = name[len("model."):] if name.startswith("model.") else name
        for candidate in (name, *(base + rest for base in self.BASES)):
            if candidate in self.source.where:
                return candidate
        return name  # SafetensorsWeights names what is missing

    def tensor(self, name: str):
        return self.source.tensor(self.key(name))


def encoder_weights(path: str | Path) -> EncoderWeights | None:
    """The checkpoint of ``hf = path`` (its directory's ``*.safetensors``), or None without one."""
    p = Path(path)
    files = sorted((p if p.is_dir() else p.parent).glob("*.safetensors"))
    return EncoderWeights(files) if files else None
