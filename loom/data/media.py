"""Image and audio files: sizes from headers, payloads decoded, and the demo's tensors encoded.

Headers first (docs/architecture.md principle 4): `image_size` asks Pillow for the size, which
it reads from the file's header without decoding a pixel; `audio_length` asks soundfile
(libsndfile) for the frame count and rate, from the header. `decode_image` / `decode_audio`
then decode, and return what `loom.data.sample.Sample` holds: float32 ``[3, H, W]`` in [0, 1]
(RGB, 8 bits per channel: ``uint8 / 255``), float32 ``[num_samples]`` in [-1, 1] (mono: several
channels are averaged; 16-bit PCM reads as ``int16 / 32768``).

Exactness: a PNG holds 8-bit pixels and a 16-bit WAV 16-bit samples, so the demo's float32
payloads cannot round-trip as they are. The writers (`encode_png`, `encode_wav`) store the
nearest representable values, and `quantise_image` / `quantise_audio` give, as tensors, exactly
what reading those files back returns (the same float32 arithmetic), so a written set equals
the demo set after quantisation, bit for bit (tests/test_data_formats.py).

Every failure is a `DataError`: one line naming the file and what to do.
"""

from __future__ import annotations

import io
from typing import BinaryIO

import numpy as np
import soundfile
import torch
from PIL import Image

IMAGE_LEVELS = 255  # 8-bit RGB
AUDIO_SCALE = 32768  # 16-bit PCM: int16 / 32768 in [-1, 1), a power of two, so exact in float32


class DataError(ValueError):
    """A sample that cannot be read: a missing or corrupt file, or a record that contradicts
    itself. The message names the sample and the file (one line)."""


def image_size(file: BinaryIO, name: str) -> tuple[int, int]:
    """``(height, width)`` of the image in ``file`` from its header alone (no pixel decoded);
    ``name`` is the file's name for the error."""
    try:
        with Image.open(file) as im:
            width, height = im.size
    # Pillow's UnidentifiedImageError is an OSError; DecompressionBombError guards absurd sizes
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"image file {name} has no readable image header ({_one_line(e)})") from e
    return height, width


def decode_image(file: BinaryIO, name: str) -> torch.Tensor:
    """The image in ``file`` as float32 ``[3, H, W]`` in [0, 1] (converted to RGB)."""
    try:
        with Image.open(file) as im:
            im.load()  # decodes every pixel: a truncated or corrupt stream fails here
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"image file {name} does not decode ({_one_line(e)})") from e
    return _image_from_uint8(rgb.transpose(2, 0, 1))


def audio_length(file: BinaryIO, name: str) -> tuple[int, int]:
    """``(num_samples, sample_rate)`` of the clip in ``file`` from its header alone."""
    try:
        info = soundfile.info(file)
    except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError) as e:
        raise DataError(f"audio file {name} has no readable audio header ({_one_line(e)})") from e
    return int(info.frames), int(info.samplerate)


def decode_audio(file: BinaryIO, name: str) -> tuple[torch.Tensor, int]:
    """The clip in ``file`` as float32 ``[num_samples]`` in [-1, 1] (channels averaged) and its
    sample rate."""
    try:
        data, rate = soundfile.read(file, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError) as e:
        raise DataError(f"audio file {name} does not decode ({_one_line(e)})") from e
    clip = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32)), int(rate)


# ---- writing: what a PNG / 16-bit WAV can hold ---------------------------------------------------


def _image_to_uint8(image: torch.Tensor) -> np.ndarray:
    """``[3, H, W]`` float in [0, 1] -> ``[3, H, W]`` uint8, nearest level."""
    x = np.clip(image.detach().cpu().numpy().astype(np.float32), 0.0, 1.0)
    return np.rint(x * IMAGE_LEVELS).astype(np.uint8)


def _image_from_uint8(levels: np.ndarray) -> torch.Tensor:
    # the one float conversion both the reader and `quantise_image` use, so they agree bit for bit
    return torch.from_numpy(np.ascontiguousarray(levels).astype(np.float32) / np.float32(IMAGE_LEVELS))


def _audio_to_int16(clip: torch.Tensor) -> np.ndarray:
    x = clip.detach().cpu().numpy().astype(np.float64)
    return np.clip(np.rint(x * AUDIO_SCALE), -AUDIO_SCALE, AUDIO_SCALE - 1).astype(np.int16)


def quantise_image(image: torch.Tensor) -> torch.Tensor:
    """What `decode_image` returns for ``encode_png(image)``: 8-bit levels as float32."""
    return _image_from_uint8(_image_to_uint8(image))


def quantise_audio(clip: torch.Tensor) -> torch.Tensor:
    """What `decode_audio` returns for ``encode_wav(clip, rate)``: 16-bit levels as float32."""
    return torch.from_numpy(_audio_to_int16(clip).astype(np.float32) / np.float32(AUDIO_SCALE))


def encode_png(image: torch.Tensor) -> bytes:
    """A float ``[3, H, W]`` image in [0, 1] as PNG bytes (8-bit RGB, nearest level)."""
    buf = io.BytesIO()
    Image.fromarray(_image_to_uint8(image).transpose(1, 2, 0), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def encode_wav(clip: torch.Tensor, sample_rate: int) -> bytes:
    """A float ``[num_samples]`` clip in [-1, 1] as mono 16-bit PCM WAV bytes (nearest level)."""
    buf = io.BytesIO()
    soundfile.write(buf, _audio_to_int16(clip), sample_rate, subtype="PCM_16", format="WAV")
    return buf.getvalue()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
