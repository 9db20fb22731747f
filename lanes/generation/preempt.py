"""Preempted sequences' caches: kept while memory allows, else recomputed on resume.

An offline sequence preempted for an interactive one (lanes/generation/scheduler.py)
keeps its tokens; only its KV cache is at stake. `Preempted.keep` copies each one's
rows out of the batch's cache before they are released, while the copies fit
`max_bytes`; `resume` puts a kept cache back as it was, and recomputes any other by
prefilling what it held (`Seq.cached_ids`: the prompt and every token but the last).
Either way the sequence's next decode feeds its last token at its position, exactly
as if it had never left: nothing it made is lost or made twice, and with greedy
decoding the tokens that follow are the ones it would have made.

The step loop (lanes/generation/loop.py) holds one, for both lanes: the offline
batch and the online engine drive the same loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lanes.generation.prefill import Join, Prefilled, prefill_apart
from lanes.generation.seq import Seq
from lanes.generation.slots import Cache
from lanes.tasks.decoder import Decoder

# Bytes of preempted caches one decoder's loop holds at most by default (the server's
# is Settings.preempted_cache_bytes): beyond, a preempted sequence's cache is
# recomputed when it resumes.
KEEP_BYTES = 256 * 1024 * 1024


@dataclass
class Preempted:
    """Kept caches of preempted sequences, by sequence id, within `max_bytes`."""

    max_bytes: int = KEEP_BYTES
    kept_bytes: int = 0
    recomputed: int = 0  # resumes whose cache had to be recomputed
    _kept: dict[int, Join] = field(default_factory=dict)

    def keep(self, cache: Cache, seqs: Sequence[Seq]) -> None:
        """Copy each of `seqs`' rows out of `cache` while they fit (call before the
        rows are released); the rest will be recomputed."""
        for seq in seqs:
            join = cache.take(seq.id)
            if join is None:
                continue
            size = _nbytes(join)
            if self.kept_bytes + size <= self.max_bytes:
                self._kept[seq.id] = join
                self.kept_bytes += size

    def resume(self, decoder: Decoder, seqs: Sequence[Seq]) -> Prefilled:
        """The caches of resuming `seqs`: kept ones as they were, the others recomputed
        in one prefill (isolated: a sequence it fails on alone is in `failed`). No
        logits: a resumed sequence samples nothing until its next decode."""
        joins: list[Join] = []
        again: list[Seq] = []
        for seq in seqs:
            join = self._kept.pop(seq.id, None)
            if join is None:
                again.append(seq)
            else:
                self.kept_bytes -= _nbytes(join)
                joins.append(join)
        if not again:
            return Prefilled(None, joins)
        self.recomputed += len(again)
        done = prefill_apart(decoder, again, recompute=True)
        return Prefilled(None, joins + done.joins, done.failed, done.error)

    def drop(self, seq_id: int) -> None:
        """Forget a sequence's kept cache (it finished, or was aborted, while preempted)."""
        join = self._kept.pop(seq_id, None)
        if join is not None:
            self.kept_bytes -= _nbytes(join)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._kept

    def __len__(self) -> int:
        return len(self._kept)


def _nbytes(join: Join) -> int:
    return sum(a.nbytes for a in (*join.past.keys, *join.past.values))
