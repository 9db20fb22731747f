"""vLLM's stop_token_ids, min_tokens and include_stop_str_in_output on
/v1/completions and /v1/chat/completions: a real uvicorn on 127.0.0.1, the demo
tinycode decoder, the official `openai` client (vLLM's fields in `extra_body`), and
the offline in-process batch loop on the same model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from lanes import load_spec
from lanes.batchframe import decode_items, decode_outputs, encode_items, encode_outputs
from lanes.errors import InvalidInput, SpecError
from lanes.flows.records import Line
from lanes.flows.requests import Rejection, to_request
from lanes.flows.shape import RecordShape
from lanes.protocols.chat import ChatMessage, render_chat
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import Generation, OfflineWorkload
from lanes.spectypes import MAX_STOP_CHARS
from lanes.tasks import GenerateTask, load_task
from lanes.tasks.decoder import Completion
from lanes.tasks.generate import GenerateRequest
from tests.model_reference import prefill_logits
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

WORKLOADS = """\
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 4}
    generation: {max_new_tokens: 12, temperature: 0}
  penalised:                       # defaults a request may override
    mode: interactive
    task: generate
    model: tinycode
    generation: {max_new_tokens: 12, temperature: 0, frequency_penalty: 2.0, min_p: 0.1}
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
    # As eos: the stop token is not in the text, but the model made it and usage
    # counts it, as vLLM does (test_a_stop_token_is_counted_alike_everywhere).
    assert choice.text == task.decoder.tokenizer.decode(tokens[:k])
    assert answer.usage is not None and answer.usage.completion_tokens == k + 1
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


def test_a_stop_token_is_counted_alike_everywhere(
    client: OpenAI, task: GenerateTask, spec: Path
) -> None:
    """vLLM counts the eos or stop token that ended a text in completion_tokens (its
    output token ids hold it) though the text does not show it: lanes counts it so on
    every route and lane, streamed or not, with the same text."""
    tokens = greedy_ids(task, PROMPT)
    k = fresh_token(tokens)
    fields = {"stop_token_ids": [tokens[k]]}
    text = task.decoder.tokenizer.decode(tokens[:k])
    asked: dict[str, Any] = {"model": "code-complete", "max_tokens": 12, "extra_body": fields}
    whole = client.completions.create(prompt=PROMPT, stream=False, **asked)
    streamed = list(
        client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **asked
        )
    )
    assert streamed[-1].usage is not None and not streamed[-1].choices
    assert "".join(c.choices[0].text for c in streamed[:-1]) == whole.choices[0].text == text
    assert whole.usage is not None and streamed[-1].usage is not None
    assert whole.usage.completion_tokens == streamed[-1].usage.completion_tokens == k + 1
    config = task.decoder.config
    messages = [ChatMessage(role="user", content="write a loop")]
    rendered = render_chat(messages, config.chat_template, config.chat_generation_prompt)
    chat_tokens = greedy_ids(task, rendered)
    j = fresh_token(chat_tokens)
    said: Any = [{"role": "user", "content": "write a loop"}]
    asked["extra_body"] = {"stop_token_ids": [chat_tokens[j]]}
    chat = client.chat.completions.create(messages=said, stream=False, **asked)
    chat_streamed = list(
        client.chat.completions.create(
            messages=said, stream=True, stream_options={"include_usage": True}, **asked
        )
    )
    final = chat_streamed[-1].usage
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and final is not None
    assert chat.usage.completion_tokens == final.completion_tokens == j + 1
    # Offline, in-process: the task's batch loop, and an OpenAI batch line answered.
    (done,) = task.run([task.prepare({"prompt": PROMPT, **fields})])
    assert done.tokens == tokens[:k] and done.stop_token == tokens[k]
    assert done.completion_tokens == k + 1
    workload = load_spec(spec, Settings()).workload("nightly")
    assert isinstance(workload, OfflineWorkload)
    body = {"model": "nightly", "prompt": PROMPT, "max_tokens": 12, **fields}
    line = {"custom_id": "c-1", "method": "POST", "url": "/v1/completions", "body": body}
    shape = RecordShape.of("nightly", workload, None)
    limit = Settings().max_inputs_per_request
    request = to_request(Line(1, line), shape, "in/a.jsonl", limit)
    assert not isinstance(request, Rejection)
    prepared = request.prepare(task)
    answered = request.answer(prepared, task.run(prepared), task)
    assert answered["response"]["body"]["usage"] == whole.usage.model_dump(exclude_none=True)
    assert answered["response"]["body"]["choices"][0]["text"] == text


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
    assert (done.stop_token, done.completion_tokens) == (tokens[k], k + 1)


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


def test_stop_strings_are_capped_in_number_and_length(
    client: OpenAI, task: GenerateTask, demo_models: Path, tmp_path: Path
) -> None:
    """At most MAX_STOP_CHARS characters each, at most 16 of them: each is looked for at
    every token. The most a request may send is served; past it, a 400 naming `stop`
    (a list too long, one string too long) or `stop[i]` (that one string)."""
    longest = "\u00e9" * MAX_STOP_CHARS  # characters, not UTF-8 bytes
    most = [f"{i:03d}" + longest[3:] for i in range(16)]
    answer = client.completions.create(model="code-complete", prompt=PROMPT, stop=most)
    assert answer.choices[0].finish_reason == "length"
    too_long = longest + "x"
    refused: list[tuple[str, str | list[str]]] = [
        ("stop", [*most, "x"]),
        ("stop", too_long),
        ("stop[1]", ["x", too_long]),
    ]
    for param, value in refused:
        with pytest.raises(BadRequestError) as completion:
            client.completions.create(model="code-complete", prompt=PROMPT, stop=value)
        with pytest.raises(BadRequestError) as chat:
            client.chat.completions.create(
                model="code-complete", messages=[{"role": "user", "content": "x"}], stop=value
            )
        for caught in (completion, chat):
            body = caught.value.body
            assert isinstance(body, dict) and body["param"] == param, body
            assert body["message"].startswith(f"{param}: expected at most "), body
    body = completion.value.body
    assert isinstance(body, dict)
    assert body["message"] == "stop[1]: expected at most 256 characters, found 257"
    with pytest.raises(InvalidInput) as record:  # the offline lane's check is the same
        task.prepare({"prompt": PROMPT, "stop": ["x", "y", too_long]})
    assert record.value.param == "stop[2]"
    bad = WORKLOADS.replace("temperature: 0}", f"temperature: 0, stop: [{too_long!r}]}}", 1)
    with pytest.raises(SpecError, match=r"generation\.stop\[0\]: expected at most 256"):
        load_spec(write_spec(tmp_path, demo_models, bad), Settings())


def test_the_endpoint_runners_frame_carries_the_controls(task: GenerateTask) -> None:
    """An offline batch run on an endpoint (lanes/batchframe.py) gets what was asked."""
    fields = {"stop_token_ids": [199, 9], "min_tokens": 2, "include_stop_str_in_output": True}
    fields |= {"logit_bias": {"5": 2.5}, "presence_penalty": 0.5, "frequency_penalty": 1}
    fields |= {"repetition_penalty": 1.2, "min_p": 0.1, "temperature": 0.5, "seed": 3}
    request = task.prepare({"prompt": PROMPT, "stop": ")", **fields})
    (back,) = decode_items(task, encode_items([request]))
    assert isinstance(back, GenerateRequest)
    assert back.stop_token_ids == frozenset({199, 9}) and back.min_tokens == 2
    assert back.include_stop and back.stop == (")",)
    assert back.logit_bias == {5: 2.5} and back.sampling == request.sampling
    assert (back.presence_penalty, back.frequency_penalty, back.repetition_penalty) == (
        0.5,
        1.0,
        1.2,
    )
    assert task.run([back])[0] == task.run([request])[0]
    # And its answer back, the stop token that ended it with it (usage counts it).
    tokens = greedy_ids(task, PROMPT)
    k = fresh_token(tokens)
    ended = task.run([task.prepare({"prompt": PROMPT, "stop_token_ids": [tokens[k]]})])
    assert decode_outputs(encode_outputs(ended), 1, "generate") == ended
    assert ended[0].stop_token == tokens[k]


# ---- logit_bias, penalties, min_p: checked on the model's raw logits, computed here ----


def completion(client: OpenAI, prompt: str, **extra: Any) -> tuple[str, str | None]:
    answer = client.completions.create(
        model="code-complete", prompt=prompt, max_tokens=6, extra_body=extra
    )
    return answer.choices[0].text, answer.choices[0].finish_reason


def test_logit_bias_100_makes_greedy_emit_that_token(client: OpenAI, task: GenerateTask) -> None:
    tokens = greedy_ids(task, PROMPT)
    wanted = next(t for t in range(1, 1024) if t not in tokens)
    text, _ = completion(client, PROMPT, logit_bias={str(wanted): 100})
    made = greedy_ids(task, PROMPT, max_tokens=6, logit_bias={str(wanted): 100})
    assert made == [wanted] * 6
    assert text == task.decoder.tokenizer.decode(made)
    # -100 keeps greedy off the token it would make.
    first = tokens[0]
    assert greedy_ids(task, PROMPT, logit_bias={str(first): -100})[0] != first


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 1.5, "presence_penalty": -0.5},
    ],
)
def test_presence_and_frequency_penalties_are_openais_formula(
    client: OpenAI, task: GenerateTask, penalties: dict[str, float]
) -> None:
    """ "x" alone makes "x" again and again: the second token is the first one taken on
    the penalised logits (the first one's are not: nothing was made yet)."""
    ids = task.decoder.encode("x")
    plain = greedy_ids(task, "x")
    made = greedy_ids(task, "x", max_tokens=6, **penalties)
    assert made[0] == plain[0]
    row = prefill_logits(task.decoder, [*ids, made[0]])[-1]
    row[made[0]] -= penalties.get("frequency_penalty", 0) + penalties.get("presence_penalty", 0)
    assert made[1] == int(row.argmax())
    if penalties.get("presence_penalty", 0) >= 0:
        assert made[1] != plain[1]  # "x" again was what greedy made: now it is not
    text, _ = completion(client, "x", **penalties)
    assert text == task.decoder.tokenizer.decode(made)


def test_repetition_penalty_is_vllms_over_the_prompt_too(
    client: OpenAI, task: GenerateTask
) -> None:
    ids = task.decoder.encode(PROMPT)
    row = prefill_logits(task.decoder, ids)[-1]
    seen = np.unique(ids)
    row[seen] = np.where(row[seen] > 0, row[seen] / 1.8, row[seen] * 1.8)
    made = greedy_ids(task, PROMPT, max_tokens=6, repetition_penalty=1.8)
    assert made[0] == int(row.argmax())
    text, _ = completion(client, PROMPT, repetition_penalty=1.8)
    assert text == task.decoder.tokenizer.decode(made)


def test_min_p_never_draws_a_token_below_its_threshold(client: OpenAI, task: GenerateTask) -> None:
    fields = {"temperature": 1.5, "min_p": 0.2, "seed": 7, "max_tokens": 6}
    made = greedy_ids(task, PROMPT, **fields)
    answer = client.completions.create(
        model="code-complete",
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.5,
        seed=7,
        extra_body={"min_p": 0.2},
    )
    assert answer.choices[0].text == task.decoder.tokenizer.decode(made)
    ids = task.decoder.encode(PROMPT)
    for token in made[:4]:
        scores = prefill_logits(task.decoder, ids)[-1] / 1.5
        probs = np.exp(scores - scores.max())
        assert probs[token] >= 0.2 * probs.max()
        ids.append(token)


def test_rows_with_penalties_beside_rows_without(task: GenerateTask) -> None:
    prompts = [PROMPT, "x", "hello", "print("]
    alone = [greedy_ids(task, p) for p in prompts]
    controls = {"frequency_penalty": 2.0, "logit_bias": {"5": 3}, "repetition_penalty": 1.3}
    requests = [
        task.prepare({"prompt": p, **(controls if i % 2 else {})}) for i, p in enumerate(prompts)
    ]
    done = task.run(requests)
    assert [done[i].tokens for i in (0, 2)] == [alone[0], alone[2]]
    assert done[1].tokens == greedy_ids(task, "x", **controls) != alone[1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"1024": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_logits_controls_are_400s_naming_the_field(
    client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="code-complete", prompt=PROMPT, extra_body=extra)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_the_workloads_generation_block_sets_default_penalties(
    client: OpenAI, demo_models: Path, tmp_path: Path
) -> None:
    def text(model: str, **extra: Any) -> str:
        answer = client.completions.create(model=model, prompt="x", max_tokens=6, extra_body=extra)
        return answer.choices[0].text

    assert (
        text("penalised") == text("code-complete", frequency_penalty=2.0) != text("code-complete")
    )
    assert text("penalised", frequency_penalty=0) == text("code-complete")
    bad = WORKLOADS.replace("frequency_penalty: 2.0", "repetition_penalty: 0")
    with pytest.raises(SpecError, match="repetition_penalty"):
        load_spec(write_spec(tmp_path, demo_models, bad), Settings())


def test_a_generation_block_without_the_new_keys_dumps_as_before() -> None:
    """An offline job's identity hashes the dump (flows/job.py): unchanged unless set."""
    assert list(Generation().model_dump(mode="json")) == [
        *("max_new_tokens", "temperature", "top_k", "top_p", "stop")
    ]
    assert Generation(min_p=0.1).model_dump()["min_p"] == 0.1
