"""balance_real's measurement design (issue 8): the groups' turn orders are balanced, and a
repeat's ratio pairs none and the policy on the same global batches, so which batches a repeat
drew cannot move the figure. Pure functions on synthetic step times: no process is started."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks import balance_real
from benchmarks.balance_real import paired_differences, paired_ratio, summarize_batching, turn_orders


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_turn_orders_balance_positions_and_predecessors(n):
    names = [f"g{i}" for i in range(n)]
    orders = turn_orders(names)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == names for order in orders)  # every group once per step
    per = len(orders) // n
    positions = Counter((name, k) for order in orders for k, name in enumerate(order))
    assert set(positions.values()) == {per} and len(positions) == n * n  # every position equally often
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(follows) == n * (n - 1) and set(follows.values()) == {per}  # every predecessor equally often


def _step(total: float, **parts: float) -> dict:
    return {"total": total, "dispatch": parts.get("dispatch", 0.01), "engine_step": parts.get("engine", total - 0.01),
            "compute": [total / 2, total / 2], "cpu": [parts.get("cpu0", total), parts.get("cpu1", total)], "gc": [0.0, 0.0], "num_microbatches": 8,
            "llm_padded_over_real": 1.0, "mb_max_over_mean": {"llm": 1.0}, "slots": {}, "kept_given": False, "eager_forward": 0,
            "predicted_gain": 0.0}


def test_a_repeat_ratio_is_paired_on_the_same_batches():
    # batches of very different sizes; the policy takes 1/1.25 of none's time on every one of them
    batch_s = [1.0, 3.0, 1.2, 2.8, 0.9, 3.1]
    base = [_step(t) for t in batch_s]
    fast = [_step(t / 1.25) for t in batch_s]
    # and a policy that pays 20 ms of dispatch (rank 0's CPU) on every step, nothing else
    slow = [_step(t + 0.02, dispatch=0.03, engine=t - 0.01, cpu0=t + 0.02, cpu1=t) for t in batch_s]
    run = {"timed": {"none": base, "p": fast, "q": slow},
           "repeats": {n: [st[0:3], st[3:6]] for n, st in {"none": base, "p": fast, "q": slow}.items()},
           "peak_rss_mb": {"none": 1.0, "p": 1.0, "q": 1.0}}
    out = summarize_batching(run)
    assert out["p"]["repeat_ratio"] == pytest.approx([1.25, 1.25])
    assert out["none"]["repeat_ratio"] == pytest.approx([1.0, 1.0])
    assert out["q"]["repeat_ratio"] == pytest.approx([sum(batch_s[:3]) / (sum(batch_s[:3]) + 0.06),
                                                       sum(batch_s[3:]) / (sum(batch_s[3:]) + 0.06)])
    assert out["p"]["repeat_step_s"] == pytest.approx([sum(batch_s[:3]) / 3 / 1.25, sum(batch_s[3:]) / 3 / 1.25])
    d = out["q"]["minus_none_ms"]
    assert d["total"] == pytest.approx(20.0) and d["dispatch"] == pytest.approx(20.0)
    assert d["cpu"] == pytest.approx([20.0, 0.0]) and d["engine_step"] == pytest.approx(0.0)
    assert paired_differences(base, base)["total"] == 0.0


def test_paired_ratio_refuses_unpaired_steps():
    assert paired_ratio([1.0, 3.0], [0.5, 1.5]) == 2.0
    with pytest.raises(ValueError, match="pair the same steps"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_ratio([], [])


def test_plans_fit_two_ranks_and_orchmllm_is_timed_only_where_it_acts():
    """Both plans run on the benchmark's 2 ranks; OrchMLLM (data-parallel rounds) keeps none's
    layout by construction on the pipeline, so that plan does not time it, and acts on the
    colocated one (OrchMLLM's own setting)."""
    from loom.balance.config import BalanceConfig
    from loom.balance.policy import nothing_to_balance

    for name, (_, build) in balance_real.PLANS.items():
        assert build(8).world_size == balance_real.WORLD_SIZE, name
    acts = {name: {p: not nothing_to_balance(BalanceConfig(default=p), build(8))
                   for p in ("orchmllm", "disttrain", "entrain")} for name, (_, build) in balance_real.PLANS.items()}
    assert acts == {"pipeline": {"orchmllm": False, "disttrain": True, "entrain": True},
                    "colocated": {"orchmllm": True, "disttrain": True, "entrain": True}}
    with pytest.raises(ValueError, match="--plans"):
        balance_real.RealConfig(plans="pipeline,ring").check()
    assert balance_real.train_config(balance_real.RealConfig(), "colocated", "padded", "orchmllm", 3).plan.placement \
        == "colocated"
