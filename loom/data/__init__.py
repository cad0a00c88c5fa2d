"""Samples, metadata, the demo dataset, tokenisation and collation."""

from loom.data.collate import (
    IGNORE_INDEX,
    MODALITIES,
    SAMPLE_FIELDS,
    collate,
    count_tokens,
    split_microbatches,
)
from loom.data.demo import DEFAULT_MIX, SAMPLE_KINDS, DemoConfig, DemoDataset
from loom.data.demo_words import demo_vocabulary
from loom.data.sample import AudioMeta, Batch, ImageMeta, Sample, SampleMeta
from loom.data.tokenizer import Tokenizer

__all__ = [
    "AudioMeta",
    "Batch",
    "DEFAULT_MIX",
    "DemoConfig",
    "DemoDataset",
    "IGNORE_INDEX",
    "ImageMeta",
    "MODALITIES",
    "SAMPLE_FIELDS",
    "SAMPLE_KINDS",
    "Sample",
    "SampleMeta",
    "Tokenizer",
    "collate",
    "count_tokens",
    "demo_vocabulary",
    "split_microbatches",
]
