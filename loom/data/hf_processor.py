"""Hugging Face image processors and feature extractors as loom's encoder input step, with a
token count from metadata alone.

`load_processor` reads a local directory (``AutoImageProcessor`` / ``AutoFeatureExtractor`` /
``AutoProcessor``, local files only) and `HFProcessor.for_encoder` binds it to the encoder it
feeds (`EncoderProcessor`). Bound, it is two things (``data.processors.<encoder> = DIR``,
`loom.train.build.attach_processors`):

- the encoder's ``before_encoder`` callback (Cornstarch's call order, `loom.model.multimodal`):
  the decoded items of a microbatch (``images``: float ``[3, H, W]`` in [0, 1]; ``waveforms``:
  float ``[num_samples]``) go through the Hugging Face processor itself, and its output is the
  encoder's input. Images reach it as the 8-bit arrays their files held (`loom.data.media`
  decodes ``uint8 / 255``, so ``round(x * 255)`` is exact), as they would from Pillow;
- the token count of an item from its metadata (image size and audio length from the file
  header, `loom.data.media`), so balancing still decides before any payload moves: the
  encoder's ``num_tokens`` of the item *as the processor will make it* (`HFProcessor.item_meta`).

Per family (the rules `item_meta` implements; a test checks each against the processor's output
on every sample of the demo set):

- Qwen2-VL (``Qwen2VLImageProcessor``): ``smart_resize`` of the header's ``H x W`` to multiples
  of ``patch_size * merge_size`` within ``[min_pixels, max_pixels]`` (``size.shortest_edge`` /
  ``longest_edge``), then ``(H' / p / m) * (W' / p / m)`` tokens;
- SigLIP / CLIP (``SiglipImageProcessor``, ``CLIPImageProcessor`` with its centre crop): every
  image becomes ``size`` (SigLIP) or ``crop_size`` (CLIP), so the count is fixed: the
  encoder's ``(image_size / patch_size) ** 2`` (plus CLIP's class token);
- Whisper (``WhisperFeatureExtractor``): every clip is padded or cut to ``chunk_length``
  seconds, ``chunk_length * sampling_rate / hop_length`` log-Mel frames, and the encoder gives
  half as many tokens (``max_source_positions``) whatever the clip's duration. A clip at
  another sample rate is refused (the extractor does not resample).

A processor whose output the encoder cannot take as it is (another patch size, image size, Mel
bin count or frame count than the encoder's config) is refused when bound, naming both values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom.data.sample import AudioMeta, ImageMeta

# the Hugging Face class name (without the "Pil" / "Fast" backend suffix) -> loom's family
FAMILIES = {
    "Qwen2VLImageProcessor": "qwen2_vl",
    "SiglipImageProcessor": "siglip",
    "CLIPImageProcessor": "clip",
    "WhisperFeatureExtractor": "whisper",
}


def _family_of(obj: Any) -> str | None:
    name = type(obj).__name__
    for suffix in ("Pil", "Fast"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return FAMILIES.get(name)


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def has_processor(path: str | Path) -> bool:
    """Whether directory ``path`` holds a saved processor (what `load_processor` reads)."""
    return any((Path(path) / f).is_file() for f in PROCESSOR_FILES)


def load_processor(path: str | Path) -> "HFProcessor":
    """The image processor or feature extractor saved in directory ``path`` (``save_pretrained``:
    ``preprocessor_config.json``, or a full processor's ``processor_config.json``); a one-line
    ``ValueError`` naming the path when it cannot be read or is not of a supported family."""
    import transformers

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory; point it at a processor saved with save_pretrained")
    if not has_processor(p):
        raise ValueError(f"{str(path)!r} has no preprocessor_config.json or processor_config.json")
    kind = ""
    try:
        kind = json.loads((p / "preprocessor_config.json").read_text()).get("feature_extractor_type", "")
    except (OSError, ValueError):
        pass
    loaders = ([transformers.AutoFeatureExtractor] if kind else []) + [
        transformers.AutoImageProcessor, transformers.AutoFeatureExtractor, transformers.AutoProcessor]
    errors = []
    for loader in loaders:
        try:
            obj = loader.from_pretrained(str(p), local_files_only=True)
            break
        except (OSError, ValueError, KeyError, TypeError) as e:
            errors.append(" ".join(str(e).split())[:200])
    else:
        raise ValueError(f"{str(path)!r}: transformers cannot read a processor there ({errors[-1]})")
    # a full processor (tokenizer + image processor / feature extractor): its media half
    for part in ("image_processor", "feature_extractor"):
        if _family_of(obj) is None and _family_of(getattr(obj, part, None)) is not None:
            obj = getattr(obj, part)
    family = _family_of(obj)
    if family is None:
        raise ValueError(f"{str(path)!r} holds a {type(obj).__name__}; loom runs the image processors and feature "
                         f"extractors of {', '.join(sorted(FAMILIES))}")
    return HFProcessor(obj, family, str(path))


def smart_resize(sizes: Any, factor: int, min_pixels: int, max_pixels: int) -> np.ndarray:
    """Qwen2-VL's image size rule (Qwen2-VL §2.1, "Naive Dynamic Resolution"; its image
    processor's ``smart_resize``) for many images at once: ``sizes`` ``[N, 2]`` (height, width)
    -> ``[N, 2]``. Each side is rounded to a multiple of ``factor``; when the area then leaves
    ``[min_pixels, max_pixels]``, both sides are scaled by one factor to bring it back (down:
    floored to multiples, at least ``factor``; up: ceiled). Vectorised for the simulator and the
    balancer (`loom.cost.workload`); a test checks it against the processor's own, size by size."""
    hw = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    h, w = hw[:, 0], hw[:, 1]
    hb, wb = np.round(h / factor) * factor, np.round(w / factor) * factor  # half to even, as round()
    big = hb * wb > max_pixels
    small = ~big & (hb * wb < min_pixels)
    with np.errstate(divide="ignore", invalid="ignore"):
        down, up = np.sqrt(h * w / max_pixels), np.sqrt(min_pixels / (h * w))
        hb = np.where(big, np.maximum(factor, np.floor(h / down / factor) * factor), hb)
        wb = np.where(big, np.maximum(factor, np.floor(w / down / factor) * factor), wb)
        hb = np.where(small, np.ceil(h * up / factor) * factor, hb)
        wb = np.where(small, np.ceil(w * up / factor) * factor, wb)
    return np.stack([hb, wb], axis=1).astype(np.int64)


def _size(d: Any, *keys: str) -> tuple[int | None, ...]:
    get = d.get if isinstance(d, dict) else (lambda k, default=None: getattr(d, k, default))
    return tuple(get(k, None) for k in keys)


@dataclass
class HFProcessor:
    """A Hugging Face image processor or feature extractor (``source``) of family ``family``
    (``qwen2_vl``, ``siglip``, ``clip`` or ``whisper``), read from ``path``."""

    source: Any
    family: str
    path: str = ""

    @property
    def modality(self) -> str:
        return "audio" if self.family == "whisper" else "image"

    def __post_init__(self) -> None:
        s = self.source
        if self.family in ("siglip", "clip"):
            crop = self.family == "clip" and getattr(s, "do_center_crop", False)
            h, w = _size(s.crop_size if crop else s.size, "height", "width")
            if not (crop or getattr(s, "do_resize", False)) or h is None or w is None:
                raise ValueError(f"{self.path!r}: this {type(s).__name__} does not make images of one fixed size "
                                 f"(do_resize with size height/width{', or do_center_crop' if self.family == 'clip' else ''}); "
                                 "loom needs the fixed size its encoder takes")
            self.out_size = (int(h), int(w))
        elif self.family == "qwen2_vl":
            self.patch, self.merge = int(s.patch_size), int(s.merge_size)
            self.temporal = int(s.temporal_patch_size)
            self.min_pixels, self.max_pixels = _size(s.size, "shortest_edge", "longest_edge")

    # ---- metadata ---------------------------------------------------------------------------
    def item_meta(self, item: ImageMeta | AudioMeta) -> ImageMeta | AudioMeta:
        """The metadata of the item this processor makes of one with metadata ``item`` (the
        header's), computed as the processor resizes, crops or pads: the family rules above."""
        want = AudioMeta if self.modality == "audio" else ImageMeta
        if not isinstance(item, want):
            raise ValueError(f"processor {self.path!r} ({type(self.source).__name__}) takes "
                             f"{'audio clips' if want is AudioMeta else 'images'}, not {item}; bind it to an encoder of "
                             f"that modality")
        s = self.source
        if self.family == "whisper":
            if item.sample_rate != s.sampling_rate:
                raise ValueError(f"an audio clip at {item.sample_rate} Hz: the feature extractor {self.path!r} takes "
                                 f"{s.sampling_rate} Hz and does not resample; resample the audio or use an extractor "
                                 f"with sampling_rate = {item.sample_rate}")
            return AudioMeta(int(s.n_samples), int(s.sampling_rate))  # padded or cut to chunk_length
        if self.family in ("siglip", "clip"):
            return ImageMeta(*self.out_size)
        if not getattr(s, "do_resize", True):
            return item
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return ImageMeta(*smart_resize(item.height, item.width, factor=self.patch * self.merge,
                                       min_pixels=self.min_pixels, max_pixels=self.max_pixels))

    # ---- payloads ---------------------------------------------------------------------------
    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The encoder's inputs made from a microbatch's decoded items by the Hugging Face
        processor: ``{"images": [...]}`` -> Qwen2-VL's ``pixel_values`` and ``image_grid_thw``,
        or SigLIP / CLIP's resized, normalised ``images`` ``[3, S, S]``; ``{"waveforms": [...]}``
        -> Whisper's ``input_features`` ``[clips, mels, frames]``. Other keys pass through."""
        key = "waveforms" if self.modality == "audio" else "images"
        other = "images" if key == "waveforms" else "waveforms"
        if inputs.get(other):
            raise ValueError(f"processor {self.path!r} ({type(self.source).__name__}) got {other}; it processes {key}")
        items = inputs.get(key) or []
        out = {k: v for k, v in inputs.items() if k != key}
        if not items:  # an empty microbatch: the encoder builds its own empty input
            out[key] = []
            return out
        if self.modality == "audio":
            clips = [np.asarray(c.detach().cpu(), dtype=np.float32) for c in items]
            # the sample rate was checked on each clip's metadata (item_meta) before collation
            feats = self.source(clips, sampling_rate=self.source.sampling_rate, return_tensors="pt")
            out["input_features"] = feats["input_features"]
            return out
        arrays = [to_uint8(img) for img in items]
        got = self.source(images=arrays, return_tensors="pt", input_data_format="channels_first")
        if self.family == "qwen2_vl":
            out["pixel_values"], out["image_grid_thw"] = got["pixel_values"], got["image_grid_thw"]
        else:
            out["images"] = list(got["pixel_values"].float())
        return out

    def output_tokens(self, outputs: dict[str, Any], encoder: Any) -> list[int]:
        """Tokens per item of ``outputs`` (this processor's output for some items) that
        ``encoder`` will emit: what the metadata rule must predict."""
        if self.family == "qwen2_vl":
            return [int(t * h * w) // (self.merge ** 2) for t, h, w in outputs["image_grid_thw"].tolist()]
        if self.family == "whisper":
            return [int(f.shape[-1]) // 2 for f in outputs["input_features"]]  # conv2's stride
        return [encoder.num_tokens(ImageMeta(int(im.shape[-2]), int(im.shape[-1]))) for im in outputs["images"]]

    # ---- binding ----------------------------------------------------------------------------
    def for_encoder(self, encoder: Any) -> "EncoderProcessor":
        """This processor bound to ``encoder`` (a loom encoder: ``num_tokens`` and its config's
        sizes), after checking that the encoder takes what the processor makes."""
        s, where = self.source, f"processor {self.path!r} ({type(self.source).__name__})"
        if self.family == "qwen2_vl":
            mine = (self.patch, self.merge, self.temporal)
            theirs = tuple(getattr(encoder, k, None) for k in ("patch", "merge", "temporal"))
            if mine != theirs:
                raise ValueError(f"{where} cuts (patch_size, merge_size, temporal_patch_size) = {mine} but encoder "
                                 f"{type(encoder).__name__} takes {theirs}; use the processor saved with the model")
        elif self.family == "whisper":
            mine = (int(s.feature_size), int(s.nb_max_frames))
            theirs = (getattr(encoder, "num_mel_bins", None), getattr(encoder, "frames", None))
            if mine != theirs:
                raise ValueError(f"{where} makes (feature_size, frames) = {mine} but encoder {type(encoder).__name__} "
                                 f"takes (num_mel_bins, 2 * max_source_positions) = {theirs}; set the extractor's "
                                 "feature_size and chunk_length (frames = chunk_length * sampling_rate / hop_length) "
                                 "to match")
        else:
            side = getattr(encoder, "image_size", None)
            if self.out_size != (side, side):
                raise ValueError(f"{where} makes {self.out_size[0]}x{self.out_size[1]} images but encoder "
                                 f"{type(encoder).__name__} takes image_size = {side}; use the processor saved with "
                                 "the model")
        return EncoderProcessor(self, encoder)


@dataclass
class EncoderProcessor:
    """A processor bound to its encoder: the encoder's ``before_encoder`` callback, and the
    item -> token count rule from metadata alone (`num_tokens`)."""

    processor: HFProcessor
    encoder: Any

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return self.processor(inputs)

    def num_tokens(self, item: ImageMeta | AudioMeta) -> int:
        """The encoder's tokens for an item of (header) metadata ``item`` once processed."""
        return self.encoder.num_tokens(self.processor.item_meta(item))

    @property
    def resize(self) -> tuple[int, int, int] | tuple[()]:
        """``(factor, min_pixels, max_pixels)`` of a Qwen2-VL processor that resizes (`smart_resize`),
        for the cost model's token rule (`loom.cost.arch.ModuleArch.resize`); ``()`` otherwise (the
        other families' counts are fixed, the encoder's own ``num_tokens``)."""
        p = self.processor
        if p.family != "qwen2_vl" or not getattr(p.source, "do_resize", True):
            return ()
        return (p.patch * p.merge, int(p.min_pixels), int(p.max_pixels))


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """A float ``[3, H, W]`` image in [0, 1] as the ``[3, H, W]`` uint8 array a file held."""
    return np.rint(np.clip(image.detach().cpu().float().numpy(), 0.0, 1.0) * 255).astype(np.uint8)
