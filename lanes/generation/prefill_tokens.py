"""What one prefill of a step's joiners will run, in padded tokens, known before it
runs: the scheduler's token budget charges this (lanes/generation/scheduler.py).

It follows `prefill` (lanes/generation/prefill.py) run for run. Joiners of one prompt
share a row. Prompts of one opening that share it (two or more, or one with a prompt
kept for it) run apart from the rest: each row runs only what follows the part of
the kept prompt they all start with, or their own common prefix runs once and each
row its rest; the other prompts run whole in one left-padded run. A prefill that
scores a prompt (prompt_logprobs) runs every prompt whole, in one run. How much of a
prompt is kept the prefix cache answers without a copy or a run
(`PrefixCache.shares`), so the charge is exact, as long as the prefill runs on the
cache as it was when the joiners were admitted (it does: the same thread plans then
runs, and `prefill` takes every part's kept head before it keeps any new prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lanes.generation.prefixes import (
    SHARED_PREFIX_MIN,
    Context,
    PrefixCache,
    common_prefix,
    opening,
)
from lanes.generation.seq import Seq


@dataclass(frozen=True)
class Opening:
    """The distinct prompts of one opening among a prefill's joiners, summed up: how
    many, their shortest and longest, and the least and greatest (every one shares
    with the others, and with a kept prompt, what these two share with it)."""

    members: int
    shortest: int
    longest: int
    low: Context
    high: Context

    @classmethod
    def of(cls, context: Context) -> Opening:
        return cls(1, len(context), len(context), context, context)

    def plus(self, context: Context) -> Opening:
        """With one more prompt of its opening."""
        return Opening(
            self.members + 1,
            min(self.shortest, len(context)),
            max(self.longest, len(context)),
            min(self.low, context),
            max(self.high, context),
        )

    def tokens(self, kept: int | None) -> int:
        """What its run costs, as `_run_part` runs it, `kept` tokens of every prompt
        being a kept prompt's (None: none is kept for the opening)."""
        common = common_prefix(self.low, self.high) if self.members > 1 else 0
        kept = 0 if kept is None else min(kept, self.shortest - 1)
        if kept >= SHARED_PREFIX_MIN and common < kept + SHARED_PREFIX_MIN:
            return self.members * (self.longest - kept)
        if common >= SHARED_PREFIX_MIN:
            return common + self.members * (self.longest - common)
        return self.members * self.longest


@dataclass(frozen=True)
class PrefillTokens:
    """The padded tokens the prefill of the joiners admitted so far will run; `plus`
    gives them with one more. Without `prefixes` (a decoder that shares no prefix:
    its cache in slots; or a plain scheduler) every prompt is charged whole."""

    prefixes: PrefixCache | None = None
    distinct: frozenset[Context] = frozenset()
    longest: int = 0
    resumed: int = 0
    scored: bool = False
    openings: tuple[tuple[Context, Opening], ...] = ()  # by opening, in order of arrival
    plain: tuple[int, int] = (0, 0)  # prompts too short to share: how many, the longest

    def plus(self, seq: Seq) -> PrefillTokens:
        if seq.tokens:
            return replace(self, resumed=self.resumed + 1)
        context = seq.prompt_ids
        if context in self.distinct:
            return self  # it shares the row of its prompt's first joiner
        grown = replace(
            self,
            distinct=self.distinct | {context},
            longest=max(self.longest, len(context)),
            scored=self.scored or seq.prompt_logprobs is not None,
        )
        if self.prefixes is None:
            return grown
        key = opening(context)
        if key is None:
            count, longest = self.plain
            return replace(grown, plain=(count + 1, max(longest, len(context))))
        openings = dict(self.openings)
        found = openings.get(key)
        openings[key] = Opening.of(context) if found is None else found.plus(context)
        return replace(grown, openings=tuple(openings.items()))

    @property
    def tokens(self) -> int:
        # A resumed sequence is charged a row of the longest prompt, as it always was:
        # its recompute (where its cache was not kept) is a run of its own, unforeseen.
        flat = (len(self.distinct) + self.resumed) * self.longest
        if self.prefixes is None or self.scored:
            return flat
        rest, widest = self.plain
        total = 0
        for key, group in self.openings:
            kept = self.prefixes.shares(group.low, group.high)[0] if key in self.prefixes else None
            if group.members > 1 or kept is not None:  # apart, as prefill.py's `_parts`
                total += group.tokens(kept)
            else:  # alone of its opening, none kept: it runs whole with the rest
                rest, widest = rest + 1, max(widest, group.longest)
        return total + rest * widest + self.resumed * self.longest
