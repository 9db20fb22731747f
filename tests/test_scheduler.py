"""The continuous-batching scheduler on fabricated logits: no model, no threads, milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from lanes.costmodel import Fit
from lanes.generation.prefill import prefill_groups
from lanes.generation.prefixes import PrefixCache
from lanes.generation.reserve import Reserve
from lanes.generation.scheduler import Policy, Scheduler
from lanes.generation.seq import Event, Seq, SeqStatus, StepOutputs, StepPlan
from lanes.tasks.past import Past
from lanes.tasks.sampling import SamplingParams

# Token ids: 0 is eos; 1-6 are one character each; 7 and 8 are the two halves of "é".
CHARS = {1: "a", 2: "b", 3: "c", 4: " ", 5: "\n", 6: "x"}
EOS, A, B, C, SPACE, NEWLINE, X, E1, E2 = range(9)
VOCAB = 9


def detokenize(ids: Sequence[int]) -> str:
    """Like a byte-level decoder: an unfinished multi-byte character decodes to U+FFFD."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == E1 and i + 1 < len(ids) and ids[i + 1] == E2:
            out.append("é")
            i += 2
            continue
        out.append(CHARS.get(ids[i], "\ufffd") if ids[i] != EOS else "")
        i += 1
    return "".join(out)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(max_running: int = 4, policy: Policy = "continuous", **kw: object) -> Scheduler:
    return Scheduler(max_running, frozenset({EOS}), detokenize, policy=policy, **kw)  # type: ignore[arg-type]


def seq(
    id: int, prompt: int = 3, max_new: int = 8, stop: tuple[str, ...] = (), **kw: object
) -> Seq:
    return Seq(
        id=id,
        prompt_ids=tuple(range(1, prompt + 1)),
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=0),
        stop=stop,
        **kw,  # type: ignore[arg-type]
    )


def logits(*tokens: int) -> np.ndarray:
    """One row per token, peaked at that token."""
    rows = np.full((len(tokens), VOCAB), -10.0, dtype=np.float32)
    rows[np.arange(len(tokens)), list(tokens)] = 10.0
    return rows


def step(s: Scheduler, choose: dict[int, int] | int = A) -> tuple[StepPlan, list[Event]]:
    """Schedule, then feed each row the token `choose` names for its sequence."""
    plan = s.schedule()

    def pick(rows: tuple[Seq, ...]) -> np.ndarray | None:
        if not rows:
            return None
        wanted = [choose.get(r.id, A) if isinstance(choose, dict) else choose for r in rows]
        return logits(*wanted)

    return plan, s.update(plan, StepOutputs(pick(plan.prefill), pick(plan.decode)))


def ids(rows: Sequence[Seq]) -> list[int]:
    return [r.id for r in rows]


def by_id(events: list[Event]) -> dict[int, Event]:
    return {e.seq_id: e for e in events}


def test_statuses_are_ordered_and_finished_from_stopped_on() -> None:
    assert [s.is_finished for s in SeqStatus] == [False, False, True, True, True, True, True]
    assert SeqStatus.FINISHED_LENGTH.finish_reason == "length"
    assert SeqStatus.RUNNING.finish_reason is None


def test_joiners_prefill_then_decode_and_a_finished_row_is_refilled_at_once() -> None:
    s = make(max_running=2)
    for i, n in enumerate((2, 5, 3)):
        s.add(seq(i, max_new=n))
    plan, events = step(s)
    assert ids(plan.prefill) == [0, 1] and plan.decode == ()
    assert all(e.first and e.tokens == (A,) for e in events)
    plan, events = step(s)  # seq 0 reaches its budget of 2
    assert ids(plan.decode) == [0, 1] and plan.prefill == ()
    assert by_id(events)[0].finish == "length" and by_id(events)[0].text == "a"
    plan, _ = step(s)  # its row goes to seq 2 at the very next step
    assert ids(plan.decode) == [1] and ids(plan.prefill) == [2]
    assert s.num_running == 2 and s.num_waiting == 0


def test_eos_stops_without_a_token_unless_ignored() -> None:
    """An eos that ends a sequence is no token of its text, but it was made: usage
    counts it, as vLLM does (Event.made)."""
    s = make()
    s.add(seq(0))
    s.add(seq(1, ignore_eos=True))
    step(s)
    _, events = step(s, EOS)
    assert by_id(events)[0] == Event(0, (), "", "stop", stop_token=EOS)
    assert by_id(events)[0].made == 1 and by_id(events)[1].made == 1
    assert by_id(events)[1].tokens == (EOS,) and by_id(events)[1].finish is None


def test_stop_string_is_held_back_then_cut_and_never_sent() -> None:
    s = make()
    s.add(seq(0, stop=("bc",)))
    sent = []
    for token in (A, A, B, C, A):
        _, events = step(s, token)
        sent += [e.text for e in events]
        if events[-1].finish:
            break
    assert events[-1].finish == "stop" and events[-1].tokens == (C,)
    assert sent == ["a", "a", "", ""]  # only "b" waited: it could have begun "bc"
    assert s.rows[0].text == "aa" and s.rows[0].tokens == [A, A, B, C]


def test_text_that_cannot_begin_a_stop_string_goes_out_at_once() -> None:
    """However long a stop string, only the end of the text that may still become
    one waits; a long stop string does not hold its length of text back."""
    s = make()
    s.add(seq(0, max_new=12, stop=("x" + "b" * 500, "ca")))
    sent = []
    for token in (A, B, X, B, A, C, C, A):
        _, events = step(s, token)
        sent.append(events[0].text)
    assert sent == ["a", "b", "", "", "xba", "", "c", ""]
    assert events[0].finish == "stop" and s.rows[0].text == "abxbac"


def held_back(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins some stop string."""
    ends = [k for k in range(1, len(text) + 1) for x in stop if x.startswith(text[-k:])]
    return max(ends, default=0)


@pytest.mark.parametrize("stop", [("bc",), ("aab", "ba"), ("x" + "a" * 30,), ("abab", "bx")])
def test_what_is_sent_is_all_but_the_end_that_may_begin_a_stop_string(
    stop: tuple[str, ...],
) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        s = make()
        s.add(seq(0, max_new=20, stop=stop))
        sent = ""
        for token in rng.choice([A, B, C, X], size=20).tolist():
            _, events = step(s, token)
            sent += events[0].text
            if events[0].finish:
                break
            text = s.rows[0].text
            assert sent == text[: len(text) - held_back(text, stop)], (text, stop)
        assert sent == s.rows[0].text
        assert not any(x in sent for x in stop)


def test_streamed_text_always_adds_up_to_the_whole_text() -> None:
    for stop in ((), ("xx",), ("b", "\nc")):
        s = make()
        s.add(seq(0, max_new=12, stop=stop))
        sent = []
        for token in (A, NEWLINE, A, B, X, A, SPACE, C, X, A, A, A):
            _, events = step(s, token)
            sent.append(events[0].text)
            if events[0].finish:
                break
        whole = s.rows[0].text
        assert "".join(sent) == whole, stop
        assert not any(x and x in whole for x in stop)


def test_a_character_split_across_tokens_is_sent_whole() -> None:
    s = make()
    s.add(seq(0, max_new=3))
    texts = [step(s, t)[1][0].text for t in (E1, E2, A)]
    assert texts == ["", "é", "a"]
    s = make()
    s.add(seq(0, max_new=2))
    texts = [step(s, t)[1][0].text for t in (A, E1)]
    assert texts == ["a", "\ufffd"]  # cut by the budget: flushed as decode() gives it


def test_budget_is_cut_by_the_models_context() -> None:
    s = make(max_position=6)
    s.add(seq(0, prompt=4, max_new=100))
    _, first = step(s)
    _, second = step(s)
    assert first[0].finish is None and second[0].finish == "length"
    assert s.advance.budget(seq(1, prompt=4, max_new=100)) == 2


def test_abort_while_waiting_never_runs_and_while_running_frees_the_row() -> None:
    s = make(max_running=1)
    s.add(seq(0))
    s.add(seq(1))
    s.add(seq(2))
    step(s)
    s.abort(1)  # waiting
    plan, events = step(s)
    assert ids(plan.retired) == [1] and by_id(events)[1] == Event(1, (), "", "abort")
    s.abort(0)  # running
    s.abort(99)  # unknown: ignored
    plan, events = step(s)
    assert ids(plan.retired) == [0] and ids(plan.prefill) == [2] and plan.decode == ()
    assert by_id(events)[0].finish == "abort" and by_id(events)[0].text == ""
    s.abort(0)  # already gone: ignored
    assert s.schedule().retired == ()


def test_deadlines_expire_waiting_and_running_sequences() -> None:
    clock = Clock()
    s = make(max_running=1, clock=clock)
    s.add(seq(0, deadline=110.0))
    s.add(seq(1, deadline=105.0))
    step(s, A)
    clock.now = 106.0
    plan, events = step(s, B)
    assert ids(plan.retired) == [1] and by_id(events)[1] == Event(1, (), "", "deadline")
    clock.now = 110.0
    plan, events = step(s)
    assert ids(plan.retired) == [0] and plan.decode == ()
    assert by_id(events)[0].finish == "deadline"
    assert s.has_work is False


def test_expire_ends_every_interactive_sequence_at_the_next_step_as_its_deadline() -> None:
    """The server is about to stop: running and waiting interactive sequences leave at
    the next step as at a deadline (with or without one of their own); offline ones
    stay (the engine's stop aborts them, and their flow retries)."""
    clock = Clock()
    s = make(max_running=1, clock=clock)
    s.add(seq(0))
    s.add(seq(1, deadline=500.0))
    s.add(seq(10, offline=True))
    step(s, A)
    s.expire()
    plan, events = step(s)
    assert sorted(ids(plan.retired)) == [0, 1]
    assert by_id(events)[0] == Event(0, (), "", "deadline")  # its text went out already
    assert by_id(events)[1].finish == "deadline"
    assert [q.id for q in s.rows] == [10]  # it takes the freed row


def test_a_deadline_that_passes_during_the_prefill_makes_no_token() -> None:
    clock = Clock()
    s = make(max_running=2, clock=clock)
    s.add(seq(0, deadline=105.0))
    s.add(seq(1, deadline=200.0))
    plan = s.schedule()
    assert ids(plan.prefill) == [0, 1]  # both joined in time
    clock.now = 106.0  # the prefill ran past seq 0's deadline
    events = by_id(s.update(plan, StepOutputs(prefill=logits(A, A))))
    assert events[0] == Event(0, (), "", "deadline")  # no first token: the caller gets 504
    assert events[1].tokens == (A,) and events[1].finish is None
    plan, events = step(s)
    assert ids(plan.decode) == [1] and plan.retired == ()


def test_static_batch_keeps_finished_rows_until_the_longest_is_done() -> None:
    s = make(max_running=4, policy="static")
    s.add(seq(0, max_new=1))
    s.add(seq(1, max_new=3))
    step(s)  # both prefilled; seq 0 is done
    s.add(seq(2, max_new=1))
    plan, events = step(s)
    assert ids(plan.decode) == [0, 1] and plan.prefill == ()  # 0 idles, 2 may not join
    assert [e.seq_id for e in events] == [1]
    plan, _ = step(s)
    assert ids(plan.decode) == [0, 1] and plan.prefill == ()
    plan, _ = step(s)  # 1 finished on the last step: a new batch forms
    assert plan.decode == () and ids(plan.prefill) == [2]


def test_static_drop_frees_finished_rows_but_admits_nobody_meanwhile() -> None:
    s = make(max_running=4, policy="static-drop")
    s.add(seq(0, max_new=1))
    s.add(seq(1, max_new=3))
    step(s)
    s.add(seq(2, max_new=1))
    plan, _ = step(s)
    assert ids(plan.decode) == [1] and plan.prefill == ()
    plan, _ = step(s)
    assert ids(plan.decode) == [1] and plan.prefill == ()
    plan, _ = step(s)
    assert ids(plan.prefill) == [2]


def test_serial_runs_one_sequence_at_a_time() -> None:
    s = make(max_running=8, policy="serial")
    s.add(seq(0, max_new=2))
    s.add(seq(1, max_new=2))
    seen = [(ids(p.prefill), ids(p.decode)) for p, _ in (step(s) for _ in range(4))]
    assert seen == [([0], []), ([], [0]), ([1], []), ([], [1])]


def test_prefill_token_budget_splits_joiners_but_one_always_joins() -> None:
    s = make(max_running=8, max_prefill_tokens=10)
    s.add(seq(0, prompt=4))
    s.add(seq(1, prompt=5))
    s.add(seq(2, prompt=20))
    assert ids(step(s)[0].prefill) == [0, 1]  # 2 x 5 padded tokens
    assert ids(step(s)[0].prefill) == [2]  # alone, over the budget


def test_joiners_of_one_prompt_take_the_budget_of_one_row() -> None:
    """A prompt's n choices share one row of their prefill run (prefill.py), so they
    join together where one fits the budget, and leave the rest to other prompts."""
    s = make(max_running=8, max_prefill_tokens=10)
    for i in range(3):
        s.add(seq(i, prompt=5))
    s.add(seq(3, prompt=4))
    s.add(seq(4, prompt=3))
    assert ids(step(s)[0].prefill) == [0, 1, 2, 3]  # 2 rows x 5 padded tokens
    assert ids(step(s)[0].prefill) == [4]


def opened(id: int, tail: tuple[int, ...]) -> Seq:
    """A joiner whose prompt is a long shared opening (36 tokens), then `tail`."""
    return Seq(id, (*(1 + k % 6 for k in range(36)), *tail), 4, SamplingParams(temperature=0))


def test_a_long_prefix_joiners_share_is_charged_once() -> None:
    """Joiners whose prompts share a long opening run it once and each its rest
    (prefill.py): with the step loop's prefix cache, a budget of one whole prompt and
    two rests takes three of them; a prompt that shares nothing pays its whole length,
    and without the cache (a decoder that shares nothing) each is charged whole."""
    for prefixes, want in ((PrefixCache(), [[0, 1, 2], [3]]), (None, [[0], [1], [2], [3]])):
        s = make(max_running=8, max_prefill_tokens=40 + 2 * 4)
        s.prefixes = prefixes
        for i, tail in enumerate([(1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6)]):
            s.add(opened(i, tail))
        s.add(seq(3, prompt=3))
        assert [ids(step(s)[0].prefill) for _ in want] == want


def test_a_kept_prompts_part_is_charged_nothing() -> None:
    """A prompt kept for the joiners' opening (PrefixCache): each runs only what
    follows the part of it they all start with, so only that is charged; equal
    prompts share a row."""
    cache = PrefixCache()
    kept = opened(9, (1, 1, 1, 1)).prompt_ids
    past = Past(
        (np.zeros((1, 1, len(kept), 2), np.float32),), (np.zeros((1, 1, len(kept), 2), np.float32),)
    )
    cache.keep(kept, past, 0, again=True)
    s = make(max_running=8, max_prefill_tokens=3 * 4)
    s.prefixes = cache
    for i, tail in enumerate([(1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6), (3, 4, 5, 6)]):
        s.add(opened(i, tail))
    s.add(opened(4, (4, 5, 6, 1)))
    assert ids(step(s)[0].prefill) == [0, 1, 2, 3]
    assert ids(step(s)[0].prefill) == [4]


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(3, VOCAB)).astype(np.float32)

    def run(seed: int) -> list[int]:
        s = make()
        warm = SamplingParams(temperature=1.0)
        s.add(Seq(0, (1, 2), 5, sampling=SamplingParams(temperature=0)))
        s.add(Seq(1, (1, 2), 5, sampling=warm, seed=seed, ignore_eos=True))
        s.add(Seq(2, (1, 2), 5, sampling=warm, seed=seed + 1, ignore_eos=True))
        plan = s.schedule()
        s.update(plan, StepOutputs(prefill=rows))
        return [r.tokens[0] for r in s.rows]

    first = run(7)
    assert first[0] == int(np.argmax(rows[0]))
    assert run(7) == first


def test_update_checks_the_logits_it_gets() -> None:
    s = make()
    s.add(seq(0))
    s.add(seq(1))
    plan = s.schedule()
    with pytest.raises(ValueError, match="expected logits for 2 rows"):
        s.update(plan, StepOutputs(prefill=logits(A)))


def test_a_failed_step_errors_every_row_and_frees_them() -> None:
    s = make()
    s.add(seq(0))
    s.add(seq(1))
    step(s)
    s.add(seq(2))
    plan = s.schedule()
    events = s.fail(plan, "the step failed")
    assert sorted((e.seq_id, e.finish, e.error) for e in events) == [
        (0, "error", "the step failed"),
        (1, "error", "the step failed"),
        (2, "error", "the step failed"),
    ]
    assert s.rows == [] and not s.has_work


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_rows_the_model_failed_on_alone_finish_and_the_others_go_on(policy: Policy) -> None:
    s = make(policy=policy)
    for i in range(4):
        s.add(seq(i))
    joining = s.schedule()
    outputs = StepOutputs(prefill=logits(B, B, B, B), failed={3: "the model failed on 3"})
    events = by_id(s.update(joining, outputs))
    assert (events[3].finish, events[3].error, events[3].tokens) == (
        "error",
        "the model failed on 3",
        (),
    )
    assert [events[i].tokens for i in range(3)] == [(B,)] * 3
    # A failed row leaves at once, even a static batch: stepping it would fail again.
    plan = s.schedule()
    assert ids(plan.decode) == [0, 1, 2]
    outputs = StepOutputs(decode=logits(C, EOS, C), failed={1: "the model failed on 1"})
    events = by_id(s.update(plan, outputs))
    assert (events[1].finish, events[1].error) == ("error", "the model failed on 1")
    assert events[0].tokens == events[2].tokens == (C,) and events[0].finish is None
    assert ids(s.schedule().decode) == [0, 2]


def test_a_list_of_rows_that_all_failed_needs_no_logits() -> None:
    s = make()
    s.add(seq(0))
    s.add(seq(1))
    plan = s.schedule()
    outputs = StepOutputs(failed={0: "failed", 1: "failed"})
    events = by_id(s.update(plan, outputs))
    assert [events[i].finish for i in (0, 1)] == ["error", "error"]
    assert s.schedule().empty and not s.has_work


def test_duplicate_ids_and_unknown_policies_are_refused() -> None:
    s = make()
    s.add(seq(0))
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(seq(0))
    with pytest.raises(ValueError, match="policy"):
        make(policy="eager")  # type: ignore[arg-type]


def test_prefill_alone_runs_joiners_without_the_rows_then_decodes_them_all() -> None:
    s = make(max_running=3, prefill_alone=True)
    s.add(seq(0, max_new=2))
    s.add(seq(1, max_new=5))
    step(s)
    s.add(seq(2))
    s.abort(1)
    plan, events = step(s, B)  # a joiner: its prefill alone, the rows wait a step
    assert plan.decode == () and ids(plan.prefill) == [2] and ids(plan.retired) == [1]
    assert by_id(events)[2].text == "b" and by_id(events)[1].finish == "abort"
    s.add(seq(3))
    plan, events = step(s)  # joiners never twice in a row alone: the rows decode too
    assert ids(plan.decode) == [0, 2] and ids(plan.prefill) == [3]
    assert by_id(events)[0].finish == "length"
    s.add(seq(4))
    plan, _ = step(s)  # a free row again, and the last step decoded: alone again
    assert plan.decode == () and ids(plan.prefill) == [4]


def test_arrivals_during_a_decode_take_free_rows_beside_it_and_decode_from_the_next_plan() -> None:
    s = make(max_running=3, reserve=Reserve(share=0), prefill_alone=True)
    s.add(seq(0, max_new=5))
    step(s)
    plan = s.schedule()  # the decode in flight
    assert ids(plan.decode) == [0]
    s.add(seq(1, prompt=2))
    s.add(seq(10, offline=True))
    s.add(seq(2))
    s.add(seq(3))
    joiners = s.admit_beside()
    assert ids(joiners) == [1, 2], "interactive ones, into the free rows; no preemption"
    events = s.update(StepPlan(prefill=joiners), StepOutputs(logits(B, C)))
    assert [(e.seq_id, e.text, e.first) for e in events] == [(1, "b", True), (2, "c", True)]
    s.update(plan, StepOutputs(decode=logits(A)))  # the decode in flight ends
    assert s.admit_beside() == (), "no row is free"
    plan, _ = step(s)
    assert ids(plan.decode) == [0, 1, 2] and plan.prefill == (), "the joiners decode now"
    assert s.num_waiting == 1 and s.num_offline_waiting == 1


@pytest.mark.parametrize("policy", ["static", "static-drop", "serial"])
def test_only_continuous_batching_admits_beside_a_decode(policy: Policy) -> None:
    s = make(max_running=3, policy=policy, prefill_alone=True)
    s.add(seq(0))
    step(s)
    s.add(seq(1))
    assert s.admit_beside() == ()


def test_a_prompt_that_goes_in_parts_waits_for_the_next_plan_not_beside_a_decode() -> None:
    s = make(max_running=3, prefill_alone=True, chunked=True, max_prefill_tokens=4)
    s.add(seq(0))
    step(s)
    s.add(seq(1, prompt=9))
    assert s.admit_beside() == () and s.num_waiting == 1
    plan = s.schedule()
    assert plan.chunk is not None and plan.chunk.seq.id == 1


# ---- two lanes: offline sequences take free rows, and leave them for interactive ones


def test_offline_sequences_join_only_in_steps_without_interactive_work() -> None:
    s = make(max_running=3, reserve=Reserve(share=0))  # no free rows kept
    s.offline_rides = True  # a device where more rows cost a step little
    for i in range(3):
        s.add(seq(10 + i, offline=True))
    s.add(seq(1, max_new=2))
    plan, _ = step(s)
    assert ids(plan.prefill) == [1], "interactive first, and a prefill is of one lane"
    plan, _ = step(s)
    assert ids(plan.decode) == [1] and not plan.prefill, "free rows, yet no offline prompt"
    assert s.num_offline_waiting == 3, "its prefill would lengthen the interactive step"
    plan, _ = step(s)
    assert ids(plan.prefill) == [10, 11, 12], "the interactive row is done: a gap"


def test_offline_rows_sit_out_the_interactive_rows_steps_unless_they_ride_along() -> None:
    s = make(max_running=4, reserve=Reserve(share=0))
    for i in range(2):
        s.add(seq(10 + i, offline=True, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [10, 11], "no interactive work: the offline lane runs"
    s.add(seq(1, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [1] and not plan.decode, "a joiner's step is interactive"
    s.add(seq(12, offline=True, max_new=50))
    plan, _ = step(s)
    assert ids(plan.decode) == [1], "offline rows keep their rows but sit the step out"
    assert not plan.prefill and not plan.preempted, "and no offline prompt joins"
    before = [list(s._live[i].tokens) for i in (10, 11)]
    plan, _ = step(s)
    assert ids(plan.decode) == [1]
    assert [s._live[i].tokens for i in (10, 11)] == before, "they made nothing meanwhile"
    s.offline_rides = True  # the cost model says they cost the interactive rows little
    plan, _ = step(s)
    assert ids(plan.decode) == [10, 11, 1], "they ride along"
    assert not plan.prefill, "an offline prompt still joins no interactive step"
    s.abort(1)  # the interactive lane is idle: the gap is the offline lane's
    plan, _ = step(s)
    assert ids(plan.decode) == [10, 11] and ids(plan.prefill) == [12]
    assert [s._live[i].rider for i in (10, 11, 12)] == [False, False, True]
    s.offline_rides = False
    s.add(seq(2, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [2] and ids(plan.decode) == [12]
    plan, _ = step(s)
    assert ids(plan.decode) == [12, 2], "one that joined riding shares the interactive steps"


def test_offline_joiners_prefill_in_the_rows_decode_step_even_where_joiners_run_alone() -> None:
    s = make(max_running=4, reserve=Reserve(share=0), prefill_alone=True)
    s.add(seq(10, offline=True, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [10]
    s.add(seq(11, offline=True, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [11] and ids(plan.decode) == [10], "nobody waits for its token"
    s.add(seq(2, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [2] and not plan.decode, "an interactive joiner's runs alone"


def test_an_interactive_arrival_preempts_the_newest_offline_row_at_the_next_plan() -> None:
    s = make(max_running=3, reserve=Reserve(share=0))  # no free rows kept
    s.offline_rides = True  # a device where more rows cost a step little
    for i in range(3):
        s.add(seq(10 + i, offline=True))
    step(s, B)  # all three prefill and make their first token
    step(s, C)  # and their second
    s.add(seq(1))
    plan = s.schedule()
    assert [r.id for r in plan.preempted] == [12], "the newest offline row leaves"
    assert [r.id for r in plan.prefill] == [1] and [r.id for r in plan.decode] == [10, 11]
    (left,) = plan.preempted
    assert left.status == SeqStatus.WAITING and left.preemptions == 1
    assert left.tokens == [B, C], "it keeps what it made"
    assert left.cached_ids == (1, 2, 3, B), "its cache held the prompt and all but the last"
    events = s.update(plan, StepOutputs(prefill=logits(A), decode=logits(A, A)))
    assert {e.seq_id for e in events} == {1, 10, 11}, "nothing for the preempted one"
    # Rows are full again: it waits, until one frees; then it resumes without a prefill.
    plan, _ = step(s)
    assert not plan.resumed and s.num_offline_waiting == 1
    s.abort(10)
    plan, _ = step(s)
    assert not plan.resumed, "a row is free, but an interactive one runs: no resume"
    s.abort(1)  # a gap
    plan = s.schedule()
    assert [r.id for r in plan.resumed] == [12] and not plan.prefill
    events = s.update(plan, StepOutputs(decode=logits(*([A] * len(plan.decode)))))
    assert 12 not in {e.seq_id for e in events if e.tokens}, "a resume samples nothing"
    plan, events = step(s, {12: A})
    assert 12 in [r.id for r in plan.decode]
    assert next(e for e in events if e.seq_id == 12).tokens == (A,)
    assert left.tokens == [B, C, A], "one token per decode, none lost or made twice"


def test_interactive_rows_are_never_preempted() -> None:
    s = make(max_running=2)
    s.add(seq(1))
    s.add(seq(2))
    step(s)
    s.add(seq(10, offline=True))
    s.add(seq(3))
    plan = s.schedule()
    assert not plan.preempted and not plan.prefill, "rows held by interactive ones stay"
    s.update(plan, StepOutputs(decode=logits(A, A)))


def test_offline_sequences_leave_a_reserve_of_rows_while_interactive_requests_arrive() -> None:
    clock = Clock()
    s = make(max_running=8, clock=clock)
    s.offline_rides = True  # a device where more rows cost a step little
    for i in range(10):
        s.add(seq(10 + i, offline=True, max_new=50))
    step(s)
    assert s.num_running == 8, "no interactive traffic: the offline job has every row"
    for i in range(8):  # the offline rows finish; interactive requests come meanwhile
        s.abort(10 + i)
    s.add(seq(1, max_new=1))
    s.add(seq(2, max_new=1))
    s.add(seq(3, max_new=1))
    plan, _ = step(s)
    assert ids(plan.prefill) == [1, 2, 3], "a prefill is of one lane: interactive first"
    plan, _ = step(s)
    assert ids(plan.prefill) == [18, 19] and s.num_running == 2
    for i in range(6):
        s.add(seq(20 + i, offline=True, max_new=50))
    plan, _ = step(s)
    assert ids(plan.prefill) == [20, 21, 22, 23] and s.num_running == 6, (
        "3 interactive arrivals in the last 2 s: 8 // 4 rows stay free"
    )
    s.add(seq(4, max_new=1))
    plan = s.schedule()
    assert not plan.preempted, "the arrival finds a free row: nobody is preempted"
    assert ids(plan.prefill) == [4]
    s.update(plan, StepOutputs(prefill=logits(A), decode=logits(*[A] * len(plan.decode))))
    clock.now += 2.5  # no interactive arrival since: the reserve goes back to the offline lane
    plan, _ = step(s)
    assert ids(plan.prefill) == [24, 25] and s.num_running == 8


def test_offline_rows_past_a_lowered_bound_are_preempted_while_interactive_rows_run() -> None:
    clock = Clock()
    s = make(max_running=6, clock=clock, reserve=Reserve(share=0))
    s.offline_rides = True  # a device where more rows cost a step little
    for i in range(5):
        s.add(seq(10 + i, offline=True, max_new=50))
    step(s)
    s.add(seq(1, max_new=50))
    step(s)
    assert s.num_running == 6
    s.max_running = 3  # as slo.itl_ms lowers it when the cache grows
    plan = s.schedule()
    assert ids(plan.preempted) == [12, 13, 14], "the newest offline rows leave"
    assert ids(plan.decode) == [10, 11, 1]
    s.update(plan, StepOutputs(decode=logits(A, A, A)))
    plan, _ = step(s)
    assert not plan.preempted and not plan.resumed, "and stay out while the bound holds"

    s = make(max_running=4, clock=clock, reserve=Reserve(share=0))
    for i in range(4):
        s.add(seq(10 + i, offline=True, max_new=50))
    step(s)
    s.max_running = 2
    plan = s.schedule()
    assert not plan.preempted, "offline rows alone: no interactive step to keep short"


# ---- chunked prefill: a long prompt in parts, the rows decoding meanwhile ----------------


def test_a_prompt_over_the_budget_is_prefilled_in_parts_while_rows_keep_decoding() -> None:
    s = make(max_running=3, max_prefill_tokens=4, chunked=True)
    s.add(seq(1, prompt=2, max_new=20))
    step(s)
    s.add(seq(2, prompt=10))
    s.add(seq(3, prompt=3))
    parts = []
    for _ in range(3):
        plan = s.schedule()
        assert ids(plan.decode) == [1], "the row decodes at every step"
        assert plan.chunk is not None and plan.chunk.seq.id == 2
        parts.append((plan.chunk.start, plan.chunk.stop))
        final = plan.chunk.final
        # Prefill tokens per step stay within the budget: seq 3 waits while parts run.
        assert plan.chunk.stop - plan.chunk.start + len(plan.prefill) * 3 <= 4
        events = s.update(
            plan,
            StepOutputs(
                prefill=logits(*[A] * len(plan.prefill)) if plan.prefill else None,
                decode=logits(A),
                chunk=logits(B) if final else None,
            ),
        )
        got = by_id(events)
        assert got[1].tokens == (A,)
        assert (2 in got) == final, "only the final part makes a token"
    assert parts == [(0, 4), (4, 8), (8, 10)]
    assert by_id(events)[2].tokens == (B,) and by_id(events)[2].first
    plan = s.schedule()
    assert ids(plan.decode) == [1, 2] and plan.chunk is None
    assert ids(plan.prefill) == [3]


def test_prompts_that_fit_join_before_the_parts_of_long_ones_that_wait_their_turn() -> None:
    s = make(max_running=4, max_prefill_tokens=8, chunked=True)
    s.add(seq(1, prompt=20))
    s.add(seq(2, prompt=20))
    s.add(seq(3, prompt=3))
    plan, _ = step(s)
    assert plan.chunk is not None and plan.chunk.seq.id == 1
    assert ids(plan.prefill) == [3], "the short prompt passes the long one waiting for parts"
    assert (plan.chunk.start, plan.chunk.stop) == (0, 5), "the part takes what it leaves"
    assert ids(s.waiting) == [2], "the other long prompt keeps its place"
    s.add(seq(4, prompt=6))
    plan, _ = step(s)
    assert not plan.prefill, "past half the budget, a prompt waits for the next step"
    assert plan.chunk is not None and (plan.chunk.start, plan.chunk.stop) == (5, 13)


def test_a_long_prompt_passed_by_short_ones_takes_the_next_free_row_when_its_turn_comes() -> None:
    s = make(max_running=3, max_prefill_tokens=8, chunked=True)
    for i, prompt in ((1, 20), (2, 20), (3, 3), (4, 3)):
        s.add(seq(i, prompt=prompt, max_new=50))
    for _ in range(10):  # 1 in parts; 3 and 4 pass 2, which waits for its turn
        plan = s.schedule()
        final = plan.chunk is not None and plan.chunk.final
        s.update(
            plan,
            StepOutputs(
                prefill=logits(*[A] * len(plan.prefill)) if plan.prefill else None,
                decode=logits(*[A] * len(plan.decode)) if plan.decode else None,
                chunk=logits(A) if final else None,
            ),
        )
        if final:
            break
    assert sorted(ids(s.rows)) == [1, 3, 4] and ids(s.waiting) == [2]
    s.add(seq(5, prompt=3))
    plan, _ = step(s)
    assert plan.chunk is None and not plan.prefill, "2's turn: 5 does not pass it now"
    s.abort(3)
    plan, _ = step(s)
    assert plan.chunk is not None and plan.chunk.seq.id == 2, "the free row is 2's"
    assert ids(s.waiting) == [5]


def test_a_long_prompt_starts_its_parts_in_a_row_past_the_bound_the_steer_allows() -> None:
    s = make(max_running=4, max_prefill_tokens=16, chunked=True)
    for i in range(3):
        s.add(seq(i + 1, max_new=50))
    step(s)
    assert s.num_running == 3
    s.max_running, s.past_bound = 2, 2  # the rows' ITL bound, and TTFT pressure past it
    s.add(seq(9, prompt=40))
    plan, _ = step(s)
    assert plan.chunk is not None and plan.chunk.seq.id == 9, "rows past the bound stay"


def test_an_aborted_prompt_mid_chunks_frees_its_row() -> None:
    s = make(max_running=2, max_prefill_tokens=4, chunked=True)
    s.add(seq(1, prompt=10))
    plan, _ = step(s)
    assert plan.chunk is not None and not plan.prefill
    s.abort(1)
    plan = s.schedule()
    assert plan.chunk is None and ids(plan.retired) == [1]
    assert s.chunking is None and s.num_running == 0


def test_prefill_groups_split_where_padding_costs_more_than_a_run() -> None:
    """Shortest prompts first; a prompt joins the run before it unless the padding it
    adds there costs more than a run's fixed cost; one run while nothing is fitted."""
    seqs = [seq(1, prompt=30), seq(2, prompt=3), seq(3, prompt=4), seq(4, prompt=28)]
    cpu = Fit(fixed_s=1e-4, per_item_s=0.0, per_token_s=1e-5, spread=1.0, samples=8)
    ids = [[s.id for s in group] for group in prefill_groups(seqs, cpu)]
    assert ids == [[2, 3], [4, 1]], "28 would pad the run of 3 and 4 by 48 tokens, 30 its by 2"
    gpu = Fit(fixed_s=1e-2, per_item_s=0.0, per_token_s=1e-6, spread=1.0, samples=8)
    assert [len(g) for g in prefill_groups(seqs, gpu)] == [4]
    assert prefill_groups(seqs, None) == [seqs]
    assert prefill_groups([], cpu) == []
    # Four choices of the 3-token prompt are one row of the run: 4 pads it by 1 token.
    choices = [seq(i, prompt=3) for i in (5, 6, 7, 8)]
    edge = Fit(fixed_s=1.5e-5, per_item_s=0.0, per_token_s=1e-5, spread=1.0, samples=8)
    grouped = prefill_groups([seq(3, prompt=4), *choices], edge)
    assert [[s.id for s in group] for group in grouped] == [[5, 6, 7, 8, 3]]
