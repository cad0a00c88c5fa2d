"""Architectures from published configurations: the TOML files in ``configs/models/`` (one per
encoder, LLM or generator, sources cited in each), loaded into typed tables (`ModuleConfig`)
and assembled into a `ModelArch` with projectors and a freeze list (`load_model_arch`), so the
simulator and the planner can cost models too large to build. A generator is a latent U-Net
(``[unet]``, Stable Diffusion's layout: `UNetConfig`) behind an output projector from the LLM."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.cost.arch import FRONTENDS, LLM, MODULE_KINDS, PROJECTORS, LayerArch, ModelArch, ModuleArch

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


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
class UNetConfig:
    """The ``[unet]`` table of a generator: a latent diffusion U-Net (diffusers'
    ``UNet2DConditionModel`` layout, `unet_layers`)."""

    in_channels: int
    out_channels: int
    vae_factor: int
    block_out_channels: list
    down_attention: list
    up_attention: list
    layers_per_block: int
    heads: list
    cross_attention_dim: int
    time_embed: int
    cond_tokens: int

    def check(self, where: str) -> None:
        n = len(self.block_out_channels)
        for key in ("down_attention", "up_attention", "heads"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"{where} {key} has {len(getattr(self, key))} entries but block_out_channels has {n}; "
                                 f"give one per resolution level")
        for key in ("in_channels", "out_channels", "vae_factor", "layers_per_block", "cross_attention_dim",
                    "time_embed", "cond_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{where} {key} = {getattr(self, key)} must be at least 1")
        bad = [c for c, h in zip(self.block_out_channels, self.heads) if h < 1 or c % h]
        if bad:
            raise ValueError(f"{where} heads {self.heads} must divide block_out_channels {self.block_out_channels}")


def unet_layers(u: UNetConfig) -> list[LayerArch]:
    """A U-Net's layers in diffusers' order, each at its resolution (``scale``): the input conv
    (with the timestep MLP), per level ``layers_per_block`` residual blocks each followed by a
    spatial transformer where the level attends, and a stride-2 downsampler but at the last
    level; the middle (residual, transformer, residual); per level upwards ``layers_per_block +
    1`` residual blocks over the concatenated skip, transformers, and a 2x upsampler but at the
    top; the output norm and conv."""
    layers: list[LayerArch] = []
    c0 = u.block_out_channels[0]
    layers.append(LayerArch("unet.conv_in", "conv", c0, in_channels=u.in_channels, kernel=3, stride=1, time_in=c0,
                            time_embed=u.time_embed))

    def resblock(name: str, c_in: int, c_out: int, scale: int) -> LayerArch:
        return LayerArch(name, "resblock", c_out, in_channels=c_in, temb=u.time_embed, scale=scale)

    def transformer(name: str, c: int, heads: int, scale: int) -> LayerArch:
        # BasicTransformerBlock: self-attention, cross-attention, GEGLU feed-forward (4c), LayerNorms;
        # linear proj_in / proj_out and a GroupNorm around it; only the output projections and FF have biases
        return LayerArch(name, "block", c, heads=heads, kv_heads=heads, ffn=4 * c, gated_mlp=True, linear_bias=True,
                         cross=u.cross_attention_dim, cond=u.cond_tokens, proj_io=True, scale=scale)

    skips, c, scale, n = [c0], c0, 1, len(u.block_out_channels)
    for i, out in enumerate(u.block_out_channels):
        for j in range(u.layers_per_block):
            layers.append(resblock(f"unet.down_blocks.{i}.resnets.{j}", c, out, scale))
            c = out
            if u.down_attention[i]:
                layers.append(transformer(f"unet.down_blocks.{i}.attentions.{j}", c, u.heads[i], scale))
            skips.append(c)
        if i < n - 1:
            layers.append(LayerArch(f"unet.down_blocks.{i}.downsamplers.0", "conv", c, in_channels=c, kernel=3, stride=2,
                                    scale=scale))
            skips.append(c)
            scale *= 2
    layers += [resblock("unet.mid_block.resnets.0", c, c, scale),
               transformer("unet.mid_block.attentions.0", c, u.heads[-1], scale),
               resblock("unet.mid_block.resnets.1", c, c, scale)]
    for i, out in enumerate(reversed(u.block_out_channels)):
        level = n - 1 - i
        for j in range(u.layers_per_block + 1):
            layers.append(resblock(f"unet.up_blocks.{i}.resnets.{j}", c + skips.pop(), out, scale))
            c = out
            if u.up_attention[i]:
                layers.append(transformer(f"unet.up_blocks.{i}.attentions.{j}", c, u.heads[level], scale))
        if i < n - 1:
            layers.append(LayerArch(f"unet.up_blocks.{i}.upsamplers.0", "conv", c, in_channels=c, kernel=3, stride=1,
                                    upsample=True, scale=scale))
            scale //= 2
    layers.append(LayerArch("unet.conv_out", "conv", u.out_channels, in_channels=c, kernel=3, stride=1,
                            norm_before=True))
    return layers


@dataclass(frozen=True)
class ModuleConfig:
    """One ``configs/models/<name>.toml``: an encoder or an LLM from its published config."""

    name: str
    kind: str
    transformer: TransformerConfig | None
    published_params: float = 0.0
    source: str = ""
    frontend: FrontendConfig | None = None
    embedding: EmbeddingConfig | None = None
    projector: ProjectorConfig | None = None
    unet: UNetConfig | None = None

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

    def generator_arch(self, name: str, projector: str, llm_width: int) -> ModuleArch:
        """This generator as ``name``, behind a ``projector`` from the LLM's ``llm_width`` into its
        conditioning width (``cond_tokens`` states per item)."""
        u = self.unet
        assert u is not None
        project = LayerArch("projector", "projector", llm_width, projector=projector, out_hidden=u.cross_attention_dim,
                            cond=u.cond_tokens)
        return ModuleArch(name, "generator", (project, *unet_layers(u)), patch=u.vae_factor, cond_tokens=u.cond_tokens,
                          published_params=self.published_params)

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
                        "(only architectures that merge tokens, like qwen2-vl-vision, have one); choose 'mlp' or "
                        "'linear' for it"
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
        raise TypeError(f"{where} must be a table; write it as a [table] of key = value lines (see configs/models/)")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(table) - set(fields)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known keys are {sorted(fields)}: remove or "
                         f"rename them")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in table]
    if missing:
        raise ValueError(f"{where} lacks {missing}; add them (every table's keys are in configs/models/llama3-8b.toml "
                         f"and vit-h-14.toml)")
    for key, value in table.items():
        expected = fields[key].type  # a string: this module uses postponed annotations
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }.get(expected, True)
        if not ok:
            raise ValueError(f"{where} {key} = {value!r}: expected a {expected}; write the value as one")
    return cls(**table)


def model_config_path(name: str | Path) -> Path:
    """``configs/models/<name>.toml``, or ``name`` itself when it is a path to a TOML file."""
    p = Path(name)
    if p.suffix == ".toml":
        if not p.exists():
            raise ValueError(f"model config {str(p)!r} does not exist; give the path of a TOML file in the format of "
                             f"configs/models/, or one of the names {list_model_configs()}")
        return p
    path = MODEL_CONFIG_DIR / f"{name}.toml"
    if not path.exists():
        raise ValueError(f"unknown model config {str(name)!r}; known configs are {list_model_configs()}: use one of "
                         f"them, the path of a .toml file, or add {name}.toml to {MODEL_CONFIG_DIR}")
    return path


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.toml"))


def load_module_config(name: str | Path) -> ModuleConfig:
    """Parse ``configs/models/<name>.toml`` (or a path); errors name the file and the key."""
    path = model_config_path(name)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    where = path.name
    top = {"name", "kind", "published_params", "source", "transformer", "frontend", "embedding", "projector", "unet"}
    unknown = set(data) - top
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known keys are {sorted(top)}: remove or rename "
                         f"them")
    kind = data.get("kind")
    if kind not in MODULE_KINDS:
        raise ValueError(f"{where}: kind = {kind!r} is not a module kind; set kind to one of {list(MODULE_KINDS)}")
    if kind == "generator":
        if "unet" not in data:
            raise ValueError(f"{where}: a generator needs a [unet] table; add one (see configs/models/sd21-unet.toml)")
        unet = _typed(UNetConfig, data["unet"], f"{where} [unet]")
        unet.check(f"{where} [unet]")
        return ModuleConfig(name=str(data.get("name", path.stem)), kind=kind, transformer=None,
                            published_params=float(data.get("published_params", 0.0)),
                            source=str(data.get("source", "")), unet=unet)
    if "transformer" not in data:
        raise ValueError(f"{where} lacks the [transformer] table; add one (hidden, layers, heads, ...: see "
                         f"configs/models/llama3-8b.toml)")
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
        raise ValueError(f"{where}: an LLM needs an [embedding] table; add one with its vocab (see "
                         f"configs/models/llama3-8b.toml)")
    if kind != LLM and cfg.frontend is None:
        raise ValueError(f"{where}: an encoder needs a [frontend] table; add one (type = \"patch\" or \"conv1d\": see "
                         f"configs/models/vit-h-14.toml)")
    if cfg.frontend is not None and cfg.frontend.type not in FRONTENDS:
        raise ValueError(f"{where} [frontend].type = {cfg.frontend.type!r} is unknown; set it to one of "
                         f"{list(FRONTENDS)}")
    return cfg


def load_model_arch(
    llm: str | Path,
    encoders: Mapping[str, str | Path] | None = None,
    projector: str | Mapping[str, str] | None = None,
    freeze: Iterable[str] = (),
    generators: Mapping[str, str | Path] | None = None,
) -> ModelArch:
    """A multimodal model from published configs, e.g.
    ``load_model_arch(llm="llama3-70b", encoders={"vision": "vit-h-14"}, projector="mlp",
    freeze=["vision.encoder"], generators={"image": "sd21-unet"})``.

    ``projector``: one kind for every encoder and generator, a mapping module name -> kind, or
    None for each encoder's own (its ``[projector]`` table, Qwen2-VL's merger) or else ``"mlp"``.
    """
    llm_cfg = load_module_config(llm)
    if llm_cfg.kind != LLM:
        raise ValueError(f"llm = {str(llm)!r} is a {llm_cfg.kind} encoder config, not an LLM; name an LLM config "
                         f"(kind = \"llm\") there and list {str(llm)!r} under encoders")
    width = llm_cfg.transformer.hidden
    modules: dict[str, ModuleArch] = {}
    for name, config_name in (encoders or {}).items():
        if name == LLM:
            raise ValueError("encoders may not be named 'llm': that name is the language model's; rename the encoder "
                             "(e.g. 'vision')")
        cfg = load_module_config(config_name)
        if cfg.kind in (LLM, "generator"):
            raise ValueError(f"encoders[{name!r}] = {str(config_name)!r} is an {cfg.kind} config, not an encoder; name "
                             f"an encoder config (kind vision or audio) there")
        if isinstance(projector, Mapping):
            kind = projector.get(name)
        else:
            kind = projector
        if kind is None:
            kind = cfg.projector.kind if cfg.projector is not None else "mlp"
        if kind not in PROJECTORS:
            raise ValueError(f"projector for encoder {name!r} = {kind!r} is unknown; choose one of {list(PROJECTORS)}")
        modules[name] = cfg.module_arch(name, kind, width)
    modules[LLM] = llm_cfg.module_arch(LLM)
    for name, config_name in (generators or {}).items():
        if name in modules:
            raise ValueError(f"generators[{name!r}]: the model already has a module {name!r}; give the generator its "
                             f"own name (e.g. 'image')")
        cfg = load_module_config(config_name)
        if cfg.kind != "generator":
            raise ValueError(f"generators[{name!r}] = {str(config_name)!r} is a {cfg.kind} config, not a generator; "
                             f"name a generator config (kind = \"generator\", e.g. sd21-unet) there")
        kind = (projector.get(name) if isinstance(projector, Mapping) else projector) or "mlp"
        if kind not in ("linear", "mlp"):
            raise ValueError(f"projector for generator {name!r} = {kind!r}: choose 'linear' or 'mlp'")
        modules[name] = cfg.generator_arch(name, kind, width)
    if isinstance(projector, Mapping):
        extra = set(projector) - set(modules)
        if extra:
            raise ValueError(f"projector names modules {sorted(extra)} that the model does not have ({list(modules)}); "
                             f"name only those")
    return ModelArch(modules).with_freeze(freeze)
