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
   needed; when every payload is already where it runs, the collective is skipped. A rank
   that hosts several phases (``placement = "first_stage"``: the encoders on the LLM's first
   stage) gets each one's payloads in the same collective, and one `Batch` per slot with all
   of them, as `loom.data.collate.collate` gives the single process.

Encoder outputs then travel along the schedule's routed edges straight to the LLM microbatch
of their sample (OrchMLLM's rearrangement composition), and their gradients back along the
same edges, transposed (`loom.runtime.executor`, `loom.runtime.rows`).

A payload that disagrees with its metadata fails on *every* rank with the same message (the
error travels with the gathered metadata), so no rank is left waiting in a collective. With
``on_error = "skip"`` (``data.on_error``) a sample that fails to load (a missing or corrupt file,
a bad record, a payload that contradicts its metadata, an item its encoder refuses) is replaced
by the next dataset index that loads, within its split (the training range or the held-out
one, `loom.data.sampler.next_in_split`): the global batch keeps its size, the replacement is a pure
function of the data (whichever rank loads the position finds the same one), and the loss
normalisation counts the replacement's targets, as the gathered metadata does. Each skip is logged on the loading rank
(stderr: its ``logs/rank<R>.log``) and counted (`Dispatched.skipped`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import sys

import numpy as np
import torch
import torch.distributed as dist

from loom.schedule.layout import BatchLayout
from loom.balance.payload import loader_rank_of, slot_destinations
from loom.balance.policy import BalanceConfig, SampleCosts, make_layout, sample_costs
from loom.cost.arch import ModelArch
from loom.cost.workload import GENERATOR_NAMES, MetadataArrays, per_sample_sum
from loom.data.collate import (MODALITY_KINDS, Generations, TokenCounts, check_generations, collate_ids,
                               encoder_modalities, encoder_modality, flagged_ids, generation_seed, item_token_count)
from loom.data.sample import AudioMeta, Batch, ImageMeta, Sample, SampleMeta
from loom.data.sampler import next_in_split
from loom.data.tokenizer import Tokenizer
from loom.plan.plan import LLM, Plan
from loom.runtime.metadata import all_gather_metadata
from loom.runtime.rows import RowMap


class DispatchError(ValueError):
    """A sample that cannot be dispatched (its payload disagrees with its metadata)."""


class SampleSource(Protocol):
    """What the dispatcher reads: ``source[i]`` is a `Sample` with its payload; ``len(source)``
    its samples (``on_error = "skip"`` wraps around within the sample's split, `Dispatcher.held_out`)."""

    def __getitem__(self, index: int) -> Sample: ...

    def __len__(self) -> int: ...


ON_ERROR = ("raise", "skip")
MAX_SKIPS = 64  # consecutive failing indices before "skip" gives up: the data is broken, not a sample


@dataclass
class Dispatched:
    """One iteration's data on this rank."""

    layout: BatchLayout
    rows: RowMap
    batches: dict[Any, Batch]  # this rank's microbatches, by slot (a colocated encoder's own: by (phase, slot))
    num_targets: int  # target tokens of the whole global batch (loss normalisation)
    metadata: MetadataArrays  # the global batch's metadata, by position
    costs: SampleCosts  # per-sample costs the policy balanced
    # per generator, its items in the whole global batch (its loss normalisation)
    num_generations: dict[str, int] = field(default_factory=dict)
    # with on_error = "skip": what this rank skipped while loading its shard, one line each
    skipped: list[str] = field(default_factory=list)
    _metas: list[SampleMeta] | None = field(default=None, repr=False)

    @property
    def metas(self) -> list[SampleMeta]:
        """The global batch's `SampleMeta`s, by position (built on first use: the dispatch
        itself works on `metadata`)."""
        if self._metas is None:
            self._metas = self.metadata.metas()
        return self._metas


class _ShapeMemo:
    """``token_counts[encoder]`` asked once per item shape (callers check what it returns with
    `item_token_count`, naming the sample)."""

    def __init__(self, fn) -> None:
        self.fn, self.memo = fn, {}
        self.modality = getattr(fn, "modality", None)  # a `TokenCounter`'s (`encoder_modality`)
        self.placeholder = getattr(fn, "placeholder", None)  # and its placeholder id

    def __call__(self, item: ImageMeta | AudioMeta):
        n = self.memo.get(item)  # the metadata dataclasses are frozen: hashable by value
        if n is None:
            if len(self.memo) > 1 << 16:  # a stream of ever-new shapes: keep the memo bounded
                self.memo.clear()
            n = self.memo[item] = self.fn(item)
        return n


def loader_shards(batch_size: int, world_size: int) -> list[list[int]]:
    """Positions each rank loads: contiguous, sizes differing by at most one."""
    return [list(map(int, part)) for part in np.array_split(np.arange(batch_size), world_size)]


class Dispatcher:
    """Builds every rank's microbatches of a global batch under a balancing policy."""

    # data.eval_samples: the dataset's last indices are a split of their own, which a skip's
    # replacement stays inside (as the training range's stays in it)
    held_out: int = 0

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
        generations: Generations | None = None,
        microbatch_tokens: int = 0,
        on_error: str = "raise",
    ):
        self.plan, self.dataset, self.tokenizer = plan, dataset, tokenizer
        self.token_counts, self.arch, self.balance = token_counts, arch, balance.check(plan.module_names)
        self.device, self.placeholder_ids, self.group = device, placeholder_ids, group
        self.pack = pack  # LLM microbatches as one packed row (then balancing costs the LLM as packed)
        self.microbatch_tokens = microbatch_tokens  # data.microbatch_tokens: a token budget per microbatch
        # per generator of the model, what collation needs of it (`loom.train.build.generation_specs`)
        self.generations = dict(generations or {})
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error = {on_error!r}: use one of {ON_ERROR}")
        self.on_error = on_error  # data.on_error: "skip" replaces a sample that fails to load (`_load`)
        missing = [g for g in plan.generator_names if g not in self.generations]
        if missing:
            raise ValueError(f"the plan has generators {missing} but the Dispatcher got no GenerationSpec for them: "
                             f"pass generations=generation_specs(model)")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.module, self.stage, self.replica = plan.role_of(self.rank)
        # every rank's phases (modules), in plan order: several where encoders run on the LLM's
        # ranks (placement first_stage); the exchange's chunks follow this order on both sides
        self._phases_of = [self._hosted(d) for d in range(self.world_size)]
        self.phases = self._phases_of[self.rank]
        self._replica_of = {m: r for m, _, r in plan.stages_of(self.rank)}  # this rank's replica of each
        # every step costs the same few item shapes: `token_counts` is asked once per shape
        self._counts = {encoder: _ShapeMemo(fn) for encoder, fn in token_counts.items()}
        # each encoder's modality (any name: its counter says it, `loom.data.collate.TokenCounter`)
        self._modality = encoder_modalities(token_counts)
        unplaced = [e for e in plan.encoder_names if e not in self._modality]
        if unplaced:
            raise ValueError(f"the plan has encoders {unplaced} but token_counts has no entry for them: pass "
                             f"token_counts=token_counters(model) of the model the plan places")

    def _hosted(self, rank: int) -> list[str]:
        hosted = {m for m, _, _ in self.plan.stages_of(rank)}
        return [m for m in self.plan.module_names if m in hosted]

    # ---- the iteration ------------------------------------------------------------------------
    def dispatch(self, indices: Sequence[int], step: int = 0) -> Dispatched:
        """This rank's microbatches of the global batch ``indices`` (dataset indices) at training
        ``step`` (a generator's noise seeds depend on it: `loom.data.collate.generation_seed`)."""
        shards = loader_shards(len(indices), self.world_size)
        mine = shards[self.rank]
        samples, text_ids, error, skipped = self._load(indices, mine)
        meta = all_gather_metadata([s.meta for s in samples], error, len(indices), self.device, self.group)
        errors = meta.errors()
        if errors:
            raise DispatchError(errors[min(errors)])
        costs = sample_costs(self.arch, meta)
        layout = make_layout(self.balance, self.plan, costs, "packed" if self.pack else "padded", self.microbatch_tokens)
        self._check_shared_slots(layout)
        tokens, items = self._encoder_rows(meta)
        rows = RowMap(layout, tokens, items)
        received = self._exchange(layout, meta, costs.payload_bytes, mine, samples, text_ids)
        batches = self._microbatches(layout, meta, received, step)
        # `loom.data.collate.target_count` summed: every text token after BOS but the markers (and requests),
        # or a sample's own count where its loss covers only some tokens (a chat's assistant turns)
        default = meta.text_tokens - meta.image_count - meta.audio_count - meta.generation_count - 1
        num_targets = int(np.where(meta.target_tokens >= 0, meta.target_tokens, default).sum())
        num_generations = {g: int((meta.generation_code == GENERATOR_NAMES.index(g)).sum()) for g in self.generations}
        return Dispatched(layout, rows, batches, num_targets, meta, costs, num_generations=num_generations,
                          skipped=skipped)

    def _check_shared_slots(self, layout: BatchLayout) -> None:
        """An encoder inside the LLM's first stage (``first_stage``) runs slot ``j`` with the
        LLM's slot ``j``: the layout must give both the same samples. Checked on the whole
        layout, so every rank refuses it together (none waits in a collective). A colocated
        encoder runs its own slots (`_microbatches`)."""
        for encoder in self.plan.encoder_names:
            if self.plan.placement == "first_stage" and not layout.shares_llm_slots(encoder):
                j = next((j for j in range(layout.num_microbatches) if layout.slot(encoder, j) != layout.slot(LLM, j)), 0)
                raise DispatchError(
                    f"the layout puts global batch positions {list(layout.slot(encoder, j))} in slot {j} of "
                    f"{encoder!r} but {list(layout.slot(LLM, j))} in the LLM's: with plan.placement = "
                    f"{self.plan.placement!r} an encoder runs each LLM microbatch's own samples; set "
                    f"balance.default = 'none' and name no balance.policy")

    def _load(self, indices: Sequence[int],
              mine: list[int]) -> tuple[list[Sample], list[list[int]], str | None, list[str]]:
        """This rank's samples and their text ids, the first error (``None`` if none) and, with
        ``on_error = "skip"``, a line per skipped index (each replaced by the next index that
        loads, wrapping around; `MAX_SKIPS` failures in a row are an error)."""
        samples, ids, skipped = [], [], []
        for p in mine:
            index = indices[p]
            for attempt in range(MAX_SKIPS + 1):
                try:
                    sample, text = self._load_one(index)
                    break
                except (ValueError, KeyError, IndexError, OSError) as e:
                    where = f"rank {self.rank}, global batch position {p} (dataset index {index})"
                    if self.on_error != "skip":
                        return samples, ids, f"{where}: {e}", skipped
                    if attempt == MAX_SKIPS:
                        return samples, ids, (f"{where}: {e}; data.on_error = 'skip' gave up after {MAX_SKIPS} failing "
                                              f"samples in a row from dataset index {indices[p]}: check the data"), skipped
                    skipped.append(f"{where}: {' '.join(str(e).split())}")
                    print(f"loom: skipped {skipped[-1]}", file=sys.stderr, flush=True)
                    index = next_in_split(index, len(self.dataset), self.held_out)
            samples.append(sample)
            ids.append(text)
        return samples, ids, None, skipped

    def _load_one(self, index: int) -> tuple[Sample, list[int]]:
        """Sample ``index`` with its payload checked against its metadata, and its text ids."""
        sample = self.dataset[index]
        sample.check_payload()
        check_generations(sample.meta, self.generations)  # a generator the model has, of its size
        for encoder, count in self._counts.items():  # an item its encoder refuses (an image side the patch
            for item in getattr(sample.meta, self._field(encoder)):  # does not divide) fails as its sample
                item_token_count(encoder, count, item, sample.meta.sample_id)
        text = flagged_ids(self.tokenizer, sample.text, sample.target_spans)  # targets flagged (a chat's turns)
        if len(text) != sample.meta.text_tokens:
            raise ValueError(
                f"sample {sample.meta.sample_id}: the text has {len(text)} token ids but meta.text_tokens "
                f"says {sample.meta.text_tokens}; regenerate the sample's metadata"
            )
        return sample, text

    # ---- token rows per sample ----------------------------------------------------------------
    def _encoder_rows(self, meta: MetadataArrays) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """Per encoder of the plan, each position's output rows (the sum of ``token_counts`` over
        its items: `loom.data.collate.count_tokens`) and item count, and per generator the LLM's
        state rows of each position (``cond_tokens`` per request) and its requests, as lists for
        `RowMap`."""
        for modality, count in (("image", meta.image_count), ("audio", meta.audio_count)):
            if modality not in self._modality.values() and count.any():
                s = int(np.flatnonzero(count)[0])
                raise DispatchError(
                    f"sample {int(meta.sample_id[s])} has {int(count[s])} {MODALITY_KINDS[modality].sample_field} but "
                    f"token_counts has no {modality} encoder; add one, or filter such samples out")
        tokens, items = {}, {}
        for encoder in self.plan.encoder_names:
            count = meta.image_count if self._modality[encoder] == "image" else meta.audio_count
            tokens[encoder] = per_sample_sum(count, self._item_tokens(encoder, meta)).tolist()
            items[encoder] = count.tolist()
        owner = np.repeat(np.arange(meta.num_samples), meta.generation_count) if self.generations else None
        for g, spec in self.generations.items():  # the LLM's states of each sample's requests
            asks = np.bincount(owner[meta.generation_code == GENERATOR_NAMES.index(g)], minlength=meta.num_samples)
            tokens[g], items[g] = (asks * spec.cond_tokens).tolist(), asks.tolist()
        return tokens, items

    def _item_tokens(self, encoder: str, meta: MetadataArrays) -> np.ndarray:
        """``token_counts[encoder]`` of every item of the encoder's modality, called once per
        distinct item shape (a run sees few; the memo is kept across steps)."""
        image = self._modality[encoder] == "image"
        if image:
            keys, make = meta.image_hw, ImageMeta
        else:
            keys, make = np.stack([meta.audio_samples, meta.audio_rate], axis=1), AudioMeta
        if not keys.shape[0]:
            return np.zeros(0, dtype=np.int64)
        shapes, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        owner = meta.image_owner if image else meta.audio_owner
        count = self._counts[encoder]
        counts = [item_token_count(encoder, count, make(*key), int(meta.sample_id[owner[item]]))
                  for key, item in zip(shapes.tolist(), first.tolist())]
        return np.asarray(counts, dtype=np.int64)[inverse.reshape(-1)]

    # ---- payload exchange ---------------------------------------------------------------------
    def _destinations(self, phase: str, layout: BatchLayout) -> np.ndarray:
        """``dest[s, stage]``: the ranks that need position ``s``'s ``phase`` payload (every stage
        of the replica that holds it: later stages need the items' shapes or the ids for their
        context), as `loom.balance.payload` prices them."""
        index = layout.slot_index(phase)
        return slot_destinations(self.plan, phase, len(layout.arrays[phase][1]) - 1)[index]

    def _exchange(self, layout: BatchLayout, meta: MetadataArrays, payload_bytes: Mapping[str, np.ndarray], mine: list[int],
                  samples: list[Sample], text_ids: list[list[int]]) -> dict[str, dict[int, list | np.ndarray]]:
        """One ``all_to_all_single`` for every phase at once: rank ``d`` gets the payloads of
        each phase it hosts (as bytes: pixels and waveforms in float32, ids in int64) of the
        samples it runs there; returns, on this rank, phase -> position -> payload (item
        tensors, or text ids). Inside each rank pair's chunk the payloads go by phase in plan
        order, then by position (sender and receiver derive the same order). Byte counts come
        from metadata on both sides. When no payload has to leave the rank that loaded it
        (every rank runs exactly what it loaded), every rank knows so from the same layout and
        the collective is skipped."""
        world, me = self.world_size, self.rank
        local = dict(zip(mine, zip(samples, text_ids)))
        dests = {phase: self._destinations(phase, layout) for phase in self.plan.module_names}
        owner = loader_rank_of(meta.num_samples, world)
        if all((d == owner[:, None]).all() for d in dests.values()):
            return {phase: {p: self._payload(phase, *local[p]) for p in mine} for phase in self.phases}
        first = mine[0] if mine else 0
        send: list[torch.Tensor] = []
        in_splits = [0] * world
        flats: dict[tuple[str, int], torch.Tensor] = {}  # a payload goes to every stage of its replica
        for d in range(world):
            for phase in self._phases_of[d]:
                for p in np.flatnonzero((dests[phase][first:first + len(mine)] == d).any(axis=1)).tolist():
                    key = (phase, first + p)
                    if key not in flats:
                        flats[key] = self._flat(phase, *local[first + p])
                    send.append(flats[key])
                    in_splits[d] += send[-1].numel()
        # what this rank receives, in the senders' order: by source rank, then phase, then position
        wanted = [np.flatnonzero((dests[phase] == me).any(axis=1)) for phase in self.phases]
        positions = np.concatenate(wanted) if wanted else np.zeros(0, dtype=np.int64)
        phase_index = np.repeat(np.arange(len(wanted)), [w.size for w in wanted])
        nbytes = (np.concatenate([np.asarray(payload_bytes[phase], dtype=np.int64)[w]
                                  for phase, w in zip(self.phases, wanted)])
                  if wanted else np.zeros(0, dtype=np.int64))
        order = np.lexsort((positions, phase_index, owner[positions]))
        out_splits = np.bincount(owner[positions], weights=nbytes, minlength=world).astype(np.int64).tolist()
        payload = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, payload.to(self.device), out_splits, in_splits, group=self.group)
        out = out.cpu()
        result: dict[str, dict[int, list | np.ndarray]] = {phase: {} for phase in self.phases}
        offset = 0
        for i in order.tolist():
            phase, p, n = self.phases[int(phase_index[i])], int(positions[i]), int(nbytes[i])
            result[phase][p] = self._unflat(phase, meta, p, out[offset:offset + n])
            offset += n
        return result

    def _payload(self, phase: str, sample: Sample, ids: list[int]) -> list | np.ndarray:
        """A sample's ``phase`` payload as `_unflat` gives it, from the sample itself (it stayed
        on the rank that loaded it)."""
        if phase == LLM:
            return np.asarray(ids, dtype=np.int64)
        return [t.to(torch.float32) for t in self._items(phase, sample)]

    def _items(self, phase: str, sample: Sample) -> list[torch.Tensor]:
        """A sample's tensors for ``phase``: an encoder's items, or a generator's targets."""
        if phase in self.generations:
            return [t for t, g in zip(sample.targets, sample.meta.generations) if g.generator == phase]
        return getattr(sample, self._field(phase))

    def _field(self, encoder: str) -> str:
        """The attribute of ``Sample`` / ``SampleMeta`` holding ``encoder``'s items."""
        return MODALITY_KINDS[encoder_modality(encoder, self._counts[encoder])].sample_field

    def _flat(self, phase: str, sample: Sample, ids: list[int]) -> torch.Tensor:
        """A sample's ``phase`` payload as bytes (`_unflat` reads them back)."""
        if phase == LLM:
            return torch.tensor(ids, dtype=torch.long).view(torch.uint8)
        items = self._items(phase, sample)
        if not items:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat([t.reshape(-1).to(torch.float32) for t in items]).view(torch.uint8)

    def _unflat(self, phase: str, meta: MetadataArrays, p: int, flat: torch.Tensor) -> list | np.ndarray:
        # a copy: the slice of the received buffer may not be aligned for the wider dtype
        if phase == LLM:
            return flat.clone().view(torch.long).numpy()
        values = flat.clone().view(torch.float32)
        if phase in self.generations:
            b = meta.generation_bounds
            mine = meta.generation_code[b[p]:b[p + 1]] == GENERATOR_NAMES.index(phase)
            shapes = [(3, h, w) for h, w in meta.generation_hw[b[p]:b[p + 1]][mine].tolist()]
        elif self._modality[phase] == "image":
            b = meta.bounds[0]
            shapes = [(3, h, w) for h, w in meta.image_hw[b[p]:b[p + 1]].tolist()]
        else:
            b = meta.bounds[1]
            shapes = [(k,) for k in meta.audio_samples[b[p]:b[p + 1]].tolist()]
        items, offset = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            items.append(values[offset:offset + n].reshape(shape))
            offset += n
        return items

    # ---- microbatches -------------------------------------------------------------------------
    def _modality_inputs(self, phases: list[str], slot: Sequence[int],
                         received: dict[str, dict[int, list | np.ndarray]]) -> dict[str, dict[str, list]]:
        """The ``modality_inputs`` of ``phases`` for the samples at positions ``slot``."""
        return {phase: {MODALITY_KINDS[self._modality[phase]].input_key: [t for p in slot for t in received[phase][p]]}
                for phase in phases}

    def _generation_inputs(self, slot: Sequence[int], meta: MetadataArrays, step: int,
                           received: dict[str, dict[int, list | np.ndarray]]) -> dict[str, dict[str, list]]:
        """The ``generation_inputs`` of the generators this rank hosts for the samples at
        positions ``slot``: their targets and noise seeds, as `loom.data.collate.collate` gives
        the single process (a request's seed from its index among its sample's requests)."""
        out: dict[str, dict[str, list]] = {}
        bounds = meta.generation_bounds
        for g in (p for p in self.phases if p in self.generations):
            code, seeds = GENERATOR_NAMES.index(g), []
            for p in slot:
                sid = int(meta.sample_id[p])
                codes = meta.generation_code[bounds[p]:bounds[p + 1]].tolist()
                seeds.extend(generation_seed(sid, i, step) for i, c in enumerate(codes) if c == code)
            out[g] = {"targets": [t for p in slot for t in received[g][p]], "seeds": seeds}
        return out

    def _microbatches(self, layout: BatchLayout, meta: MetadataArrays,
                      received: dict[str, dict[int, list | np.ndarray]], step: int = 0) -> dict[Any, Batch]:
        """This rank's microbatches, by slot. A rank hosting several phases (encoders on the LLM's
        ranks) gets one `Batch` per slot with every hosted phase's fields, as `collate` gives the
        single process: the LLM's ids, labels and segments and the encoders'
        ``modality_inputs``. A colocated encoder whose slot ``j`` holds other samples than the
        slot's main phase (the LLM's, else the first hosted) under a balanced layout gets a
        `Batch` of its own under ``(phase, j)`` (`PipelineExecutor._microbatch`)."""
        batches: dict[Any, Batch] = {}
        if self.plan.coordinate_of(self.rank)[3:] != (0, 0):  # payloads go to a unit's leader, which
            return batches  # shares them with its unit (`loom.runtime.unit.UnitPlace.share_microbatches`)
        held: dict[int, dict[str, tuple[int, ...]]] = {}  # slot -> phase -> its positions
        for phase in self.phases:
            for j, slot in enumerate(layout.slots[phase]):
                if self.plan.replica_of_microbatch(phase, j) == self._replica_of[phase]:
                    held.setdefault(j, {})[phase] = tuple(slot)
        for j in sorted(held):
            slots = held[j]
            main = slots.get(LLM, next(iter(slots.values())))
            for phase in [p for p in slots if slots[p] != main]:  # a colocated encoder's own samples
                own = slots.pop(phase)
                empty = torch.zeros((len(own), 0), dtype=torch.long)
                batches[(phase, j)] = Batch(empty, empty.clone(), self._modality_inputs([phase], own, received),
                                            meta.sample_id[list(own)].tolist())
            slot = main
            ids = meta.sample_id[list(slot)].tolist()
            modality_inputs = self._modality_inputs([p for p in slots if p != LLM and p not in self.generations],
                                                    slot, received)
            generation_inputs = self._generation_inputs(slot, meta, step, received)
            if LLM in slots:
                input_ids, labels, segments = collate_ids([meta.meta(p) for p in slot],
                                                          [received[LLM][p] for p in slot], self.tokenizer,
                                                          self._counts, self.placeholder_ids, self.pack,
                                                          self.generations)
                batches[j] = Batch(input_ids, labels, modality_inputs, ids, segments, generation_inputs)
            else:
                empty = torch.zeros((len(slot), 0), dtype=torch.long)
                batches[j] = Batch(empty, empty.clone(), modality_inputs, ids, generation_inputs=generation_inputs)
        return batches
