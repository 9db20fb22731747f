"""The slot cache (lanes/generation/slots.py) on the demo's slot-layout tinycode
(lanes/demo/slots.py: its weights, its cache kept in place by GroupQueryAttention):
one run decodes rows of any lengths as each alone; a row the model fails on leaves
the others as if it had never been there; rows kept apart sit a step out untouched;
and the graph reads as the Optimum one does through `Decoder.step`. The same holds for
the graph written as onnxruntime-genai's model builder writes decoders (lengths from
a right-padded attention_mask, genai_config.json): its batches decode as the Optimum
graph alone. The step loop's users on this graph are tests/test_engine.py and
tests/test_engine_lanes.py (their `slots` cases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lanes.demo.slots import export_slots
from lanes.demo.tinycode import load_model
from lanes.errors import ModelError
from lanes.generation.batch import generate_batch
from lanes.generation.slots import FIRST_ROWS, SlotCache
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import ModelSpec
from lanes.tasks.decoder import Completion, Decoder
from lanes.tasks.generate import GenerateRequest
from lanes.tasks.past import Past
from lanes.tasks.sampling import SamplingParams
from tests.test_kvcache import Row


def load(folder: Path, file: str) -> Decoder:
    spec = ModelSpec(path=folder / file, tokenizer=folder / "tokenizer.json")
    return Decoder.load(spec, Runtime(Settings(device="cpu")))


@pytest.fixture(scope="module")
def slots(demo_models: Path) -> Decoder:
    return load(demo_models / "tinycode", "model-slots.onnx")


@pytest.fixture(scope="module")
def concat(demo_models: Path) -> Decoder:
    return load(demo_models / "tinycode", "model.onnx")


@pytest.fixture(scope="module")
def masked(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """tinycode's slot graph as onnxruntime-genai's builder writes a decoder: the rows'
    lengths from attention_mask, genai_config.json instead of config.json."""
    folder, out = demo_models / "tinycode", tmp_path_factory.mktemp("genai")
    export_slots(load_model(folder), out / "model.onnx", lengths_from="mask")
    shutil.copy(folder / "tokenizer.json", out / "tokenizer.json")
    ours = json.loads((folder / "config.json").read_text())
    decoder = {
        "num_hidden_layers": ours["num_layers"],
        "num_key_value_heads": ours["num_heads"],
        "head_size": ours["head_dim"],
    }
    model = {
        "bos_token_id": ours["bos_token_id"],
        "eos_token_id": ours["eos_token_id"],
        "context_length": ours["max_position"],
        "vocab_size": ours["vocab_size"],
        "decoder": decoder,
    }
    (out / "genai_config.json").write_text(json.dumps({"model": model}))
    return load(out, "model.onnx")


def prefilled(decoder: Decoder, row: Row) -> tuple[Past, np.ndarray]:
    prompt = np.asarray([row.tokens[:-1]], dtype=np.int64)
    out = decoder.step(
        prompt, np.ones_like(prompt), np.arange(prompt.shape[1])[None], decoder.empty_past(1)
    )
    return out.present, np.ones_like(prompt)


def filled(decoder: Decoder, rows: list[Row], apart: bool = False) -> SlotCache:
    """A cache holding each row's tokens but its last, so the next decode feeds it."""
    cache = SlotCache(decoder, 0)
    for row in rows:
        past, mask = prefilled(decoder, row)
        cache.place([row.id], past, mask, apart)
    return cache


def rows_of(lengths: list[int]) -> list[Row]:
    rng = np.random.default_rng(0)
    return [Row(i + 1, [int(t) for t in rng.integers(1, 1000, n)]) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("graph", ["slots", "masked"])
def test_one_run_decodes_rows_of_any_length_as_each_alone(
    graph: str, concat: Decoder, request: pytest.FixtureRequest
) -> None:
    """More rows than the buffers start with, of lengths 2 to 300: one run's logits are
    each row's alone, and the Optimum graph's (the same weights). On both ways a slot
    graph takes the rows' lengths."""
    slots: Decoder = request.getfixturevalue(graph)
    rows = rows_of([2, 300, 17, 5, 120, 9, 64, 33, 3, 250])
    assert len(rows) > FIRST_ROWS
    cache = filled(slots, rows)
    decoded = cache.decode(rows)
    assert not decoded.failed and decoded.logits is not None
    assert len(decoded.runs) == 1 and decoded.runs[0].rows == len(rows)
    held = [len(row.tokens) - 1 for row in rows]
    assert decoded.length == -(-sum(held) // len(held)), "the rows' mean positions (its cost)"
    for i, row in enumerate(rows):
        for decoder in (slots, concat):
            ids = np.asarray([row.tokens], dtype=np.int64)
            out = decoder.step(
                ids, np.ones_like(ids), np.arange(ids.shape[1])[None], decoder.empty_past(1)
            )
            assert np.allclose(decoded.logits[i], out.logits[0, -1], atol=1e-4)


def test_after_a_row_leaves_the_rest_decode_as_each_alone_into_the_same_logits_array(
    slots: Decoder,
) -> None:
    """The first row leaves after a step: the last one takes its place, so the step's
    rows are in another order than the buffers'. Each row's logits are still its own
    alone, and the run of fewer rows writes them into the array the set's runs share
    (one step's logits at a time, whatever its rows: not one array per row count)."""
    rows = rows_of([3, 40, 11, 7])
    cache = filled(slots, rows)
    first = cache.decode(rows)
    assert first.logits is not None
    for i, row in enumerate(rows):
        row.tokens.append(int(np.argmax(first.logits[i])))
    cache.release({row.id for row in rows[1:]})
    left = rows[1:]
    decoded = cache.decode(left)
    assert not decoded.failed and decoded.logits is not None
    for i, row in enumerate(left):
        ids = np.asarray([row.tokens], dtype=np.int64)
        alone = slots.step(
            ids, np.ones_like(ids), np.arange(ids.shape[1])[None], slots.empty_past(1)
        )
        assert np.allclose(decoded.logits[i], alone.logits[0, -1], atol=1e-4)
    (held,) = [s for s in cache.sets if s.ids]
    assert held.ids != [row.id for row in left], "the buffers' order is not the step's"
    assert held.logits is not None
    runs = held._runs
    assert set(runs) == {4, 3}
    assert all(np.shares_memory(run._logits, held.logits) for run in runs.values())


def test_a_left_padded_prefill_reads_as_the_optimum_graphs(slots: Decoder, concat: Decoder) -> None:
    """`Decoder.step` on the slot graph takes the concat layout: left padding, a past."""
    prompts = [[5, 9, 11, 40], [7], [3, 3, 8]]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), dtype=np.int64)
    mask = np.zeros((3, width), dtype=np.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = slots.step(ids, mask, positions, slots.empty_past(3))
    theirs = concat.step(ids, mask, positions, concat.empty_past(3))
    assert np.allclose(ours.logits[:, -1], theirs.logits[:, -1], atol=1e-4)
    real = np.broadcast_to(mask[:, None, :, None] == 1, ours.present.keys[0].shape)
    for a, b in zip(ours.present.keys, theirs.present.keys, strict=True):
        assert np.allclose(a[real], b[real], atol=1e-4)
    # And one more token on that past.
    step_mask = np.concatenate([mask, np.ones((3, 1), dtype=np.int64)], axis=1)
    token = np.asarray([[1], [2], [3]])
    at = positions[:, -1:] + 1
    assert np.allclose(
        slots.step(token, step_mask, at, ours.present).logits,
        concat.step(token, step_mask, at, theirs.present).logits,
        atol=1e-4,
    )
    with pytest.raises(ValueError, match="zeros then ones"):
        slots.step(ids[:1], np.asarray([[1, 0, 1, 1]]), positions[:1], slots.empty_past(1))


def test_a_row_that_fails_alone_leaves_the_others_as_if_it_never_was(slots: Decoder) -> None:
    good = rows_of([4, 30])
    vocab = slots.config.vocab_size
    assert vocab is not None
    bad = Row(9, [5, 6, vocab])  # its next token is past the embedding table
    with_bad = filled(slots, [good[0], bad, good[1]])
    without = filled(slots, good)

    decoded = with_bad.decode([good[0], bad, good[1]])
    assert list(decoded.failed) == [bad.id] and decoded.error is not None
    reference = without.decode(good)
    assert decoded.logits is not None and reference.logits is not None
    assert np.array_equal(decoded.logits[[0, 2]], reference.logits)
    assert not decoded.logits[1].any()
    assert with_bad.rows == 2 and with_bad.take(bad.id) is None, "the failed row left"
    for row in good:
        ours, theirs = with_bad.take(row.id), without.take(row.id)
        assert ours is not None and theirs is not None
        mine, reference_past = ours.past, theirs.past
        for a, b in zip(
            mine.keys + mine.values, reference_past.keys + reference_past.values, strict=True
        ):
            assert np.array_equal(a, b)

    # The next step goes on without it, and still matches.
    for i, row in enumerate(good):
        row.tokens.append(int(np.argmax(reference.logits[i])))
    again, clean = with_bad.decode(good), without.decode(good)
    assert not again.failed and again.logits is not None and clean.logits is not None
    assert np.array_equal(again.logits, clean.logits)


def test_rows_kept_apart_sit_a_step_out_and_leavers_take_nothing_with_them(
    slots: Decoder,
) -> None:
    interactive, offline = rows_of([3, 12, 7]), rows_of([20, 4])
    for row in offline:
        row.id += 100
    cache = filled(slots, interactive)
    for row in offline:
        past, mask = prefilled(slots, row)
        cache.place([row.id], past, mask, apart=True)
    parked = cache.take(offline[0].id)

    assert cache.decode(interactive).logits is not None
    still = cache.take(offline[0].id)
    assert parked is not None and still is not None
    assert np.array_equal(parked.past.keys[0], still.past.keys[0]), "it sat the step out"

    # The first interactive row leaves; the last one moves into its place.
    cache.release({r.id for r in interactive[1:] + offline})
    rest = interactive[1:] + offline
    for row in interactive[1:]:
        row.tokens.append(1)
    decoded = cache.decode(rest)
    assert decoded.logits is not None and len(decoded.runs) == 2, "one run per set of slots"
    # As a cache that never held the leaver: the others' tokens, prefilled afresh.
    fresh = filled(slots, interactive[1:])
    for row in offline:
        past, mask = prefilled(slots, row)
        fresh.place([row.id], past, mask, apart=True)
    expected = fresh.decode(rest)
    assert expected.logits is not None
    assert np.allclose(decoded.logits, expected.logits, atol=1e-4)


def test_nbytes_is_what_the_buffers_take_every_rows_whole_context(slots: Decoder) -> None:
    """What lanes_kv_cache_bytes shows for the slot layout: the buffers, however few
    positions their rows hold; a growth holds the old buffers beside the new ones."""
    context = slots.config.max_position
    assert context is not None
    row_bytes = context * slots.position_bytes
    rows = rows_of([3, 40] + [5] * FIRST_ROWS)
    cache = filled(slots, rows[:2])
    buffers = [b for s in cache.sets for b in s.buffers]
    assert cache.nbytes == sum(b.nbytes for b in buffers) == FIRST_ROWS * row_bytes
    assert cache.peak_nbytes == cache.nbytes
    cache.decode(rows[:2])
    assert cache.nbytes == cache.peak_nbytes == FIRST_ROWS * row_bytes, "written in place"

    for row in rows[2:]:  # one more row than the buffers hold: they double
        past, mask = prefilled(slots, row)
        cache.place([row.id], past, mask)
    assert cache.nbytes == 2 * FIRST_ROWS * row_bytes
    assert cache.peak_nbytes == 3 * FIRST_ROWS * row_bytes, "the old beside the new"


def test_a_slot_graph_without_a_stated_context_is_refused(
    demo_models: Path, tmp_path: Path
) -> None:
    folder = demo_models / "tinycode"
    for name in ("model-slots.onnx", "tokenizer.json"):
        shutil.copy(folder / name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    del config["max_position"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="as long as the context"):
        load(tmp_path, "model-slots.onnx")


def test_a_graph_that_reads_lengths_from_its_mask_batches_as_the_optimum_graph_alone(
    masked: Decoder, concat: Decoder, demo_models: Path
) -> None:
    """onnxruntime-genai's layout: GroupQueryAttention fed a right-padded mask. Read as
    concat, a left-padded batch would attend over its pads; read as slots (context and
    ids from genai_config.json), the offline loop's batches, refilled as rows finish,
    give each prompt the Optimum graph's own greedy tokens."""
    c = masked.config
    assert c.kv_layout == "slots" and c.max_position == concat.config.max_position
    assert (c.bos_token_id, c.eos_token_ids) == (
        concat.config.bos_token_id,
        concat.config.eos_token_ids,
    )
    greedy = SamplingParams(temperature=0)
    texts = [
        "def f(x",
        "import os\nimport sys\n\n\ndef main(argv):\n    for a in",
        "x = 1",
        "class A:",
    ]
    texts += ["    return self.", "for i in range("]
    requests = [GenerateRequest(t, tuple(masked.encode(t)), 12, greedy, (), None) for t in texts]
    got = generate_batch(masked, requests, 4, "genai")
    for request, completion in zip(requests, got, strict=True):
        assert isinstance(completion, Completion)
        alone = concat.complete(request.prompt_ids, 12, greedy)
        assert (completion.tokens, completion.text) == (alone.tokens, alone.text), request.prompt
    assert sum(len(c.tokens) for c in got if isinstance(c, Completion)) > 3 * len(texts)
