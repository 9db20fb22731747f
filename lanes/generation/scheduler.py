"""Continuous batching, the pure part: which sequences run this step, and what came of it.

    plan = scheduler.schedule()            # who joins (prefill), who steps (decode)
    outputs = <run the model on the plan>  # the step loop's job (lanes/generation/loop.py)
    events = scheduler.update(plan, outputs)  # lanes/generation/update.py

No onnxruntime, no threads, no I/O: logits in, events out. The clock and the
detokenizer are injected, so the hard logic is tested with fabricated logits. What
the logits make of each sequence (its token, its text, its end) is `Advance`'s
(lanes/generation/advance.py); this module plans the steps.

Rows are the decoder's batch, in order. A decode step feeds every row its last
token; a sequence that finishes (eos, its token budget, a stop string, an abort,
its deadline) leaves its row at once under the continuous policies, and a waiting
sequence takes the free row at the next step. The bench compares against:

- `static`: a batch is formed only when no row is busy; finished sequences keep
  their rows (stepping uselessly) until the longest is done, as a plain batched
  `generate()` does;
- `static-drop`: the same, but finished sequences leave the batch at once;
- `serial`: one sequence at a time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

from lanes.generation.advance import Advance
from lanes.generation.kvbudget import KvBudget
from lanes.generation.prefill_tokens import PrefillTokens
from lanes.generation.prefixes import PrefixCache
from lanes.generation.reserve import Reserve
from lanes.generation.seq import Chunk, Seq, SeqStatus, StepPlan
from lanes.generation.text import ByteText, Detokenize, WindowText
from lanes.generation.update import StepUpdate

Policy = Literal["continuous", "static", "static-drop", "serial"]
POLICIES: tuple[Policy, ...] = ("continuous", "static", "static-drop", "serial")


# One step's joiners' padded prompt tokens unless told otherwise: prefill returns logits
# for every position, so this bounds its memory.
PREFILL_TOKENS = 4096


class Scheduler(StepUpdate):
    """Decides each step's batch for one decoder; single-threaded (the step loop's).

    `max_running` bounds the rows; `max_prefill_tokens` bounds one step's joiners by
    their padded prompt size (at least one joins when a row is free). With
    `prefill_alone`, a step that admits joiners runs only their prefill and the rows
    decode at the next one: a newcomer's first token waits for no decode (the online
    engine's choice; offline, nobody waits for a first token). Never two such steps
    in a row while rows wait: then the joiners prefill in the rows' decode step.

    Two lanes share the rows. Offline sequences (`Seq.offline`) wait in a queue of
    their own and take only rows that no interactive sequence waits for, never the
    last `reserve` rows (lanes/generation/reserve.py: kept free for interactive
    arrivals while they keep coming); when interactive ones wait and every row is
    taken, the newest offline rows are preempted (continuous policy):
    back to the front of the offline queue with the tokens they made, to resume when
    rows are free again. So are offline rows past `max_running` while interactive
    rows run (a bound lowered under them, as `slo.itl_ms` does): they would make the
    interactive rows' steps longer than the bound allows.

    Offline rows fill the gaps the interactive lane leaves. They join (and preempted
    ones resume) only in steps without interactive work, on any device: a prefill, or
    a cache recomputed, would lengthen an interactive step by several decodes, the
    tail the interactive lane feels. While interactive rows run, the offline ones keep
    their rows and caches but sit the steps out (no copy, nothing lost), unless
    `offline_rides` says their decode costs the interactive rows little
    (lanes/generation/steer.py sets it from its cost model of single decoder runs
    before each plan: on a device whose run costs about the same for more rows they
    ride along; where every row adds its cost, they wait for a step without
    interactive rows). The batch cache keeps the rows that may sit out in groups of
    their own (lanes/generation/kvcache.py), and a prefill's joiners are of one kind.
    Offline rows admitted while they ride (`Seq.rider`) join the interactive rows'
    groups instead, a run less per step, and decode in every step.

    With `chunked`, `max_prefill_tokens` is a hard budget: a prompt longer than it is
    prefilled in parts over several plans (`StepPlan.chunk`, one prompt at a time,
    holding a row meanwhile), so the rows decoding keep stepping while it is admitted.
    Prompts that fit join before its next part (which takes the budget they leave, at
    least half) and pass the next long prompt waiting meanwhile.

    With a `kv` budget (lanes/generation/kvbudget.py), a sequence joins only while
    every row's worst case fits it together (one alone always may), in queue order;
    an interactive one that does not fit preempts the newest offline rows when that
    makes it fit, as for a row.
    """

    def __init__(
        self,
        max_running: int,
        eos_token_ids: frozenset[int],
        detokenize: Detokenize,
        *,
        policy: Policy = "continuous",
        max_position: int | None = None,
        max_prefill_tokens: int = PREFILL_TOKENS,
        prefill_alone: bool = False,
        chunked: bool = False,
        reserve: Reserve | None = None,
        kv: KvBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
        byte_text: ByteText | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, found {policy!r}")
        self.policy: Policy = policy
        self.max_running = 1 if policy == "serial" else max_running
        # With the tokens' bytes (text.ByteText), text needs no decode() call.
        text = WindowText(detokenize) if byte_text is None else byte_text
        self.advance = Advance(eos_token_ids, text, max_position, self._finish)
        self.max_prefill_tokens = max_prefill_tokens
        # The prefix cache the prefill runs with (the step loop's, where its decoder
        # shares prefixes): the budget charges a joiner only what it will run. None:
        # every prompt is charged whole.
        self.prefixes: PrefixCache | None = None
        # Rows past max_running that waiting interactive sequences may take at the next
        # full plan (lanes/generation/steer.py: when their TTFT is the nearer SLO).
        self.past_bound = 0
        # Whether offline rows decode in steps with interactive rows (see above).
        self.offline_rides = False
        self.prefill_alone = prefill_alone
        self.chunked = chunked
        self.chunking: Seq | None = None  # the prompt being prefilled in parts
        self._prefilled_alone = False  # the last plan left waiting rows out for joiners
        self.clock = clock
        self.reserve = Reserve() if reserve is None else reserve
        self.kv = kv
        self.waiting: deque[Seq] = deque()
        self.offline: deque[Seq] = deque()  # the offline lane's, preempted ones first
        self.rows: list[Seq] = []
        self._live: dict[int, Seq] = {}  # unfinished sequences, by id
        self._unreported: list[Seq] = []  # finished outside update(): aborts, deadlines
        # What spares each plan a pass over every queue and row: unfinished sequences
        # with a deadline, unfinished offline ones, and whether a queued one finished
        # (an abort, its deadline) since the queues were last cleared of such.
        self._timed = 0
        self._offline_live = 0
        self._queued_finished = False

    # ---- requests in and out ------------------------------------------------

    def add(self, seq: Seq) -> None:
        """Queue a new sequence; it joins at a coming step."""
        if seq.id in self._live:
            raise ValueError(f"sequence {seq.id} is already scheduled")
        self._live[seq.id] = seq
        self._timed += seq.deadline is not None
        self._offline_live += seq.offline
        self.advance.scoring += seq.top_logprobs is not None
        self.advance.controlled += seq.controlled
        if not seq.offline:
            self.reserve.arrived(self.clock())
        (self.offline if seq.offline else self.waiting).append(seq)

    def abort(self, seq_id: int) -> None:
        """The client went away: the sequence leaves at the next step. Unknown or
        finished ids are ignored (it may have finished meanwhile)."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self._finish(seq, SeqStatus.FINISHED_ABORTED)
            self._unreported.append(seq)

    def expire(self) -> None:
        """The server is about to stop: every interactive sequence's deadline is now,
        so each leaves at the next step as at its deadline (a running one with its text
        so far and finish_reason `length`), instead of being cut off mid-stream."""
        now = self.clock()
        for seq in self._live.values():
            if not seq.offline:
                self._timed += seq.deadline is None
                seq.deadline = now if seq.deadline is None else min(seq.deadline, now)

    @property
    def num_waiting(self) -> int:
        """Interactive sequences waiting for a row."""
        return sum(1 for s in self.waiting if not s.status.is_finished)

    @property
    def num_offline_waiting(self) -> int:
        """Offline sequences waiting for a row (preempted ones included)."""
        return sum(1 for s in self.offline if not s.status.is_finished)

    @property
    def num_running(self) -> int:
        return sum(1 for s in (*self.rows, *self._chunking()) if not s.status.is_finished)

    @property
    def any_running(self) -> bool:
        """`num_running > 0`, stopping at the first row that runs (asked every step)."""
        if self.chunking is not None and not self.chunking.status.is_finished:
            return True
        return any(not s.status.is_finished for s in self.rows)

    @property
    def kv_reserved(self) -> int:
        """Bytes of KV cache the rows may take at most: the sum of their worst cases."""
        if self.kv is None:
            return 0
        return sum(self._worst(s) for s in (*self.rows, *self._chunking()))

    @property
    def _kv_bound(self) -> int | None:
        return None if self.kv is None else self.kv.max_bytes

    def _worst(self, seq: Seq) -> int:
        return 0 if self.kv is None else self.kv.worst(len(seq.prompt_ids), seq.max_new_tokens)

    def _kv_fits(self, seq: Seq, reserved: int) -> bool:
        """Whether `seq` may join rows whose worst cases take `reserved` bytes: within
        the budget, or with no row to share it."""
        bound = self._kv_bound
        return bound is None or not reserved or reserved + self._worst(seq) <= bound

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.offline or self.rows or self._unreported or self.chunking)

    # ---- the step ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: expire what is past its deadline, drop finished rows (per
        policy), and let waiting sequences join the free rows."""
        now = self.clock()
        if self._timed:
            for seq in (*self.rows, *self.waiting, *self.offline, *self._chunking()):
                if seq.deadline is not None and now >= seq.deadline and not seq.status.is_finished:
                    self._finish(seq, SeqStatus.FINISHED_DEADLINE)
                    seq.text += self.advance.text.rest(seq)
                    self._unreported.append(seq)
        self._drop_finished_queued()
        if self.policy != "static" or all(s.status.is_finished for s in self.rows):
            self.rows = [s for s in self.rows if not s.status.is_finished]
        else:  # a row the model failed on would fail again: it leaves even static
            self.rows = [s for s in self.rows if s.status != SeqStatus.FINISHED_ERROR]
        if self.chunking is not None and self.chunking.status.is_finished:
            self.chunking = None  # aborted or past its deadline: reported as retired
        preempted = self._preempt()
        running = tuple(self.rows)
        offline_rows = self.max_running - self.reserve.rows(self.max_running, now)
        limit = self.max_running + self.past_bound
        chunking = self._start_chunk(limit, offline_rows)
        # Prompts that fit join before the next part of a long one, which takes the
        # budget they leave, at least half of it (so it is never starved).
        share = self._budget // 2 if chunking else 0
        prefill = self._admit(self.waiting, self.max_prefill_tokens - share, limit)
        self.rows.extend(prefill)
        budget = self.max_prefill_tokens - self._prefill_tokens(prefill)
        chunk = self._chunk(budget) if chunking else None
        budget -= 0 if chunk is None else chunk.stop - chunk.start
        resumed: tuple[Seq, ...] = ()
        busy = self._offline_live > 0 and self._interactive_busy(running, prefill)
        sits_out = busy and not self.offline_rides and self.policy == "continuous"
        # Offline rows join only in steps without interactive work (see above).
        if not (self.waiting or busy):
            offline = self._admit(self.offline, budget, offline_rows)
            for seq in offline:
                if not seq.tokens:  # a resumed one keeps its kind (and its cache's group)
                    seq.rider = self.offline_rides
            resumed = tuple(s for s in offline if s.tokens)
            prefill += tuple(s for s in offline if not s.tokens)
            self.rows.extend(offline)
        if sits_out:
            running = tuple(s for s in running if not s.sits_out)
            if chunk is not None and chunk.seq.sits_out:
                chunk = None  # its next part waits for a gap too
        retired, self._unreported = tuple(self._unreported), []
        # Joiners run alone, but never twice in a row while rows wait: arrivals that
        # trickle in one per step would otherwise starve the decode.
        # Offline joiners wait for no first token: they prefill beside the rows' decode.
        interactive_joiners = any(not s.offline for s in prefill)
        alone = interactive_joiners and self.prefill_alone and not self._prefilled_alone
        self._prefilled_alone = alone and bool(running)
        rows = () if alone else running
        if alone and running:
            # The next part waits for the rows' decode (the next plan): in the joiners'
            # step alone it would delay their first tokens, and the rows' next one.
            chunk = None
        return StepPlan(prefill, rows, retired, preempted, resumed, chunk)

    def admit_beside(self) -> tuple[Seq, ...]:
        """Interactive joiners that take free rows while the last plan's decode still
        runs, to prefill beside it (the online engine's choice: an arrival then waits
        for no decode at all). Update with their prefill alone
        (`StepPlan(prefill=...)`); they decode from the next plan on. Only what needs
        nothing of that plan joins: a row free without preempting anyone and a prompt
        that goes whole; the rest wait for the next plan, as without this."""
        if self.policy != "continuous" or not self.prefill_alone:
            return ()
        self._drop_finished_queued()
        # Charged whole: they are prefilled in runs of their own (prefill_groups), and
        # a run's prompt kept for the next may share less with it than the one now.
        whole = PrefillTokens()
        joiners = self._admit(self.waiting, self.max_prefill_tokens, self.max_running, whole)
        self.rows.extend(joiners)
        return joiners

    def _drop_finished_queued(self) -> None:
        if self._queued_finished:
            self.waiting = deque(s for s in self.waiting if not s.status.is_finished)
            self.offline = deque(s for s in self.offline if not s.status.is_finished)
            self._queued_finished = False

    def _interactive_busy(self, running: Sequence[Seq], prefill: Sequence[Seq]) -> bool:
        """Whether this step has interactive work: rows, joiners or a prompt in parts."""
        chunking = self.chunking is not None and not self.chunking.offline
        return chunking or bool(prefill) or any(not s.offline for s in running)

    def _start_chunk(self, limit: int, offline_rows: int) -> bool:
        """Whether a prompt is being prefilled in parts; a new one starts when the
        first waiting prompt (interactive first) is over the budget and fewer than
        `limit` rows are taken (an offline prompt: `offline_rows`)."""
        if not self.chunked or self.policy != "continuous":
            return False
        if self.chunking is None and len(self.rows) < limit:
            queue = self.waiting if self.waiting else self.offline
            if queue is self.offline and len(self.rows) >= offline_rows:
                queue = deque()
            head = queue[0] if queue else None
            long = head is not None and not head.tokens and len(head.prompt_ids) > self._budget
            reserved = self.kv_reserved if self._kv_bound is not None else 0
            if long and head is not None and self._kv_fits(head, reserved):
                self.chunking = queue.popleft()
                self.chunking.status = SeqStatus.RUNNING
        return self.chunking is not None

    def _chunk(self, tokens: int) -> Chunk | None:
        """The next part, at most `tokens` long, of the prompt being prefilled in parts."""
        seq = self.chunking
        if seq is None:
            return None
        stop = min(seq.prefilled + max(tokens, 1), len(seq.prompt_ids))
        return Chunk(seq, seq.prefilled, stop)

    @property
    def _budget(self) -> int:
        return max(self.max_prefill_tokens, 1)

    def _preempt(self) -> tuple[Seq, ...]:
        """Free a row for each interactive sequence waiting, and the rows past
        `max_running` while interactive rows run, from the newest offline rows (the
        least work to redo if a cache must be recomputed)."""
        if self.policy != "continuous":
            return ()
        free = self.max_running + self.past_bound - len(self.rows) - len(self._chunking())
        interactive = any(not (s.offline or s.status.is_finished) for s in self.rows)
        waiting = len(self.waiting)  # schedule() cleared it of finished ones
        wanted = waiting - free if waiting or interactive else 0
        victims: list[Seq] = []
        for seq in reversed(self.rows):
            if len(victims) >= wanted:
                break
            if seq.offline and not seq.status.is_finished:
                victims.append(seq)
        victims += self._kv_victims(victims)
        if not victims:
            return ()
        for seq in victims:
            seq.status = SeqStatus.WAITING
            seq.preemptions += 1
        out = set(map(id, victims))
        self.rows = [s for s in self.rows if id(s) not in out]
        self.offline.extendleft(victims)  # newest first in: the oldest ends up in front
        return tuple(reversed(victims))

    def _kv_victims(self, victims: Sequence[Seq]) -> list[Seq]:
        """The newest offline rows besides `victims` whose caches, once freed, let the
        first interactive sequence waiting fit the KV budget; none when no such rows
        would (interactive rows hold too much of it)."""
        if self._kv_bound is None or not self.waiting:
            return []
        chosen = {id(s) for s in victims}
        rows = [s for s in self.rows if id(s) not in chosen]
        reserved = sum(self._worst(s) for s in (*rows, *self._chunking()))
        more: list[Seq] = []
        for seq in reversed(rows):
            if self._kv_fits(self.waiting[0], reserved):
                return more
            if seq.offline and not seq.status.is_finished:
                more.append(seq)
                reserved -= self._worst(seq)
        return more if self._kv_fits(self.waiting[0], reserved) else []

    def _prefill_tokens(self, seqs: Sequence[Seq]) -> int:
        """What the prefill of `seqs` will run (lanes/generation/prefill_tokens.py)."""
        if not seqs:  # most plans
            return 0
        charged = PrefillTokens(self.prefixes)
        for seq in seqs:
            charged = charged.plus(seq)
        return charged.tokens

    def _admit(
        self,
        queue: deque[Seq],
        budget: int,
        limit: int,
        charged: PrefillTokens | None = None,
    ) -> tuple[Seq, ...]:
        """Joiners from `queue` while fewer than `limit` rows are taken and what their
        prefill runs fits `budget` (at least one, unless chunking makes the budget
        hard): `charged` counts it, by default with the prefix cache's kept prompts
        (lanes/generation/prefill_tokens.py; a resumed sequence is charged a row of
        the longest prompt). While a prompt is prefilled in parts, the next one over
        the whole budget waits for its turn without holding back the prompts behind
        it (they pass it only then: when its turn comes and no row is free, it takes
        the next one)."""
        static = self.policy in ("static", "static-drop")
        if static and self.rows:
            return ()  # nobody joins a static batch once it runs
        joining: list[Seq] = []
        if charged is None:
            charged = PrefillTokens(self.prefixes)
        hard = self.chunked and not static
        held = len(self.rows) + len(self._chunking())
        bounded = self._kv_bound is not None
        reserved = self.kv_reserved if bounded else 0  # summed only where it bounds
        passed: list[Seq] = []  # too long for one step: the parts' turn will come
        while queue and held + len(joining) < limit:
            head = queue[0]
            long = hard and not head.tokens and len(head.prompt_ids) > self._budget
            if long and self.chunking is not None:
                passed.append(queue.popleft())
                continue
            more = charged.plus(head)
            over = more.tokens > budget
            if over and not static and (joining or (hard and not head.tokens)):
                break
            if not self._kv_fits(head, reserved):
                break  # in queue order: what follows waits too, as vLLM's FCFS does
            seq = queue.popleft()
            seq.status = SeqStatus.RUNNING
            joining.append(seq)
            charged = more
            reserved += self._worst(seq) if bounded else 0
        queue.extendleft(reversed(passed))
        return tuple(joining)

    def _finish(self, seq: Seq, status: SeqStatus) -> None:
        self._queued_finished |= seq.status == SeqStatus.WAITING
        seq.status = status
        if self._live.pop(seq.id, None) is not None:
            self._timed -= seq.deadline is not None
            self._offline_live -= seq.offline
            self.advance.scoring -= seq.top_logprobs is not None
            self.advance.controlled -= seq.controlled
