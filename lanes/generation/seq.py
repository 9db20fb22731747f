"""What the scheduler works on and hands out: a sequence and its status, one step's
plan, the model's outputs for it, and the events it makes (lanes/generation/scheduler.py
decides; lanes/generation/loop.py runs)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from lanes.generation.logprobs import TokenLogprob
from lanes.generation.usage import completion_tokens
from lanes.tasks.sampling import SamplingParams, generator

Array = np.ndarray[Any, Any]
FinishReason = Literal["stop", "length", "abort", "deadline", "error"]
Lane = Literal["interactive", "offline"]


class SeqStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # eos or a stop string
    FINISHED_LENGTH = 3  # its token budget, or the model's context
    FINISHED_ABORTED = 4  # the client went away (or the server is stopping)
    FINISHED_DEADLINE = 5  # its deadline passed
    FINISHED_ERROR = 6  # the model failed on it (alone: see StepOutputs.failed)

    @property
    def is_finished(self) -> bool:
        return self >= SeqStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASONS.get(self)


_REASONS: dict[SeqStatus, FinishReason] = {
    SeqStatus.FINISHED_STOPPED: "stop",
    SeqStatus.FINISHED_LENGTH: "length",
    SeqStatus.FINISHED_ABORTED: "abort",
    SeqStatus.FINISHED_DEADLINE: "deadline",
    SeqStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Seq:
    """One request's sequence: its prompt, its parameters, and what it has made so far."""

    id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    deadline: float | None = None  # on the scheduler's clock
    ignore_eos: bool = False  # benchmarks: run to the budget
    # Alternatives wanted beside each generated token's logprob (lanes/generation/
    # logprobs.py); None: no logprobs at all, and no cost.
    top_logprobs: int | None = None
    # Alternatives wanted beside each prompt token's logprob (an echo that scores its
    # prompt); None: its prompt is not scored, at no cost. With it, max_new_tokens may
    # be 0: the sequence finishes after its prefill, having made nothing.
    prompt_logprobs: int | None = None
    # vLLM's: tokens that end it as eos does (not in its tokens or text); eos and these
    # cannot end it before min_tokens (their logits are masked until then), nor can a
    # stop string; a stop string that ends it stays in its text (include_stop_str_in_output).
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False
    # Added to its logits before it picks (lanes/generation/processors.py): OpenAI's
    # logit_bias and presence and frequency penalties, vLLM's repetition penalty.
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Its text is wanted as it is made (a stream). Without, and without stop strings,
    # nobody reads it before the finish: it is decoded once then, its events till then
    # carry no text (the offline lanes').
    stream: bool = True
    arrived: float = 0.0  # on the scheduler's clock: for time-to-first-token
    offline: bool = False  # the offline lane's: free rows only, preempted for interactive
    # An offline row admitted while offline rows ride along (Scheduler.offline_rides):
    # it shares KV groups with interactive rows and decodes in every step, for good.
    rider: bool = False
    preemptions: int = 0  # times it gave its row up to an interactive sequence
    prefilled: int = 0  # prompt tokens in its cache so far (a prompt prefilled in chunks)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)
    # The eos or stop_token_ids token that ended it: made, counted (`completion_tokens`),
    # but neither in `tokens` nor in its text.
    stop_token: int | None = None
    text: str = ""  # decoded so far (cut before a stop string once one is found)
    sent: int = 0  # characters of `text` already handed out in events
    error: str | None = None  # why it finished with FINISHED_ERROR
    # One per token made, if asked: `tokens`' and then its `stop_token`'s (Event.scored).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Its prompt's tokens after the first, scored by its first prefill (in parts for a
    # prompt prefilled in chunks), where `prompt_logprobs` asked.
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    # Its tokens' counts, for its penalties: `tokens[:counted]` are in them.
    counts: dict[int, int] = field(default_factory=dict, repr=False)
    counted: int = field(default=0, repr=False)
    _rng: np.random.Generator | None = field(default=None, init=False, repr=False)
    # incremental detokenization: text of tokens[prefix:read] is already in `text`
    _prefix: int = field(default=0, repr=False)
    _read: int = field(default=0, repr=False)
    _limit: int = field(default=0, repr=False)  # Advance.budget, once known

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.id}: expected at least one prompt token")

    @property
    def rng(self) -> np.random.Generator:
        """Its own generator, made when it first samples: a greedy row never does, and
        making one costs more than such a row's whole sampling."""
        if self._rng is None:
            self._rng = generator(self.seed)
        return self._rng

    @property
    def controlled(self) -> bool:
        """Whether its logits are processed before it picks (Advance.pick): rows that
        declared nothing pick from them as they are, in the vectorised paths."""
        return (
            bool(self.stop_token_ids)
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds this row."""
        return self.tokens[-1] if self.tokens else self.prompt_ids[-1]

    @property
    def position(self) -> int:
        """Position of `last_token`: decode steps feed it at this position."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """What its cache holds before its next decode: the prompt and every token but
        the last (which that decode feeds). A preempted sequence's recompute prefills these."""
        return (*self.prompt_ids, *self.tokens[:-1])

    @property
    def lane(self) -> Lane:
        return "offline" if self.offline else "interactive"

    @property
    def sits_out(self) -> bool:
        """Whether it may sit out a step with interactive rows (an offline row that
        joined in a gap)."""
        return self.offline and not self.rider


@dataclass(frozen=True)
class Chunk:
    """Part of a long prompt prefilled in one step, on the cache of its earlier parts:
    `seq.prompt_ids[start:stop]`. The last part (`final`) samples the first token."""

    seq: Seq
    start: int
    stop: int

    @property
    def final(self) -> bool:
        return self.stop == len(self.seq.prompt_ids)


@dataclass(frozen=True)
class StepPlan:
    """One step. `prefill` join now: their prompts run and each samples its first token.
    `decode` are the batch's rows in order, each fed `last_token` at `position`;
    under `static`, finished rows stay in it and their logits are ignored.
    `retired` left without running (aborted or past their deadline): update() reports them.
    `preempted` (offline) left their rows to interactive joiners: the loop keeps their
    caches where memory allows (lanes/generation/preempt.py). `resumed` take rows
    again: their cache is put back (or recomputed from `cached_ids`) and they decode
    from the next plan on; they sample nothing now, so no token is made twice.
    `chunk` is the next part of a prompt too long for one step's prefill budget.
    """

    prefill: tuple[Seq, ...] = ()
    decode: tuple[Seq, ...] = ()
    retired: tuple[Seq, ...] = ()
    preempted: tuple[Seq, ...] = ()
    resumed: tuple[Seq, ...] = ()
    chunk: Chunk | None = None

    @property
    def runs_model(self) -> bool:
        return bool(self.prefill or self.decode or self.resumed or self.chunk)

    @property
    def empty(self) -> bool:
        return not (
            self.prefill
            or self.decode
            or self.retired
            or self.preempted
            or self.resumed
            or self.chunk
        )


@dataclass(frozen=True)
class StepOutputs:
    """Next-token logits of the plan's rows: [len(plan.prefill), vocab] and
    [len(plan.decode), vocab] (None where that list is empty, or every row in it failed).

    `failed` are the rows the model failed on alone (a resumed sequence's recompute
    included), by sequence id, with what to tell their callers: they finish with an
    error and their logits are not read; every other row goes on as usual.
    """

    prefill: Array | None = None
    decode: Array | None = None
    failed: Mapping[int, str] = field(default_factory=dict)
    chunk: Array | None = None  # [1, vocab]: the final chunk's next-token logits


# One is made per row per step: slots, and not frozen (a frozen dataclass's __init__
# sets each field through object.__setattr__, several times the cost of the rest of
# an offline row's update). Nothing changes an event once it is made.
@dataclass(slots=True)
class Event:
    """What one step did for one sequence: new tokens, the text now safe to show
    (held back while it might be the start of a stop string), and the finish."""

    seq_id: int
    tokens: tuple[int, ...] = ()
    text: str = ""
    finish: FinishReason | None = None
    first: bool = False  # carries the sequence's first generated token
    error: str | None = None  # with finish "error": what failed
    logprobs: tuple[TokenLogprob, ...] = ()  # of `scored`, where its sequence asked
    # A sequence's first event, where it asked (Seq.prompt_logprobs): its prompt's
    # tokens after the first, scored.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    stop_token: int | None = None  # with finish "stop": the token that ended it (Seq's)

    @property
    def made(self) -> int:
        """The tokens this step made for its sequence, as usage counts them."""
        return completion_tokens(len(self.tokens), self.stop_token)

    @property
    def scored(self) -> int | None:
        """The token this step's logprob record scores, where its sequence asked: the
        one it made, shown or not (the stop token, which `made` counts), as vLLM
        scores every token it counts; None where it made none."""
        return self.tokens[-1] if self.tokens else self.stop_token
