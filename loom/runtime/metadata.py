"""The dispatcher's metadata all-gather: every rank's `SampleMeta`s (and its payload error, if
any) as one int64 tensor, gathered in one collective.

``all_gather_object`` pickles every `SampleMeta` (a Python object per sample, per rank, per
step) and runs two collectives (sizes, then bytes). Here a rank's share is a flat list of
ints: ``[samples, error length, error bytes..., record...]`` with one record per sample,
``[sample_id, text_tokens, images, audios, segments, (height, width) per image,
(num_samples, sample_rate) per audio clip, (length, utf-8 bytes...) per segment name]``. Every
rank pads its list to the same capacity, fixed from the batch size, so one ``all_gather``
suffices; a share longer than that (many items per sample, a long error message) makes every
rank run one more ``all_gather`` at the longest share's size, decided from the first round's
lengths, which every rank sees alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from loom.data.sample import AudioMeta, ImageMeta, SampleMeta

# ints per sample of the first round: the record's 5 fixed fields, one text segment name, and
# room for a few items and segments; larger shares take the second round
_INTS_PER_SAMPLE = 24


def encode(metas: Sequence[SampleMeta], error: str | None) -> list[int]:
    """A rank's share as ints (see the module docstring)."""
    err = list((error or "").encode())
    out = [len(metas), len(err), *err]
    for m in metas:
        out += [m.sample_id, m.text_tokens, len(m.images), len(m.audios), len(m.segments)]
        for i in m.images:
            out += [i.height, i.width]
        for a in m.audios:
            out += [a.num_samples, a.sample_rate]
        for s in m.segments:
            b = s.encode()
            out += [len(b), *b]
    return out


def decode(values: Sequence[int]) -> tuple[list[SampleMeta], str | None]:
    """`encode`'s input back from its ints (trailing padding is ignored)."""
    n, e = values[0], values[1]
    error = bytes(values[2:2 + e]).decode() if e else None
    p = 2 + e
    metas = []
    for _ in range(n):
        sample_id, text_tokens, num_images, num_audios, num_segments = values[p:p + 5]
        p += 5
        images = tuple(ImageMeta(values[p + 2 * k], values[p + 2 * k + 1]) for k in range(num_images))
        p += 2 * num_images
        audios = tuple(AudioMeta(values[p + 2 * k], values[p + 2 * k + 1]) for k in range(num_audios))
        p += 2 * num_audios
        segments = []
        for _ in range(num_segments):
            length = values[p]
            segments.append(bytes(values[p + 1:p + 1 + length]).decode())
            p += 1 + length
        metas.append(SampleMeta(sample_id, text_tokens, images, audios, tuple(segments)))
    return metas, error


def all_gather_metadata(metas: Sequence[SampleMeta], error: str | None, batch_size: int, device: torch.device,
                        group: dist.ProcessGroup | None = None) -> list[tuple[list[SampleMeta], str | None]]:
    """Every rank's ``(metas, error)``, in rank order, from one ``all_gather`` (two when a share
    exceeds the capacity every rank derives from ``batch_size``)."""
    world = dist.get_world_size(group)
    mine = encode(metas, error)
    capacity = 2 + _INTS_PER_SAMPLE * -(-batch_size // world)
    first = torch.zeros(1 + capacity, dtype=torch.int64)
    first[0] = len(mine)
    head = mine[:capacity]
    first[1:1 + len(head)] = torch.tensor(head, dtype=torch.int64)
    rows = _all_gather(first, world, device, group)
    lengths = [r[0] for r in rows]
    if max(lengths) > capacity:  # every rank sees the same lengths: all take this round or none
        size = max(lengths)
        second = torch.zeros(size, dtype=torch.int64)
        second[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
        rows = [[0, *r] for r in _all_gather(second, world, device, group)]
    return [decode(r[1:1 + n]) for r, n in zip(rows, lengths)]


def _all_gather(t: torch.Tensor, world: int, device: torch.device, group: dist.ProcessGroup | None) -> list[list[int]]:
    out = [torch.empty_like(t, device=device) for _ in range(world)]
    dist.all_gather(out, t.to(device), group=group)
    return torch.stack(out).cpu().tolist()
