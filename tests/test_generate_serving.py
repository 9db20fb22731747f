"""Generate workloads over real HTTP: a real uvicorn on 127.0.0.1, the demo tinycode
decoder, the official `openai` client, continuous batching, SSE and guards."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, ContentFilterFinishReasonError, OpenAI

from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.spectypes import MAX_STOP_CHARS
from lanes.tasks import GenerateTask, load_task
from tests.gates import Gate, JumpClock, eventually, stepping, wait_until
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

# The server's decoder runs wait here while a test holds it closed; its clock jumps
# when a test needs a deadline to pass.
GATE = Gate()
CLOCK = JumpClock()
HOUR_MS = "3600000"  # a deadline no step can reach unless the clock jumps

GUARD_EVERY = 4
KV_TOKENS = 64
TINYCODE_TOKEN_BYTES = 4 * 2 * 4 * 32 * 4  # layers x (key, value) x heads x head_dim x float32
GUARD_MODULE = "lanes_test_guard"
REFUSE_MODULE = "lanes_test_refuse"  # a guard that fails every text
TRIM_MODULE = "lanes_test_trim"  # a handler with only pre: every request asks 2 tokens
CANDIDATES = [
    "    def __repr__(self):\n        return",
    "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv[1:]:\n        if",
    "class Foo:\n    def __init__(self, name",
    "def f(x",
    "try:\n    import",
    "    return self._",
    "for i in range(",
    "if __name__ == ",
]


def workloads(models: Path, guard: str) -> str:
    tiny = f"{{path: {models}/tinycode/model.onnx, tokenizer: {models}/tinycode/tokenizer.json}}"
    greedy = "generation: {max_new_tokens: 16, temperature: 0}"
    return f"""\
version: 1
models:
  tinycode: {tiny}
workloads:
  code:
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: 16}}
    {greedy}
  one-lane:                    # one row and one waiting place: queues fill at once
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: 1, max_queue: 1}}
    {greedy}
  pair:                        # one row, room to wait: a list's second prompt waits
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: 1, max_queue: 4}}
    {greedy}
  budgeted:                    # KV cache for 64 tokens (KV_TOKENS) in flight at most
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_kv_bytes: {KV_TOKENS * TINYCODE_TOKEN_BYTES}}}
    {greedy}
  streamer:                    # answers as Server-Sent Events unless a request says not
    mode: interactive
    task: generate
    model: tinycode
    stream: true
    {greedy}
  guarded-buffer:
    mode: interactive
    task: generate
    model: tinycode
    {greedy}
    guard: {{handler: "{guard}", mode: buffer}}
  guarded-chunked:
    mode: interactive
    task: generate
    model: tinycode
    {greedy}
    guard: {{handler: "{guard}", mode: chunked, every_tokens: {GUARD_EVERY}}}
  refusing:                    # its guard fails every text: any prompt is blocked
    mode: interactive
    task: generate
    model: tinycode
    {greedy}
    guard: {{handler: "{REFUSE_MODULE}:everything", mode: buffer}}
  trimmed:
    mode: interactive
    task: generate
    model: tinycode
    handler: {TRIM_MODULE}:trim
    {greedy}
"""


@dataclass(frozen=True)
class Found:
    """A prompt whose greedy text first shows `term` after its first two guard chunks,
    and a prompt whose text never shows it."""

    prompt: str
    text: str
    before: str  # the text of the first 2 * GUARD_EVERY tokens
    term: str
    clean_prompt: str


def find_term(task: GenerateTask) -> Found:
    decode = task.decoder.tokenizer.decode
    texts = {}
    for prompt in CANDIDATES:
        texts[prompt] = task.complete(task.prepare({"prompt": prompt, "max_tokens": 16}))
    for prompt, completion in texts.items():
        before = decode(completion.tokens[: 2 * GUARD_EVERY])
        for k in range(2 * GUARD_EVERY, len(completion.tokens)):
            term = decode(completion.tokens[k : k + 1]).strip()
            if len(term) < 2 or completion.text.lower().find(term.lower()) < len(before):
                continue
            clean = [p for p, c in texts.items() if term.lower() not in c.text.lower()]
            if clean:
                return Found(prompt, completion.text, before, term, clean[0])
    pytest.fail(f"no usable guard term in the demo model's greedy texts: {texts}")


@pytest.fixture(scope="module")
def setup(
    demo_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerThread, GenerateTask, Found]]:
    folder = tmp_path_factory.mktemp("generate")
    spec_path = folder / "workloads.yaml"
    (folder / f"{TRIM_MODULE}.py").write_text(
        "class Trim:\n"
        "    def pre(self, item):\n"
        "        return {**item, 'max_tokens': 2}\n\n\n"
        "trim = Trim()\n"
    )
    # The blocked term comes from the model's own greedy texts, so the guard module
    # beside the spec is written after a first load with the demo's guard.
    spec_path.write_text(workloads(demo_models, "lanes.demo.guard:blocklist"))
    (folder / f"{REFUSE_MODULE}.py").write_text("def everything(text):\n    return 1.0\n")
    task = load_task("code", load_spec(spec_path, Settings()), Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    found = find_term(task)
    (folder / f"{GUARD_MODULE}.py").write_text(
        "from lanes.demo.guard import make_blocklist\n\n"
        f"blocked = make_blocklist([{found.term!r}])\n"
    )
    spec_path.write_text(workloads(demo_models, f"{GUARD_MODULE}:blocked"))
    # The spec's folder is on the import path: the guard module beside it imports.
    with ServerThread(spec_path, gates={"tinycode": GATE}, clock=CLOCK) as server:
        yield server, task, found


@pytest.fixture(scope="module")
def server(setup: tuple[ServerThread, GenerateTask, Found]) -> ServerThread:
    return setup[0]


@pytest.fixture(scope="module")
def task(setup: tuple[ServerThread, GenerateTask, Found]) -> GenerateTask:
    return setup[1]


@pytest.fixture(scope="module")
def found(setup: tuple[ServerThread, GenerateTask, Found]) -> Found:
    return setup[2]


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when the series has no sample yet)."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def sse(
    server: ServerThread, path: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> list[dict[str, object]]:
    """Every event of a streamed answer, up to [DONE] (which must come last)."""
    events: list[dict[str, object]] = []
    with httpx.stream(
        "POST", f"{server.url}{path}", json={**body, "stream": True}, headers=headers, timeout=30
    ) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line.removeprefix("data: ")))
    return events


def streamed_text(events: list[dict[str, object]]) -> tuple[str, str | None]:
    text, finish = [], None
    for event in events:
        for choice in event["choices"]:  # type: ignore[attr-defined]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


def test_openai_client_streams_a_chat_and_a_completion(server: ServerThread) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "a class"},
    ]
    whole = client.chat.completions.create(model="code", messages=messages, max_tokens=12)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(model="code", messages=messages, max_tokens=12, stream=True)  # type: ignore[arg-type]
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert whole.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"
    assert whole.usage is not None and whole.usage.completion_tokens == 12

    prompt = "def main(argv):\n    "
    once = client.completions.create(model="code", prompt=prompt, max_tokens=10)
    stream = client.completions.create(
        model="code",
        prompt=prompt,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert parts[-1].choices == [] and parts[-1].usage == once.usage
    assert "".join(p.choices[0].text for p in parts if p.choices) == once.choices[0].text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"


def test_chat_prompt_is_the_documented_template(server: ServerThread, task: GenerateTask) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="code", messages=messages, max_tokens=6)  # type: ignore[arg-type]
    plain = client.completions.create(
        model="code", prompt="<|user|>\nhi\n<|assistant|>\n", max_tokens=6
    )
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage is not None and plain.usage is not None
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


async def test_16_concurrent_greedy_requests_match_each_alone(
    server: ServerThread, task: GenerateTask
) -> None:
    prompts = [(CANDIDATES[i % len(CANDIDATES)] + " x" * i, 4 + i) for i in range(16)]
    alone = [task.complete(task.prepare({"prompt": p, "max_tokens": n})) for p, n in prompts]
    before = {
        name: metric(server, name, workload="code")
        for name in (
            "lanes_batch_size_sum",
            "lanes_batch_size_count",
            "lanes_generated_tokens_total",
            "lanes_prefill_seconds_count",
        )
    }
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with GATE.closed():  # the first prefill waits at the gate, so the others queue behind it
        (p, n), *others = prompts
        calls = [
            asyncio.create_task(client.completions.create(model="code", prompt=p, max_tokens=n))
        ]
        await asyncio.to_thread(GATE.wait_held)
        calls += [
            asyncio.create_task(client.completions.create(model="code", prompt=p, max_tokens=n))
            for p, n in others
        ]
        await eventually(
            lambda: metric(server, "lanes_queue_depth", workload="code") == 15,
            "the other 15 requests queued behind the first",
        )
    answers = await asyncio.gather(*calls)
    await client.close()
    for want, got in zip(alone, answers, strict=True):
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage is not None and got.usage.completion_tokens == want.completion_tokens
    delta = {name: metric(server, name, workload="code") - value for name, value in before.items()}
    assert delta["lanes_batch_size_sum"] / delta["lanes_batch_size_count"] > 2, "rows share steps"
    # No prefix is ever recomputed: one prefill per request at most, and every token
    # costs one row of one decode step (the first comes from the prefill; an eos that
    # ends a text is a token made, counted as usage counts it).
    assert delta["lanes_prefill_seconds_count"] <= 16
    assert delta["lanes_generated_tokens_total"] == sum(c.completion_tokens for c in alone)
    assert delta["lanes_batch_size_sum"] + 16 == delta["lanes_generated_tokens_total"]


async def joined(stream: Any) -> list[str]:
    """Each choice's text of a streamed completion, by index."""
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return [texts[i] for i in sorted(texts)]


async def test_a_seeded_request_draws_the_same_alone_and_beside_any_others(
    server: ServerThread,
) -> None:
    """As vLLM: a seed fixes a request's sampled text, streamed or not, whatever runs
    beside it (unseeded, seeded, greedy, longer or shorter); with n its choices are
    each other's equals only by chance, and the same again."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    seeded: Any = {"model": "code", "prompt": "def f(x", "max_tokens": 12, "temperature": 1.5}
    seeded |= {"seed": 1234, "extra_body": {"ignore_eos": True}}

    async def texts(**more: Any) -> list[str]:
        if more.get("stream"):
            return await joined(await client.completions.create(**seeded, **more))
        return [c.text for c in (await client.completions.create(**seeded, **more)).choices]

    (alone,) = await texts()
    choices = await texts(n=3)
    assert choices[0] == alone and len(set(choices)) == 3, "n draws three, the first as n = 1"
    assert await texts(stream=True) == [alone]

    beside: list[dict[str, Any]] = [
        {"prompt": "import os\n", "max_tokens": 3, "temperature": 1.5},  # unseeded, shorter
        {"prompt": "class Foo:\n    def", "max_tokens": 30, "temperature": 1, "seed": 7},
        {"prompt": "for i in range(", "max_tokens": 9, "temperature": 0},
    ]
    with GATE.closed():  # the first prefill waits at the gate, so the others queue behind it
        longest = {"prompt": "try:\n    import", "max_tokens": 40, "temperature": 2}
        first = asyncio.ensure_future(
            client.completions.create(model="code", **longest, extra_body={"ignore_eos": True})
        )
        await asyncio.to_thread(GATE.wait_held)
        again = [
            asyncio.ensure_future(texts()),
            asyncio.ensure_future(texts(stream=True)),
            asyncio.ensure_future(texts(n=3, stream=True)),
        ]
        others = [
            asyncio.ensure_future(client.completions.create(model="code", **item))
            for item in beside
        ]
        await eventually(
            lambda: metric(server, "lanes_queue_depth", workload="code") == 8,
            "the seeded sequences (3 of them choices) and the others queued behind the first",
        )
    assert await asyncio.gather(*again) == [[alone], [alone], choices]
    await asyncio.gather(first, *others)
    await client.close()


async def test_unseeded_requests_draw_apart(server: ServerThread) -> None:
    """Without a seed each request, and each of its choices, draws from fresh entropy:
    16 tokens at temperature 2 are the same twice only by a chance far below any flake."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    asked: Any = {"model": "code", "prompt": "def f(x", "max_tokens": 16, "temperature": 2}
    asked |= {"extra_body": {"ignore_eos": True}}
    first, second = [await client.completions.create(**asked) for _ in range(2)]
    assert first.choices[0].text != second.choices[0].text
    choices = (await client.completions.create(**asked, n=3)).choices
    assert len({c.text for c in choices}) == 3
    await client.close()


def test_stop_strings_cut_the_text_streamed_or_not(server: ServerThread, found: Found) -> None:
    body = {
        "model": "code",
        "prompt": found.prompt,
        "max_tokens": 16,
        "stop": ["\x00never", found.term],
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    cut = found.text[: found.text.find(found.term)]
    assert whole["choices"][0]["text"] == cut
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert streamed_text(sse(server, "/v1/completions", body)) == (cut, "stop")


def test_text_that_cannot_begin_a_stop_string_is_streamed_at_once(server: ServerThread) -> None:
    """A stop string of the most characters a request may send holds back no text
    that cannot begin it."""
    longest = "\u0100" + "y" * (MAX_STOP_CHARS - 1)
    body = {"model": "code", "prompt": "def f(x", "stop": [longest]}
    url = f"{server.url}/v1/completions"
    first = httpx.post(url, json={**body, "max_tokens": 1}, timeout=30).json()["choices"][0]
    whole = httpx.post(url, json={**body, "max_tokens": 8}, timeout=30).json()["choices"][0]
    assert first["text"] and whole["finish_reason"] == "length"
    with GATE.closed():
        GATE.allow(1)  # the prefill: the first token; the next step waits
        stream = {**body, "max_tokens": 8, "stream": True}
        with httpx.stream("POST", url, json=stream, timeout=30) as answer:
            lines = (line for line in answer.iter_lines() if line)
            event = json.loads(next(lines).removeprefix("data: "))
            assert event["choices"][0]["text"] == first["text"]
            GATE.open()
            rest = list(lines)
    assert rest.pop() == "data: [DONE]"
    events = [event, *(json.loads(line.removeprefix("data: ")) for line in rest)]
    assert streamed_text(events) == (whole["text"], "length")


def test_a_workload_that_streams_still_answers_whole_unless_asked_to_stream(
    server: ServerThread,
) -> None:
    """OpenAI's default: no `stream` is not streamed; the workload's `stream:` is the
    SDK's and CLI's default only."""
    body = {"model": "streamer", "prompt": "def ", "max_tokens": 4}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["usage"]["completion_tokens"] == 4
    events = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert events.headers["content-type"].startswith("text/event-stream")
    assert events.text.endswith("data: [DONE]\n\n")


def aborts(server: ServerThread) -> float:
    return metric(server, "lanes_sequences_finished_total", workload="code", reason="abort")


def wait_aborted(server: ServerThread, before: float) -> None:
    """Until `code` has aborted one more sequence. The step the gate holds may still
    run it (the abort may reach the engine after that step's plan), so the runs held
    meanwhile are let through, one at a time."""
    wait_until(stepping(GATE, lambda: aborts(server) > before), "the server aborting the sequence")


def test_a_disconnect_frees_its_row(server: ServerThread) -> None:
    aborted = aborts(server)
    body = {
        "model": "code",
        "prompt": "def f(x",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with GATE.closed():
        GATE.allow(2)  # the prefill and one decode step; the next step waits: the row is held
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()
            assert next(lines).startswith("data: ")
            GATE.wait_held()
            assert metric(server, "lanes_sequences_in_flight", workload="code") == 1

        # The client left: the engine frees its row at its next step.
        wait_aborted(server, aborted)
        assert aborts(server) == aborted + 1
        assert metric(server, "lanes_sequences_in_flight", workload="code") == 0
    assert metric(server, "lanes_generated_tokens_total", workload="code") > 0
    assert metric(server, "lanes_time_to_first_token_seconds_count", workload="code") > 0
    assert metric(server, "lanes_inter_token_latency_seconds_count", workload="code") > 0


def test_kv_cache_bytes_show_what_a_held_rows_cache_holds(server: ServerThread) -> None:
    """A row held open after its prefill and one decode step: lanes_kv_cache_bytes is its
    cache exactly (its prompt and the token fed since: one row, nothing padded), the
    peak at least that step's past beside its present. Once a request completes and the
    batch is empty, the cache is freed: 0."""
    prompt = [5, 6, 7, 8, 9, 10]  # token ids: exactly these positions
    body = {"model": "code", "prompt": prompt, "max_tokens": 400, "stream": True}
    cached = (len(prompt) + 1) * TINYCODE_TOKEN_BYTES

    def cache_bytes() -> float:
        return metric(server, "lanes_kv_cache_bytes", workload="code")

    aborted = aborts(server)
    with GATE.closed():
        GATE.allow(2)  # the prefill and one decode step; the next step waits: the row is held
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")
            GATE.wait_held()
            wait_until(lambda: cache_bytes() == cached, f"lanes_kv_cache_bytes at {cached}")
            peak = metric(server, "lanes_kv_cache_peak_bytes", workload="code")
            assert peak >= cached + len(prompt) * TINYCODE_TOKEN_BYTES
        wait_aborted(server, aborted)
    done = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "code", "prompt": prompt, "max_tokens": 2},
        timeout=30,
    )
    assert done.status_code == 200, done.text
    wait_until(lambda: cache_bytes() == 0, "lanes_kv_cache_bytes at 0 with no rows")


def test_a_client_gone_before_its_first_token_is_a_499_and_frees_its_row(
    server: ServerThread,
) -> None:
    route = {"route": "/v1/completions"}
    gone = metric(server, "lanes_responses_total", **route, code="499")
    before = {c: metric(server, "lanes_responses_total", **route, code=c) for c in ("500", "503")}
    aborted = aborts(server)
    body = json.dumps(
        {"model": "code", "prompt": "def f(x", "max_tokens": 400, "stream": True}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with GATE.closed():  # its prefill waits: no first token, no answer started
        with socket.create_connection(("127.0.0.1", server.settings.port)) as sock:
            sock.sendall(head.encode() + body)
            GATE.wait_held()
        # Answered at once, the engine still held: nobody reads it, nothing failed.
        wait_until(
            lambda: metric(server, "lanes_responses_total", **route, code="499") > gone,
            "the abandoned request counted as 499",
        )
        wait_aborted(server, aborted)
    assert metric(server, "lanes_sequences_in_flight", workload="code") == 0
    for code in ("500", "503"):
        assert metric(server, "lanes_responses_total", **route, code=code) == before[code]


async def test_full_queue_503_and_deadlines(server: ServerThread) -> None:
    """one-lane has one row and one waiting place. A gate holds the row's sequence
    in a step for as long as the test needs; the clock's jumps pass deadlines."""
    url = f"{server.url}/v1/completions"
    long = {
        "model": "one-lane",
        "prompt": "def f(x",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }

    def queued() -> bool:
        return metric(server, "lanes_queue_depth", workload="one-lane") == 1

    def free() -> bool:
        return metric(server, "lanes_sequences_in_flight", workload="one-lane") == 0

    async with httpx.AsyncClient(timeout=30) as client:
        with GATE.closed():
            GATE.allow(1)  # its prefill: the first token, then its next step waits
            async with client.stream("POST", url, json=long) as running:
                lines = running.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # it holds the only row
                await asyncio.to_thread(GATE.wait_held)
                waiting = asyncio.create_task(
                    client.post(url, json={"model": "one-lane", "prompt": "x", "max_tokens": 2})
                )
                await eventually(queued, "a request waiting for the row")
                refused = await client.post(url, json={"model": "one-lane", "prompt": "y"})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "overloaded"
        assert (await waiting).status_code == 200  # the disconnect above freed the row

        # A deadline that passes while the request waits for a row: 504, before any token.
        with GATE.closed():
            GATE.allow(1)
            async with client.stream("POST", url, json=long) as running:
                lines = running.aiter_lines()  # keep it: a dropped iterator closes the response
                assert (await anext(lines)).startswith("data: ")
                await asyncio.to_thread(GATE.wait_held)
                late = asyncio.create_task(
                    client.post(
                        url,
                        json={"model": "one-lane", "prompt": "z"},
                        headers={"X-Timeout-Ms": HOUR_MS},
                    )
                )
                await eventually(queued, "a request waiting for the row")
                CLOCK.jump(7200)
                # The running one's step, then the next: its plan sees the deadline.
                GATE.allow(2)
                assert (await late).status_code == 504
                await asyncio.to_thread(GATE.wait_held)  # and the running one holds its row still
        await eventually(free, "the row freed by the disconnect")

        # A deadline that passes before the first token answers 504, not one token...
        late_body = {**long, "stream": False}
        with GATE.closed():  # even its prefill waits
            early = asyncio.create_task(
                client.post(url, json=late_body, headers={"X-Timeout-Ms": HOUR_MS})
            )
            await asyncio.to_thread(GATE.wait_held)  # admitted: its prefill is on the model
            CLOCK.jump(7200)
            GATE.allow(1)  # the prefill ends past the deadline
            answer = await early
        assert answer.status_code == 504
        await eventually(free, "the row freed by the deadline")

        # ...and one that passes while the sequence runs cuts it like max_tokens.
        with GATE.closed():
            cut = asyncio.create_task(
                client.post(url, json=late_body, headers={"X-Timeout-Ms": HOUR_MS})
            )
            await asyncio.to_thread(GATE.wait_held)  # its prefill
            GATE.allow(1)  # the first token
            await asyncio.to_thread(GATE.wait_held)  # its first decode step
            CLOCK.jump(7200)
            GATE.allow(1)  # the second token; the next plan finds it late
            answer = await cut
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert answer.json()["usage"]["completion_tokens"] == 2


def sse_events(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line]


# A list of two prompts, or one prompt's two choices (n): two sequences either way.
@pytest.mark.parametrize(
    "two", [{"prompt": ["def f(x", "class A"]}, {"prompt": "def f(x", "n": 2}], ids=["list", "n"]
)
async def test_a_streamed_list_starts_at_once_and_a_late_prompt_fails_alone(
    server: ServerThread, two: dict[str, object]
) -> None:
    """`pair` has one row: a list's second prompt (or choice) waits for the first to
    finish. The stream starts before either has a token, the first's text comes while
    the second waits, and the second's deadline passing before its first token ends it
    alone."""
    url = f"{server.url}/v1/completions"
    body = {"model": "pair", **two, "max_tokens": 3, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        first_prompt = {**body, "prompt": "def f(x", "n": 1}
        alone = (await client.post(url, json=first_prompt)).json()
        with GATE.closed():  # even the first prompt's prefill waits
            stream = {**body, "stream": True}
            late = {"X-Timeout-Ms": HOUR_MS}
            async with client.stream("POST", url, json=stream, headers=late) as answer:
                # Admitted and valid: the answer has started, no token made yet.
                assert answer.status_code == 200
                assert answer.headers["content-type"].startswith("text/event-stream")
                lines = answer.aiter_lines()
                GATE.allow(3)  # the first prompt's prefill and two decode steps: its 3 tokens
                first: list[str] = []
                while not any('"finish_reason":"length"' in line for line in first):
                    first.append(await anext(lines))
                await asyncio.to_thread(GATE.wait_held)  # the second's prefill
                CLOCK.jump(7200)
                GATE.allow(1)  # it ends past the deadline: no token in time
                rest = [line async for line in lines]
    events = sse_events(first)
    assert all(e["choices"][0]["index"] == 0 for e in events)  # type: ignore[index]
    assert streamed_text(events) == (alone["choices"][0]["text"], "length")
    done = [line for line in rest if line]
    assert done[-1] == "data: [DONE]"
    (failed,) = sse_events(done[:-1])
    assert failed["error"]["index"] == 1  # type: ignore[index]
    assert failed["error"]["code"] == "timeout"  # type: ignore[index]


def test_a_streamed_list_of_prompts_streams_each_choice_by_index(server: ServerThread) -> None:
    """17 prompts on 16 rows: each choice's chunks add up to its text answered whole."""
    prompts = [*CANDIDATES, *CANDIDATES, "def g("]
    body = {"model": "code", "prompt": prompts, "max_tokens": 6}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    events = sse(server, "/v1/completions", body)
    for i, choice in enumerate(whole["choices"]):
        mine = [e for e in events if e["choices"][0]["index"] == i]  # type: ignore[index]
        assert streamed_text(mine) == (choice["text"], choice["finish_reason"]), i


def test_buffer_guard_holds_the_stream_until_the_whole_text_passed(
    server: ServerThread, found: Found
) -> None:
    blocked = {"model": "guarded-buffer", "prompt": found.prompt, "max_tokens": 16}
    whole = httpx.post(f"{server.url}/v1/completions", json=blocked, timeout=30).json()
    assert whole["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "content_filter",
    }
    events = sse(server, "/v1/completions", blocked)
    assert streamed_text(events) == ("", "content_filter")
    clean = {**blocked, "prompt": found.clean_prompt}
    events = sse(server, "/v1/completions", clean)
    texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["text"]]  # type: ignore[index]
    assert len(texts) == 1, "buffer mode sends the text in one piece"
    alone = httpx.post(f"{server.url}/v1/completions", json={**clean, "model": "code"}).json()
    assert streamed_text(events) == (alone["choices"][0]["text"], "length")


def test_a_blocked_stream_is_one_chunk_with_its_finish(server: ServerThread) -> None:
    """As the README's buffer mode says: on a failure the client sees only
    finish_reason content_filter, no empty text chunk before it (a chat's role rides
    on that chunk), then the usage chunk where asked."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    usage = {"include_usage": True}
    messages = [{"role": "user", "content": "a class"}]
    chat = list(
        client.chat.completions.create(
            model="refusing", messages=messages, max_tokens=4, stream=True, stream_options=usage
        )  # type: ignore[call-overload]
    )
    assert [c.choices[0].finish_reason for c in chat[:-1]] == ["content_filter"]
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[0].choices[0].delta.content is None
    assert chat[-1].choices == [] and chat[-1].usage is not None
    # The SDK's stream helper reads such a stream as a refusal.
    helper = client.chat.completions.stream(model="refusing", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    with helper as stream, pytest.raises(ContentFilterFinishReasonError):
        stream.get_final_completion()
    text = list(
        client.completions.create(
            model="refusing", prompt="def f(x", max_tokens=4, stream=True, stream_options=usage
        )
    )
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in text[:-1]] == [
        ("", "content_filter")
    ]
    assert text[-1].choices == [] and text[-1].usage is not None


def test_chunked_guard_cuts_the_stream_before_the_failing_chunk(
    server: ServerThread, found: Found
) -> None:
    before = metric(server, "lanes_guard_blocked_total", workload="guarded-chunked", mode="chunked")
    body = {"model": "guarded-chunked", "prompt": found.prompt, "max_tokens": 16}
    events = sse(server, "/v1/completions", body)
    text, finish = streamed_text(events)
    assert finish == "content_filter"
    assert found.term.lower() not in text.lower()
    assert found.text.startswith(text) and text, "the chunks before the failing one were sent"
    assert len(text) <= found.text.lower().find(found.term.lower())
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert whole["choices"][0]["finish_reason"] == "content_filter"
    assert whole["choices"][0]["text"] == ""
    clean = {**body, "prompt": found.clean_prompt}
    events = sse(server, "/v1/completions", clean)
    alone = httpx.post(f"{server.url}/v1/completions", json={**clean, "model": "code"}).json()
    assert streamed_text(events) == (
        alone["choices"][0]["text"],
        alone["choices"][0]["finish_reason"],
    )
    pieces = [e for e in events if e["choices"] and e["choices"][0]["text"]]  # type: ignore[index]
    assert len(pieces) > 1 or len(alone["choices"][0]["text"]) <= 1, "chunks, not one piece"
    after = metric(server, "lanes_guard_blocked_total", workload="guarded-chunked", mode="chunked")
    assert after >= before + 2


@pytest.mark.parametrize("model", ["guarded-buffer", "guarded-chunked"])
def test_a_guarded_stream_sends_every_tokens_logprobs_with_the_text_that_passed(
    server: ServerThread, found: Found, model: str
) -> None:
    body = {"model": model, "prompt": found.clean_prompt, "max_tokens": 16, "logprobs": 1}
    alone = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "code"}).json()
    (want,) = alone["choices"]
    tokens: list[str] = []
    for event in sse(server, "/v1/completions", body):
        for choice in event["choices"]:  # type: ignore[attr-defined]
            tokens += (choice["logprobs"] or {}).get("tokens", [])
    assert tokens == want["logprobs"]["tokens"]
    assert len(tokens) == alone["usage"]["completion_tokens"]
    whole = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert whole["choices"][0]["logprobs"]["tokens"] == tokens


def test_bad_generate_requests_get_openai_errors(server: ServerThread) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    # n is served (tests/test_choices.py); past 128 it is out of range, as OpenAI's.
    with pytest.raises(BadRequestError, match="n"):
        client.completions.create(model="code", prompt="x", n=129)
    bad = [
        ({"model": "code", "prompt": ["a", 5]}, 400, "prompt[1]: "),
        ({"model": "code", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "code", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "code", "prompt": "x", "stop": 3}, 400, "stop"),
        ({"model": "code"}, 400, "prompt"),
        ({"model": "ghost", "prompt": "x"}, 404, "ghost"),
    ]
    for body, status, words in bad:
        answer = httpx.post(f"{server.url}/v1/completions", json=body)
        assert answer.status_code == status, (body, answer.text)
        assert words in answer.json()["error"]["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "code", "messages": []})
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]
    streamed = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "ghost", "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    assert streamed.status_code == 404
    assert (
        httpx.post(
            f"{server.url}/v1/completions", json={"model": "code", "prompt": "x"}
        ).status_code
        == 200
    )


def test_a_request_whose_kv_cache_could_exceed_the_budget_is_a_400_naming_max_tokens(
    server: ServerThread, task: GenerateTask
) -> None:
    """Refused at once, as a prompt over the context is: it could never be admitted."""
    assert task.decoder.position_bytes == TINYCODE_TOKEN_BYTES
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="budgeted", prompt="x", max_tokens=KV_TOKENS)
    assert caught.value.param == "max_tokens"
    assert f"batching.max_kv_bytes ({KV_TOKENS * TINYCODE_TOKEN_BYTES} bytes)" in str(caught.value)
    fits = client.completions.create(model="budgeted", prompt="x", max_tokens=KV_TOKENS - 2)
    assert fits.choices[0].finish_reason in ("stop", "length")


def test_a_handlers_pre_shapes_each_generate_request_online(server: ServerThread) -> None:
    """An interactive generate workload takes a handler with pre alone (post is a spec
    error there: tests/test_spec.py): pre makes every request ask for 2 tokens."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="trimmed", prompt="def f(x", max_tokens=12)
    assert whole.usage is not None and whole.usage.completion_tokens == 2
    assert whole.choices[0].finish_reason == "length"
    untrimmed = client.completions.create(model="code", prompt="def f(x", max_tokens=2)
    assert whole.choices[0].text == untrimmed.choices[0].text
    messages = [{"role": "user", "content": "a class"}]
    chat = client.chat.completions.create(model="trimmed", messages=messages, max_tokens=12)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.completion_tokens == 2
