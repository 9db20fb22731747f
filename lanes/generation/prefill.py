"""Prefill: the joiners' prompts in one left-padded decoder run, and what to do when
that run fails.

`prefill_apart` runs the joiners whole and, if that raises, in halves until the
prompts that fail alone are found (lanes/isolation.py): every other joiner gets its
logits and a cache (`Join`) to enter the batch's with, exactly as from the whole run.

Joiners with the same context (a request's `n` choices, a batch's repeated prompts)
share one row of the run: the model's output for a row depends on that row alone,
so each gets a copy of the one row's cache and logits. Joiners whose contexts share
a long prefix (SHARED_PREFIX_MIN tokens or more: a few-shot instruction, a system
prompt) run it once, the rest of each on its cache (`_run_on_prefix`), in a run
apart from joiners of other openings; and prompts' caches stay (`PrefixCache`,
lanes/generation/prefixes.py) for joiners of later steps that start with a long part
of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lanes.costmodel import Fit
from lanes.generation.logprobs import token_logprobs
from lanes.generation.prefixes import (
    SHARED_PREFIX_MIN,
    Context,
    PrefixCache,
    common_prefix,
    opening,
)
from lanes.generation.seq import Chunk, Seq
from lanes.isolation import isolate
from lanes.tasks.decoder import Decoder
from lanes.tasks.past import Past, StepOutput

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class Join:
    """Prefilled sequences' cache, waiting to enter the batch's (lanes/generation/kvcache.py)."""

    ids: list[int]
    past: Past
    mask: Array
    apart: bool = False  # rows that may sit steps out (Seq.sits_out): grouped apart
    # What its prefill ran (a prefill cost model's measure): rows and padded tokens.
    # Joiners of one context share a row; a shared prefix runs once (prefill.py).
    rows_run: int = 0
    tokens_run: int = 0


@dataclass(frozen=True)
class Prefilled:
    """A prefill's next-token logits [len(seqs), vocab] (a failed row's are zeros;
    None when every row failed), the caches of the joiners it ran, the joiners it
    failed on alone (by id), and what the whole run raised (None: it succeeded)."""

    logits: Array | None
    joins: list[Join]
    failed: dict[int, Exception] = field(default_factory=dict)
    error: Exception | None = None

    @property
    def rows_run(self) -> int:
        """The rows of the runs whose caches joined (what a prefill cost model sees)."""
        return sum(j.rows_run for j in self.joins)

    @property
    def tokens_run(self) -> int:
        """Their padded tokens."""
        return sum(j.tokens_run for j in self.joins)


def prefill(
    decoder: Decoder,
    seqs: Sequence[Seq],
    recompute: bool = False,
    prefixes: PrefixCache | None = None,
) -> tuple[Array, list[Join]]:
    """The joiners' distinct prompts, left-padded to the longest of their run, and
    their next-token logits in `seqs`' order. Prompts that share a long opening, with
    each other or with a prompt `prefixes` keeps, run apart from the others: the
    shared part once and each one's rest on its cache (`_run_on_prefix`); every run
    gives its own `Join`. With `recompute`, what a preempted sequence's cache held
    (`Seq.cached_ids`)."""
    contexts = [s.cached_ids if recompute else s.prompt_ids for s in seqs]
    distinct: dict[Context, int] = {}
    row_of = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]
    unique = list(distinct)
    scored = not recompute and any(s.prompt_logprobs is not None for s in seqs)
    # A slot-layout graph runs prompts on a past row by row: no gain there. Scoring a
    # prompt wants every position's logits, which the prefix's own run does not keep.
    if scored or decoder.slots:
        out, mask = _run_left_padded(decoder, unique)
        if scored:  # a recompute's prompt was scored by its first prefill
            _score_prompts(seqs, out.logits, row_of)
        runs = [(list(range(len(unique))), Ran(out.logits[:, -1], out.present, mask))]
    else:
        parts = _parts(unique, prefixes)
        # Every part's kept head is taken before any part keeps a prompt (which may
        # evict another part's): each runs on the cache the scheduler's budget saw.
        heads = [_kept_head(prefixes, [unique[u] for u in part]) for part in parts]
        runs = [
            (part, _run_part(decoder, unique, part, head, prefixes))
            for part, head in zip(parts, heads, strict=True)
        ]
    apart = all(s.sits_out for s in seqs)
    logits = np.empty((len(seqs), runs[0][1].logits.shape[-1]), dtype=runs[0][1].logits.dtype)
    joins = []
    for part, ran in runs:
        local = {u: r for r, u in enumerate(part)}
        index = [j for j, u in enumerate(row_of) if u in local]
        rows = [local[row_of[j]] for j in index]
        logits[index] = ran.logits[rows]
        joins.append(ran.join([seqs[j].id for j in index], rows, apart))
    return logits, joins


@dataclass(frozen=True)
class Ran:
    """One prefill run of distinct contexts: their last logits [rows, vocab], the cache
    and mask (padding's keys and values zeroed), and what it ran (rows, tokens)."""

    logits: Array
    present: Past
    mask: Array
    rows_run: int = 0  # 0: one row per context, and the mask's size in tokens
    tokens_run: int = 0

    def __post_init__(self) -> None:
        if not self.mask.all():
            # Padding's keys/values are never attended (mask 0), but a model may have
            # left NaN there (a query row with every key masked): 0 * NaN is NaN.
            pad = self.mask == 0
            for kv in self.present.arrays:
                kv[np.broadcast_to(pad[:, None, :], kv.shape[:3])] = 0

    def join(self, ids: list[int], rows: list[int], apart: bool) -> Join:
        """The `Join` of sequences `ids`, each on row `rows[j]` of the run: its own copy
        of that row where several share one (rows are written apart)."""
        present, mask = self.present, self.mask
        if rows != list(range(len(mask))):
            take = np.asarray(rows)
            mask = mask[take]
            present = Past(
                tuple(k[take] for k in present.keys), tuple(v[take] for v in present.values)
            )
        rows_run = self.rows_run or len(self.mask)
        return Join(ids, present, mask, apart, rows_run, self.tokens_run or self.mask.size)


def _parts(contexts: list[Context], prefixes: PrefixCache | None) -> list[list[int]]:
    """Indices of `contexts` by prefill run: those of one opening apart, where they
    share it (two or more, or one with a prompt kept for it); the rest in one run."""
    by_opening: dict[Context, list[int]] = {}
    rest: list[int] = []
    for i, context in enumerate(contexts):
        key = opening(context)
        if key is None:
            rest.append(i)
        else:
            by_opening.setdefault(key, []).append(i)
    parts = []
    for key, members in by_opening.items():
        if len(members) > 1 or (prefixes is not None and key in prefixes):
            parts.append(members)
        else:
            rest.extend(members)
    if rest:
        parts.append(sorted(rest))
    return parts


def _kept_head(prefixes: PrefixCache | None, contexts: list[Context]) -> tuple[int, Past | None]:
    return (0, None) if prefixes is None else prefixes.covers(contexts)


def _run_part(
    decoder: Decoder,
    unique: list[Context],
    part: list[int],
    head: tuple[int, Past | None],
    prefixes: PrefixCache | None,
) -> Ran:
    """One run of the contexts `part` of `unique`: on the part of a kept prompt they all
    start with (`head`: its length and cache, PrefixCache.covers), or on their own
    shared prefix (run once, first), or whole, left-padded. Where they have an
    opening, the first of each goes to `prefixes` for later joiners (the others of
    one opening share as much with them)."""
    contexts = [unique[u] for u in part]
    kept, kept_past = head
    common = _common(contexts) if len(contexts) > 1 else 0
    if kept_past is not None and kept >= SHARED_PREFIX_MIN and common < kept + SHARED_PREFIX_MIN:
        on = Past(
            tuple(k[:, :, :kept] for k in kept_past.keys),
            tuple(v[:, :, :kept] for v in kept_past.values),
        )
        logits, present, mask, tokens = _run_on_prefix(decoder, contexts, kept, on)
        ran = Ran(logits, present, mask, len(contexts), tokens)
    elif common >= SHARED_PREFIX_MIN:
        on = _run_head(decoder, contexts[0][:common])
        logits, present, mask, tokens = _run_on_prefix(decoder, contexts, common, on)
        ran = Ran(logits, present, mask, 1 + len(contexts), tokens + common)
    else:
        out, mask = _run_left_padded(decoder, contexts)
        ran = Ran(out.logits[:, -1], out.present, mask)
    if prefixes is not None:
        firsts: dict[Context | None, int] = {}
        for r, context in enumerate(contexts):
            firsts.setdefault(opening(context), r)
        again = common >= SHARED_PREFIX_MIN  # its opening came to several joiners
        for r in firsts.values():
            prefixes.keep(contexts[r], ran.present, r, again)
    return ran


def _run_left_padded(decoder: Decoder, contexts: list[tuple[int, ...]]) -> tuple[StepOutput, Array]:
    """`contexts` in one run from an empty cache, left-padded to the longest; its
    output and attention mask."""
    width = max(len(c) for c in contexts)
    ids = np.full((len(contexts), width), decoder.config.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(contexts), width), dtype=np.int64)
    positions = np.zeros((len(contexts), width), dtype=np.int64)
    for j, context in enumerate(contexts):
        n = len(context)
        ids[j, width - n :] = context
        mask[j, width - n :] = 1
        positions[j, width - n :] = np.arange(n)
    return decoder.step(ids, mask, positions, decoder.empty_past(len(contexts))), mask


def _common(contexts: list[Context]) -> int:
    """The length of the prefix every context shares."""
    return common_prefix(min(contexts), max(contexts))  # they differ first where any two do


def _run_head(decoder: Decoder, prefix: tuple[int, ...]) -> Past:
    """The cache of `prefix` alone, in one row."""
    ids = np.asarray([prefix], dtype=np.int64)
    positions = np.arange(len(prefix))[None, :]
    return decoder.step(ids, np.ones_like(ids), positions, decoder.empty_past(1)).present


def _run_on_prefix(
    decoder: Decoder, contexts: list[tuple[int, ...]], shared: int, head: Past
) -> tuple[Array, Past, Array, int]:
    """Contexts that start with the `shared` tokens whose cache is `head` (one row):
    every row's last W tokens (W: the longest context less the prefix) in one run on
    that cache, each row's earlier tokens (all in the prefix) right-aligned in it. So
    each row's mask is zeros then ones, as from one left-padded run, and the work is
    rows x W instead of rows x the longest. The last logits [rows, vocab], the cache
    [rows, ..., shared + W, ...], its mask, and the tokens run."""
    rows, width = len(contexts), max(len(c) for c in contexts) - shared
    past = head.zeros(rows, shared)
    ids = np.full((rows, width), decoder.config.pad_token_id, dtype=np.int64)
    mask = np.zeros((rows, shared + width), dtype=np.int64)
    positions = np.zeros((rows, width), dtype=np.int64)
    for r, context in enumerate(contexts):
        held = max(len(context) - width, 0)  # in the prefix: len(context) <= shared + width
        fed = len(context) - held
        for ours, theirs in zip(past.arrays, head.arrays, strict=True):
            ours[r, :, shared - held :] = theirs[0, :, :held]
        ids[r, width - fed :] = context[held:]
        mask[r, shared - held : shared] = 1
        mask[r, shared + width - fed :] = 1
        positions[r, width - fed :] = np.arange(held, len(context))
    out = decoder.step(ids, mask, positions, past)
    return out.logits[:, -1], out.present, mask, rows * width


def _score_prompts(seqs: Sequence[Seq], logits: Array, row_of: Sequence[int]) -> None:
    """The joiners that asked (Seq.prompt_logprobs) get their prompt's tokens after
    the first scored, each on the logits of the position before it, from the run's
    left-padded [rows, width, vocab] `logits` (a row's real positions are its last
    ones; joiner j's row is `row_of[j]`), in one pass. One look at each joiner per
    prefill; none per step."""
    asked = [(j, s) for j, s in enumerate(seqs) if s.prompt_logprobs is not None]
    if not asked:
        return
    width = logits.shape[1]
    rows = [logits[row_of[j], width - len(s.prompt_ids) : width - 1] for j, s in asked]
    tokens = [t for _, s in asked for t in s.prompt_ids[1:]]
    counts = [s.prompt_logprobs or 0 for _, s in asked for _ in s.prompt_ids[1:]]
    if not tokens:  # one-token prompts: nothing before their only token
        return
    records = token_logprobs(np.concatenate(rows), tokens, counts)
    at = 0
    for _, s in asked:
        n = len(s.prompt_ids) - 1
        s.prompt_scores = records[at : at + n]  # whole: a failed run scored no one
        at += n


def _score_chunk(seq: Seq, start: int, logits: Array) -> None:
    """A part of a long prompt from `start`, run: its [1, part, vocab] `logits` score
    the tokens after each of its positions (the next part's first one included). A
    part already scored (the prompt begun again) is not scored twice."""
    if seq.prompt_logprobs is None or len(seq.prompt_scores) != start:
        return
    tokens = seq.prompt_ids[start + 1 : start + 1 + logits.shape[1]]
    if tokens:
        counts = [seq.prompt_logprobs] * len(tokens)
        seq.prompt_scores += token_logprobs(logits[0, : len(tokens)], tokens, counts)


def prefill_groups(seqs: Sequence[Seq], fit: Fit | None) -> list[list[Seq]]:
    """Joiners in prefill runs, shortest prompts first (equal ones together): a prompt
    joins the run before it unless the padding it adds to that run's rows costs more,
    by `fit` (the workload's prefill cost model), than a run of its own. Where a run's
    fixed cost is small (a CPU), short prompts get their first tokens without waiting
    for a long one's prefill; where it dominates (a GPU), they share one run. One run
    while there is no fit."""
    if fit is None or len(seqs) < 2:
        return [list(seqs)] if seqs else []
    ordered = sorted(seqs, key=lambda s: (len(s.prompt_ids), s.prompt_ids))
    groups = [[ordered[0]]]
    for seq in ordered[1:]:
        group = groups[-1]
        rows = len({s.prompt_ids for s in group})  # equal prompts share a row
        padding = rows * (len(seq.prompt_ids) - len(group[-1].prompt_ids))
        if fit.per_token_s * padding > fit.fixed_s:
            groups.append([seq])
        else:
            group.append(seq)
    return groups


def prefill_apart(
    decoder: Decoder,
    seqs: Sequence[Seq],
    recompute: bool = False,
    prefixes: PrefixCache | None = None,
) -> Prefilled:
    """`prefill`; if it fails, in halves until the prompts that fail alone are found."""
    isolated = isolate(lambda part: prefill(decoder, part, recompute, prefixes), seqs)
    if isolated.whole:
        logits, joins = isolated.ran[0].result
        return Prefilled(logits, joins)
    found: Array | None = None
    joins = []
    for part in isolated.ran:
        logits, its_joins = part.result
        if found is None:
            found = np.zeros((len(seqs), logits.shape[-1]), dtype=logits.dtype)
        found[part.start : part.stop] = logits
        joins += its_joins
    failed = {seqs[f.index].id: f.error for f in isolated.failed}
    return Prefilled(found, joins, failed, isolated.error)


def prefill_chunk(decoder: Decoder, chunk: Chunk, past: Past | None) -> tuple[Array, Past]:
    """One part of a long prompt, on `past` (its earlier parts' cache; None for the
    first part): the next-token logits [1, vocab] after it, and the cache with it."""
    seq = chunk.seq
    ids = np.asarray([seq.prompt_ids[chunk.start : chunk.stop]], dtype=np.int64)
    mask = np.ones((1, chunk.stop), dtype=np.int64)
    positions = np.arange(chunk.start, chunk.stop, dtype=np.int64).reshape(1, -1)
    before = decoder.empty_past(1) if past is None else past
    if before.length != chunk.start:
        raise ValueError(
            f"sequence {seq.id}: a chunk from {chunk.start} on a cache of {before.length}"
        )
    out = decoder.step(ids, mask, positions, before)
    _score_chunk(seq, chunk.start, out.logits)
    return out.logits[:, -1], out.present


@dataclass
class Chunked:
    """The cache of the prompt being prefilled in parts, kept between its steps (one
    prompt at a time: a first part starts afresh, so an aborted one's cache goes then)."""

    past: Past | None = None

    def run(self, decoder: Decoder, chunk: Chunk) -> Prefilled:
        """One part: for the final one its logits [1, vocab] and the cache to enter the
        batch with; for an earlier one neither. A run that raises is the sequence's
        failure alone (in `failed`)."""
        try:
            logits, present = prefill_chunk(decoder, chunk, self.past if chunk.start else None)
        except Exception as error:
            self.past = None
            return Prefilled(None, [], {chunk.seq.id: error}, error)
        if not chunk.final:
            self.past = present
            return Prefilled(None, [])
        self.past = None
        mask = np.ones((1, chunk.stop), dtype=np.int64)
        join = Join([chunk.seq.id], present, mask, chunk.seq.sits_out, 1, chunk.stop - chunk.start)
        return Prefilled(logits, [join])
