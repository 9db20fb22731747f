"""The SLOs' bounds on a generate step, on fabricated run times (no model)."""

from __future__ import annotations

from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import StepOutputs
from lanes.generation.steer import DEFAULT_PREFILL_TOKENS, MIN_PREFILL_TOKENS, Steer
from tests.gates import ManualClock
from tests.test_scheduler import A, ids, logits, make, seq, step


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


def test_stalled_runs_halve_the_prefill_budget_at_most() -> None:
    steer = Steer(ttft_s=0.050, itl_s=None, max_rows=16, clock=ManualClock())
    for tokens in (10, 20, 40, 80, 160) * 4:
        steer.observe_prefill(1, tokens, 0.002 + 0.0001 * tokens)
    steer.observe_prefill(1, 10, 0.030)  # one run lost the core for 27 ms
    fit = steer.prefill_cost.fit
    assert fit is not None and fit.spread > 4
    # A budget divided by the whole spread would split long prompts into many small
    # parts, each paying a decode of the rows; the stall is no shorter for it.
    half = (0.050 / 2 - fit.fixed_s - fit.per_item_s) / fit.per_token_s
    assert steer.prefill_tokens(4096) == int(half + 1e-9) > 200


def test_itl_bounds_the_rows_by_the_decode_cost_at_the_cache_length() -> None:
    steer = Steer(ttft_s=None, itl_s=0.010, max_rows=64, clock=ManualClock())
    assert not steer.chunked and steer.prefill_tokens(4096) == 4096
    assert steer.rows(100) == 64, "nothing measured yet"
    for rows in (1, 2, 4, 8, 16, 1, 2, 4, 8, 16):
        steer.observe_decode(rows, 100, 0.001 + rows * 100 * 0.00001)  # 1 ms + 1 ms a row
    assert steer.rows(100) == 9  # (10 - 1) ms / 1 ms
    assert steer.rows(1000) == 1, "a long cache leaves room for fewer rows (at least one)"


def test_offline_rows_ride_along_only_where_they_cost_the_interactive_step_little() -> None:
    per_row = Steer(ttft_s=None, itl_s=None, max_rows=16, clock=ManualClock())
    assert not per_row.offline_rides(100, 2, 6), "nothing measured: the gaps only"
    assert per_row.offline_rides(100, 0, 6), "no interactive rows: nothing to protect"
    for rows in (1, 2, 4, 8, 16) * 2:  # a CPU: 1 ms + 1 ms a row
        per_row.observe_run(rows, 100, 0.001 + rows * 100 * 0.00001)
    assert not per_row.offline_rides(100, 2, 6), "6 rows would make 3 ms steps 9 ms"
    assert not per_row.offline_rides(100, 8, 1), "one more row is 1/9 more: past 10%"
    assert per_row.offline_rides(100, 16, 1), "1/17 more"

    flat = Steer(ttft_s=None, itl_s=0.01005, max_rows=64, clock=ManualClock())
    for rows in (1, 2, 4, 8, 16, 32, 64) * 2:  # a GPU: 10 ms + 1 us a row
        flat.observe_run(rows, 100, 0.010 + rows * 100 * 0.00000001)
    assert flat.offline_rides(100, 2, 30), "30 more rows cost the step 0.3%, within itl_ms"
    assert not flat.offline_rides(100, 2, 62), "within 10%, but past itl_ms"


def test_the_steer_lets_a_scheduler_s_offline_rows_ride_along_by_the_cost_model() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=None, itl_s=None, max_rows=8, clock=clock)
    s = make(max_running=8, clock=clock)
    for i in range(3):
        s.add(seq(10 + i, offline=True, max_new=50))
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    assert ids(plan.prefill) == [10, 11, 12], "no interactive work: the gap is theirs"
    s.add(seq(1, max_new=50))
    for _ in range(3):
        steer.apply(s, 100, 4096)
        plan, _ = step(s)
    assert ids(plan.decode) == [1], "measured nothing yet: the offline rows sit out"
    for rows in (1, 2, 4, 8) * 2:  # a run's cost hardly grows with its rows
        steer.observe_run(rows, 100, 0.010 + rows * 0.00001)
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    assert ids(plan.decode) == [10, 11, 12, 1], "they decode beside the interactive row"


# ---- steering a real scheduler: its rows and queue, on a manual clock ----------------


def measured(steer: Steer) -> None:
    """Exact costs (so the spread is 1): prefill 2 ms + 0.1 ms a token; a decode step
    over a 100-long cache 1 ms + 1 ms a row."""
    for tokens in (10, 20, 40, 80, 160, 10, 20, 40, 80, 160):
        steer.observe_prefill(1, tokens, 0.002 + 0.0001 * tokens)
    for rows in (1, 2, 4, 8, 16, 1, 2, 4, 8, 16):
        steer.observe_decode(rows, 100, 0.001 + rows * 100 * 0.00001)


def running(clock: ManualClock, rows: int, max_rows: int = 16) -> Scheduler:
    s = make(max_running=max_rows, clock=clock)
    for i in range(rows):
        s.add(seq(100 + i, max_new=1000))
    step(s)
    assert s.num_running == rows
    return s


def test_the_prefill_budget_leaves_ttft_room_for_the_decode_of_the_current_rows() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.050, itl_s=None, max_rows=16, clock=clock)
    measured(steer)
    s = running(clock, 8)
    steer.apply(s, 100, 4096)
    # A joiner's first token comes after the 8 rows' decode (9 ms) and its prefill:
    # (50 - 9 - 2) ms / 0.1 ms, not the (50 - 2) / 0.1 = 480 of a step without rows.
    assert s.max_prefill_tokens == 390
    assert steer.prefill_tokens(4096) == 480
    # 48 rows would take 49 ms: no smaller prefill meets ttft_ms then, and it keeps
    # the budget of half of it, (25 - 2) ms / 0.1 ms, rather than split every prompt.
    assert steer.prefill_tokens(4096, rows=48, length=100) == 230


def test_a_waiting_prompt_joins_past_the_itl_bound_once_its_ttft_is_nearer_to_being_missed() -> (
    None
):
    clock = ManualClock()
    steer = Steer(ttft_s=0.100, itl_s=0.005, max_rows=16, clock=clock)
    measured(steer)
    s = running(clock, 4)
    s.add(seq(1, arrived=clock.now))
    steer.apply(s, 100, 4096)
    assert s.max_running == 4, "(5 - 1) ms / 1 ms a row"
    plan = s.schedule()
    # With it a step would take 6 ms, 1.2x itl_ms; its first token 8.3 ms, 0.08x ttft_ms.
    assert plan.prefill == (), "its TTFT has room: the rows' ITL comes first"
    s.update(plan, StepOutputs(decode=logits(*[A] * 4)))
    clock.advance(0.115)
    s.add(seq(2, arrived=clock.now))
    steer.apply(s, 100, 4096)
    plan = s.schedule()
    # Waited 115 ms: its first token at 1.23x ttft_ms against 1.2x itl_ms for the rows;
    # the one that just came (7 ms, 0.07x against 1.4x with a 6th row) still waits.
    assert ids(plan.prefill) == [1] and s.num_waiting == 1

    itl_only = Steer(ttft_s=None, itl_s=0.005, max_rows=16, clock=clock)
    measured(itl_only)
    itl_only.apply(s, 100, 4096)
    assert s.max_running == 4 and s.past_bound == 0, "no ttft_ms: the ITL bound alone"


def test_waiting_prompts_fill_the_rows_the_itl_bound_leaves_before_any_joins_past_it() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.100, itl_s=0.007, max_rows=16, clock=clock)
    measured(steer)
    s = running(clock, 4)
    for i in range(3):
        s.add(seq(i + 1, arrived=clock.now - 1.0))  # waited long: their TTFT is missed
    steer.apply(s, 100, 4096)
    assert s.max_running == 6 and s.past_bound == 1
    plan = s.schedule()
    assert ids(plan.prefill) == [1, 2, 3]


# ---- a long prompt: whole or in parts, and never in the joiners' step alone ----------


def steered(clock: ManualClock, steer: Steer, rows: int, max_rows: int = 16) -> Scheduler:
    """`rows` rows decoding on a scheduler run as the engine runs it."""
    s = make(max_running=max_rows, clock=clock, prefill_alone=True, chunked=True)
    for i in range(rows):
        s.add(seq(100 + i, max_new=1000))
    steer.apply(s, 100, 4096)
    step(s)
    assert s.num_running == rows
    return s


def test_a_long_prompt_whose_ttft_is_the_nearer_slo_is_prefilled_whole() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.020, itl_s=0.030, max_rows=16, clock=clock)
    measured(steer)
    s = steered(clock, steer, 2)
    s.add(seq(1, prompt=300, arrived=clock.now))
    steer.apply(s, 100, 4096)
    # Beside the rows' 3 ms decode, (20 - 3 - 2) ms / 0.1 ms = 150 tokens fit ttft_ms.
    assert steer.prefill_tokens(4096, rows=2, length=100) == 150
    # Whole, its prefill takes 32 ms: 1.6x ttft_ms, against 1.17x itl_ms for the rows'
    # next token. Parts would add a decoder run each, and a decode of the rows, to the
    # SLO nearer to being missed.
    assert s.max_prefill_tokens == 300
    plan = s.schedule()
    assert ids(plan.prefill) == [1] and plan.chunk is None


def test_a_long_prompt_goes_in_parts_when_the_rows_itl_is_nearer_or_prompts_queue() -> None:
    clock = ManualClock()
    itl_nearer = Steer(ttft_s=0.200, itl_s=0.030, max_rows=16, clock=clock)
    measured(itl_nearer)
    s = steered(clock, itl_nearer, 2)
    s.add(seq(1, prompt=3000, arrived=clock.now))
    itl_nearer.apply(s, 100, 4096)
    # Whole: 302 ms, 1.5x ttft_ms, against 10.2x itl_ms for the rows.
    plan = s.schedule()
    assert plan.chunk is not None and plan.chunk.seq.id == 1 and not plan.chunk.final

    steer = Steer(ttft_s=0.020, itl_s=0.030, max_rows=3, clock=clock)
    measured(steer)
    s = steered(clock, steer, 2, max_rows=3)
    s.add(seq(1, prompt=300, arrived=clock.now))
    s.add(seq(2, arrived=clock.now))
    steer.apply(s, 100, 4096)
    assert s.max_running + s.past_bound - s.num_running == 1, "one row for two prompts"
    # Prompts queue for rows: each long prompt's whole run would stall the rows again.
    plan = s.schedule()
    assert plan.chunk is not None and plan.chunk.seq.id == 1 and not plan.chunk.final


def test_the_next_part_waits_for_the_rows_decode_never_in_the_joiners_step_alone() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.020, itl_s=None, max_rows=16, clock=clock)
    measured(steer)
    s = steered(clock, steer, 2)
    s.add(seq(1, prompt=400))
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    assert plan.chunk is not None and plan.chunk.seq.id == 1 and ids(plan.decode) == [100, 101]
    s.add(seq(2))
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    # The joiner's first token waits for its own prefill only; the rows, for it only.
    assert ids(plan.prefill) == [2] and plan.decode == () and plan.chunk is None
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    assert plan.chunk is not None and ids(plan.decode) == [100, 101, 2]


def test_the_parts_of_a_long_prompt_take_what_fits_itl_beside_the_rows_decode() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.020, itl_s=0.060, max_rows=3, clock=clock)
    measured(steer)
    s = steered(clock, steer, 2, max_rows=3)
    s.add(seq(1, prompt=3000, arrived=clock.now))
    s.add(seq(2, arrived=clock.now))  # one row for two prompts: the long one goes in parts
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    # The first part as any step's prefill: (20 - 3 - 2) ms / 0.1 ms beside the decode.
    assert plan.chunk is not None and (plan.chunk.start, plan.chunk.stop) == (0, 150)
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    # Its first token is far past ttft_ms however it goes: the parts are bounded by the
    # rows' ITL, (60 - 3 - 2) ms / 0.1 ms, so it takes fewer steps.
    assert plan.chunk is not None and (plan.chunk.start, plan.chunk.stop) == (150, 700)
    assert ids(plan.decode) == [100, 101]


def test_a_prompt_within_ttft_goes_in_parts_when_its_run_would_hold_the_rows_past_itl() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.100, itl_s=0.020, max_rows=16, clock=clock)
    measured(steer)
    s = steered(clock, steer, 2)
    s.add(seq(1, prompt=400, arrived=clock.now))
    steer.apply(s, 100, 4096)
    # Its 42 ms prefill fits ttft_ms (0.42x), but holds the rows' next token 2.25x
    # itl_ms: the nearer SLO bounds the step to (20 - 3 - 2) ms / 0.1 ms of prompt.
    assert steer.prefill_tokens(4096, rows=2, length=100) == 950
    assert s.max_prefill_tokens == 150
    parts = []
    for _ in range(3):
        plan = s.schedule()
        assert plan.chunk is not None and ids(plan.decode) == [100, 101]
        parts.append((plan.chunk.start, plan.chunk.stop))
        last = logits(A) if plan.chunk.final else None
        s.update(plan, StepOutputs(decode=logits(A, A), chunk=last))
        steer.apply(s, 100, 4096)
    assert parts == [(0, 150), (150, 300), (300, 400)]


def test_the_parts_take_the_mean_cost_however_runs_stalled() -> None:
    clock = ManualClock()
    steer = Steer(ttft_s=0.020, itl_s=0.060, max_rows=3, clock=clock)
    measured(steer)
    steer.observe_prefill(1, 10, 0.030)  # one run lost the core for 27 ms
    fit, decode = steer.prefill_cost.fit, steer.decode_cost.estimate(2, 200)
    assert fit is not None and fit.spread > 2 and decode is not None
    s = steered(clock, steer, 2, max_rows=3)
    s.add(seq(1, prompt=3000, arrived=clock.now))
    s.add(seq(2, arrived=clock.now))  # one row for two prompts: the long one goes in parts
    steer.apply(s, 100, 4096)
    step(s)
    steer.apply(s, 100, 4096)
    plan, _ = step(s)
    # A smaller part avoids no stall: it only adds steps, each with the rows' decode.
    mean = (0.060 - decode.seconds - fit.fixed_s - fit.per_item_s) / fit.per_token_s
    assert plan.chunk is not None and plan.chunk.stop - plan.chunk.start == int(mean + 1e-9)
