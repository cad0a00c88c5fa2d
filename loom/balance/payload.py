"""Where a layout's payload bytes go: per sample, from its loader rank to the ranks of the slot
that holds it, per phase (orchmllm.md §3.9, the communication the dispatcher's all-to-all pays).

The dispatcher (`loom.runtime.dispatch`) moves each sample's payload for a phase, once, from the
rank that loaded it (contiguous loader shards of the global batch, `loader_rank_of`) to every
pipeline stage of the replica holding the sample's slot in that phase (slot ``j`` of a module
of data-parallel degree ``dp`` runs on replica ``j % dp``). Rank ``r`` sits on node
``r // ranks_per_node``. Everything here is a pure function of the plan, the layout and the
per-sample bytes, so the balancing policy (node-wise rearrangement, orchmllm.md §3.10), the
simulator and the tests price the same exchange. A layout that node-wise rearrangement
permuted keeps, per phase, the slot each slot's samples had before (``layout.unpermuted_slot``),
so the bytes can be priced with and without the permutation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from loom.cost.arch import ModelArch
from loom.cost.workload import GENERATOR_NAMES, MetadataArrays
from loom.plan.plan import LLM, Plan
from loom.schedule.layout import BatchLayout

# Bytes per payload element, as the runtime sends them: float32 pixels and waveforms, int64 ids
# (`loom.runtime.dispatch.Dispatcher._exchange`).
ELEMENT_BYTES = {"vision": 4, "audio": 4, LLM: 8}
TARGET_BYTES = 4  # a generator's target images: float32 pixels


class PayloadError(ValueError):
    """A bad input to the payload rule; the message names the argument and the fix."""


def sample_payload_bytes(arch: ModelArch, meta: MetadataArrays) -> dict[str, np.ndarray]:
    """Per phase, each sample's payload bytes (float64 arrays over positions): its images'
    pixels (3 x height x width) to a vision encoder, its clips' waveform samples to an audio
    encoder, its text ids (``text_tokens``) to the LLM; `ELEMENT_BYTES` per element; its
    generation targets to a generator (`generation_payload_bytes`).
    The dispatcher sends exactly these bytes (`loom.runtime.dispatch.Dispatcher._nbytes`)."""
    n = meta.num_samples
    out: dict[str, np.ndarray] = {LLM: meta.text_tokens.astype(np.float64) * ELEMENT_BYTES[LLM]}
    for name in arch.encoder_names:
        kind = arch.module(name).kind
        if kind == "vision":
            hw = meta.image_hw.reshape(-1, 2).astype(np.float64)
            out[name] = np.bincount(meta.image_owner, weights=3.0 * hw[:, 0] * hw[:, 1], minlength=n) * ELEMENT_BYTES[kind]
        elif kind == "audio":
            out[name] = np.bincount(meta.audio_owner, weights=meta.audio_samples.astype(np.float64),
                                    minlength=n) * ELEMENT_BYTES[kind]
        else:
            raise PayloadError(f"encoder {name!r} has kind {kind!r}: no payload rule; known: vision, audio")
    for name in arch.generator_names:  # a generator's ranks get its targets
        out[name] = generation_payload_bytes(meta, name)
    return out


def generation_payload_bytes(meta: MetadataArrays, generator: str) -> np.ndarray:
    """Each sample's payload bytes to ``generator``: its target images' pixels (3 x height x
    width, `TARGET_BYTES` each) of the requests naming that generator."""
    if generator not in GENERATOR_NAMES:
        raise PayloadError(f"generator {generator!r}: no payload rule; known generators: {list(GENERATOR_NAMES)}")
    mine = meta.generation_code == GENERATOR_NAMES.index(generator)
    owner = np.repeat(np.arange(meta.num_samples), meta.generation_count)[mine]
    hw = meta.generation_hw[mine].astype(np.float64)
    return np.bincount(owner, weights=3.0 * hw[:, 0] * hw[:, 1], minlength=meta.num_samples) * TARGET_BYTES


def loader_rank_of(batch_size: int, world_size: int) -> np.ndarray:
    """The rank that loads each position of the global batch: contiguous shards, sizes
    differing by at most one, the larger first (`loom.runtime.dispatch.loader_shards`,
    `np.array_split`), as an array."""
    if world_size < 1:
        raise PayloadError(f"world_size = {world_size}: use a positive rank count")
    base, extra = divmod(batch_size, world_size)
    pos = np.arange(batch_size, dtype=np.int64)
    cut = extra * (base + 1)  # the first `extra` ranks load base + 1 positions
    return np.where(pos < cut, pos // (base + 1), extra + (pos - cut) // max(base, 1))


def slot_destinations(plan: Plan, phase: str, num_slots: int) -> np.ndarray:
    """``dest[j, stage]``: the ranks that receive the payload of slot ``j`` of ``phase`` (every
    stage of replica ``j % dp``, tensor and context rank 0 as the dispatcher sends)."""
    spec = plan.spec(phase)
    # `Plan.rank_of(phase, stage, replica)` at tensor and context rank 0, over arrays
    unit = np.arange(spec.pipeline_depth)[None, :] * spec.data_parallel + np.arange(spec.data_parallel)[:, None]
    per_replica = plan.rank_offset(phase) + unit * (spec.context_parallel * spec.tensor_parallel)
    replicas = np.array([plan.replica_of_microbatch(phase, j) for j in range(num_slots)], dtype=np.int64)
    return per_replica.astype(np.int64)[replicas]


def phase_slot_index(layout: BatchLayout, phase: str, permuted: bool = True) -> np.ndarray:
    """Each sample's slot of ``phase``; with ``permuted=False``, the slot it had before
    node-wise rearrangement (the same when none was applied)."""
    idx = layout.slot_index(phase)
    undo = getattr(layout, "unpermuted_slot", {}).get(phase)
    return idx if permuted or undo is None else undo[idx]


def payload_matrix(plan: Plan, layout: BatchLayout, phase: str, sample_bytes: Sequence[float] | np.ndarray,
                   permuted: bool = True, world_size: int | None = None) -> np.ndarray:
    """The ``world x world`` bytes ``[src, dst]`` of ``phase``'s all-to-all for ``layout``
    (with or without its node-wise permutation); the diagonal stays in memory."""
    world = plan.world_size if world_size is None else world_size
    size = np.asarray(sample_bytes, dtype=np.float64)
    src, dst, vol = _flows(plan, layout, phase, size, permuted, world)
    return np.bincount(src * world + dst, weights=vol, minlength=world * world).reshape(world, world)


def layout_payload_bytes(plan: Plan, layout: BatchLayout, sample_bytes: Mapping[str, Sequence[float] | np.ndarray],
                         permuted: bool = True, world_size: int | None = None) -> dict[str, np.ndarray]:
    """Per phase, `payload_matrix`: what the simulator prices (`loom.sim.dispatch`)."""
    return {p: payload_matrix(plan, layout, p, sample_bytes[p], permuted, world_size) for p in plan.module_names}


def _flows(plan: Plan, layout: BatchLayout, phase: str, size: np.ndarray, permuted: bool,
           world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source rank, destination rank, bytes) of every sample's payload to every stage."""
    n = size.size
    slot = phase_slot_index(layout, phase, permuted)
    if slot.size != n:
        raise PayloadError(f"sample_bytes[{phase!r}] has {n} entries; the layout places {slot.size} samples: "
                           f"give one byte count per position of the global batch")
    dest = slot_destinations(plan, phase, layout.num_microbatches)[slot]  # (n, stages)
    stages = dest.shape[1]
    return np.repeat(loader_rank_of(n, world), stages), dest.ravel(), np.repeat(size, stages)
