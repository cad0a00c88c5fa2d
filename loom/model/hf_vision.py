"""Hugging Face vision encoders (SigLIP, CLIP) as loom encoders: `HFVisionEncoder` wraps an
unmodified ``SiglipVisionModel`` / ``CLIPVisionModel`` and gives it the layer contract
(`loom.model.layers`) and ``num_tokens``.

These encoders take square images of their config's ``image_size`` (learned position
embeddings, one per patch). The demo's images have any size (multiples of the patch), so
``context()`` resizes each image bilinearly to ``image_size`` and stacks them into one batch;
normalising pixels as the model's image processor does is left to a ``before_encoder`` callback.
Every image then gives the same token count: ``(image_size // patch_size) ** 2`` patches, plus
CLIP's class token. The output is the model's ``last_hidden_state`` (SigLIP: after
``post_layernorm``; CLIP: the encoder's output, ``post_layernorm`` being for the pooled class
token only) packed as ``[images x tokens, hidden]``; the pooling heads are not run.

Layers (``model.`` and the path inside the HF model; transformers 4.x adds ``vision_model.``):
``embeddings`` (front-end), CLIP's ``pre_layrnorm`` (norm), ``encoder.layers.<i>`` (block),
SigLIP's ``post_layernorm`` (norm). SigLIP's pooling ``head`` and CLIP's ``post_layernorm`` are
dropped (they make the pooled vector; the LLM gets the patch tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, run_layers

# config.model_type of the vision models (or of their vision_config) this module adapts
VISION_MODEL_TYPES = ("siglip_vision_model", "clip_vision_model")


def vision_model_from_config(config: Any) -> nn.Module:
    """The bare vision model of ``config`` (a vision config, or a SigLIP / CLIP config whose
    ``vision_config`` is taken), built where the caller's device context says."""
    import transformers

    config = getattr(config, "vision_config", None) or config
    classes = {"siglip_vision_model": transformers.SiglipVisionModel, "clip_vision_model": transformers.CLIPVisionModel}
    if config.model_type not in classes:
        raise ValueError(f"model_type {config.model_type!r} is not a vision encoder loom adapts; supported: "
                         f"SigLIP and CLIP vision models ({', '.join(VISION_MODEL_TYPES)})")
    return classes[config.model_type](config)


class HFVisionEncoder(nn.Module):
    """A SigLIP or CLIP vision model with loom's layer contract. Inputs of ``context``:
    ``{"images": list of [3, H, W] tensors}``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        if config.model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"{type(model).__name__} (model_type {config.model_type!r}) is not a SigLIP or CLIP "
                             "vision model")
        if getattr(model, "use_head", False):
            # SigLIP's attention-pooling head makes one vector per image; loom feeds the LLM the
            # patch tokens, so the head would be dead weight on every stage: dropped
            model.head, model.use_head = None, False
        vm = getattr(model, "vision_model", model)
        if config.model_type == "clip_vision_model" and isinstance(getattr(vm, "post_layernorm", None), nn.LayerNorm):
            # CLIP's post_layernorm normalises the pooled class token only, which loom never
            # runs: dropped like SigLIP's head, so no parameter sits outside the layers
            vm.post_layernorm = nn.Identity()
        self.model = model
        self.config = config
        self.hidden_size: int = config.hidden_size
        self.image_size: int = config.image_size
        self.is_clip = config.model_type == "clip_vision_model"
        self.tokens_per_image = (config.image_size // config.patch_size) ** 2 + (1 if self.is_clip else 0)

    def num_tokens(self, item: Any) -> int:
        """Every image is resized to ``image_size``: a fixed count, whatever its metadata."""
        return self.tokens_per_image

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        images = inputs.get("images") or []
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        size = (self.image_size, self.image_size)
        if images:
            pixels = torch.cat([F.interpolate(img[None].to(device=device, dtype=dtype), size=size, mode="bilinear",
                                              align_corners=False) for img in images])
        else:  # a microbatch without images still runs the encoder (an empty output with a grad_fn)
            pixels = torch.zeros((0, self.config.num_channels, *size), dtype=dtype, device=device)
        return {"pixel_values": pixels}

    def layers(self) -> list[Layer]:
        # transformers 5 holds the parts on the model itself; 4.x under ``vision_model``
        vm = getattr(self.model, "vision_model", self.model)
        at = "model.vision_model." if vm is not self.model else "model."

        def embed(x: Any, ctx: dict[str, Any]) -> torch.Tensor:
            return vm.embeddings(ctx["pixel_values"])

        def block(layer: nn.Module):
            def run(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
                if x.shape[0] == 0:  # no images: HF attention cannot reshape an empty batch; nothing to attend
                    return x.clone()
                out = layer(x, None)
                return out[0] if isinstance(out, tuple) else out
            return run

        def flatten(norm: nn.Module | None):
            def run(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
                return (norm(x) if norm is not None else x).flatten(0, 1)  # packed [images x tokens, hidden]
            return run

        out = [Layer(f"{at}embeddings", vm.embeddings, embed, kind="frontend")]
        if self.is_clip:
            out.append(Layer(f"{at}pre_layrnorm", vm.pre_layrnorm,
                             lambda x, ctx: vm.pre_layrnorm(x), kind="norm"))
        blocks = [Layer(f"{at}encoder.layers.{i}", layer, block(layer))
                  for i, layer in enumerate(vm.encoder.layers)]
        last = blocks[-1]  # the packed output leaves the last layer
        if self.is_clip:
            blocks[-1] = Layer(last.name, last.module, lambda x, ctx, f=last.forward: f(x, ctx).flatten(0, 1))
        out += blocks
        if not self.is_clip:
            out.append(Layer(f"{at}post_layernorm", vm.post_layernorm, flatten(vm.post_layernorm),
                             kind="norm"))
        return out

    def init_layer_weights(self, module: nn.Module) -> None:
        """The model's own ``_init_weights``, children first (`loom.model.materialise`)."""
        for sub in reversed(list(module.modules())):
            self.model._init_weights(sub)

    @staticmethod
    def init_layer_buffers(module: nn.Module) -> None:
        """The embeddings' ``position_ids`` (non-persistent: neither ``to_empty`` nor a
        checkpoint fills it)."""
        for sub in module.modules():
            ids = getattr(sub, "position_ids", None)
            if isinstance(ids, torch.Tensor):
                ids.copy_(torch.arange(ids.shape[-1]).expand_as(ids))

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))
