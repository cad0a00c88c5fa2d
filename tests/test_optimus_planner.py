"""Optimus's model planner (loom.planner.optimus.model_planner; optimus.md §2.3, §2.7, §3.3, §6.1)."""

from __future__ import annotations

import itertools
import math

import pytest

from loom.cost.arch import ModelArch
from loom.cost.hardware import Cluster
from loom.cost.memory import static_memory
from loom.cost.model import Workload
from loom.cost.model_configs import EmbeddingConfig, FrontendConfig, ModuleConfig, TransformerConfig
from loom.plan.plan import even_boundaries
from loom.planner.optimus import (
    EncoderParallel,
    LLMParallel,
    compositions,
    count_partitions,
    encoder_stage_times,
    paper_model_memory,
    paper_overhead_memory,
    plan_encoders,
)
from loom.planner.optimus.model_planner import OptimusPlanError, _count_grouped, _grouped
from loom.planner.optimus.paper import LLM_PLAN, NUM_MICROBATCHES, paper_arch, paper_workload


def tiny_arch(enc_layers: int = 4, llm_layers: int = 8) -> ModelArch:
    vision = ModuleConfig("tiny-vit", "vision", TransformerConfig(hidden=64, layers=enc_layers, heads=4, ffn=256),
                          frontend=FrontendConfig(type="patch", in_channels=3, patch=4))
    llm = ModuleConfig("tiny-llm", "llm",
                       TransformerConfig(hidden=64, layers=llm_layers, heads=4, ffn=256, causal=True),
                       embedding=EmbeddingConfig(vocab=100))
    return ModelArch({"vision": vision.module_arch("vision", "mlp", 64), "llm": llm.module_arch()})


def plan_tiny(llm: LLMParallel, n_mb: int = 8, limit: float = 1e12, **kw):
    return plan_encoders(tiny_arch(), llm, n_mb, llm_tokens=128, encoder_tokens={"vision": 64}, memory_limit=limit,
                         **kw)


# ---- partitions -------------------------------------------------------------------------------


def test_eight_microbatches_over_two_pipelines_give_the_papers_seven_partitions():
    assert list(compositions(8, 2)) == [(1, 7), (2, 6), (3, 5), (4, 4), (5, 3), (6, 2), (7, 1)]
    assert count_partitions(8, 2) == 7


@pytest.mark.parametrize("n,m", [(1, 1), (5, 1), (6, 3), (7, 4), (9, 9), (4, 5), (10, 3)])
def test_partition_count_is_the_binomial(n, m):
    parts = list(compositions(n, m))
    assert len(parts) == count_partitions(n, m) == (math.comb(n - 1, m - 1) if m <= n else 0)
    assert len(set(parts)) == len(parts)
    assert all(len(p) == m and min(p) >= 1 and sum(p) == n for p in parts)


@pytest.mark.parametrize("n,groups", [(8, (1, 1)), (9, (3,)), (10, (2, 2)), (12, (3, 2)), (7, (2, 2, 2))])
def test_symmetric_partitions_are_one_per_class_of_compositions(n, groups):
    """Permuting parts inside a group of symmetric pipelines gives the same schedule: the
    enumeration keeps exactly one representative of every class, and the count agrees."""
    m = sum(groups)

    def canonical(p):
        out, i = [], 0
        for g in groups:
            out += sorted(p[i:i + g], reverse=True)
            i += g
        return tuple(out)

    classes = {canonical(p) for p in compositions(n, m)}
    got = list(_grouped(n, groups, 1, n))
    assert len(got) == len(set(got)) == _count_grouped(n, groups, 1, n)
    assert set(got) == classes


# ---- the plans (Fig. 5) ---------------------------------------------------------------------------


def test_fig5_encoder_plan_is_a_candidate_with_two_pipelines_and_seven_partitions():
    llm = LLMParallel(data_parallel=1, pipeline_parallel=4, tensor_parallel=2)
    result = plan_tiny(llm)
    plans = {c.encoder: c for c in result.candidates}
    # divisors(4) x divisors(2): every plan fits the generous limit
    assert len(plans) + len(result.pruned) == 6
    fig5 = plans[EncoderParallel(data_parallel=2, pipeline_parallel=2, tensor_parallel=2)]
    assert fig5.m == 2
    assert list(fig5.partitions(8)) == list(compositions(8, 2))  # the two pipelines sit on different LLM stages
    # Fig. 5: pipeline 1 on LLM stages 1-2, pipeline 2 on stages 3-4, both TP ranks
    assert [fig5.llm_stage(0, s) for s in range(2)] == [0, 1]
    assert [fig5.llm_stage(1, s) for s in range(2)] == [2, 3]
    assert fig5.ranks(0, 0) == (0, 1) and fig5.ranks(1, 1) == (6, 7)
    # every rank hosts exactly one encoder stage of one pipeline
    for c in result.candidates:
        hosted = [r for j in range(c.m) for s in range(c.encoder.pipeline_parallel) for r in c.ranks(j, s)]
        assert sorted(hosted) == list(range(llm.world_size)), c.encoder
        assert c.encoder.data_parallel * c.encoder.pipeline_parallel * c.encoder.tensor_parallel == llm.world_size
        assert c.m == c.encoder.data_parallel // llm.data_parallel


def test_plans_with_more_pipelines_than_microbatches_are_pruned():
    llm = LLMParallel(data_parallel=1, pipeline_parallel=4, tensor_parallel=2)
    result = plan_tiny(llm, n_mb=3)
    assert {c.m for c in result.candidates} <= {1, 2}
    reasons = {p.encoder: p.reason for p in result.pruned}
    assert "exceed N_mb = 3" in reasons[EncoderParallel(8, 1, 1)]


# ---- memory (§2.7) --------------------------------------------------------------------------------


@pytest.mark.parametrize("pp_tp,expected_gb", [(64, 2.0625), (16, 8.25), (8, 16.5), (1, 132.0)])
def test_paper_model_memory_of_vit_22b(pp_tp, expected_gb):
    n = 3072
    assert paper_model_memory(22e9, 0.0, n // pp_tp, 48, n) == pytest.approx(expected_gb * 1e9)


@pytest.mark.parametrize("pp,tp,expected_gb", [(8, 4, 2.0625), (8, 2, 6.1875), (4, 4, 6.1875), (8, 1, 14.4375),
                                               (4, 2, 14.4375), (2, 4, 14.4375)])
def test_paper_overhead_at_3072_gpus(pp, tp, expected_gb):
    n = 3072
    assert paper_overhead_memory(22e9, n // (pp * tp), 48, n) == pytest.approx(expected_gb * 1e9)


def test_planner_reports_the_paper_formula_and_loom_static_memory():
    arch = tiny_arch()
    llm = LLMParallel(data_parallel=2, pipeline_parallel=2, tensor_parallel=2)
    result = plan_encoders(arch, llm, 4, llm_tokens=128, encoder_tokens={"vision": 64}, memory_limit=1e12,
                           llm_recompute="none")
    c = next(c for c in result.candidates if c.encoder == EncoderParallel(4, 2, 1))
    phi_e, phi_l = arch.module("vision").params, arch.module("llm").params
    assert c.memory.paper_model == pytest.approx(6 * (4 * phi_e + 2 * phi_l) / 8)
    assert c.memory.paper_overhead == pytest.approx(6 * (4 - 2) * phi_e / 8)
    w = c.memory.worst(1)
    p, s = w.llm_stage, w.encoder_stage
    assert s == p % 2 and [r.encoder_stage for r in c.memory.ranks] == [0, 1]
    enc = arch.module("vision").layers
    lay = arch.module("llm").layers
    eb, lb = even_boundaries(len(enc), 2), even_boundaries(len(lay), 2)
    expected = (static_memory(enc[eb[s]:eb[s + 1]], 1, 4, 1, "adam", accumulates=True).total
                + static_memory(lay[lb[p]:lb[p + 1]], 2, 2, 1, "adam", accumulates=True).total)
    assert w.static == pytest.approx(expected)
    assert w.llm_activations > 0 and w.encoder_activations_per_microbatch > 0


def test_memory_limit_prunes_and_caps_encoder_microbatches_in_flight():
    llm = LLMParallel(data_parallel=1, pipeline_parallel=4, tensor_parallel=2)
    roomy = plan_tiny(llm)
    c = next(c for c in roomy.candidates if c.encoder == EncoderParallel(2, 2, 2))
    assert c.max_in_flight == 8  # everything fits: capped at N_mb
    # a limit that holds the rest and exactly two encoder microbatches on the worst rank
    w = c.memory.worst(1)
    base, per = w.total(0), w.encoder_activations_per_microbatch
    tight = plan_tiny(llm, limit=base + 2.5 * per)
    t = next(x for x in tight.candidates if x.encoder == c.encoder)
    assert 2 <= t.max_in_flight < 8
    assert all(max(p) <= t.max_in_flight for p in t.partitions(8))
    assert len(list(t.partitions(8))) < 7
    none = plan_tiny(llm, limit=1.0)
    assert not none.candidates and all("over the limit" in p.reason or "exceed" in p.reason for p in none.pruned)


def test_partition_cap_keeps_the_balanced_band():
    llm = LLMParallel(data_parallel=1, pipeline_parallel=8, tensor_parallel=1)
    arch = tiny_arch(enc_layers=8)
    result = plan_encoders(arch, llm, 32, llm_tokens=128, encoder_tokens={"vision": 64}, memory_limit=1e12)
    c = next(c for c in result.candidates if c.m == 8)  # PP_enc 1: 8 pipelines on 8 different stages
    assert c.count_partitions(32) == count_partitions(32, 8) == 2_629_575
    band = c.partition_band(32, 5000)
    got = list(c.partitions(32, 5000))
    assert 0 < len(got) <= 5000 and band is not None and band >= 1
    assert (4,) * 8 in got and all(abs(x - 4) <= band for p in got for x in p)
    assert c.count_partitions(32, band + 1) > 5000  # the widest band under the cap


def test_bad_input_names_the_field():
    with pytest.raises(OptimusPlanError, match="pipeline_parallel"):
        LLMParallel(1, 0, 1)
    with pytest.raises(OptimusPlanError, match="encoder_tokens"):
        plan_encoders(tiny_arch(), LLMParallel(1, 2, 1), 4, llm_tokens=1, encoder_tokens={}, memory_limit=1e9)
    with pytest.raises(OptimusPlanError, match="memory_limit"):
        plan_tiny(LLMParallel(1, 2, 1), limit=0)


def test_encoder_stage_times_from_the_analytic_model():
    llm = LLMParallel(data_parallel=1, pipeline_parallel=4, tensor_parallel=2)
    c = next(c for c in plan_tiny(llm).candidates if c.encoder == EncoderParallel(2, 2, 2))
    work = {"vision": Workload(64, 64 * 64, 1), "llm": Workload(128, 128 * 128, 1)}
    times = encoder_stage_times(tiny_arch(), c, Cluster("h100", 8), work)
    assert times.num_stages == 2 and min(times.forward) > 0 and min(times.backward) > 0
    assert len(times.to_llm) == c.groups == 2
    assert times.to_llm[0] > 0  # pipeline 0's last stage is on LLM stage 1, not 0
    # per-layer times (the fine step's units): the stage's layers, adding up to its time
    layers = len(tiny_arch().module("vision").layers)
    assert sum(len(x) for x in times.layer_forward) == sum(len(x) for x in times.layer_backward) == layers
    assert [sum(x) for x in times.layer_forward] == pytest.approx(list(times.forward))


def test_paper_configuration_plans():
    """ViT-22B + GPT-175B on 3072 GPUs: (1, 1) gives m = 64 > 32 and is pruned; the plans
    that survive fit 80 GB by loom's memory model."""
    arch, work = paper_arch(), paper_workload()
    result = plan_encoders(arch, LLM_PLAN, NUM_MICROBATCHES, llm_tokens=work["llm"].tokens,
                           encoder_tokens={"vision": work["vision"].tokens}, memory_limit=80e9,
                           encoder_recompute="full")
    assert len(result.candidates) + len(result.pruned) == 16
    assert EncoderParallel(3072, 1, 1) in {p.encoder for p in result.pruned}
    for c in result.candidates:
        assert c.memory.total(c.max_in_flight) <= 80e9
        assert c.memory.paper_model == pytest.approx(
            paper_model_memory(arch.module("vision").params, arch.module("llm").params, c.encoder.data_parallel,
                               48, 3072))
    assert all(itertools.islice(c.partitions(NUM_MICROBATCHES), 1) for c in result.candidates)
