"""The SLOs' bounds on a generate step, on fabricated run times (no model)."""

from __future__ import annotations

from lanes.generation.steer import DEFAULT_PREFILL_TOKENS, MIN_PREFILL_TOKENS, Steer
from tests.gates import ManualClock


def test_ttft_bounds_the_prefill_tokens_by_the_measured_cost_per_token() -> None:
    steer = Steer(ttft_s=0.050, itl_s=None, max_rows=16, clock=ManualClock())
    assert steer.chunked
    assert steer.prefill_tokens(4096) == DEFAULT_PREFILL_TOKENS, "nothing measured yet"
    for tokens in (10, 20, 40, 80, 160, 10, 20, 40, 80, 160):
        steer.observe_prefill(1, tokens, 0.002 + 0.0001 * tokens)  # 2 ms + 0.1 ms a token
    assert steer.prefill_tokens(4096) == 480  # (50 - 2) ms / 0.1 ms
    assert steer.rows(100) == 16, "no itl_ms: the rows are max_batch_size"


def test_a_tight_ttft_still_admits_a_minimal_chunk() -> None:
    steer = Steer(ttft_s=0.001, itl_s=None, max_rows=4, clock=ManualClock())
    for tokens in (10, 20, 40, 80, 160, 10, 20, 40, 80, 160):
        steer.observe_prefill(1, tokens, 0.002 + 0.0001 * tokens)
    assert steer.prefill_tokens(4096) == MIN_PREFILL_TOKENS


def test_itl_bounds_the_rows_by_the_decode_cost_at_the_cache_length() -> None:
    steer = Steer(ttft_s=None, itl_s=0.010, max_rows=64, clock=ManualClock())
    assert not steer.chunked and steer.prefill_tokens(4096) == 4096
    assert steer.rows(100) == 64, "nothing measured yet"
    for rows in (1, 2, 4, 8, 16, 1, 2, 4, 8, 16):
        steer.observe_decode(rows, 100, 0.001 + rows * 100 * 0.00001)  # 1 ms + 1 ms a row
    assert steer.rows(100) == 9  # (10 - 1) ms / 1 ms
    assert steer.rows(1000) == 1, "a long cache leaves room for fewer rows (at least one)"
