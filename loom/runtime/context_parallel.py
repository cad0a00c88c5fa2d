"""Context-parallel attention as in Cornstarch (cornstarch.md §3.3.6): the all-gather key/value
algorithm with each rank's local bitfield-attention-mask rows, skipping the tiles the mask
makes empty.

Each context-parallel (CP) rank holds the tokens `loom.balance.context.distribute_tokens` gave
it (whole blocks, ascending); its queries are those tokens' queries. Keys and values are
all-gathered over the CP group into gather order (rank 0's tokens first, §3.3.6), so every
rank's rows of the mask are `local_mask(bam, dist, rank)`: the BAM decoded at global positions,
whatever the permutation. The gather is autograd-correct: its backward sums every rank's
gradient of the gathered keys and values and hands each rank its own slice (a reduce-scatter;
on gloo, which has none, an all-reduce and a slice, the same values).

Block skipping (§3.3.1, §3.3.6): the rank's query blocks are attended one at a time against
only the key blocks whose tile is not ``EMPTY`` (`local_block_mask`); a ``FULL`` set of tiles
needs no mask. The work per query block is then its count of non-empty key blocks, the
workload LPT balanced (§3.3.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.balance.context import ContextDistribution, distribute_tokens, local_block_mask, local_mask
from loom.data.bam import EMPTY, FULL, TEXT, BitfieldMask, Span, bitfield_mask
from loom.model.adapter import adapter_for
from loom.model.multimodal import MultimodalModel
from loom.plan.plan import LLM, ModuleSpec, PlanError


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[..., n_rank, d]`` slices of unequal lengths along dim -2 into
    ``[..., sum(sizes), d]`` (rank order); backward: the sum over ranks of the gathered
    gradient, each rank's own slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: tuple[int, ...], rank: int, group) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        width = max(sizes)
        padded = F.pad(x, (0, 0, 0, width - x.shape[-2])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[..., :n, :] for p, n in zip(parts, sizes)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sizes, rank, group = ctx.sizes, ctx.rank, ctx.group
        starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: same values
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=group)
            out = total[..., starts[rank]:starts[rank + 1], :]
        else:
            width = max(sizes)
            stacked = torch.stack([
                F.pad(grad[..., starts[r]:starts[r + 1], :], (0, 0, 0, width - sizes[r])) for r in range(len(sizes))
            ]).contiguous()
            out = torch.empty_like(stacked[0])
            dist.reduce_scatter(out, list(stacked.unbind(0)), group=group)
            out = out[..., :sizes[rank], :]
        return out.contiguous(), None, None, None


def gather_sequence(x: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Every CP rank's ``x`` (``[..., sizes[rank], d]``) concatenated along dim -2 in rank order."""
    rank = dist.get_rank(group)
    if x.shape[-2] != sizes[rank]:
        raise ValueError(f"this rank holds {x.shape[-2]} tokens but sizes[{rank}] = {sizes[rank]}")
    return _GatherSequence.apply(x, tuple(int(n) for n in sizes), rank, group)


@dataclass
class RankContext:
    """What one CP rank needs to attend: its tokens (global positions, ascending), every
    rank's token count (the gather's sizes), its mask rows against the gathered keys
    ``[rows, n, T]`` (one per batch row, or one for all), and per local query block the
    gathered key positions (indices into gather order) of its non-empty tiles, with whether
    they are all ``FULL`` (no mask needed)."""

    rank: int
    tokens: torch.Tensor  # int64 [n]
    sizes: tuple[int, ...]
    mask: torch.Tensor  # bool [rows, n, T]
    query_blocks: list[tuple[int, int]]  # local [start, stop) of each query block
    key_index: list[torch.Tensor]  # int64 gathered key indices per query block
    full: list[bool]
    group: object = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`cp_attention` with this context: the hook the zoo Llama calls
        (``inputs["context_parallel"]``, `LlamaForCausalLM.context`)."""
        return cp_attention(q, k, v, self)

    def select(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-row tensor (labels, hidden states): they follow the tokens."""
        return t.index_select(dim, self.tokens.to(t.device))


def rank_context(bams: BitfieldMask | Sequence[BitfieldMask], distribution: ContextDistribution, rank: int,
                 group=None) -> RankContext:
    """Rank ``rank``'s `RankContext` for rows ``bams`` (one BAM per batch row, all of the
    distribution's length; a tile is skipped only where it is empty in every row)."""
    rows = [bams] if isinstance(bams, BitfieldMask) else list(bams)
    d = distribution
    tokens = d.tokens_on(rank)
    sizes = tuple(len(d.tokens_on(r)) for r in range(d.cp))
    mask = np.stack([local_mask(b, d, rank) for b in rows])
    tiles = np.stack([local_block_mask(b, d, rank) for b in rows])  # [rows, my blocks, key blocks]
    nonempty = (tiles != EMPTY).any(axis=0)
    all_full = (tiles == FULL).all(axis=0)
    key_blocks = d.key_blocks()
    # gathered index of each key block's first token (blocks keep their tokens contiguous)
    block_len = np.array([min(d.block, d.length - b * d.block) for b in key_blocks])
    block_start = np.concatenate([[0], np.cumsum(block_len)[:-1]])
    query_blocks, key_index, full = [], [], []
    start = 0
    for i, b in enumerate(d.blocks_on(rank)):
        n = min(d.block, d.length - b * d.block)
        query_blocks.append((start, start + n))
        start += n
        cols = np.flatnonzero(nonempty[i])
        idx = np.concatenate([np.arange(block_start[c], block_start[c] + block_len[c]) for c in cols]) if len(cols) else np.zeros(0, np.int64)
        key_index.append(torch.from_numpy(idx.astype(np.int64)))
        full.append(bool(all_full[i, cols].all()) if len(cols) else False)
    return RankContext(rank, torch.from_numpy(tokens.astype(np.int64)), sizes, torch.from_numpy(mask),
                       query_blocks, key_index, full, group)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rc: RankContext) -> torch.Tensor:
    """Attention of this rank's queries ``[B, H, n, d]`` over every rank's keys and values
    (``[B, H_kv, n, d]`` each, this rank's tokens; grouped-query heads repeated after the
    gather, so the gather moves only the key/value heads). Returns ``[B, H, n, d]``."""
    k = gather_sequence(k, rc.sizes, rc.group)
    v = gather_sequence(v, rc.sizes, rc.group)
    repeats = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeats, dim=1)
    v = v.repeat_interleave(repeats, dim=1)
    if q.shape[-2] == 0:  # the hash may give a rank no block: nothing to attend, still in the graph
        return q * 0 + (k.sum() + v.sum()) * 0
    mask = rc.mask.to(q.device)
    outs = []
    for (start, stop), idx, full in zip(rc.query_blocks, rc.key_index, rc.full):
        idx = idx.to(q.device)
        kb, vb = k.index_select(2, idx), v.index_select(2, idx)
        m = None if full else mask[:, None, start:stop].index_select(3, idx)  # [rows, 1, nq, nk]
        outs.append(F.scaled_dot_product_attention(q[:, :, start:stop], kb, vb, attn_mask=m))
    return torch.cat(outs, dim=2)


def select_features(placeholder_mask: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The rows of an encoder's projected tokens ``features`` (``[N, H]``, one per True of
    ``placeholder_mask`` ``[B, L]`` in row-major order, what `MultimodalModel.merge` scatters)
    whose placeholders are among this CP rank's ``tokens``, in the order the rank's cut of the
    row meets them: merging them into the rank's tokens equals merging all into the full row and
    then cutting it. Their gradient is this rank's share; the full encoder gradient is the sum
    over the CP group."""
    if int(placeholder_mask.sum()) != features.shape[0]:
        raise ValueError(f"the placeholders count {int(placeholder_mask.sum())} tokens but the encoder gave "
                         f"{features.shape[0]}; pass the full row's placeholder mask and features")
    slot = torch.cumsum(placeholder_mask.flatten().long(), 0).view_as(placeholder_mask) - 1  # feature row per position
    mine = placeholder_mask[:, tokens]
    return features.index_select(0, slot[:, tokens][mine])


def check_context_parallel(spec: ModuleSpec, model: MultimodalModel | None = None) -> None:
    """Refuse a context-parallel setting the runtime cannot execute (before any group is built):
    CP is the LLM's (cornstarch.md §3.3: encoders' items are short and run whole), not yet
    combined with ZeRO and TP together or with hybrid sharding on the same module, and needs an
    LLM whose context takes the runtime's attention (``supports_context_parallel``: the zoo
    Llama)."""
    cp = spec.context_parallel
    if cp == 1:
        return
    where = f"plan.modules[{spec.name!r}]"
    if spec.name != LLM:
        raise PlanError(f"{where}.context_parallel = {cp}: context parallelism splits the LLM's rows; an encoder's "
                        f"items run whole on a rank. Set it to 1 (use data_parallel or tensor_parallel instead)")
    if spec.zero_stage and spec.tensor_parallel > 1:
        raise PlanError(f"{where}.context_parallel = {cp} with zero_stage = {spec.zero_stage} and tensor_parallel = "
                        f"{spec.tensor_parallel}: ZeRO over TP shards of a CP module is not executed yet; set one "
                        f"of the three to its default")
    if spec.shard_degree not in (None, spec.data_parallel):
        raise PlanError(f"{where}.context_parallel = {cp} with shard_degree = {spec.shard_degree}: hybrid sharding "
                        f"of a CP module is not executed yet; leave shard_degree unset or set context_parallel = 1")
    if model is not None and not getattr(adapter_for(model.llm), "supports_context_parallel", False):
        raise PlanError(f"{where}.context_parallel = {cp}: the LLM ({type(model.llm).__name__}) has no context-parallel "
                        f"attention hook (only the zoo Llama has one); set context_parallel = 1")


MAX_BLOCK = 128  # tokens per CP block on long rows: an attention kernel's tile (cornstarch.md §3.3.2)
BLOCKS_PER_RANK = 4  # on short rows, blocks shrink so that each rank gets about this many to balance


def cp_block(length: int, cp: int, multiple: int = 1) -> int:
    """The block size of a row of ``length`` tokens over ``cp`` ranks: `MAX_BLOCK`, or smaller
    where the row has fewer than `BLOCKS_PER_RANK` such blocks per rank (LPT needs several
    blocks per rank to balance; every rank computes the same size from the same metadata),
    rounded up to a multiple of ``multiple`` (the TP degree: sequence parallelism shards a CP
    rank's tokens evenly)."""
    block = max(1, min(MAX_BLOCK, length // (BLOCKS_PER_RANK * cp)))
    return -(-block // multiple) * multiple


def row_spans(ids: torch.Tensor, segments: Sequence[int] | None, placeholder_ids: dict[str, int]) -> list[list[Span]]:
    """The samples of one LLM row ``ids`` (``[L]``) as spans: text runs, and runs of an encoder's
    placeholder id (one span per run: adjacent items of one modality merge, which the causal
    mask the runtime uses does not distinguish). ``segments`` (a packed row's sample lengths)
    splits the row into samples; without them the whole row, right padding included, is one
    sample, so its mask is the single-process model's causal mask over the row."""
    kind = np.zeros(ids.shape[0], dtype=np.int64)
    names = [TEXT]
    for name, pid in placeholder_ids.items():
        names.append(name)
        kind[(ids == pid).cpu().numpy()] = len(names) - 1
    bounds = np.cumsum([0, *(segments if segments is not None else [ids.shape[0]])])
    samples = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        k = kind[lo:hi]
        cuts = np.flatnonzero(np.diff(k)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [hi - lo]])
        samples.append([Span(names[k[a]], int(b - a)) for a, b in zip(starts, ends)])
    return samples


def microbatch_context(input_ids: torch.Tensor, segments: Sequence[int] | None, placeholder_ids: dict[str, int],
                       cp: int, rank: int, group=None, block: int | None = None) -> RankContext:
    """CP rank ``rank``'s `RankContext` for an LLM microbatch (``input_ids`` ``[B, L]``, packed
    ``segments`` or None) as the runtime runs it (cornstarch.md §3.3): one BAM per row with the
    LLM's own mask (``item_attention="causal"``: causal inside each packed sample, what the
    single-process model computes), blocks of `cp_block` tokens distributed by LPT over their
    workloads (§3.3.3, summed over the rows), every rank computing the same split from the
    same metadata, so nothing is exchanged. ``block`` overrides the block size (the unit fixes
    it before padding rows to whole blocks: `UnitPlace.prepare_microbatches`)."""
    length = int(input_ids.shape[1])
    if length < cp:
        raise ValueError(f"plan.modules['llm'].context_parallel = {cp} but a microbatch's LLM rows have {length} "
                         f"tokens: every CP rank needs at least one; lower context_parallel, pack the rows "
                         f"(data.pack_sequences = true) or use longer samples")
    modalities = tuple(placeholder_ids)
    bams = [bitfield_mask(row_spans(row, segments, placeholder_ids), modalities=modalities, item_attention="causal")
            for row in input_ids]
    distribution = distribute_tokens(bams, cp, block or cp_block(length, cp), method="lpt")
    return rank_context(bams, distribution, rank, group)
