"""Finding a module's layer adapter: the zoo implements the protocol itself, Hugging Face models
get one from `loom.model.hf` (kept apart from `loom.model.layers` so neither imports the other)."""

from __future__ import annotations

from torch import nn

from loom.model.layers import LayerAdapter


def adapter_for(module: nn.Module) -> LayerAdapter:
    """The layer adapter of ``module``: the module itself when it implements the protocol
    (the zoo), else a registered adapter for its class (Hugging Face models)."""
    if isinstance(module, LayerAdapter):
        return module
    from loom.model import hf  # transformers is optional: hf imports it only when used

    adapter = hf.adapter_for(module)
    if adapter is None:
        raise TypeError(
            f"{type(module).__name__} has no layer adapter: implement layers()/context() on it "
            "(see loom.model.layers) or register one in loom.model.hf"
        )
    return adapter
