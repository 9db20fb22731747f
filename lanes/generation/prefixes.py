"""Prompts' caches kept for later prompts that start the same way.

Requests that share an opening (a system prompt, a few-shot instruction, the turns
of a conversation so far) come one by one to an endpoint, and an offline job's rows
free up a few at a time, so the prompts that share one rarely meet in one prefill.
`PrefixCache` keeps the caches of prompts prefilled before, by opening (their first
SHARED_PREFIX_MIN tokens: prompts sharing fewer are not worth a run of their own,
lanes/generation/prefill.py), one row each, a copy, the least recently used going
first once they pass `max_bytes`. A joiner then runs only what follows the longest
start it shares with a kept prompt of its opening.

Several prompts of one opening stay side by side: conversations that share a system
prompt each find their own last turn, though other users' turns came between. A
prompt that holds a kept one whole (a conversation's next turn) replaces it, and an
opening keeps at most PROMPTS_PER_OPENING (its least recently used go), which bounds
a lookup. vLLM keys its cache by blocks of tokens, so diverging prompts share the
blocks of their common start in memory too; here each kept prompt is a row of its
own, since a batch's cache is rows of a batched array, not blocks.

A copy costs about what writing the prompt's cache did, so a prompt is kept only
once its opening has come before (or comes to several joiners of one prefill): a job
of prompts that share nothing copies none.
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
# Prompts kept per opening: a lookup compares a joiner with each (a few microseconds
# apiece), and one template's prompts all share the template alike.
PROMPTS_PER_OPENING = 32

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
    """A kept prompt's cache (one row)."""

    past: Past
    nbytes: int


class PrefixCache:
    """Prompts' caches by opening, within `max_bytes` (0: none)."""

    def __init__(self, max_bytes: int = PREFIX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._kept: OrderedDict[Context, Kept] = OrderedDict()  # by prompt, least recent first
        self._openings: dict[Context, list[Context]] = {}  # its prompts, least recent first
        self._seen: OrderedDict[Context, None] = OrderedDict()  # openings not kept yet

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: Context) -> bool:
        """Whether a prompt is kept for the opening `key`."""
        return key in self._openings

    def shares(self, low: Context, high: Context) -> tuple[int, Context | None]:
        """What every prompt from `low` to `high` (the least and the greatest, by their
        tokens, of prompts of one opening) starts with of the kept prompt of their
        opening they share most with (the most recent of equals), and that prompt;
        (0, None) when none is kept. Copies and moves nothing: the scheduler's budget
        asks it too (lanes/generation/prefill_tokens.py).

        Of prompts in order, the two ends share least with any other: so what all
        share with a kept prompt is what `low` and `high` share with it."""
        key = opening(low)
        prompts = None if key is None else self._openings.get(key)
        if not prompts:
            return 0, None
        best = prompts[-1]
        shared = min(common_prefix(best, low), common_prefix(best, high))
        for ids in reversed(prompts[:-1]):
            # Sharing more than `shared` needs the token at `shared` alike: one lookup
            # turns away nearly every other prompt, unrelated conversations included.
            if shared < len(ids) and shared < len(low) and ids[shared] == low[shared]:
                common = min(common_prefix(ids, low), common_prefix(ids, high))
                if common > shared:
                    best, shared = ids, common
        return shared, best

    def covers(self, contexts: list[Context]) -> tuple[int, Past | None]:
        """How many tokens of a prompt kept for `contexts`' opening every one of them
        starts with (each keeping at least one token of its own to run), and that
        prompt's cache (`shares`); (0, None) when none is kept."""
        shared, best = self.shares(min(contexts), max(contexts))
        if best is None:
            return 0, None
        self._touch(best)
        return min(shared, min(len(c) for c in contexts) - 1), self._kept[best].past

    def keep(self, context: Context, present: Past, row: int, again: bool = False) -> None:
        """`context`'s cache: row `row` of `present`, its last len(context) columns,
        if its opening came before or comes `again` (to other joiners of its run). It
        replaces the kept prompts it holds whole; the least recently used go while its
        opening keeps more than PROMPTS_PER_OPENING or the caches pass `max_bytes`."""
        key = opening(context)
        if key is None or self.max_bytes <= 0:
            return
        prompts = self._openings.get(key)
        if not again and prompts is None and key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > SEEN_OPENINGS:
                self._seen.popitem(last=False)
            return
        self._seen.pop(key, None)
        n = len(context)
        for ids in prompts or ():
            # The last token first: it turns away nearly every other prompt at once.
            if len(ids) >= n and ids[n - 1] == context[-1] and ids[:n] == context:
                self._touch(ids)  # it holds this prompt already
                return
        past = Past(
            tuple(np.ascontiguousarray(k[row : row + 1, :, -n:]) for k in present.keys),
            tuple(np.ascontiguousarray(v[row : row + 1, :, -n:]) for v in present.values),
        )
        nbytes = sum(a.nbytes for a in past.arrays)
        if nbytes > self.max_bytes:
            return
        for ids in [p for p in prompts or () if len(p) < n and context[: len(p)] == p]:
            self._drop(ids)  # an earlier turn of this conversation
        self._kept[context] = Kept(past, nbytes)
        self._openings.setdefault(key, []).append(context)
        self.kept_bytes += nbytes
        while len(self._openings[key]) > PROMPTS_PER_OPENING:
            self._drop(self._openings[key][0])
        while self.kept_bytes > self.max_bytes:
            self._drop(next(iter(self._kept)))

    def _touch(self, ids: Context) -> None:
        self._kept.move_to_end(ids)
        prompts = self._openings[ids[:SHARED_PREFIX_MIN]]
        prompts.remove(ids)
        prompts.append(ids)

    def _drop(self, ids: Context) -> None:
        gone = self._kept.pop(ids)
        self.kept_bytes -= gone.nbytes
        key = ids[:SHARED_PREFIX_MIN]
        self._openings[key].remove(ids)
        if not self._openings[key]:
            del self._openings[key]
