"""Tiny reference models: plain ``nn.Module``s that implement the layer-list contract
(``loom.model.layers``) themselves, small enough for CPU tests and demos."""

from loom.model.zoo.audio import AudioConfig, AudioEncoder
from loom.model.zoo.llama import LlamaConfig, LlamaForCausalLM
from loom.model.zoo.vision import VisionConfig, VisionEncoder

__all__ = [
    "AudioConfig",
    "AudioEncoder",
    "LlamaConfig",
    "LlamaForCausalLM",
    "VisionConfig",
    "VisionEncoder",
]
