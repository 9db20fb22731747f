"""vLLM's stop_token_ids, min_tokens and include_stop_str_in_output on
/v1/completions and /v1/chat/completions: a real uvicorn on 127.0.0.1, the demo
tinycode decoder, the official `openai` client (vLLM's fields in `extra_body`), and
the offline in-process batch loop on the same model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from lanes import load_spec
from lanes.batchframe import decode_items, encode_items
from lanes.protocols.completions import ChatMessage, render_chat
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.tasks import GenerateTask, load_task
from lanes.tasks.decoder import Completion
from lanes.tasks.generate import GenerateRequest
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

WORKLOADS = """\
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 4}
    generation: {max_new_tokens: 12, temperature: 0}
  nightly:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: out/
    batch_size: 4
    generation: {max_new_tokens: 12, temperature: 0}
"""
PROMPT = "def f(x"


@pytest.fixture(scope="module")
def spec(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("controls"), demo_models, WORKLOADS)


@pytest.fixture(scope="module")
def server(spec: Path) -> Iterator[ServerThread]:
    with ServerThread(spec) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def task(spec: Path) -> GenerateTask:
    """The offline workload's task, loaded apart: its own in-process batch loop."""
    loaded = load_task("nightly", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    assert isinstance(loaded, GenerateTask)
    return loaded


def greedy_ids(task: GenerateTask, prompt: str, **fields: Any) -> list[int]:
    done = task.complete(task.prepare({"prompt": prompt, **fields}))
    return done.tokens


def fresh_token(tokens: list[int]) -> int:
    """The index of the first token after the first that did not come earlier."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def test_a_stop_token_ends_greedy_output_where_greedy_makes_it(
    client: OpenAI, task: GenerateTask
) -> None:
    tokens = greedy_ids(task, PROMPT)
    k = fresh_token(tokens)
    stop = {"stop_token_ids": [tokens[k]]}
    answer = client.completions.create(
        model="code-complete", prompt=PROMPT, max_tokens=12, extra_body=stop
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop"
    # As eos: the stop token is neither in the text nor counted.
    assert choice.text == task.decoder.tokenizer.decode(tokens[:k])
    assert answer.usage is not None and answer.usage.completion_tokens == k
    config = task.decoder.config
    messages = [ChatMessage(role="user", content="write a loop")]
    rendered = render_chat(messages, config.chat_template, config.chat_generation_prompt)
    chat_tokens = greedy_ids(task, rendered)
    k = fresh_token(chat_tokens)
    chat = client.chat.completions.create(
        model="code-complete",
        messages=[{"role": "user", "content": "write a loop"}],
        extra_body={"stop_token_ids": [chat_tokens[k]]},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == task.decoder.tokenizer.decode(chat_tokens[:k])


def test_min_tokens_keeps_a_stop_token_from_ending_the_text_before_it(
    client: OpenAI, task: GenerateTask
) -> None:
    """The demo model almost never makes eos (no one-token prompt's greedy next token
    is eos): the stop token it makes stands for one, masked as eos is (the masking of
    eos itself is tested on fabricated logits, tests/test_scheduler_controls.py)."""
    tokens = greedy_ids(task, PROMPT)
    k = fresh_token(tokens)
    body = {"stop_token_ids": [tokens[k]], "min_tokens": k + 3}
    answer = client.completions.create(
        model="code-complete", prompt=PROMPT, max_tokens=12, extra_body=body
    )
    made = greedy_ids(task, PROMPT, **body)
    assert answer.choices[0].text == task.decoder.tokenizer.decode(made)
    assert made[:k] == tokens[:k] and made[k] != tokens[k]
    assert len(made) >= k + 3 and tokens[k] not in made[: k + 3]


def test_include_stop_str_in_output_keeps_the_stop_string(client: OpenAI) -> None:
    def text(**extra: Any) -> str:
        answer = client.completions.create(
            model="code-complete", prompt=PROMPT, max_tokens=12, stop=[")"], extra_body=extra
        )
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].text

    cut = text()
    assert text(include_stop_str_in_output=True) == cut + ")"
    streamed = client.completions.create(
        model="code-complete",
        prompt=PROMPT,
        max_tokens=12,
        stop=[")"],
        stream=True,
        extra_body={"include_stop_str_in_output": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == cut + ")"


def test_batched_rows_without_controls_make_what_they_make_alone(task: GenerateTask) -> None:
    prompts = [PROMPT, "import os", "hello", "print("]
    alone = [greedy_ids(task, p) for p in prompts]
    controls = {"stop_token_ids": [alone[0][fresh_token(alone[0])]], "min_tokens": 1}
    requests = [
        task.prepare({"prompt": p, **(controls if i % 2 else {})}) for i, p in enumerate(prompts)
    ]
    done = task.run(requests)
    assert all(isinstance(d, Completion) for d in done)
    assert [done[i].tokens for i in (0, 2)] == [alone[0], alone[2]]


def test_a_plain_record_takes_the_same_fields(task: GenerateTask) -> None:
    tokens = greedy_ids(task, PROMPT)
    k = fresh_token(tokens)
    record = {"prompt": PROMPT, "stop_token_ids": [tokens[k]], "include_stop_str_in_output": True}
    (done,) = task.run([task.prepare(record)])
    assert done.tokens == tokens[:k] and done.finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop_token_ids": [1024]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 13}, "min_tokens"),  # over max_tokens (the workload's 12)
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_bad_values_are_400s_naming_the_field(
    client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="code-complete", prompt=PROMPT, extra_body=extra)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_the_endpoint_runners_frame_carries_the_controls(task: GenerateTask) -> None:
    """An offline batch run on an endpoint (lanes/batchframe.py) gets what was asked."""
    fields = {"stop_token_ids": [199, 9], "min_tokens": 2, "include_stop_str_in_output": True}
    request = task.prepare({"prompt": PROMPT, "stop": ")", **fields})
    (back,) = decode_items(task, encode_items([request]))
    assert isinstance(back, GenerateRequest)
    assert back.stop_token_ids == frozenset({199, 9}) and back.min_tokens == 2
    assert back.include_stop and back.stop == (")",)
    assert task.run([back])[0] == task.run([request])[0]
