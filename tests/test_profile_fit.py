"""The profiler's fit (`loom.cost.profile_fit`, `loom.cost.profile_comm`; entrain.md §3.1)
recovers known coefficients: exactly from exact timings, and within stated tolerances from
noisy timings on the very workloads `loom profile` measures, with predictions on held-out
workloads within 5 %; the communication fit recovers a known latency and bandwidth."""

from __future__ import annotations

import numpy as np
import pytest

from loom.cost.model import Workload
from loom.cost.profile_comm import fit_communication
from loom.cost.profile_fit import FEATURES, LinearFit, evaluate, fit_cost, nnls
from loom.profile.comm import MESSAGE_SIZES
from loom.profile.inputs import item_shapes, llm_shapes
from loom.profile.profiler import DEFAULT_TOKEN_COUNTS

NOISE = 0.02  # relative standard deviation of one timing
REPEATS = 5  # timings per point; a point is their median, as the profiler takes it
SEEDS = range(8)


def true_time(coef: dict[str, float], lengths: list[int], padded: bool = False) -> float:
    """The fit's model written out from the sequence lengths, independently of `features`:
    ``a * sum(len^2) + a2 * tokens^2 + b * tokens + d * segments + c``."""
    if padded and lengths:
        lengths = [max(lengths)] * len(lengths)
    tokens = sum(lengths)
    return (coef["attn_sq"] * sum(n * n for n in lengths) + coef["tokens_sq"] * tokens**2
            + coef["tokens"] * tokens + coef["segments"] * len(lengths) + coef["one"])


def noisy(t: float, rng: np.random.Generator) -> float:
    return float(np.median(t * (1 + NOISE * rng.standard_normal(REPEATS))))


# what the profiler measures (loom.profile.inputs.module_workloads): an encoder sees no item,
# one item of each token count and packs of 64- and 16-token items; the LLM right-padded
# batches of 1, 4 and 16 sequences
ENCODER = [[]] + [s for x in DEFAULT_TOKEN_COUNTS for s in item_shapes(x)]
LLM_BATCHES = [[length] * b for x in DEFAULT_TOKEN_COUNTS for b, length in llm_shapes(x)]
HELD_OUT = {
    "encoder": [[96], [384], [1536], [100, 30, 7], [200] * 3, [48] * 10, [700, 20]],
    "llm": [[96] * 2, [48] * 8, [300] * 3, [1536], [200] * 6, [40] * 12],
}
CASES = {
    # a ViT-like layer: quadratic attention over packed items plus a dense N x N mask, per-item work
    "encoder": (ENCODER, False, dict(attn_sq=2e-9, tokens_sq=5e-10, tokens=3e-6, segments=4e-5, one=1e-4)),
    # a decoder layer on padded rows: attention per sequence, no packed-sequence term
    "llm": (LLM_BATCHES, True, dict(attn_sq=1e-9, tokens_sq=0.0, tokens=4e-6, segments=2e-5, one=5e-5)),
}


def workload(lengths: list[int], padded: bool) -> Workload:
    return Workload.padded(lengths) if padded else Workload.of_lengths(lengths)


def test_features_are_the_stated_model():
    assert FEATURES == ("attn_sq", "tokens_sq", "tokens", "segments", "one")
    coef = dict(attn_sq=1.0, tokens_sq=2.0, tokens=3.0, segments=4.0, one=5.0)
    for lengths, padded in (([100], False), ([7, 30, 100], False), ([30, 30, 30], True), ([], False)):
        assert evaluate(list(coef.values()), workload(lengths, padded)) == true_time(coef, lengths, padded)


def test_fit_recovers_known_coefficients_from_synthetic_timings():
    truth = [2e-9, 5e-10, 3e-6, 4e-5, 1e-4]  # attn_sq, tokens^2, tokens, segments, constant
    works = []
    for x in (16, 64, 256, 1024):
        for items in (1, 4, 16):
            if x // items:
                works.append(Workload.of_lengths([x // items] * items))
        works.append(Workload.padded([x // 4] * 4))
    times = [evaluate(truth, w) for w in works]
    coef = fit_cost(works, times)
    np.testing.assert_allclose(coef, truth, rtol=1e-6, atol=1e-15)
    # entrain's a x^2 + b x + c on single sequences: the same, through the same code
    single = [Workload.of_lengths([x]) for x in (64, 256, 1024, 4096, 16384)]
    abc = [3e-9, 0.0, 2e-6, 0.0, 5e-5]
    coef = fit_cost(single, [evaluate(abc, w) for w in single])
    for w in single:
        assert evaluate(coef, w) == pytest.approx(evaluate(abc, w), rel=1e-9)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_recovers_known_coefficients_from_noisy_timings_of_the_profiled_workloads(case: str):
    """2 % noise per timing, medians of 5, on the workloads the profiler measures, 8 seeds.

    Tolerances (each about 1.3x the worst seen over 300 seeds): every term's error contributes
    at most 6 % of any measured time; a coefficient whose term carries at least 20 % of some
    measured time is within 25 % of the truth, one carrying at least half within 10 %; a true
    zero stays within 6 % of the time it would add; predictions on held-out workloads (other
    sizes, mixed item lengths, other batch shapes) are within 5 %."""
    shapes, padded, coef = CASES[case]
    truth = np.array([coef[f] for f in FEATURES])
    works = [workload(s, padded) for s in shapes]
    x = np.array([[w.attn_sq, w.tokens**2, w.tokens, w.segments, 1.0] for w in works], dtype=np.float64)
    exact = np.array([true_time(coef, s, padded) for s in shapes])
    share = (x * truth / exact[:, None]).max(axis=0)  # the largest part of a measured time each term is
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        fitted = np.array(fit_cost(works, [noisy(t, rng) for t in exact]))
        assert (fitted >= 0).all()
        term_error = (np.abs(fitted - truth) * x / exact[:, None]).max(axis=0)
        assert (term_error <= 0.06).all(), (seed, dict(zip(FEATURES, term_error)))
        rel = np.abs(fitted - truth) / np.where(truth > 0, truth, 1.0)
        for i, name in enumerate(FEATURES):
            if share[i] >= 0.5:
                assert rel[i] <= 0.10, (seed, name, fitted[i], truth[i])
            elif share[i] >= 0.2:
                assert rel[i] <= 0.25, (seed, name, fitted[i], truth[i])
        for lengths in HELD_OUT[case]:
            want = true_time(coef, lengths, padded)
            got = evaluate(fitted, workload(lengths, padded))
            assert got == pytest.approx(want, rel=0.05), (seed, lengths)


def test_relative_weighting_is_what_fits_small_workloads():
    """Without the ``1 / t`` row weights the constant (what a tiny microbatch costs) is lost in
    the large workloads' noise: the held-out check above would fail on small workloads."""
    shapes, padded, coef = CASES["encoder"]
    works = [workload(s, padded) for s in shapes]
    rng = np.random.default_rng(0)
    times = [noisy(true_time(coef, s, padded), rng) for s in shapes]
    small = Workload.of_lengths([4])
    want = true_time(coef, [4])
    assert evaluate(fit_cost(works, times), small) == pytest.approx(want, rel=0.05)
    assert evaluate(fit_cost(works, times, relative=False), small) != pytest.approx(want, rel=0.05)


def test_fit_is_non_negative_and_nnls_matches_a_brute_force_oracle():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(8, 3))
        b = rng.normal(size=8)
        x = nnls(a, b)
        assert (x >= 0).all()
        # oracle: best least-squares solution over every support set, clamped to feasible ones
        best = np.inf
        for mask in range(8):
            cols = [j for j in range(3) if mask >> j & 1]
            z = np.zeros(3)
            if cols:
                z[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (z >= -1e-12).all():
                best = min(best, np.linalg.norm(a @ z - b))
        assert np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9, abs=1e-12)
    # a decreasing trend cannot be fitted with a negative slope: it becomes a constant
    works = [Workload.of_lengths([n]) for n in (10, 20, 40)]
    coef = fit_cost(works, [3.0, 2.0, 1.0])
    assert min(coef) >= 0


# ---- communication ----------------------------------------------------------------------------
def test_comm_fit_interpolates_its_points_and_extrapolates_the_line():
    fit = LinearFit.fit([(1e6, 1e-4 + 1e-3), (0, 1e-4), (4e6, 1e-4 + 4e-3)])
    assert fit.alpha_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.seconds_per_byte == pytest.approx(1e-9, rel=1e-6)
    assert fit.time(2e6) == pytest.approx(1e-4 + 2e-3) and fit.time(8e6) == pytest.approx(1e-4 + 8e-3)
    step = LinearFit.fit([(0, 1e-4), (1000, 2e-3), (2000, 2e-3)])  # a step, as small messages make
    assert step.time(0) == 1e-4 and step.time(500) == pytest.approx((1e-4 + 2e-3) / 2)
    assert step.time(1500) == pytest.approx(2e-3)


# latency (s) and inverse bandwidth (s/byte) per quantity, of the order gloo shows on loopback
COMM_TRUTH = {
    "send_post": (2e-5, 5e-11),
    "recv_ready": (8e-5, 4e-10),
    "latency": (1.5e-4, 6e-10),
    "all_reduce": (3e-4, 1.2e-9),
}


def test_fit_communication_recovers_a_known_latency_and_bandwidth():
    """Rows as `message_pass` returns them (two ranks, 2 rows per size, 9 passes each), times
    ``alpha + bytes * beta`` with 2 % noise: alpha within 10 %, beta within 5 %, and the
    fitted times at sizes between and beyond the measured ones within 5 %."""
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        passes = []
        for _rank in range(2):
            for _ in range(9):
                passes.append({q: [[n, (a + n * b) * (1 + NOISE * rng.standard_normal())]
                                   for n in MESSAGE_SIZES for _ in range(2)]
                               for q, (a, b) in COMM_TRUTH.items()})
        comm = fit_communication(passes, world=4)
        assert comm.world == 4 and comm.recv_ready_idle is None
        for q, (a, b) in COMM_TRUTH.items():
            fit: LinearFit = getattr(comm, q)
            assert fit.alpha_s == pytest.approx(a, rel=0.10), (seed, q)
            assert fit.seconds_per_byte == pytest.approx(b, rel=0.05), (seed, q)
            assert [p[0] for p in fit.points] == sorted(set(MESSAGE_SIZES))
            for n in (0, 4096, 100_000, 2_000_000, 16_000_000):
                assert fit.time(n) == pytest.approx(a + n * b, rel=0.05), (seed, q, n)


def test_encoder_packs_have_distinct_item_lengths():
    """The zoo encoders run one attention call per distinct item length, so the profiler's packs
    use distinct lengths (the per-item term then prices one call per item, as for images of mixed
    sizes); each pack keeps its target's tokens, and both pack sizes are measured."""
    for target in DEFAULT_TOKEN_COUNTS:
        shapes = item_shapes(target)
        assert shapes[0] == [target]
        for shape in shapes:
            assert sum(shape) == target, (target, shape)
            assert len(set(shape)) == len(shape), (target, shape)
    packs = [len(s) for x in DEFAULT_TOKEN_COUNTS for s in item_shapes(x) if len(s) > 1]
    assert max(packs) >= 16 and min(packs) <= 2
    assert item_shapes(256) == [[256], [66, 65, 63, 62], list(range(24, 16, -1)) + list(range(15, 7, -1))]
