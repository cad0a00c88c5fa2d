"""benchmarks/placements.py's helpers that run no process: its placements' configs (the optimus
one's fill and profile wiring), its argument checks, the pairing checks, the figures from given
step times and the schedule its prediction plays."""

from __future__ import annotations

import pytest

from dataclasses import replace

from benchmarks.balance_real import turn_orders
from benchmarks.placements import (BASELINE, PLACEMENTS, PROFILED, WORLD_SIZE, BenchConfig, check_same_work,
                                   compute_order, engine_schedule, placement_figures, placement_model, repeat_sums,
                                   step_layout, train_config)
from loom.runtime.stage import trainable_stages
from loom.schedule.generators import build_schedule
from loom.train.build import bubble_filler


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


def test_optimus_is_colocated_with_the_fill_and_reads_the_benchmarks_profile():
    colo, opt = train_config("colocated", 1).plan, train_config("optimus", 1, "/tmp/p r/profile.json")
    # the colocated plan, field for field, but for the fill
    assert replace(opt.plan, bubble_fill="none") == colo and opt.plan.bubble_fill == "optimus"
    assert opt.run.profile == "/tmp/p r/profile.json"  # as `loom train ... run.profile=<file>` sets it
    assert PROFILED == {"optimus"}
    # only a PROFILED placement takes the profile; without one the fill is timed analytically
    assert train_config("colocated", 1, "/tmp/profile.json").run.profile == ""
    assert train_config("optimus", 1).run.profile == ""


def test_the_prediction_plays_the_schedule_the_engine_runs():
    """Without a profile (the analytic fill, ``loom train`` without ``run.profile``) the fill
    moves vision blocks on this model; `engine_schedule` returns the transform's schedule, that
    of `ParallelEngine.schedule_for` (generator, then the transform on the layout's plan)."""
    opt, colo = placement_model("optimus", 10), placement_model("colocated", 10)
    assert colo.transform is None and opt.transform is not None
    layout = step_layout(opt, 3)[1]
    assert layout.slots == step_layout(colo, 3)[1].slots  # policy none: the same microbatches
    plain = engine_schedule(colo, layout)
    filled = engine_schedule(opt, layout)
    assert plain.actions == engine_schedule(replace(opt, transform=None), layout).actions
    assert filled.actions != plain.actions
    # the same actions, reordered: the fill moves work, it adds or drops none
    assert {u: sorted(map(repr, a)) for u, a in filled.actions.items()} == \
           {u: sorted(map(repr, a)) for u, a in plain.actions.items()}
    # exactly the engine's call: the generator's schedule through bubble_filler on the layout's plan
    generated = build_schedule(opt.plan, trainable_stages(opt.model, opt.plan), layout=layout,
                               eager=opt.cfg.balance.eager_forward)
    engine = bubble_filler(opt.cfg, opt.model, opt.dataset, opt.plan)(
        generated, replace(opt.plan, num_microbatches=layout.num_microbatches))
    assert filled.actions == engine.actions
    order = compute_order(filled, opt.plan)
    assert list(order) == ["0 llm stage 0", "1 llm stage 1"]
    assert order != compute_order(plain, opt.plan)
    assert sorted(order["0 llm stage 0"]) == sorted(compute_order(plain, opt.plan)["0 llm stage 0"])


@pytest.mark.parametrize("placements, match", [
    ("first_stage,colocated", "list the baseline 'disaggregated'"),
    ("disaggregated", "at least one other"),
    ("disaggregated,nowhere", r"\['nowhere'\] are not placements"),
    ("disaggregated,colocated,colocated", "each once"),
])
def test_bad_placement_lists_name_the_flag(placements, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(placements=placements).check()


def test_another_baseline_must_be_a_listed_placement():
    assert BenchConfig(placements="first_stage,optimus", baseline="first_stage").check().names() == \
        ["first_stage", "optimus"]
    with pytest.raises(ValueError, match="--baseline 'megatron'"):
        BenchConfig(placements="first_stage,optimus", baseline="megatron").check()
    with pytest.raises(ValueError, match="list the baseline 'colocated'"):
        BenchConfig(placements="first_stage,optimus", baseline="colocated").check()


@pytest.mark.parametrize("field", ["repeats", "warmup", "profile_repeats"])
def test_counts_below_one_are_refused_with_their_flag(field):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} 0"):
        BenchConfig(**{field: 0}).check()


def test_a_repeat_is_one_whole_turn_cycle():
    assert BenchConfig().check().steps_per_repeat() == 10  # 5 placements: the 5 x 5 Williams square and its mirror
    assert BenchConfig(placements="first_stage,optimus", baseline="first_stage").steps_per_repeat() == 2
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
    # against another baseline: its loss is the reference
    with pytest.raises(RuntimeError, match="other global batches than 'first_stage'"):
        check_same_work({"first_stage": 2.0, "optimus": 2.0}, {"first_stage": [[0, 1]], "optimus": [[1, 0]]},
                        "first_stage")


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
