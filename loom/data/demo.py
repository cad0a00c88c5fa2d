"""The bundled learnable demo dataset: shapes in images, tones in audio clips, templated text.

Every sample is a pure function of ``(config.seed, index)``: nothing is downloaded and no
global random state is touched, so any rank can produce any sample, and a run is reproducible.

The data is built to be *learnable* by a tiny MLLM and *heterogeneous* like real MLLM data:

- images of varying resolution (token counts 4..64 at the defaults) show 1 to 4 coloured shapes
  on a dark background; the caption names their count, colours and kinds, in reading order;
- audio clips of varying, short-skewed length hold 1 to 3 successive tones (low / mid / high);
  the caption names them in order;
- samples mix modalities unevenly: text only, one image, several images, audio only, image(s)
  plus audio (``DemoConfig.mix``);
- a "generate" sample (weight 0 in the default mix; for models with an image generator) asks
  for an image of ``gen_image_size`` pixels: its text describes the shapes, then a
  ``<gen_image>`` marker, and its target is that image (``Sample.targets``), so the generator
  learns to draw what the LLM read.

The captions are templates: the words that carry content (counts, colours, shapes, pitches)
can only be inferred from the image or the clip, everything else is predictable from the
template, so the loss on content words measures whether the encoders are being used.

Metadata first (docs/architecture.md principle 4): ``DemoDataset.meta(i)`` draws only the sample's
*recipe* (sizes, shapes, tones, text), never pixels or waveforms. ``__getitem__`` draws the
same recipe from the same random stream and then renders the payload, so the two always agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.data.sample import AudioMeta, GenerationMeta, ImageMeta, Sample, SampleMeta
from loom.data.demo_words import COLOURS, NUMBER_WORDS, SHAPE_CORNERS, SHAPES, TONES
from loom.data.tokenizer import AUDIO_MARKER, GEN_IMAGE_MARKER, IMAGE_MARKER, Tokenizer

SAMPLE_KINDS: tuple[str, ...] = ("text", "image", "multi_image", "audio", "image_audio", "generate")
GENERATOR = "image"  # the generator a "generate" sample asks (loom.data.collate.GENERATORS)

DEFAULT_MIX: dict[str, float] = {
    "text": 0.15,
    "image": 0.35,
    "multi_image": 0.15,
    "audio": 0.20,
    "image_audio": 0.15,
}

# Shapes are placed in distinct cells of a 2x2 grid, so at most four fit without overlapping.
_GRID = 2
_MAX_SHAPES = _GRID * _GRID


@dataclass
class DemoConfig:
    """Configuration of the demo dataset. Sizes are in pixels, durations in seconds."""

    seed: int = 0
    num_samples: int = 10_000
    # Image sides are multiples of the vision encoder's patch size, so tokens = (H/p) * (W/p).
    patch_size: int = 8
    min_image_size: int = 16
    max_image_size: int = 64
    max_shapes: int = 4
    # A "multi_image" sample has 2..max_images images; an "image_audio" one has 1..2.
    max_images: int = 4
    sample_rate: int = 8000
    min_audio_seconds: float = 0.25
    max_audio_seconds: float = 2.0
    max_tones: int = 3
    # the side of a "generate" sample's target image (the generator's image_size)
    gen_image_size: int = 16
    # Sample kind -> probability (normalised, so weights work too).
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field and how to fix it."""
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"DemoConfig.seed={self.seed!r}: use a non-negative integer")
        if self.num_samples < 1:
            raise ValueError(f"DemoConfig.num_samples={self.num_samples}: use at least 1")
        if self.patch_size < 1:
            raise ValueError(f"DemoConfig.patch_size={self.patch_size}: use a positive integer")
        p = self.patch_size
        for name in ("min_image_size", "max_image_size"):
            size = getattr(self, name)
            if size < p or size % p != 0:
                raise ValueError(
                    f"DemoConfig.{name}={size}: must be a positive multiple of "
                    f"patch_size={p}; use e.g. {max(p, round(size / p) * p)}"
                )
        if self.min_image_size > self.max_image_size:
            raise ValueError(
                f"DemoConfig.min_image_size={self.min_image_size} > max_image_size="
                f"{self.max_image_size}: swap them or raise max_image_size"
            )
        if self.min_image_size < 8:
            raise ValueError(
                f"DemoConfig.min_image_size={self.min_image_size}: shapes need at least 4 px "
                "per cell of the 2x2 layout grid; use 8 or more"
            )
        if not 1 <= self.max_shapes <= _MAX_SHAPES:
            raise ValueError(
                f"DemoConfig.max_shapes={self.max_shapes}: use 1..{_MAX_SHAPES} "
                "(shapes sit in distinct cells of a 2x2 grid)"
            )
        if self.max_images < 2:
            raise ValueError(
                f"DemoConfig.max_images={self.max_images}: multi_image samples need at least "
                "2 images; use 2 or more (or set mix['multi_image'] to 0 and keep max_images=2)"
            )
        nyquist_limit = 2 * max(TONES.values())
        if self.sample_rate <= nyquist_limit:
            raise ValueError(
                f"DemoConfig.sample_rate={self.sample_rate}: must exceed {nyquist_limit:g} Hz "
                f"to represent the highest tone ({max(TONES.values()):g} Hz); use e.g. 8000"
            )
        if not self.min_audio_seconds > 0:
            raise ValueError(
                f"DemoConfig.min_audio_seconds={self.min_audio_seconds}: use a positive duration"
            )
        if self.min_audio_seconds > self.max_audio_seconds:
            raise ValueError(
                f"DemoConfig.min_audio_seconds={self.min_audio_seconds} > max_audio_seconds="
                f"{self.max_audio_seconds}: swap them or raise max_audio_seconds"
            )
        if self.max_tones < 1:
            raise ValueError(f"DemoConfig.max_tones={self.max_tones}: use at least 1")
        if self.gen_image_size < 8:
            raise ValueError(
                f"DemoConfig.gen_image_size={self.gen_image_size}: shapes need at least 4 px per cell of the "
                "2x2 layout grid; use 8 or more (the generator's image_size)"
            )
        # Each tone needs a few periods of the low tone to be recognisable.
        shortest_tone = self.min_audio_seconds / self.max_tones
        if shortest_tone < 0.02:
            raise ValueError(
                f"DemoConfig.min_audio_seconds={self.min_audio_seconds} split over max_tones="
                f"{self.max_tones} gives {shortest_tone * 1000:.1f} ms tones; raise "
                "min_audio_seconds or lower max_tones so each tone lasts at least 20 ms"
            )
        unknown = sorted(set(self.mix) - set(SAMPLE_KINDS))
        if unknown:
            raise ValueError(
                f"DemoConfig.mix: unknown sample kinds {unknown}; "
                f"use keys from {list(SAMPLE_KINDS)}"
            )
        for kind, prob in self.mix.items():
            if not (isinstance(prob, (int, float)) and math.isfinite(prob) and prob >= 0):
                raise ValueError(
                    f"DemoConfig.mix[{kind!r}]={prob!r}: use a finite non-negative probability"
                )
        if sum(self.mix.values()) <= 0:
            raise ValueError(
                "DemoConfig.mix: probabilities sum to 0; give at least one kind a positive weight"
            )


# ---------------------------------------------------------------------------------------------
# Recipes: everything about a sample except its pixels and samples. Cheap to draw.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ShapeRecipe:
    kind: str  # "circle" | "square" | "triangle"
    colour: str
    center_y: float
    center_x: float
    radius: float


@dataclass(frozen=True)
class _ImageRecipe:
    height: int
    width: int
    shapes: tuple[_ShapeRecipe, ...]  # in reading order of their grid cells


@dataclass(frozen=True)
class _AudioRecipe:
    num_samples: int
    tones: tuple[str, ...]  # pitch words, in playing order


@dataclass(frozen=True)
class _SampleRecipe:
    kind: str
    text: str
    images: tuple[_ImageRecipe, ...]
    audios: tuple[_AudioRecipe, ...]
    targets: tuple[_ImageRecipe, ...] = ()


def _join_list(phrases: list[str]) -> str:
    """ "a", "a and b", "a , b and c" (space-separated punctuation, one token per word)."""
    if len(phrases) == 1:
        return phrases[0]
    return " , ".join(phrases[:-1]) + " and " + phrases[-1]


def _describe_image(image: _ImageRecipe) -> str:
    n = len(image.shapes)
    noun = "shape" if n == 1 else "shapes"
    items = _join_list([f"a {s.colour} {s.kind}" for s in image.shapes])
    return f"{IMAGE_MARKER} {NUMBER_WORDS[n]} {noun} : {items} ."


def _describe_audio(audio: _AudioRecipe) -> str:
    return f"{AUDIO_MARKER} " + " then ".join(f"a {t} tone" for t in audio.tones) + " ."


def _segments(text: str) -> tuple[str, ...]:
    """Segment order of a text: each marker is its own segment, runs of words are "text"."""
    segments: list[str] = []
    for word in text.split():
        if word == IMAGE_MARKER:
            segments.append("image")
        elif word == AUDIO_MARKER:
            segments.append("audio")
        elif word == GEN_IMAGE_MARKER:
            segments.append("generate")
        elif not segments or segments[-1] != "text":
            segments.append("text")
    return tuple(segments)


class DemoDataset:
    """The demo dataset: ``meta(i)`` is metadata only, ``dataset[i]`` is the full ``Sample``."""

    def __init__(self, config: DemoConfig | None = None, tokenizer: Tokenizer | None = None):
        self.config = config if config is not None else DemoConfig()
        self.config.validate()  # again: a TOML / CLI override may have changed fields since
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer()
        kinds = [k for k in SAMPLE_KINDS if self.config.mix.get(k, 0.0) > 0]
        if "generate" in kinds and not self.tokenizer.has(GEN_IMAGE_MARKER):
            raise ValueError(
                f"DemoConfig.mix['generate'] > 0 asks for images, but the tokenizer has no {GEN_IMAGE_MARKER} "
                f"token: build it with Tokenizer(extra_tokens=[{GEN_IMAGE_MARKER!r}]) (a model with an image "
                "generator), or set mix['generate'] to 0"
            )
        weights = np.array([self.config.mix[k] for k in kinds], dtype=np.float64)
        self._kinds = kinds
        self._kind_cdf = np.cumsum(weights / weights.sum())
        p = self.config.patch_size
        self._image_sides = np.arange(self.config.min_image_size, self.config.max_image_size + 1, p)

    def __len__(self) -> int:
        return self.config.num_samples

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        # A per-sample stream keyed by (seed, index): order of access never matters.
        return np.random.Generator(np.random.PCG64([self.config.seed, index]))

    # -- recipes -------------------------------------------------------------------------------

    def _draw_kind(self, rng: np.random.Generator) -> str:
        u = rng.random()
        i = int(np.searchsorted(self._kind_cdf, u, side="right"))
        return self._kinds[min(i, len(self._kinds) - 1)]

    def _draw_image(self, rng: np.random.Generator, size: int | None = None) -> _ImageRecipe:
        height = int(rng.choice(self._image_sides)) if size is None else size
        width = int(rng.choice(self._image_sides)) if size is None else size
        n = int(rng.integers(1, self.config.max_shapes + 1))
        cells = np.sort(rng.choice(_MAX_SHAPES, size=n, replace=False))
        cell_h, cell_w = height / _GRID, width / _GRID
        shapes = []
        for cell in cells:
            row, col = divmod(int(cell), _GRID)
            radius = float(rng.uniform(0.30, 0.45)) * min(cell_h, cell_w)
            # Jitter the centre but keep the shape inside its cell, so shapes never overlap.
            slack_y, slack_x = max(0.0, cell_h / 2 - radius), max(0.0, cell_w / 2 - radius)
            center_y = (row + 0.5) * cell_h + float(rng.uniform(-1, 1)) * slack_y
            center_x = (col + 0.5) * cell_w + float(rng.uniform(-1, 1)) * slack_x
            shapes.append(
                _ShapeRecipe(
                    kind=SHAPES[int(rng.integers(len(SHAPES)))],
                    colour=list(COLOURS)[int(rng.integers(len(COLOURS)))],
                    center_y=center_y,
                    center_x=center_x,
                    radius=radius,
                )
            )
        return _ImageRecipe(height=height, width=width, shapes=tuple(shapes))

    def _draw_audio(self, rng: np.random.Generator) -> _AudioRecipe:
        cfg = self.config
        # u**2 skews durations towards short clips (mean at a third of the range), as in real
        # speech data where most clips are short and a few are long.
        seconds = cfg.min_audio_seconds + (cfg.max_audio_seconds - cfg.min_audio_seconds) * (
            float(rng.random()) ** 2
        )
        num_samples = max(1, round(seconds * cfg.sample_rate))
        n = int(rng.integers(1, cfg.max_tones + 1))
        pitches = list(TONES)
        tones = tuple(pitches[int(rng.integers(len(pitches)))] for _ in range(n))
        return _AudioRecipe(num_samples=num_samples, tones=tones)

    def _draw_text_only(self, rng: np.random.Generator) -> str:
        template = int(rng.integers(3))
        if template == 0:  # arithmetic: the answer follows from the question
            a, b = (int(x) for x in rng.integers(0, 5, size=2))
            return f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]} ."
        if template == 1:  # a fact about shapes
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            return f"a {shape} has {NUMBER_WORDS[SHAPE_CORNERS[shape]]} corners ."
        start = int(rng.integers(0, 6))  # counting: start..start+3 at most, within NUMBER_WORDS
        length = int(rng.integers(3, 5))
        run = " ".join(NUMBER_WORDS[start : start + length])
        return f"count from {NUMBER_WORDS[start]} : {run} ."

    def _draw_recipe(self, rng: np.random.Generator) -> _SampleRecipe:
        kind = self._draw_kind(rng)
        images: list[_ImageRecipe] = []
        audios: list[_AudioRecipe] = []
        if kind == "text":
            return _SampleRecipe(kind, self._draw_text_only(rng), (), ())
        if kind == "generate":  # the description, then the request: the generator draws what it reads
            target = self._draw_image(rng, size=self.config.gen_image_size)
            text = _describe_image(target).replace(f"{IMAGE_MARKER} ", "", 1) + f" {GEN_IMAGE_MARKER}"
            return _SampleRecipe(kind, text, (), (), (target,))
        if kind == "image":
            images = [self._draw_image(rng)]
        elif kind == "multi_image":
            num_images = int(rng.integers(2, self.config.max_images + 1))
            images = [self._draw_image(rng) for _ in range(num_images)]
        elif kind == "audio":
            audios = [self._draw_audio(rng)]
        elif kind == "image_audio":
            images = [self._draw_image(rng) for _ in range(int(rng.integers(1, 3)))]
            audios = [self._draw_audio(rng)]
        else:  # unreachable: DemoConfig.validate rejects unknown kinds
            raise ValueError(f"unknown sample kind {kind!r}")
        parts = [_describe_image(im) for im in images]
        audio_parts = [_describe_audio(a) for a in audios]
        # Put the clip before the images half the time, so segment orders vary.
        if audio_parts and images and rng.random() < 0.5:
            parts = audio_parts + parts
        else:
            parts = parts + audio_parts
        return _SampleRecipe(kind, " ".join(parts), tuple(images), tuple(audios))

    def _meta_of(self, index: int, recipe: _SampleRecipe) -> SampleMeta:
        return SampleMeta(
            sample_id=index,
            text_tokens=len(self.tokenizer.encode(recipe.text)),
            images=tuple(ImageMeta(height=im.height, width=im.width) for im in recipe.images),
            audios=tuple(
                AudioMeta(num_samples=a.num_samples, sample_rate=self.config.sample_rate)
                for a in recipe.audios
            ),
            segments=_segments(recipe.text),
            generations=tuple(GenerationMeta(GENERATOR, t.height, t.width) for t in recipe.targets),
        )

    # -- public API ----------------------------------------------------------------------------

    def kind(self, index: int) -> str:
        """The sample's kind (a key of ``DemoConfig.mix``), from its recipe alone."""
        return self._draw_kind(self._rng(index))

    def text(self, index: int) -> str:
        """The sample's text, from its recipe alone (no payload)."""
        return self._draw_recipe(self._rng(index)).text

    def meta(self, index: int) -> SampleMeta:
        """Metadata of sample ``index`` without generating any pixels or waveforms."""
        return self._meta_of(index, self._draw_recipe(self._rng(index)))

    def __getitem__(self, index: int) -> Sample:
        rng = self._rng(index)
        # Same stream, same draws as meta(): the recipe first, then the payload's noise.
        recipe = self._draw_recipe(rng)
        images = [torch.from_numpy(_render_image(im, rng)) for im in recipe.images]
        audios = [
            torch.from_numpy(_render_audio(a, self.config.sample_rate, rng)) for a in recipe.audios
        ]
        targets = [torch.from_numpy(_render_image(t, rng)) for t in recipe.targets]
        meta = self._meta_of(index, recipe)
        return Sample(meta=meta, text=recipe.text, images=images, audios=audios, targets=targets)


# ---------------------------------------------------------------------------------------------
# Rendering: payloads from recipes (numpy, then handed to torch without a copy).
# ---------------------------------------------------------------------------------------------


def _shape_mask(shape: _ShapeRecipe, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    dy, dx, r = ys - shape.center_y, xs - shape.center_x, shape.radius
    if shape.kind == "circle":
        return dy * dy + dx * dx <= r * r
    if shape.kind == "square":
        half = 0.85 * r  # a bit smaller than the circle's bounding box: similar area
        return (np.abs(dy) <= half) & (np.abs(dx) <= half)
    # Triangle pointing up: apex at the top of the bounding box, base at the bottom; the
    # half-width grows linearly from 0 at the apex to r at the base.
    depth = (dy + r) / (2 * r)
    return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * r)


def _render_image(image: _ImageRecipe, rng: np.random.Generator) -> np.ndarray:
    """A float32 ``[3, H, W]`` image in [0, 1]: dark noisy background, the recipe's shapes."""
    h, w = image.height, image.width
    pixels = 0.06 + 0.03 * rng.standard_normal((3, h, w), dtype=np.float32)
    # Pixel centres, so a shape covers the pixels whose centre falls inside it.
    ys = (np.arange(h, dtype=np.float32) + 0.5)[:, None]
    xs = (np.arange(w, dtype=np.float32) + 0.5)[None, :]
    for shape in image.shapes:
        mask = _shape_mask(shape, ys, xs)
        colour = np.asarray(COLOURS[shape.colour], dtype=np.float32)[:, None]
        noise = rng.standard_normal((3, int(mask.sum())), dtype=np.float32)
        pixels[:, mask] = colour + 0.03 * noise
    return np.clip(pixels, 0.0, 1.0, out=pixels)


def _render_audio(audio: _AudioRecipe, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
    """A float32 clip in [-1, 1]: the tones back to back, equal lengths, with a little noise."""
    n = audio.num_samples
    clip = np.zeros(n, dtype=np.float32)
    bounds = np.linspace(0, n, len(audio.tones) + 1).round().astype(int)
    fade = max(1, int(0.01 * sample_rate))  # 10 ms ramps: no clicks, audible tone boundaries
    for pitch, start, stop in zip(audio.tones, bounds[:-1], bounds[1:]):
        length = stop - start
        if length <= 0:
            continue
        t = np.arange(length, dtype=np.float32) / sample_rate
        phase = float(rng.uniform(0, 2 * np.pi))
        amplitude = float(rng.uniform(0.4, 0.6))
        tone = amplitude * np.sin(2 * np.pi * TONES[pitch] * t + phase).astype(np.float32)
        ramp = min(fade, length // 2)
        if ramp > 0:
            envelope = np.ones(length, dtype=np.float32)
            envelope[:ramp] = np.linspace(0, 1, ramp, dtype=np.float32)
            envelope[length - ramp :] = np.linspace(1, 0, ramp, dtype=np.float32)
            tone *= envelope
        clip[start:stop] = tone
    clip += 0.02 * rng.standard_normal(n, dtype=np.float32)
    return np.clip(clip, -1.0, 1.0, out=clip)
