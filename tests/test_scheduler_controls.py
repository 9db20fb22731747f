"""vLLM's stop_token_ids, min_tokens and include_stop_str_in_output in the scheduler
(lanes/generation/advance.py), on fabricated logits: no model, milliseconds."""

from __future__ import annotations

import numpy as np

from lanes.generation.seq import Event, StepOutputs
from lanes.tasks.sampling import SamplingParams, sample
from tests.test_scheduler import EOS, VOCAB, A, B, C, X, by_id, logits, make, seq, step


def test_a_stop_token_ends_the_sequence_as_eos_does_and_is_not_in_its_text() -> None:
    s = make()
    s.add(seq(0, stop_token_ids=frozenset({X})))
    s.add(seq(1))  # declared nothing: X is one more token
    step(s)
    _, events = step(s, X)
    # Not shown, but made: counted as vLLM counts it (Event.made).
    assert by_id(events)[0] == Event(0, (), "", "stop", stop_token=X)
    assert by_id(events)[0].made == 1
    assert s.advance.controlled == 0  # the finished one no longer counts
    assert by_id(events)[1].tokens == (X,) and by_id(events)[1].finish is None


def test_min_tokens_masks_eos_and_stop_tokens_until_then() -> None:
    s = make()
    s.add(seq(0, min_tokens=3, stop_token_ids=frozenset({X})))
    made = []
    for token in (EOS, X, EOS, EOS):
        _, events = step(s, token)
        made += [t for e in events for t in e.tokens]
        if events[-1].finish:
            break
    # Masked, eos and X leave the row's next likeliest (the first of its -10s: EOS
    # masked too, so token 1, A) for the first 3 tokens; then eos ends it.
    assert made == [A, A, A] and events[-1].finish == "stop"


def test_min_tokens_masks_nothing_but_eos_and_stop_tokens() -> None:
    s = make()
    s.add(seq(0, min_tokens=2))
    _, events = step(s, B)
    assert events[0].tokens == (B,)


def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text() -> None:
    s = make()
    s.add(seq(0, stop=("bc",), include_stop=True))
    s.add(seq(1, stop=("bc",)))
    for token in (A, B, C, A):
        _, events = step(s, token)
        if all(e.finish for e in events):
            break
    assert [r.text for r in s.rows] == ["abc", "a"]
    assert [e.finish for e in events] == ["stop", "stop"]


def test_min_tokens_keeps_a_stop_string_from_ending_the_text_before_it() -> None:
    """As vLLM: a stop string is looked for only once min_tokens tokens are made; one
    that ends after them may start in their text."""
    s = make()
    rows = [seq(0, stop=("b",), min_tokens=2), seq(1, stop=("ba",), min_tokens=1)]
    rows.append(seq(2, stop=("b",)))  # declared no min_tokens: its first b ends it
    for row in rows:
        s.add(row)
    for token in (B, A, B):
        step(s, token)
    assert [r.text for r in rows] == ["ba", "", ""]
    assert [r.status.finish_reason for r in rows] == ["stop", "stop", "stop"]
    assert [len(r.tokens) for r in rows] == [3, 2, 1]


def test_rows_without_controls_pick_as_alone_beside_rows_with_them() -> None:
    s = make()
    s.add(seq(0, min_tokens=4))
    s.add(seq(1))
    plan = s.schedule()
    row = np.full((2, VOCAB), -10.0, dtype=np.float32)
    row[:, EOS] = 10.0
    row[:, B] = 5.0
    events = by_id(s.update(plan, StepOutputs(row, None)))
    assert events[0].tokens == (B,)  # eos masked: the next likeliest
    assert events[1] == Event(1, (), "", "stop", True, stop_token=EOS)  # eos, as alone
    assert row[0, EOS] == 10.0  # the logits themselves are left as they were


def test_a_final_chunk_picks_with_the_controls_too() -> None:
    s = make(max_prefill_tokens=4, chunked=True)
    s.add(seq(0, prompt=10, min_tokens=2))
    events: list[Event] = []
    while not events:
        plan = s.schedule()
        assert plan.chunk is not None
        chunk = logits(EOS) if plan.chunk.final else None
        events = s.update(plan, StepOutputs(chunk=chunk))
    assert events[-1].tokens == (A,) and events[-1].finish is None


def test_min_p_drops_what_is_less_likely_than_min_p_times_the_likeliest() -> None:
    row = np.log(np.array([0.5, 0.3, 0.09, 0.11]))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, min_p=0.2)
    drawn = {sample(row, params, rng) for _ in range(400)}
    assert drawn == {0, 1, 3}  # 0.09 < 0.2 * 0.5; 0.11 is kept


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    """As vLLM: below 1e-5 a temperature picks as 0 does, the likeliest token; the
    logits divided by 1e-320 would be infinite, and every token as likely."""
    row = np.array([1.0, 3.0, 2.0, -1.0])
    rng = np.random.default_rng(0)
    for temperature in (1e-320, 1e-6):
        drawn = {sample(row, SamplingParams(temperature=temperature), rng) for _ in range(50)}
        assert drawn == {1}, temperature


def test_penalties_count_each_made_token_once_however_many_steps() -> None:
    s = make()
    s.add(seq(0, frequency_penalty=1.0, presence_penalty=0.5))
    made = []
    for _ in range(4):
        plan = s.schedule()
        rows = np.full((1, VOCAB), -10.0)
        rows[0, A], rows[0, B] = 2.0, 0.0
        outputs = StepOutputs(rows, None) if plan.prefill else StepOutputs(None, rows)
        made += [t for e in s.update(plan, outputs) for t in e.tokens]
    # A (2.0), A (2.0 - 1 - 0.5 = 0.5 > 0.0), B (2.0 - 2 - 0.5 < 0.0), A (-0.5 > -1.5).
    assert made == [A, A, B, A]
    # Counted at each pick, the tokens made before it: the last one waits for the next.
    assert s.rows[0].counts == {A: 2, B: 1} and s.rows[0].counted == 3
