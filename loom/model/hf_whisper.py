"""The Whisper encoder as a loom encoder: `WhisperAudioEncoder` wraps an unmodified
``WhisperEncoder`` (Whisper, Radford et al. 2022, §2.3 "Model": two convolutions over the
log-Mel spectrogram, the second with stride 2, sinusoidal positions, pre-norm Transformer
blocks, a final layer norm) and gives it the layer contract (`loom.model.layers`) and
``num_tokens``.

Inputs of ``context``: ``input_features``, ``[clips, num_mel_bins, 2 * max_source_positions]``
log-Mel features as Whisper's feature extractor makes them (`loom.data.hf_processor`: every
clip padded or cut to the feature extractor's ``chunk_length``). ``WhisperEncoder.forward``
accepts exactly ``2 * max_source_positions`` frames and refuses other lengths, so every clip
gives the same count: ``max_source_positions`` tokens (1500 for 30 s at Whisper's scale),
whatever its duration. Raw ``waveforms`` are refused: the log-Mel parameters (sample rate,
FFT, hop) are the feature extractor's, not the model config's.

Layers (``model.`` and the path inside the HF model): ``model`` (front-end: ``conv1``,
``conv2`` and ``embed_positions``, held by one container so that their parameters keep the
model's names), ``layers.<i>`` (block), ``layer_norm`` (norm; the output packed as ``[clips x
positions, d_model]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, run_layers

MODEL_TYPE = "whisper"


def whisper_encoder_from_config(config: Any) -> "WhisperAudioEncoder":
    """The loom encoder of a Whisper config (its encoder half; the decoder is not built), random
    init, built where the caller's device context says."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    if getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(f"model_type {getattr(config, 'model_type', None)!r} is not a Whisper config")
    return WhisperAudioEncoder(WhisperEncoder(config))


class _FrontEnd(nn.Module):
    """``conv1``, ``conv2`` and ``embed_positions`` of a ``WhisperEncoder`` under their own names:
    a container for one layer (not registered in the adapter, so nothing is counted twice)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.conv1, self.conv2, self.embed_positions = encoder.conv1, encoder.conv2, encoder.embed_positions


class WhisperAudioEncoder(nn.Module):
    """A ``WhisperEncoder`` with loom's layer contract; its output is the ``last_hidden_state``
    of every clip, packed as ``[clips x max_source_positions, d_model]``."""

    needs_processor = True  # it takes log-Mel features: a feature extractor makes them (loom.data.hf_processor)

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        if getattr(config, "model_type", None) != MODEL_TYPE or not hasattr(model, "conv1"):
            raise ValueError(f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) is not a "
                             "Whisper encoder (WhisperEncoder)")
        # WhisperEncoder.forward draws dropout and LayerDrop from the global RNG, which a pipeline
        # does not replay the same way: refused rather than reproduced approximately
        refused = [f"{name} = {getattr(config, name)}" for name in
                   ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop")
                   if getattr(config, name, 0.0)]
        if getattr(model, "gradient_checkpointing", False):
            refused.append("gradient checkpointing")
        if refused:
            raise ValueError(f"the Whisper encoder adapter does not reproduce {', '.join(refused)}; set them to 0")
        self.model = model
        self.config = config
        self.hidden_size: int = config.d_model
        self.positions: int = config.max_source_positions
        self.frames: int = config.max_source_positions * model.conv1.stride[0] * model.conv2.stride[0]
        self.num_mel_bins: int = config.num_mel_bins
        # one container for the life of the adapter: runtimes tell a stage's layers apart by
        # module identity (loom.runtime.stage.build_stages); not registered, so not counted twice
        object.__setattr__(self, "_frontend", _FrontEnd(model))

    def num_tokens(self, item: Any) -> int:
        """Every clip is padded or cut to ``2 * max_source_positions`` frames: a fixed count."""
        return self.positions

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if "input_features" not in inputs:
            if inputs.get("waveforms"):
                raise ValueError("the Whisper encoder takes log-Mel input_features, not waveforms: set "
                                 "data.processors.<encoder> to a Whisper feature extractor directory "
                                 "(loom.data.hf_processor)")
            features = torch.zeros(0, self.num_mel_bins, self.frames)
        else:
            features = inputs["input_features"]
        if features.dim() != 3 or tuple(features.shape[1:]) != (self.num_mel_bins, self.frames):
            raise ValueError(f"input_features of shape {tuple(features.shape)}: the Whisper encoder takes "
                             f"[clips, num_mel_bins = {self.num_mel_bins}, 2 * max_source_positions = {self.frames}]; "
                             "use a feature extractor with that feature_size and chunk_length")
        weight = self.model.layer_norm.weight
        device = inputs.get("device", weight.device) if weight.is_meta else weight.device
        return {"input_features": features.to(device)}

    def layers(self) -> list[Layer]:
        enc = self.model

        def embed(x: Any, ctx: dict[str, Any]) -> torch.Tensor:
            feats = ctx["input_features"].to(enc.conv1.weight.dtype)
            h = F.gelu(enc.conv1(feats))
            h = F.gelu(enc.conv2(h)).permute(0, 2, 1)
            positions = torch.arange(enc.embed_positions.num_embeddings, device=h.device)
            return h + enc.embed_positions(positions)

        def block(layer: nn.Module):
            def run(x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
                if x.shape[0] == 0:  # no clips: nothing to attend
                    return x.clone()
                out = layer(x, None)
                return out[0] if isinstance(out, tuple) else out
            return run

        return ([Layer("model", self._frontend, embed, kind="frontend")]
                + [Layer(f"model.layers.{i}", layer, block(layer)) for i, layer in enumerate(enc.layers)]
                + [Layer("model.layer_norm", enc.layer_norm, lambda x, ctx: enc.layer_norm(x).flatten(0, 1),
                         kind="norm")])

    def init_layer_weights(self, module: nn.Module) -> None:
        """The model's own ``_init_weights``, children first; the front-end's positions get
        Whisper's sinusoids, as ``_init_weights`` gives them on the whole ``WhisperEncoder``."""
        from transformers.models.whisper.modeling_whisper import sinusoids

        for sub in reversed(list(module.modules())):
            self.model._init_weights(sub)
        if isinstance(module, _FrontEnd):
            with torch.no_grad():
                module.embed_positions.weight.copy_(sinusoids(*module.embed_positions.weight.shape))

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))
