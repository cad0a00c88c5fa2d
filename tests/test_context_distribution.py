"""Token distribution over context-parallel ranks (loom/balance/context.py, cornstarch.md §3.3.2
to §3.3.6): LPT against brute force, the distribution is a partition, local masks are the dense
mask's rows against the gathered keys."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loom.balance.context import (
    ContextDistribution, block_workloads, distribute_tokens, local_block_mask, local_mask, lpt_blocks,
    random_blocks,
)
from loom.data.bam import EMPTY, FULL, PARTIAL, Span, bitfield_mask, dense_mask


def brute_force_makespan(workloads: np.ndarray, cp: int) -> int:
    """Optimal makespan over every assignment of blocks to ranks (cp ** n of them)."""
    best = None
    for ranks in itertools.product(range(cp), repeat=workloads.size):
        loads = np.bincount(np.array(ranks, dtype=np.int64), weights=workloads, minlength=cp)
        best = loads.max() if best is None else min(best, loads.max())
    return int(best)


def random_row(rng: np.random.Generator, max_samples: int = 3):
    samples = []
    for _ in range(int(rng.integers(1, max_samples + 1))):
        samples.append([Span(str(rng.choice(["text", "vision", "audio"])), int(rng.integers(1, 20)))
                        for _ in range(int(rng.integers(1, 5)))])
    used = sum(s.length for sp in samples for s in sp)
    return bitfield_mask(samples, length=used + int(rng.integers(0, 8)))


def test_lpt_within_graham_bound_of_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n, cp = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        w = rng.integers(0, 12, n).astype(np.int64)
        ranks = lpt_blocks(w, cp)
        makespan = int(np.bincount(ranks, weights=w, minlength=cp).max())
        opt = brute_force_makespan(w, cp)
        assert makespan <= (4 / 3 - 1 / (3 * cp)) * opt + 1e-9
        if n <= cp or cp == 1:  # trivial: one block per rank, or one rank
            assert makespan == opt


def test_lpt_on_bams_against_brute_force():
    rng = np.random.default_rng(1)
    checked = 0
    while checked < 40:
        bam = random_row(rng)
        block = int(rng.integers(4, 16))
        nb = -(-bam.length // block)
        if nb > 7:
            continue
        cp = int(rng.integers(1, min(3, nb) + 1))
        dist = distribute_tokens(bam, cp, block)
        opt = brute_force_makespan(dist.workloads, cp)
        assert dist.makespan <= (4 / 3 - 1 / (3 * cp)) * opt + 1e-9
        checked += 1


def test_lpt_on_the_dissertations_example():
    # [D] Fig. 3.3a: eight query blocks with workloads 1, 2, 2, 4, 5, 2, 2, 8, on 2 GPUs
    w = np.array([1, 2, 2, 4, 5, 2, 2, 8])
    ranks = lpt_blocks(w, 2)
    # descending 8 5 4 2 2 2 2 1 (ties by block index) to the least-loaded rank (ties: rank 0)
    assert ranks.tolist() == [0, 0, 1, 1, 1, 0, 1, 0]
    assert np.bincount(ranks, weights=w).tolist() == [13, 13]


def test_workloads_of_a_causal_text_row_grow_by_one_per_block():
    bam = bitfield_mask([[Span("text", 50)]])
    assert block_workloads(bam, 8).tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_workloads_are_non_empty_key_blocks_of_the_dense_mask():
    rng = np.random.default_rng(2)
    for _ in range(20):
        bam = random_row(rng)
        dense = dense_mask(bam)
        block = int(rng.integers(1, 10))
        want = [sum(dense[i:i + block, j:j + block].any() for j in range(0, bam.length, block))
                for i in range(0, bam.length, block)]
        assert block_workloads(bam, block).tolist() == want


def check_partition(dist: ContextDistribution) -> None:
    tokens = [dist.tokens_on(r) for r in range(dist.cp)]
    for t in tokens:
        assert np.all(np.diff(t) > 0)  # ascending: a rank keeps the row's order
    everything = np.concatenate(tokens)
    assert np.array_equal(np.sort(everything), np.arange(dist.length))  # every token exactly once
    assert np.array_equal(dist.gather_order(), everything)
    assert sum(dist.blocks_on(r).size for r in range(dist.cp)) == dist.num_blocks
    assert dist.loads.sum() == dist.workloads.sum()


@pytest.mark.parametrize("method", ["lpt", "random"])
def test_distribution_is_a_partition_and_local_masks_are_dense_rows(method):
    rng = np.random.default_rng(3)
    for trial in range(30):
        bam = random_row(rng)
        block = int(rng.integers(1, 12))
        nb = -(-bam.length // block)
        cp = int(rng.integers(1, min(4, nb) + 1))
        dist = distribute_tokens(bam, cp, block, method=method, seed=trial)
        check_partition(dist)
        if method == "lpt":  # every block has work (a token sees at least itself): no rank idles
            assert dist.workloads.min() >= 1 and all(dist.blocks_on(r).size for r in range(cp))
        dense = dense_mask(bam)
        gathered = dist.gather_order()
        for r in range(cp):
            rows = dist.tokens_on(r)
            assert np.array_equal(local_mask(bam, dist, r), dense[np.ix_(rows, gathered)])
            # tile classes of the local mask: each block's tokens are contiguous in both layouts
            tiles = local_block_mask(bam, dist, r)
            q_sizes = [min(block, bam.length - b * block) for b in dist.blocks_on(r)]
            k_sizes = [min(block, bam.length - b * block) for b in dist.key_blocks()]
            local = dense[np.ix_(rows, gathered)]
            qo = np.cumsum([0] + q_sizes)
            ko = np.cumsum([0] + k_sizes)
            for i in range(len(q_sizes)):
                for j in range(len(k_sizes)):
                    tile = local[qo[i]:qo[i + 1], ko[j]:ko[j + 1]]
                    want = FULL if tile.all() else (EMPTY if not tile.any() else PARTIAL)
                    assert tiles[i, j] == want


def test_positions_and_labels_follow_the_tokens():
    bam = bitfield_mask([[Span("text", 5), Span("vision", 6)], [Span("text", 7), Span("audio", 4)]])
    labels = np.arange(100, 100 + bam.length)
    dist = distribute_tokens(bam, 3, 4)
    for r in range(3):
        t = dist.tokens_on(r)
        assert np.array_equal(labels[t], 100 + t)
        assert np.array_equal(bam.positions()[t], np.where(t < 11, t, t - 11))


def test_random_baseline_is_seeded_and_spreads_blocks():
    a = random_blocks(64, 4, seed=5)
    assert np.array_equal(a, random_blocks(64, 4, seed=5))
    assert any(not np.array_equal(a, random_blocks(64, 4, seed=s)) for s in range(6, 10))
    # cp divides the hash's modulus 2^31: the hash mod cp strides through the ranks
    for seed in range(5):
        counts = np.bincount(random_blocks(61, 8, seed), minlength=8)
        assert counts.max() - counts.min() <= 1
    assert set(random_blocks(300, 3, seed=1).tolist()) == {0, 1, 2}


def test_lpt_balances_a_packed_multimodal_row_better_than_contiguous_chunks():
    # causal rows: later contiguous chunks carry more key blocks; LPT evens the ranks out
    bam = bitfield_mask([[Span("text", 300), Span("vision", 256), Span("text", 200)],
                         [Span("text", 100), Span("audio", 150), Span("text", 400)]])
    dist = distribute_tokens(bam, 4, 32)
    contiguous = max(int(part.sum()) for part in np.array_split(dist.workloads, 4))
    assert dist.makespan < contiguous
    opt_lower_bound = max(dist.workloads.max(), -(-dist.workloads.sum() // 4))
    assert dist.makespan <= (4 / 3 - 1 / 12) * opt_lower_bound
    assert dist.makespan <= opt_lower_bound + dist.workloads.min()


def test_bad_input_names_the_field():
    bam = bitfield_mask([[Span("text", 300)]])
    with pytest.raises(ValueError, match="context_parallel = 4 but the row has 3 blocks of 128 tokens"):
        distribute_tokens(bam, 4, 128)
    with pytest.raises(ValueError, match="context_parallel = 0"):
        distribute_tokens(bam, 0, 128)
    with pytest.raises(ValueError, match="block = 0"):
        distribute_tokens(bam, 2, 0)
    with pytest.raises(ValueError, match="method = 'zigzag'"):
        distribute_tokens(bam, 2, 64, method="zigzag")
    dist = distribute_tokens(bam, 2, 64)
    with pytest.raises(ValueError, match="rank = 2"):
        dist.tokens_on(2)
    with pytest.raises(ValueError, match="the BAM has 200 tokens"):
        local_mask(bitfield_mask([[Span("text", 200)]]), dist, 0)


def test_one_split_for_a_padded_microbatch_sums_the_rows_workloads():
    rows = [bitfield_mask([[Span("text", 20), Span("vision", 16)]], length=60),
            bitfield_mask([[Span("audio", 30), Span("text", 30)]], length=60)]
    dist = distribute_tokens(rows, 2, 8)
    assert np.array_equal(dist.workloads, block_workloads(rows[0], 8) + block_workloads(rows[1], 8))
    check_partition(dist)
    for bam in rows:
        dense = dense_mask(bam)
        assert np.array_equal(local_mask(bam, dist, 1), dense[np.ix_(dist.tokens_on(1), dist.gather_order())])
    with pytest.raises(ValueError, match=r"bam rows have lengths \[50, 60\]"):
        distribute_tokens([rows[0], bitfield_mask([[Span("text", 50)]])], 2, 8)


def test_all_gather_attention_with_local_masks_equals_full_attention():
    """§3.3.6 in one process: each rank attends its queries against the gathered keys and values
    with its local mask, skipping EMPTY key tiles; the outputs, put back at their positions, equal
    attention over the whole row with the dense mask."""
    import torch

    torch.manual_seed(0)
    rng = np.random.default_rng(4)
    for method, _ in itertools.product(("lpt", "random"), range(8)):
        bam = random_row(rng, max_samples=3)
        block = 5
        cp = min(3, -(-bam.length // block))
        dist = distribute_tokens(bam, cp, block, method=method, seed=1)
        t, heads, dim = bam.length, 2, 8
        q, k, v = (torch.randn(heads, t, dim, dtype=torch.float64) for _ in range(3))
        dense = torch.from_numpy(dense_mask(bam))
        assert bool(dense.any(dim=1).all())  # every row has a key (padding: itself)

        def attend(qq, kk, vv, mask):
            scores = (qq @ kk.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ vv

        want = attend(q, k, v, dense)
        got = torch.zeros_like(want)
        order = torch.from_numpy(dist.gather_order())
        k_all, v_all = k[:, order], v[:, order]  # what the all-gather delivers
        key_sizes = [min(block, t - b * block) for b in dist.key_blocks()]
        key_starts = np.cumsum([0] + key_sizes)
        for r in range(cp):
            rows = torch.from_numpy(dist.tokens_on(r))
            mask = torch.from_numpy(local_mask(bam, dist, r))
            tiles = local_block_mask(bam, dist, r)
            q_starts = np.cumsum([0] + [min(block, t - b * block) for b in dist.blocks_on(r)])
            for i in range(tiles.shape[0]):
                keep = np.flatnonzero(tiles[i] != EMPTY)  # block skipping
                cols = torch.from_numpy(np.concatenate([np.arange(key_starts[j], key_starts[j + 1]) for j in keep]))
                lo, hi = q_starts[i], q_starts[i + 1]
                out = attend(q[:, rows[lo:hi]], k_all[:, cols], v_all[:, cols], mask[lo:hi][:, cols])
                got[:, rows[lo:hi]] = out
        assert torch.allclose(got, want, atol=1e-12)
