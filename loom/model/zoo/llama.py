"""A tiny Llama-style causal language model, the zoo's LLM backbone.

RMSNorm, rotary position embeddings (RoPE), a SwiGLU MLP and grouped-query attention (key and
value heads repeated to the query heads), with causal attention through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``. No weight tying: the
input embedding and the output head are separate parameters, so they can sit on different
pipeline stages.

Layers: ``model.embed_tokens`` (embedding), ``model.layers.0`` .. ``model.layers.{n-1}``,
``model.norm``, ``lm_head`` (head, returns logits ``[B, L, vocab_size]``): the names, and the
parameter names under them, are those of Hugging Face's ``LlamaForCausalLM``, so a zoo state
dict loads into the HF model and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, decoder_layers, run_layers
from loom.model.zoo.attention import AttentionCore


@dataclass
class LlamaConfig:
    """Shape of a ``LlamaForCausalLM``."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 172
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2 != 0:
            raise ValueError(
                f"LlamaConfig: the head dimension {self.hidden_size // self.num_heads} must be even for RoPE"
            )


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[B, 1, L, head_dim]`` (fp32) for ``position_ids [B, L]``.

    The frequencies are laid out as two repeated halves, matching ``rotate_half``.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, L, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, L, head_dim]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.core = AttentionCore()  # no parameters; a seam for selective recompute

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int] | None = None,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, length, _ = x.shape
        # heads as -1: under tensor parallelism a rank holds only its share of the heads
        q = self.q_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attend is not None:  # context parallelism: the runtime's attention (k/v heads unrepeated)
            return self.o_proj(self.core(q, k, v, None, True, attend).transpose(1, 2).reshape(b, length, -1))
        # Grouped-query attention: each key/value head serves num_heads / num_kv_heads query heads.
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        if segments is None:
            out = self.core(q, k, v, None, True)
        else:  # packed samples in one row: causal within each sample only
            out = self.core(q[0], k[0], v[0], segments, True).unsqueeze(0)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = FeedForward(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int] | None = None,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _run_decoder_layer(layer: DecoderLayer, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    # Call the module (not .forward) so that hooks applied from outside (FSDP, ...) fire.
    return layer(x, ctx["rope_cos"], ctx["rope_sin"], ctx.get("segments"), ctx.get("attend"))


class LlamaModel(nn.Module):
    """The decoder stack (embedding, blocks, final norm) without the head.

    It only groups modules: ``LlamaForCausalLM`` runs them through its layer list. It exists
    so that parameter names follow the Hugging Face layout (``model.layers.0.self_attn.q_proj
    .weight``, ...), which also keeps the attribute ``layers`` (a ``ModuleList``) off the
    module that defines the ``layers()`` method of the layer-list contract.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. Inputs ``{"input_ids": LongTensor[B, L]}`` (optionally
    ``"position_ids": LongTensor[B, L]`` or ``[L]``); output logits ``[B, L, vocab_size]``.

    Parameter and layer names are those of Hugging Face's ``LlamaForCausalLM``
    (``model.embed_tokens``, ``model.layers.i``, ``model.norm``, ``lm_head``), so the zoo model
    and an adapted HF model are interchangeable, state dicts included.
    """

    supports_context_parallel = True  # context() takes the runtime's "context_parallel" (below)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) weights for embeddings and projections (the usual LLM init); norms at 1."""
        self.init_layer_weights(self, std)

    @staticmethod
    def init_layer_weights(module: nn.Module, std: float = 0.02) -> None:
        """`init_weights` restricted to ``module`` (one layer, when `loom.model.materialise`
        allocates layers one at a time)."""
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                nn.init.normal_(sub.weight, mean=0.0, std=std)
            elif isinstance(sub, RMSNorm):
                sub.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (same accessor as Hugging Face models)."""
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Input ids, position ids ``[B, L]`` and the RoPE tables built from them.

        With ``"segments"`` (sample lengths summing to ``L``, ``B = 1``) the row holds several
        packed samples: positions restart at every sample and attention stays inside each.

        With ``"context_parallel"`` (the runtime's per-rank context: ``tokens``, the rank's
        global positions, and ``attend(q, k, v)``, e.g. `loom.runtime.context_parallel.
        RankContext`) the full row's ids and positions are cut to the rank's tokens and every
        block attends through ``attend``."""
        input_ids: torch.Tensor = inputs["input_ids"]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected [batch, length]")
        batch, length = input_ids.shape
        if length > self.config.max_seq_len:
            raise ValueError(
                f"input_ids has length {length}, more than max_seq_len={self.config.max_seq_len}; "
                "raise LlamaConfig.max_seq_len or shorten the sequences"
            )
        segments = inputs.get("segments")
        position_ids = inputs.get("position_ids")
        if segments is not None:
            segments = [int(n) for n in segments]
            if batch != 1 or sum(segments) != length:
                raise ValueError(
                    f"segments {segments} must sum to the packed row's length {length} (with batch 1, got {batch})"
                )
            if position_ids is None:
                position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in segments])
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)
        position_ids = position_ids.to(input_ids.device).expand(batch, length)
        cp = inputs.get("context_parallel")
        if cp is not None:
            # Context parallelism (cornstarch.md §3.3.6): this rank runs only its tokens of the
            # row; their positions (RoPE) are the row's, and attention is the runtime's, whose
            # mask already keeps packed samples apart.
            tokens = cp.tokens.to(input_ids.device)
            input_ids, position_ids, segments = input_ids[:, tokens], position_ids[:, tokens], None
        cos, sin = rope_tables(position_ids, self.hidden_size // self.config.num_heads, self.config.rope_theta)
        ctx = {"input_ids": input_ids, "position_ids": position_ids, "rope_cos": cos, "rope_sin": sin}
        if segments is not None:
            ctx["segments"] = segments
        if cp is not None:
            ctx["attend"] = cp.attend
        return ctx

    def layers(self) -> list[Layer]:
        return decoder_layers(self.model, self.lm_head, list(self.model.layers), lambda i, block: partial(_run_decoder_layer, block))

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))
