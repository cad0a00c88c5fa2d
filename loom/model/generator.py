"""`ModalityGenerator`: an output projector and a modality generator after the LLM (DistTrain's
encoder -> input projector -> LLM -> output projector -> generator, disttrain.md §1).

The LLM's final hidden states at a sample's generation positions (its ``<gen_...>`` tokens, one
group of ``cond_tokens`` per item to generate) go through the output projector into the
generator's width and condition it; the generator returns its summed loss over the items (a
denoising loss for a diffusion generator, `loom.model.zoo.diffusion`). `MultimodalModel`
weighs it (``loss_weight``) and divides it by the global batch's item count, as it divides the
language-model loss by the global target count, so moving samples between ranks or
microbatches never changes the math.

As a module of the graph its layers are the projector, then the generator's own
(``generator.<name>``); freezing is per part: ``"<name>"``, ``"<name>.generator"``,
``"<name>.projector"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.model.adapter import adapter_for
from loom.model.layers import Layer, prefixed, run_layers
from loom.model.projector import make_projector, projector_kind, width_of


class ModalityGenerator(nn.Module):
    """A generator, the output projector from the LLM's width into it, and the weight of its loss.

    ``projector`` may be ``"linear"`` / ``"mlp"`` (built by `MultimodalModel` once the LLM's
    width is known) or a ready module. The generator must have a layer adapter whose first
    layer takes the projected conditioning tokens ``[N_cond, hidden]`` and whose last returns
    the summed loss of its items, a ``hidden_size``, a ``cond_tokens`` count (LLM states per
    item), a ``target_shape`` and ``check_target(shape, where)``.
    """

    def __init__(self, generator: nn.Module, projector: str | nn.Module = "linear", loss_weight: float = 1.0):
        super().__init__()
        if not loss_weight >= 0:
            raise ValueError(f"loss_weight = {loss_weight}: give a non-negative weight for the generator's loss")
        self.generator = generator
        self.loss_weight = float(loss_weight)
        self._projector_kind = projector_kind(projector)
        if self._projector_kind is None:
            self.projector = projector

    def build_projector(self, in_features: int) -> None:
        """Create the projector lazily, once the LLM's width is known."""
        if self._projector_kind is not None:
            self.projector = make_projector(self._projector_kind, in_features, width_of(self.generator))
            self._projector_kind = None

    @property
    def cond_tokens(self) -> int:
        """LLM states (generation tokens) per item to generate."""
        return int(self.generator.cond_tokens)

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The shape of one item the generator makes (``[C, H, W]`` for an image)."""
        return tuple(self.generator.target_shape)

    def check_target(self, shape: tuple[int, ...], where: str) -> None:
        self.generator.check_target(shape, where)

    def layers(self) -> list[Layer]:
        if self._projector_kind is not None:
            raise RuntimeError("projector not built yet: wrap the generator in a MultimodalModel first")
        project = Layer("projector", self.projector, lambda x, ctx: self.projector(x), kind="projector")
        return [project] + prefixed(adapter_for(self.generator).layers(), "generator")

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The generator's context, with ``items``: how many items it generates."""
        ctx = adapter_for(self.generator).context(inputs)
        ctx["items"] = len(inputs["targets"])
        return ctx

    def forward(self, states: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The summed loss of the items conditioned on the LLM ``states`` ``[N_cond, llm width]``."""
        return run_layers(self.layers(), states, self.context(inputs))
