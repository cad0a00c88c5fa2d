"""Alpha-beta costs of point-to-point transfers and ring collectives (issue 3, item 1).

A message of ``b`` bytes over a link costs ``alpha + b / beta``, with ``beta`` the link's
per-direction bandwidth of one GPU and ``alpha`` its per-message latency (`loom.cost.hardware`).
Collectives are NCCL's ring algorithms among ``n`` ranks, each step moving a ``1/n`` chunk:

- all-reduce = reduce-scatter + all-gather: ``2 (n-1)/n * b / beta + 2 (n-1) alpha``;
- all-gather and reduce-scatter: ``(n-1)/n * b / beta + (n-1) alpha``,

where ``b`` is the size of the *whole* tensor (the all-reduced tensor, the gathered result, the
input of the reduce-scatter). A ring is as fast as its slowest hop, so a group that spans
nodes runs at the inter-node bandwidth (`link_for`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loom.cost.hardware import Cluster


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` bytes/s per direction per GPU, ``latency`` seconds per
    message step."""

    name: str
    bandwidth: float
    latency: float


def intra_node_link(cluster: Cluster) -> Link:
    spec = cluster.spec
    return Link("intra-node", spec.intra_node_bandwidth, spec.intra_node_latency)


def inter_node_link(cluster: Cluster) -> Link:
    spec = cluster.spec
    return Link("inter-node", spec.inter_node_bandwidth, spec.inter_node_latency)


def link_for(cluster: Cluster, ranks: Iterable[int]) -> Link:
    """The link a group of ranks communicates over: intra-node if they share a node."""
    nodes = {cluster.node_of_rank(r) for r in ranks}
    return intra_node_link(cluster) if len(nodes) <= 1 else inter_node_link(cluster)


def p2p_time(nbytes: float, link: Link) -> float:
    """One send of ``nbytes`` (0 for an empty message: nothing is sent)."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` tensor among ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather among ``n`` ranks whose *gathered* tensor has ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter among ``n`` ranks of an ``nbytes`` input tensor."""
    return all_gather_time(nbytes, n, link)
