"""The batch dispatcher: metadata gathered, one decision on every rank, payloads moved once.

Per iteration (orchmllm.md §2.2, "adopted"; docs/architecture.md principle 4):

1. every rank reads the samples of its *loader shard* (a contiguous share of the global batch,
   as a distributed data loader would give it) and checks each payload against its metadata;
2. the metadata alone (and any payload error) is all-gathered as one int tensor
   (`loom.runtime.metadata`), so every rank knows the whole batch's shapes without having
   seen its pixels;
3. every rank runs the same deterministic balancing policy (`loom.balance.policy.make_layout`)
   and gets the same `BatchLayout`;
4. one ``all_to_all_single`` for all phases at once moves each sample's payload for each
   phase from its loader rank straight to the ranks that run it there: the items' pixels or
   waveforms to every stage of the encoder replica holding the sample, the text ids to every
   stage of the LLM replica holding it. Split sizes come from metadata, so no size exchange is
   needed; when every payload is already where it runs, the collective is skipped.

Encoder outputs then travel along the schedule's routed edges straight to the LLM microbatch
of their sample (OrchMLLM's rearrangement composition), and their gradients back along the
same edges, transposed (`loom.runtime.executor`, `loom.runtime.rows`).

A payload that disagrees with its metadata fails on *every* rank with the same message (the
error travels with the gathered metadata), so no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from loom.schedule.layout import BatchLayout
from loom.balance.payload import ELEMENT_BYTES
from loom.balance.policy import BalanceConfig, SampleCosts, make_layout, sample_costs
from loom.cost.arch import ModelArch
from loom.data.collate import MODALITIES, SAMPLE_FIELDS, TokenCounts, collate_ids, count_tokens, target_count
from loom.data.sample import Batch, Sample, SampleMeta
from loom.data.tokenizer import Tokenizer
from loom.plan.plan import LLM, Plan
from loom.runtime.metadata import all_gather_metadata
from loom.runtime.rows import RowMap


class DispatchError(ValueError):
    """A sample that cannot be dispatched (its payload disagrees with its metadata)."""


class SampleSource(Protocol):
    """What the dispatcher reads: ``source[i]`` is a `Sample` with its payload."""

    def __getitem__(self, index: int) -> Sample: ...


@dataclass
class Dispatched:
    """One iteration's data on this rank."""

    layout: BatchLayout
    rows: RowMap
    batches: dict[int, Batch]  # this rank's microbatches, by slot
    num_targets: int  # target tokens of the whole global batch (loss normalisation)
    metas: list[SampleMeta]  # the global batch's metadata, by position
    costs: SampleCosts  # per-sample costs the policy balanced


def loader_shards(batch_size: int, world_size: int) -> list[list[int]]:
    """Positions each rank loads: contiguous, sizes differing by at most one."""
    return [list(map(int, part)) for part in np.array_split(np.arange(batch_size), world_size)]


class Dispatcher:
    """Builds every rank's microbatches of a global batch under a balancing policy."""

    def __init__(
        self,
        plan: Plan,
        dataset: "SampleSource",
        tokenizer: Tokenizer,
        token_counts: TokenCounts,
        arch: ModelArch,
        balance: BalanceConfig,
        device: torch.device,
        placeholder_ids: Mapping[str, int] | None = None,
        group: dist.ProcessGroup | None = None,
        pack: bool = False,
    ):
        self.plan, self.dataset, self.tokenizer = plan, dataset, tokenizer
        self.token_counts, self.arch, self.balance = token_counts, arch, balance.check(plan.module_names)
        self.device, self.placeholder_ids, self.group = device, placeholder_ids, group
        self.pack = pack  # LLM microbatches as one packed row (then balancing costs the LLM as packed)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.module, self.stage, self.replica = plan.role_of(self.rank)

    # ---- the iteration ------------------------------------------------------------------------
    def dispatch(self, indices: Sequence[int]) -> Dispatched:
        """This rank's microbatches of the global batch ``indices`` (dataset indices)."""
        shards = loader_shards(len(indices), self.world_size)
        mine = shards[self.rank]
        samples, text_ids, error = self._load(indices, mine)
        gathered = all_gather_metadata([s.meta for s in samples], error, len(indices), self.device, self.group)
        errors = [e for _, e in gathered if e]
        if errors:
            raise DispatchError(errors[0])
        metas = [m for part, _ in gathered for m in part]
        costs = sample_costs(self.arch, metas)
        layout = make_layout(self.balance, self.plan, costs, "packed" if self.pack else "padded")
        counts = [count_tokens(m, self.token_counts) for m in metas]
        rows = RowMap(layout, {e: [c[e] for c in counts] for e in self.plan.encoder_names},
                      {e: [len(getattr(m, SAMPLE_FIELDS[e])) for m in metas] for e in self.plan.encoder_names})

        received = self._exchange(layout, metas, shards, dict(zip(mine, samples)), dict(zip(mine, text_ids)))
        batches = self._microbatches(layout, metas, received)
        return Dispatched(layout, rows, batches, sum(target_count(m) for m in metas), metas, costs)

    def _load(self, indices: Sequence[int], mine: list[int]) -> tuple[list[Sample], list[list[int]], str | None]:
        samples, ids = [], []
        for p in mine:
            try:
                sample = self.dataset[indices[p]]
                sample.check_payload()
                text = self.tokenizer.encode(sample.text)
                if len(text) != sample.meta.text_tokens:
                    raise ValueError(
                        f"sample {sample.meta.sample_id}: the text has {len(text)} token ids but meta.text_tokens "
                        f"says {sample.meta.text_tokens}; regenerate the sample's metadata"
                    )
            except (ValueError, KeyError, IndexError, OSError) as e:
                return samples, ids, f"rank {self.rank}, global batch position {p} (dataset index {indices[p]}): {e}"
            samples.append(sample)
            ids.append(text)
        return samples, ids, None

    # ---- payload exchange ---------------------------------------------------------------------
    def _destinations(self, phase: str, layout: BatchLayout) -> dict[int, list[int]]:
        """position -> the ranks that need its ``phase`` payload (every stage of the replica
        that holds it: later stages need the items' shapes or the ids for their context)."""
        spec = self.plan.spec(phase)
        return {s: [self.plan.rank_of(phase, st, j % spec.data_parallel) for st in range(spec.num_stages)]
                for s, j in layout.slot_of(phase).items()}

    def _nbytes(self, phase: str, meta: SampleMeta) -> int:
        # the element sizes the balancer prices node-wise traffic with (loom.balance.payload)
        if phase == LLM:
            return ELEMENT_BYTES[LLM] * meta.text_tokens  # int64 ids
        items = getattr(meta, SAMPLE_FIELDS[phase])
        return ELEMENT_BYTES[phase] * sum(3 * m.height * m.width if phase == "vision" else m.num_samples
                                          for m in items)  # float32 pixels or waveform samples

    def _exchange(self, layout, metas, shards, local_samples, local_ids) -> dict[int, list]:
        """One ``all_to_all_single`` for every phase at once: rank ``d`` gets the payloads of
        its own module's phase (as bytes: pixels and waveforms in float32, ids in int64) of the
        samples it runs; returns, on this rank, position -> payload (item tensors, or text ids).
        Byte counts come from metadata on both sides. When no payload has to leave the rank that
        loaded it (every rank runs exactly what it loaded), every rank knows so from the same
        layout and the collective is skipped."""
        world, me = self.world_size, self.rank
        dests = {phase: self._destinations(phase, layout) for phase in self.plan.module_names}
        owner = {p: r for r, shard in enumerate(shards) for p in shard}
        if all(d == owner[p] for dest in dests.values() for p, ranks in dest.items() for d in ranks):
            return {p: self._unflat(self.module, metas[p], self._flat(self.module, local_samples[p], local_ids[p]))
                    for p in shards[me] if p in dests[self.module]}
        phase_of = [self.plan.role_of(d)[0] for d in range(world)]
        send: list[torch.Tensor] = []
        in_splits = [0] * world
        for d in range(world):
            dest = dests[phase_of[d]]
            for p in shards[me]:
                if d in dest[p]:
                    send.append(self._flat(phase_of[d], local_samples[p], local_ids[p]))
                    in_splits[d] += send[-1].numel()
        mine = dests[self.module]
        wanted = [[p for p in shards[src] if me in mine[p]] for src in range(world)]
        out_splits = [sum(self._nbytes(self.module, metas[p]) for p in w) for w in wanted]
        payload = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, payload.to(self.device), out_splits, in_splits, group=self.group)
        out = out.cpu()
        result: dict[int, list] = {}
        offset = 0
        for p in (p for w in wanted for p in w):
            n = self._nbytes(self.module, metas[p])
            result[p] = self._unflat(self.module, metas[p], out[offset:offset + n])
            offset += n
        return result

    def _flat(self, phase: str, sample: Sample, ids: list[int]) -> torch.Tensor:
        """A sample's ``phase`` payload as bytes (`_unflat` reads them back)."""
        if phase == LLM:
            return torch.tensor(ids, dtype=torch.long).view(torch.uint8)
        items = getattr(sample, SAMPLE_FIELDS[phase])
        if not items:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in items]).view(torch.uint8)

    def _unflat(self, phase: str, meta: SampleMeta, flat: torch.Tensor) -> list:
        # a copy: the slice of the received buffer may not be aligned for the wider dtype
        if phase == LLM:
            return flat.clone().view(torch.long).tolist()
        values = flat.clone().view(torch.float32)
        items, offset = [], 0
        for m in getattr(meta, SAMPLE_FIELDS[phase]):
            shape = (3, m.height, m.width) if phase == "vision" else (m.num_samples,)
            n = int(np.prod(shape))
            items.append(values[offset:offset + n].reshape(shape).clone())
            offset += n
        return items

    # ---- microbatches -------------------------------------------------------------------------
    def _microbatches(self, layout: BatchLayout, metas: list[SampleMeta], received: dict[int, list]) -> dict[int, Batch]:
        dp = self.plan.spec(self.module).data_parallel
        batches = {}
        for j, slot in enumerate(layout.slots[self.module]):
            if j % dp != self.replica:
                continue
            slot_metas = [metas[p] for p in slot]
            ids = [m.sample_id for m in slot_metas]
            if self.module == LLM:
                input_ids, labels, segments = collate_ids(slot_metas, [received[p] for p in slot], self.tokenizer,
                                                          self.token_counts, self.placeholder_ids, self.pack)
                batches[j] = Batch(input_ids, labels, {}, ids, segments)
            else:
                key = MODALITIES[self.module][1]
                items = [t for p in slot for t in received[p]]
                empty = torch.zeros((len(slot), 0), dtype=torch.long)
                batches[j] = Batch(empty, empty.clone(), {self.module: {key: items}}, ids)
        return batches

