"""Layer adapters for Hugging Face models, used unmodified (docs/architecture.md principle 3).

A Hugging Face causal LM with the Llama layout

    model.embed_tokens, model.layers[i], model.norm, model.rotary_emb, lm_head

(Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, Gemma2, Gemma3's text model: `SUPPORTED_MODEL_TYPES`)
is exposed as the layer list

    "model.embed_tokens" (embedding), "model.layers.0" .. (block), "model.norm" (norm),
    "lm_head" (head)

whose names are the modules' paths inside the HF model, so a stage's parameters keep their
names. ``context()`` rebuilds, from the raw inputs alone, what ``LlamaModel.forward`` computes
before its decoder loop: position ids, the rotary ``position_embeddings`` (from the model's own
``rotary_emb``) and the attention mask(s), made by the installed transformers' own mask
functions so that every attention implementation (sdpa, eager, flash, ...) gets the argument it
expects. Dispatch is by structure, then checked against the families whose forward the adapter
reproduces (a model whose forward does anything else is refused, never run silently
different); transformers is imported lazily so loom works without it.

What each family's ``ForCausalLM.forward`` does beyond the decoder loop, and where the layer
list does it: Gemma's embedding scale (``sqrt(hidden_size)``) lives in its
``*ScaledWordEmbedding`` module, so the embedding layer runs it (its non-persistent
``embed_scale`` buffer is recomputed on materialisation); Gemma2 / Gemma3's final logit
softcap (``final_logit_softcapping``) is applied by the head layer; their attention softcap and
sliding windows are inside the HF decoder layers, which the blocks call unmodified; Gemma3's
per-layer-type rotary tables (local and global ``rope_parameters``) are built per attention type
in ``context()``.
"""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.model.layers import Layer, decoder_layers

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# ``config.model_type`` of the families whose causal-LM forward the adapter reproduces (each
# has a test cutting it into 2 stages: tests/test_hf_families.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")


def check_supported_config(config: Any) -> None:
    """Refuse (``ValueError``) a config whose model the adapter does not reproduce exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} has no loom layer adapter; supported causal LMs: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type}: use_bidirectional_attention=True is not reproduced by loom's causal masks; "
                         "set it to false")


def read_config(path: str | Path) -> Any:
    """The Hugging Face config of ``path`` (a model directory or its ``config.json``), of any
    family; a one-line ``ValueError`` naming the path when it cannot be read."""
    from transformers import AutoConfig

    p = Path(path)
    if not p.exists():
        raise ValueError(f"{str(path)!r} does not exist")
    source = p if p.is_dir() else p.parent
    if not (source / "config.json").is_file() or (p.is_file() and p.name != "config.json"):
        raise ValueError(f"{str(path)!r} is neither a model directory with a config.json nor a config.json")
    try:
        return AutoConfig.from_pretrained(str(source))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{str(path)!r}: transformers cannot read its config.json ({' '.join(str(e).split())})") from e


def load_config(path: str | Path) -> Any:
    """The Hugging Face LLM config of ``path`` (`read_config`), checked with
    `check_supported_config`."""
    config = read_config(path)
    check_supported_config(config)
    return config


def causal_lm_from_config(config: Any) -> nn.Module:
    """An HF causal LM built from ``config`` on the meta device, in fp32 (loom's master
    weights): its layers get values on materialisation (`loom.model.materialise`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not has_llama_layout(model):
        raise ValueError(f"{type(model).__name__} does not have the Llama layout loom adapts")
    return model


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a model directory (or of a ``config.json``'s directory)."""
    p = Path(path)
    return sorted((p if p.is_dir() else p.parent).glob("*.safetensors"))


def has_llama_layout(module: nn.Module) -> bool:
    """True for a causal LM laid out like HF's ``LlamaForCausalLM`` whose decoder layers take
    precomputed ``position_embeddings`` (transformers >= 4.48)."""
    body = getattr(module, "model", None)
    if not isinstance(body, nn.Module) or not isinstance(getattr(module, "lm_head", None), nn.Linear):
        return False
    if getattr(module, "config", None) is None:
        return False
    if not isinstance(getattr(body, "embed_tokens", None), nn.Embedding):
        return False
    blocks = getattr(body, "layers", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return False
    if not isinstance(getattr(body, "norm", None), nn.Module) or not isinstance(
        getattr(body, "rotary_emb", None), nn.Module
    ):
        return False
    return "position_embeddings" in inspect.signature(blocks[0].forward).parameters


def adapter_for(module: nn.Module) -> HFCausalLMAdapter | None:
    """The layer adapter for a supported Hugging Face model, or None when ``module`` is not one.

    Raises ``ValueError`` for a Llama layout whose forward the adapter does not reproduce
    (another ``model_type``). Tied embeddings are kept: ``model.embed_tokens`` and ``lm_head``
    then share their weight, which `loom.model.multimodal.MultimodalModel` materialises and
    places on stages as a tie (`Tie`).
    """
    if has_llama_layout(module):
        return HFCausalLMAdapter(module)
    return None


def _attention_type(config: Any, layer_index: int) -> str:
    """Which mask a decoder layer uses, mirroring the HF model code: ``config.layer_types`` when
    the config has it (Qwen2, recent versions), else sliding when the config sets a window
    (Mistral), else full causal (Llama)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_index]
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return SLIDING_ATTENTION
    return FULL_ATTENTION


class HFCausalLMAdapter:
    """``LayerAdapter`` over an unmodified HF causal LM with the Llama layout.

    Inputs of ``context``: ``{"input_ids": LongTensor[B, L]}``, optionally ``"attention_mask"``
    ``[B, L]`` (1 = token, 0 = padding, as in HF) and ``"position_ids"`` ``[B, L]`` or ``[1, L]``.
    The head returns logits ``[B, L, vocab_size]``, like ``model(input_ids).logits``.
    """

    def __init__(self, model: nn.Module) -> None:
        if not has_llama_layout(model):
            raise TypeError(
                f"{type(model).__name__} does not have the Llama layout (model.embed_tokens, model.layers, "
                "model.norm, model.rotary_emb, lm_head)"
            )
        config = model.config
        check_supported_config(config)
        self.model = model
        self.config = config
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        # LlamaModel.forward runs layers[:num_hidden_layers]; do the same.
        num_blocks = getattr(config, "num_hidden_layers", len(model.model.layers))
        self.blocks = list(model.model.layers[:num_blocks])
        self.attention_types = [_attention_type(config, i) for i in range(len(self.blocks))]
        # Gemma3: one rotary table per attention type (local and global rope_parameters)
        self.rotary_per_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
        # Gemma2 / Gemma3: logits = cap * tanh(logits / cap), in ForCausalLM.forward after lm_head
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def layers(self) -> list[Layer]:
        layers = decoder_layers(self.model.model, self.model.lm_head, self.blocks,
                                lambda i, block: partial(self._run_block, block, self.attention_types[i]))
        cap = self.final_logit_softcapping
        if cap is not None:
            head = layers[-1]
            layers[-1] = Layer(head.name, head.module, partial(_softcapped, head.forward, cap), kind="head")
        return layers

    def init_layer_weights(self, module: nn.Module) -> None:
        """The model's own ``_init_weights`` over ``module``'s submodules, children first as
        ``PreTrainedModel.initialize_weights`` applies it (one layer at a time:
        `loom.model.materialise`)."""
        for sub in reversed(list(module.modules())):
            self.model._init_weights(sub)

    @staticmethod
    def init_layer_buffers(module: nn.Module) -> None:
        """Recompute rotary tables (``inv_freq``, non-persistent) by building a fresh rotary
        module from its config on the CPU: the constructor is what computes them in every
        transformers version."""
        for sub in module.modules():
            # Gemma's *ScaledWordEmbedding: the sqrt(hidden_size) factor is a non-persistent buffer
            if hasattr(sub, "scalar_embed_scale") and isinstance(getattr(sub, "embed_scale", None), torch.Tensor):
                sub.embed_scale.fill_(sub.scalar_embed_scale)
            if "RotaryEmbedding" in type(sub).__name__ and any(n.endswith("inv_freq") for n, _ in sub.named_buffers()):
                with torch.device("cpu"):
                    fresh = type(sub)(sub.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(sub, name).copy_(buffer)
                if hasattr(fresh, "attention_scaling"):
                    sub.attention_scaling = fresh.attention_scaling

    @staticmethod
    def _run_block(block: nn.Module, attention_type: str, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        out = block(
            x,
            attention_mask=ctx["attention_masks"][attention_type],
            position_ids=ctx["position_ids"],
            position_embeddings=ctx["position_embeddings"][attention_type],
        )
        # transformers < 5 returns a tuple (hidden_states, ...); 5.x returns the tensor.
        return out[0] if isinstance(out, tuple) else out

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Position ids, rotary tables and attention masks, as ``LlamaModel.forward`` builds them."""
        input_ids: torch.Tensor = inputs["input_ids"]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected [batch, length]")
        batch, length = input_ids.shape
        device = input_ids.device
        if inputs.get("segments") is not None:
            raise ValueError(
                "packed sequences (data.pack_sequences = true) need an LLM whose attention keeps packed "
                "samples apart; the Hugging Face adapter runs the model's own attention: set "
                "data.pack_sequences = false, or use the zoo Llama"
            )
        padding_mask = inputs.get("attention_mask")
        position_ids = inputs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=device).unsqueeze(0)
        position_ids = position_ids.to(device)

        # transformers reads only the shape, dtype and device of inputs_embeds for the rotary
        # tables and the masks; a zero-stride stand-in avoids running the embedding here.
        dtype = self.model.model.embed_tokens.weight.dtype
        like_embeds = torch.zeros((), dtype=dtype, device=device).expand(batch, length, self.hidden_size)
        rotary = self.model.model.rotary_emb
        with torch.no_grad():
            if self.rotary_per_type:
                tables = {kind: rotary(like_embeds, position_ids, kind) for kind in sorted(set(self.attention_types))}
            else:
                shared = rotary(like_embeds, position_ids)
                tables = {kind: shared for kind in set(self.attention_types)}

        masks = {
            kind: self._attention_mask(kind, like_embeds, padding_mask, position_ids)
            for kind in sorted(set(self.attention_types))
        }
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "position_embeddings": tables,  # attention type -> (cos, sin)
            "attention_masks": masks,
        }

    def _attention_mask(
        self,
        kind: str,
        like_embeds: torch.Tensor,
        padding_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
    ) -> Any:
        """The ``attention_mask`` argument the installed transformers' decoder layers expect.

        With sdpa and no padding this is None, and sdpa then runs with ``is_causal=True``; with
        eager attention it is a materialised additive mask. Passing None to an eager layer
        would silently drop causality, so the mask always comes from transformers' own
        factory when it has one.
        """
        try:
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        except ImportError:  # transformers < 4.53: no mask factory; build the 4D additive mask.
            return self._additive_mask(kind, like_embeds, padding_mask)
        factory = create_sliding_window_causal_mask if kind == SLIDING_ATTENTION else create_causal_mask
        params = inspect.signature(factory).parameters
        # The factory's argument names moved between versions (input_embeds -> inputs_embeds,
        # cache_position dropped); pass what this version takes.
        kwargs: dict[str, Any] = {"config": self.config, "attention_mask": padding_mask,
                                  "cache" if "cache" in params else "past_key_values": None}
        kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = like_embeds
        if "cache_position" in params:
            kwargs["cache_position"] = torch.arange(like_embeds.shape[1], device=like_embeds.device)
        if "position_ids" in params:
            kwargs["position_ids"] = position_ids
        return factory(**kwargs)

    def _additive_mask(
        self, kind: str, like_embeds: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``[B, 1, L, L]`` float mask, 0 where attention is allowed and the dtype's minimum
        elsewhere: what older decoder layers accept for both eager and sdpa attention."""
        batch, length, _ = like_embeds.shape
        device, dtype = like_embeds.device, like_embeds.dtype
        query = torch.arange(length, device=device)[:, None]
        key = torch.arange(length, device=device)[None, :]
        allowed = key <= query
        if kind == SLIDING_ATTENTION:
            allowed = allowed & (query - key < self.config.sliding_window)
        allowed = allowed[None, None].expand(batch, 1, length, length)
        if padding_mask is not None:
            allowed = allowed & padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = torch.zeros(batch, 1, length, length, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def _softcapped(head: Any, cap: float, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """The head's logits through Gemma2 / Gemma3's final softcap, as their ``ForCausalLM.forward``."""
    return torch.tanh(head(x, ctx) / cap) * cap
