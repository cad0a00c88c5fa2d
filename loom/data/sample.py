"""Samples and their metadata (docs/architecture.md principle 4: decide on metadata, move data once).

A sample's metadata says, before any payload is decoded, how many tokens each module will see:
the image sizes give the vision encoder's patch count, the audio lengths give the audio
encoder's frame count, the text length gives the LLM's text tokens. Balancing, planning and
the simulator work on metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageMeta:
    """An RGB image of ``height`` x ``width`` pixels."""

    height: int
    width: int


@dataclass(frozen=True)
class AudioMeta:
    """A mono clip of ``num_samples`` samples at ``sample_rate`` Hz."""

    num_samples: int
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.num_samples / self.sample_rate


@dataclass(frozen=True)
class GenerationMeta:
    """An image of ``height`` x ``width`` pixels that generator ``generator`` learns to make."""

    generator: str
    height: int
    width: int


@dataclass(frozen=True)
class SampleMeta:
    """Everything the planner and balancer need about a sample, without its payload.

    ``segments`` is the order of the sample's segments, e.g. ``("image", "text", "audio",
    "text")``; ``text_tokens`` counts the tokenizer's ids for the text alone (with BOS/EOS,
    one id per modality placeholder *before* expansion). ``generations`` are the images the
    sample asks generators to make (one generation marker each in the text, in order).
    ``target_tokens`` is how many of its text tokens the loss predicts when only some are
    targets (the assistant turns of a chat, `Sample.target_spans`); ``None``: every token after
    the first but the markers (`loom.data.collate.target_count`).
    """

    sample_id: int
    text_tokens: int
    images: tuple[ImageMeta, ...] = ()
    audios: tuple[AudioMeta, ...] = ()
    segments: tuple[str, ...] = ()
    generations: tuple[GenerationMeta, ...] = ()
    target_tokens: int | None = None


@dataclass
class Sample:
    """A sample's metadata and payload.

    ``text`` carries one ``<image>`` / ``<audio>`` marker per item, in the order of
    ``images`` / ``audios``, and one generation marker (``<gen_image>``) per entry of
    ``targets``. Images and targets are float32 ``[3, H, W]`` in [0, 1]; audio clips are
    float32 ``[num_samples]`` in [-1, 1]. ``target_spans`` (character ranges of ``text``, e.g. a
    chat's assistant turns) restricts the loss to the tokens that start inside them; ``None``:
    every text token is a target (`loom.data.collate.flagged_ids`).
    """

    meta: SampleMeta
    text: str
    images: list[torch.Tensor] = field(default_factory=list)
    audios: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    target_spans: tuple[tuple[int, int], ...] | None = None

    def check_payload(self) -> None:
        """Raise ``ValueError`` naming the field when the payload disagrees with the metadata."""
        self._check_images(self.images, self.meta.images, "images", "meta.images")
        if len(self.audios) != len(self.meta.audios):
            raise ValueError(
                f"sample {self.meta.sample_id}: {len(self.audios)} audio clips in the payload but "
                f"{len(self.meta.audios)} in meta.audios; regenerate the sample's metadata"
            )
        for i, (clip, m) in enumerate(zip(self.audios, self.meta.audios)):
            if clip.dim() != 1 or clip.shape[0] != m.num_samples:
                raise ValueError(
                    f"sample {self.meta.sample_id}: audios[{i}] has shape {tuple(clip.shape)}, "
                    f"meta.audios[{i}] says [{m.num_samples}]"
                )
        self._check_images(self.targets, self.meta.generations, "targets", "meta.generations")

    def _check_images(self, images: list[torch.Tensor], metas: tuple, field: str, meta_field: str) -> None:
        """``images`` (``[3, H, W]`` each) against their metadata ``metas``, one for one."""
        if len(images) != len(metas):
            raise ValueError(
                f"sample {self.meta.sample_id}: {len(images)} {field} in the payload but "
                f"{len(metas)} in {meta_field}; regenerate the sample's metadata"
            )
        for i, (img, m) in enumerate(zip(images, metas)):
            if img.dim() != 3 or img.shape[0] != 3 or tuple(img.shape[1:]) != (m.height, m.width):
                raise ValueError(
                    f"sample {self.meta.sample_id}: {field}[{i}] has shape {tuple(img.shape)}, "
                    f"{meta_field}[{i}] says [3, {m.height}, {m.width}]"
                )


@dataclass
class Batch:
    """A collated (micro)batch, ready for ``MultimodalModel``.

    - ``input_ids`` ``[B, L]``: text ids with every modality marker expanded to as many
      placeholder ids as its encoder emits tokens; right-padded with the pad id.
    - ``labels`` ``[B, L]``: the *next* token at each position (already shifted), ``-100``
      where nothing is to be predicted (placeholders, padding, the last position).
    - ``modality_inputs``: per encoder name, the keyword inputs of its ``context()``, e.g.
      ``{"vision": {"images": [...]}, "audio": {"waveforms": [...]}}``, items in sample order.
    - ``sample_ids``: which samples, in order.
    - ``segments``: with packing, the samples' lengths in the single row ``[1, L]`` (attention
      and positions restart at each); ``None`` for one right-padded row per sample.
    - ``generation_inputs``: per generator name, the keyword inputs of its ``context()``, e.g.
      ``{"image": {"targets": [...], "seeds": [...]}}``, items in sample order.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    modality_inputs: dict[str, dict[str, list[torch.Tensor]]]
    sample_ids: list[int]
    segments: list[int] | None = None
    generation_inputs: dict[str, dict[str, list]] = field(default_factory=dict)

    def num_generations(self, name: str) -> int:
        """Items generator ``name`` trains on in this batch."""
        inputs = self.generation_inputs.get(name)
        return 0 if inputs is None else len(inputs["targets"])

    @property
    def num_targets(self) -> int:
        return int((self.labels != -100).sum())
