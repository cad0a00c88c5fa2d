"""The layer-list adapter: every module as an ordered list of named layers.

A pipeline stage is a contiguous slice of a module's layer list, cut at any layer boundary
(docs/architecture.md principle 3: model code stays plain, parallelism is applied from outside). The
contract is deliberately small so that an unmodified Hugging Face model fits it through a thin
adapter (`loom.model.hf`) and the tiny zoo fits it natively (`loom.model.zoo`):

- ``layers()`` returns ``list[Layer]`` in execution order (embedding / front-end first,
  blocks, then norm / head / projector).
- ``context(inputs)`` turns the module's raw inputs (a dict) into a dict of auxiliary values
  that every layer may read: position ids, RoPE tables, attention masks, the raw input ids or
  pixels for the first layer. It holds no trainable state, so any stage of a pipeline can
  rebuild it from the microbatch it is working on; only the running activation ``x`` travels
  between stages.
- each ``Layer.forward(x, ctx)`` maps the running activation to the next one. The first layer
  receives ``x=None`` (it reads its input from ``ctx``) unless the owner injects one.

``Layer.name`` is the dotted path of ``Layer.module`` inside the adapted module, so that the
parameters of a stage keep the names they have in the full model (reference semantics compare
gradients by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from torch import nn

LayerForward = Callable[[Any, dict[str, Any]], Any]


@dataclass
class Layer:
    """One cut point of a module: ``forward(x, ctx) -> x``; ``module`` owns its parameters."""

    name: str
    module: nn.Module
    forward: LayerForward
    kind: str = "block"  # "embedding" | "frontend" | "block" | "norm" | "head" | "projector"

    def __call__(self, x: Any, ctx: dict[str, Any]) -> Any:
        return self.forward(x, ctx)


@runtime_checkable
class LayerAdapter(Protocol):
    """What loom needs of a module to cut it into pipeline stages."""

    def layers(self) -> list[Layer]: ...

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]: ...


def run_layers(layers: list[Layer], x: Any, ctx: dict[str, Any]) -> Any:
    """Run a contiguous slice of layers: the body of every pipeline stage."""
    for layer in layers:
        x = layer(x, ctx)
    return x


def prefixed(layers: list[Layer], prefix: str) -> list[Layer]:
    """The same layers named as seen from a parent module (``prefix.name``)."""
    return [Layer(f"{prefix}.{l.name}" if prefix else l.name, l.module, l.forward, l.kind) for l in layers]


def decoder_layers(
    body: nn.Module, lm_head: nn.Module, blocks: list[nn.Module], block_forward: Callable[[int, nn.Module], LayerForward]
) -> list[Layer]:
    """The layer list of a Llama-layout causal LM: ``model.embed_tokens`` (reads
    ``ctx["input_ids"]``), ``model.layers.i`` for each of ``blocks`` (run by ``block_forward(i, block)``),
    ``model.norm`` and ``lm_head``. Shared by the zoo Llama and the Hugging Face adapter, so
    both cut the same way and keep Hugging Face's parameter names."""
    layers = [Layer("model.embed_tokens", body.embed_tokens, lambda x, ctx: body.embed_tokens(ctx["input_ids"]),
                    kind="embedding")]
    layers += [Layer(f"model.layers.{i}", block, block_forward(i, block)) for i, block in enumerate(blocks)]
    layers.append(Layer("model.norm", body.norm, lambda x, ctx: body.norm(x), kind="norm"))
    layers.append(Layer("lm_head", lm_head, lambda x, ctx: lm_head(x), kind="head"))
    return layers
