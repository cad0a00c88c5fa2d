"""Which samples make up each global batch.

An endless stream of per-epoch permutations (seeded), cut into consecutive global batches, so
within an epoch no sample is dropped or repeated and a batch may straddle two epochs. Every
rank computes the same indices from the seed: no communication is needed to agree on the batch.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (num_samples = {num_samples}): nothing to train on")
        if global_batch_size < 1:
            raise ValueError(f"data.global_batch_size = {global_batch_size}: must be at least 1")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle = seed, shuffle

    def _epoch(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def batch(self, step: int) -> list[int]:
        """Sample indices of global batch ``step``."""
        start = step * self.global_batch_size
        out: list[int] = []
        while len(out) < self.global_batch_size:
            epoch, offset = divmod(start + len(out), self.num_samples)
            take = min(self.num_samples - offset, self.global_batch_size - len(out))
            out.extend(int(i) for i in self._epoch(epoch)[offset : offset + take])
        return out


def next_in_split(index: int, num_samples: int, held_out: int = 0) -> int:
    """The dataset index after ``index`` within its split, wrapping around inside it: the
    training range ``[0, num_samples - held_out)`` or the held-out one (``data.eval_samples``:
    the last ``held_out`` indices, `loom.train.rank.RankRun.evaluate`'s). ``data.on_error =
    "skip"`` replaces a failing sample by it, so a replacement never crosses the edge: the
    evaluation never trains on, nor the training reads, the other split's samples."""
    first = num_samples - held_out
    if not 0 <= held_out < num_samples or not 0 <= index < num_samples:
        raise ValueError(f"next_in_split({index}, {num_samples}, held_out={held_out}): need 0 <= held_out < "
                         f"num_samples and 0 <= index < num_samples")
    lo, hi = (first, num_samples) if held_out and index >= first else (0, first)
    return lo + (index + 1 - lo) % (hi - lo)
