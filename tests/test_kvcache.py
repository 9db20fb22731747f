"""The batch's KV cache on a real decoder that fails on positions past its table
(tests/failing_models.py): a decode run that fails leaves the other rows' cache and
logits exactly as a cache that never held the failing row. What the cache reports it
holds (`nbytes`, `peak_nbytes`: lanes_kv_cache_bytes) is its arrays' bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from lanes.generation.kvcache import BatchCache
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import ModelSpec
from lanes.tasks.decoder import Decoder
from tests.failing_models import POSITIONS, positional_decoder

A, B, C = 1, 2, 3  # token ids of "a", "b", "c"
ONE_GROUP = 1e9  # padding never costs more than a run: every row in one group


@dataclass
class Row:
    """What the cache needs of a sequence: its id, last token and that token's position."""

    id: int
    tokens: list[int]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def position(self) -> int:
        return len(self.tokens) - 1


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    model, tokenizer = positional_decoder(tmp_path_factory.mktemp("kvcache") / "dec")
    spec = ModelSpec(path=model, tokenizer=tokenizer)
    return Decoder.load(spec, Runtime(Settings(device="cpu")))


def prefill(decoder: Decoder, cache: BatchCache, row: Row) -> None:
    """`row`'s tokens but its last into `cache`, prefilled on its own."""
    prompt = np.asarray([row.tokens[:-1]], dtype=np.int64)
    out = decoder.step(
        prompt, np.ones_like(prompt), np.arange(prompt.shape[1])[None], decoder.empty_past(1)
    )
    cache.place([row.id], out.present, np.ones_like(prompt))


def filled(decoder: Decoder, rows: list[Row]) -> BatchCache:
    """A cache holding each row's tokens but its last (each prefilled on its own), so
    the next decode feeds the last."""
    cache = BatchCache(decoder, ONE_GROUP)
    for row in rows:
        prefill(decoder, cache, row)
    assert len(cache.groups) == 1
    return cache


def cached(cache: BatchCache, seq_id: int) -> tuple[np.ndarray, ...]:
    """One sequence's keys and values over its unpadded positions."""
    (group,) = cache.groups
    r = group.slots.index(seq_id)
    start = group.start[r]
    return (*(k[r, :, start:] for k in group.keys), *(v[r, :, start:] for v in group.values))


def test_a_row_that_fails_alone_leaves_the_others_as_if_it_never_was(decoder: Decoder) -> None:
    good = [Row(1, [A, B]), Row(3, [C, A, B, C])]
    bad = Row(2, [A] * POSITIONS + [B])  # fed at position POSITIONS: past the table
    with_bad = filled(decoder, [good[0], bad, good[1]])
    without = filled(decoder, good)

    decoded = with_bad.decode([good[0], bad, good[1]])
    assert list(decoded.failed) == [bad.id]
    assert "out of data bounds" in str(decoded.failed[bad.id])
    reference = without.decode(good)
    assert decoded.logits is not None and reference.logits is not None
    assert np.array_equal(decoded.logits[[0, 2]], reference.logits)
    for row in good:
        for ours, theirs in zip(cached(with_bad, row.id), cached(without, row.id), strict=True):
            assert np.array_equal(ours, theirs)
    assert with_bad.groups[0].live == 2, "the failed row is a hole now"

    # The next step goes on without it, and still matches.
    for row in good:
        row.tokens.append(int(np.argmax(reference.logits[good.index(row)])))
    again, clean = with_bad.decode(good), without.decode(good)
    assert not again.failed and again.logits is not None and clean.logits is not None
    assert np.array_equal(again.logits, clean.logits)


def test_when_every_row_fails_each_is_reported(decoder: Decoder) -> None:
    rows = [Row(1, [A] * POSITIONS + [B]), Row(2, [B] * POSITIONS + [C])]
    cache = filled(decoder, rows)
    decoded = cache.decode(rows)
    assert decoded.logits is None and sorted(decoded.failed) == [1, 2]
    assert cache.groups[0].live == 0


def test_rows_that_may_sit_out_are_grouped_apart_and_a_step_may_leave_them_out(
    decoder: Decoder,
) -> None:
    rows = [Row(1, [A, B, C]), Row(2, [C, B, A]), Row(3, [B, C, A])]
    cache = BatchCache(decoder, ONE_GROUP)  # one group, were they of one lane
    for row, apart in zip(rows, (False, True, True), strict=True):
        prompt = np.asarray([row.tokens[:-1]], dtype=np.int64)
        out = decoder.step(
            prompt, np.ones_like(prompt), np.arange(prompt.shape[1])[None], decoder.empty_past(1)
        )
        cache.place([row.id], out.present, np.ones_like(prompt), apart)
    groups = {g.apart: g.slots for g in cache.groups}
    assert groups == {False: [1], True: [2, 3]}, "rows that may sit out in a group apart"
    parked = next(g for g in cache.groups if g.apart)
    keys = parked.keys

    interactive = cache.decode(rows[:1])
    assert parked.keys is keys, "the offline group sat the step out, its cache untouched"
    both = cache.decode(rows[1:])
    alone = filled(decoder, rows).decode(rows)
    assert interactive.logits is not None and both.logits is not None
    assert alone.logits is not None
    assert np.allclose(interactive.logits, alone.logits[:1], atol=1e-5)
    assert np.allclose(both.logits, alone.logits[1:], atol=1e-5)
    with pytest.raises(ValueError, match="a group holds 2 sequences, the step has 1"):
        cache.decode(rows[1:2])


def arrays_bytes(cache: BatchCache) -> int:
    return sum(a.nbytes for g in cache.groups for a in (*g.keys, *g.values))


def test_nbytes_is_what_the_groups_arrays_hold_padding_and_holes_included(
    decoder: Decoder,
) -> None:
    """What lanes_kv_cache_bytes shows: more than the rows' real positions."""
    rows = [Row(1, [A, B]), Row(2, [B, C, A]), Row(3, [C, A, B, C, A, B])]
    cache = BatchCache(decoder, 2)  # 1 pads to 2 (1 position); 3 is too far: alone
    for row in rows:
        prefill(decoder, cache, row)
    assert [g.slots for g in cache.groups] == [[1, 2], [3]]
    per_position = decoder.position_bytes
    for _ in range(2):
        before = cache.nbytes
        decoded = cache.decode(rows)
        assert decoded.logits is not None
        for row, logits in zip(rows, decoded.logits, strict=True):
            row.tokens.append(int(np.argmax(logits)))
        assert cache.nbytes == arrays_bytes(cache)
        assert cache.nbytes == before + 3 * per_position, "one more position per row"
    real = sum(len(row.tokens) - 1 for row in rows)
    assert cache.nbytes == (real + 1) * per_position, "row 1's padding"

    cache.release({1, 3})  # row 2 leaves: a hole, half the group's rows, until compacted
    assert cache.nbytes == arrays_bytes(cache) == (real + 1) * per_position
    cache.decode([rows[0], rows[2]])
    assert cache.nbytes == arrays_bytes(cache) == (real + 4) * per_position
    cache.compact()
    real = len(rows[0].tokens) + len(rows[2].tokens)  # each fed one more token
    assert cache.nbytes == arrays_bytes(cache) == real * per_position


def test_peak_nbytes_counts_a_decode_holding_a_groups_past_and_present_together(
    decoder: Decoder,
) -> None:
    rows = [Row(1, [A, B, C]), Row(2, [C, A, B])]
    cache = filled(decoder, rows)
    past = cache.nbytes
    cache.decode(rows)
    assert cache.peak_nbytes == past + cache.nbytes, "the old past beside the new present"
    assert cache.nbytes == past + 2 * decoder.position_bytes
