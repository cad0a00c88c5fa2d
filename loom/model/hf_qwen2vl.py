"""The Qwen2-VL vision tower as a loom encoder: `Qwen2VLVisionEncoder` wraps an unmodified
``Qwen2VisionTransformerPretrainedModel`` (Qwen2-VL, Wang et al. 2024, §2.1 "Naive Dynamic
Resolution": any image size, 2D rotary position embeddings over the patch grid, and an MLP
that merges each 2x2 block of adjacent patches into one token) and gives it the layer contract
(`loom.model.layers`) and ``num_tokens``.

Inputs of ``context``: either what the Hugging Face image processor makes (``pixel_values``
``[patches, C * T * p * p]`` and ``image_grid_thw`` ``[images, 3]``, `loom.data.hf_processor`),
or ``images``, a list of float ``[3, H, W]`` tensors whose sides are multiples of
``patch_size * spatial_merge_size``: those are cut into patches here exactly as the processor
cuts its resized, normalised images (the same element order; each image repeated over the
``temporal_patch_size`` frames of a still image), with no resizing and no normalisation.

Token count: an image of ``H x W`` pixels (after the processor's ``smart_resize``) has a grid
of ``(H / p) x (W / p)`` patches, attended per image, and gives ``(H / p / m) * (W / p / m)``
tokens after the merger (``m = spatial_merge_size``): the model's ``pooler_output``, which is
what Qwen2-VL feeds its LLM. Images are packed, as the model packs them: the running activation
is ``[all patches, embed_dim]`` and every block attends within each image (``cu_seqlens``).

Layers (``model.`` and the path inside the HF model): ``patch_embed`` (front-end),
``blocks.<i>`` (block), ``merger`` (head: layer norm, 2x2 merge, MLP to ``hidden_size``). The
rotary table (``rotary_pos_emb``, no parameters) is read by ``context``, so every stage holds it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.model.layers import Layer, run_layers

MODEL_TYPES = ("qwen2_vl_vision", "qwen2_vl")  # the vision config, or a full Qwen2-VL config's vision_config


def qwen2vl_vision_config(config: Any) -> Any:
    """The vision config of ``config`` (a Qwen2-VL config's ``vision_config``, or itself)."""
    vision = getattr(config, "vision_config", None) or config
    if getattr(vision, "model_type", None) != "qwen2_vl_vision":
        raise ValueError(f"model_type {getattr(config, 'model_type', None)!r} is not a Qwen2-VL vision config "
                         f"(model_type 'qwen2_vl_vision', or 'qwen2_vl' with a vision_config)")
    return vision


def qwen2vl_encoder_from_config(config: Any) -> "Qwen2VLVisionEncoder":
    """The loom encoder of a Qwen2-VL (vision) config, random init, built where the caller's device
    context says (``torch.device("meta")`` for a rank that materialises only its stage)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VLVisionEncoder(Qwen2VisionTransformerPretrainedModel(qwen2vl_vision_config(config)))


def patchify(image: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """``[3, H, W]`` -> ``[(H/p) * (W/p), 3 * T * p * p]``: the Qwen2-VL image processor's patch
    layout (merge blocks in row-major order, the ``m x m`` patches of a block together, each
    patch ``(C, T, p, p)`` with the still image repeated over ``T``)."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal, patch, patch)
    return x.reshape(gh * gw, c * temporal * patch * patch)


class Qwen2VLVisionEncoder(nn.Module):
    """A ``Qwen2VisionTransformerPretrainedModel`` with loom's layer contract; its output is the
    merger's ``[tokens of all images, hidden_size]`` (the model's ``pooler_output``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        if getattr(config, "model_type", None) != "qwen2_vl_vision":
            raise ValueError(f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) is not "
                             "the Qwen2-VL vision tower (Qwen2VisionTransformerPretrainedModel)")
        # what forward does that the layers below reproduce, and nothing else: refuse the rest
        refused = [what for what, bad in (
            ("a rotary type other than 'axial'", (config.rope_parameters or {}).get("rope_type", "axial") != "axial"),
            ("a list-valued patch_size or temporal_patch_size",
             not isinstance(config.patch_size, int) or not isinstance(config.temporal_patch_size, int)),
            ("gradient checkpointing", getattr(model, "gradient_checkpointing", False)),
        ) if bad]
        if refused:
            raise ValueError(f"the Qwen2-VL vision adapter does not reproduce {', '.join(refused)}; use a config "
                             "without it")
        self.model = model
        self.config = config
        self.hidden_size: int = config.hidden_size  # the merger's output width (the LLM's in Qwen2-VL)
        self.patch: int = config.patch_size
        self.merge: int = config.spatial_merge_size
        self.temporal: int = config.temporal_patch_size
        self.factor = self.patch * self.merge  # image sides must be multiples of it

    def num_tokens(self, item: Any) -> int:
        """Tokens of an ``ImageMeta`` of ``height x width`` pixels (multiples of ``patch_size *
        spatial_merge_size``; a processor resizes other sizes first, `loom.data.hf_processor`)."""
        h, w = int(item.height), int(item.width)
        if h % self.factor or w % self.factor or h < 1 or w < 1:
            raise ValueError(f"an image of {h}x{w} pixels: the Qwen2-VL vision tower takes sides that are multiples "
                             f"of patch_size * spatial_merge_size = {self.factor}; resize the images (a Qwen2-VL image "
                             "processor as data.processors.<encoder> does: smart_resize)")
        return (h // self.factor) * (w // self.factor)

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``pixel_values`` and ``image_grid_thw`` (from ``images`` when given raw), the rotary
        tables over each image's patch grid and the packed sequences' boundaries, as
        ``Qwen2VisionTransformerPretrainedModel.forward`` computes them."""
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        vm = self.model
        # the rotary table is on every stage (a context module); the patch embedding may be elsewhere
        device = vm.rotary_pos_emb.inv_freq.device
        if "pixel_values" in inputs:
            pixels, grid = inputs["pixel_values"], torch.as_tensor(inputs["image_grid_thw"]).reshape(-1, 3)
        else:
            images = inputs.get("images") or []
            for img in images:
                self.num_tokens(_Size(img.shape[-2], img.shape[-1]))  # refuses sides it cannot cut, naming them
            pixels = (torch.cat([patchify(img, self.patch, self.merge, self.temporal) for img in images]) if images
                      else torch.zeros(0, 3 * self.temporal * self.patch * self.patch))
            grid = torch.tensor([[1, img.shape[-2] // self.patch, img.shape[-1] // self.patch] for img in images],
                                dtype=torch.long).reshape(-1, 3)
        pixels, grid = pixels.to(device), grid.to(device)
        position_ids = (get_vision_position_ids(grid, self.merge) if len(grid)
                        else torch.zeros(0, 2, dtype=torch.long, device=device))  # no images
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, self.config)
        cos, sin = vm.rotary_pos_emb(pixels, position_ids)
        return {"pixel_values": pixels, "image_grid_thw": grid, "cu_seqlens": cu_seqlens,
                "max_seqlen": max_seqlen, "position_embeddings": (cos, sin)}

    def layers(self) -> list[Layer]:
        vm = self.model

        def embed(x: Any, ctx: dict[str, Any]) -> torch.Tensor:
            pixels = ctx["pixel_values"]
            if pixels.shape[0] == 0:  # no images: PatchEmbed's view(-1, ...) cannot size an empty batch
                pe = vm.patch_embed
                empty = pixels.reshape(0, pe.in_channels, pe.temporal_patch_size, pe.patch_size, pe.patch_size)
                return pe.proj(empty.to(pe.proj.weight.dtype)).reshape(0, pe.embed_dim)
            return vm.patch_embed(pixels)

        def block(layer: nn.Module):
            def run(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
                if x.shape[0] == 0:  # nothing to attend
                    return x.clone()
                return layer(x, cu_seqlens=ctx["cu_seqlens"], max_seqlen=ctx["max_seqlen"],
                             position_embeddings=ctx["position_embeddings"])
            return run

        def merge(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
            if x.shape[0] == 0:
                return vm.merger.mlp(vm.merger.ln_q(x).reshape(0, vm.merger.hidden_size))
            return vm.merger(x)

        return ([Layer("model.patch_embed", vm.patch_embed, embed, kind="frontend")]
                + [Layer(f"model.blocks.{i}", blk, block(blk)) for i, blk in enumerate(vm.blocks)]
                + [Layer("model.merger", vm.merger, merge, kind="head")])

    def init_layer_weights(self, module: nn.Module) -> None:
        """The model's own ``_init_weights``, children first (`loom.model.materialise`)."""
        for sub in reversed(list(module.modules())):
            self.model._init_weights(sub)

    def init_layer_buffers(self, module: nn.Module) -> None:
        """The rotary table's ``inv_freq`` (non-persistent), recomputed from the config."""
        for sub in module.modules():
            if "RotaryEmbedding" in type(sub).__name__:
                inv_freq, _ = sub.compute_axial_rope_parameters(self.config)
                sub.inv_freq.copy_(inv_freq)
                sub.original_inv_freq.copy_(inv_freq)

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))


class _Size:
    """An image's sides, as `num_tokens` reads an ``ImageMeta``."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = int(height), int(width)
