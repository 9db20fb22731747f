"""The eos or stop token that ends a text is counted and scored alike everywhere, as
vLLM does (its output token ids hold it): `usage.completion_tokens`, one logprob entry
per token counted (the last the finishing token's, its text not in the answer's),
and the `lanes_generated_tokens` metric. A real uvicorn on 127.0.0.1 serving the test
decoder of tests/flows_fixtures.py (greedy "a" completes to "b c d", then eos), the
official `openai` client, streamed and whole; and the offline in-process batch loop
with an OpenAI batch line answered on the same model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from lanes import load_spec
from lanes.flows.records import Line
from lanes.flows.requests import Rejection, to_request
from lanes.flows.shape import RecordShape
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
from lanes.tasks import GenerateTask, load_task
from tests.flows_fixtures import DECODER_WORDS, write_spec
from tests.gates import wait_until
from tests.model_reference import log_softmax
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

GENERATE = {"mode": "interactive", "task": "generate", "model": "dec"}
WORKLOADS: dict[str, dict[str, Any]] = {
    "gen": {**GENERATE, "generation": {"max_new_tokens": 8, "temperature": 0}},
    # Its own series in /metrics: no other test's tokens in it.
    "counted": {**GENERATE, "generation": {"max_new_tokens": 8, "temperature": 0}},
    "nightly": {
        "mode": "offline",
        "task": "generate",
        "model": "dec",
        "input": "in/",
        "output": "out/",
        "generation": {"max_new_tokens": 8, "temperature": 0},
    },
}
EOS = DECODER_WORDS.index("<eos>")
# The test decoder's logits after each token: 5.0 for the next one, -5.0 for the rest.
LOGPROB = float(log_softmax(np.array([5.0] + [-5.0] * (len(DECODER_WORDS) - 1)))[0])


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("stop-token"), WORKLOADS)


@pytest.fixture(scope="module")
def server(spec: Path) -> Iterator[ServerThread]:
    with ServerThread(spec) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def task(spec: Path) -> GenerateTask:
    loaded = load_task("nightly", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    assert isinstance(loaded, GenerateTask)
    return loaded


def completion_entries(
    client: OpenAI, stream: bool, **asked: Any
) -> tuple[list[str], list[float], str, int]:
    """A completion's logprob tokens and logprobs, text and completion_tokens."""
    body: dict[str, Any] = {"model": "gen", "prompt": "a", "logprobs": 1, **asked}
    if not stream:
        answer = client.completions.create(**body)
        (choice,) = answer.choices
        assert choice.logprobs is not None and answer.usage is not None
        assert choice.logprobs.tokens is not None and choice.logprobs.token_logprobs is not None
        tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        return tokens, logprobs, choice.text, answer.usage.completion_tokens
    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    tokens, logprobs, text = [], [], ""
    for chunk in chunks:
        for part in chunk.choices:
            text += part.text
            if part.logprobs is not None:
                tokens += part.logprobs.tokens or []
                logprobs += part.logprobs.token_logprobs or []
    usage = chunks[-1].usage
    assert usage is not None
    return tokens, logprobs, text, usage.completion_tokens


def test_a_text_ended_by_eos_has_a_logprob_entry_per_counted_token_the_eos_last(
    client: OpenAI, task: GenerateTask
) -> None:
    eos_text = task.spelling.text(EOS)
    for stream in (False, True):
        tokens, logprobs, text, made = completion_entries(client, stream)
        assert text == "b c d"
        assert made == 4 == len(tokens) == len(logprobs), stream
        assert tokens == ["b", "c", "d", eos_text]
        assert logprobs == pytest.approx([LOGPROB] * 4, abs=1e-4)
    # A stop token ends it as eos does, and is scored so; a stop string's tokens are
    # shown tokens, scored already (the text is cut, the tokens stay).
    for stream in (False, True):
        tokens, _, text, made = completion_entries(
            client, stream, extra_body={"stop_token_ids": [DECODER_WORDS.index("c")]}
        )
        assert (text, tokens, made) == ("b", ["b", "c"], 2), stream
        tokens, _, text, made = completion_entries(client, stream, stop=["c"])
        assert (text.strip(), tokens, made) == ("b", ["b", "c"], 2), stream


def test_a_chat_ended_by_eos_has_a_logprob_entry_per_counted_token_the_eos_last(
    client: OpenAI, task: GenerateTask
) -> None:
    asked: dict[str, Any] = {
        "model": "gen",
        "messages": [{"role": "user", "content": "a"}],
        "logprobs": True,
        "top_logprobs": 1,
    }
    whole = client.chat.completions.create(**asked)
    (choice,) = whole.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert whole.usage is not None
    content = choice.logprobs.content
    assert choice.message.content == "b c d" and choice.finish_reason == "stop"
    assert len(content) == whole.usage.completion_tokens == 4
    assert content[-1].token == task.spelling.text(EOS)
    assert content[-1].logprob == pytest.approx(LOGPROB, abs=1e-4)
    streamed = list(
        client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
    )
    gathered = [
        entry
        for chunk in streamed
        for part in chunk.choices
        if part.logprobs is not None and part.logprobs.content is not None
        for entry in part.logprobs.content
    ]
    assert [e.model_dump() for e in gathered] == [e.model_dump() for e in content]
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 4


def test_offline_lines_score_the_eos_as_the_endpoint_does(
    client: OpenAI, task: GenerateTask, spec: Path
) -> None:
    (done,) = task.run([dataclasses.replace(task.prepare("a"), top_logprobs=1)])
    assert done.stop_token == EOS and done.logprobs is not None
    assert [r.token for r in done.logprobs] == [*done.tokens, EOS]
    assert len(done.logprobs) == done.completion_tokens == 4
    workload = load_spec(spec, Settings()).workload("nightly")
    assert isinstance(workload, OfflineWorkload)
    body = {"model": "nightly", "prompt": "a", "logprobs": 1}
    line = {"custom_id": "c-1", "method": "POST", "url": "/v1/completions", "body": body}
    shape = RecordShape.of("nightly", workload, None)
    request = to_request(Line(1, line), shape, "in/a.jsonl", Settings().max_inputs_per_request)
    assert not isinstance(request, Rejection)
    prepared = request.prepare(task)
    answered = request.answer(prepared, task.run(prepared), task)["response"]["body"]
    online = client.completions.create(model="gen", prompt="a", logprobs=1)
    assert online.choices[0].logprobs is not None
    assert answered["choices"][0]["logprobs"] == online.choices[0].logprobs.model_dump()
    assert answered["usage"]["completion_tokens"] == 4


def generated(server: ServerThread, workload: str) -> float:
    """`workload`'s lanes_generated_tokens_total (0 before its first sample)."""
    series = f'lanes_generated_tokens_total{{workload="{workload}"}} '
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(series):
            return float(line[len(series) :])
    return 0.0


def test_the_generated_tokens_metric_counts_what_usage_counts(
    server: ServerThread, client: OpenAI
) -> None:
    before = generated(server, "counted")
    answer = client.completions.create(model="counted", prompt="a")
    assert answer.usage is not None and answer.choices[0].finish_reason == "stop"
    want = before + answer.usage.completion_tokens
    # The metric is reported beside the answer: wait for it to reach usage's count.
    wait_until(
        lambda: generated(server, "counted") >= want, "the step's tokens reported", interval=0.05
    )
    assert generated(server, "counted") == want
