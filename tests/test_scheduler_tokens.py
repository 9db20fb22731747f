"""The scheduler's token path on fabricated logits: text decoded once at the finish
(`Seq.stream` off) against text decoded token by token, and the one argmax that
serves a batch's greedy rows against each row sampled alone."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Event, Seq, StepOutputs
from lanes.tasks.sampling import SamplingParams, generator, sample
from tests.test_scheduler import E1, E2, EOS, NEWLINE, SPACE, VOCAB, A, B, C, X, detokenize

GREEDY = SamplingParams(temperature=0)


class Counted:
    """`detokenize`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return detokenize(ids)


def peaked(tokens: Sequence[int]) -> np.ndarray:
    rows = np.full((len(tokens), VOCAB), -10.0, dtype=np.float32)
    rows[np.arange(len(tokens)), list(tokens)] = 10.0
    return rows


def run_scripted(
    scripts: Sequence[Sequence[int]],
    *,
    stream: bool,
    stop: tuple[str, ...] = (),
    max_new: int = 64,
    detok: Counted | None = None,
) -> tuple[list[Seq], dict[int, list[Event]]]:
    """Each sequence makes the tokens of its script, one per step (eos once it runs out)."""
    s = Scheduler(len(scripts), frozenset({EOS}), detok or Counted())
    seqs = [
        Seq(i, (A,), max_new, sampling=GREEDY, stop=stop, stream=stream)
        for i in range(len(scripts))
    ]
    for seq in seqs:
        s.add(seq)
    events: dict[int, list[Event]] = {seq.id: [] for seq in seqs}
    for _ in range(200):  # bounded: every script ends in eos or the budget
        if not s.has_work:
            break
        plan = s.schedule()

        def pick(rows: tuple[Seq, ...]) -> np.ndarray | None:
            if not rows:
                return None
            made = [len(r.tokens) for r in rows]
            return peaked(
                [
                    scripts[r.id][n] if n < len(scripts[r.id]) else EOS
                    for r, n in zip(rows, made, strict=True)
                ]
            )

        for event in s.update(plan, StepOutputs(pick(plan.prefill), pick(plan.decode))):
            events[event.seq_id].append(event)
    assert not s.has_work
    return seqs, events


SCRIPTS = [
    [A, B, C, SPACE, X],  # plain text, ends in eos
    [E1, E2, A, E1, E2, E1, E2, B],  # characters split across tokens
    [A, E1],  # ends (eos) inside a character
    [B, A, NEWLINE, E1, E2, C, A, B, C, A],  # runs to the budget below
    [EOS],  # eos at once: no token, no text
]


def test_text_decoded_at_the_finish_equals_the_text_decoded_token_by_token() -> None:
    streamed, streamed_events = run_scripted(SCRIPTS, stream=True, max_new=7)
    counted = Counted()
    deferred, deferred_events = run_scripted(SCRIPTS, stream=False, max_new=7, detok=counted)
    for a, b in zip(streamed, deferred, strict=True):
        assert (b.tokens, b.text, b.status) == (a.tokens, a.text, a.status)
        assert b.text == detokenize(b.tokens)
        sent_a = "".join(e.text for e in streamed_events[a.id])
        sent_b = "".join(e.text for e in deferred_events[b.id])
        assert sent_b == sent_a == a.text
        # Token for token the same events, the text all in the last one.
        assert [(e.tokens, e.finish, e.first) for e in deferred_events[b.id]] == [
            (e.tokens, e.finish, e.first) for e in streamed_events[a.id]
        ]
        assert all(e.text == "" for e in deferred_events[b.id][:-1])
    assert streamed[3].status.finish_reason == "length" and streamed[3].tokens == SCRIPTS[3][:7]
    # One decode per sequence that made a token, at its finish.
    assert counted.calls == sum(1 for s in deferred if s.tokens)


@pytest.mark.parametrize("stop", [("ab",), ("\nx", "é"), ("zz",)])
def test_stop_strings_cut_the_text_alike_with_or_without_a_stream(stop: tuple[str, ...]) -> None:
    scripts = [[A, A, B, C, NEWLINE, X, E1, E2, B], [C, E1, E2, A, B, A]]
    streamed, streamed_events = run_scripted(scripts, stream=True, stop=stop)
    deferred, deferred_events = run_scripted(scripts, stream=False, stop=stop)
    for a, b in zip(streamed, deferred, strict=True):
        assert (b.tokens, b.text, b.status) == (a.tokens, a.text, a.status)
        assert [e.text for e in deferred_events[b.id]] == [e.text for e in streamed_events[a.id]]
        assert not any(s in b.text for s in stop)
    if stop == ("ab",):
        assert streamed[0].text == "a" and streamed[1].text == "cé"


def test_greedy_rows_of_a_batch_take_what_each_row_sampled_alone_would() -> None:
    """The batch's one argmax against sample() per row: ties, and greedy rows among
    seeded ones, whose draws stay their own."""
    rng = np.random.default_rng(3)
    warm = SamplingParams(temperature=0.8, top_k=5)
    kinds = [GREEDY, warm, GREEDY, warm, GREEDY]
    s = Scheduler(len(kinds), frozenset({EOS}), detokenize)
    seqs = [
        Seq(i, (A, B), 6, sampling=p, seed=10 + i, ignore_eos=True) for i, p in enumerate(kinds)
    ]
    for seq in seqs:
        s.add(seq)
    alone = [generator(10 + i) for i in range(len(kinds))]
    want: list[list[int]] = [[] for _ in kinds]
    for n in range(6):
        plan = s.schedule()
        rows = plan.prefill or plan.decode
        logits = rng.normal(size=(len(rows), VOCAB)).astype(np.float32)
        if n == 2:
            logits[:, 3] = logits[:, 5] = logits.max() + 1  # a tie: the first one wins
        for i, seq in enumerate(rows):
            want[seq.id].append(sample(logits[i], seq.sampling, alone[seq.id]))
        if plan.prefill:
            s.update(plan, StepOutputs(prefill=logits))
        else:
            s.update(plan, StepOutputs(decode=logits))
    assert [seq.tokens for seq in seqs] == want
    assert want[0][2] == 3
