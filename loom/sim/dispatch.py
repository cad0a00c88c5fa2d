"""The batch dispatch, priced: what `loom.runtime.dispatch.Dispatcher` costs every step before
the schedule starts (orchmllm.md §2.2; docs/architecture.md principle 4, "decide on metadata, move data
once").

Every rank of ``loom train`` runs, per step:

1. an **all-gather of the metadata** of the global batch over the world (each rank contributes
   its loader shard's int64 array), priced as a ring all-gather of `metadata_bytes` (alpha-beta,
   `loom.cost.comm.all_gather_time`) over the world's link (inter-node once the world spans
   nodes);
2. the **layout decision** (`loom.balance.policy.make_layout` on the gathered metadata): every
   rank computes the same layout, so it costs each rank its wall time. It is an input
   (``decision_seconds``: a measured figure such as `benchmarks/balance_speed.py`'s
   ``decide_ms_<policy>``); `decision_seconds_model` is the default when none is measured;
3. one **payload all-to-all per phase** (each encoder, then the LLM), priced from the bytes every
   source rank sends to every destination rank (``payload[phase][src, dst]``:
   `loom.balance.payload.layout_payload_bytes` of the layout). A rank's bytes to itself stay in
   memory; a phase whose bytes all stay home skips the collective (it costs 0). When OrchMLLM's
   node-wise rearrangement permuted the layout (orchmllm.md §3.10, ``balance.ranks_per_node``),
   the same exchange without the permutation (``payload_unpermuted``) is priced beside it, for
   comparison only: the step pays the permuted one.

Beside these, the dispatcher's own **host work** (reading and checking its shard's samples,
tokenising, the metadata codec, packing and unpacking the exchange, collating its microbatches)
costs CPU on every rank (``host_seconds``, per rank; the slowest paces the step's
collectives); a profile measures it (`loom.profile.dispatch`, ``Profile.dispatch_host_seconds``)
at the world size it ran, and it is 0 where none is given
(a cluster scenario without a measured figure).

The all-to-all model (`all_to_all_seconds`): a rank's sends to ranks of its own node take the
intra-node link, its sends to other nodes the inter-node link; the two links are separate
hardware (NVLink / the NIC) and work concurrently, while the messages on one link share it, so
a rank's send side takes ``max(Σ_intra (alpha + b / beta_intra), Σ_inter (alpha + b / beta_inter))``
over its non-empty messages, and its receive side likewise over its column. The collective
ends when the slowest rank's slower side ends (every rank waits in ``all_to_all_single`` for
its own receives, and the next phase's collective starts on every rank after it). This is why
the node-wise permutation matters: it moves bytes from the slow inter-node term to the fast
intra-node one.

The dispatch appears in the simulator's result (``SimResult.dispatch``, `DispatchCost` in
``dispatch_parts``) and as ``dispatch`` events at the start of every rank's timeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.cost.comm import Link, all_gather_time, inter_node_link, intra_node_link
from loom.cost.hardware import Cluster
from loom.cost.workload import HEADER, PER_SAMPLE, MetadataArrays, gathered_bytes
from loom.data.sample import SampleMeta

DISPATCH = "dispatch"  # the timeline kind of the dispatch's parts

# Default decision time per sample of the global batch, per policy, when no measured figure is
# given: the measured `decide_ms_<policy>` of `benchmarks/results/balance_speed.json` (commit
# 45d59de, one thread of this project's 2-core CPU machine: orchmllm 21.19 ms for 2560 x 60
# samples; disttrain 19.04 ms for 64 groups x 64 microbatches x 4 samples; entrain 29.65 ms for 64
# replicas x 32 microbatches x 16 samples), spread linearly over the batch. ``none`` keeps the
# given contiguous split: no search. Pass ``decision_seconds`` for a figure measured on the
# cluster's own CPUs.
DECISION_PER_SAMPLE_S = {
    "none": 0.0,
    "orchmllm": 21.19e-3 / (2560 * 60),
    "disttrain": 19.04e-3 / (64 * 64 * 4),
    "entrain": 29.65e-3 / (64 * 32 * 16),
}


class DispatchModelError(ValueError):
    """A bad input to the dispatch model; the message names the argument and the fix."""


@dataclass(frozen=True)
class Links:
    """The links a rank's bytes can take: ``intra`` between ranks of one node, ``inter``
    between nodes; rank ``r`` sits on node ``r // ranks_per_node`` (torchrun's placement)."""

    intra: Link
    inter: Link
    ranks_per_node: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise DispatchModelError(f"Links.ranks_per_node = {self.ranks_per_node!r}: use a positive integer")

    @classmethod
    def of_cluster(cls, cluster: Cluster) -> "Links":
        """The cluster's intra- and inter-node links (`loom.cost.comm`)."""
        return cls(intra_node_link(cluster), inter_node_link(cluster), cluster.gpus_per_node)

    @classmethod
    def uniform(cls, link: Link) -> "Links":
        """One link between every pair of ranks (one node: a local multi-process run)."""
        return cls(link, link, 1 << 30)

    def spans_nodes(self, world_size: int) -> bool:
        return world_size > self.ranks_per_node

    def world_link(self, world_size: int) -> Link:
        """The link a ring over the whole world runs at: its slowest hop."""
        return self.inter if self.spans_nodes(world_size) else self.intra


@dataclass(frozen=True)
class DispatchCost:
    """One step's dispatch: seconds of the metadata all-gather (``gather``), the decision
    (``decide``) and each phase's payload all-to-all (``payload``, in exchange order), with the
    bytes behind them: ``metadata_bytes`` gathered, ``payload_bytes[phase]`` sent between
    different ranks, ``internode_bytes[phase]`` the most any one rank sends to other nodes
    (orchmllm.md §3.10, Eq. 5's objective). ``unpermuted`` holds the all-to-all seconds and
    cross-node bytes the layout would have cost without node-wise rearrangement (``None``
    when none was applied); it is not part of ``total``."""

    gather: float
    decide: float
    payload: dict[str, float] = field(default_factory=dict)
    metadata_bytes: float = 0.0
    payload_bytes: dict[str, float] = field(default_factory=dict)
    internode_bytes: dict[str, float] = field(default_factory=dict)
    unpermuted: dict[str, dict[str, float]] | None = None  # {"payload_s": ..., "max_internode_send_bytes": ...}
    host: float = 0.0  # the dispatcher's own CPU work (reading, tokenising, codec, packing, collation): the slowest rank's
    host_per_rank: tuple[float, ...] = ()  # each rank's, where known (core sharing prices them together)

    @property
    def total(self) -> float:
        return self.host + self.gather + self.decide + sum(self.payload.values())

    def parts(self) -> list[tuple[str, float]]:
        """``(label, seconds)`` in the order the dispatcher runs them (the timeline's events;
        its host work, spread over the step, comes first)."""
        return ([("host work", self.host)] if self.host else []) + [
            ("gather metadata", self.gather), ("decide layout", self.decide)] + [
            (f"all-to-all {phase}", t) for phase, t in self.payload.items()]

    def summary(self) -> dict[str, Any]:
        return {"total_s": self.total, "host_s": self.host, "gather_s": self.gather, "decide_s": self.decide,
                "payload_s": dict(self.payload), "metadata_bytes": self.metadata_bytes,
                "payload_bytes": dict(self.payload_bytes), "max_internode_send_bytes": dict(self.internode_bytes),
                "without_nodewise": self.unpermuted}


def metadata_bytes(metas: Sequence[SampleMeta], world_size: int = 1) -> int:
    """Bytes of the global batch's metadata as the dispatcher all-gathers it
    (`loom.runtime.metadata`): every rank's loader shard (contiguous, sizes differing by at most
    one) as one `MetadataArrays.to_flat` row, padded to `gather_capacity`; the ``(ranks,
    capacity)`` int64 table every rank receives, plus a second round at the longest row's length
    when a row exceeds the capacity (`gathered_bytes`)."""
    arrays = MetadataArrays.from_metas(list(metas))
    shard = np.array([len(part) for part in np.array_split(np.arange(arrays.num_samples), world_size)],
                     dtype=np.int64)
    ends = np.cumsum(shard)

    def per_shard(count: np.ndarray) -> np.ndarray:
        cum = np.concatenate(([0], np.cumsum(count)))
        return cum[ends] - cum[ends - shard]

    lengths = (HEADER + PER_SAMPLE * shard + 2 * per_shard(arrays.image_count) + 2 * per_shard(arrays.audio_count)
               + per_shard(arrays.segment_count) + 3 * per_shard(arrays.generation_count))
    return gathered_bytes(arrays.num_samples, lengths)


def decision_seconds_model(policies: Mapping[str, str] | str, num_samples: int) -> float:
    """The default decision time (no measured figure given): the measured per-sample time of the
    slowest policy named (a joint policy decides every phase at once; per-phase policies run one
    after another, but each figure already covers an encoder phase and the LLM), times the batch."""
    names = {policies} if isinstance(policies, str) else set(policies.values())
    unknown = sorted(names - set(DECISION_PER_SAMPLE_S))
    if unknown:
        raise DispatchModelError(f"no decision-time model for policy {unknown}; known: "
                                 f"{sorted(DECISION_PER_SAMPLE_S)} (or pass decision_seconds)")
    return max(DECISION_PER_SAMPLE_S[n] for n in names) * num_samples


def all_to_all_seconds(matrix: np.ndarray | Sequence[Sequence[float]], links: Links) -> float:
    """One ``all_to_all_single`` moving ``matrix[src, dst]`` bytes (module docstring). 0 when
    no byte leaves its rank."""
    m = _square(matrix, "payload matrix")
    n = m.shape[0]
    off = m.copy()
    np.fill_diagonal(off, 0.0)
    if not off.any():
        return 0.0
    node = np.arange(n) // links.ranks_per_node
    same = node[:, None] == node[None, :]
    worst = 0.0
    for side in (off, off.T):  # sends (rows), receives (columns)
        nonzero = side > 0
        intra = (nonzero & same).sum(axis=1) * links.intra.latency + (side * same).sum(axis=1) / links.intra.bandwidth
        inter = (nonzero & ~same).sum(axis=1) * links.inter.latency + (side * ~same).sum(axis=1) / links.inter.bandwidth
        worst = max(worst, float(np.maximum(intra, inter).max()))
    return worst


def max_internode_send(matrix: np.ndarray | Sequence[Sequence[float]], ranks_per_node: int) -> float:
    """The most bytes any one rank sends to ranks of other nodes."""
    m = _square(matrix, "payload matrix")
    node = np.arange(m.shape[0]) // ranks_per_node
    return float((m * (node[:, None] != node[None, :])).sum(axis=1).max(initial=0.0))


def price_dispatch(world_size: int, links: Links, *, metadata_bytes: float, decision_seconds: float,
                   payload: Mapping[str, np.ndarray | Sequence[Sequence[float]]],
                   payload_unpermuted: Mapping[str, np.ndarray | Sequence[Sequence[float]]] | None = None,
                   host_seconds: float | Sequence[float] = 0.0) -> DispatchCost:
    """The dispatch of one step on ``world_size`` ranks: the all-gather of ``metadata_bytes``,
    ``decision_seconds`` (measured, or `decision_seconds_model`), and ``payload[phase]`` (a
    ``world_size x world_size`` byte matrix per phase, in exchange order); ``payload_unpermuted``
    the same exchange before node-wise rearrangement, priced for comparison. ``host_seconds``:
    the dispatcher's own CPU work, one figure or one per rank (a profile's fit,
    `loom.cost.profile_file.Profile.dispatch_host_seconds`; 0 when not measured); the step
    pays the slowest rank's."""
    if world_size < 1:
        raise DispatchModelError(f"world_size = {world_size}: use a positive rank count")
    if metadata_bytes < 0 or decision_seconds < 0 or not np.isfinite(decision_seconds):
        raise DispatchModelError(
            f"metadata_bytes = {metadata_bytes}, decision_seconds = {decision_seconds}: both must be finite and >= 0"
        )
    per_rank = tuple(float(h) for h in np.atleast_1d(np.asarray(host_seconds, dtype=np.float64)))
    if not per_rank or min(per_rank) < 0 or not np.isfinite(per_rank).all():
        raise DispatchModelError(f"host_seconds = {host_seconds}: must be finite and >= 0 (0 when not measured)")
    if len(per_rank) not in (1, world_size):
        raise DispatchModelError(f"host_seconds has {len(per_rank)} values for {world_size} ranks: give one, or one "
                                 f"per rank")
    seconds, moved, internode = {}, {}, {}
    for phase, matrix in payload.items():
        m = _square(matrix, f"payload[{phase!r}]")
        if m.shape[0] != world_size:
            raise DispatchModelError(f"payload[{phase!r}] is {m.shape[0]} x {m.shape[0]}; the world has "
                                     f"{world_size} ranks: give bytes for every (source, destination) rank pair")
        seconds[phase] = all_to_all_seconds(m, links)
        moved[phase] = float(m.sum() - np.trace(m))
        internode[phase] = max_internode_send(m, links.ranks_per_node)
    unpermuted = None
    if payload_unpermuted is not None:
        unpermuted = {"payload_s": {p: all_to_all_seconds(m, links) for p, m in payload_unpermuted.items()},
                      "max_internode_send_bytes": {p: max_internode_send(m, links.ranks_per_node)
                                                   for p, m in payload_unpermuted.items()}}
    gather = all_gather_time(metadata_bytes, world_size, links.world_link(world_size))
    return DispatchCost(gather, float(decision_seconds), seconds, float(metadata_bytes), moved, internode, unpermuted,
                        max(per_rank), per_rank if len(per_rank) == world_size > 1 else ())


def _square(matrix: np.ndarray | Sequence[Sequence[float]], name: str) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise DispatchModelError(f"{name} must be a square (source rank x destination rank) byte matrix, "
                                 f"got shape {m.shape}")
    if (m < 0).any() or not np.isfinite(m).all():
        raise DispatchModelError(f"{name} holds negative or non-finite byte counts")
    return m
