"""lanes.costmodel: run time per batch learned from runs, on an injected clock, no model."""

from __future__ import annotations

import numpy as np
import pytest

from lanes.costmodel import CostModel


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def linear(items: int, tokens: int) -> float:
    return 0.002 + 0.001 * items + 0.00001 * tokens


def test_exact_runs_give_back_their_coefficients() -> None:
    model = CostModel()
    rng = np.random.default_rng(0)
    for _ in range(64):
        items = int(rng.integers(1, 33))
        tokens = items * int(rng.integers(4, 65))
        model.observe(items, tokens, linear(items, tokens))
    fit = model.fit
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.002, rel=1e-6)
    assert fit.per_item_s == pytest.approx(0.001, rel=1e-6)
    assert fit.per_token_s == pytest.approx(0.00001, rel=1e-6)
    assert fit.spread == pytest.approx(1.0, abs=1e-6)
    estimate = model.estimate(16, 16 * 40)
    assert estimate is not None
    assert estimate.seconds == pytest.approx(linear(16, 640), rel=1e-6)


def test_it_knows_nothing_until_min_samples() -> None:
    model = CostModel(min_samples=8)
    for items in range(1, 8):
        model.observe(items, 0, linear(items, 0))
    assert model.estimate(4) is None
    assert model.largest_batch(0.001, max_items=64) == 64  # no opinion: the caller's bound
    model.observe(8, 0, linear(8, 0))
    assert model.estimate(4) is not None


def test_upper_covers_the_quantile_of_noisy_runs() -> None:
    model = CostModel(quantile=0.9, window=512)
    rng = np.random.default_rng(1)
    runs = []
    for _ in range(400):
        items = int(rng.integers(1, 65))
        # Mostly on the line; one run in ten takes twice as long (a noisy neighbour).
        slow = 2.0 if rng.random() < 0.1 else 1.0
        seconds = linear(items, 0) * slow * float(rng.uniform(0.95, 1.05))
        runs.append((items, seconds))
        model.observe(items, 0, seconds)
    fit = model.fit
    assert fit is not None and fit.spread > 1.05
    covered = 0
    for items, seconds in runs:
        estimate = model.estimate(items)
        assert estimate is not None
        covered += seconds <= estimate.upper
    assert covered / len(runs) >= 0.9


def test_old_runs_age_out_on_the_injected_clock() -> None:
    clock = Clock()
    model = CostModel(horizon_s=60, min_samples=4, clock=clock)
    for items in (1, 2, 4, 8):
        model.observe(items, 0, 0.010 * items)  # a slow machine
    estimate = model.estimate(4)
    assert estimate is not None and estimate.seconds == pytest.approx(0.040)
    clock.now = 61.0
    assert model.estimate(4) is None  # everything it knew is too old
    for items in (1, 2, 4, 8):
        model.observe(items, 0, 0.001 * items)  # the same machine, now quiet
    estimate = model.estimate(4)
    assert estimate is not None and estimate.seconds == pytest.approx(0.004)


def test_largest_batch_fits_the_budget_at_the_spread() -> None:
    model = CostModel(min_samples=4)
    for items in (1, 2, 4, 8, 16):
        model.observe(items, 0, 0.001 + 0.001 * items)
    assert model.largest_batch(0.010, max_items=64) == 9  # 1 ms + 9 x 1 ms
    assert model.largest_batch(0.010, max_items=4) == 4
    assert model.largest_batch(0.0001, max_items=64) == 1  # never less than one


def test_one_batch_size_means_time_proportional_to_items() -> None:
    model = CostModel(min_samples=4)
    for _ in range(8):
        model.observe(8, 0, 0.016)
    fit = model.fit
    assert fit is not None and fit.fixed_s == 0
    estimate = model.estimate(16)
    assert estimate is not None and estimate.seconds == pytest.approx(0.032)


def test_coefficients_never_go_negative() -> None:
    model = CostModel(min_samples=4)
    # Longer padding looks cheaper here (noise: 10 us less per token, exactly): the token
    # term is dropped, not negative. (Without that slope its least-squares coefficient
    # is zero give or take rounding, whose sign depends on the machine's BLAS.)
    for items, tokens in [(1, 80), (2, 40), (4, 20), (8, 8)]:
        model.observe(items, tokens, 0.001 + 0.001 * items - 0.00001 * tokens)
    fit = model.fit
    assert fit is not None
    assert min(fit.fixed_s, fit.per_item_s, fit.per_token_s) >= 0
    assert fit.per_token_s == 0


def test_at_least_reads_the_fit_only_at_the_sizes_it_has_seen() -> None:
    """A burst of full batches (32 rows of 64 tokens, 100 ms): the fit puts the tokens'
    cost on the items, 3.125 ms each, however short. `at_least` says that much only of
    a size it saw; of one item of 64 tokens, its share of the batch; of rows shorter
    than any seen, nothing; of a larger run, what the size seen takes."""
    model = CostModel(min_samples=4)
    for _ in range(4):
        model.observe(32, 32 * 64, 0.1)
    fit = model.fit
    assert fit is not None
    assert fit.at_least(32, 32 * 64) == pytest.approx(0.1)
    assert fit.at_least(1, 64) == pytest.approx(0.1 / 32)
    assert fit.seconds(1, 1) == pytest.approx(0.1 / 32) and fit.at_least(1, 1) == 0
    assert fit.seconds(64, 64 * 128) == pytest.approx(0.2)
    assert fit.at_least(64, 64 * 128) == pytest.approx(0.1)


def test_at_least_is_never_more_than_the_estimate() -> None:
    model = CostModel(min_samples=4)
    rng = np.random.default_rng(2)
    for _ in range(12):
        items = int(rng.integers(4, 17))
        tokens = items * int(rng.integers(16, 33))
        model.observe(items, tokens, linear(items, tokens) * float(rng.uniform(0.8, 1.2)))
    fit = model.fit
    assert fit is not None
    for items in (1, 2, 4, 8, 16, 32, 64):
        for row in (0, 1, 16, 24, 32, 64):
            assert 0 <= fit.at_least(items, items * row) <= fit.seconds(items, items * row)
    assert fit.at_least(1, 1) == 0  # rows shorter than any seen
    assert fit.at_least(1, 32) > 0  # an item's share of a batch seen
