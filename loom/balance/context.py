"""Token distribution over context-parallel ranks for the all-gather CP of Cornstarch
(cornstarch.md §3.3.2 to §3.3.4 and §3.3.6).

A row of ``T`` tokens is cut into blocks of ``block`` consecutive tokens; a block is the unit a
rank owns, so its tokens stay contiguous for the attention kernel's tiles. A query block's
workload is the number of key blocks its row of the block mask does not skip (§3.3.2, the
dissertation's [D] granularity: ``block_mask(bam, block) != EMPTY`` summed over the row). Two
distributions:

- ``"lpt"`` (§3.3.3): blocks in descending workload order (ties: lower block index first), each
  to the rank with the smallest load so far (ties: lower rank). This is the corrected
  Algorithm 2 of [P] Appendix A (it sorts, as the text says; the printed loop does not), the
  same variant as OrchMLLM's post-balancing, so it runs on `lpt_balance`. Graham's bound: the
  makespan is at most ``4/3 - 1/(3 cp)`` times the optimum.
- ``"random"`` (§3.3.4): the universal hash of the repository's history, per block:
  ``h(b) = (a ((b + offset) mod p) + b0) mod p``, ``p = 2^31``, rank ``h(b) mod cp``, with ``a``
  coprime to ``cp`` and ``a, b0, offset`` drawn from ``seed``: every rank computes the same split
  from the same seed (the digest's [gap]). When ``cp`` divides ``p`` (a power of two) the hash
  mod ``cp`` is a shifted stride through the ranks, so each rank gets ``num_blocks / cp`` blocks
  (±1); otherwise the counts vary, and a rank may get none. (LPT gives every rank a block: a
  token attends at least itself, so every block has work.)

The runtime then needs, per rank, its tokens' global positions (its hidden states, RoPE
positions and labels are those positions of the row: they follow the tokens), the order in
which the all-gather concatenates every rank's keys, and its local mask: its rows against the
gathered keys (§3.3.6), as booleans or as tile classes for block skipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.balance.lpt import lpt_balance
from loom.data.bam import BitfieldMask, block_mask, decode, nonempty_tiles

METHODS = ("lpt", "random")
HASH_PRIME = 2**31  # the repository's modulus (a power of two, despite the name it had there)


@dataclass(frozen=True)
class ContextDistribution:
    """Blocks of one row over ``cp`` context-parallel ranks.

    ``rank_of_block[b]`` owns tokens ``b * block`` to ``min((b + 1) * block, length) - 1``;
    ``workloads[b]`` is block ``b``'s count of non-empty key blocks, ``loads[r]`` the sum over
    rank ``r``'s blocks."""

    block: int
    length: int
    rank_of_block: np.ndarray  # int64 [num_blocks]
    workloads: np.ndarray  # int64 [num_blocks]
    loads: np.ndarray  # int64 [cp]
    method: str

    @property
    def cp(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.rank_of_block.shape[0])

    @property
    def makespan(self) -> int:
        return int(self.loads.max())

    @property
    def imbalance(self) -> float:
        """Makespan over the mean load (1.0 is perfect balance)."""
        mean = float(self.loads.mean())
        return float(self.makespan) / mean if mean > 0 else 1.0

    def blocks_on(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s blocks in ascending order (its tokens keep the row's order)."""
        self._check_rank(rank)
        return np.flatnonzero(self.rank_of_block == rank)

    def tokens_on(self, rank: int) -> np.ndarray:
        """int64 global positions of rank ``rank``'s tokens, ascending: index its hidden states,
        position ids and labels with them."""
        return _block_tokens(self.blocks_on(rank), self.block, self.length)

    def gather_order(self) -> np.ndarray:
        """Global positions of the all-gathered keys: every rank's tokens, rank 0 first (§3.3.6)."""
        return np.concatenate([self.tokens_on(r) for r in range(self.cp)])

    def key_blocks(self) -> np.ndarray:
        """The blocks of the gathered keys, in gather order."""
        return np.concatenate([self.blocks_on(r) for r in range(self.cp)])

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank = {rank}; use a context-parallel rank in 0..{self.cp - 1}")


def _block_tokens(blocks: np.ndarray, block: int, length: int) -> np.ndarray:
    if blocks.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = blocks.astype(np.int64) * block
    sizes = np.minimum(starts + block, length) - starts
    # each block's start repeated over its tokens, plus the offset inside the block
    offsets = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + offsets


def _rows(bam: BitfieldMask | Sequence[BitfieldMask]) -> list[BitfieldMask]:
    rows = [bam] if isinstance(bam, BitfieldMask) else list(bam)
    if not rows:
        raise ValueError("bam is an empty list; pass one BitfieldMask per row of the microbatch")
    lengths = sorted({r.length for r in rows})
    if len(lengths) > 1:
        raise ValueError(f"bam rows have lengths {lengths}; one split serves a microbatch of rows "
                         "padded to one length (collate pads them), so pass rows of equal length")
    return rows


def _check(length: int, context_parallel: int, block: int) -> int:
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block = {block!r}; use a positive int (tokens per CP block, e.g. 128)")
    if not isinstance(context_parallel, (int, np.integer)) or context_parallel < 1:
        raise ValueError(f"context_parallel = {context_parallel!r}; use a positive int")
    num_blocks = math.ceil(length / block)
    if context_parallel > num_blocks:
        raise ValueError(
            f"context_parallel = {context_parallel} but the row has {num_blocks} blocks of {block} tokens "
            f"({length} tokens); use context_parallel <= {num_blocks}, a smaller block, or longer rows"
        )
    return num_blocks


def block_workloads(bam: BitfieldMask, block: int) -> np.ndarray:
    """int64 per query block: its non-empty key blocks (§3.3.2 [D]: "# blocks to compute"), the
    row sums of ``block_mask(bam, block) != EMPTY``."""
    return nonempty_tiles(bam, block)


def lpt_blocks(workloads: np.ndarray, cp: int) -> np.ndarray:
    """Rank per block by greedy LPT (§3.3.3; ties in the module docstring)."""
    return lpt_balance(np.asarray(workloads, dtype=np.int64), cp).rank_of_sample


def random_blocks(num_blocks: int, cp: int, seed: int) -> np.ndarray:
    """Rank per block by the seeded universal hash of §3.3.4 (module docstring)."""
    rng = np.random.default_rng(seed)
    a = int(rng.integers(1, HASH_PRIME))
    while math.gcd(a, cp) != 1:
        a = int(rng.integers(1, HASH_PRIME))
    b0, offset = (int(x) for x in rng.integers(0, HASH_PRIME, size=2))
    idx = np.arange(num_blocks, dtype=np.int64)
    h = (a * ((idx + offset) % HASH_PRIME) + b0) % HASH_PRIME  # a * x < 2^62: exact in int64
    return h % cp


def distribute_tokens(
    bam: BitfieldMask | Sequence[BitfieldMask],
    context_parallel: int,
    block: int = 128,
    method: str = "lpt",
    seed: int = 0,
) -> ContextDistribution:
    """Distribute the row's blocks over ``context_parallel`` ranks by ``method`` (``"lpt"`` or
    ``"random"``, with ``seed``); see the module docstring. Given several rows of one length (a
    right-padded microbatch), one split serves them all and a block's workload is summed over the
    rows, as the repository does (cornstarch.md §6.5, point 10)."""
    rows = _rows(bam)
    length = rows[0].length
    num_blocks = _check(length, context_parallel, block)
    workloads = np.sum([block_workloads(r, block) for r in rows], axis=0).astype(np.int64)
    if method == "lpt":
        rank_of_block = lpt_blocks(workloads, context_parallel)
    elif method == "random":
        rank_of_block = random_blocks(num_blocks, context_parallel, seed)
    else:
        raise ValueError(f"method = {method!r}; use one of {list(METHODS)}")
    loads = np.bincount(rank_of_block, weights=workloads, minlength=context_parallel).astype(np.int64)
    return ContextDistribution(block, length, rank_of_block.astype(np.int64), workloads, loads, method)


def _check_same_row(bam: BitfieldMask, dist: ContextDistribution) -> None:
    if bam.length != dist.length:
        raise ValueError(f"the BAM has {bam.length} tokens but the distribution was made for "
                         f"{dist.length}; pass the BAM that distribute_tokens was given")


def local_mask(bam: BitfieldMask, dist: ContextDistribution, rank: int) -> np.ndarray:
    """bool ``[tokens on rank, T]``: rank ``rank``'s query rows against the all-gathered keys in
    gather order (§3.3.6), decoded from the BAM at global positions."""
    _check_same_row(bam, dist)
    return decode(bam, dist.tokens_on(rank), dist.gather_order())


def local_block_mask(bam: BitfieldMask, dist: ContextDistribution, rank: int) -> np.ndarray:
    """int8 tile classes of `local_mask` for block skipping: the rank's query blocks (rows)
    against the gathered key blocks in gather order (columns). The global block mask's rows and
    columns, permuted, as the repository builds its local compressed mask (§3.3.6)."""
    _check_same_row(bam, dist)
    return block_mask(bam, dist.block)[np.ix_(dist.blocks_on(rank), dist.key_blocks())]
