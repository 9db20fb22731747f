"""Existing OpenAI clients work unchanged, and no request can hurt the server.

A real uvicorn on 127.0.0.1 with an API key, the demo models, the official `openai`
package and raw sockets: OpenAI's defaults (no `stream` is not streamed), what OpenAI
accepts and rejects (with its `param` and `code`), context limits, requests that can
never fit, and inputs that used to answer 500.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import APIStatusError, BadRequestError, NotFoundError, OpenAI
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.flows_fixtures import embed_model
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

KEY = "sk-openai-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
ODD_HANDLER = "lanes_test_odd_handler"

WORKLOADS = """\
workloads:
  search-query:
    mode: interactive
    task: embed
    model: minilm
  tiny-queue:                      # four waiting places: five texts can never fit
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 2, max_queue: 4}
  words:                           # a WordLevel tokenizer without an unknown token
    mode: interactive
    task: embed
    model: words
  flowers:
    mode: interactive
    task: infer
    model: classifier
  odd-flowers:                     # a handler whose answer is not JSON: a server bug
    mode: interactive
    task: infer
    model: classifier
    handler: lanes_test_odd_handler:handler
  odd-search:
    mode: interactive
    task: embed
    model: minilm
    handler: lanes_test_odd_handler:handler
  code-complete:                   # as the demo declares it: streams by default
    mode: interactive
    task: generate
    model: tinycode
    stream: true
    generation: {max_new_tokens: 8, temperature: 0}
  sampled:
    mode: interactive
    task: generate
    model: tinycode
    generation: {max_new_tokens: 8, temperature: 0.8}
"""


def models_block(demo: Path, words: Path) -> str:
    return f"""\
version: 1
models:
  minilm: {{path: {demo}/minilm/model.onnx, tokenizer: {demo}/minilm/tokenizer.json}}
  tinycode: {{path: {demo}/tinycode/model.onnx, tokenizer: {demo}/tinycode/tokenizer.json}}
  classifier: {{path: {demo}/classifier/model.onnx}}
  words: {{path: {words}/model.onnx, tokenizer: {words}/tokenizer.json}}
"""


def words_model(folder: Path) -> Path:
    """The tiny embedding-table encoder, with a WordLevel tokenizer that has no
    unknown token: a word outside its vocabulary cannot be encoded at all."""
    embed_model(folder)
    vocab = {w: i for i, w in enumerate(["[PAD]", "hello", "world"])}
    tokenizer = Tokenizer(models.WordLevel(vocab))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("openai")
    words = words_model(folder / "words")
    (folder / f"{ODD_HANDLER}.py").write_text(
        "class Odd:\n    def post(self, output):\n        return {1, 2}\n\n\nhandler = Odd()\n"
    )
    spec = folder / "workloads.yaml"
    spec.write_text(models_block(demo_models, words) + WORKLOADS)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        with ServerThread(spec, api_key=KEY) as running:
            yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def post(server: ServerThread, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **headers}, timeout=30)


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when the series has none yet)."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head = line.split(" ")[0]
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


class Records(logging.Handler):
    """Every record the server's loggers write at WARNING or above, while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        for name in ("uvicorn.error", "lanes"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("uvicorn.error", "lanes"):
            logging.getLogger(name).removeHandler(self)


CHAT = [{"role": "user", "content": "a class"}]


# ---- OpenAI's default: a request without `stream` is not streamed ------------------------


def test_a_request_without_stream_is_answered_whole(client: OpenAI, server: ServerThread) -> None:
    chat = client.chat.completions.create(model="code-complete", messages=CHAT)  # type: ignore[arg-type]
    assert isinstance(chat, ChatCompletion), type(chat)
    assert chat.choices[0].message.role == "assistant"
    completion = client.completions.create(model="code-complete", prompt="def f(x")
    assert isinstance(completion, Completion), type(completion)
    for stream in ({}, {"stream": None}, {"stream": False}):
        body = {"model": "code-complete", "prompt": "def ", "max_tokens": 3, **stream}
        answer = post(server, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/json", stream
    chunks = list(client.completions.create(model="code-complete", prompt="def f(x", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text


# ---- what OpenAI accepts is accepted --------------------------------------------------------


def test_no_op_values_of_parameters_lanes_does_not_implement_are_accepted(
    client: OpenAI, server: ServerThread
) -> None:
    plain = client.chat.completions.create(model="code-complete", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    same = client.chat.completions.create(
        model="code-complete",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        n=None,
        top_p=0,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        logprobs=False,
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=True,
        user="user-1",
        seed=3,
    )
    assert same.choices[0].message.content == plain.choices[0].message.content
    whole = client.completions.create(
        model="code-complete",
        prompt="def f(x",
        max_tokens=4,
        echo=False,
        best_of=1,
        logprobs=None,
        suffix=None,
        user="user-1",
    )
    assert whole.choices[0].finish_reason in ("stop", "length")
    # vLLM's extensions, as its clients send them (extra_body), at their no-op values.
    vllm = {"repetition_penalty": 1, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": []}
    vllm |= {"bad_words": [], "include_stop_str_in_output": False, "use_beam_search": False}
    vllm |= {"guided_json": None, "structured_outputs": None, "allowed_token_ids": None}
    again = client.chat.completions.create(
        model="code-complete",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body=vllm,
    )
    assert again.choices[0].message.content == plain.choices[0].message.content
    answer = post(
        server,
        "/v1/chat/completions",
        {"model": "code-complete", "messages": CHAT, "max_tokens": 2, "tools": [], "n": None},
    )
    assert answer.status_code == 200, answer.text
    template = {"add_generation_prompt": True, "continue_final_message": False}
    template |= {"chat_template": None}
    answer = post(server, "/v1/chat/completions", {**CHAT_BODY, **template, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    # vLLM's add_generation_prompt: false leaves out the assistant's opening (its tokens).
    bare = post(server, "/v1/chat/completions", {**CHAT_BODY, "add_generation_prompt": False})
    opening = answer.json()["usage"]["prompt_tokens"] - bare.json()["usage"]["prompt_tokens"]
    assert opening > 0, bare.text
    text_only = {"modalities": ["text"], "audio": None, "web_search_options": None}
    answer = post(server, "/v1/chat/completions", {**CHAT_BODY, **text_only})
    assert answer.status_code == 200, answer.text
    answer = post(server, "/v1/completions", {**PROMPT_BODY, "response_format": {"type": "text"}})
    assert answer.status_code == 200, answer.text
    # An assistant's turn as some clients write it back: no tool calls, spelled empty.
    turn = {"role": "assistant", "content": "class A:", "tool_calls": [], "function_call": None}
    answer = post(server, "/v1/chat/completions", {**CHAT_BODY, "messages": [*CHAT, turn, *CHAT]})
    assert answer.status_code == 200, answer.text


def test_token_ids_are_embedding_input(client: OpenAI) -> None:
    text = client.embeddings.create(model="search-query", input="hello", dimensions=384, user="u")
    # vLLM's extensions, at their no-op values.
    vllm = {"truncate_prompt_tokens": None, "add_special_tokens": True, "normalize": True}
    same = client.embeddings.create(model="search-query", input="hello", extra_body=vllm)
    assert same.data[0].embedding == text.data[0].embedding
    # minilm's tokenizer: [CLS] hello [SEP]
    ids = client.embeddings.create(model="search-query", input=[101, 7592, 102])
    assert len(ids.data) == 1 and ids.usage.prompt_tokens == 3
    np.testing.assert_allclose(ids.data[0].embedding, text.data[0].embedding, atol=1e-6)
    many = client.embeddings.create(
        model="search-query", input=[[101, 7592, 102], [101, 2088, 102]]
    )
    assert [d.index for d in many.data] == [0, 1]
    np.testing.assert_allclose(many.data[0].embedding, text.data[0].embedding, atol=1e-6)
    with pytest.raises(BadRequestError) as bad:
        client.embeddings.create(model="search-query", input=[[101, 99_999_999]])
    assert bad.value.param == "input[0]"


def test_a_null_encoding_format_is_float_as_the_other_nulls_are_their_defaults(
    server: ServerThread,
) -> None:
    nulls = {**EMBED_BODY, "encoding_format": None, "dimensions": None, "user": None}
    answer = post(server, "/v1/embeddings", nulls)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) == 384


def test_a_list_of_prompts_gets_one_choice_each(client: OpenAI) -> None:
    prompts = ["def f(x", "class Foo:\n    def", "import os\n"]
    alone = [client.completions.create(model="code-complete", prompt=p) for p in prompts]
    together = client.completions.create(model="code-complete", prompt=prompts)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage is not None
    assert together.usage.completion_tokens == sum(
        a.usage.completion_tokens for a in alone if a.usage
    )
    texts = ["", "", ""]
    finishes: list[str | None] = [None, None, None]
    for chunk in client.completions.create(model="code-complete", prompt=prompts, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [a.choices[0].text for a in alone]
    assert finishes == [a.choices[0].finish_reason for a in alone]


def usages(chunks: list[Any]) -> dict[int, list[tuple[int, int, int]]]:
    """Each choice's (prompt, completion, total) tokens, chunk by chunk, as its chunks
    carried them."""
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            usage = chunk.usage
            assert usage is not None, chunk
            counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
            seen.setdefault(choice.index, []).append(counts)
    return seen


def test_continuous_usage_stats_puts_each_choice_s_usage_in_every_chunk(client: OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk
    carries its choice's usage so far, the last its whole; the usage chunk follows."""
    prompts = ["def f(x", "import os\n"]
    continuous = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = list(
        client.completions.create(
            model="code-complete", prompt=prompts, stream=True, extra_body=continuous
        )
    )
    *texts, last = chunks
    assert last.choices == [] and last.usage is not None
    seen = usages(texts)
    assert sorted(seen) == [0, 1]
    for counts in seen.values():
        assert all(p == counts[0][0] and t == p + c for p, c, t in counts)
        made = [c for _, c, _ in counts]
        assert made == sorted(made) and made[0] >= 1
    alone = [
        client.completions.create(model="code-complete", prompt=p, stream=False) for p in prompts
    ]
    for index, answer in enumerate(alone):
        assert answer.usage is not None
        whole = answer.usage
        assert seen[index][-1] == (whole.prompt_tokens, whole.completion_tokens, whole.total_tokens)
    assert last.usage.completion_tokens == sum(seen[i][-1][1] for i in seen)
    assert last.usage.prompt_tokens == sum(seen[i][-1][0] for i in seen)

    messages: Any = CHAT
    chat = list(
        client.chat.completions.create(
            model="code-complete", messages=messages, stream=True, extra_body=continuous
        )
    )
    *deltas, total = chat
    (counts,) = usages(deltas).values()
    assert total.usage is not None
    assert counts[-1] == (
        total.usage.prompt_tokens,
        total.usage.completion_tokens,
        total.usage.total_tokens,
    )
    # Without include_usage, vLLM reads no continuous_usage_stats: no usage at all.
    alone_option = {"stream_options": {"continuous_usage_stats": True}}
    plain = list(
        client.completions.create(
            model="code-complete", prompt=prompts[0], stream=True, extra_body=alone_option
        )
    )
    assert plain and all(chunk.usage is None for chunk in plain)
    usual = {"stream_options": {"include_usage": True}}
    counted = list(
        client.completions.create(
            model="code-complete", prompt=prompts[0], stream=True, extra_body=usual
        )
    )
    assert all(chunk.usage is None for chunk in counted[:-1]) and counted[-1].usage is not None


def test_a_list_of_prompts_mixing_texts_and_token_ids_is_a_400_naming_the_item(
    client: OpenAI,
) -> None:
    """OpenAI and vLLM take a text, a list of texts, token ids or a list of arrays of
    token ids, never a mix: the first item sets the kind and another is refused."""
    mixes: dict[str, tuple[Any, str]] = {
        "prompt[1]": (["def f(x", [1, 2]], "expected a string, as prompt[0] is"),
        "prompt[2]": ([[1, 2], [3], "def f(x"], "expected an array of token ids, as prompt[0] is"),
    }
    for param, (prompt, says) in mixes.items():
        with pytest.raises(BadRequestError) as mixed:
            client.completions.create(model="code-complete", prompt=prompt, stream=False)
        assert (mixed.value.param, mixed.value.code) == (param, "invalid_type")
        assert isinstance(mixed.value.body, dict)
        assert mixed.value.body["message"].startswith(f"{param}: {says} (a list is all strings")
    with pytest.raises(BadRequestError) as embedded:
        client.embeddings.create(model="search-query", input=["hello", [101, 102]])  # type: ignore[arg-type]
    assert embedded.value.param == "input[1]"
    # Each kind alone is served.
    texts = client.completions.create(model="code-complete", prompt=["a", "b"], stream=False)
    ids = client.completions.create(model="code-complete", prompt=[[1, 2], [3]], stream=False)
    assert len(texts.choices) == len(ids.choices) == 2


# ---- what OpenAI rejects is rejected, with its param and code ---------------------------------

CHAT_BODY: dict[str, Any] = {"model": "code-complete", "messages": CHAT}
PROMPT_BODY: dict[str, Any] = {"model": "code-complete", "prompt": "def "}
TOOL_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ],
}
TOOL_ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
EMBED_BODY: dict[str, Any] = {"model": "search-query", "input": "hello"}
REJECTED: list[tuple[str, dict[str, Any], str, str | None]] = [
    # 0 is a prompt scored: only with echo (tests/test_generate_logprobs.py).
    ("/v1/completions", {**PROMPT_BODY, "max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ("/v1/completions", {**PROMPT_BODY, "max_tokens": "5"}, "max_tokens", "invalid_type"),
    ("/v1/completions", {**PROMPT_BODY, "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    (
        "/v1/completions",
        {**PROMPT_BODY, "temperature": 3},
        "temperature",
        "decimal_above_max_value",
    ),
    ("/v1/completions", {**PROMPT_BODY, "top_p": 1.5}, "top_p", "decimal_above_max_value"),
    ("/v1/completions", {**PROMPT_BODY, "seed": "7"}, "seed", "invalid_type"),
    ("/v1/completions", {**PROMPT_BODY, "stream": "yes"}, "stream", "invalid_type"),
    # n up to 128 is served (tests/test_choices.py); past it, out of range.
    ("/v1/completions", {**PROMPT_BODY, "n": 129}, "n", "integer_above_max_value"),
    ("/v1/completions", {**PROMPT_BODY, "n": 0}, "n", "integer_below_min_value"),
    (
        "/v1/completions",
        {**PROMPT_BODY, "frequency_penalty": "a"},
        "frequency_penalty",
        "invalid_type",
    ),
    (
        "/v1/completions",
        {**PROMPT_BODY, "frequency_penalty": 3},
        "frequency_penalty",
        "decimal_above_max_value",
    ),
    (
        "/v1/completions",
        {**PROMPT_BODY, "presence_penalty": -2.5},
        "presence_penalty",
        "decimal_below_min_value",
    ),
    ("/v1/completions", {**PROMPT_BODY, "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {**PROMPT_BODY, "logit_bias": {"5": 200}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {**PROMPT_BODY, "logit_bias": [1]}, "logit_bias", "invalid_type"),
    # Served (tests/test_sampling_controls.py): an id outside the vocabulary is refused.
    ("/v1/completions", {**PROMPT_BODY, "logit_bias": {"5000": 1}}, "logit_bias", "invalid_value"),
    ("/v1/completions", {**PROMPT_BODY, "user": 5}, "user", "invalid_type"),
    ("/v1/chat/completions", {**CHAT_BODY, "echo": True}, "echo", "unsupported_value"),
    # vLLM's, for an assistant's prefill: the answer would be a new turn, not its rest.
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        "chat_template",
        "unsupported_value",
    ),
    # vLLM's sampling extensions change the tokens: refused, not silently ignored.
    *(
        ("/v1/completions", {**PROMPT_BODY, name: value}, name, "unsupported_value")
        for name, value in (
            ("bad_words", ["def"]),
            ("use_beam_search", True),
            # Structured output: JSON (or a choice) asked for would come back as free text.
            ("guided_json", {"type": "object"}),
            ("guided_regex", "[ab]+"),
            ("guided_choice", ["yes", "no"]),
            ("guided_grammar", "root ::= 'a'"),
            ("structured_outputs", {"choice": ["yes", "no"]}),
            ("allowed_token_ids", [5, 6]),
        )
    ),
    # Those lanes implements are refused only out of range (tests/test_sampling_controls.py).
    (
        "/v1/completions",
        {**PROMPT_BODY, "repetition_penalty": 0},
        "repetition_penalty",
        "decimal_below_min_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "min_tokens": -1},
        "min_tokens",
        "integer_below_min_value",
    ),
    (
        "/v1/completions",
        {**PROMPT_BODY, "stop_token_ids": [10**6]},
        "stop_token_ids",
        "invalid_value",
    ),
    ("/v1/completions", {**PROMPT_BODY, "min_p": 2}, "min_p", "decimal_above_max_value"),
    # Served up to 5 alternatives, as OpenAI: more is out of range, not unsupported.
    ("/v1/completions", {**PROMPT_BODY, "logprobs": 6}, "logprobs", "integer_above_max_value"),
    ("/v1/completions", {**PROMPT_BODY, "suffix": "}"}, "suffix", "unsupported_value"),
    ("/v1/completions", {**PROMPT_BODY, "best_of": 3}, "best_of", "unsupported_value"),
    ("/v1/completions", {**PROMPT_BODY, "best_of": 3, "n": 2}, "best_of", "unsupported_value"),
    ("/v1/completions", {**PROMPT_BODY, "prompt": []}, "prompt", "empty_array"),
    ("/v1/completions", {**PROMPT_BODY, "prompt": ["a", 5]}, "prompt[1]", "invalid_type"),
    (
        "/v1/completions",
        {**PROMPT_BODY, "stream_options": {"include_usage": True}},
        "stream_options",
        "invalid_value",
    ),
    ("/v1/completions", {"model": "code-complete"}, "prompt", "missing_required_parameter"),
    # JSON's parser reads an integer beyond 64 bits as a float.
    ("/v1/completions", {**PROMPT_BODY, "seed": 2**64}, "seed", "integer_above_max_value"),
    (
        "/v1/completions",
        {**PROMPT_BODY, "max_tokens": 2**70},
        "max_tokens",
        "integer_above_max_value",
    ),
    # An empty stop string would cut every text before its first character.
    ("/v1/completions", {**PROMPT_BODY, "stop": ["\n", ""]}, "stop[1]", "string_below_min_length"),
    # One stop string is checked as a list of it, but named as it was sent.
    ("/v1/completions", {**PROMPT_BODY, "stop": ""}, "stop", "string_below_min_length"),
    ("/v1/chat/completions", {**CHAT_BODY, "stop": ""}, "stop", "string_below_min_length"),
    ("/v1/completions", {**PROMPT_BODY, "stop": ["x"] * 17}, "stop", "array_above_max_length"),
    # Served, as OpenAI: top_logprobs needs logprobs, and at most 20 alternatives.
    ("/v1/chat/completions", {**CHAT_BODY, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "integer_above_max_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "response_format": {"type": "json_object"}},
        "response_format",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "unsupported_value",
    ),
    # OpenAI's, and each would change the answer: audio asked for, text given, unsaid.
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "modalities": ["text", "audio"]},
        "modalities",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "audio": {"voice": "alloy", "format": "wav"}},
        "audio",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "web_search_options": {}},
        "web_search_options",
        "unsupported_value",
    ),
    # vLLM's on completions: JSON asked for would come back as free text.
    (
        "/v1/completions",
        {**PROMPT_BODY, "response_format": {"type": "json_object"}},
        "response_format",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "tool_choice": "required"},
        "tool_choice",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "max_completion_tokens": -1},
        "max_completion_tokens",
        "integer_below_min_value",
    ),
    # The chat's budget is named as it was sent, though it is max_tokens' limit.
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "max_completion_tokens": 2**20},
        "max_completion_tokens",
        "integer_above_max_value",
    ),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": []}, "messages", "empty_array"),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [*CHAT, {"role": "user", "content": 5}]},
        "messages[1].content",
        "invalid_type",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [*CHAT, {"role": "user"}]},
        "messages[1].content",
        "missing_required_parameter",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [{"role": "system", "content": []}, *CHAT]},
        "messages[0].content",
        "empty_array",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [{"role": "robot", "content": "hi"}]},
        "messages[0].role",
        "invalid_value",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT_BODY,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        "messages[0].content[0].type",
        "unsupported_value",
    ),
    # lanes calls no tools: a conversation that holds tool calls would reach the model
    # without them.
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [*CHAT, TOOL_CALL, TOOL_ANSWER, *CHAT]},
        "messages[1].tool_calls",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "messages": [*CHAT, TOOL_ANSWER]},
        "messages[1].role",
        "unsupported_value",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT_BODY,
            "messages": [
                *CHAT,
                {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            ],
        },
        "messages[1].function_call",
        "unsupported_value",
    ),
    ("/v1/embeddings", {**EMBED_BODY, "dimensions": 0}, "dimensions", "integer_below_min_value"),
    ("/v1/embeddings", {**EMBED_BODY, "dimensions": "x"}, "dimensions", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "dimensions": 128}, "dimensions", "unsupported_value"),
    ("/v1/embeddings", {**EMBED_BODY, "user": ["u"]}, "user", "invalid_type"),
    # vLLM's extensions that would change the vectors: ignored, a vLLM client would
    # get vectors of other tokens (or not unit length) than it asked for.
    (
        "/v1/embeddings",
        {**EMBED_BODY, "truncate_prompt_tokens": 2},
        "truncate_prompt_tokens",
        "unsupported_value",
    ),
    (
        "/v1/embeddings",
        {**EMBED_BODY, "add_special_tokens": False},
        "add_special_tokens",
        "unsupported_value",
    ),
    ("/v1/embeddings", {**EMBED_BODY, "normalize": False}, "normalize", "unsupported_value"),
    (
        "/v1/embeddings",
        {**EMBED_BODY, "encoding_format": "hex"},
        "encoding_format",
        "invalid_value",
    ),
    ("/v1/embeddings", {**EMBED_BODY, "input": 42}, "input", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "input": []}, "input", "empty_array"),
    ("/v1/embeddings", {**EMBED_BODY, "input": ["ok", None]}, "input[1]", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "input": [101, "x"]}, "input[1]", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "input": ["x", [101]]}, "input[1]", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "input": [[101], "x"]}, "input[1]", "invalid_type"),
    ("/v1/embeddings", {**EMBED_BODY, "model": 7}, "model", "invalid_type"),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), REJECTED)
def test_what_openai_rejects_is_a_400_with_its_param_and_code(
    server: ServerThread, path: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    answer = post(server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    message = error["message"]
    assert message.startswith(f"{param}: "), message
    # No pydantic internals: union branches, its wording, its loc paths.
    for leak in (".str", "list[", "Input should", "Field required", ".0.", "function-after"):
        assert leak not in message, message


def test_the_official_client_reads_param_and_code(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as bad:
        client.completions.create(model="code-complete", prompt="x", max_tokens=0)
    assert bad.value.param == "max_tokens"
    assert bad.value.code == "integer_below_min_value"
    with pytest.raises(NotFoundError) as missing:
        client.chat.completions.create(model="ghost", messages=CHAT)  # type: ignore[arg-type]
    assert missing.value.type == "invalid_request_error"
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(NotFoundError) as gone:
        client.embeddings.create(model="ghost", input="x")
    assert gone.value.code == "model_not_found"


def test_models_can_be_retrieved_one_by_one(client: OpenAI) -> None:
    model = client.models.retrieve("search-query")
    assert model.id == "search-query" and model.object == "model"
    # vLLM's max_model_len: the tokens a prompt and its answer may hold; none for a
    # model that reads no tokens.
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert listed["code-complete"]["max_model_len"] == 512  # tinycode's context
    assert listed["search-query"]["max_model_len"] == 256  # minilm's max_length
    assert listed["flowers"]["max_model_len"] is None
    assert client.models.retrieve("code-complete").model_dump()["max_model_len"] == 512
    with pytest.raises(NotFoundError) as missing:
        client.models.retrieve("ghost")
    assert missing.value.code == "model_not_found"


def test_unknown_routes_answer_json_in_their_protocol(server: ServerThread) -> None:
    nowhere = httpx.get(f"{server.url}/v1/nowhere", headers=AUTH)
    assert nowhere.status_code == 404
    assert nowhere.json()["error"]["type"] == "invalid_request_error"
    assert "/v1/nowhere" in nowhere.json()["error"]["message"]
    wrong_method = httpx.get(f"{server.url}/v1/embeddings", headers=AUTH)
    assert wrong_method.status_code == 405
    assert "GET" in wrong_method.json()["error"]["message"]
    v2 = httpx.get(f"{server.url}/v2/nowhere/at/all", headers=AUTH)
    assert v2.status_code == 404 and isinstance(v2.json()["error"], str)


# ---- limits: a request that can never fit, input over the context -----------------------------


def test_more_texts_than_the_queue_holds_is_413_and_never_retried(server: ServerThread) -> None:
    before = {
        code: metric(server, "lanes_responses_total", route="/v1/embeddings", code=code)
        for code in ("413", "503")
    }
    patient = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=2)
    with pytest.raises(APIStatusError) as refused:
        patient.embeddings.create(model="tiny-queue", input=[f"text {i}" for i in range(5)])
    assert refused.value.status_code == 413
    assert "4" in refused.value.message and "max_queue" in refused.value.message
    assert refused.value.param == "input"
    after = {
        code: metric(server, "lanes_responses_total", route="/v1/embeddings", code=code)
        for code in ("413", "503")
    }
    assert after["413"] == before["413"] + 1, "answered once: the client did not retry"
    assert after["503"] == before["503"]
    fits = patient.embeddings.create(model="tiny-queue", input=[f"text {i}" for i in range(4)])
    assert len(fits.data) == 4


def test_text_over_the_model_s_length_is_a_400_naming_it(client: OpenAI) -> None:
    long = "word " * 300  # minilm: max_length 256 tokens
    with pytest.raises(BadRequestError) as refused:
        client.embeddings.create(model="search-query", input=["short", long])
    assert refused.value.param == "input[1]"
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in refused.value.message


def test_prompt_and_max_tokens_over_the_context_is_a_400_naming_it(client: OpenAI) -> None:
    prompt = "x = 1\n" * 60  # tinycode: 512 positions
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="code-complete", prompt=prompt, max_tokens=500)
    assert refused.value.param == "prompt"
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in refused.value.message
    with pytest.raises(BadRequestError) as chat:
        client.chat.completions.create(
            model="code-complete",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=500,
        )
    assert chat.value.param == "messages"
    # Without max_tokens, the answer stops where the context ends.
    fits = client.completions.create(model="code-complete", prompt=prompt)
    assert fits.choices[0].finish_reason in ("stop", "length")


def test_a_workload_that_truncates_cuts_long_text_instead(
    demo_models: Path, tmp_path: Path
) -> None:
    minilm = demo_models / "minilm"
    spec = tmp_path / "workloads.yaml"
    spec.write_text(
        f"""\
version: 1
models:
  short: {{path: {minilm}/model.onnx, tokenizer: {minilm}/tokenizer.json, max_length: 16}}
workloads:
  cut: {{mode: interactive, task: embed, model: short, truncate: true}}
  strict: {{mode: interactive, task: embed, model: short}}
"""
    )
    with ServerThread(spec) as running:
        client = OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        cut = client.embeddings.create(model="cut", input="word " * 40)
        assert cut.usage.prompt_tokens == 16
        fits = client.embeddings.create(model="cut", input="word " * 14)  # and [CLS], [SEP]
        np.testing.assert_allclose(cut.data[0].embedding, fits.data[0].embedding, atol=1e-6)
        with pytest.raises(BadRequestError, match="maximum context length is 16 tokens"):
            client.embeddings.create(model="strict", input="word " * 40)


# ---- authorization: the scheme is case-insensitive -------------------------------------------


def test_the_bearer_scheme_is_case_insensitive(server: ServerThread) -> None:
    for scheme, status in (("bearer", 200), ("BEARER", 200), ("Bearer", 200), ("Basic", 401)):
        answer = post(server, "/v1/embeddings", EMBED_BODY, Authorization=f"{scheme} {KEY}")
        assert answer.status_code == status, (scheme, answer.text)
    assert (
        post(server, "/v1/embeddings", EMBED_BODY, Authorization="bearer nope").status_code == 401
    )


# ---- no input gives a 500 ----------------------------------------------------------------------


def test_a_negative_seed_is_a_seed(client: OpenAI) -> None:
    texts = [
        client.completions.create(model="sampled", prompt="def f(x", seed=-1).choices[0].text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_an_empty_v2_tensor_is_a_400(server: ServerThread) -> None:
    empty_rows = {"inputs": [{"name": "features", "shape": [0], "datatype": "FP32", "data": []}]}
    answer = post(server, "/v2/models/flowers/infer", empty_rows)
    assert answer.status_code == 400, answer.text
    assert "features" in answer.json()["error"]
    no_texts = {"inputs": [{"name": "text", "shape": [0], "datatype": "BYTES", "data": []}]}
    answer = post(server, "/v2/models/search-query/infer", no_texts)
    assert answer.status_code == 400, answer.text
    assert "at least one" in answer.json()["error"]


def same_connection(first: httpx.Response, second: httpx.Response) -> bool:
    def local(response: httpx.Response) -> object:
        return response.extensions["network_stream"].get_extra_info("client_addr")

    return local(first) == local(second)


def test_text_the_tokenizer_cannot_encode_is_a_400_and_the_connection_lives(
    server: ServerThread,
) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        bad = http.post(
            "/v1/embeddings", json={"model": "words", "input": ["hello", "hello zebra"]}
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "input[1]"
        good = http.post("/v1/embeddings", json={"model": "words", "input": "hello world"})
        assert good.status_code == 200, good.text
        assert same_connection(bad, good), "the connection was closed after the error"


def test_a_failing_handler_answers_a_json_500_in_its_protocol(server: ServerThread) -> None:
    rows = {
        "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    with Records() as logged, httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        v2 = http.post("/v2/models/odd-flowers/infer", json=rows)
        assert v2.status_code == 500
        assert isinstance(v2.json()["error"], str)
        openai = http.post("/v1/embeddings", json={"model": "odd-search", "input": "hello"})
        assert openai.status_code == 500
        assert openai.json()["error"]["type"] == "server_error"
        after = http.post("/v1/embeddings", json=EMBED_BODY)
        assert after.status_code == 200 and same_connection(v2, after)
    assert sum(r.exc_info is not None for r in logged.records) == 2, "one traceback each"


def test_a_client_gone_mid_body_is_not_a_500(server: ServerThread) -> None:
    route = {"route": "/v1/embeddings"}
    before = {c: metric(server, "lanes_responses_total", **route, code=c) for c in ("499", "500")}
    with Records() as logged:
        with socket.create_connection(("127.0.0.1", server.settings.port)) as sock:
            head = (
                "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n"
            )
            sock.sendall(head.encode() + json.dumps(EMBED_BODY).encode()[:10])
        wait_for(
            lambda: metric(server, "lanes_responses_total", **route, code="499") > before["499"],
            "the abandoned request counted as 499",
        )
    assert metric(server, "lanes_responses_total", **route, code="500") == before["500"]
    assert not logged.records, [r.getMessage() for r in logged.records]


def test_the_server_still_answers_after_all_of_the_above(client: OpenAI) -> None:
    answer = client.embeddings.create(model="search-query", input="still here")
    assert isinstance(answer, CreateEmbeddingResponse) and len(answer.data[0].embedding) == 384
