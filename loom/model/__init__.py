"""The model tree: `MultimodalModel`, `ModalityEncoder`, the layer-list adapter and the zoo."""

from loom.model.adapter import adapter_for
from loom.model.layers import Layer, LayerAdapter, run_layers
from loom.model.multimodal import ModalityEncoder, MultimodalModel, loss_sum

__all__ = ["Layer", "LayerAdapter", "ModalityEncoder", "MultimodalModel", "adapter_for", "loss_sum", "run_layers"]
