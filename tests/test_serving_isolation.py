"""One bad input never fails its neighbours, over real HTTP: a real uvicorn on
127.0.0.1 serving tiny real models that fail at run time on one kind of input
(tests/failing_models.py). Eight requests forced into one batch (held at a gate),
one of them bad: the seven others answer 200 with what they answer alone, the bad
one a 500 `model_error` that names its own failure and says not to retry it (no
Retry-After; `x-should-retry: false`, which the openai client obeys)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import yaml

import lanes
from tests.failing_models import (
    BAD_WORD,
    LOOKUP_ROWS,
    POSITIONS,
    lookup_model,
    positional_decoder,
    short_embed_model,
)
from tests.gates import HELD, Gate, eventually
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

# Every run of the decoder passes this gate (open unless a test holds it): it holds
# the first request's prefill while the others queue, and counts the runs.
DECODER = Gate()

GOOD_PROMPTS = ["a", "b", "c", "a b", "c a", "b b c", "a a"]
BAD_PROMPTS = {
    # A prompt longer than the position table fails in its prefill ...
    "prefill": " ".join(["a"] * (POSITIONS + 1)),
    # ... one a row short of it at its second decode step, mid-sequence.
    "decode": " ".join(["a"] * (POSITIONS - 1)),
}
GOOD_TEXTS = ["w1 w2", "w3", "w4 w5 w6", "w7 w8", "w9", "w10 w11 w12 w13", "w14"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("isolation")
    decoder, words = positional_decoder(folder / "dec")
    encoder, tokenizer = short_embed_model(folder / "enc")
    lookup = lookup_model(folder / "lookup")
    held = {"handler": "tests.gates:held", "batching": {"max_batch_size": 16, "max_wait_ms": 0}}
    spec = {
        "version": 1,
        "models": {
            "dec": {"path": str(decoder), "tokenizer": str(words)},
            "enc": {"path": str(encoder), "tokenizer": str(tokenizer)},
            "lookup": {"path": str(lookup)},
        },
        "workloads": {
            "gen": {
                "mode": "interactive",
                "task": "generate",
                "model": "dec",
                "batching": {"max_batch_size": 8},
                "generation": {"max_new_tokens": 16, "temperature": 0},
            },
            "vectors": {"mode": "interactive", "task": "embed", "model": "enc", **held},
            "table": {"mode": "interactive", "task": "infer", "model": "lookup", **held},
        },
    }
    path = folder / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with ServerThread(path, gates={"dec": DECODER}) as running:
        yield running


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when the series has no sample yet)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_not_to_retry(answer: httpx.Response, *words: str) -> None:
    """A 500 model_error, in OpenAI's shape, that names its failure and asks no retry."""
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "model_error")
    assert "run on its own" in error["message"] and "INVALID_ARGUMENT" in error["message"]
    for word in words:
        assert word in error["message"]
    assert "retry-after" not in answer.headers
    assert answer.headers["x-should-retry"] == "false"


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "gen", "prompt": prompt}


@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_a_sequence_the_decoder_fails_on_fails_alone(
    server: ServerThread, where: str
) -> None:
    url = f"{server.url}/v1/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        alone = [(await client.post(url, json=completion(p))).json() for p in GOOD_PROMPTS]
        assert [a["choices"][0]["text"] for a in alone[:3]] == ["b c d", "c d", "d"]
        prompts = [GOOD_PROMPTS[0], BAD_PROMPTS[where], *GOOD_PROMPTS[1:]]
        prefills = metric(server, "lanes_prefill_seconds_count", workload="gen")
        with DECODER.closed():  # the first prefill waits: the other seven queue behind it
            calls = [asyncio.create_task(client.post(url, json=completion(prompts[0])))]
            await asyncio.to_thread(DECODER.wait_held)
            calls += [
                asyncio.create_task(client.post(url, json=completion(p))) for p in prompts[1:]
            ]
            await eventually(
                lambda: metric(server, "lanes_queue_depth", workload="gen") == 7,
                "the other seven requests queued behind the first",
            )
        answers = await asyncio.gather(*calls)
    bad = answers.pop(1)
    assert [a.status_code for a in answers] == [200] * 7, [a.text for a in answers]
    for want, got in zip(alone, answers, strict=True):
        assert got.json()["choices"] == want["choices"]
        assert got.json()["usage"] == want["usage"]
    assert_not_to_retry(bad, "this prompt" if where == "prefill" else f"position {POSITIONS}")
    # The first prefilled alone, the other seven (the bad one among them) together: the
    # bad row shared its prefill, and its decode steps, with six others.
    assert metric(server, "lanes_prefill_seconds_count", workload="gen") - prefills == 2


def test_no_client_retries_a_sequence_the_model_fails_on(server: ServerThread) -> None:
    bad = BAD_PROMPTS["prefill"]
    runs = DECODER.passed
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")  # 2 retries by default
    with pytest.raises(openai.InternalServerError, match="run on its own"):
        sdk.completions.create(model="gen", prompt=bad)
    assert DECODER.passed - runs == 1, "the openai client sent it once"
    client = lanes.Client(server.url, spec=server.spec, max_retries=3)
    with client, pytest.raises(lanes.ModelError, match="run on its own") as raised:
        client.call("gen", bad)
    assert raised.value.code == "model_error"
    assert DECODER.passed - runs == 2, "so did the lanes client"


async def held_batch(
    server: ServerThread, workload: str, send: Any, inputs: list[Any]
) -> list[httpx.Response]:
    """Send `inputs[0]`, hold its run at HELD, send the rest (they queue as one batch),
    then let it all run. Checks that the rest ran as one batch."""
    runs = metric(server, "lanes_batch_size_count", workload=workload)
    items = metric(server, "lanes_batch_size_sum", workload=workload)
    with HELD.closed():
        calls = [asyncio.create_task(send(inputs[0]))]
        await asyncio.to_thread(HELD.wait_held)
        calls += [asyncio.create_task(send(i)) for i in inputs[1:]]
        await eventually(
            lambda: metric(server, "lanes_queue_depth", workload=workload) == len(inputs) - 1,
            "the others queued behind the first",
        )
    answers = list(await asyncio.gather(*calls))
    assert metric(server, "lanes_batch_size_count", workload=workload) - runs == 2
    assert metric(server, "lanes_batch_size_sum", workload=workload) - items == len(inputs)
    return answers


async def test_an_embedding_input_the_model_fails_on_fails_alone(server: ServerThread) -> None:
    url = f"{server.url}/v1/embeddings"
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(text: str) -> httpx.Response:
            return await client.post(url, json={"model": "vectors", "input": text})

        alone = [(await send(t)).json()["data"] for t in GOOD_TEXTS]
        texts = [GOOD_TEXTS[0], GOOD_TEXTS[1], f"w2 {BAD_WORD}", *GOOD_TEXTS[2:]]
        answers = await held_batch(server, "vectors", send, texts)
    bad = answers.pop(2)
    assert [a.status_code for a in answers] == [200] * 7, [a.text for a in answers]
    for want, got in zip(alone, answers, strict=True):
        assert np.allclose(got.json()["data"][0]["embedding"], want[0]["embedding"], atol=1e-6)
    assert_not_to_retry(bad)


async def test_an_infer_input_the_model_fails_on_fails_alone(server: ServerThread) -> None:
    url = f"{server.url}/v2/models/table/infer"
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(index: int) -> httpx.Response:
            tensor = {"name": "i", "shape": [1, 1], "datatype": "INT64", "data": [index]}
            return await client.post(url, json={"inputs": [tensor]})

        indices = [0, 1, 2, 3, LOOKUP_ROWS + 5, 2, 1, 0]
        answers = await held_batch(server, "table", send, indices)
    bad = answers.pop(4)
    assert [a.status_code for a in answers] == [200] * 7, [a.text for a in answers]
    for index, got in zip([i for i in indices if i < LOOKUP_ROWS], answers, strict=True):
        [output] = got.json()["outputs"]
        assert output["data"] == [index, index + 0.5, index + 0.25]
    assert bad.status_code == 500
    assert "run on its own" in bad.json()["error"] and "INVALID_ARGUMENT" in bad.json()["error"]
    assert "retry-after" not in bad.headers


def test_a_stream_the_model_fails_on_mid_way_ends_with_its_error_event(
    server: ServerThread,
) -> None:
    body = {**completion(BAD_PROMPTS["decode"]), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200  # its first tokens came before the failure
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "model_error" and f"position {POSITIONS}" in error["message"]
    with lanes.Client(server.url, spec=server.spec) as client:
        chunks = client.stream("gen", BAD_PROMPTS["decode"])
        with pytest.raises(lanes.ModelError, match=f"position {POSITIONS}"):
            list(chunks)
