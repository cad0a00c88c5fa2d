"""Context-parallel attention (loom.runtime.context_parallel, cornstarch.md §3.3.6) against dense
attention on the whole sequence with the BAM's dense mask: output and the gradients of q, k and
v, CP 2 and CP 4 on gloo, random packed multimodal rows, LPT and random distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.balance.context import distribute_tokens
from loom.data.bam import Span, bitfield_mask, dense_mask
from loom.runtime.context_parallel import cp_attention, rank_context
from loom.runtime.local import run_local


def random_rows(rng: np.random.Generator, rows: int) -> list:
    """``rows`` packed rows of 1 to 3 samples (text runs, images, clips), right-padded to one length."""
    layouts = []
    for _ in range(rows):
        samples = []
        for _ in range(int(rng.integers(1, 4))):
            spans = [Span(str(rng.choice(["text", "vision", "audio"], p=[0.4, 0.35, 0.25])), int(rng.integers(1, 8)))
                     for _ in range(int(rng.integers(1, 6)))]
            samples.append(spans)
        layouts.append(samples)
    length = max(sum(s.length for spans in lay for s in spans) for lay in layouts) + int(rng.integers(0, 5))
    return [bitfield_mask(lay, length=length, item_attention=str(rng.choice(["bidirectional", "causal"])))
            for lay in layouts]


def _check(rank: int, world: int, cases: int) -> None:
    rng = np.random.default_rng(100 + world)
    for case in range(cases):
        bams = random_rows(rng, int(rng.integers(1, 3)))
        length = bams[0].length
        block = int(rng.integers(2, 6))
        if length < world * block:
            block = max(1, length // world)
        method = "lpt" if case % 2 == 0 else "random"
        d = distribute_tokens(bams, world, block, method=method, seed=case)
        rc = rank_context(bams, d, rank)
        g = torch.Generator().manual_seed(case)
        b, heads, kv_heads, hd = len(bams), 4, 2, 8
        q = torch.randn(b, heads, length, hd, generator=g, dtype=torch.float64)
        k = torch.randn(b, kv_heads, length, hd, generator=g, dtype=torch.float64)
        v = torch.randn(b, kv_heads, length, hd, generator=g, dtype=torch.float64)
        up = torch.randn(b, heads, length, hd, generator=g, dtype=torch.float64)
        # reference: dense attention over the whole row with the BAM's dense mask
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        mask = torch.from_numpy(np.stack([dense_mask(x) for x in bams]))[:, None]
        ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(2, 1), vf.repeat_interleave(2, 1), attn_mask=mask)
        (ref * up).sum().backward()
        tok = rc.tokens
        ql, kl, vl = (t[:, :, tok].clone().requires_grad_() for t in (q, k, v))
        out = cp_attention(ql, kl, vl, rc)
        (out * up[:, :, tok]).sum().backward()
        where = f"rank {rank} cp {world} case {case} ({method}, block {block}, length {length})"
        torch.testing.assert_close(out, ref[:, :, tok], msg=lambda m: f"{where} output: {m}")
        torch.testing.assert_close(ql.grad, qf.grad[:, :, tok], msg=lambda m: f"{where} dq: {m}")
        torch.testing.assert_close(kl.grad, kf.grad[:, :, tok], msg=lambda m: f"{where} dk: {m}")
        torch.testing.assert_close(vl.grad, vf.grad[:, :, tok], msg=lambda m: f"{where} dv: {m}")
    dist.barrier()


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_dense_attention(cp: int) -> None:
    run_local(_check, cp, 12)


def test_block_skipping_attends_only_nonempty_tiles() -> None:
    # two packed samples: the second sample's query blocks never read the first's keys
    bam = bitfield_mask([[Span("text", 6), Span("vision", 6), Span("text", 4)],
                         [Span("text", 4), Span("audio", 8), Span("text", 4)]])
    d = distribute_tokens(bam, 2, 4)
    attended = 0
    for rank in range(2):
        rc = rank_context(bam, d, rank)
        for (start, stop), idx, full in zip(rc.query_blocks, rc.key_index, rc.full):
            keys = rc.mask[0, start:stop]
            # every allowed key is among the attended ones, and no attended key block is empty
            outside = torch.ones(bam.length, dtype=torch.bool)
            outside[idx] = False
            assert not keys[:, outside].any()
            assert full == bool(keys[:, idx].all())
            attended += (stop - start) * len(idx)
    assert attended < bam.length * bam.length / 2  # fewer than half the dense pairs
    # the image's diagonal tile (rows 8..11 are image tokens that see columns 8..11) is FULL
    assert any(rc.full for rank in range(2) for rc in [rank_context(bam, d, rank)])


def test_select_features_merges_like_the_full_row() -> None:
    from loom.runtime.context_parallel import select_features
    rng = np.random.default_rng(5)
    for _ in range(20):
        bams = random_rows(rng, int(rng.integers(1, 3)))
        d = distribute_tokens(bams, 2, 3 if bams[0].length >= 6 else 1, method=str(rng.choice(["lpt", "random"])), seed=1)
        placeholders = torch.from_numpy(np.stack([b.kind == 1 for b in bams]))  # the vision tokens
        feats = torch.randn(int(placeholders.sum()), 4)
        full = torch.zeros(len(bams), bams[0].length, 4).masked_scatter(placeholders[..., None], feats)
        for rank in range(2):
            tok = torch.from_numpy(d.tokens_on(rank))
            cut = torch.zeros(len(bams), len(tok), 4).masked_scatter(
                placeholders[:, tok][..., None], select_features(placeholders, feats, tok))
            torch.testing.assert_close(cut, full[:, tok])
