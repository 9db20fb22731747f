"""Logprobs of generated tokens (lanes/generation/logprobs.py) and how the core makes
them: the log-softmax of the raw logits, only for the rows that ask, in the offline
batch loop on the demo tinycode decoder and in the pure scheduler."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lanes.generation.batch import generate_batch
from lanes.generation.logprobs import ROWS_PER_PASS, TokenLogprob, token_logprobs
from lanes.generation.prefill import prefill
from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Seq, StepOutputs, completion_tokens
from lanes.isolation import Failed
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import ModelSpec
from lanes.specfile import load_spec
from lanes.tasks import GenerateTask, load_task
from lanes.tasks.decoder import Completion, Decoder
from lanes.tasks.generate import GenerateRequest
from lanes.tasks.sampling import SamplingParams
from tests.model_reference import log_softmax, next_logprobs, prefill_logits
from tests.servers import write_spec

PROMPTS = ["def f(x", "import os\n", "class Config:\n    def __init__(self, path", "for i in "]


def test_token_logprobs_are_the_log_softmax_of_each_row_and_its_likeliest_in_order() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, size=(3, 50)).astype(np.float32)
    logits[1, 4] = logits[1, 9] = 40.0  # a tie at the top: the lower id first
    records = token_logprobs(logits, [3, 9, 0], [2, 3, 0])
    for row, record in zip(logits, records, strict=True):
        assert record.logprob == pytest.approx(log_softmax(row)[record.token], abs=1e-5)
    assert [len(r.top) for r in records] == [2, 3, 0]
    want = np.argsort(-log_softmax(logits[0]), kind="stable")[:2]
    assert [a.token for a in records[0].top] == want.tolist()
    assert [a.token for a in records[1].top][:2] == [4, 9]
    assert records[1].top[0].logprob >= records[1].top[1].logprob >= records[1].top[2].logprob
    # More alternatives than the vocabulary holds: the whole vocabulary, no more.
    (whole,) = token_logprobs(logits[:1, :5], [0], [20])
    assert sorted(a.token for a in whole.top) == [0, 1, 2, 3, 4]


def test_rows_past_one_pass_are_scored_as_in_one() -> None:
    """A long prompt's positions are scored ROWS_PER_PASS at a time (the temporary
    copies of one pass stay bounded), each row as it would be in one pass."""
    rows = ROWS_PER_PASS * 2 + 3
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 3, size=(rows, 40)).astype(np.float32)
    tokens = rng.integers(0, 40, size=rows).tolist()
    counts = [r % 4 for r in range(rows)]
    records = token_logprobs(logits, tokens, counts)
    assert len(records) == rows
    for r in (0, ROWS_PER_PASS - 1, ROWS_PER_PASS, rows - 1):
        (alone,) = token_logprobs(logits[r : r + 1], tokens[r : r + 1], counts[r : r + 1])
        assert records[r] == alone


def test_float16_logits_are_widened_before_the_softmax() -> None:
    logits = np.linspace(-30, 30, 200, dtype=np.float16)[None]
    (record,) = token_logprobs(logits, [0], [1])
    assert record.logprob == pytest.approx(log_softmax(logits[0])[0], abs=1e-3)
    assert np.isfinite(record.logprob)


@pytest.fixture(scope="module")
def task(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> GenerateTask:
    workloads = """\
  nightly:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: out/
    generation: {max_new_tokens: 10, temperature: 0}
"""
    spec = write_spec(tmp_path_factory.mktemp("logprobs"), demo_models, workloads)
    loaded = load_task("nightly", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    assert isinstance(loaded, GenerateTask)
    return loaded


def run(task: GenerateTask, requests: list[GenerateRequest], rows: int) -> list[Completion]:
    done = generate_batch(task.decoder, requests, rows, task.name, byte_text=task.byte_text)
    assert not any(isinstance(d, Failed) for d in done)
    return [d for d in done if isinstance(d, Completion)]


def made(done: Completion) -> list[int]:
    """The tokens its logprobs score: those it shows, then the one that ended it."""
    return [*done.tokens, *([] if done.stop_token is None else [done.stop_token])]


def test_rows_that_ask_for_logprobs_leave_the_others_tokens_as_they_were_alone(
    task: GenerateTask,
) -> None:
    plain = [task.prepare(p) for p in PROMPTS]
    alone = [run(task, [r], 1)[0] for r in plain]
    # Every other row asks, with different counts; rows fewer than prompts (refilled).
    asked = [dataclasses.replace(r, top_logprobs=[3, None][i % 2]) for i, r in enumerate(plain)]
    batched = run(task, asked, 3)
    for one, both, request in zip(alone, batched, asked, strict=True):
        assert both.tokens == one.tokens and both.text == one.text
        if request.top_logprobs is None:
            assert both.logprobs is None
            continue
        assert both.logprobs is not None
        assert [r.token for r in both.logprobs] == made(both)
        for record in both.logprobs:  # greedy: the token made is the likeliest
            assert len(record.top) == 3
            assert record.top[0].token == record.token
            assert record.top[0].logprob == record.logprob


def test_logprobs_are_the_raw_logits_log_softmax_whatever_the_temperature(
    task: GenerateTask,
) -> None:
    request = dataclasses.replace(task.prepare("def f(x"), top_logprobs=2)
    hot = dataclasses.replace(request, sampling=SamplingParams(1.7, 5, 0.9), seed=3)
    for asked in (request, hot):
        (done,) = run(task, [asked], 1)
        assert done.logprobs is not None and len(done.logprobs) == done.completion_tokens
        for j, record in enumerate(done.logprobs[:4]):
            want = next_logprobs(task.decoder, [*asked.prompt_ids, *done.tokens[:j]])
            assert record.logprob == pytest.approx(want[record.token], abs=1e-4)
            for alternative in record.top:
                assert alternative.logprob == pytest.approx(want[alternative.token], abs=1e-4)
            assert record.top[0].token == int(want.argmax())


def test_tokens_a_stop_string_cut_keep_their_logprobs(task: GenerateTask) -> None:
    request = task.prepare({"prompt": "def f(x", "max_tokens": 10})
    (free,) = run(task, [request], 1)
    stop = free.text[len(free.text) // 2 :][:2]
    stopped = dataclasses.replace(request, stop=(stop,), top_logprobs=0)
    (cut,) = run(task, [stopped], 1)
    assert cut.finish_reason == "stop" and len(cut.text) < len(free.text)
    assert cut.logprobs is not None
    assert [r.token for r in cut.logprobs] == cut.tokens != []
    assert all(r.top == () for r in cut.logprobs)


@pytest.mark.parametrize("first", [False, True])
def test_an_eos_that_ends_a_sequence_is_scored_as_it_is_counted(first: bool) -> None:
    """As vLLM scores every token it counts in completion_tokens: the eos that ended a
    sequence gets its logprob on its (textless) last event, whether a decode made it or
    the final chunk of a prompt prefilled in parts (its first token)."""
    vocab, eos = 8, 0
    scheduler = Scheduler(2, frozenset({eos}), lambda ids: "x" * len(ids), chunked=True)
    scheduler.max_prefill_tokens = 2
    seq = Seq(1, (5, 6, 7), 5, SamplingParams(temperature=0), top_logprobs=1)
    scheduler.add(seq)
    events = []
    chunks = 0
    while not seq.status.is_finished:
        logits = np.zeros((1, vocab), dtype=np.float32)
        logits[0, eos if seq.tokens or first else 3] = 5.0  # eos ends it there
        plan = scheduler.schedule()
        chunks += plan.chunk is not None
        outputs = StepOutputs(
            prefill=np.tile(logits, (len(plan.prefill), 1)) if plan.prefill else None,
            decode=np.tile(logits, (len(plan.decode), 1)) if plan.decode else None,
            chunk=logits if plan.chunk is not None and plan.chunk.final else None,
        )
        events += scheduler.update(plan, outputs)
    assert chunks == 2  # its first token came from the final chunk's logits
    want = float(log_softmax(np.array([5.0] + [0.0] * (vocab - 1)))[0])
    end = events[-1]
    assert end.tokens == () and end.finish == "stop" and end.stop_token == eos
    assert [r.token for r in end.logprobs] == [eos]
    assert end.logprobs[0].logprob == pytest.approx(want, abs=1e-5)
    assert end.logprobs[0].top[0].token == eos
    assert [r.token for r in seq.logprobs] == [*seq.tokens, eos] == ([eos] if first else [3, eos])
    assert len(seq.logprobs) == completion_tokens(len(seq.tokens), seq.stop_token)


# ---- prompt logprobs (an echo's) ------------------------------------------------------

LONG = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path"


def prompt_scores(decoder: Decoder, ids: tuple[int, ...]) -> list[float]:
    """Each prompt token after the first: its log-softmax at the position before, from
    one whole run of the prompt."""
    rows = log_softmax(prefill_logits(decoder, ids))
    return [float(rows[i - 1][ids[i]]) for i in range(1, len(ids))]


def test_prompts_that_ask_are_scored_and_the_others_make_what_they_made_alone(
    task: GenerateTask,
) -> None:
    plain = [task.prepare(p) for p in [*PROMPTS, LONG]]
    alone = [run(task, [r], 1)[0] for r in plain]
    asked = [dataclasses.replace(r, prompt_logprobs=[2, None][i % 2]) for i, r in enumerate(plain)]
    batched = run(task, asked, 3)  # prompts of different lengths share prefills, padded
    for one, both, request in zip(alone, batched, asked, strict=True):
        assert both.tokens == one.tokens and both.text == one.text
        if request.prompt_logprobs is None:
            assert both.prompt_logprobs is None
            continue
        assert both.prompt_logprobs is not None
        assert [r.token for r in both.prompt_logprobs] == list(request.prompt_ids[1:])
        want = prompt_scores(task.decoder, request.prompt_ids)
        assert [r.logprob for r in both.prompt_logprobs] == pytest.approx(want, abs=1e-4)
        assert all(len(r.top) == 2 for r in both.prompt_logprobs)


def test_a_prompt_prefilled_in_chunks_scores_as_a_whole_one(task: GenerateTask) -> None:
    request = dataclasses.replace(task.prepare(LONG), prompt_logprobs=3)
    assert len(request.prompt_ids) > 2 * 8  # three chunks at least
    (whole,) = run(task, [request], 1)
    done = generate_batch(task.decoder, [request], 1, task.name, max_prefill_tokens=8, chunked=True)
    (chunked,) = [d for d in done if isinstance(d, Completion)]
    assert whole.prompt_logprobs is not None and chunked.prompt_logprobs is not None
    assert chunked.tokens == whole.tokens
    assert len(chunked.prompt_logprobs) == len(request.prompt_ids) - 1
    for a, b in zip(chunked.prompt_logprobs, whole.prompt_logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [x.token for x in a.top] == [x.token for x in b.top]


def test_a_prompt_asked_for_no_token_is_scored_and_makes_none(task: GenerateTask) -> None:
    requests = [
        dataclasses.replace(task.prepare(p), prompt_logprobs=0, max_new_tokens=0) for p in PROMPTS
    ]
    for request, done in zip(requests, run(task, requests, 2), strict=True):
        assert done.tokens == [] and done.text == "" and done.finish_reason == "length"
        assert done.prompt_logprobs is not None
        assert len(done.prompt_logprobs) == len(request.prompt_ids) - 1


def test_a_chunked_prompt_asked_for_no_token_finishes_after_its_last_chunk() -> None:
    scheduler = Scheduler(2, frozenset({0}), lambda ids: "x" * len(ids), chunked=True)
    scheduler.max_prefill_tokens = 2
    seq = Seq(1, (5, 6, 7), 0, SamplingParams(temperature=0), prompt_logprobs=0)
    seq.prompt_scores = [TokenLogprob(6, -1.0), TokenLogprob(7, -2.0)]  # as its chunks scored
    scheduler.add(seq)
    events = []
    while not seq.status.is_finished:
        plan = scheduler.schedule()
        assert plan.chunk is not None and not plan.decode  # it never decodes
        chunk = np.zeros((1, 8), dtype=np.float32) if plan.chunk.final else None
        events += scheduler.update(plan, StepOutputs(chunk=chunk))
    (event,) = events
    assert event.tokens == () and event.finish == "length" and event.first
    assert event.prompt_logprobs == tuple(seq.prompt_scores)


@pytest.mark.parametrize("layout", ["model.onnx", "model-slots.onnx"])
def test_one_left_padded_prefill_scores_each_prompt_on_its_own_positions(
    demo_models: Path, layout: str
) -> None:
    """Prompts of three lengths in one run, on the Optimum graph and on the slot
    layout's (which moves each row's columns and back): each as its run alone."""
    folder = demo_models / "tinycode"
    model = ModelSpec.model_validate(
        {"path": folder / layout, "tokenizer": folder / "tokenizer.json"}
    )
    decoder = Decoder.load(model, Runtime(Settings(device="cpu")))
    prompts = ["for", "import os\nimport sys\nclass A:", "def f(x"]
    seqs = [Seq(i, tuple(decoder.encode(p)), 3, prompt_logprobs=1) for i, p in enumerate(prompts)]
    plain = Seq(9, tuple(decoder.encode("x = ")), 3)
    prefill(decoder, [*seqs, plain])
    assert plain.prompt_scores == []
    for seq in seqs:
        want = prompt_scores(decoder, seq.prompt_ids)
        assert [r.logprob for r in seq.prompt_scores] == pytest.approx(want, abs=1e-4)
        assert all(len(r.top) == 1 for r in seq.prompt_scores)
    # A preempted sequence's recompute runs its prompt again: it is not scored again.
    scored = [seq.prompt_scores for seq in seqs]
    prefill(decoder, seqs, recompute=True)
    assert all(seq.prompt_scores is s for seq, s in zip(seqs, scored, strict=True))
