"""Giving layers memory one at a time: a model is built on the meta device, and each rank
materialises only the layers of its own stage (docs/architecture.md, "Runtime"; torchtitan
builds on ``meta`` then runs ``to_empty`` and ``init_weights`` the same way).

`materialise` is the one per-layer step, and its `LayerInit` says where the values come from:
`SeededInit` initialises a layer from a seed derived from (run seed, module, layer index), so a
layer's values do not depend on which rank builds it, in which order, or whether the
single-process reference builds every layer; a loader of pretrained weights is another
`LayerInit` whose ``weights`` copies a checkpoint's tensors instead.

Derived buffers (rotary tables, mel filterbanks) are recomputed by ``buffers`` whatever fills
the weights, since ``to_empty`` leaves them uninitialised and checkpoints do not hold them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from loom.model.layers import Layer

ModuleInit = Callable[[nn.Module], None]


class LayerInit(Protocol):
    """Where a freshly allocated layer's values come from."""

    def weights(self, module: nn.Module) -> None:
        """Fill the parameters (and persistent buffers) of ``module`` in place."""

    def buffers(self, module: nn.Module) -> None:
        """Recompute the derived (non-persistent) buffers of ``module`` in place."""


def layer_seed(seed: int, module: str, index: int) -> int:
    """A 63-bit seed for layer ``index`` of module ``module`` in a run seeded ``seed``; stable
    across processes (Python's ``hash`` of a string is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{module}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def reset_parameters(module: nn.Module) -> None:
    """PyTorch's own initialisation: ``reset_parameters()`` of every submodule holding
    parameters (the default for layers whose adapter defines no ``init_layer_weights``)."""
    for sub in module.modules():
        if next(sub.parameters(recurse=False), None) is None:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if reset is None:
            raise TypeError(
                f"{type(sub).__name__} holds parameters but has no reset_parameters(): give it one, or give "
                "its model's layer adapter an init_layer_weights(module) method"
            )
        reset()


def reset_buffers(module: nn.Module) -> None:
    """Recompute derived buffers: ``reset_buffers()`` of every submodule that defines it (the
    default for layers whose adapter defines no ``init_layer_buffers``)."""
    for sub in module.modules():
        reset = getattr(sub, "reset_buffers", None)
        if reset is not None:
            reset()


@dataclass(frozen=True)
class SeededInit:
    """The owner's initialisation of one layer, run under the CPU generator seeded with
    `layer_seed` (run seed, module, layer index)."""

    seed: int
    module: str
    index: int
    init_weights: ModuleInit = reset_parameters
    init_buffers: ModuleInit = reset_buffers

    def weights(self, module: nn.Module) -> None:
        # fork_rng: a layer's init neither reads nor advances the caller's random stream
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(layer_seed(self.seed, self.module, self.index))
            self.init_weights(module)

    def buffers(self, module: nn.Module) -> None:
        self.init_buffers(module)


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lacks storage (built on, or moved to, meta)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialise_module(module: nn.Module, device: torch.device | str, init: LayerInit) -> None:
    """Allocate ``module`` and fill it from ``init``, then move it to ``device``.

    The values are computed on the CPU: the CPU generator gives the same numbers for a layer
    whatever device the rank trains on, so a CUDA run starts from the weights of the CPU
    reference. Only one layer is staged at a time. ``requires_grad`` (frozen flags) survives
    ``to_empty``.
    """
    module.to_empty(device=torch.device("cpu"))
    with torch.no_grad():
        init.weights(module)
        init.buffers(module)
    module.to(device)


def materialise(layer: Layer, device: torch.device | str, init: LayerInit) -> None:
    """The per-layer seam: give ``layer`` memory on ``device`` and its values from ``init``
    (seeded initialisation today, pretrained weights later)."""
    materialise_module(layer.module, device, init)


@dataclass(frozen=True)
class Tie:
    """One parameter shared by two layers of a module (tied input and output embeddings):
    ``first`` / ``second`` are (layer index, parameter name inside the layer's module). A tie
    stays one tensor where a process holds both layers; where they sit on different pipeline
    stages each stage holds a copy, initialised equal, whose gradients the runtime sums
    (`loom.runtime.tied`), as Megatron-LM's embedding group does."""

    module: str
    first: tuple[int, str]
    second: tuple[int, str]


def find_ties(module: str, layers: list[Layer]) -> list[Tie]:
    """The parameters shared between layers of one module, each as a `Tie` (first holder first)."""
    seen: dict[int, tuple[int, str]] = {}
    ties = []
    for index, layer in enumerate(layers):
        for name, p in layer.module.named_parameters(remove_duplicate=False):
            if id(p) in seen and seen[id(p)][0] != index:
                ties.append(Tie(module, seen[id(p)], (index, name)))
            seen.setdefault(id(p), (index, name))
    return ties


def check_untied(layers: dict[str, list[Layer]], ties: list[Tie] = ()) -> None:
    """Refuse parameters shared between layers (tied weights) other than the declared ``ties``
    (which `MultimodalModel.materialise` keeps equal): layers are materialised, and placed on
    pipeline stages, one at a time, which would silently untie them."""
    allowed = {(t.module, t.second) for t in ties}
    owner: dict[int, str] = {}
    for module, module_layers in layers.items():
        for index, layer in enumerate(module_layers):
            for name, p in layer.module.named_parameters():
                here = f"{module}: {layer.name}.{name}"
                if id(p) in owner and (module, (index, name)) not in allowed:
                    raise ValueError(
                        f"parameter {here} is the same tensor as {owner[id(p)]} (tied weights); layers are "
                        "materialised and placed on stages one at a time: untie them (e.g. "
                        "tie_word_embeddings=False) and copy the shared values into both"
                    )
                owner.setdefault(id(p), here)
