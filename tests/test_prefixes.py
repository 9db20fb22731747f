"""PrefixCache: which prompts' caches stay, and how much of one a prompt may use."""

from __future__ import annotations

import numpy as np

from lanes.generation.prefixes import (
    PROMPTS_PER_OPENING,
    SHARED_PREFIX_MIN,
    PrefixCache,
    common_prefix,
    opening,
)
from lanes.tasks.past import Past

LAYERS, HEADS, DIM = 2, 2, 4


def present(contexts: list[tuple[int, ...]]) -> Past:
    """A left-padded batch's cache whose every real column holds its token's id."""
    width = max(len(c) for c in contexts)
    keys = np.zeros((len(contexts), HEADS, width, DIM), dtype=np.float32)
    for r, context in enumerate(contexts):
        keys[r, :, width - len(context) :] = np.asarray(context, dtype=np.float32)[:, None]
    return Past((keys,) * LAYERS, (keys,) * LAYERS)


def prompt(
    opening_id: int, rest: tuple[int, ...], length: int = SHARED_PREFIX_MIN
) -> tuple[int, ...]:
    return (opening_id,) * length + rest


def row_bytes(context: tuple[int, ...]) -> int:
    return 2 * LAYERS * HEADS * len(context) * DIM * 4


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix((5,) * 100 + (1,), (5,) * 100 + (2,)) == 100
    assert common_prefix((), (1,)) == 0
    assert opening(tuple(range(SHARED_PREFIX_MIN))) is None  # nothing of its own would run


def test_a_prompt_uses_the_kept_one_of_its_opening_up_to_where_they_differ() -> None:
    cache = PrefixCache()
    kept = prompt(1, (7, 8, 9))
    cache.keep(kept, present([prompt(2, ()), kept]), 1, again=True)
    shared, past = cache.covers([prompt(1, (7, 8, 5, 6))])
    assert shared == SHARED_PREFIX_MIN + 2 and past is not None
    assert past.keys[0][0, 0, :, 0].tolist() == list(kept)  # its row, its real columns
    # Each joiner keeps at least its own last token to run.
    assert cache.covers([kept])[0] == len(kept) - 1
    assert cache.covers([prompt(3, (7,))]) == (0, None)


def test_the_newest_prompt_of_an_opening_replaces_the_one_before() -> None:
    cache = PrefixCache()
    turn = prompt(1, (7,))
    cache.keep(turn, present([turn]), 0, again=True)
    longer = (*turn, 8, 9)  # a conversation's next turn holds its last
    cache.keep(longer, present([longer]), 0)
    assert len(cache) == 1 and cache.kept_bytes == row_bytes(longer)
    assert cache.covers([(*longer, 10)])[0] == len(longer)
    cache.keep(turn, present([turn]), 0)  # held by the longer one already
    assert cache.covers([(*longer, 10)])[0] == len(longer)


def test_the_least_recently_used_openings_go_past_the_byte_bound() -> None:
    a, b, c = (prompt(i, (9,)) for i in (1, 2, 3))
    cache = PrefixCache(max_bytes=2 * row_bytes(a))
    for p in (a, b):
        cache.keep(p, present([p]), 0, again=True)
    assert cache.covers([(*a, 1)])[0] > 0  # a is used: b is now the oldest
    cache.keep(c, present([c]), 0, again=True)
    assert len(cache) == 2 and cache.kept_bytes == 2 * row_bytes(a)
    assert cache.covers([(*b, 1)]) == (0, None)
    assert cache.covers([(*a, 1)])[0] > 0 and cache.covers([(*c, 1)])[0] > 0
    none = PrefixCache(max_bytes=0)
    none.keep(a, present([a]), 0, again=True)
    assert len(none) == 0


def test_an_opening_is_kept_from_its_second_comer_on() -> None:
    """A prompt whose opening nobody else has is not worth its copy: a job whose
    prompts share nothing copies none."""
    cache = PrefixCache()
    first, second = prompt(1, (5,)), prompt(1, (6,))
    cache.keep(first, present([first]), 0)
    assert len(cache) == 0 and cache.covers([(*first, 7)]) == (0, None)
    cache.keep(second, present([second]), 0)
    assert cache.covers([(*second, 7)])[0] == len(second)


def test_conversations_of_one_opening_each_find_their_own_last_turn() -> None:
    """Two users with one system prompt take turns: each next turn runs on its own
    last turn, not on the other user's (one prompt per opening shared only the system
    prompt)."""
    cache = PrefixCache()
    a, b = prompt(1, (5, 6)), prompt(1, (7, 8))
    for turn in (a, b):
        cache.keep(turn, present([turn]), 0, again=True)
    assert len(cache) == 2
    assert cache.covers([(*a, 9)])[0] == len(a)
    assert cache.covers([(*b, 9)])[0] == len(b)
    # A part of joiners takes the kept prompt that all of them share most with.
    assert cache.covers([(*a, 9), (*a, 3)])[0] == len(a)
    assert cache.covers([(*a, 9), (*b, 3)])[0] == SHARED_PREFIX_MIN
    # A next turn replaces the turn it holds; the other conversation's stays.
    a2 = (*a, 9, 10)
    cache.keep(a2, present([a2]), 0)
    assert len(cache) == 2 and cache.kept_bytes == row_bytes(a2) + row_bytes(b)
    assert cache.covers([(*a2, 1)])[0] == len(a2)
    assert cache.covers([(*b, 1)])[0] == len(b)


def test_an_opening_keeps_at_most_its_share_of_prompts() -> None:
    cache = PrefixCache()
    turns = [prompt(1, (i,)) for i in range(PROMPTS_PER_OPENING + 1)]
    for turn in turns:
        cache.keep(turn, present([turn]), 0, again=True)
    assert len(cache) == PROMPTS_PER_OPENING
    assert cache.covers([(*turns[0], 5)])[0] == SHARED_PREFIX_MIN  # the oldest went
    assert cache.covers([(*turns[-1], 5)])[0] == len(turns[-1])
    assert cache.kept_bytes == PROMPTS_PER_OPENING * row_bytes(turns[0])


def test_a_shorter_prompt_of_a_conversation_keeps_the_longer_ones() -> None:
    cache = PrefixCache()
    long, short = prompt(1, (5, 6, 7, 8)), prompt(1, (9,))
    for p in (long, short):
        cache.keep(p, present([p]), 0, again=True)
    assert len(cache) == 2
    assert cache.covers([(*long, 1)])[0] == len(long)
