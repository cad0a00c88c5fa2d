"""benchmarks/placements.py's helpers that run no process: its placements' configs, its
argument checks, the pairing checks and the figures from given step times."""

from __future__ import annotations

import pytest

from benchmarks.balance_real import turn_orders
from benchmarks.placements import (BASELINE, PLACEMENTS, WORLD_SIZE, BenchConfig, check_same_work,
                                   placement_figures, placement_model, repeat_sums, train_config)


def test_every_placement_is_the_demo_model_without_audio_on_the_same_two_ranks():
    demo = {}
    for name in PLACEMENTS:
        pm = placement_model(name, steps=10)
        cfg, plan = pm.cfg, pm.plan
        assert cfg.model.audio is None and [m.name for m in plan.modules] == ["vision", "llm"]
        assert "audio" not in cfg.data.demo.mix and "image_audio" not in cfg.data.demo.mix
        assert cfg.run.steps == 10
        assert plan.world_size == WORLD_SIZE, name
        demo[name] = (cfg.model, cfg.data, cfg.optim)
        # a placement moves work, it changes neither the model, the data nor the optimizer
        assert demo[name] == demo[BASELINE]
    assert train_config("first_stage", 1).plan.placement == "first_stage"
    assert train_config("first_stage", 1).plan.spec("llm").num_stages == 2
    colo = train_config("colocated", 1).plan
    assert (colo.placement, colo.spec("vision").data_parallel, colo.spec("llm").num_stages) == ("colocated", 2, 2)
    dp = train_config("colocated_dp", 1).plan
    assert (dp.spec("vision").data_parallel, dp.spec("llm").data_parallel, dp.spec("llm").num_stages) == (2, 2, 1)
    with pytest.raises(ValueError, match="placement 'nope'"):
        train_config("nope", 1)


@pytest.mark.parametrize("placements, match", [
    ("first_stage,colocated", "list 'disaggregated'"),
    ("disaggregated", "at least one other"),
    ("disaggregated,nowhere", r"\['nowhere'\] are not placements"),
    ("disaggregated,colocated,colocated", "each once"),
])
def test_bad_placement_lists_name_the_flag(placements, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(placements=placements).check()


@pytest.mark.parametrize("field", ["repeats", "warmup", "profile_repeats"])
def test_counts_below_one_are_refused_with_their_flag(field):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} 0"):
        BenchConfig(**{field: 0}).check()


def test_a_repeat_is_one_whole_turn_cycle():
    assert BenchConfig().check().steps_per_repeat() == 4  # 4 placements: a 4 x 4 Williams square
    three = BenchConfig(placements="disaggregated,first_stage,colocated")
    assert three.steps_per_repeat() == 6 == len(turn_orders(three.names()))  # odd: the square and its mirror


def test_repeat_sums_cuts_the_timed_steps_after_the_warmup():
    assert repeat_sums([9.0, 1.0, 2.0, 3.0, 4.0], warmup=1, repeats=2, per_repeat=2) == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(ValueError, match="expected warmup 1 \\+ 2 x 2"):
        repeat_sums([1.0, 2.0, 3.0], warmup=1, repeats=2, per_repeat=2)


def test_check_same_work_refuses_other_losses_or_other_batches():
    batches = {BASELINE: [[0, 1], [2, 3]], "colocated": [[0, 1], [2, 3]]}
    assert check_same_work({BASELINE: 2.0, "colocated": 2.0 * (1 + 5e-5)}, batches) == pytest.approx(5e-5)
    with pytest.raises(RuntimeError, match="different first-step losses"):
        check_same_work({BASELINE: 2.0, "colocated": 2.01}, batches)
    with pytest.raises(RuntimeError, match="'colocated' trained other global batches"):
        check_same_work({BASELINE: 2.0, "colocated": 2.0}, {BASELINE: [[0, 1]], "colocated": [[1, 0]]})


def test_figures_from_given_step_times():
    names = [BASELINE, "colocated"]
    repeats = {BASELINE: [[0.2, 0.4], [0.3, 0.3], [0.4, 0.4]], "colocated": [[0.1, 0.3], [0.2, 0.2], [0.4, 0.4]]}
    simulated = {BASELINE: [0.25, 0.35, 0.3], "colocated": [0.2, 0.3, 0.1]}
    figs = placement_figures(names, repeats, simulated, global_batch=16)
    base, colo = figs[f"placement_{BASELINE}_step_ms"], figs["placement_colocated_step_ms"]
    assert base["value"] == pytest.approx(300.0) and base["spread"] == [300.0, 400.0] and base["better"] == "lower"
    assert colo["value"] == pytest.approx(200.0) and colo["spread_is"] == "min-max"
    assert figs["placement_colocated_samples_per_s"]["value"] == pytest.approx(80.0)  # 16 / 0.2 s
    assert figs["placement_colocated_samples_per_s"]["better"] == "higher"
    # per repeat, disaggregated's step-time sum over colocated's on the same batches: 1.5, 1.5, 1.0
    ratio = figs[f"placement_step_ratio_{BASELINE}_over_colocated"]
    assert (ratio["value"], ratio["spread"], ratio["better"]) == (1.5, [1.0, 1.5], "higher")
    assert figs[f"placement_sim_ratio_{BASELINE}_over_colocated"]["value"] == pytest.approx(0.3 / 0.2)
    assert figs["placement_colocated_sim_step_ms"]["value"] == pytest.approx(200.0)
    assert figs["placement_colocated_sim_samples_per_s"]["value"] == pytest.approx(80.0)
    # median measured step 0.25 s (of 0.1, 0.2, 0.2, 0.3, 0.4, 0.4) against the simulated 0.2 s
    assert figs["placement_colocated_sim_abs_rel_error"]["value"] == pytest.approx(0.2)
    assert f"placement_step_ratio_{BASELINE}_over_{BASELINE}" not in figs
