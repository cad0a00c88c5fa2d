"""A tiny ViT-style vision encoder that takes images of any resolution.

Multimodal data is heterogeneous (docs/architecture.md): every image keeps its own size, so its patch
count, and hence the encoder's work, follows from its metadata alone (``num_tokens``). The
images of one call are packed into a single sequence with a block-diagonal attention mask, so
an image's tokens never see another image's and the result does not depend on what else was
packed with it. Positions are 2D sinusoidal embeddings of each patch's (row, column), which
exist for any grid size.

The module is plain PyTorch and implements the layer-list contract of ``loom.model.layers``
itself: ``patch_embed`` (front-end), ``blocks.0`` .. ``blocks.{n-1}``, ``norm``.

The transformer block and the sinusoidal embedding defined here are shared with the audio
encoder (``loom.model.zoo.audio``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, run_layers
from loom.model.zoo.attention import AttentionCore

if TYPE_CHECKING:  # loom.model sits above loom.data (docs/architecture.md): metadata types only
    from loom.data.sample import ImageMeta


@dataclass
class VisionConfig:
    """Shape of a ``VisionEncoder``; images must have sides that are multiples of ``patch_size``."""

    patch_size: int = 8
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    in_channels: int = 3
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"VisionConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        # Half of the channels encode the row, half the column, each as sin/cos pairs.
        if self.hidden_size % 4 != 0:
            raise ValueError(
                f"VisionConfig: hidden_size={self.hidden_size} must be a multiple of 4 for 2D sinusoidal positions"
            )


def sinusoidal_embedding(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[N] -> [N, dim]`` fixed sin/cos embedding of (possibly fractional) positions, in fp32.

    ``dim`` must be even: the first half holds the sines, the second half the cosines.
    """
    half = dim // 2
    inv_freq = torch.exp(
        -math.log(base) * torch.arange(half, dtype=torch.float32, device=positions.device) / half
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """``[C, H, W] -> [(H/p)*(W/p), C*p*p]``, patches in row-major order."""
    c, h, w = image.shape
    return image.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x)), over a packed sequence.

    The input is ``[N, hidden]`` (all items of a call packed); ``lengths`` are the items'
    token counts, which keep them apart (`segment_attention`).
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, norm_eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attn_norm = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=norm_eps)
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, hidden_size)
        self.core = AttentionCore()  # no parameters; a seam for selective recompute

    def attention(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        # [N, 3*hidden] -> 3 x [heads, N, head_dim]
        qkv = self.qkv(x)
        # under tensor parallelism a rank holds only its share of the heads (from the width, not
        # -1: an empty call has no elements to infer it from)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(n, 3, heads, self.head_dim).permute(1, 2, 0, 3)
        out = self.core(q, k, v, lengths, False)
        return self.proj(out.transpose(0, 1).reshape(n, heads * self.head_dim))

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), lengths)
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


def run_encoder_block(block: EncoderBlock, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """Layer forward of an encoder block: the items' lengths come from the context."""
    # Call the module (not .forward) so that hooks applied from outside (FSDP, ...) fire.
    return block(x, ctx["lengths"])


def run_norm(norm: nn.Module, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """A layer that needs nothing from the context (final norms)."""
    return norm(x)


class PatchEmbed(nn.Module):
    """Cuts each image into ``p x p`` patches, projects them linearly and adds 2D positions."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_channels = in_channels
        # A Linear over flattened patches is a stride-p Conv2d, without a per-image call.
        self.proj = nn.Linear(in_channels * patch_size * patch_size, hidden_size)

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        return patchify(image, self.patch_size)

    def forward(self, images: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if images:
            patches = torch.cat([self.patchify(img) for img in images], dim=0)
        else:
            # Still goes through the projection, so an empty call has a grad_fn like any other.
            patches = weight.new_zeros(0, weight.shape[1])
        x = self.proj(patches.to(weight.dtype))
        return x + positions.to(x.dtype)


class VisionEncoder(nn.Module):
    """ViT-style encoder of variable-resolution images, packed into one sequence.

    Inputs ``{"images": list[Tensor[C, H, W]]}``; output ``[N_total, hidden_size]``: the
    tokens of image 0, then those of image 1, ... (``num_tokens`` of each image).
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.patch_embed = PatchEmbed(config.patch_size, config.in_channels, config.hidden_size)
        self.blocks = nn.ModuleList(
            EncoderBlock(config.hidden_size, config.num_heads, config.mlp_ratio, config.norm_eps)
            for _ in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def num_tokens(self, meta: ImageMeta) -> int:
        """Patch count of an image, from its metadata alone."""
        p = self.config.patch_size
        if meta.height % p or meta.width % p:
            raise ValueError(
                f"image of {meta.height}x{meta.width} pixels: height and width must be multiples of "
                f"the patch size {p}; resize or crop the image"
            )
        return (meta.height // p) * (meta.width // p)

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Validated images, their 2D patch positions and per-image patch counts (the
        attention segments)."""
        images: list[torch.Tensor] = list(inputs["images"])
        p = self.config.patch_size
        grids: list[tuple[int, int]] = []
        for i, img in enumerate(images):
            if img.dim() != 3 or img.shape[0] != self.config.in_channels:
                raise ValueError(
                    f"images[{i}] has shape {tuple(img.shape)}; expected [{self.config.in_channels}, H, W]"
                )
            h, w = img.shape[1], img.shape[2]
            if h % p or w % p:
                raise ValueError(
                    f"images[{i}] has shape {tuple(img.shape)}: height and width must be multiples of "
                    f"the patch size {p}; resize or crop the image"
                )
            grids.append((h // p, w // p))
        # With no items there is no tensor to take the device from, and on a later pipeline
        # stage this module's own weights may be released (meta): the caller may say where.
        device = images[0].device if images else inputs.get("device", self.patch_embed.proj.weight.device)

        # (row, col) of every patch, image after image, row-major within an image.
        rows, cols = [], []
        for gh, gw in grids:
            r, c = torch.meshgrid(
                torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij"
            )
            rows.append(r.reshape(-1))
            cols.append(c.reshape(-1))
        empty = torch.zeros(0, dtype=torch.long, device=device)
        rows_t = torch.cat(rows) if rows else empty
        cols_t = torch.cat(cols) if cols else empty
        half = self.hidden_size // 2
        positions = torch.cat([sinusoidal_embedding(rows_t, half), sinusoidal_embedding(cols_t, half)], dim=-1)

        lengths = [gh * gw for gh, gw in grids]
        return {
            "images": images,
            "positions": positions,
            "lengths": lengths,
        }

    def layers(self) -> list[Layer]:
        result = [
            Layer(
                "patch_embed",
                self.patch_embed,
                lambda x, ctx: self.patch_embed(ctx["images"], ctx["positions"]),
                kind="frontend",
            )
        ]
        for i, block in enumerate(self.blocks):
            result.append(Layer(f"blocks.{i}", block, partial(run_encoder_block, block), kind="block"))
        result.append(Layer("norm", self.norm, partial(run_norm, self.norm), kind="norm"))
        return result

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))
