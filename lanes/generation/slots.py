"""The KV cache of a continuous batch for a slot-layout decoder: one run per step.

A concat-layout decoder (the Optimum signature) needs one past length per run, so
lanes/generation/kvcache.py groups rows of similar length and runs each group. A
slot-layout decoder (DecoderConfig.kv_layout, lanes/demo/slots.py) keeps every
row's past at the front of its own row of one buffer per layer, [rows, heads,
max_position, head_dim], and a step writes each row's new key and value in place at
its own length. So the whole batch decodes in one run, each row attending over its
own positions only: no padding, and no copy of the past.

Rows are dense: a sequence that leaves is replaced by the last row (a copy of that
row's positions), so a step binds the buffers' first rows. Buffers start with the
scheduler's rows and grow by doubling; they are allocated lazily (zeroed pages that
nothing touched cost nothing), and a step touches each row's own columns only. Offline rows that may sit a step out (`Seq.sits_out`) live in a second
set of buffers (`apart`), run only in the steps they take part in.

A step's run that fails is run again in halves of its rows on copies of their
buffers (lanes/isolation.py); the rows that fail alone leave, the others take what
their half wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lanes.generation.kvcache import BatchCache, Decoded, GroupRun
from lanes.generation.prefill import Join
from lanes.isolation import isolate
from lanes.tasks.decoder import Decoder
from lanes.tasks.past import Past
from lanes.tasks.slot_graph import SlotRun

Array = np.ndarray[Any, Any]

FIRST_ROWS = 8


class Slots:
    """One set of buffers: `ids[r]` is the sequence in row r, `lengths[r]` the
    positions it holds (columns 0 .. lengths[r]-1 of its row). `rows`: how many
    rows the buffers take when the first sequence comes."""

    def __init__(self, decoder: Decoder, apart: bool, rows: int = FIRST_ROWS) -> None:
        c = decoder.config
        if c.max_position is None:  # read_config refuses such a slot-layout model
            raise ValueError("a slot-layout decoder needs config.max_position")
        self.decoder = decoder
        self.apart = apart
        self.first_rows = max(1, rows)
        self.ids: list[int] = []
        self.lengths: list[int] = []
        self._shape = (c.num_heads, c.max_position, c.head_dim)
        self._layers = c.num_layers
        self.buffers: list[Array] = []  # keys then values, per layer
        # The most the buffers held at once: a growth holds the old and the new ones
        # while it copies; a step writes in place.
        self.peak_nbytes = 0
        # The logits of every run below, whatever its rows: one step's at a time.
        self.logits: Array | None = None
        # Bound to the buffers' first rows, by their count: rows join and leave most
        # steps, and the buffers stay until they grow.
        self._runs: dict[int, SlotRun] = {}

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    @property
    def past(self) -> Past:
        n = self._layers
        return Past(tuple(self.buffers[:n]), tuple(self.buffers[n:]))

    @property
    def nbytes(self) -> int:
        """The bytes the buffers take: every row's whole context, used or not."""
        return sum(b.nbytes for b in self.buffers)

    def place(self, sid: int, keys: Sequence[Array], values: Sequence[Array]) -> None:
        """Add sequence `sid`, whose cache is `keys`/`values` [heads, positions, dim]."""
        r = len(self.ids)
        if not self.buffers or r == self.buffers[0].shape[0]:
            self._grow(max(self.first_rows, 2 * r))
        n = keys[0].shape[1]
        for ours, theirs in zip(self.buffers, (*keys, *values), strict=True):
            ours[r, :, :n] = theirs
        self.ids.append(sid)
        self.lengths.append(n)

    def _grow(self, rows: int) -> None:
        old, used = len(self.ids), self.length
        dtype = self.decoder.empty_past(0).keys[0].dtype
        grown = []
        for i in range(2 * self._layers):
            buffer = np.zeros((rows, *self._shape), dtype=dtype)
            if self.buffers:
                buffer[:old, :, :used] = self.buffers[i][:old, :, :used]
            grown.append(buffer)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + sum(b.nbytes for b in grown))
        self.buffers = grown
        self.logits = self.decoder.slot_logits(rows)
        self._runs = {}

    def release(self, keep: set[int]) -> None:
        """Rows whose sequence is not in `keep` go; the last rows move into their places."""
        if keep.issuperset(self.ids):
            return
        r = 0
        while r < len(self.ids):
            if self.ids[r] in keep:
                r += 1
                continue
            last = len(self.ids) - 1
            if r != last:
                n = self.lengths[last]
                for buffer in self.buffers:
                    buffer[r, :, :n] = buffer[last, :, :n]
                self.ids[r], self.lengths[r] = self.ids[last], self.lengths[last]
            self.ids.pop()
            self.lengths.pop()

    def take(self, sid: int) -> Join:
        """A copy of sequence `sid`'s cache."""
        r = self.ids.index(sid)
        n = self.lengths[r]
        keys = tuple(b[r : r + 1, :, :n].copy() for b in self.buffers[: self._layers])
        values = tuple(b[r : r + 1, :, :n].copy() for b in self.buffers[self._layers :])
        return Join([sid], Past(keys, values), np.ones((1, n), dtype=np.int64), self.apart)

    def decode(self, tokens: Sequence[int]) -> Array:
        """One step of every row, `tokens[r]` after row r's positions, in place: the
        logits [rows, vocab], valid until the next step (`SlotRun`). Raises what the run
        raises."""
        rows = len(self.ids)
        run = self._runs.get(rows)
        if run is None:
            run = self._runs[rows] = self.decoder.slot_run(self.past, rows, self.logits)
        ids = np.asarray(tokens, dtype=np.int64).reshape(rows, 1)
        logits = run(ids, self.lengths)
        self.lengths = [n + 1 for n in self.lengths]
        return logits[:, -1]

    def decode_apart(
        self, tokens: Sequence[int], error: Exception
    ) -> tuple[Array | None, dict[int, Exception]]:
        """After the step's run raised `error`: its rows in halves, each on a copy of
        its buffers, until the rows that fail alone are found. The others take what
        their half wrote; the failed ones leave. Logits [rows, vocab] (zeros for the
        failed rows; None when every row failed) and the failed sequences' errors."""
        rows = list(range(len(self.ids)))

        def run(part: Sequence[int]) -> tuple[Array, list[Array]]:
            index = np.asarray(part, dtype=np.int64)
            copies = [np.ascontiguousarray(b[index]) for b in self.buffers]
            n = self._layers
            ids = np.asarray([tokens[r] for r in part], dtype=np.int64).reshape(-1, 1)
            lengths = [self.lengths[r] for r in part]
            past = Past(tuple(copies[:n]), tuple(copies[n:]))
            return self.decoder.step_slots(ids, lengths, past, len(part))[:, -1], copies

        isolated = isolate(run, rows, error)
        logits: Array | None = None
        for done in isolated.ran:
            index = np.asarray(rows[done.start : done.stop], dtype=np.int64)
            part_logits, copies = done.result
            if logits is None:
                logits = np.zeros((len(rows), part_logits.shape[-1]), dtype=part_logits.dtype)
            logits[index] = part_logits
            for buffer, copy in zip(self.buffers, copies, strict=True):
                buffer[index] = copy
        failed = {self.ids[f.index]: f.error for f in isolated.failed}
        self.lengths = [n + 1 for n in self.lengths]
        self.release(set(self.ids) - failed.keys())
        return logits, failed


class SlotCache:
    """Every row of the batch in slots: one decoder run per step (two when rows kept
    apart take part). The same calls as kvcache.BatchCache, for StepLoop."""

    def __init__(
        self,
        decoder: Decoder,
        max_padding: float,
        clock: Callable[[], float] = time.monotonic,
        rows: int = FIRST_ROWS,
    ) -> None:
        self.decoder = decoder
        self.max_padding = max_padding  # unused: nothing is padded; kept for StepLoop
        self.clock = clock
        self.sets = (Slots(decoder, False, rows), Slots(decoder, True, rows))

    @property
    def rows(self) -> int:
        return sum(len(s.ids) for s in self.sets)

    @property
    def nbytes(self) -> int:
        """The bytes both sets' buffers take, their rows' whole contexts (untouched
        pages of them are not resident yet: see above)."""
        return sum(s.nbytes for s in self.sets)

    @property
    def peak_nbytes(self) -> int:
        """The most the buffers held at once, or a little more: each set's own most,
        summed (the two sets grow at different times)."""
        return sum(s.peak_nbytes for s in self.sets)

    @property
    def length(self) -> int:
        """What a decode step's cost follows per row, as BatchCache.length is: here the
        rows' mean length (rounded up), since each row attends over its own positions
        only where BatchCache pads a group's rows to its longest."""
        return _mean_length(self.sets)

    def place(self, ids: Sequence[int], past: Past, mask: Array, apart: bool = False) -> None:
        """Add prefilled sequences: each row's real columns (mask 1) to the front of a slot."""
        into = self.sets[apart]
        for j, sid in enumerate(ids):
            real = np.flatnonzero(mask[j])
            # Left padding makes them one slice, read without a copy.
            dense = real[-1] - real[0] + 1 == len(real)
            cols: slice | Array = slice(real[0], real[-1] + 1) if dense else real
            keys = [k[j][:, cols] for k in past.keys]
            values = [v[j][:, cols] for v in past.values]
            into.place(sid, keys, values)

    def release(self, keep: set[int]) -> None:
        for slots in self.sets:
            slots.release(keep)

    def compact(self) -> None:
        """Nothing to do: rows are dense and unpadded."""

    def take(self, sid: int) -> Join | None:
        for slots in self.sets:
            if sid in slots.ids:
                return slots.take(sid)
        return None

    def decode(self, seqs: Sequence[Any]) -> Decoded:
        """One decode step of the sets holding `seqs`, whole (see BatchCache.decode)."""
        step_ids = [s.id for s in seqs]
        # The usual step: one set, holding the step's rows in its order.
        single = next((x for x in self.sets if x.ids == step_ids), None) if seqs else None
        stepped = [single] if single is not None else self._stepped(seqs)
        at = {sid: i for i, sid in enumerate(step_ids)} if single is None else {}
        length = _mean_length(stepped)
        logits: Array | None = None
        failed: dict[int, Exception] = {}
        error: Exception | None = None
        runs = []
        for slots in stepped:
            ids, before = list(slots.ids), _mean_length([slots])
            rows = None if single is not None else [at[sid] for sid in ids]  # in the step
            tokens = (
                [s.last_token for s in seqs] if rows is None else [seqs[i].last_token for i in rows]
            )
            start = self.clock()
            try:
                got: Array | None = slots.decode(tokens)
            except Exception as raised:
                error = error or raised
                got, lost = slots.decode_apart(tokens, raised)
                failed.update(lost)
            runs.append(GroupRun(len(ids), before, self.clock() - start))
            if got is None:
                continue
            if rows is None:
                logits = got
                continue
            if logits is None:  # rows no set's run gives (it failed whole) stay zeros
                whole = len(stepped) == 1  # one set, its rows in another order
                shape, dtype = (len(seqs), got.shape[-1]), got.dtype
                logits = np.empty(shape, dtype) if whole else np.zeros(shape, dtype)
            logits[rows] = got
        if failed and logits is not None and single is None:  # one set's are zeros already
            logits[[at[sid] for sid in failed]] = 0
        return Decoded(logits, failed, error, length, tuple(runs))

    def _stepped(self, seqs: Sequence[Any]) -> list[Slots]:
        """The sets holding `seqs`; ValueError unless they hold them and nothing else."""
        wanted = {s.id for s in seqs}
        stepped = []
        for slots in self.sets:
            inside = sum(1 for sid in slots.ids if sid in wanted)
            if inside and inside != len(slots.ids):
                raise ValueError(
                    f"decode: a set of slots holds {len(slots.ids)} sequences, "
                    f"the step has {inside} of them"
                )
            if inside:
                stepped.append(slots)
        if sum(len(s.ids) for s in stepped) != len(seqs):
            raise ValueError(
                f"decode: the cache holds {sum(len(s.ids) for s in stepped)} of the step's "
                f"{len(seqs)} sequences"
            )
        return stepped


def _mean_length(sets: Sequence[Slots]) -> int:
    """The positions a row of `sets` attends over in a step, on average (rounded up)."""
    rows = sum(len(s.lengths) for s in sets)
    return -(-sum(sum(s.lengths) for s in sets) // rows) if rows else 0


Cache = BatchCache | SlotCache


def new_cache(
    decoder: Decoder,
    max_padding: float,
    clock: Callable[[], float] = time.monotonic,
    rows: int = FIRST_ROWS,
) -> Cache:
    """The batch cache `decoder`'s KV layout needs (`rows`: the rows it will usually
    hold)."""
    if decoder.slots:
        return SlotCache(decoder, max_padding, clock, rows)
    return BatchCache(decoder, max_padding, clock)
