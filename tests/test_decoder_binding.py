"""The decoder's IO-bound path on the CPU provider (the code path a GPU runs): its past
stays in OrtValues between steps and is rearranged by the row graph, and every logit
and greedy token equals the numpy path's, on the demo tinycode and on decoders that
Hugging Face Optimum's exporter wrote (GPT-2, Llama with GQA and RoPE, Qwen2, and a
float16 Llama)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lanes.binding import Placement
from lanes.errors import ModelError
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import ModelSpec
from lanes.tasks.decoder import Decoder, DevicePast, RowRef
from lanes.tasks.device_past import PastRows
from lanes.tasks.past import Past
from lanes.tasks.sampling import SamplingParams
from tests.conftest import ROOT
from tests.optimum_exports import FAMILIES, PROMPTS, export, float16

pytestmark = pytest.mark.slow

Array = np.ndarray[Any, Any]
EXPORTS = ROOT / ".lanes" / "optimum-exports"
CODE = [
    "def f(x",
    "import os\nimport sys\n\n\ndef main(argv):\n    for a",
    "x",
    "    return self._",
]
STEPS = 6
GREEDY = SamplingParams(0.0, 0, 1.0)


def model_of(name: str, demo_models: Path) -> ModelSpec:
    if name == "tinycode":
        folder = demo_models / "tinycode"
        return ModelSpec(path=folder / "model.onnx", tokenizer=folder / "tokenizer.json")
    family, _, dtype = name.partition("-")
    done = export(FAMILIES[family], EXPORTS)
    if dtype == "float16":
        done = float16(done)
    return ModelSpec(path=done.model, tokenizer=done.tokenizer)


@dataclass(frozen=True)
class Pair:
    """One session, two decoders over it: the numpy path and the bound one."""

    host: Decoder
    bound: Decoder
    prompts: list[str]


@pytest.fixture(scope="module", params=["tinycode", "gpt2", "llama", "qwen2", "llama-float16"])
def pair(request: pytest.FixtureRequest, demo_models: Path) -> Pair:
    model = model_of(request.param, demo_models)
    host = Decoder.load(model, Runtime(Settings(device="cpu", threads=1, io_binding="off")))
    assert not host.binds
    bound = Decoder(host.session, host.tokenizer, host.config, binds=True)
    return Pair(host, bound, CODE if request.param == "tinycode" else PROMPTS)


def left_padded(decoder: Decoder, prompts: Sequence[str]) -> tuple[Array, Array, Array]:
    """input_ids, attention_mask and position_ids of a prefill of `prompts` together."""
    rows = [decoder.encode(p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), decoder.config.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def same_past(device: DevicePast, host: Past, decoder: Decoder) -> bool:
    got = decoder.to_host(device)
    pairs = zip((*got.keys, *got.values), (*host.keys, *host.values), strict=True)
    return all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in pairs)


def test_bound_steps_equal_numpy_steps_batched(pair: Pair) -> None:
    """A left-padded prefill, then greedy decode steps: the same logits every step (to
    the bit), the same tokens, the same cache."""
    host, bound = pair.host, pair.bound
    ids, mask, positions = left_padded(host, pair.prompts)
    want = host.step(ids, mask, positions, host.empty_past(len(ids)))
    got = bound.step_bound(ids, mask, positions, bound.empty_device_past(len(ids)))
    assert isinstance(got.logits, np.ndarray) and got.logits.dtype == want.logits.dtype
    assert np.array_equal(got.logits, want.logits)
    assert same_past(got.present, want.present, host)
    for _ in range(STEPS):
        tokens = want.logits[:, -1].argmax(axis=-1)
        assert np.array_equal(got.logits[:, -1].argmax(axis=-1), tokens)
        mask = np.concatenate([mask, np.ones((len(ids), 1), dtype=np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        want = host.step(tokens[:, None], mask, positions, want.present)
        got = bound.step_bound(tokens[:, None], mask, positions, got.present)
        assert got.present.length == want.present.length == mask.shape[1]
        assert np.array_equal(got.logits, want.logits)
    assert same_past(got.present, want.present, host)


def test_bound_greedy_completions_equal_numpy_ones(pair: Pair) -> None:
    for prompt in pair.prompts:
        ids = pair.host.encode(prompt)
        want = pair.host.complete(ids, 12, GREEDY)
        got = pair.bound.complete(ids, 12, GREEDY)
        assert (got.tokens, got.text, got.finish_reason) == (
            want.tokens,
            want.text,
            want.finish_reason,
        )


def aligned(rows: Sequence[tuple[Past, int] | None], length: int, like: Past) -> Past:
    """The host's version of `assemble_past`: each row right-aligned to `length`."""

    def one(layer: int, keys: bool) -> Array:
        template = (like.keys if keys else like.values)[layer]
        _, heads, _, dim = template.shape
        out = np.zeros((len(rows), heads, length, dim), dtype=template.dtype)
        for i, row in enumerate(rows):
            if row is None:
                continue
            past, r = row
            source = (past.keys if keys else past.values)[layer][r]
            kept = source[:, -length:] if source.shape[1] >= length else source
            out[i, :, length - kept.shape[1] :] = kept
        return out

    layers = range(len(like.keys))
    return Past(tuple(one(i, True) for i in layers), tuple(one(i, False) for i in layers))


def aligned_mask(rows: Sequence[tuple[Array, int] | None], length: int) -> Array:
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, row in enumerate(rows):
        if row is not None:
            source, r = row
            kept = source[r, -length:]
            mask[i, length - len(kept) :] = kept
    return mask


def test_rows_rearranged_on_the_device_step_like_the_host(pair: Pair) -> None:
    """What a continuous batch does to its cache between steps (joiners from another
    prefill, holes, a trimmed front), done on the device by the row graph and on the
    host by numpy: the same past to the bit, and the same logits from the next step."""
    host, bound = pair.host, pair.bound
    first, second = pair.prompts[:2] + pair.prompts[3:], pair.prompts[2:3] + pair.prompts[:1]
    runs = []
    for prompts in (first, second):
        ids, mask, positions = left_padded(host, prompts)
        want = host.step(ids, mask, positions, host.empty_past(len(ids)))
        got = bound.step_bound(ids, mask, positions, bound.empty_device_past(len(ids)))
        runs.append((want, got, mask, positions))
    (a_host, a_dev, a_mask, a_pos), (b_host, b_dev, b_mask, b_pos) = runs
    length = max(a_mask.shape[1], b_mask.shape[1]) + 2  # both left-padded further
    # Output rows: a's 0, b's 1, a hole, a's 2, b's 0.
    refs: list[RowRef | None] = [RowRef(0, 0), RowRef(1, 1), None, RowRef(0, 2), RowRef(1, 0)]
    pasts = (a_host.present, b_host.present)
    masks, positions_of = (a_mask, b_mask), (a_pos, b_pos)
    logits_of = (a_host.logits, b_host.logits)
    on_host = [None if r is None else (pasts[r.source], r.row) for r in refs]
    past = aligned(on_host, length, a_host.present)
    mask = aligned_mask([None if r is None else (masks[r.source], r.row) for r in refs], length)
    device = bound.assemble_past([a_dev.present, b_dev.present], refs, length)
    assert device.batch == len(refs) and device.length == length
    assert same_past(device, past, host)

    def next_inputs(refs: Sequence[RowRef | None], mask: Array) -> tuple[Array, Array, Array]:
        ids = np.full((len(refs), 1), host.config.pad_token_id, dtype=np.int64)
        positions = np.zeros((len(refs), 1), dtype=np.int64)
        for i, r in enumerate(refs):
            if r is not None:
                ids[i, 0] = logits_of[r.source][r.row, -1].argmax()
                positions[i, 0] = positions_of[r.source][r.row, -1] + 1
        return ids, np.concatenate([mask, np.ones((len(refs), 1), dtype=np.int64)], 1), positions

    ids, step_mask, positions = next_inputs(refs, mask)
    want = host.step(ids, step_mask, positions, past)
    got = bound.step_bound(ids, step_mask, positions, device)
    assert np.array_equal(got.logits, want.logits)
    # Compaction: the hole goes, rows are reordered, the front every row pads goes.
    keep = [3, 0, 4, 1]
    drop = int(min(np.argmax(step_mask[r]) for r in keep))
    assert drop >= 2
    compacted = bound.take_past(got.present, keep, drop)
    host_compacted = Past(
        tuple(k[keep, :, drop:] for k in want.present.keys),
        tuple(v[keep, :, drop:] for v in want.present.values),
    )
    assert same_past(compacted, host_compacted, host)
    kept_refs = [refs[r] for r in keep]
    tokens = want.logits[keep, -1].argmax(axis=-1)[:, None]
    mask = np.concatenate([step_mask[keep, drop:], np.ones((len(keep), 1), np.int64)], 1)
    positions = positions[keep] + 1
    assert all(r is not None for r in kept_refs)
    want = host.step(tokens, mask, positions, host_compacted)
    got = bound.step_bound(tokens, mask, positions, compacted)
    assert np.array_equal(got.logits, want.logits)
    # Three sources fold two at a time; a source row may appear twice.
    three = [RowRef(2, 1), RowRef(0, 0), RowRef(1, 0), RowRef(2, 1)]
    sources = [a_dev.present, b_dev.present, got.present]
    host_sources = [a_host.present, b_host.present, want.present]
    width = max(s.length for s in sources) - 1  # the longest loses a position
    folded = bound.assemble_past(sources, three, width)
    expected = aligned([(host_sources[r.source], r.row) for r in three], width, a_host.present)
    assert same_past(folded, expected, host)


def test_bad_rows_and_a_graph_on_the_wrong_device_are_errors(pair: Pair) -> None:
    past = pair.bound.empty_device_past(2)
    with pytest.raises(ValueError, match="is not a row of the 1 sources"):
        pair.bound.assemble_past([past], [RowRef(0, 2)], 0)
    with pytest.raises(ValueError, match="no sources"):
        pair.bound.assemble_past([], [None], 0)
    # A row graph that does not land where the decoder runs is refused, not used.
    with pytest.raises(ModelError, match=r"not on cuda:0"):
        PastRows(["CPUExecutionProvider"], Placement("cuda"), 2, np.dtype(np.float32))


def test_the_runtime_setting_decides_whether_generate_binds(demo_models: Path) -> None:
    model = model_of("tinycode", demo_models)
    for setting, binds in (("on", True), ("off", False), ("auto", False)):
        runtime = Runtime(Settings(device="cpu", threads=1, io_binding=setting))
        assert Decoder.load(model, runtime).binds is binds
