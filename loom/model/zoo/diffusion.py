"""A tiny diffusion generator (DiT-style) conditioned on LLM states, for MLLMs that also produce
images (DistTrain's encoder -> LLM -> generator, disttrain.md §1; its evaluation trains Stable
Diffusion 2.1, this is the zoo's stand-in at test scale).

Training is DDPM's (Ho et al. 2020): an image ``x0`` in [-1, 1] is noised to
``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps`` at a timestep ``t`` under a fixed linear beta
schedule (``a_t`` the cumulative product of ``1 - beta``), and the model predicts ``eps``. Each
item draws ``t`` and ``eps`` from its own seed (``seeds``, which the data sets from the sample
and the step), on the CPU, so a distributed run draws what the single process draws.

The model is plain PyTorch and implements the layer-list contract of ``loom.model.layers``:

- ``noise_embed`` (front-end): receives the conditioning tokens (the projected LLM states, one
  group of ``cond_tokens`` per item), noises the targets, cuts them into patches, embeds them
  with 2D positions and the timestep's embedding, and returns the image tokens and the
  conditioning tokens packed in one tensor ``[N_img + N_cond, hidden]``;
- ``blocks.i``: self-attention among an item's image tokens, cross-attention from them to the
  item's conditioning tokens, an MLP (pre-norm, residual); the conditioning rows pass through;
- ``final``: norm and a linear map to each patch's predicted noise, and the loss: per item the
  mean squared error over its pixels, summed over the items (a 0-dim tensor). The caller
  divides by the global batch's item count, so moving items between ranks never changes it.

The noise schedule is written here rather than taken from ``diffusers``: it is the two lines
above, and ``diffusers`` would add a large dependency for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, run_layers
from loom.model.zoo.attention import AttentionCore
from loom.model.zoo.vision import patchify, sinusoidal_embedding


@dataclass
class DiffusionConfig:
    """Shape of a ``DiffusionGenerator``: it generates square ``image_size`` images of
    ``in_channels`` channels, conditioned on ``cond_tokens`` LLM states per image."""

    image_size: int = 16
    in_channels: int = 3
    patch_size: int = 4
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    cond_tokens: int = 4
    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "patch_size", "hidden_size", "num_layers", "num_heads",
                     "cond_tokens", "num_train_timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"DiffusionConfig.{name} = {getattr(self, name)}: must be at least 1")
        if self.image_size % self.patch_size:
            raise ValueError(f"DiffusionConfig: image_size = {self.image_size} is not a multiple of patch_size = "
                             f"{self.patch_size}")
        if self.hidden_size % self.num_heads or self.hidden_size % 4:
            raise ValueError(f"DiffusionConfig: hidden_size = {self.hidden_size} must be a multiple of num_heads = "
                             f"{self.num_heads} and of 4 (2D sinusoidal positions)")
        if not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"DiffusionConfig: need 0 < beta_start ({self.beta_start}) < beta_end ({self.beta_end}) "
                             "< 1")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def noise_schedule(config: DiffusionConfig) -> torch.Tensor:
    """``a_t`` for every timestep: the cumulative product of ``1 - beta_t`` over DDPM's linear
    betas, in float64."""
    betas = torch.linspace(config.beta_start, config.beta_end, config.num_train_timesteps, dtype=torch.float64,
                           device="cpu")
    return torch.cumprod(1.0 - betas, dim=0)


def draw_noise(seed: int, config: DiffusionConfig) -> tuple[int, torch.Tensor]:
    """The timestep and the noise ``[C, H, W]`` an item with ``seed`` trains on (CPU, so every
    device and process draws the same)."""
    g = torch.Generator().manual_seed(seed)
    t = int(torch.randint(0, config.num_train_timesteps, (1,), generator=g))
    eps = torch.randn(config.in_channels, config.image_size, config.image_size, generator=g)
    return t, eps


class NoiseEmbed(nn.Module):
    """Patches of the noised image, projected, plus 2D positions and the timestep's embedding."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        self.proj = nn.Linear(config.in_channels * p * p, config.hidden_size)
        self.time_mlp = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.SiLU(),
                                      nn.Linear(config.hidden_size, config.hidden_size))

    def forward(self, cond: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        weight = self.proj.weight
        patches = ctx["noised_patches"].to(weight.dtype)
        x = self.proj(patches) + ctx["positions"].to(weight.dtype)
        time = self.time_mlp(sinusoidal_embedding(ctx["timesteps"], self.config.hidden_size).to(weight.dtype))
        x = x + time.repeat_interleave(self.config.patches, dim=0)
        return torch.cat([x, cond.to(x.dtype)], dim=0)


class GeneratorBlock(nn.Module):
    """Pre-norm block over the packed ``[image tokens; conditioning tokens]``: an item's image
    tokens attend to each other, then to its conditioning tokens, then an MLP."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.cross_norm = nn.LayerNorm(hidden, eps=eps)
        self.cross_q = nn.Linear(hidden, hidden)
        self.cross_kv = nn.Linear(hidden, 2 * hidden)
        self.cross_proj = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, int(hidden * mlp_ratio))
        self.fc2 = nn.Linear(int(hidden * mlp_ratio), hidden)
        self.core = AttentionCore()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], self.heads, self.head_dim).transpose(0, 1)  # [heads, N, d]

    def forward(self, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        n_img = ctx["image_tokens"]
        img, cond = x[:n_img], x[n_img:]
        q, k, v = self.qkv(self.attn_norm(img)).chunk(3, dim=-1)
        out = self.core(self._heads(q), self._heads(k), self._heads(v), ctx["image_lengths"], False)
        img = img + self.proj(out.transpose(0, 1).reshape(n_img, self.heads * self.head_dim))
        q = self._heads(self.cross_q(self.cross_norm(img)))
        k, v = (self._heads(t) for t in self.cross_kv(cond).chunk(2, dim=-1))
        if n_img:
            cross = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["cross_mask"])
        else:  # no items: keep the (empty) result in the graph for zero gradients
            cross = q * 0 + (k.sum() + v.sum()) * 0
        img = img + self.cross_proj(cross.transpose(0, 1).reshape(n_img, self.heads * self.head_dim))
        img = img + self.fc2(F.gelu(self.fc1(self.mlp_norm(img))))
        return torch.cat([img, cond], dim=0)


class DiffusionHead(nn.Module):
    """Norm and a linear map from an image token to its patch's predicted noise."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.out = nn.Linear(config.hidden_size, config.in_channels * p * p)

    def forward(self, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        """The summed per-item mean squared error (module docstring)."""
        n_img = ctx["image_tokens"]
        pred = self.out(self.norm(x[:n_img]))
        if not n_img:  # no items: a zero that keeps every parameter in the graph (zero gradients)
            return pred.sum() * 0
        err = (pred.float() - ctx["noise_patches"]).pow(2)
        return err.reshape(len(ctx["timesteps"]), -1).mean(dim=1).sum()


class DiffusionGenerator(nn.Module):
    """DiT-style denoiser (module docstring). Inputs ``{"targets": list[Tensor[C, S, S]]}`` in
    [0, 1] and ``{"seeds": list[int]}``, one per item; the conditioning tokens come in as the
    first layer's activation. Output: the summed loss of the items."""

    def __init__(self, config: DiffusionConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.noise_embed = NoiseEmbed(config)
        self.blocks = nn.ModuleList(GeneratorBlock(config.hidden_size, config.num_heads, config.mlp_ratio,
                                                   config.norm_eps) for _ in range(config.num_layers))
        self.final = DiffusionHead(config)
        # a plain CPU tensor, not a buffer: the schedule is fixed, so no materialisation (a meta
        # build, `loom.model.materialise`) or move must touch it
        self.alphas_cumprod = noise_schedule(config).float()

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    @property
    def cond_tokens(self) -> int:
        return self.config.cond_tokens

    @property
    def target_shape(self) -> tuple[int, int, int]:
        """``[C, H, W]`` of the images it makes."""
        c, side = self.config.in_channels, self.config.image_size
        return (c, side, side)

    def check_target(self, target: torch.Tensor | tuple[int, ...], where: str) -> None:
        """Raise ``ValueError`` naming ``where`` when a target's shape is not the configured one."""
        c, s, _ = self.target_shape
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else tuple(target)
        if shape != self.target_shape:
            raise ValueError(f"{where} has shape {shape}; this generator makes images of [{c}, {s}, {s}] "
                             f"(its config's in_channels and image_size): resize the target or the generator")

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        targets: list[torch.Tensor] = list(inputs["targets"])
        seeds: list[int] = list(inputs["seeds"])
        if len(seeds) != len(targets):
            raise ValueError(f"generator inputs: {len(targets)} targets but {len(seeds)} seeds; give one seed each")
        cfg = self.config
        device = targets[0].device if targets else inputs.get("device", self.final.out.weight.device)
        for i, t in enumerate(targets):
            self.check_target(t, f"targets[{i}]")
        noised, noises, steps = [], [], []
        alphas = self.alphas_cumprod.to(device)
        for target, seed in zip(targets, seeds):
            t, eps = draw_noise(seed, cfg)
            eps = eps.to(device)
            a = alphas[t]
            x0 = target.float() * 2 - 1
            noised.append(patchify(a.sqrt() * x0 + (1 - a).sqrt() * eps, cfg.patch_size))
            noises.append(patchify(eps, cfg.patch_size))
            steps.append(t)
        width = cfg.in_channels * cfg.patch_size ** 2
        empty = torch.zeros(0, width, device=device)
        side = cfg.image_size // cfg.patch_size
        r, c = torch.meshgrid(torch.arange(side, device=device), torch.arange(side, device=device), indexing="ij")
        half = cfg.hidden_size // 2
        grid = torch.cat([sinusoidal_embedding(r.reshape(-1), half), sinusoidal_embedding(c.reshape(-1), half)], -1)
        n = len(targets)
        image_segment = torch.arange(n, device=device).repeat_interleave(cfg.patches)
        cond_segment = torch.arange(n, device=device).repeat_interleave(cfg.cond_tokens)
        return {
            "noised_patches": torch.cat(noised) if noised else empty,
            "noise_patches": torch.cat(noises) if noises else empty,
            "positions": grid.repeat(n, 1),
            "timesteps": torch.tensor(steps, dtype=torch.float32, device=device),
            "image_tokens": n * cfg.patches,
            "image_lengths": [cfg.patches] * n,
            "cross_mask": image_segment[:, None] == cond_segment[None, :],
        }

    def layers(self) -> list[Layer]:
        out = [Layer("noise_embed", self.noise_embed, self.noise_embed, kind="frontend")]
        for i, block in enumerate(self.blocks):
            out.append(Layer(f"blocks.{i}", block, block, kind="block"))
        out.append(Layer("final", self.final, self.final, kind="head"))
        return out

    def forward(self, cond: torch.Tensor, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), cond, self.context(inputs))

