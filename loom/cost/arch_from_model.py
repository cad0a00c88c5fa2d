"""The `ModelArch` of a live model (`arch_from_model`): module introspection of the zoo
encoders, the Hugging Face encoders of `loom.model.hf_encoders` (`HF_ENCODER_ARCHS`) and of
Llama-layout LLMs (the zoo's or Hugging Face's), layer for layer as
`MultimodalModel.module_layers`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from loom.cost.arch import LLM, LayerArch, ModelArch, ModuleArch
from loom.model.multimodal import MultimodalModel
from loom.model.projector import MLPProjector
from loom.model.zoo import AudioEncoder, VisionEncoder
from loom.model.zoo.diffusion import DiffusionGenerator


def _trainable(module: Any) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _projector_arch(name: str, module: Any, hidden: int, trainable: bool) -> LayerArch:
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


def _hf_encoder_layers(name: str, model: MultimodalModel, own: Callable[[Any, bool], LayerArch | None],
                       hidden: int, projector_hidden: int | None = None, projector_scale: int = 1) -> tuple[LayerArch, ...]:
    """A Hugging Face encoder's layers described in order: each family's own kinds by ``own``
    (None: not one of its kinds), then what every family shares: LayerNorms of ``hidden`` and
    loom's projector (on ``projector_hidden``, seeing ``projector_scale``-merged tokens); any
    other kind has no cost description and is refused."""
    encoder = model.encoders[name].encoder
    layers = []
    for layer in model.module_layers(name):
        trainable = _trainable(layer.module)
        arch = own(layer, trainable)
        if arch is None and layer.kind == "norm":
            arch = LayerArch(layer.name, "norm", hidden, trainable)
        elif arch is None and layer.kind == "projector":
            arch = _projector_arch(layer.name, layer.module, projector_hidden or hidden, trainable)
            if projector_scale != 1:
                arch = dataclasses.replace(arch, scale=projector_scale)
        if arch is None:
            raise TypeError(f"{layer.name}: layer kind {layer.kind!r} of a {type(encoder).__name__} has no cost "
                            "description")
        layers.append(arch)
    return tuple(layers)


def _hf_vision_arch(name: str, model: MultimodalModel) -> ModuleArch:
    """A Hugging Face SigLIP / CLIP vision tower (`loom.model.hf_vision.HFVisionEncoder`), layer
    for layer: the patch embedding (SigLIP: conv with bias and a position per patch; CLIP: conv
    without bias, a class token and a position per patch and for it), CLIP's pre-norm,
    pre-norm blocks (LayerNorms, q/k/v/out and fc1/fc2 with biases, GELU MLP, attention over each
    image's tokens), SigLIP's post-norm, then the projector. Every image is resized to the
    config's ``image_size``: a fixed token count per item (`ModuleArch.item_tokens`)."""
    wrapper = model.encoders[name]
    encoder = wrapper.encoder
    cfg = encoder.config
    h, patches = cfg.hidden_size, (cfg.image_size // cfg.patch_size) ** 2

    def own(layer: Any, trainable: bool) -> LayerArch | None:
        if layer.kind == "frontend":
            return LayerArch(layer.name, "frontend", h, trainable, frontend="patch", in_channels=cfg.num_channels,
                             patch=cfg.patch_size, positions=patches + (1 if encoder.is_clip else 0),
                             cls_token=encoder.is_clip, frontend_bias=not encoder.is_clip)
        if layer.kind == "block":
            return LayerArch(layer.name, "block", h, trainable, heads=cfg.num_attention_heads,
                             kv_heads=cfg.num_attention_heads, ffn=cfg.intermediate_size, qkv_bias=True, linear_bias=True)
        return None

    layers = _hf_encoder_layers(name, model, own, h)
    return ModuleArch(name, "vision", layers, patch=cfg.patch_size, item_tokens=encoder.tokens_per_image)


def _qwen2vl_arch(name: str, model: MultimodalModel) -> ModuleArch:
    """The Qwen2-VL vision tower (`loom.model.hf_qwen2vl.Qwen2VLVisionEncoder`), layer for layer:
    the patch embedding (a bias-free conv over ``temporal_patch_size`` x ``patch_size``^2 pixels
    per patch, rotary positions: no learned rows), pre-norm blocks (fused qkv and proj, fc1 /
    fc2, all with biases; attention within each image), the merger (LayerNorm, 2x2 patches
    concatenated, an MLP to ``hidden_size``: a merging projector), then loom's projector, which
    sees the merged tokens (``scale`` = the merge side: a quarter of the patches at 2x2). Images
    are cut into ``patch_size`` patches as they reach it; a Qwen2-VL processor in front
    (``before_encoder``) resizes them first (`ModuleArch.resize`)."""
    wrapper = model.encoders[name]
    encoder = wrapper.encoder
    cfg = encoder.config
    h, m = cfg.embed_dim, cfg.spatial_merge_size

    def own(layer: Any, trainable: bool) -> LayerArch | None:
        if layer.kind == "frontend":
            return LayerArch(layer.name, "frontend", h, trainable, frontend="patch", in_channels=cfg.in_channels,
                             patch=cfg.patch_size, temporal_patch=cfg.temporal_patch_size, frontend_bias=False)
        if layer.kind == "block":
            return LayerArch(layer.name, "block", h, trainable, heads=cfg.num_heads, kv_heads=cfg.num_heads,
                             ffn=int(h * cfg.mlp_ratio), qkv_bias=True, linear_bias=True)
        if layer.kind == "head":  # the merger
            return LayerArch(layer.name, "projector", h, trainable, projector="merger", merge=m * m,
                             out_hidden=cfg.hidden_size)
        return None

    layers = _hf_encoder_layers(name, model, own, h, projector_hidden=cfg.hidden_size, projector_scale=m)
    resize = tuple(getattr(wrapper.before_encoder, "resize", ()))
    return ModuleArch(name, "vision", layers, patch=cfg.patch_size, resize=resize)


def _whisper_arch(name: str, model: MultimodalModel) -> ModuleArch:
    """The Whisper encoder (`loom.model.hf_whisper.WhisperAudioEncoder`), layer for layer: the
    two-conv front-end over ``num_mel_bins`` (kernel 3, the second with stride 2; a learned row
    per position), pre-norm blocks (q, v, out, fc1 and fc2 with biases, k without; GELU MLP), the
    final LayerNorm, then the projector. Every clip is padded or cut to the same frames: a fixed
    ``max_source_positions`` tokens per item (`ModuleArch.item_tokens`)."""
    wrapper = model.encoders[name]
    encoder = wrapper.encoder
    cfg = encoder.config
    h = cfg.d_model

    def own(layer: Any, trainable: bool) -> LayerArch | None:
        if layer.kind == "frontend":
            return LayerArch(layer.name, "frontend", h, trainable, frontend="conv1d", in_channels=cfg.num_mel_bins,
                             kernel=3, stride=2, positions=cfg.max_source_positions)
        if layer.kind == "block":
            return LayerArch(layer.name, "block", h, trainable, heads=cfg.encoder_attention_heads,
                             kv_heads=cfg.encoder_attention_heads, ffn=cfg.encoder_ffn_dim, qkv_bias=True,
                             key_bias=False, linear_bias=True)
        return None

    layers = _hf_encoder_layers(name, model, own, h)
    return ModuleArch(name, "audio", layers, item_tokens=cfg.max_source_positions)


# Hugging Face encoder adapters (loom.model.hf_encoders) -> their description, by class name
# (transformers stays optional: nothing here imports it). A family registered there adds its own.
HF_ENCODER_ARCHS: dict[str, Callable[[str, MultimodalModel], ModuleArch]] = {
    "HFVisionEncoder": _hf_vision_arch, "Qwen2VLVisionEncoder": _qwen2vl_arch, "WhisperAudioEncoder": _whisper_arch}


def _generator_arch(model: MultimodalModel, name: str) -> ModuleArch:
    """A `DiffusionGenerator` (DiT) behind its output projector, layer for layer: the projector
    from the LLM's width (``cond_tokens`` states per item), the patch front-end with the timestep
    MLP, blocks with cross-attention to the conditioning tokens, the final norm and linear (a
    1x1 conv onto each patch's pixels)."""
    wrapper = model.generators[name]
    gen = wrapper.generator
    if not isinstance(gen, DiffusionGenerator):
        raise TypeError(f"generator {name!r} ({type(gen).__name__}) has no cost description; describe the model with "
                        f"load_model_arch")
    cfg, cond = gen.config, wrapper.cond_tokens
    h, p = cfg.hidden_size, cfg.patch_size
    layers = []
    for layer in model.module_layers(name):
        trainable = _trainable(layer.module)
        if layer.kind == "projector":
            arch = _projector_arch(layer.name, layer.module, layer.module.in_features, trainable)
            layers.append(dataclasses.replace(arch, cond=cond))
        elif layer.kind == "frontend":
            layers.append(LayerArch(layer.name, "frontend", h, trainable, frontend="patch", in_channels=cfg.in_channels,
                                    patch=p, time_in=h, time_embed=h))
        elif layer.kind == "block":
            layers.append(LayerArch(layer.name, "block", h, trainable, heads=cfg.num_heads, kv_heads=cfg.num_heads,
                                    ffn=int(h * cfg.mlp_ratio), qkv_bias=True, linear_bias=True, cross=h, cond=cond))
        elif layer.kind == "head":
            layers.append(LayerArch(layer.name, "conv", cfg.in_channels * p * p, trainable, in_channels=h, kernel=1,
                                    stride=1, norm_before=True))
        else:
            raise TypeError(f"{layer.name}: generator layer kind {layer.kind!r} has no cost description")
    return ModuleArch(name, "generator", tuple(layers), patch=p, cond_tokens=cond)


def arch_from_model(model: MultimodalModel) -> ModelArch:
    """The `ModelArch` of a live model: zoo encoders (`VisionEncoder`, `AudioEncoder`) and a
    Llama-layout LLM (the zoo's or a Hugging Face one), layer for layer as
    ``model.module_layers``, each layer trainable iff any of its parameters requires grad.

    Every layer's parameter count is checked against the real module, so a model this
    function does not understand fails here rather than mis-costing silently.

    Generators: the zoo's `DiffusionGenerator` (a DiT) behind its output projector.
    """
    modules: dict[str, ModuleArch] = {}
    for name in model.module_names:
        layers: list[LayerArch] = []
        if name == LLM:
            llm = model.llm
            config = llm.config
            tied_heads = {t.second[0] for t in model.ties}  # a head tied to the embedding (loom.runtime.tied)
            for index, layer in enumerate(model.module_layers(name)):
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
                                            vocab=layer.module.out_features, tied=index in tied_heads))
                else:
                    raise TypeError(f"{layer.name}: LLM layer kind {layer.kind!r} has no cost description")
            module = ModuleArch(name, "llm", tuple(layers))
        elif name in model.generators:
            module = _generator_arch(model, name)
        else:
            wrapper = model.encoders[name]
            encoder = wrapper.encoder
            describe = HF_ENCODER_ARCHS.get(type(encoder).__name__)
            if describe is not None:
                module = describe(name, model)
            elif isinstance(encoder, VisionEncoder):
                kind, extra = "vision", {"patch": encoder.config.patch_size}
            elif isinstance(encoder, AudioEncoder):
                kind, extra = "audio", {"sample_rate": encoder.config.sample_rate, "hop_length": encoder.config.hop_length}
            else:
                raise TypeError(
                    f"encoder {name!r} ({type(encoder).__name__}) has no cost description; describe the model "
                    "with load_model_arch"
                )
            if describe is None:
                for layer in model.module_layers(name):
                    if layer.kind == "projector":
                        layers.append(_projector_arch(layer.name, layer.module, encoder.hidden_size,
                                                      _trainable(layer.module)))
                    else:
                        layers.append(_encoder_layer_arch(layer, encoder))
                module = ModuleArch(name, kind, tuple(layers), **extra)
        for arch_layer, layer in zip(module.layers, model.module_layers(name)):
            # a tied head's weight is the embedding's: counted there (LayerArch.params)
            shared = arch_layer.vocab * arch_layer.hidden if arch_layer.kind == "head" and arch_layer.tied else 0
            if arch_layer.params != _numel(layer.module) - shared:
                raise ValueError(
                    f"{layer.name}: the cost description counts {arch_layer.params} parameters but the module "
                    f"has {_numel(layer.module) - shared}; its architecture is not one arch_from_model understands"
                )
        modules[name] = module
    return ModelArch(modules)
