"""Metadata-only samples at real-model scale, for planning and simulation.

The simulator and the planners decide on metadata (docs/architecture.md principle 4), so to plan a run of
Llama-3-70B + ViT-H/14 on 1024 GPUs they need the *shape* of the data, not pixels: how many
images of what size, how long the audio, how many text tokens. `SyntheticMetadata` draws such
`SampleMeta` deterministically per ``(seed, index)`` from a named mix of sample kinds whose
modality ratios are as skewed as real MLLM data (a caption set is one image and 20-60 words, an
interleaved document has several images and hundreds of tokens, some samples are text only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loom.data.sample import AudioMeta, GenerationMeta, ImageMeta, SampleMeta


@dataclass(frozen=True)
class SampleKind:
    """One kind of sample: counts and sizes are drawn uniformly in the given inclusive ranges,
    text length log-normally around ``text_median`` tokens (clipped to ``text_range``)."""

    images: tuple[int, int] = (0, 0)
    image_side: tuple[int, int] = (224, 448)  # pixels, rounded down to a multiple of the patch
    audios: tuple[int, int] = (0, 0)
    audio_seconds: tuple[float, float] = (1.0, 30.0)
    text_median: int = 64
    text_sigma: float = 0.6
    text_range: tuple[int, int] = (8, 4096)
    generations: tuple[int, int] = (0, 0)  # images the sample asks a generator for (DistTrain, disttrain.md §1)


MIXES: dict[str, dict[str, tuple[float, SampleKind]]] = {
    # LLaVA-style instruction data: mostly one image with a short exchange, some text only.
    "llava": {
        "caption": (0.55, SampleKind(images=(1, 1), text_median=48)),
        "conversation": (0.30, SampleKind(images=(1, 1), text_median=320, text_sigma=0.7)),
        "text": (0.15, SampleKind(text_median=400, text_sigma=0.8)),
    },
    # The skewed mixes of the balancing benchmarks (benchmarks/balance_quality.py), each skewed
    # in its own way (tests/test_sim_balance.py checks max / mean encoder tokens per sample):
    # caption-like: one image and a few words, encoder-heavy, with a high-resolution tail.
    "caption": {
        "caption": (0.9, SampleKind(images=(1, 1), text_median=32, text_sigma=0.4)),
        "hires_caption": (0.1, SampleKind(images=(1, 1), image_side=(448, 896), text_median=48, text_sigma=0.4)),
    },
    # multi-image: two to six images per sample next to single-image ones.
    "multi_image": {
        "multi": (0.7, SampleKind(images=(2, 6), text_median=200)),
        "single": (0.3, SampleKind(images=(1, 1), text_median=80)),
    },
    # audio-heavy: long speech clips, a few with an image, some text only.
    "audio_heavy": {
        "speech": (0.6, SampleKind(audios=(1, 1), audio_seconds=(5.0, 30.0), text_median=120)),
        "speech_image": (0.2, SampleKind(images=(1, 1), audios=(1, 1), audio_seconds=(2.0, 15.0), text_median=80)),
        "text": (0.2, SampleKind(text_median=300)),
    },
    # interleaved documents, heavy-tailed: most have a few images and long text, a tenth are long
    # documents with many images, a fifth text only.
    "interleaved": {
        "document": (0.7, SampleKind(images=(1, 8), image_side=(224, 672), text_median=900, text_sigma=0.8)),
        "long_document": (0.1, SampleKind(images=(8, 24), text_median=2400, text_sigma=0.5)),
        "text": (0.2, SampleKind(text_median=1200, text_sigma=0.5)),
    },
}

# DistTrain's MLLMs (disttrain.md §4.1): LAION image-text pairs interleaved into sequences of up
# to 8192 tokens that the model reads, with images to generate (at the scenario's generation
# resolution) among them, skewed in image count and size; a fifth mostly ask for images.
MIXES["generation"] = {
    "interleaved": (0.8, SampleKind(images=(1, 8), image_side=(224, 448), text_median=3000, text_sigma=0.5,
                                    text_range=(256, 7000), generations=(0, 2))),
    "generate": (0.2, SampleKind(images=(0, 2), text_median=1500, text_sigma=0.5, generations=(1, 4))),
}

# The mixes whose samples are skewed enough to need balancing, as the balancing benchmark names them.
SKEWED_MIXES = ("caption", "multi_image", "audio_heavy", "interleaved")


@dataclass
class SyntheticMetadata:
    """Deterministic metadata stream: ``meta(i)`` depends only on ``(seed, i)``."""

    mix: str | dict[str, tuple[float, SampleKind]] = "llava"
    seed: int = 0
    patch_size: int = 14
    sample_rate: int = 16000
    num_samples: int = 1_000_000
    generation_size: int = 512  # side of the images generation requests ask for (pixels)
    generator: str = "image"  # the generator they name
    _kinds: list[tuple[str, float, SampleKind]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        table = MIXES.get(self.mix) if isinstance(self.mix, str) else self.mix
        if table is None:
            raise ValueError(f"data mix {self.mix!r} is unknown; choose one of {sorted(MIXES)} or pass a table")
        weights = [w for w, _ in table.values()]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"data mix {self.mix!r}: weights must be non-negative and not all zero")
        if self.patch_size < 1:
            raise ValueError(f"patch_size = {self.patch_size}: must be positive")
        total = sum(weights)
        self._kinds = [(name, w / total, kind) for name, (w, kind) in table.items()]

    def __len__(self) -> int:
        return self.num_samples

    def kind(self, i: int) -> str:
        return self._draw(i)[0]

    def meta(self, i: int) -> SampleMeta:
        return self._draw(i)[1]

    def _draw(self, i: int) -> tuple[str, SampleMeta]:
        rng = np.random.default_rng([self.seed, i])
        probs = [p for _, p, _ in self._kinds]
        name, _, kind = self._kinds[int(rng.choice(len(self._kinds), p=probs))]
        p = self.patch_size
        images = tuple(
            ImageMeta(*(max(p, int(rng.integers(kind.image_side[0], kind.image_side[1] + 1)) // p * p) for _ in range(2)))
            for _ in range(int(rng.integers(kind.images[0], kind.images[1] + 1)))
        )
        audios = tuple(
            AudioMeta(int(rng.uniform(*kind.audio_seconds) * self.sample_rate), self.sample_rate)
            for _ in range(int(rng.integers(kind.audios[0], kind.audios[1] + 1)))
        )
        text = int(np.clip(rng.lognormal(np.log(kind.text_median), kind.text_sigma), *kind.text_range))
        side = self.generation_size
        gens = tuple(GenerationMeta(self.generator, side, side)
                     for _ in range(int(rng.integers(kind.generations[0], kind.generations[1] + 1))))
        segments = ("image",) * len(images) + ("audio",) * len(audios) + ("text",) + ("generate",) * len(gens)
        # text_tokens counts BOS/EOS and one marker per item or request, as the collation's tokenizer would
        return name, SampleMeta(i, text + 2 + len(images) + len(audios) + len(gens), images, audios, segments, gens)
