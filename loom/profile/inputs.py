"""Synthetic inputs for the profiler: microbatches of each module at representative sizes
(entrain.md §3.1: "synthetic inputs at representative sizes"), varying tokens, tokens^2, the
sum of squared item lengths and the item count independently, so every term of the fit
(`loom.cost.profile_fit`) is seen."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from loom.cost.model import Workload
from loom.data.sample import Batch
from loom.model.multimodal import IGNORE_INDEX, MultimodalModel
from loom.model.zoo import AudioEncoder, VisionEncoder
from loom.plan.plan import LLM


def _grid(tokens: int) -> tuple[int, int]:
    """A patch grid with ``tokens`` cells, as square as possible."""
    h = int(math.isqrt(tokens))
    while tokens % h:
        h -= 1
    return h, tokens // h


def item_shapes(target: int, sizes: Iterable[int] = (None, 64, 16)) -> list[list[int]]:
    """Per target token count, several ways to make it from items: one item of all of it, and
    packs of ``target // s`` items of *distinct* lengths around each size ``s`` (``s`` plus
    centred offsets ``±1, ±2, ...``, so a pack keeps ``s`` tokens per item on average), so
    tokens, tokens^2, the sum of squares and the item count vary independently.

    Distinct lengths because the zoo encoders' attention runs one call per distinct item length
    (`loom.model.zoo.attention.segment_attention`): a pack of equal items would price the per-item
    term at one call for the whole pack, while the data's items (images of mixed sizes) mostly
    differ. A pack needs ``target // s <= s`` items to keep every length distinct (within
    ``s / 2`` of ``s``); larger packs of that size are left out."""
    out = []
    for s in sizes:
        if s is None:
            shape = [target]
        else:
            k = target // s
            if k < 1 or k > s:
                continue
            # k distinct centred offsets summing to 0: 0 (k odd), then +-1, +-2, ...
            offsets = ([0] if k % 2 else []) + [sign * i for i in range(1, k // 2 + 1) for sign in (1, -1)]
            shape = sorted((s + o for o in offsets), reverse=True)
        if shape not in out:
            out.append(shape)
    return out


def _encoder_inputs(model: MultimodalModel, name: str, item_tokens: list[int], gen: torch.Generator,
                    device: torch.device) -> dict[str, list[torch.Tensor]]:
    enc = model.encoders[name].encoder
    if isinstance(enc, VisionEncoder):
        p, c = enc.config.patch_size, enc.config.in_channels
        images = []
        for n in item_tokens:
            gh, gw = _grid(n)
            images.append(torch.rand(c, gh * p, gw * p, generator=gen).to(device))
        return {"images": images}
    if isinstance(enc, AudioEncoder):
        hop = enc.config.hop_length
        # tokens = ((1 + samples // hop) - 1) // 2 + 1, so 2 (n - 1) hops give exactly n tokens
        clips = [(torch.rand(max(2 * (n - 1) * hop, 1), generator=gen) * 2 - 1).to(device) for n in item_tokens]
        return {"waveforms": clips}
    raise TypeError(
        f"loom profile has no synthetic-input builder for encoder {name!r} ({type(enc).__name__}); "
        f"it profiles the zoo's VisionEncoder and AudioEncoder"
    )


def _llm_vocab(model: MultimodalModel) -> int:
    llm = model.llm
    emb = llm.get_input_embeddings() if hasattr(llm, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None else int(llm.config.vocab_size)


def _llm_batch(model: MultimodalModel, batch_size: int, length: int, gen: torch.Generator,
               device: torch.device) -> Batch:
    vocab = _llm_vocab(model)
    reserved = set(model.placeholder_ids.values())
    allowed = torch.tensor([i for i in range(vocab) if i not in reserved], dtype=torch.long)
    ids = allowed[torch.randint(0, len(allowed), (batch_size, length), generator=gen)]
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[torch.rand(batch_size, length, generator=gen) < 0.1] = IGNORE_INDEX
    return Batch(input_ids=ids.to(device), labels=labels.to(device), modality_inputs={}, sample_ids=[])


def llm_shapes(target: int) -> list[tuple[int, int]]:
    """(batch, length) pairs of about ``target`` tokens: 1, 4 and 16 sequences."""
    out = []
    for b in (1, 4, 16):
        length = target // b
        if length >= 4 and (b, length) not in out:
            out.append((b, length))
    return out


def module_workloads(model: MultimodalModel, name: str, token_counts: Sequence[int], gen: torch.Generator,
                     device: torch.device) -> list[tuple[Batch, Workload]]:
    """Synthetic microbatches of module ``name`` and their workloads: for the LLM, right-padded
    batches of 1, 4 and 16 sequences; for an encoder, no item at all (a microbatch without its
    modality still runs the module), one item of each token count, and packs of items of
    distinct lengths around 64 and 16 tokens (`item_shapes`)."""
    configs: list[tuple[Batch, Workload]] = []
    dummy = torch.zeros(1, 1, dtype=torch.long, device=device)
    if name == LLM:
        for x in token_counts:
            for b, length in llm_shapes(x):
                configs.append((_llm_batch(model, b, length, gen, device), Workload.padded([length] * b)))
        return configs
    shapes = [[]] + [s for x in token_counts for s in item_shapes(x)]
    for items in shapes:
        inputs = _encoder_inputs(model, name, items, gen, device)
        configs.append((Batch(input_ids=dummy, labels=dummy, modality_inputs={name: inputs}, sample_ids=[]),
                        Workload.of_lengths(items)))
    return configs
