"""Projectors between modules: an encoder's into the LLM's embedding space, the LLM's states
into a generator's width. LLaVA-1.5's two-layer MLP or a single linear map."""

from __future__ import annotations

from torch import nn


class MLPProjector(nn.Sequential):
    """LLaVA-1.5 style two-layer projector: Linear -> GELU -> Linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(nn.Linear(in_features, out_features), nn.GELU(), nn.Linear(out_features, out_features))
        self.in_features, self.out_features = in_features, out_features


def make_projector(kind: str, in_features: int, out_features: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(in_features, out_features)
    if kind == "mlp":
        return MLPProjector(in_features, out_features)
    raise ValueError(f"projector = {kind!r}: choose 'linear', 'mlp' or pass an nn.Module")
