"""A tiny Whisper-style audio encoder over variable-length clips.

Front-end: log-mel spectrogram (``torch.stft`` with a Hann window and a triangular HTK mel
filterbank computed here; torchaudio is not a dependency), two 1D convolutions (the second
with stride 2) and sinusoidal positions. Then pre-norm transformer blocks over all clips of a
call packed into one sequence, with block-diagonal attention so clips stay independent, and a
final LayerNorm.

A clip's token count follows from its metadata alone (``num_tokens``), which is what lets the
planner and the balancers work before any audio is decoded (docs/architecture.md principle 4).

Layers: ``frontend``, ``blocks.0`` .. ``blocks.{n-1}``, ``norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.model.layers import Layer, run_layers
from loom.model.zoo.vision import EncoderBlock, run_encoder_block, run_norm, sinusoidal_embedding

if TYPE_CHECKING:  # loom.model sits above loom.data (docs/architecture.md): metadata types only
    from loom.data.sample import AudioMeta


@dataclass
class AudioConfig:
    """Shape of an ``AudioEncoder``; clips must be mono at ``sample_rate`` Hz."""

    sample_rate: int = 8000
    n_fft: int = 256
    hop_length: int = 128
    n_mels: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"AudioConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.hidden_size % 2 != 0:
            raise ValueError(f"AudioConfig: hidden_size={self.hidden_size} must be even for sinusoidal positions")


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """HTK mel scale."""
    return 2595.0 * torch.log10(1.0 + hz / 700.0)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters, centres equally spaced on the HTK mel scale
    between 0 Hz and the Nyquist frequency; each filter peaks at 1 on its centre."""
    n_freqs = n_fft // 2 + 1
    # the Nyquist edge is a Python number (device="cpu" even under a meta device context)
    bin_hz = torch.linspace(0.0, sample_rate / 2, n_freqs, dtype=torch.float64)
    mel_points = torch.linspace(0.0, float(hz_to_mel(torch.tensor(sample_rate / 2.0, device="cpu"))), n_mels + 2, dtype=torch.float64)
    edges_hz = mel_to_hz(mel_points)  # n_mels + 2 edges: filter m spans edges[m] .. edges[m + 2]
    lower, centre, upper = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bin_hz[None, :] - lower) / (centre - lower)
    falling = (upper - bin_hz[None, :]) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).to(torch.float32)


class AudioFrontend(nn.Module):
    """Waveform -> log-mel -> conv(k3) + GELU -> conv(k3, stride 2) + GELU -> + positions."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.n_fft = config.n_fft
        self.hop_length = config.hop_length
        self.n_mels = config.n_mels
        self.conv1 = nn.Conv1d(config.n_mels, config.hidden_size, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size=3, stride=2, padding=1)
        self.sample_rate = config.sample_rate
        # Derived from the config, so not saved in checkpoints.
        self.register_buffer(
            "mel_filters", mel_filterbank(config.sample_rate, config.n_fft, config.n_mels), persistent=False
        )

    def reset_buffers(self) -> None:
        """Recompute the filterbank (after ``to_empty``; `loom.model.materialise`)."""
        with torch.device(self.mel_filters.device):
            filters = mel_filterbank(self.sample_rate, self.n_fft, self.n_mels)
        self.mel_filters.copy_(filters)

    def log_mel(self, waveform: torch.Tensor) -> torch.Tensor:
        """``[num_samples] -> [n_mels, 1 + num_samples // hop_length]``, computed in fp32."""
        waveform = waveform.to(torch.float32)
        window = torch.hann_window(self.n_fft, device=waveform.device)
        # center=True gives 1 + num_samples // hop frames; zero ("constant") padding instead of
        # the default reflection so that clips shorter than n_fft / 2 work too.
        spectrum = torch.stft(
            waveform,
            self.n_fft,
            hop_length=self.hop_length,
            window=window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        power = spectrum.abs() ** 2
        mel = self.mel_filters.to(device=power.device, dtype=torch.float32) @ power
        return torch.log(mel + 1e-6)

    def forward(self, waveforms: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        weight = self.conv1.weight
        if waveforms:
            # One clip at a time: the convolutions' zero padding must not see a neighbouring clip.
            features = []
            for wav in waveforms:
                mel = self.log_mel(wav).to(weight.dtype).unsqueeze(0)  # [1, n_mels, frames]
                h = F.gelu(self.conv2(F.gelu(self.conv1(mel))))  # [1, hidden, tokens]
                features.append(h.squeeze(0).transpose(0, 1))
            x = torch.cat(features, dim=0)
        else:
            # A batch of zero clips still runs the convolutions, so the output has a grad_fn.
            empty = weight.new_zeros(0, self.n_mels, 1)
            x = F.gelu(self.conv2(F.gelu(self.conv1(empty)))).transpose(1, 2).reshape(0, weight.shape[0])
        return x + positions.to(x.dtype)


class AudioEncoder(nn.Module):
    """Encoder of variable-length mono clips, packed into one sequence.

    Inputs ``{"waveforms": list[Tensor[num_samples]]}``; output ``[N_total, hidden_size]``: the
    tokens of clip 0, then those of clip 1, ... (``num_tokens`` of each clip).
    """

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.frontend = AudioFrontend(config)
        self.blocks = nn.ModuleList(
            EncoderBlock(config.hidden_size, config.num_heads, config.mlp_ratio, config.norm_eps)
            for _ in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    def _tokens_for_samples(self, num_samples: int) -> int:
        frames = 1 + num_samples // self.config.hop_length  # torch.stft with center=True
        return (frames - 1) // 2 + 1  # conv2: kernel 3, stride 2, padding 1

    def num_tokens(self, meta: AudioMeta) -> int:
        """Exact output length of a clip, from its metadata alone."""
        if meta.sample_rate != self.config.sample_rate:
            raise ValueError(
                f"audio clip at {meta.sample_rate} Hz, but the audio encoder expects "
                f"{self.config.sample_rate} Hz; resample the clip"
            )
        return self._tokens_for_samples(meta.num_samples)

    def context(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Validated clips, per-clip sinusoidal positions and per-clip frame counts (the
        attention segments)."""
        waveforms: list[torch.Tensor] = list(inputs["waveforms"])
        for i, wav in enumerate(waveforms):
            if wav.dim() != 1:
                raise ValueError(f"waveforms[{i}] has shape {tuple(wav.shape)}; expected a mono clip [num_samples]")
        # With no items there is no tensor to take the device from, and on a later pipeline
        # stage this module's own weights may be released (meta): the caller may say where.
        device = waveforms[0].device if waveforms else inputs.get("device", self.frontend.conv1.weight.device)
        lengths = [self._tokens_for_samples(wav.shape[0]) for wav in waveforms]
        # Positions restart at 0 for every clip.
        positions_ids = (
            torch.cat([torch.arange(n, device=device) for n in lengths])
            if lengths
            else torch.zeros(0, dtype=torch.long, device=device)
        )
        return {
            "waveforms": waveforms,
            "positions": sinusoidal_embedding(positions_ids, self.hidden_size),
            "lengths": lengths,
        }

    def layers(self) -> list[Layer]:
        result = [
            Layer(
                "frontend",
                self.frontend,
                lambda x, ctx: self.frontend(ctx["waveforms"], ctx["positions"]),
                kind="frontend",
            )
        ]
        for i, block in enumerate(self.blocks):
            result.append(Layer(f"blocks.{i}", block, partial(run_encoder_block, block), kind="block"))
        result.append(Layer("norm", self.norm, partial(run_norm, self.norm), kind="norm"))
        return result

    def forward(self, **inputs: Any) -> torch.Tensor:
        return run_layers(self.layers(), None, self.context(inputs))
