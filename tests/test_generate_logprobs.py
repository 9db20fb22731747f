"""`logprobs` on /v1/completions and /v1/chat/completions (serving/generate_routes.py),
and `echo` on /v1/completions (the prompt before the completion and, with `logprobs`,
its tokens' logprobs, scored in the prefill; `max_tokens: 0` scores a text alone): a
real uvicorn on 127.0.0.1, the demo tinycode decoder, the official `openai` client,
streamed and whole, checked against a log-softmax of the raw logits computed here
with the model's own onnxruntime session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk, ChatCompletionTokenLogprob

from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.tasks.decoder import Decoder
from tests.model_reference import log_softmax, next_logprobs, prefill_logits
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
CHAT = [{"role": "user", "content": "write a loop"}]
PROMPTS = ["for", "import os\nimport sys\n", "def f(x"]  # different lengths: left-padded


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("logprobs"), demo_models, WORKLOADS)
    with ServerThread(spec) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def decoder(server: ServerThread) -> Decoder:
    """The model the server serves, loaded apart: the test's own session."""
    return Decoder.load(server.spec.models["tinycode"], Runtime(Settings(device="cpu")))


def check_against_the_model(
    decoder: Decoder, prompt: str, tokens: list[str], logprobs: list[float]
) -> None:
    """The first steps' logprobs are the raw log-softmax of the model at that point; the
    token strings say which tokens (each is one token's own text, in this vocabulary)."""
    ids = decoder.encode(prompt)
    for text, logprob in list(zip(tokens, logprobs, strict=True))[:4]:
        row = next_logprobs(decoder, ids)
        token = int(row.argmax())  # greedy
        assert decoder.tokenizer.decode([token]) == text
        assert logprob == pytest.approx(row[token], abs=1e-4)
        ids.append(token)


# ---- /v1/completions ---------------------------------------------------------------------


def test_completion_logprobs_whole_and_streamed_are_the_models_raw_logprobs(
    client: OpenAI, decoder: Decoder
) -> None:
    whole = client.completions.create(
        model="code-complete", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    (choice,) = whole.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy: the token made is the likeliest, so it is among the 3.
        assert len(top) <= 3 and top[token] == logprob == max(top.values())
    check_against_the_model(decoder, PROMPT, lp.tokens, lp.token_logprobs)

    chunks = list(
        client.completions.create(
            model="code-complete",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=3,
            stream=True,
        )
    )
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    offsets: list[int] = []
    for chunk in chunks:
        part = chunk.choices[0].logprobs
        if part is None:
            assert chunk.choices[0].text == ""  # the finish's chunk
            continue
        for name, values in streamed.items():
            values += getattr(part, name)
        offsets += part.text_offset or []
    assert streamed["tokens"] == lp.tokens
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in lp.top_logprobs]
    assert offsets == lp.text_offset


def test_logprobs_0_gives_the_sampled_tokens_only_and_no_logprobs_gives_null(
    server: ServerThread,
) -> None:
    body = {"model": "code-complete", "prompt": PROMPT, "max_tokens": 4, "temperature": 1.5}
    sampled = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 0, "seed": 1})
    (choice,) = sampled.json()["choices"]
    lp = choice["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [top[t] for top, t in zip(lp["top_logprobs"], lp["tokens"], strict=True)] == lp[
        "token_logprobs"
    ]
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert plain["choices"][0]["logprobs"] is None


def test_a_list_of_prompts_gets_each_prompts_logprobs(client: OpenAI) -> None:
    prompts = [PROMPT, "import os\n", "class A:\n    def"]
    alone = [
        client.completions.create(model="code-complete", prompt=p, max_tokens=6, logprobs=1)
        for p in prompts
    ]
    listed = client.completions.create(
        model="code-complete", prompt=prompts, max_tokens=6, logprobs=1
    )
    for one, choice in zip(alone, listed.choices, strict=True):
        assert choice.text == one.choices[0].text
        assert choice.logprobs is not None and one.choices[0].logprobs is not None
        assert choice.logprobs.tokens == one.choices[0].logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(
            one.choices[0].logprobs.token_logprobs, abs=1e-4
        )
    chunks = client.completions.create(
        model="code-complete", prompt=prompts, max_tokens=6, logprobs=1, stream=True
    )
    tokens: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens or [])
    assert [tokens[i] for i in range(3)] == [c.logprobs.tokens for c in listed.choices]  # type: ignore[union-attr]


def test_a_stop_string_keeps_every_generated_tokens_logprobs_streamed_or_not(
    client: OpenAI,
) -> None:
    free = client.completions.create(model="code-complete", prompt=PROMPT, max_tokens=8)
    text = free.choices[0].text
    # One stop string ends the text midway; another holds text back while it could
    # begin there, and never ends it.
    cut = text[len(text) // 2 :][:2]
    never = text[1:3] + "\x00"
    for stop in ([cut], [never]):
        whole = client.completions.create(
            model="code-complete", prompt=PROMPT, max_tokens=8, logprobs=2, stop=stop
        )
        (choice,) = whole.choices
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == whole.usage.completion_tokens  # type: ignore[union-attr]
        chunks = client.completions.create(
            model="code-complete", prompt=PROMPT, max_tokens=8, logprobs=2, stop=stop, stream=True
        )
        tokens: list[str] = []
        for chunk in chunks:
            part = chunk.choices[0].logprobs
            tokens += (part.tokens or []) if part is not None else []
        assert tokens == choice.logprobs.tokens, stop
    assert choice.text == text and choice.finish_reason == "length"  # `never` cut nothing


# ---- /v1/chat/completions ----------------------------------------------------------------


def test_chat_logprobs_whole_and_streamed(client: OpenAI, decoder: Decoder) -> None:
    whole = client.chat.completions.create(
        model="code-complete",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    (choice,) = whole.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob
        assert bytes(token.bytes or []) == token.token.encode()
    prompt = "<|user|>\nwrite a loop\n<|assistant|>\n"  # the demo model's chat template
    check_against_the_model(
        decoder, prompt, [t.token for t in content], [t.logprob for t in content]
    )

    chunks = client.chat.completions.create(
        model="code-complete",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed: list[ChatCompletionTokenLogprob] = []
    for chunk in chunks:
        assert isinstance(chunk, ChatCompletionChunk)
        part = chunk.choices[0].logprobs
        if part is not None:
            streamed += part.content or []
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [
        [a.token for a in t.top_logprobs] for t in content
    ]


def test_chat_without_logprobs_answers_null(client: OpenAI) -> None:
    plain = client.chat.completions.create(model="code-complete", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(
        model="code-complete",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=2,
        logprobs=True,
    )
    (choice,) = only.choices
    assert choice.logprobs is not None and choice.logprobs.content
    assert all(t.top_logprobs == [] for t in choice.logprobs.content)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        # Nothing generated is a prompt scored: only with echo. Chat echoes nothing.
        ("/v1/completions", {"logprobs": 2, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"logprobs": True, "echo": True}, "echo"),
        # vLLM's field for a prompt's logprobs: echo gives them, in OpenAI's shape.
        ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_logprobs_out_of_range_are_400s_naming_the_field(
    server: ServerThread, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "code-complete", "max_tokens": 2, **extra}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    answer = httpx.post(f"{server.url}{path}", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


# ---- echo: the prompt before the completion, with its tokens' logprobs ------------------


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
    asked: dict[str, Any] = {
        "model": "code-complete",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "echo": True,
        "logprobs": 2,
        "temperature": 0,
    }
    whole = client.completions.create(**asked)
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
    chunks = list(client.completions.create(**asked, stream=True))
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


def test_an_echo_of_nothing_scores_a_prompt_that_fills_the_context(
    client: OpenAI, decoder: Decoder
) -> None:
    """As vLLM: echo with max_tokens 0 makes no token, so its prompt may fill the
    context (lm-evaluation-harness scores such windows); finish_reason is vLLM's,
    length. A token more is refused, and without echo max_tokens 0 still is."""
    limit = decoder.config.max_position
    assert limit is not None
    ids = (decoder.encode("def f(x):\n    return x\n") * limit)[:limit]
    by_ids = client.completions.create(
        model="code-complete", prompt=ids, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = by_ids.choices
    assert (choice.text, choice.finish_reason) == (decoder.tokenizer.decode(ids), "length")
    assert by_ids.usage is not None
    assert (by_ids.usage.prompt_tokens, by_ids.usage.completion_tokens) == (limit, 0)
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == limit
    check_prompt(decoder, ids, choice.logprobs, 1)
    # A text prompt that fills the context, echoed without logprobs, and streamed.
    text = "a " * (limit - 2)  # tokens: bos, "a", then " a" per next one, and " "
    assert len(decoder.encode(text, 0)) == limit, "the test needs a prompt of the context"
    by_text = client.completions.create(model="code-complete", prompt=text, max_tokens=0, echo=True)
    assert (by_text.choices[0].text, by_text.choices[0].finish_reason) == (text, "length")
    chunks = list(
        client.completions.create(
            model="code-complete", prompt=text, max_tokens=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(BadRequestError) as over:
        client.completions.create(
            model="code-complete", prompt=[*ids, ids[0]], max_tokens=0, echo=True
        )
    assert (over.value.param, over.value.code) == ("prompt", "context_length_exceeded")
    assert f"{limit + 1} in the prompt, 0 for the completion" in over.value.message
    with pytest.raises(BadRequestError) as least:  # as vLLM: no token, so none at least
        client.completions.create(
            model="code-complete", prompt=ids, max_tokens=0, echo=True, extra_body={"min_tokens": 1}
        )
    assert least.value.param == "min_tokens" and "at most max_tokens (0)" in least.value.message
    with pytest.raises(BadRequestError) as unechoed:
        client.completions.create(model="code-complete", prompt=ids[:8], max_tokens=0)
    assert unechoed.value.param == "max_tokens"


def test_echo_offsets_never_go_back_where_tokens_split_a_character(
    client: OpenAI, decoder: Decoder
) -> None:
    # "π" is two byte tokens, each spelled U+FFFD: the prompt's tokens' texts are one
    # character longer than its text, and the completion's offsets go on from theirs.
    prompt = "def π(x"
    ids = decoder.encode(prompt)
    spelled = [decoder.tokenizer.decode([i]) for i in ids]
    assert sum(len(t) for t in spelled) > len(prompt)
    kwargs: dict[str, Any] = {"model": "code-complete", "prompt": prompt, "max_tokens": 3}
    whole = client.completions.create(**kwargs, echo=True, logprobs=1, temperature=0)
    streamed = client.completions.create(
        **kwargs, echo=True, logprobs=1, temperature=0, stream=True
    )
    assert whole.choices[0].logprobs is not None
    for lp in (whole.choices[0].logprobs.model_dump(), joined(list(streamed))[0][1]):
        tokens, offsets = lp["tokens"], lp["text_offset"]
        assert len(tokens) == len(ids) + 3
        # Each token starts where the one before it ends, counted by their texts.
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


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
