"""Prompts' caches kept for later prompts that start the same way.

Requests that share an opening (a system prompt, a few-shot instruction, the turns
of a conversation so far) come one by one to an endpoint, and an offline job's rows
free up a few at a time, so the prompts that share one rarely meet in one prefill.
`PrefixCache` keeps the cache of the last prompt prefilled with each opening (its
first SHARED_PREFIX_MIN tokens: prompts sharing fewer are not worth a run of their
own, lanes/generation/prefill.py), one row, a copy, the least recently used going
first once they pass `max_bytes`. A joiner that starts with a long part of a kept
prompt then runs only its rest. Several openings stay side by side: workloads or
tenants taking turns with their own system prompts no longer evict each other.

A copy costs about what writing the prompt's cache did, so a prompt is kept only
once its opening has come before (or comes to several joiners of one prefill): a job
of prompts that share nothing copies none.

One prompt per opening: the newest replaces the one before it, since a
conversation's next turn holds its last one, and prompts of one template share the
template either way. vLLM keys its cache by blocks of tokens instead, so prompts
that diverge after a shared opening each keep theirs; lanes' caches are rows of a
batched array, not blocks, so a whole row is what there is to keep.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lanes.tasks.past import Past

# A prefix shorter than this is run in every row: a second run has a fixed cost of
# its own, which a short prefix's rows do not repay.
SHARED_PREFIX_MIN = 32

# Bytes of kept prompts' caches a loop holds by default (the server's is
# Settings.prefix_cache_bytes).
PREFIX_CACHE_BYTES = 64 * 1024 * 1024
# Openings seen once, remembered so that their second comer is kept: a few tuples of
# 32 ints each, the oldest forgotten first.
SEEN_OPENINGS = 4096

Context = tuple[int, ...]


def opening(context: Context) -> Context | None:
    """What prompts must share to share a run (None: too short to share any)."""
    return context[:SHARED_PREFIX_MIN] if len(context) > SHARED_PREFIX_MIN else None


def common_prefix(a: Context, b: Context) -> int:
    """How many tokens `a` and `b` start with alike (tuple slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same], a[:differs] != b[:differs]
    while differs - same > 1:
        mid = (same + differs) // 2
        if a[:mid] == b[:mid]:
            same = mid
        else:
            differs = mid
    return same


@dataclass(frozen=True)
class Kept:
    """A kept prompt and its cache (one row)."""

    ids: Context
    past: Past
    nbytes: int


class PrefixCache:
    """The last prompt of each opening, with its cache, within `max_bytes` (0: none)."""

    def __init__(self, max_bytes: int = PREFIX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._kept: OrderedDict[Context, Kept] = OrderedDict()  # least recently used first
        self._seen: OrderedDict[Context, None] = OrderedDict()  # openings not kept yet

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: Context) -> bool:
        """Whether a prompt is kept for the opening `key`."""
        return key in self._kept

    def covers(self, contexts: list[Context]) -> tuple[int, Past | None]:
        """How many tokens of the prompt kept for `contexts`' opening every one of them
        starts with (each keeping at least one token of its own to run), and that
        prompt's cache; (0, None) when none is kept."""
        key = opening(contexts[0])
        kept = None if key is None else self._kept.get(key)
        if key is None or kept is None:
            return 0, None
        shared = min(common_prefix(kept.ids, c) for c in contexts)
        self._kept.move_to_end(key)
        return min(shared, min(len(c) for c in contexts) - 1), kept.past

    def keep(self, context: Context, present: Past, row: int, again: bool = False) -> None:
        """`context`'s cache: row `row` of `present`, its last len(context) columns,
        if its opening came before or comes `again` (to other joiners of its run). It
        replaces the prompt kept for its opening; the least recently used go while the
        kept caches pass `max_bytes`."""
        key = opening(context)
        if key is None or self.max_bytes <= 0:
            return
        if not again and key not in self._kept and key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > SEEN_OPENINGS:
                self._seen.popitem(last=False)
            return
        self._seen.pop(key, None)
        old = self._kept.get(key)
        if old is not None and old.ids[: len(context)] == context:
            self._kept.move_to_end(key)  # it holds this prompt already
            return
        n = len(context)
        past = Past(
            tuple(np.ascontiguousarray(k[row : row + 1, :, -n:]) for k in present.keys),
            tuple(np.ascontiguousarray(v[row : row + 1, :, -n:]) for v in present.values),
        )
        nbytes = sum(a.nbytes for a in past.arrays)
        if nbytes > self.max_bytes:
            return
        if old is not None:
            self.kept_bytes -= old.nbytes
        self._kept[key] = Kept(context, past, nbytes)
        self._kept.move_to_end(key)
        self.kept_bytes += nbytes
        while self.kept_bytes > self.max_bytes:
            _, gone = self._kept.popitem(last=False)
            self.kept_bytes -= gone.nbytes
