"""This machine as a scenario: the ranks ``loom train`` would start here, priced by a measured
profile (``loom profile``) instead of a GPU's datasheet, on the batches the run really draws.

A `LocalScenario` is a `Scenario` whose

- cost model is `loom.cost.profiled.ProfiledCostModel` over the profile (every layer's fitted
  forward and backward, message, gradient-sync and optimizer costs measured on this machine);
- batches are the run's own: ``metas(step)`` is the metadata of the samples its sampler draws
  at ``step`` (the caller passes that function, built from the training config);
- ranks share the host's cores (`loom.sim.sharing.CoreSharing`, with the CPU slowdown of busy
  co-runners the profile measured, `loom.profile.contention`): ``cores`` cores for all of them;
- dispatcher is priced over the profiled loopback link (its latency measured with the sender
  waiting, as in the dispatcher's collectives every rank waits) and its host work from the
  profile's fit (`Profile.dispatch_host_seconds`); a fit taken at another world size is carried
  over as its ranks' median line (each rank does the whole decision and a share of the loading);
- "GPU" is one rank's share of the host: its memory ``memory_bytes / ranks``, its peak the
  measured matmul rate (an MFU then says how much of what this CPU core does in a GEMM).

The planner's search runs on it unchanged (``loom plan --search --cluster local``); what the
profile cannot price is refused by the cost model (selective recompute) or left out of the
search space by the caller (TP and CP: a profile times layers at TP = CP = 1).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from loom.cost.hardware import Cluster, GPUSpec
from loom.cost.comm import Link
from loom.cost.profile_file import Profile
from loom.cost.profiled import ProfiledCostModel
from loom.data.sample import SampleMeta
from loom.plan.plan import Plan
from loom.sim.dispatch import Links
from loom.sim.scenario import Scenario, ScenarioError
from loom.sim.sharing import CoreSharing, profile_sharing


def local_cluster(profile: Profile, ranks: int, memory_bytes: float) -> Cluster:
    """``ranks`` ranks on one host, each a "GPU" with its share of ``memory_bytes`` and the
    profile's measured matmul rate and message link (one node: every rank on this host)."""
    comm = profile.comm
    link = (comm.latency_idle or comm.latency) if comm is not None else None
    bandwidth = 1.0 / max(link.seconds_per_byte, 1e-15) if link is not None else 1e10
    latency = link.alpha_s if link is not None else 0.0
    spec = GPUSpec(name=f"local {profile.device.get('kind', 'cpu')} rank", peak_bf16_flops=profile.matmul_flops_per_s,
                   hbm_bytes=memory_bytes / ranks, hbm_bandwidth=1e10, intra_node_bandwidth=bandwidth,
                   inter_node_bandwidth=bandwidth, intra_node_latency=latency, inter_node_latency=latency)
    return Cluster(spec, ranks, ranks)


@dataclass
class LocalScenario(Scenario):
    """This machine, priced by ``profile`` (module docstring). ``batches(step)``: the metadata of
    the global batch the run draws at ``step``; ``cores``: the host's cores the ranks share."""

    profile: Profile | None = None
    batches: Callable[[int], list[SampleMeta]] | None = None
    cores: int = 1
    _dispatch_lines: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.profile is None or self.batches is None:
            raise ScenarioError("a local scenario needs the profile and the run's batches (LocalScenario(profile=, "
                                "batches=))")
        if self.cores < 1:
            raise ScenarioError(f"cores = {self.cores}: give the host's core count (at least 1)")
        d = self.profile.dispatch
        if d:
            self._dispatch_lines = list(zip(map(float, d["fixed_s"]), map(float, d["per_sample_s"])))

    def cost_model(self, plan: Plan) -> ProfiledCostModel:  # type: ignore[override]
        return ProfiledCostModel(self.profile, self.arch, plan)

    def metas(self, step: int = 0) -> list[SampleMeta]:
        return self.batches(step)

    def dispatch_links(self) -> Links:
        spec = self.cluster.spec
        return Links.uniform(Link("loopback (profiled, idle sender)", spec.intra_node_bandwidth,
                                  spec.intra_node_latency))

    def dispatch_host_seconds(self, batch_size: int, world_size: int) -> float | list[float]:
        measured = self.profile.dispatch_host_seconds(batch_size, world_size)
        if measured is not None:
            return measured
        if not self._dispatch_lines:
            return 0.0
        return statistics.median(a + c * batch_size for a, c in self._dispatch_lines)

    def core_sharing(self, plan: Plan) -> CoreSharing:
        return profile_sharing(self.profile, self.cores, plan.world_size)

    def step_seconds(self, plan: Plan, policy: str = "none", step: int = 0) -> float:
        """The predicted wall time of one ``loom train`` step of ``plan``: the simulated
        iteration (dispatch included) and the loss all-reduce that ends every step."""
        run = self.run_balanced(plan, policy, step)
        return run.result.iteration_time + self.cost_model(plan).clip_time()
