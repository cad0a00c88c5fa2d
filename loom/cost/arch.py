"""Architecture descriptions: the dimensions that decide what each layer costs (issue 3, items 1
and 5).

A `ModelArch` mirrors a `MultimodalModel` layer for layer: every module (encoders in graph
order, then ``"llm"``, then any generators) is a list of `LayerArch` in the *same order and count* as
`MultimodalModel.module_layers`, so a plan's stage boundaries mean the same thing to the cost
model as to the runtime:

- an encoder: front-end (``patch_embed`` / ``frontend``), blocks, final norm (when the
  architecture has one), projector;
- the LLM: ``embed_tokens``, blocks, final norm, ``lm_head``;
- a generator (DistTrain's output projector + modality generator, disttrain.md §1): the
  projector from the LLM's width, then the generator's layers: a DiT's patch front-end, blocks
  with cross-attention and output layer, or a U-Net's convolutions, residual blocks and
  spatial-transformer blocks at several resolutions.

A generator's `Workload` counts its items' positions at the module's base resolution
(``tokens``: latent positions or patches; ``attn_sq``: their squares; ``segments``: items). A
generator layer runs at ``scale`` (its input grid is the base grid downsampled ``scale`` times
per side), so it sees ``tokens / scale^2`` positions and ``attn_sq / scale^4``; its per-token
quantities here are per *base* position, so FLOPs and memory follow image resolution through the
workload. Layers that read the LLM's conditioning states (the projector, cross-attention) also
work on ``cond`` tokens per item (``segments x cond``).

Two builders: `loom.cost.arch_from_model` reads a live model (the zoo, or a Hugging Face
Llama-layout LLM) and takes each layer's trainable flag from ``requires_grad``;
`loom.cost.model_configs.load_model_arch` assembles real architectures from the TOML files in
``configs/models/`` (their published configurations, sources cited in each file) with a
projector and a freeze list, so the simulator can plan models too large to build.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

LLM = "llm"
LAYER_KINDS = ("embedding", "frontend", "block", "norm", "head", "projector", "resblock", "conv")
MODULE_KINDS = ("vision", "audio", "llm", "generator")
GROUP_NORM = 2  # parameters per channel of a GroupNorm / LayerNorm with affine weight and bias
FRONTENDS = ("patch", "conv1d")
PROJECTORS = ("linear", "mlp", "merger")
NORMS = ("layernorm", "rmsnorm")


def norm_params(norm: str, width: int) -> int:
    """LayerNorm has a weight and a bias, RMSNorm a weight only."""
    return 2 * width if norm == "layernorm" else width


@dataclass(frozen=True)
class LayerArch:
    """One layer of a module and the dimensions its cost depends on.

    Fields used by each ``kind`` (the rest stay at their defaults):

    - ``block``: ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``ffn``, ``gated_mlp``
      (SwiGLU: gate, up, down) or not (fc1, GELU, fc2), ``causal``, ``qkv_bias``,
      ``linear_bias`` (output projection and MLP), ``norm`` (its two pre/post norms);
    - ``embedding``: ``hidden``, ``vocab``, ``positions`` (learned position rows);
    - ``head``: ``hidden``, ``vocab``, ``tied`` (shares the embedding's weight);
    - ``norm``: ``hidden``, ``norm``;
    - ``frontend``: ``frontend = "patch"`` (a stride-``patch`` convolution over ``in_channels``
      x ``temporal_patch`` x ``patch`` x ``patch`` pixels, i.e. one GEMM per patch) or
      ``"conv1d"`` (Whisper: conv ``in_channels -> hidden`` of width ``kernel``, then conv
      ``hidden -> hidden`` of width ``kernel`` and stride ``stride``, so ``stride`` input frames
      per output token); ``frontend_bias``, ``positions``, ``cls_token``;
    - ``projector``: ``projector = "linear"`` (hidden -> out_hidden), ``"mlp"`` (LLaVA-1.5:
      Linear, GELU, Linear out_hidden -> out_hidden) or ``"merger"`` (Qwen2-VL: LayerNorm, then
      ``merge`` neighbouring tokens concatenated to ``hidden * merge`` and an MLP
      ``hidden*merge -> hidden*merge -> out_hidden``, so ``merge`` input tokens give one output).

    Generator layers (module docstring: ``scale``, ``cond``):

    - ``block`` with ``cross`` > 0 adds a cross-attention to ``cond`` tokens of width ``cross``
      per item (its norm, query, key/value and output projections, biases as the block's); with
      ``proj_io`` a GroupNorm and linear ``proj_in`` / ``proj_out`` around it (a U-Net's spatial
      transformer). A generator's attention is per item (not causal);
    - ``resblock``: a U-Net residual block ``in_channels -> hidden``: GroupNorm, SiLU, 3x3 conv,
      the timestep embedding (width ``temb``) projected and added, GroupNorm, SiLU, 3x3 conv, and
      a 1x1 shortcut conv when the widths differ;
    - ``conv``: a ``kernel`` x ``kernel`` convolution ``in_channels -> hidden`` with ``stride``
      (2: a downsampler), ``upsample`` (nearest 2x before it) and ``norm_before`` (GroupNorm and
      SiLU on its input: a U-Net's output conv; a DiT's final norm and linear are a 1x1 conv);
    - a ``frontend`` or ``conv`` with ``time_embed`` > 0 holds the timestep MLP ``time_in ->
      time_embed -> time_embed``;
    - a ``projector`` with ``cond`` > 0 maps the LLM's states, ``cond`` per item.
    """

    name: str
    kind: str
    hidden: int
    trainable: bool = True
    # block
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0  # 0: hidden // heads
    ffn: int = 0
    gated_mlp: bool = False
    causal: bool = False
    qkv_bias: bool = False
    key_bias: bool = True  # with qkv_bias: whether the key projection has one too (Whisper's has none)
    linear_bias: bool = False
    norm: str = "layernorm"
    # embedding / head
    vocab: int = 0
    positions: int = 0
    tied: bool = False
    # frontend
    frontend: str = ""
    in_channels: int = 0
    patch: int = 0
    temporal_patch: int = 1
    kernel: int = 3
    stride: int = 2
    frontend_bias: bool = True
    cls_token: bool = False
    # projector
    projector: str = ""
    out_hidden: int = 0
    merge: int = 1
    # generator layers (class docstring)
    scale: int = 1
    cond: int = 0
    cross: int = 0
    proj_io: bool = False
    temb: int = 0
    upsample: bool = False
    norm_before: bool = False
    time_in: int = 0
    time_embed: int = 0

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"{where}: kind = {self.kind!r}; choose one of {list(LAYER_KINDS)}")
        if self.hidden < 1:
            raise ValueError(f"{where}: hidden = {self.hidden} must be positive")
        if self.norm not in NORMS:
            raise ValueError(f"{where}: norm = {self.norm!r}; choose one of {list(NORMS)}")
        if self.kind == "block":
            if self.heads < 1 or self.ffn < 1:
                raise ValueError(f"{where}: a block needs heads >= 1 and ffn >= 1 (got {self.heads}, {self.ffn})")
            if self.head_dim == 0 and self.hidden % self.heads:
                raise ValueError(f"{where}: hidden = {self.hidden} is not divisible by heads = {self.heads}; give head_dim")
            if self.kv_heads < 1 or self.heads % self.kv_heads:
                raise ValueError(f"{where}: kv_heads = {self.kv_heads} must divide heads = {self.heads}")
        if self.kind in ("embedding", "head") and self.vocab < 1:
            raise ValueError(f"{where}: an {self.kind} needs vocab >= 1")
        if self.kind == "frontend":
            if self.frontend not in FRONTENDS:
                raise ValueError(f"{where}: frontend = {self.frontend!r}; choose one of {list(FRONTENDS)}")
            if self.in_channels < 1:
                raise ValueError(f"{where}: in_channels must be positive")
            if self.frontend == "patch" and self.patch < 1:
                raise ValueError(f"{where}: a patch front-end needs patch >= 1")
        if self.kind == "projector":
            if self.projector not in PROJECTORS:
                raise ValueError(f"{where}: projector = {self.projector!r}; choose one of {list(PROJECTORS)}")
            if self.out_hidden < 1:
                raise ValueError(f"{where}: a projector needs out_hidden >= 1 (the LLM's width)")
            if self.merge < 1 or (self.projector != "merger" and self.merge != 1):
                raise ValueError(f"{where}: merge = {self.merge}; only a 'merger' projector merges tokens")
        if self.kind in ("resblock", "conv") and (self.in_channels < 1 or self.kernel < 1 or self.stride < 1):
            raise ValueError(f"{where}: a {self.kind} needs in_channels, kernel and stride >= 1")
        if self.scale < 1 or self.cond < 0 or self.cross < 0:
            raise ValueError(f"{where}: scale = {self.scale} must be >= 1, cond = {self.cond} and cross = {self.cross} "
                             f">= 0")

    # ---- shapes ------------------------------------------------------------------------------
    @cached_property  # layer shapes are immutable; the simulator asks millions of times
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // max(self.heads, 1))

    @cached_property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // max(self.heads, 1))

    @cached_property
    def out_width(self) -> int:
        """Width of the activation the layer hands to the next one."""
        if self.kind == "projector":
            return self.out_hidden
        if self.kind == "head":
            return self.vocab
        return self.hidden

    @cached_property
    def out_scale(self) -> float:
        """The downsampling of the layer's output grid against the module's base grid."""
        if self.kind == "conv":
            return self.scale * self.stride / (2 if self.upsample else 1)
        return float(self.scale)

    def tokens_out(self, tokens: int) -> int:
        """Tokens leaving the layer for ``tokens`` entering it (a merger merges them; a
        generator layer's output grid is its own, ``tokens`` counting base positions)."""
        if self.kind == "projector":
            return tokens // self.merge
        if self.out_scale != 1:
            return int(tokens / self.out_scale**2)
        return tokens

    # ---- parameters --------------------------------------------------------------------------
    @cached_property
    def gemm_weights(self) -> int:
        """Parameters held in matrix multiplies (read once per pass: the memory-bound floor)."""
        h = self.hidden
        if self.kind == "block":
            mlp = (3 if self.gated_mlp else 2) * h * self.ffn
            cross = 2 * h * self.q_dim + 2 * self.cross * self.kv_dim if self.cross else 0
            return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + mlp + cross + (2 * h * h if self.proj_io else 0)
        if self.kind == "resblock":
            return 9 * self.in_channels * h + 9 * h * h + (self.in_channels * h if self.in_channels != h else 0)
        if self.kind == "conv":
            return self.kernel**2 * self.in_channels * h
        if self.kind == "head":
            return self.vocab * h
        if self.kind == "frontend":
            if self.frontend == "patch":
                return self.in_channels * self.temporal_patch * self.patch**2 * h
            return self.kernel * self.in_channels * h + self.kernel * h * h
        if self.kind == "projector":
            if self.projector == "linear":
                return h * self.out_hidden
            if self.projector == "mlp":
                return h * self.out_hidden + self.out_hidden**2
            wide = h * self.merge
            return wide * wide + wide * self.out_hidden
        return 0  # embedding (a gather) and norm

    @cached_property
    def gemm_weights_per_token(self) -> float:
        """GEMM weights one *input* token passes through: forward GEMM FLOPs are
        ``2 * tokens * gemm_weights_per_token``. A conv front-end's first convolution runs
        ``stride`` times per output token; a merger's MLP once per ``merge`` input tokens."""
        if self.kind == "frontend" and self.frontend == "conv1d":
            return self.stride * self.kernel * self.in_channels * self.hidden + self.kernel * self.hidden**2
        if self.kind == "projector" and self.projector == "merger":
            return self.gemm_weights / self.merge
        if self.cond and self.kind == "projector":
            return 0.0  # it reads the conditioning tokens only (`gemm_weights_per_item`)
        per_position = float(self.gemm_weights)
        if self.kind == "block" and self.cross:  # keys and values of the conditioning tokens: per item
            per_position -= 2 * self.cross * self.kv_dim
        if self.kind == "conv":  # per input position: a stride-s conv has 1/s^2 outputs each, an upsampler 4
            per_position *= (4 if self.upsample else 1) / self.stride**2
        return per_position / self.scale**2

    @cached_property
    def gemm_weights_per_item(self) -> float:
        """GEMM weights per generated item (forward GEMM FLOPs add ``2 * segments *`` this): the
        projector and the cross-attention's keys and values over the ``cond`` conditioning tokens,
        a residual block's timestep projection, the timestep MLP. 0 outside generators."""
        w = 0.0
        if self.kind == "projector" and self.cond:
            w += self.cond * self.gemm_weights
        if self.kind == "block" and self.cross:
            w += self.cond * 2 * self.cross * self.kv_dim
        if self.kind == "resblock":
            w += self.temb * self.hidden
        if self.time_embed:
            w += self.time_in * self.time_embed + self.time_embed**2
        return w

    @cached_property
    def params(self) -> int:
        """Parameter count, as ``sum(p.numel())`` of the real module (a tied head counts 0:
        its weight is the embedding's)."""
        h = self.hidden
        time = (self.time_in * self.time_embed + self.time_embed + self.time_embed**2 + self.time_embed
                if self.time_embed else 0)
        if self.kind == "block":
            biases = (self.q_dim + (2 if self.key_bias else 1) * self.kv_dim) if self.qkv_bias else 0
            if self.linear_bias:
                biases += h + (2 if self.gated_mlp else 1) * self.ffn + h
            norms = 2 * norm_params(self.norm, h)
            if self.cross:  # its query, key/value and output biases follow the block's; its own norm
                biases += ((self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0) + (h if self.linear_bias else 0)
                norms += norm_params(self.norm, h)
            if self.proj_io:  # GroupNorm, proj_in and proj_out with biases
                biases += GROUP_NORM * h + 2 * h
            return self.gemm_weights + biases + norms
        if self.kind == "resblock":
            c, shortcut = self.in_channels, self.in_channels != h
            return (self.gemm_weights + GROUP_NORM * (c + h) + 2 * h + self.temb * h + h + (h if shortcut else 0))
        if self.kind == "conv":
            return self.gemm_weights + h + (GROUP_NORM * self.in_channels if self.norm_before else 0) + time
        if self.kind == "embedding":
            return (self.vocab + self.positions) * h
        if self.kind == "head":
            return 0 if self.tied else self.vocab * h
        if self.kind == "norm":
            return norm_params(self.norm, h)
        if self.kind == "frontend":
            extra = (self.positions + (1 if self.cls_token else 0)) * h
            if self.frontend_bias:
                extra += h if self.frontend == "patch" else 2 * h
            return self.gemm_weights + extra + time
        # projector
        out = self.out_hidden
        if self.projector == "linear":
            return self.gemm_weights + out
        if self.projector == "mlp":
            return self.gemm_weights + 2 * out
        return self.gemm_weights + norm_params("layernorm", h) + h * self.merge + out

    @cached_property
    def stored_params(self) -> int:
        """Parameters a rank holding this layer stores: a tied head keeps its own copy of the
        embedding weight when the two sit on different stages (as Megatron does)."""
        return self.vocab * self.hidden if self.kind == "head" and self.tied else self.params


@dataclass(frozen=True)
class ModuleArch:
    """One module: its layers in the runtime's order, and how items become tokens.

    ``patch`` and ``merge`` (vision) or ``sample_rate``, ``hop_length`` and ``stride`` (audio)
    turn an item's metadata into the module's token count (`num_tokens`) and the LLM's
    (`llm_tokens`), as docs/architecture.md principle 4 asks. A generator's ``patch`` is the
    pixels per base position per side (a DiT's patch, a latent U-Net's VAE factor) and
    ``cond_tokens`` the LLM states per item (its generation positions).
    """

    name: str
    kind: str
    layers: tuple[LayerArch, ...]
    patch: int = 0
    sample_rate: int = 0
    hop_length: int = 0
    published_params: float = 0.0
    cond_tokens: int = 0
    # > 0: every item gives this many tokens whatever its size (an encoder that resizes its
    # input to a fixed size first, as Hugging Face SigLIP and CLIP take their config's image_size)
    item_tokens: int = 0
    # (factor, min_pixels, max_pixels): images are first resized as Qwen2-VL's processor does
    # (`loom.data.hf_processor.smart_resize`), then cut into patches
    resize: tuple[int, int, int] = ()

    def __post_init__(self) -> None:
        if self.kind not in MODULE_KINDS:
            raise ValueError(f"module {self.name!r}: kind = {self.kind!r}; choose one of {list(MODULE_KINDS)}")
        if not self.layers:
            raise ValueError(f"module {self.name!r} has no layers")
        if self.kind == "generator" and (self.patch < 1 or self.cond_tokens < 1):
            raise ValueError(f"generator {self.name!r}: patch = {self.patch} and cond_tokens = {self.cond_tokens} must "
                             f"be at least 1")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def trainable_params(self) -> int:
        return sum(l.params for l in self.layers if l.trainable)

    @property
    def hidden(self) -> int:
        return next(l.hidden for l in self.layers if l.kind in ("block", "resblock"))

    @property
    def merge(self) -> int:
        """Input tokens per LLM token: the product of the module's merging projectors (Qwen2-VL's
        merger may sit before loom's projector)."""
        return math.prod(l.merge for l in self.layers if l.kind == "projector")

    def num_tokens(self, item: Any) -> int:
        """The module's tokens for one item (an ``ImageMeta`` with ``height``/``width`` or an
        ``AudioMeta`` with ``num_samples``), before any merging projector."""
        if self.item_tokens:
            return self.item_tokens
        if self.kind == "vision" and self.resize:
            from loom.data.hf_processor import smart_resize

            (h, w), = smart_resize([(int(item.height), int(item.width))], *self.resize).tolist()
            return (h // self.patch) * (w // self.patch)
        if self.kind in ("vision", "generator"):  # a generator's item: a `GenerationMeta`
            return (int(item.height) // self.patch) * (int(item.width) // self.patch)
        if self.kind == "audio":
            frames = 1 + int(item.num_samples) // self.hop_length  # centred STFT frames
            stride = self.layers[0].stride
            return (frames - 1) // stride + 1
        raise ValueError(f"module {self.name!r} is the LLM: it has no items")

    def llm_tokens(self, item: Any) -> int:
        """Tokens the item places in the LLM's sequence (after a merging projector)."""
        return self.num_tokens(item) // self.merge


@dataclass
class ModelArch:
    """Modules in graph order: encoders, then ``"llm"``, then generators."""

    modules: dict[str, ModuleArch]

    def __post_init__(self) -> None:
        names = list(self.modules)
        if LLM not in names:
            raise ValueError(f"ModelArch.modules needs {LLM!r} (encoders before it, generators after); got {names}")
        at = names.index(LLM)
        misplaced = [n for i, n in enumerate(names)
                     if n != LLM and (self.modules[n].kind == "generator") != (i > at)]
        if misplaced:
            raise ValueError(f"ModelArch.modules {names}: {misplaced} are out of place; list the encoders, then "
                             f"{LLM!r}, then the generators (kind 'generator')")

    @property
    def module_names(self) -> list[str]:
        return list(self.modules)

    @property
    def encoder_names(self) -> list[str]:
        names = list(self.modules)
        return names[:names.index(LLM)]

    @property
    def generator_names(self) -> list[str]:
        names = list(self.modules)
        return names[names.index(LLM) + 1:]

    def module(self, name: str) -> ModuleArch:
        if name not in self.modules:
            raise ValueError(f"unknown module {name!r}; the model has {self.module_names}")
        return self.modules[name]

    def layer_counts(self) -> dict[str, int]:
        return {n: m.num_layers for n, m in self.modules.items()}

    @property
    def params(self) -> int:
        return sum(m.params for m in self.modules.values())

    @property
    def trainable_params(self) -> int:
        return sum(m.trainable_params for m in self.modules.values())

    def with_freeze(self, parts: Iterable[str]) -> ModelArch:
        """A copy with ``parts`` frozen and everything else trainable. Parts are named as in
        `MultimodalModel.freeze`: ``"llm"``, ``"<encoder>"``, ``"<encoder>.encoder"`` (all but
        the projector), ``"<encoder>.projector"``, and a generator's ``"<generator>"``,
        ``"<generator>.generator"``, ``"<generator>.projector"``."""
        frozen: dict[str, set[str]] = {n: set() for n in self.modules}  # module -> frozen parts
        for part in parts:
            name, _, sub = part.partition(".")
            if name not in self.modules or (name == LLM and sub):
                raise ValueError(
                    f"freeze: unknown part {part!r}; parts are 'llm', '<encoder>[.encoder|.projector]' "
                    f"with encoders {self.encoder_names}, or '<generator>[.generator|.projector]' with generators "
                    f"{self.generator_names}"
                )
            body = "generator" if name in self.generator_names else "encoder"
            if sub not in ("", body, "projector"):
                raise ValueError(f"freeze: unknown part {part!r}: after {name!r} use '.{body}' or '.projector'")
            frozen[name] |= {body, "projector"} if sub == "" else {sub}
        modules = {}
        for name, m in self.modules.items():
            body = "generator" if name in self.generator_names else "encoder"
            layers = tuple(
                dataclasses.replace(
                    l, trainable=("projector" if l.kind == "projector" and name != LLM else body) not in frozen[name]
                )
                for l in m.layers
            )
            modules[name] = dataclasses.replace(m, layers=layers)
        return ModelArch(modules)
