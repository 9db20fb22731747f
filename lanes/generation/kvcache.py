"""The KV cache of a continuous batch: rows in groups of similar length.

A group (`KVCache`) is one batched array per layer, [rows, heads, length,
head_dim], left-padded with attention_mask 0 to its longest row, and fed back as
the next step's past: no step re-runs a prefix. A step runs the decoder once per
group (`BatchCache.decode`).

Why groups: a step costs about α per decoder run plus β per row per cached
position (the model attends over, and copies, its whole past every step). One
dense batch pads every row to the longest one, and with heavy-tailed lengths the
longest is far longer than most rows (2.4x the real positions at 16 clients in
bench/generate.py). So a joiner goes to the group where its padding costs least,
or starts a group of its own when that padding would cost more than a run of its
own (`max_padding` positions); groups whose lengths come within that are merged.
MAX_PADDING was measured, not derived: on tinycode with 16 closed-loop clients
(heavy-tailed lengths, one onnxruntime thread), 1 group padded the cache to 2.5x
its real positions and made ~880 tokens/s; max_padding 256, 128, 64 and 32 gave
1.7, 2.6, 4.6 and 6.6 groups on average, 2.0x, 1.5x, 1.25x and 1.15x padding and
~800, ~1080, ~1250 and ~1130 tokens/s. The α/β of a linear step-cost model fitted
on isolated steps says ~400: it misses that a smaller run also fits the caches.

Offline rows that may sit a step out (`Seq.sits_out`: the scheduler leaves them out
of steps with interactive rows) are in groups of their own (`KVCache.apart`): their
groups then sit the step out, caches untouched.

Within a group, a sequence that leaves makes a hole that a joiner may fill in
place (a copy of the joiner's own cache only); holes and leading columns that are
padding in every row are compacted away once they are worth a copy of the group.

A group's run that fails is run again in halves of its rows, each on its own slice
of the past (`step_group`; a failed run changed none of it, `present` being an
output): the rows that fail alone become holes and are reported, the others advance
exactly as the whole run would have advanced them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lanes.generation.prefill import Join
from lanes.isolation import Isolated, isolate
from lanes.tasks.decoder import Decoder
from lanes.tasks.past import Past, StepOutput

Array = np.ndarray[Any, Any]

# A compaction (dropping holes, trimming leading padding) copies the whole group,
# about a step's worth of memory traffic; what it saves is paid back over steps. So
# holes wait (for joiners to fill them in place, or for company) until they are a
# quarter of the group's rows, and leading padding until it is a quarter of its
# length (and at least TRIM_AT columns): then each compaction saves a quarter of
# every later step, and the copies cost a few percent.
TRIM_AT = 32
COMPACT_FRACTION = 4
MAX_GROUPS = 8
MAX_PADDING = 64


class KVCache:
    """One group's past: per layer [rows, heads, length, head_dim], left-padded.

    `slots[r]` is the sequence id in row r (None: a hole, fed a dummy token until a
    joiner takes it or it is compacted). `start[r]` is row r's first real column;
    columns before it have mask 0.
    """

    def __init__(self, decoder: Decoder, apart: bool = False) -> None:
        self.pad = decoder.config.pad_token_id
        self.apart = apart  # its rows may sit steps out: no other rows join it
        self.slots: list[int | None] = []
        empty = decoder.empty_past(0)
        self.keys: list[Array] = list(empty.keys)
        self.values: list[Array] = list(empty.values)
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.start: list[int] = []
        self.steps = 0  # decode steps so far
        self.empty_since: dict[int, int] = {}  # hole row -> the step it became one

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    @property
    def live(self) -> int:
        return len(self.slots) - len(self.empty_since)

    @property
    def past(self) -> Past:
        return Past(tuple(self.keys), tuple(self.values))

    @property
    def nbytes(self) -> int:
        """The bytes its keys and values hold: holes and padding too."""
        return sum(k.nbytes for k in self.keys) + sum(v.nbytes for v in self.values)

    def release(self, keep: set[int]) -> None:
        """Rows whose sequence is not in `keep` become holes."""
        # Most steps nobody leaves: one set check, not a pass over the rows.
        if (keep | {None} if self.empty_since else keep).issuperset(self.slots):
            return
        for r, sid in enumerate(self.slots):
            if sid is not None and sid not in keep:
                self.slots[r] = None
                self.start[r] = self.length
                self.mask[r] = 0
                self.empty_since[r] = self.steps

    def take(self, sid: int) -> Join:
        """A copy of sequence `sid`'s cache: its row's real columns."""
        r = self.slots.index(sid)
        at = self.start[r]
        keys = tuple(k[r : r + 1, :, at:].copy() for k in self.keys)
        values = tuple(v[r : r + 1, :, at:].copy() for v in self.values)
        return Join([sid], Past(keys, values), self.mask[r : r + 1, at:].copy(), self.apart)

    def step_inputs(self, rows: Sequence[Any | None]) -> tuple[Array, Array, Array]:
        """input_ids, attention_mask and position_ids of a decode step: each row's
        last token at its own position (`rows[r]`: row r's sequence, None for a hole);
        a hole attends only to its own dummy token (finite, and nobody reads it)."""
        n, pad = len(rows), self.pad
        # Built as lists and converted once: item by item into arrays costs more.
        tokens = [pad if s is None else s.last_token for s in rows]
        at = [0 if s is None else s.position for s in rows]
        ids = np.array(tokens, dtype=np.int64).reshape(n, 1)
        positions = np.array(at, dtype=np.int64).reshape(n, 1)
        mask = np.concatenate([self.mask, np.ones((n, 1), dtype=np.int64)], axis=1)
        return ids, mask, positions

    def advance(self, present: Past, mask: Array) -> None:
        """After a decode step fed `mask`: its present is the new past, one column
        longer (a hole's new column stays masked)."""
        self.keys, self.values = list(present.keys), list(present.values)
        self.mask = mask
        self.steps += 1
        for r in self.empty_since:
            mask[r, -1] = 0

    def place(self, ids: Sequence[int], past: Past, mask: Array) -> None:
        """Add prefilled sequences: into holes when their cache fits (in place),
        else appended (one copy of the group, padded to the longest)."""
        holes = sorted(self.empty_since)
        appended: list[int] = []
        width = mask.shape[1]
        for j, sid in enumerate(ids):
            if holes and width <= self.length:
                r = holes.pop(0)
                at = self.length - width
                for ours, theirs in zip(
                    (*self.keys, *self.values), (*past.keys, *past.values), strict=True
                ):
                    ours[r, :, :at] = 0
                    ours[r, :, at:] = theirs[j]
                self.mask[r] = 0
                self.mask[r, at:] = mask[j]
                self.slots[r] = sid
                self.start[r] = at + int(np.argmax(mask[j]))
                del self.empty_since[r]
            else:
                appended.append(j)
        if appended:
            self._append([ids[j] for j in appended], past, mask, appended)
        self.compact()

    def absorb(self, other: KVCache) -> None:
        """Take the live rows of `other` (padded to the longer of the two)."""
        rows = [r for r, sid in enumerate(other.slots) if sid is not None]
        ids = [sid for sid in other.slots if sid is not None]
        self._append(ids, other.past, other.mask, rows)
        self.compact()

    def _append(self, ids: Sequence[int], past: Past, mask: Array, rows: list[int]) -> None:
        length = max(self.length, mask.shape[1])
        old, new = len(self.slots), len(rows)

        def merged(ours: Array, theirs: Array) -> Array:
            _, h, _, d = theirs.shape
            out = np.zeros((old + new, h, length, d), dtype=theirs.dtype)
            out[:old, :, length - ours.shape[2] :] = ours
            out[old:, :, length - theirs.shape[2] :] = theirs[rows]
            return out

        self.keys = [merged(o, t) for o, t in zip(self.keys, past.keys, strict=True)]
        self.values = [merged(o, t) for o, t in zip(self.values, past.values, strict=True)]
        shift = length - self.length
        combined = np.zeros((old + new, length), dtype=np.int64)
        combined[:old, shift:] = self.mask
        combined[old:, length - mask.shape[1] :] = mask[rows]
        self.mask = combined
        self.start = [s + shift for s in self.start]
        at = length - mask.shape[1]
        self.start += [at + int(np.argmax(mask[j])) for j in rows]
        self.slots += list(ids)

    def compact(self) -> None:
        """Drop the holes once they are a quarter of the rows, and the leading columns
        every row has as padding once they are a quarter of the length. Copies once,
        or not at all."""
        holes = self.empty_since
        if len(holes) * COMPACT_FRACTION > len(self.slots):
            kept = [r for r, sid in enumerate(self.slots) if sid is not None]
            lead = min((self.start[r] for r in kept), default=0)
        else:  # every row stays: worth a copy only for the leading padding
            lead = min(self.start, default=0)
            if lead < max(TRIM_AT, self.length // COMPACT_FRACTION):
                return
            kept = list(range(len(self.slots)))
        index = np.asarray(kept, dtype=np.int64)
        self.keys = [np.ascontiguousarray(k[index, :, lead:]) for k in self.keys]
        self.values = [np.ascontiguousarray(v[index, :, lead:]) for v in self.values]
        self.mask = np.ascontiguousarray(self.mask[index, lead:])
        self.slots = [self.slots[r] for r in kept]
        self.start = [self.start[r] - lead for r in kept]
        self.empty_since = {new: holes[old] for new, old in enumerate(kept) if old in holes}


class BatchCache:
    """Every row of the batch, in groups of similar length; one decoder run per group.

    `max_padding` is how many padded positions a group may add to save a run.
    """

    def __init__(
        self, decoder: Decoder, max_padding: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.decoder = decoder
        self.max_padding = max_padding
        self.clock = clock  # times each group's run (Decoded.runs)
        self.groups: list[KVCache] = []
        # The most the groups' arrays held at once, counted as each group's decode run
        # holds its past and its new present (past and one more column) together.
        self.peak_nbytes = 0

    @property
    def rows(self) -> int:
        return sum(len(g.slots) for g in self.groups)

    @property
    def nbytes(self) -> int:
        """The bytes the groups' keys and values hold now: the real positions, and the
        padding and holes beside them."""
        return sum(g.nbytes for g in self.groups)

    @property
    def length(self) -> int:
        return max((g.length for g in self.groups), default=0)

    def release(self, keep: set[int]) -> None:
        """Rows whose sequence is not in `keep` become holes; a group of holes goes."""
        for group in self.groups:
            group.release(keep)
        self.groups = [g for g in self.groups if g.live]

    def compact(self) -> None:
        for group in self.groups:
            group.compact()
        self._merge()

    def take(self, sid: int) -> Join | None:
        """A copy of sequence `sid`'s cache, or None when no row holds it."""
        for group in self.groups:
            if sid in group.slots:
                return group.take(sid)
        return None

    def decode(self, seqs: Sequence[Any]) -> Decoded:
        """One decode step of the groups holding `seqs` (the others sit it out):
        next-token logits in `seqs`' order, and the sequences the model failed on alone
        (holes now; see `step_group`). `seqs` have `id`, `last_token` and `position`."""
        # The usual step: one group, holding the step's rows in its order. Then the
        # rows are the sequences as given and the logits are the group's as they came.
        single = len(self.groups) == 1 and self.groups[0].slots == [s.id for s in seqs]
        by_id = {} if single else {s.id: s for s in seqs}
        order: dict[int, int] = {}
        logits: Array | None = None
        failed: dict[int, Exception] = {}
        error: Exception | None = None
        stepped = self.groups if single else self._stepped(by_id)
        length = max((g.length for g in stepped), default=0)
        runs = []
        holding = self.nbytes
        for group in stepped:
            rows_seqs = seqs if single else [None if i is None else by_id[i] for i in group.slots]
            ids, mask, positions = group.step_inputs(rows_seqs)
            at = self.clock()
            step = step_group(self.decoder, group, ids, mask, positions)
            runs.append(GroupRun(len(group.slots), group.length, self.clock() - at))
            present, past = step.present.nbytes, group.nbytes
            self.peak_nbytes = max(self.peak_nbytes, holding + present)
            holding += present - past
            group.advance(step.present, mask)
            error = error or step.error
            if step.failed:
                failed.update(step.failed)
                group.release({sid for sid in group.slots if sid is not None} - step.failed.keys())
            if step.logits is None:
                continue
            if single and not step.failed:
                logits = step.logits
                continue
            order = order or {s.id: i for i, s in enumerate(seqs)}
            rows = [r for r, sid in enumerate(group.slots) if sid is not None]
            index = [order[sid] for sid in group.slots if sid is not None]
            if logits is None:
                logits = np.empty((len(seqs), step.logits.shape[-1]), dtype=step.logits.dtype)
            logits[index] = step.logits[rows]
        if failed and logits is not None:
            order = order or {s.id: i for i, s in enumerate(seqs)}
            logits[[order[sid] for sid in failed]] = 0
        held = sum(g.live for g in stepped)
        if held + len(failed) != len(seqs) or (logits is None and not failed):
            raise ValueError(
                f"decode: the cache holds {held + len(failed)} sequences, the step has {len(seqs)}"
            )
        return Decoded(logits, failed, error, length, tuple(runs))

    def _stepped(self, ids: Mapping[int, Any]) -> list[KVCache]:
        """The groups a step of `ids` runs: every one holding any of them, whole."""
        stepped = []
        for group in self.groups:
            live = [sid for sid in group.slots if sid is not None]
            inside = sum(1 for sid in live if sid in ids)
            if inside and inside != len(live):
                raise ValueError(
                    f"decode: a group holds {len(live)} sequences, the step has {inside} of them"
                )
            if inside:
                stepped.append(group)
        return stepped

    def place(self, ids: Sequence[int], past: Past, mask: Array, apart: bool = False) -> None:
        """Add one prefill's sequences to the group where their padding costs least,
        or to a new group when it would cost more than a run; with `apart` (rows that
        may sit steps out), among the groups kept apart only, else among the others."""
        width, joining = mask.shape[1], len(ids)
        best: tuple[float, KVCache] | None = None
        for group in self.groups:
            if group.apart != apart:
                continue
            if group.length >= width:
                padding = joining * (group.length - width)
            else:
                padding = group.live * (width - group.length)
            if best is None or padding < best[0]:
                best = (padding, group)
        if best is not None and (best[0] <= self.max_padding or len(self.groups) >= MAX_GROUPS):
            best[1].place(ids, past, mask)
        else:
            group = KVCache(self.decoder, apart)
            group.place(ids, past, mask)
            self.groups.append(group)
        self._merge()

    def _merge(self) -> None:
        """Merge neighbouring groups (by length, the ones kept apart among themselves)
        while padding the shorter one's rows costs no more than the run it saves."""
        self.groups.sort(key=lambda g: (g.apart, g.length))
        i = 0
        while i + 1 < len(self.groups):
            short, long = self.groups[i], self.groups[i + 1]
            same = short.apart == long.apart
            if same and short.live * (long.length - short.length) <= self.max_padding:
                long.absorb(short)
                del self.groups[i]
            else:
                i += 1


@dataclass(frozen=True)
class Decoded:
    """One decode step of the batch: next-token logits [len(seqs), vocab] in the step's
    order (None when every row failed; a failed row's logits are zeros), the sequences
    the model failed on alone, by id, with what each raised, and what the first group
    run that failed raised (None: every group's run succeeded whole), over a cache
    `length` long (the longest group it ran, before the step: what the step's cost
    follows per row; a SlotCache's rows' mean), in `runs`, one per group."""

    logits: Array | None
    failed: dict[int, Exception]
    error: Exception | None = None
    length: int = 0
    runs: tuple[GroupRun, ...] = ()


@dataclass(frozen=True)
class GroupRun:
    """One group's decoder run in a step: its rows (holes included), its past's
    length, and how long the run took (isolating a failure included)."""

    rows: int
    length: int
    seconds: float


@dataclass(frozen=True)
class GroupStep:
    """One group's decode run: logits [rows, vocab] (None when every live row failed),
    the group's new past, the sequences the model failed on alone, by id, with their
    errors, and what the whole run raised (None: it succeeded)."""

    logits: Array | None
    present: Past
    failed: dict[int, Exception]
    error: Exception | None = None


def step_group(
    decoder: Decoder, group: KVCache, ids: Array, mask: Array, positions: Array
) -> GroupStep:
    """One decode run over the whole group; if it fails, `step_apart`."""
    try:
        out = decoder.step(ids, mask, positions, group.past)
    except Exception as error:
        return step_apart(decoder, group, ids, mask, positions, error)
    return GroupStep(out.logits[:, -1], out.present, {})


def step_apart(
    decoder: Decoder, group: KVCache, ids: Array, mask: Array, positions: Array, error: Exception
) -> GroupStep:
    """After the group's run raised `error`: run its live rows in halves, each on its
    own rows of the past and inputs, until the rows that fail alone are found
    (lanes/isolation.py). The present is put back together row by row: what each
    successful run gave its rows, zeros for holes and failed rows (never read: they
    are holes from now on)."""
    live = [r for r, sid in enumerate(group.slots) if sid is not None]

    def run(rows: Sequence[int]) -> StepOutput:
        index = np.asarray(rows, dtype=np.int64)
        past = Past(tuple(k[index] for k in group.keys), tuple(v[index] for v in group.values))
        return decoder.step(ids[index], mask[index], positions[index], past)

    # With holes, the failed run is not the live rows' run: that one is tried first.
    isolated = isolate(run, live, error if len(live) == len(group.slots) else None)
    return _reassembled(group, live, isolated, error)


def _reassembled(
    group: KVCache, live: list[int], isolated: Isolated[StepOutput], error: Exception
) -> GroupStep:
    rows = len(group.slots)

    def grown(past: Array) -> Array:
        _, heads, length, dim = past.shape
        return np.zeros((rows, heads, length + 1, dim), dtype=past.dtype)

    keys, values = [grown(k) for k in group.keys], [grown(v) for v in group.values]
    logits: Array | None = None
    for part in isolated.ran:
        index = np.asarray(live[part.start : part.stop], dtype=np.int64)
        out = part.result
        if logits is None:
            logits = np.zeros((rows, out.logits.shape[-1]), dtype=out.logits.dtype)
        logits[index] = out.logits[:, -1]
        present = (*out.present.keys, *out.present.values)
        for ours, theirs in zip((*keys, *values), present, strict=True):
            ours[index] = theirs
    failed: dict[int, Exception] = {}
    for lost in isolated.failed:
        sid = group.slots[live[lost.index]]
        if sid is not None:  # always: `live` holds only rows with a sequence
            failed[sid] = lost.error
    return GroupStep(logits, Past(tuple(keys), tuple(values)), failed, error)
