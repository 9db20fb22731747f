"""What a step's logits make of its sequences: each one's next token, its text, its end.

The scheduler (lanes/generation/scheduler.py) plans who runs; `Advance` takes the
logits of the rows that ran and gives each sequence its event: the token appended
with the text it completes (held back while it could be the start of a stop string
or ends inside a character), or its finish: eos, its token budget within the
model's context, a stop token or string, its deadline, or a failure of the model on it
alone. Finishing a sequence is the scheduler's bookkeeping (`finish`), called here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lanes.generation.logprobs import token_logprobs
from lanes.generation.processors import processed
from lanes.generation.seq import Event, Seq, SeqStatus
from lanes.generation.text import ByteText, WindowText
from lanes.tasks.sampling import sample

Array = np.ndarray[Any, Any]
Finish = Callable[[Seq, SeqStatus], None]


class Advance:
    """Sequences advanced by their sampled tokens; `finish(seq, status)` ends one."""

    def __init__(
        self,
        eos_token_ids: frozenset[int],
        text: ByteText | WindowText,
        max_position: int | None,
        finish: Finish,
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.text = text
        self.max_position = max_position
        self._finish = finish
        # Unfinished sequences that asked for logprobs (the scheduler counts them): while
        # there are none, a step's rows are not even looked at for them.
        self.scoring = 0
        # Unfinished sequences whose logits are processed before they pick (Seq.controlled,
        # counted by the scheduler too): while there are none, no row is asked.
        self.controlled = 0

    def sampled(
        self,
        seqs: Sequence[Seq],
        logits: Array | None,
        failed: Mapping[int, str],
        now: float | None,
    ) -> list[Event]:
        """The next token of each row of `seqs` from its row of `logits`; a joiner
        whose deadline passed by `now` (the prefill's) finishes instead."""
        events = self.failed(seqs, failed) if failed else []
        if failed and all(s.id in failed for s in seqs):
            return events
        if logits is None or logits.shape[0] != len(seqs):
            found = None if logits is None else logits.shape
            raise ValueError(f"update: expected logits for {len(seqs)} rows, found {found}")
        # One vectorised argmax serves every greedy row (each row's own argmax, as
        # sample() takes it); sampling rows draw alone, each from its own generator.
        greedy: list[int] | None = None
        advance, finished, eos = self.token, SeqStatus.FINISHED_STOPPED, self.eos_token_ids
        scoring = self.scoring  # read before this step's finishes lower it
        controlled = self.controlled
        for i, seq in enumerate(seqs):
            if seq.status >= finished:
                continue  # a static batch's finished row (or a failed one): no logits
            if now is not None and seq.deadline is not None and now >= seq.deadline:
                # Its deadline passed during its prefill: it made no token in time.
                self._finish(seq, SeqStatus.FINISHED_DEADLINE)
                events.append(final(seq))
                continue
            if controlled and seq.controlled:
                events.append(advance(seq, self.pick(seq, logits[i])))
                continue
            if seq.sampling.temperature == 0:
                if greedy is None:
                    greedy = logits.argmax(axis=-1).tolist()
                token, tokens = greedy[i], seq.tokens
                # An offline row's usual token (no text made until its finish, no stop
                # string, within its budget, not its end): what token() does for it,
                # without the call. A row's first token goes there, and sets `_limit`.
                if (
                    len(tokens) + 1 < seq._limit
                    and not (seq.stream or seq.stop)
                    and (token not in eos or seq.ignore_eos)
                ):
                    tokens.append(token)
                    events.append(Event(seq.id, (token,)))
                    continue
                events.append(advance(seq, token))
            else:
                events.append(advance(seq, sample(logits[i], seq.sampling, seq.rng)))
        if scoring:  # else no row asked: not one check per row
            self._score_rows(seqs, events, logits)
        return events

    def pick(self, seq: Seq, row: Array) -> int:
        """`seq`'s next token from its [vocab] row of logits, after what it declared
        (lanes/generation/processors.py; before its min_tokens, eos and its stop tokens
        are masked, as vLLM, and token() holds off its stop strings). The row itself is
        left as it is: logprobs score the raw logits."""
        if seq.controlled:
            row = processed(seq, row, self.eos_token_ids)
        if seq.sampling.temperature == 0:
            return int(row.argmax())
        return sample(row, seq.sampling, seq.rng)

    def _score_rows(self, seqs: Sequence[Seq], events: list[Event], logits: Array) -> None:
        """The tokens made by the rows of `seqs` that asked for logprobs, scored on
        their rows of `logits` (an eos or stop token that ended its sequence too)."""
        rows = {seq.id: i for i, seq in enumerate(seqs) if seq.top_logprobs is not None}
        made = [e for e in events if e.seq_id in rows and e.scored is not None]
        if made:
            picked = [rows[event.seq_id] for event in made]
            self.score([seqs[i] for i in picked], made, logits[picked])

    def score(self, seqs: Sequence[Seq], events: Sequence[Event], logits: Array) -> None:
        """Each of `seqs`' token (its event's `scored`: the eos or stop token that ended
        it among them, as usage counts it) scored on its row of [rows, vocab] raw
        `logits`: the record goes on the event and the sequence."""
        tokens = [_scored(event) for event in events]
        counts = [seq.top_logprobs or 0 for seq in seqs]
        for seq, event, record in zip(
            seqs, events, token_logprobs(logits, tokens, counts), strict=True
        ):
            event.logprobs = (record,)
            seq.logprobs.append(record)

    def failed(self, seqs: Sequence[Seq], failed: Mapping[int, str]) -> list[Event]:
        """The rows of `seqs` the model failed on alone finish with their own error
        (a row that finished otherwise meanwhile, an abort, keeps its finish)."""
        events = []
        for seq in seqs:
            if seq.id in failed and not seq.status.is_finished:
                seq.error = failed[seq.id]
                self._finish(seq, SeqStatus.FINISHED_ERROR)
                events.append(final(seq))
        return events

    def token(self, seq: Seq, token: int) -> Event:
        """`seq` after `token`: its event, and its finish where the token ends it."""
        first = not seq.tokens
        if (token in self.eos_token_ids and not seq.ignore_eos) or token in seq.stop_token_ids:
            self._finish(seq, SeqStatus.FINISHED_STOPPED)
            seq.text += self.text.rest(seq)
            seq.stop_token = token  # made and counted, not shown (seq.completion_tokens)
            ended = final(seq, (), first)
            ended.stop_token = token
            return ended
        seq.tokens.append(token)
        limit = seq._limit or self._limit(seq)
        stop = seq.stop
        if not (stop or seq.stream):  # its text waits for the finish (text.rest)
            if len(seq.tokens) >= limit:
                self._finish(seq, SeqStatus.FINISHED_LENGTH)
                seq.text += self.text.rest(seq)
                return final(seq, (token,), first)
            return Event(seq.id, (token,), "", None, first)
        before = len(seq.text)
        seq.text += self.text.delta(seq)
        # As vLLM: no stop string ends the text within its first min_tokens tokens; one
        # that ends after them may start in their text.
        held_off = len(seq.tokens) <= seq.min_tokens
        cut = _first_stop(seq.text, stop, before) if stop and not held_off else None
        if cut is not None:
            seq.text = seq.text[: cut.end if seq.include_stop else cut.start]
            self._finish(seq, SeqStatus.FINISHED_STOPPED)
            return final(seq, (token,), first)
        if len(seq.tokens) >= limit:
            self._finish(seq, SeqStatus.FINISHED_LENGTH)
            seq.text += self.text.rest(seq)
            return final(seq, (token,), first)
        # Hold back only what could be the start of a stop string.
        safe = _unheld(seq.text, seq.sent, stop) if stop else len(seq.text)
        text, seq.sent = seq.text[seq.sent : safe], safe
        return Event(seq.id, (token,), text, None, first)

    def budget(self, seq: Seq) -> int:
        """Most tokens `seq` may make: its max_new_tokens, within the model's context."""
        budget = seq.max_new_tokens
        if self.max_position is not None:
            budget = min(budget, self.max_position - len(seq.prompt_ids))
        return max(budget, 1)

    def _limit(self, seq: Seq) -> int:
        seq._limit = self.budget(seq)  # fixed: its prompt and the context do not change
        return seq._limit


def _scored(event: Event) -> int:
    token = event.scored
    if token is None:
        raise ValueError(f"sequence {event.seq_id}: an event that made no token has no logprob")
    return token


def final(seq: Seq, tokens: tuple[int, ...] = (), first: bool = False) -> Event:
    """`seq`'s last event: the text it has not sent (none after an abort), its finish."""
    text = "" if seq.status == SeqStatus.FINISHED_ABORTED else seq.text[seq.sent :]
    seq.sent = len(seq.text)
    return Event(seq.id, tokens, text, seq.status.finish_reason, first, seq.error)


def _unheld(text: str, sent: int, stop: Sequence[str]) -> int:
    """Where the text that must wait starts: the longest suffix of `text[sent:]` that
    is the start of a stop string (it may yet become one); `len(text)` when no suffix
    is. Its work is bounded by the stop strings' lengths, not the text's."""
    held = len(text)
    for s in stop:
        if not s:
            continue
        # A suffix shorter than `s` starts within its length of the end; one that
        # starts at or after `held` is no longer than the one found already.
        i = max(sent, len(text) - len(s) + 1)
        while (i := text.find(s[0], i, held)) >= 0:
            if s.startswith(text[i:]):
                held = i
                break
            i += 1
    return held


@dataclass(frozen=True)
class StopHit:
    """Where a stop string found in a text starts and ends."""

    start: int
    end: int


def _first_stop(text: str, stop: Sequence[str], before: int) -> StopHit | None:
    """The earliest stop string (the longest of those starting there), looking only
    where one could newly end (the text before `before` was searched already)."""
    hit: StopHit | None = None
    for s in stop:
        if s:
            i = text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (hit is None or (i, -(i + len(s))) < (hit.start, -hit.end)):
                hit = StopHit(i, i + len(s))
    return hit
