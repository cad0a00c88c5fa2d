"""``[elastic]``: training that survives rank failures without a restart (Oobleck, oobleck.md
§2.3-§2.5, §3.6-§3.10).

A run with this section is launched by `loom.elastic.supervisor` instead of ``torchrun``: its
nodes (``ranks_per_node`` processes each; 1 on a CPU machine) form at least ``f + 1`` pipeline
replicas from templates of ``min_nodes`` (n0) nodes and up, and keep training while at least
``(f + 1) * min_nodes`` nodes and one copy of every layer survive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loom.plan.overrides import ConfigError


@dataclass
class ElasticConfig:
    # nodes the run starts with (N): the supervisor starts nodes * ranks_per_node workers
    nodes: int = 4
    # simultaneous pipeline failures to tolerate (oobleck.md §2.3): at least f + 1 replicas
    f: int = 1
    # n0, the smallest pipeline template's node count (memory-bound; oobleck.md §3.0)
    min_nodes: int = 2
    # processes per node: a node is lost as a whole when one of its processes dies
    ranks_per_node: int = 1
    # process-group timeout (seconds): the backstop of failure detection (oobleck.md §3.10: 5 s)
    timeout_s: float = 10.0
    # samples per microbatch, b of Eq. 2.6: each pipeline runs N_b,i microbatches of b samples
    microbatch_size: int = 1

    def check(self, cfg: Any) -> None:
        """Ranges, and what the elastic runtime cannot honour refused naming the field (``cfg``:
        the whole `loom.train.config.TrainConfig`)."""
        def need(ok: bool, name: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"{name} = {value!r}: {why}")

        need(self.f >= 0, "elastic.f", self.f, "must not be negative; use 1 to survive one pipeline failure")
        need(self.min_nodes >= 1, "elastic.min_nodes", self.min_nodes, "a pipeline needs at least one node")
        need(self.ranks_per_node == 1, "elastic.ranks_per_node", self.ranks_per_node,
             "the elastic runtime runs one process per node for now (each a pipeline stage); use 1")
        need(math.isfinite(self.timeout_s) and self.timeout_s > 0, "elastic.timeout_s", self.timeout_s,
             "a process-group timeout in seconds; use e.g. 10")
        need(self.microbatch_size >= 1, "elastic.microbatch_size", self.microbatch_size,
             "samples per microbatch; use 1 or more")
        floor = (self.f + 1) * self.min_nodes
        need(self.nodes >= floor, "elastic.nodes", self.nodes,
             f"f = {self.f} needs f + 1 = {self.f + 1} pipelines of at least min_nodes = {self.min_nodes} nodes, "
             f"{floor} nodes; start with {floor} or more, or lower elastic.f / elastic.min_nodes")
        batch = cfg.data.global_batch_size
        need(batch >= self.nodes // self.min_nodes, "data.global_batch_size", batch,
             f"every pipeline needs a sample of each global batch, and up to {self.nodes // self.min_nodes} "
             f"pipelines can form; use at least that many samples")
        need(cfg.run.device == "cpu", "run.device", cfg.run.device,
             "elastic runs use gloo on the CPU for now (NCCL hangs on a lost peer instead of failing); use 'cpu'")
        policies = set(cfg.balance.summary(cfg.plan.module_names).values())
        need(policies == {"none"}, "balance", sorted(policies),
             "an elastic run splits each batch over heterogeneous pipelines by Eq. 2.6; set balance.default = 'none'")
        for m in cfg.plan.modules:
            for k in ("data_parallel", "tensor_parallel", "context_parallel"):
                need(getattr(m, k) == 1, f"plan.modules.{m.name}.{k}", getattr(m, k),
                     "an elastic run's pipelines come from its templates, one replica each without TP or CP; use 1")
            need(m.zero_stage == 0, f"plan.modules.{m.name}.zero_stage", m.zero_stage,
                 "an elastic run keeps whole replicas (their copies are what survives a failure); use 0")
            need(m.virtual_stages == 1, f"plan.modules.{m.name}.virtual_stages", m.virtual_stages,
                 "the templates place one stage per rank; use 1")
        need(cfg.plan.bubble_fill == "none", "plan.bubble_fill", cfg.plan.bubble_fill,
             "the elastic workers run each pipeline's built schedule, unfilled; use 'none'")
        need(cfg.model.generator is None, "model.generator", "set", "generators are not run elastically yet; remove it")
        hf = cfg.hf_llm_config() if getattr(cfg.model.llm, "hf", "") else None
        need(not getattr(hf, "tie_word_embeddings", False), "model.llm.hf", getattr(cfg.model.llm, "hf", ""),
             "ties its embeddings (tie_word_embeddings), which the elastic runtime does not copy and sync as one "
             "parameter yet; use an untied model")
        for name, value, why in (("run.checkpoint_every", cfg.run.checkpoint_every, "the survivors save only beyond f"),
                                 ("run.eval_every", cfg.run.eval_every, "evaluation is not run elastically yet"),
                                 ("data.microbatch_tokens", cfg.data.microbatch_tokens,
                                  "elastic.microbatch_size sets the microbatches")):
            need(not value, name, value, f"{why}; use 0")
        need(not cfg.run.tensorboard, "run.tensorboard", True, "not written by elastic runs yet; use false")
        need(not cfg.run.profile, "run.profile", cfg.run.profile, "elastic templates cut the model evenly for now")
