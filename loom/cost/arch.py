"""Architecture descriptions: the dimensions that decide what each layer costs (issue 3, items 1
and 5).

A `ModelArch` mirrors a `MultimodalModel` layer for layer: every module (encoders in graph
order, then ``"llm"``) is a list of `LayerArch` in the *same order and count* as
`MultimodalModel.module_layers`, so a plan's stage boundaries mean the same thing to the cost
model as to the runtime:

- an encoder: front-end (``patch_embed`` / ``frontend``), blocks, final norm (when the
  architecture has one), projector;
- the LLM: ``embed_tokens``, blocks, final norm, ``lm_head``.

Two builders: `arch_from_model` reads a live model (the zoo, or a Hugging Face Llama-layout
LLM) and takes each layer's trainable flag from ``requires_grad``; `load_model_arch` assembles
real architectures from the TOML files in ``configs/models/`` (their published configurations,
sources cited in each file) with a projector and a freeze list, so the simulator can plan
models too large to build.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loom.cost sits below loom.model in DESIGN.md's table; imported lazily
    from loom.model.multimodal import MultimodalModel

LLM = "llm"
LAYER_KINDS = ("embedding", "frontend", "block", "norm", "head", "projector")
MODULE_KINDS = ("vision", "audio", "llm")
FRONTENDS = ("patch", "conv1d")
PROJECTORS = ("linear", "mlp", "merger")
NORMS = ("layernorm", "rmsnorm")

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


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

    def tokens_out(self, tokens: int) -> int:
        """Tokens leaving the layer for ``tokens`` entering it (a merger merges them)."""
        return tokens // self.merge if self.kind == "projector" else tokens

    # ---- parameters --------------------------------------------------------------------------
    @cached_property
    def gemm_weights(self) -> int:
        """Parameters held in matrix multiplies (read once per pass: the memory-bound floor)."""
        h = self.hidden
        if self.kind == "block":
            mlp = (3 if self.gated_mlp else 2) * h * self.ffn
            return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + mlp
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
        return float(self.gemm_weights)

    @cached_property
    def params(self) -> int:
        """Parameter count, as ``sum(p.numel())`` of the real module (a tied head counts 0:
        its weight is the embedding's)."""
        h = self.hidden
        if self.kind == "block":
            biases = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
            if self.linear_bias:
                biases += h + (2 if self.gated_mlp else 1) * self.ffn + h
            return self.gemm_weights + biases + 2 * norm_params(self.norm, h)
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
            return self.gemm_weights + extra
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
    (`llm_tokens`), as DESIGN.md principle 4 asks.
    """

    name: str
    kind: str
    layers: tuple[LayerArch, ...]
    patch: int = 0
    sample_rate: int = 0
    hop_length: int = 0
    published_params: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in MODULE_KINDS:
            raise ValueError(f"module {self.name!r}: kind = {self.kind!r}; choose one of {list(MODULE_KINDS)}")
        if not self.layers:
            raise ValueError(f"module {self.name!r} has no layers")

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
        return next(l.hidden for l in self.layers if l.kind == "block")

    @property
    def merge(self) -> int:
        return self.layers[-1].merge if self.layers[-1].kind == "projector" else 1

    def num_tokens(self, item: Any) -> int:
        """The module's tokens for one item (an ``ImageMeta`` with ``height``/``width`` or an
        ``AudioMeta`` with ``num_samples``), before any merging projector."""
        if self.kind == "vision":
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
    """Modules in graph order: encoders, then ``"llm"``."""

    modules: dict[str, ModuleArch]

    def __post_init__(self) -> None:
        names = list(self.modules)
        if not names or names[-1] != LLM:
            raise ValueError(f"ModelArch.modules must end with {LLM!r} (encoders first); got {names}")

    @property
    def module_names(self) -> list[str]:
        return list(self.modules)

    @property
    def encoder_names(self) -> list[str]:
        return [n for n in self.modules if n != LLM]

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
        the projector), ``"<encoder>.projector"``."""
        frozen: dict[str, set[str]] = {n: set() for n in self.modules}  # module -> frozen parts
        for part in parts:
            name, _, sub = part.partition(".")
            if name not in self.modules or (name == LLM and sub):
                raise ValueError(
                    f"freeze: unknown part {part!r}; parts are 'llm', or '<encoder>[.encoder|.projector]' "
                    f"with encoders {self.encoder_names}"
                )
            if sub not in ("", "encoder", "projector"):
                raise ValueError(f"freeze: unknown part {part!r}: after {name!r} use '.encoder' or '.projector'")
            frozen[name] |= {"encoder", "projector"} if sub == "" else {sub}
        modules = {}
        for name, m in self.modules.items():
            layers = tuple(
                dataclasses.replace(
                    l, trainable=("projector" if l.kind == "projector" and name != LLM else "encoder") not in frozen[name]
                )
                for l in m.layers
            )
            modules[name] = dataclasses.replace(m, layers=layers)
        return ModelArch(modules)


# ---- from a live model --------------------------------------------------------------------------


def _trainable(module: Any) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _projector_arch(name: str, module: Any, hidden: int, trainable: bool) -> LayerArch:
    from torch import nn

    from loom.model.multimodal import MLPProjector

    if isinstance(module, MLPProjector):
        return LayerArch(name, "projector", hidden, trainable, projector="mlp", out_hidden=module.out_features)
    if isinstance(module, nn.Linear):
        return LayerArch(name, "projector", hidden, trainable, projector="linear", out_hidden=module.out_features)
    raise TypeError(
        f"{name}: projector {type(module).__name__} has no cost description; use 'linear' or 'mlp', "
        "or describe the model with load_model_arch"
    )


def _decoder_block_arch(name: str, block: Any, config: Any, trainable: bool) -> LayerArch:
    """A Llama-layout decoder block (zoo or Hugging Face): dims read off its projections."""
    attn, mlp = block.self_attn, block.mlp
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    q_dim, kv_dim = attn.q_proj.out_features, attn.k_proj.out_features
    head_dim = q_dim // heads
    gated = hasattr(mlp, "gate_proj")
    ffn = (mlp.gate_proj if gated else mlp.up_proj).out_features
    norm = "rmsnorm" if "rms" in type(block.input_layernorm).__name__.lower() else "layernorm"
    return LayerArch(
        name, "block", attn.q_proj.in_features, trainable, heads=heads, kv_heads=kv_dim // head_dim,
        head_dim=head_dim, ffn=ffn, gated_mlp=gated, causal=True, qkv_bias=attn.q_proj.bias is not None,
        linear_bias=attn.o_proj.bias is not None, norm=norm,
    )


def _encoder_layer_arch(layer: Any, encoder: Any) -> LayerArch:
    from loom.model.zoo import VisionEncoder

    cfg = encoder.config
    trainable = _trainable(layer.module)
    h = cfg.hidden_size
    if layer.kind == "frontend":
        if isinstance(encoder, VisionEncoder):
            return LayerArch(layer.name, "frontend", h, trainable, frontend="patch", in_channels=cfg.in_channels,
                             patch=cfg.patch_size)
        return LayerArch(layer.name, "frontend", h, trainable, frontend="conv1d", in_channels=cfg.n_mels,
                         kernel=3, stride=2)
    if layer.kind == "block":
        # zoo EncoderBlock: LayerNorms, fused qkv and MLP Linears with biases, GELU MLP
        return LayerArch(layer.name, "block", h, trainable, heads=cfg.num_heads, kv_heads=cfg.num_heads,
                         ffn=int(h * cfg.mlp_ratio), qkv_bias=True, linear_bias=True)
    if layer.kind == "norm":
        return LayerArch(layer.name, "norm", h, trainable)
    raise TypeError(f"{layer.name}: layer kind {layer.kind!r} of a {type(encoder).__name__} has no cost description")


def arch_from_model(model: MultimodalModel) -> ModelArch:
    """The `ModelArch` of a live model: zoo encoders (`VisionEncoder`, `AudioEncoder`) and a
    Llama-layout LLM (the zoo's or a Hugging Face one), layer for layer as
    ``model.module_layers``, each layer trainable iff any of its parameters requires grad.

    Every layer's parameter count is checked against the real module, so a model this
    function does not understand fails here rather than mis-costing silently.
    """
    from loom.model.zoo import AudioEncoder, VisionEncoder

    modules: dict[str, ModuleArch] = {}
    for name in model.module_names:
        layers: list[LayerArch] = []
        if name == LLM:
            llm = model.llm
            config = llm.config
            for layer in model.module_layers(name):
                trainable = _trainable(layer.module)
                if layer.kind == "embedding":
                    layers.append(LayerArch(layer.name, "embedding", layer.module.embedding_dim, trainable,
                                            vocab=layer.module.num_embeddings))
                elif layer.kind == "block":
                    layers.append(_decoder_block_arch(layer.name, layer.module, config, trainable))
                elif layer.kind == "norm":
                    norm = "rmsnorm" if "rms" in type(layer.module).__name__.lower() else "layernorm"
                    layers.append(LayerArch(layer.name, "norm", layers[-1].hidden, trainable, norm=norm))
                elif layer.kind == "head":
                    layers.append(LayerArch(layer.name, "head", layer.module.in_features, trainable,
                                            vocab=layer.module.out_features))
                else:
                    raise TypeError(f"{layer.name}: LLM layer kind {layer.kind!r} has no cost description")
            module = ModuleArch(name, "llm", tuple(layers))
        else:
            wrapper = model.encoders[name]
            encoder = wrapper.encoder
            if isinstance(encoder, VisionEncoder):
                kind, extra = "vision", {"patch": encoder.config.patch_size}
            elif isinstance(encoder, AudioEncoder):
                kind, extra = "audio", {"sample_rate": encoder.config.sample_rate, "hop_length": encoder.config.hop_length}
            else:
                raise TypeError(
                    f"encoder {name!r} ({type(encoder).__name__}) has no cost description; describe the model "
                    "with load_model_arch"
                )
            for layer in model.module_layers(name):
                if layer.kind == "projector":
                    layers.append(_projector_arch(layer.name, layer.module, encoder.hidden_size, _trainable(layer.module)))
                else:
                    layers.append(_encoder_layer_arch(layer, encoder))
            module = ModuleArch(name, kind, tuple(layers), **extra)
        for arch_layer, layer in zip(module.layers, model.module_layers(name)):
            if arch_layer.params != _numel(layer.module):
                raise ValueError(
                    f"{layer.name}: the cost description counts {arch_layer.params} parameters but the module "
                    f"has {_numel(layer.module)}; its architecture is not one arch_from_model understands"
                )
        modules[name] = module
    return ModelArch(modules)


# ---- from configs/models/*.toml -----------------------------------------------------------------


@dataclass(frozen=True)
class TransformerConfig:
    """The ``[transformer]`` table: the block stack."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int = 0  # 0: as many as heads (multi-head attention)
    head_dim: int = 0
    gated_mlp: bool = False
    causal: bool = False
    qkv_bias: bool = False
    linear_bias: bool = False
    norm: str = "layernorm"
    final_norm: bool = True


@dataclass(frozen=True)
class FrontendConfig:
    """The ``[frontend]`` table of an encoder."""

    type: str
    in_channels: int
    patch: int = 0
    temporal_patch: int = 1
    kernel: int = 3
    stride: int = 2
    bias: bool = True
    positions: int = 0
    cls_token: bool = False
    sample_rate: int = 0
    hop_length: int = 0


@dataclass(frozen=True)
class EmbeddingConfig:
    """The ``[embedding]`` table of an LLM."""

    vocab: int
    positions: int = 0
    tied: bool = False


@dataclass(frozen=True)
class ProjectorConfig:
    """The ``[projector]`` table: an encoder's own projector (Qwen2-VL's merger)."""

    kind: str
    merge: int = 1


@dataclass(frozen=True)
class ModuleConfig:
    """One ``configs/models/<name>.toml``: an encoder or an LLM from its published config."""

    name: str
    kind: str
    transformer: TransformerConfig
    published_params: float = 0.0
    source: str = ""
    frontend: FrontendConfig | None = None
    embedding: EmbeddingConfig | None = None
    projector: ProjectorConfig | None = None

    def block(self, name: str) -> LayerArch:
        t = self.transformer
        return LayerArch(
            name, "block", t.hidden, heads=t.heads, kv_heads=t.kv_heads or t.heads, head_dim=t.head_dim,
            ffn=t.ffn, gated_mlp=t.gated_mlp, causal=t.causal, qkv_bias=t.qkv_bias, linear_bias=t.linear_bias,
            norm=t.norm,
        )

    def layers(self) -> list[LayerArch]:
        """The module's layers without a projector (encoders) or complete (LLMs)."""
        t = self.transformer
        out: list[LayerArch] = []
        if self.kind == LLM:
            assert self.embedding is not None
            e = self.embedding
            out.append(LayerArch("model.embed_tokens", "embedding", t.hidden, vocab=e.vocab, positions=e.positions))
            out += [self.block(f"model.layers.{i}") for i in range(t.layers)]
            out.append(LayerArch("model.norm", "norm", t.hidden, norm=t.norm))
            out.append(LayerArch("lm_head", "head", t.hidden, vocab=e.vocab, tied=e.tied))
            return out
        assert self.frontend is not None
        f = self.frontend
        name = "patch_embed" if f.type == "patch" else "frontend"
        out.append(LayerArch(
            f"encoder.{name}", "frontend", t.hidden, frontend=f.type, in_channels=f.in_channels, patch=f.patch,
            temporal_patch=f.temporal_patch, kernel=f.kernel, stride=f.stride, frontend_bias=f.bias,
            positions=f.positions, cls_token=f.cls_token,
        ))
        out += [self.block(f"encoder.blocks.{i}") for i in range(t.layers)]
        if t.final_norm:
            out.append(LayerArch("encoder.norm", "norm", t.hidden, norm=t.norm))
        return out

    def module_arch(self, name: str | None = None, projector: str | None = None, out_hidden: int = 0) -> ModuleArch:
        """This module as ``name``; an encoder gets a ``projector`` into ``out_hidden`` (the
        LLM's width) unless ``projector`` is None."""
        name = name or (LLM if self.kind == LLM else self.kind)
        layers = self.layers()
        if self.kind != LLM and projector is not None:
            merge = 1
            if projector == "merger":
                if self.projector is None or self.projector.kind != "merger":
                    raise ValueError(
                        f"projector 'merger' for encoder {name!r}: {self.name}.toml has no [projector] merger "
                        "(only architectures that merge tokens, like qwen2-vl-vision, have one)"
                    )
                merge = self.projector.merge
            layers.append(LayerArch("projector", "projector", self.transformer.hidden, projector=projector,
                                    out_hidden=out_hidden, merge=merge))
        extra: dict[str, Any] = {}
        if self.frontend is not None:
            extra = {"patch": self.frontend.patch, "sample_rate": self.frontend.sample_rate,
                     "hop_length": self.frontend.hop_length}
        return ModuleArch(name, self.kind, tuple(layers), published_params=self.published_params, **extra)


def _typed(cls: type, table: Any, where: str) -> Any:
    """``cls(**table)`` with errors that name the file, the table and the key."""
    if not isinstance(table, dict):
        raise TypeError(f"{where} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(table) - set(fields)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known keys are {sorted(fields)}")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in table]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    for key, value in table.items():
        expected = fields[key].type  # a string: this module uses postponed annotations
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }.get(expected, True)
        if not ok:
            raise ValueError(f"{where} {key} = {value!r}: expected a {expected}")
    return cls(**table)


def model_config_path(name: str | Path) -> Path:
    """``configs/models/<name>.toml``, or ``name`` itself when it is a path to a TOML file."""
    p = Path(name)
    if p.suffix == ".toml":
        if not p.exists():
            raise ValueError(f"model config {str(p)!r} does not exist")
        return p
    path = MODEL_CONFIG_DIR / f"{name}.toml"
    if not path.exists():
        raise ValueError(f"unknown model config {str(name)!r}; known configs are {list_model_configs()}")
    return path


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.toml"))


def load_module_config(name: str | Path) -> ModuleConfig:
    """Parse ``configs/models/<name>.toml`` (or a path); errors name the file and the key."""
    path = model_config_path(name)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    where = path.name
    top = {"name", "kind", "published_params", "source", "transformer", "frontend", "embedding", "projector"}
    unknown = set(data) - top
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known keys are {sorted(top)}")
    kind = data.get("kind")
    if kind not in MODULE_KINDS:
        raise ValueError(f"{where}: kind = {kind!r}; choose one of {list(MODULE_KINDS)}")
    if "transformer" not in data:
        raise ValueError(f"{where} lacks the [transformer] table")
    cfg = ModuleConfig(
        name=str(data.get("name", path.stem)),
        kind=kind,
        transformer=_typed(TransformerConfig, data["transformer"], f"{where} [transformer]"),
        published_params=float(data.get("published_params", 0.0)),
        source=str(data.get("source", "")),
        frontend=_typed(FrontendConfig, data["frontend"], f"{where} [frontend]") if "frontend" in data else None,
        embedding=_typed(EmbeddingConfig, data["embedding"], f"{where} [embedding]") if "embedding" in data else None,
        projector=_typed(ProjectorConfig, data["projector"], f"{where} [projector]") if "projector" in data else None,
    )
    if kind == LLM and cfg.embedding is None:
        raise ValueError(f"{where}: an LLM needs an [embedding] table (vocab)")
    if kind != LLM and cfg.frontend is None:
        raise ValueError(f"{where}: an encoder needs a [frontend] table")
    if cfg.frontend is not None and cfg.frontend.type not in FRONTENDS:
        raise ValueError(f"{where} [frontend].type = {cfg.frontend.type!r}; choose one of {list(FRONTENDS)}")
    return cfg


def load_model_arch(
    llm: str | Path,
    encoders: Mapping[str, str | Path] | None = None,
    projector: str | Mapping[str, str] | None = None,
    freeze: Iterable[str] = (),
) -> ModelArch:
    """A multimodal model from published configs, e.g.
    ``load_model_arch(llm="llama3-70b", encoders={"vision": "vit-h-14"}, projector="mlp",
    freeze=["vision.encoder"])``.

    ``projector``: one kind for every encoder, a mapping encoder name -> kind, or None for each
    encoder's own (its ``[projector]`` table, Qwen2-VL's merger) or else ``"mlp"``.
    """
    llm_cfg = load_module_config(llm)
    if llm_cfg.kind != LLM:
        raise ValueError(f"llm = {str(llm)!r} is a {llm_cfg.kind} encoder config, not an LLM")
    width = llm_cfg.transformer.hidden
    modules: dict[str, ModuleArch] = {}
    for name, config_name in (encoders or {}).items():
        if name == LLM:
            raise ValueError("encoders may not be named 'llm': that name is the language model's")
        cfg = load_module_config(config_name)
        if cfg.kind == LLM:
            raise ValueError(f"encoders[{name!r}] = {str(config_name)!r} is an LLM config, not an encoder")
        if isinstance(projector, Mapping):
            kind = projector.get(name)
        else:
            kind = projector
        if kind is None:
            kind = cfg.projector.kind if cfg.projector is not None else "mlp"
        if kind not in PROJECTORS:
            raise ValueError(f"projector for encoder {name!r} = {kind!r}; choose one of {list(PROJECTORS)}")
        modules[name] = cfg.module_arch(name, kind, width)
    if isinstance(projector, Mapping):
        extra = set(projector) - set(modules)
        if extra:
            raise ValueError(f"projector names encoders {sorted(extra)} that are not in encoders {list(modules)}")
    modules[LLM] = llm_cfg.module_arch(LLM)
    return ModelArch(modules).with_freeze(freeze)
