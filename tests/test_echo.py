"""`echo` on /v1/completions (serving/generate_routes.py): the prompt before the
completion and, with `logprobs`, its tokens' logprobs (each on the logits of the
position before it, scored in the prefill), `max_tokens: 0` to score a text alone. A
real uvicorn on 127.0.0.1, the demo tinycode decoder, the official `openai` client,
checked against a log-softmax of the raw logits of one whole-prompt run here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import OpenAI
from openai.types import Completion

from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.tasks.decoder import Decoder
from tests.model_reference import log_softmax, prefill_logits
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

WORKLOADS = """\
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 4}
    generation: {max_new_tokens: 8, temperature: 0}
"""
PROMPT = "def f(x"
PROMPTS = ["for", "import os\nimport sys\n", "def f(x"]  # different lengths: left-padded


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("echo"), demo_models, WORKLOADS)
    with ServerThread(spec) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def decoder(server: ServerThread) -> Decoder:
    """The model the server serves, loaded apart: the test's own session."""
    return Decoder.load(server.spec.models["tinycode"], Runtime(Settings(device="cpu")))


def check_prompt(decoder: Decoder, ids: list[int], logprobs: Any, top: int) -> None:
    """The choice's logprobs start with the prompt's tokens: the first with none, each
    other one's its log-softmax at the position before, with the `top` likeliest."""
    rows = log_softmax(prefill_logits(decoder, ids))
    n = len(ids)
    assert logprobs.tokens[:n] == [decoder.tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, n):
        row = rows[i - 1]
        assert logprobs.token_logprobs[i] == pytest.approx(row[ids[i]], abs=1e-4)
        likeliest = logprobs.top_logprobs[i]
        best = np.argsort(-row, kind="stable")[:top]
        for token in best:
            text = decoder.tokenizer.decode([int(token)])
            assert likeliest[text] == pytest.approx(row[token], abs=1e-4)


def assert_same(got: Any, want: Any) -> None:
    """Equal, logprobs to float32 rounding (a run's batch may round its last bits)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key, value in want.items():
            assert_same(got[key], value)
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert got == want


def joined(chunks: list[Completion]) -> dict[int, tuple[str, dict[str, list[Any]]]]:
    """Per prompt index, its chunks' text and logprobs put together."""
    found: dict[int, tuple[str, dict[str, list[Any]]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text, lists = found.setdefault(choice.index, ("", {}))
            if choice.logprobs is not None:
                for key, value in choice.logprobs.model_dump().items():
                    lists.setdefault(key, []).extend(value or [])
            found[choice.index] = (text + choice.text, lists)
    return found


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt_whole_and_streamed(
    client: OpenAI, decoder: Decoder, max_tokens: int
) -> None:
    whole = client.completions.create(
        model="code-complete",
        prompt=PROMPT,
        max_tokens=max_tokens,
        echo=True,
        logprobs=2,
        temperature=0,
    )
    (choice,) = whole.choices
    ids = decoder.encode(PROMPT)
    assert choice.text.startswith(PROMPT)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == max_tokens  # the budget, greedy from "def f(x"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids) + max_tokens
    check_prompt(decoder, ids, lp, 2)
    # Offsets from 0 over the whole text: the completion's follow the prompt's text.
    assert lp.text_offset[0] == 0
    assert lp.text_offset[len(ids) :] == [
        len(PROMPT) + sum(len(t) for t in lp.tokens[len(ids) : i])
        for i in range(len(ids), len(lp.tokens))
    ]
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
    stream = client.completions.create(
        model="code-complete",
        prompt=PROMPT,
        max_tokens=max_tokens,
        echo=True,
        logprobs=2,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)  # the first chunk carries the echo
    assert first.logprobs is not None and first.logprobs.tokens is not None
    assert len(first.logprobs.tokens) >= len(ids)
    text, lists = joined(chunks)[0]
    assert text == choice.text
    assert_same(lists, lp.model_dump())


def test_echo_of_a_list_scores_each_prompt_and_of_token_ids_their_text(
    client: OpenAI, decoder: Decoder
) -> None:
    answer = client.completions.create(
        model="code-complete", prompt=PROMPTS, max_tokens=2, echo=True, logprobs=1
    )
    for prompt, choice in zip(PROMPTS, sorted(answer.choices, key=lambda c: c.index), strict=True):
        assert choice.text.startswith(prompt)
        check_prompt(decoder, decoder.encode(prompt), choice.logprobs, 1)
    # Streamed, each prompt's first chunk carries its echo; put together, the same.
    stream = client.completions.create(
        model="code-complete", prompt=PROMPTS, max_tokens=2, echo=True, logprobs=1, stream=True
    )
    streamed = joined(list(stream))
    for choice in answer.choices:
        assert choice.logprobs is not None
        assert_same(streamed[choice.index], (choice.text, choice.logprobs.model_dump()))
    # Each prompt's answer is what it gets alone.
    for prompt, choice in zip(PROMPTS, answer.choices, strict=True):
        alone = client.completions.create(
            model="code-complete", prompt=prompt, max_tokens=2, echo=True, logprobs=1
        )
        assert alone.choices[0].text == choice.text
    ids = decoder.encode(PROMPT)
    by_ids = client.completions.create(
        model="code-complete", prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    (choice,) = by_ids.choices
    assert choice.text == decoder.tokenizer.decode(ids)
    check_prompt(decoder, ids, choice.logprobs, 0)


def test_echo_without_logprobs_echoes_the_text_alone(client: OpenAI) -> None:
    plain = client.completions.create(model="code-complete", prompt=PROMPT, max_tokens=3)
    echoed = client.completions.create(
        model="code-complete", prompt=PROMPT, max_tokens=3, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    nothing = client.completions.create(
        model="code-complete", prompt=PROMPT, max_tokens=0, echo=True
    )
    assert nothing.choices[0].text == PROMPT and nothing.choices[0].logprobs is None
    assert nothing.usage is not None and nothing.usage.completion_tokens == 0
