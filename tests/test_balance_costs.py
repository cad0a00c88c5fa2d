"""Per-sample costs from metadata arrays: the same rule as `sample_work`, the flat form the
dispatcher all-gathers, and the policies' never-slower-than-none rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from loom.balance.costs import sample_costs
from loom.balance.policy import BalanceConfig, make_layout
from loom.balance.predict import predict_steps
from loom.cost.model_configs import load_model_arch
from loom.cost.model import Workload
from loom.cost.workload import MetadataArrays, sample_tokens, sample_work
from loom.data.synthetic import SyntheticMetadata
from loom.plan.plan import LLM, ModuleSpec, Plan



@pytest.fixture(scope="module")
def arch():
    return load_model_arch("llama3-8b", {"vision": "vit-h-14", "audio": "whisper-large"})


def _metas(mix: str, n: int, seed: int = 0):
    data = SyntheticMetadata(mix, seed=seed)
    return [data.meta(i) for i in range(n)]


@pytest.mark.parametrize("mix", ["llava", "caption", "audio_heavy", "interleaved"])
def test_arrays_agree_with_sample_work(arch, mix) -> None:
    metas = _metas(mix, 60)
    tok = sample_tokens(arch, MetadataArrays.from_metas(metas))
    for s, meta in enumerate(metas):
        work = sample_work(arch, [meta])
        for name in arch.module_names:
            assert (tok.tokens[name][s], tok.attn_sq[name][s]) == (work[name].tokens, work[name].attn_sq), (name, s)
    costs = sample_costs(arch, metas)
    a, b = costs.llm_alpha, costs.llm_beta
    assert np.allclose(costs.work[LLM], a * tok.tokens[LLM] + b * tok.attn_sq[LLM])
    # a microbatch's workload is the sum of its samples' (packed)
    both = sample_work(arch, metas[:5])
    assert both["vision"].tokens == int(tok.tokens["vision"][:5].sum())
    assert both[LLM] == Workload.of_lengths(tok.llm_lengths[:5].tolist())


def test_flat_metadata_round_trips_and_concatenates(arch) -> None:
    metas = _metas("audio_heavy", 30)
    parts = [MetadataArrays.from_metas(metas[i:i + 7]) for i in range(0, 30, 7)]
    gathered = MetadataArrays.concat([MetadataArrays.from_flat(p.to_flat()) for p in parts])
    whole = MetadataArrays.from_metas(metas)
    for f in dataclasses.fields(MetadataArrays):
        assert np.array_equal(getattr(gathered, f.name), getattr(whole, f.name)), f.name
    padded = MetadataArrays.from_gathered([p.to_flat() for p in parts])
    for f in dataclasses.fields(MetadataArrays):
        assert np.array_equal(getattr(padded, f.name), getattr(whole, f.name)), f.name
    with pytest.raises(Exception, match="does not match"):
        MetadataArrays.from_flat(whole.to_flat()[:-1])


def _plan(dp: int, m: int) -> Plan:
    plan = Plan([ModuleSpec("vision", data_parallel=dp), ModuleSpec("llm", data_parallel=dp)], num_microbatches=m)
    return plan.resolve({"vision": 34, "llm": 34})


def test_policy_keeps_the_given_layout_when_its_gain_is_too_small(arch) -> None:
    vision_arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    plan = _plan(4, 8)
    metas = _metas("caption", 64)
    costs = sample_costs(vision_arch, metas)
    for policy in ("orchmllm", "disttrain", "entrain"):
        layout = make_layout(BalanceConfig(default=policy, min_gain=0.0), plan, costs)
        given = make_layout(BalanceConfig(), plan, costs)
        before, after = (p.step for p in predict_steps([given, layout], plan, costs))
        assert after <= before * (1 + 1e-12), policy  # never slower than none by its own model
        assert layout.predicted_gain["total"] == pytest.approx((before - after) / before, abs=1e-6)
        kept = make_layout(BalanceConfig(default=policy, min_gain=0.999), plan, costs)
        assert kept.kept_given and kept.is_identity() and kept.policy == {"vision": policy, "llm": policy}
    # identical samples: nothing to gain, the given layout stays
    same = sample_costs(vision_arch, [metas[0]] * 64)
    flat = make_layout(BalanceConfig(default="orchmllm"), plan, same)
    assert flat.kept_given and flat.predicted_gain["total"] <= 0.01
