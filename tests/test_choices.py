"""`n` choices per prompt on /v1/completions and /v1/chat/completions
(serving/generate_routes.py): each choice its own sequence and its own generator
(choice j's seed derived from the request's), completions' choices in OpenAI's order,
the prompt counted once in `usage`, and n times the prompts bounded as a list of
prompts is. A real uvicorn on 127.0.0.1, the demo tinycode decoder, the official
`openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from lanes.tasks.sampling import choice_seed
from tests.gates import Gate, stepping, wait_until
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

WORKLOADS = """\
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 4}
    generation: {max_new_tokens: 8}
  short-queue:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 2, max_queue: 4}
    generation: {max_new_tokens: 4}
"""
PROMPTS = ["def f(x", "import os\n"]
MESSAGES: Any = [{"role": "user", "content": "Write a loop"}]
MAX_INPUTS = 8
GATE = Gate()  # open but where a test closes it: holds the decoder's runs


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("choices"), demo_models, WORKLOADS)
    gates = {"tinycode": GATE}
    with ServerThread(spec, gates=gates, max_inputs_per_request=MAX_INPUTS) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def streamed(chunks: Any) -> tuple[dict[int, str], dict[int, list[str]], Any]:
    """Per choice index its text and its finish reasons (one each, when whole), and the
    stream's usage."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, usage


def test_a_list_of_prompts_gets_n_choices_each_in_openais_order(client: OpenAI) -> None:
    asked: Any = {"model": "code-complete", "prompt": PROMPTS, "temperature": 1, "seed": 7}
    whole = client.completions.create(**asked, n=3, max_tokens=8)
    assert [c.index for c in whole.choices] == list(range(6))
    texts = [c.text for c in whole.choices]
    assert client.completions.create(**asked, n=3, max_tokens=8).choices == whole.choices
    for i in range(len(PROMPTS)):
        assert len(set(texts[i * 3 : i * 3 + 3])) > 1, "each choice draws on its own"
    # Choice 0 keeps the request's seed: it is what n = 1 draws.
    alone = client.completions.create(**asked, max_tokens=8)
    assert [c.text for c in alone.choices] == [texts[0], texts[3]]
    assert whole.usage is not None and alone.usage is not None
    assert whole.usage.prompt_tokens == alone.usage.prompt_tokens  # each prompt once

    chunks = client.completions.create(
        **asked, n=3, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    by_index, finishes, usage = streamed(chunks)
    assert by_index == dict(enumerate(texts))
    assert finishes == {i: [c.finish_reason] for i, c in enumerate(whole.choices)}
    assert usage == whole.usage


def test_completion_tokens_sum_every_choice(client: OpenAI) -> None:
    answer = client.completions.create(
        model="code-complete",
        prompt=PROMPTS,
        n=2,
        max_tokens=5,
        temperature=1,
        extra_body={"ignore_eos": True},
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 4 * 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 4 * 5


def test_a_chat_gets_n_choices_streamed_and_whole(client: OpenAI) -> None:
    asked: Any = {"model": "code-complete", "messages": MESSAGES, "temperature": 1, "seed": 3}
    whole = client.chat.completions.create(**asked, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]
    assert all(c.message.role == "assistant" for c in whole.choices)
    alone = client.chat.completions.create(**asked)
    assert whole.usage is not None and alone.usage is not None
    assert whole.usage.prompt_tokens == alone.usage.prompt_tokens

    chunks = list(
        client.chat.completions.create(
            **asked, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    by_index, finishes, usage = streamed(chunks)
    assert by_index == dict(enumerate(texts))
    assert finishes == {i: [c.finish_reason] for i, c in enumerate(whole.choices)}
    assert usage == whole.usage
    firsts: dict[int, Any] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.delta)
    assert {i: d.role for i, d in firsts.items()} == {0: "assistant", 1: "assistant"}


def test_greedy_choices_are_equal(client: OpenAI) -> None:
    answer = client.completions.create(
        model="code-complete", prompt=PROMPTS[0], n=3, temperature=0, max_tokens=8
    )
    assert len({c.text for c in answer.choices}) == 1
    chat = client.chat.completions.create(
        model="code-complete", messages=MESSAGES, n=3, temperature=0
    )
    assert len({c.message.content for c in chat.choices}) == 1


def test_each_choice_has_its_logprobs_and_its_echo(client: OpenAI) -> None:
    asked: Any = {"model": "code-complete", "prompt": PROMPTS, "temperature": 1, "seed": 11}
    scored = client.completions.create(**asked, n=2, max_tokens=4, logprobs=1)
    for choice in scored.choices:
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert "".join(choice.logprobs.tokens) == choice.text
    echoed = client.completions.create(**asked, n=2, max_tokens=4, echo=True, logprobs=1)
    heads: list[tuple[list[str], list[float | None]]] = []
    for i, (choice, plain) in enumerate(zip(echoed.choices, scored.choices, strict=True)):
        assert choice.text == PROMPTS[i // 2] + plain.text
        assert choice.logprobs is not None and plain.logprobs is not None
        tokens, generated = choice.logprobs.tokens or [], plain.logprobs.tokens or []
        cut = len(tokens) - len(generated)
        assert tokens[cut:] == generated
        assert "".join(tokens[:cut]) == PROMPTS[i // 2]
        heads.append((tokens[:cut], (choice.logprobs.token_logprobs or [])[:cut]))
    # Each choice repeats its prompt, scored alike.
    assert heads[0] == heads[1] and heads[2] == heads[3]

    streamed_echo = client.completions.create(**asked, n=2, max_tokens=4, echo=True, stream=True)
    by_index, _, _ = streamed(streamed_echo)
    assert by_index == {i: c.text for i, c in enumerate(echoed.choices)}


def test_n_times_the_prompts_over_the_limit_or_the_queue_is_a_400_naming_n(
    server: ServerThread,
) -> None:
    url = server.url
    over_inputs = {"model": "code-complete", "prompt": ["a", "b", "c"], "n": 3}
    over_queue = {"model": "short-queue", "prompt": "a", "n": 5}
    chat_over_queue = {"model": "short-queue", "messages": MESSAGES, "n": 5}
    for path, body, limit in (
        ("/v1/completions", over_inputs, MAX_INPUTS),
        ("/v1/completions", over_queue, 4),
        ("/v1/chat/completions", chat_over_queue, 4),
    ):
        answer = httpx.post(f"{url}{path}", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "n"
        assert f"over {limit}" in error["message"]
    fits = httpx.post(f"{url}/v1/completions", json={**over_queue, "n": 4, "max_tokens": 1})
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"]) == 4


def test_best_of_is_n_or_1(server: ServerThread) -> None:
    body = {"model": "code-complete", "prompt": "a", "n": 3, "max_tokens": 2}
    for best_of, status in ((3, 200), (1, 200), (2, 400)):
        answer = httpx.post(f"{server.url}/v1/completions", json={**body, "best_of": best_of})
        assert answer.status_code == status, answer.text
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "best_of": 2}).json()
    assert refused["error"]["param"] == "best_of" and "n (3)" in refused["error"]["message"]


def test_each_choice_has_a_seed_of_its_own_that_a_rerun_repeats() -> None:
    for seed in (7, -(2**63), 2**63 - 1):
        seeds = [choice_seed(seed, j) for j in range(128)]
        assert seeds[0] == seed  # n = 1 draws as it did
        assert len(set(seeds)) == 128
        assert all(s is not None and -(2**63) <= s < 2**63 for s in seeds)  # OpenAI's range
        assert seeds == [choice_seed(seed, j) for j in range(128)]
    assert choice_seed(None, 3) is None  # unseeded: each its own fresh entropy


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when the series has no sample yet)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_leaves_aborts_every_choice(server: ServerThread) -> None:
    def aborts() -> float:
        finished = "lanes_sequences_finished_total"
        return metric(server, finished, workload="code-complete", reason="abort")

    before = aborts()
    body = {"model": "code-complete", "prompt": "def f(x", "max_tokens": 400, "n": 3}
    body |= {"stream": True, "ignore_eos": True, "temperature": 1}
    with GATE.closed():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as answer:
            assert answer.status_code == 200
            GATE.wait_held()  # its choices are in the engine, their run held
        # The client left: each of the three leaves at the engine's next step.
        wait_until(stepping(GATE, lambda: aborts() == before + 3), "three choices aborted")
    in_flight = metric(server, "lanes_sequences_in_flight", workload="code-complete")
    assert in_flight == 0
