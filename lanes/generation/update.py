"""Continuous batching, the second half: what came of a step the scheduler planned.

    events = scheduler.update(plan, outputs)   # or scheduler.fail(plan, error)

Each row that ran gets its event from its logits (through `Advance`,
lanes/generation/advance.py): the joiners' first tokens, with their prompt's logprobs
where asked, a long prompt's last part taking its row, the rows' next tokens; rows
the model failed on finish with their error. Apart from the planning
(lanes/generation/scheduler.py) because it only reads the plan and the outputs; the
scheduler inherits it (`StepUpdate`) since both halves keep one set of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lanes.generation.advance import Advance, final
from lanes.generation.seq import Chunk, Event, Seq, SeqStatus, StepOutputs, StepPlan

Array = np.ndarray[Any, Any]


class StepUpdate:
    """`update` and `fail` over the scheduler's rows; `Scheduler` is the one subclass,
    and `_finish` its bookkeeping of a sequence that ends."""

    advance: Advance
    clock: Callable[[], float]
    rows: list[Seq]
    chunking: Seq | None  # the prompt being prefilled in parts
    _finish: Callable[[Seq, SeqStatus], None]

    def fail(self, plan: StepPlan, error: str) -> list[Event]:
        """Instead of update() when the step failed outside any one row's run (the
        loop could not tell which rows are at fault): its retired sequences are
        reported as usual, every row (joiners included) finishes with `error` and
        every row is freed."""
        events = [final(seq) for seq in plan.retired]
        for seq in (*self.rows, *self._chunking()):
            if not seq.status.is_finished:
                seq.error = error
                self._finish(seq, SeqStatus.FINISHED_ERROR)
                events.append(final(seq))
        self.rows = []
        self.chunking = None
        return events

    def _chunking(self) -> tuple[Seq, ...]:
        return () if self.chunking is None else (self.chunking,)

    def update(self, plan: StepPlan, outputs: StepOutputs) -> list[Event]:
        """Sample each running row's next token from its logits; rows in
        `outputs.failed` finish with their error instead. Returns one event per
        sequence that made a token or finished, the plan's retired ones included."""
        events = [final(seq) for seq in plan.retired]
        now = self.clock() if plan.prefill else None
        failed = outputs.failed
        if failed and plan.resumed:
            events += self.advance.failed(plan.resumed, failed)  # their recompute failed alone
        if plan.chunk is not None:
            events += self._chunked(plan.chunk, outputs)
        if plan.prefill:
            events += self._prefilled(plan.prefill, outputs.prefill, failed, now)
        if plan.decode:
            events += self.advance.sampled(plan.decode, outputs.decode, failed, None)
        return events

    def _prefilled(
        self,
        seqs: Sequence[Seq],
        logits: Array | None,
        failed: Mapping[int, str],
        now: float | None,
    ) -> list[Event]:
        """The joiners' first tokens; those that asked for their prompt's logprobs get
        them on their first event, and those that asked for no token (max_new_tokens 0)
        finish with it instead of sampling one. A look at each joiner once."""
        asked = [s for s in seqs if s.prompt_logprobs is not None]
        if not asked:
            return self.advance.sampled(seqs, logits, failed, now)
        events = []
        for seq in asked:
            if seq.max_new_tokens == 0 and seq.id not in failed:
                self._finish(seq, SeqStatus.FINISHED_LENGTH)  # sampled() skips it
                events.append(final(seq, (), True))
        if len(events) < len(seqs):
            events += self.advance.sampled(seqs, logits, failed, now)
        scores = {s.id: tuple(s.prompt_scores) for s in asked}
        for event in events:
            if event.seq_id in scores and event.finish != "error":
                event.prompt_logprobs = scores[event.seq_id]
        return events

    def _chunked(self, chunk: Chunk, outputs: StepOutputs) -> list[Event]:
        """A part of a long prompt ran: the last one samples its first token, and the
        sequence takes its place among the rows (decoding from the next plan on)."""
        seq = chunk.seq
        events = self.advance.failed((seq,), outputs.failed)
        if seq.status.is_finished:  # failed, aborted or expired meanwhile
            if self.chunking is seq:
                self.chunking = None
            return events
        seq.prefilled = chunk.stop
        if not chunk.final:
            return events
        if outputs.chunk is None or outputs.chunk.shape[0] != 1:
            found = None if outputs.chunk is None else outputs.chunk.shape
            raise ValueError(f"update: expected logits for the final chunk, found {found}")
        self.chunking = None
        self.rows.append(seq)
        if seq.prompt_logprobs is not None:
            return [*events, *self._prefilled((seq,), outputs.chunk, {}, self.clock())]
        logits = outputs.chunk[0]
        if seq.deadline is not None and self.clock() >= seq.deadline:
            self._finish(seq, SeqStatus.FINISHED_DEADLINE)
            return [*events, final(seq)]
        event = self.advance.token(seq, self.advance.pick(seq, logits))
        if seq.top_logprobs is not None and event.scored is not None:
            self.advance.score((seq,), (event,), outputs.chunk)
        return [*events, event]
