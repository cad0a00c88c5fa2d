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


def test_backward_ratio_follows_the_frozen_aware_rule() -> None:
    """`SampleCosts.backward_ratio` per phase makes the costs' backward exactly what
    `loom.cost.flops.model_flops` prices under the frozen-aware rule."""
    from loom.cost.flops import model_flops

    base = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    metas = _metas("caption", 40)
    ratios = {}
    for frozen in ((), ("vision",), ("vision.encoder",), (LLM,)):
        arch = base.with_freeze(frozen)
        costs = sample_costs(arch, metas)
        forward = sum(float(costs.work[p].sum()) for p in arch.module_names)
        backward = sum(costs.backward_ratio_of(p) * float(costs.work[p].sum()) for p in arch.module_names)
        assert forward + backward == pytest.approx(model_flops(arch, sample_work(arch, metas)), rel=1e-9), frozen
        ratios[frozen] = costs.backward_ratio
    assert ratios[()][LLM] == 2.0 and 1.99 < ratios[()]["vision"] < 2.0  # the patch embedding has no input gradient
    assert ratios[("vision",)] == {"vision": 0.0, LLM: 2.0}  # nothing before the frozen encoder trains
    assert 0.0 < ratios[("vision.encoder",)]["vision"] < 0.1  # only the projector
    assert 1.0 < ratios[(LLM,)][LLM] < 2.0 and 1.99 < ratios[(LLM,)]["vision"]  # input gradients pass through


def test_a_frozen_encoder_changes_the_prediction(arch) -> None:
    # the hand-worked pipeline of test_balance_predict, vision forwards 3 then 1, the LLM 1 then 3:
    # trainable, the encoder's backwards end at 17; frozen (no backward), the LLM's last at 15
    from loom.balance.costs import SampleCosts
    from loom.balance.predict import predict_step
    from loom.schedule.layout import identity_layout

    plan = Plan([ModuleSpec("vision"), ModuleSpec(LLM)], num_microbatches=2).resolve({"vision": 4, LLM: 4})
    layout = identity_layout([[0], [1]], plan.module_names)
    trainable = SampleCosts({"vision": [3.0, 1.0], LLM: [1.0, 3.0]}, [1, 3], 1.0, 0.0)
    frozen = dataclasses.replace(trainable, backward_ratio={"vision": 0.0})
    assert predict_step(layout, plan, trainable, llm_padded=False).step == 17.0
    assert predict_step(layout, plan, frozen, llm_padded=False).step == 15.0
    # and from the arch: freezing the encoder lowers the predicted step of the same layout
    vision_arch = load_model_arch("llama3-8b", {"vision": "vit-h-14"})
    metas = _metas("caption", 16)
    plan = _plan(2, 4)
    given = make_layout(BalanceConfig(), plan, sample_costs(vision_arch, metas))
    steps = [predict_step(given, plan, sample_costs(a, metas)).step for a in (vision_arch, vision_arch.with_freeze(["vision"]))]
    assert steps[1] < steps[0]
