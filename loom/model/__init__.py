"""The model tree: `MultimodalModel`, `ModalityEncoder`, the layer-list adapter and the zoo."""

from loom.model.layers import Layer, LayerAdapter, adapter_for, run_layers
from loom.model.multimodal import ModalityEncoder, MultimodalModel, loss_sum

__all__ = ["Layer", "LayerAdapter", "ModalityEncoder", "MultimodalModel", "adapter_for", "loss_sum", "run_layers"]
