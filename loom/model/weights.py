"""Pretrained weights, one layer at a time: the `LayerInit` that fills a freshly allocated layer
from a checkpoint's safetensors instead of a seed (`loom.model.materialise`).

A rank reads only the tensors of the layers it materialises, by name, through
``safetensors.safe_open`` (memory-mapped: nothing else of the file is read), so no rank ever
holds the whole checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loom.model.materialise import ModuleInit, reset_buffers


class SafetensorsWeights:
    """The tensors of a directory's ``*.safetensors`` files, by name. ``aliases`` maps a name
    absent from the files to the name it shares values with (tied embeddings: a tied checkpoint
    stores ``model.embed_tokens.weight`` only)."""

    def __init__(self, files: list[Path], aliases: dict[str, str] | None = None) -> None:
        from safetensors import safe_open

        if not files:
            raise ValueError("no safetensors files given")
        self.files = [Path(f) for f in files]
        self.aliases = dict(aliases or {})
        self.where: dict[str, Path] = {}
        index = self.files[0].parent / "model.safetensors.index.json"
        if index.is_file():  # sharded checkpoints name each tensor's file
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: index.parent / v for k, v in weight_map.items()}
        else:
            for f in self.files:
                with safe_open(str(f), framework="pt") as h:
                    self.where.update({k: f for k in h.keys()})

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        key = name if name in self.where else self.aliases.get(name, name)
        if key not in self.where:
            raise KeyError(f"{self.files[0].parent}: no tensor {name!r} in its safetensors (it holds "
                           f"{len(self.where)} tensors, e.g. {sorted(self.where)[:3]}); save the model with "
                           "save_pretrained from the same architecture")
        with safe_open(str(self.where[key]), framework="pt") as h:
            return h.get_tensor(key)


@dataclass(frozen=True)
class PretrainedInit:
    """A layer's parameters and persistent buffers copied from ``source`` (named ``prefix.<name>``
    there); derived buffers recomputed by ``init_buffers``, as for a seeded layer."""

    source: SafetensorsWeights
    prefix: str
    init_buffers: ModuleInit = field(default=reset_buffers)

    def weights(self, module: nn.Module) -> None:
        persistent = module.state_dict(keep_vars=True)
        for name, tensor in persistent.items():
            value = self.source.tensor(f"{self.prefix}.{name}" if self.prefix else name)
            if value.shape != tensor.shape:
                raise ValueError(f"{self.prefix}.{name}: the checkpoint's tensor has shape {tuple(value.shape)}, "
                                 f"the model's {tuple(tensor.shape)}; the config and weights do not match")
            tensor.data.copy_(value)

    def buffers(self, module: nn.Module) -> None:
        self.init_buffers(module)
