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


def projector_kind(projector: str | nn.Module) -> str | None:
    """The kind of a projector still to build (``"linear"`` / ``"mlp"``), or None for a ready
    module; any other value is refused."""
    if isinstance(projector, nn.Module):
        return None
    if projector not in ("linear", "mlp"):
        raise ValueError(f"projector = {projector!r}: choose 'linear', 'mlp' or pass an nn.Module")
    return projector


def width_of(module: nn.Module) -> int:
    """The ``hidden_size`` a lazily built projector needs from the module on its other side."""
    width = getattr(module, "hidden_size", None)
    if width is None:
        raise ValueError(f"{type(module).__name__} has no hidden_size: pass a projector module instead")
    return width
