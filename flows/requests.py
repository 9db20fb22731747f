"""From an input record to task items, and from task outputs to an output line.

Two record shapes, told apart line by line:

- a plain record `{"id": ..., <task fields>}`: embed reads `text` (other fields are
  ignored); infer and generate take every field but `id` as the item. Its output
  line is `{"id", "embedding": [...]}` (embed), or the id with the output's fields
  (infer's named tensors, a handler's mapping), or `{"id", "result": ...}`.
- an OpenAI batch line `{"custom_id", "method", "url", "body"}` for /v1/embeddings,
  /v1/completions or /v1/chat/completions: the body is what the online endpoint
  takes, the output line carries the body it answers (`stream` is ignored: a batch
  answers whole).

A record that does not fit becomes a `Rejection`, written to the errors file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lanes.errors import InvalidInput
from lanes.flows.records import Line
from lanes.protocols.openai import (
    BATCH_URLS,
    BatchRequestLine,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    batch_output,
    chat_response,
    completion_response,
    embeddings_response,
    invalid_request_body,
    is_batch_line,
    parse,
    prepare_texts,
    render_chat,
)
from lanes.spec import TaskName
from lanes.tasks.base import Task
from lanes.tasks.decoder import Completion
from lanes.tasks.embed import EmbedItem
from lanes.tasks.generate import GenerateTask


class Request(Protocol):
    """One input record's work: its items (each prepared and run by the task) and how
    to turn their outputs into its output line."""

    @property
    def number(self) -> int: ...

    @property
    def id(self) -> Any: ...

    def prepare(self, task: Task) -> list[Any]:
        """Every item prepared; `InvalidInput` rejects the whole record."""
        ...

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any]) -> dict[str, Any]:
        """The output line, given one output per prepared item."""
        ...

    def reject(self, message: str) -> dict[str, Any]:
        """The errors-file line for this record."""
        ...

    def sort_key(self) -> int:
        """About how long this record's items are (text length), to batch alike ones."""
        ...


@dataclass(frozen=True)
class Rejection:
    """A record that could not become a request: its errors-file line."""

    line: dict[str, Any]


@dataclass(frozen=True)
class PlainRecord:
    number: int
    id: Any
    item: Any
    kind: TaskName

    def prepare(self, task: Task) -> list[Any]:
        try:
            return [task.prepare(self.item)]
        except InvalidInput as err:
            if self.kind != "embed":
                raise
            # The task names its argument `input`; in a plain record it is `text`.
            raise InvalidInput(f"text: {str(err).removeprefix('input: ')}") from None

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any]) -> dict[str, Any]:
        (output,) = outputs
        if self.kind == "embed" and isinstance(output, np.ndarray):
            # Left an array: the writer prints float32's shortest decimals, which read
            # back to the same float32, in about half the bytes and time of tolist().
            vector = np.ascontiguousarray(output, dtype=np.float32)
            return {"id": self.id, "embedding": vector}
        value = jsonable(output)
        if isinstance(value, dict) and "id" not in value:
            return {"id": self.id, **value}
        return {"id": self.id, "result": value}

    def reject(self, message: str) -> dict[str, Any]:
        return {"id": self.id, "line": self.number, "error": message}

    def sort_key(self) -> int:
        return _length(self.item)


@dataclass(frozen=True)
class EmbeddingsLine:
    number: int
    id: str  # the line's custom_id
    request_id: str
    request: EmbeddingsRequest

    def prepare(self, task: Task) -> list[Any]:
        return prepare_texts(self.request, task.prepare)

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any]) -> dict[str, Any]:
        tokens = sum(item.n_tokens for item in prepared if isinstance(item, EmbedItem))
        body = embeddings_response(
            self.request.model, list(outputs), tokens, self.request.encoding_format
        )
        return batch_output(self.id, self.request_id, 200, body)

    def reject(self, message: str) -> dict[str, Any]:
        return _batch_rejection(self.id, self.number, self.request_id, message)

    def sort_key(self) -> int:
        return sum(len(t) for t in self.request.texts)


@dataclass(frozen=True)
class CompletionLine:
    """A /v1/completions or /v1/chat/completions line: one prompt, one completion."""

    number: int
    id: str
    request_id: str
    request: CompletionRequest | ChatCompletionRequest

    def prepare(self, task: Task) -> list[Any]:
        if isinstance(self.request, ChatCompletionRequest):
            config = task.decoder.config if isinstance(task, GenerateTask) else None
            template = config.chat_template if config else None
            opening = config.chat_generation_prompt if config else None
            prompt = render_chat(self.request.messages, template, opening)
        else:
            prompt = self.request.text
        return [task.prepare(self.request.generation_item(prompt))]

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any]) -> dict[str, Any]:
        (done,) = outputs
        if not isinstance(done, Completion):
            raise TypeError(f"the handler's post returned {type(done).__name__}, not a Completion")
        chat = isinstance(self.request, ChatCompletionRequest)
        make = chat_response if chat else completion_response
        body = make(
            f"{'chatcmpl' if chat else 'cmpl'}-{self.request_id}",
            int(time.time()),
            self.request.model,
            done.text,
            done.finish_reason,
            done.prompt_tokens,
            len(done.tokens),
        )
        return batch_output(self.id, self.request_id, 200, body)

    def reject(self, message: str) -> dict[str, Any]:
        return _batch_rejection(self.id, self.number, self.request_id, message)

    def sort_key(self) -> int:
        if isinstance(self.request, CompletionRequest):
            prompt = self.request.prompt
            return len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt)
        return sum(len(m.text) for m in self.request.messages)


def to_request(line: Line, kind: TaskName, shard_uri: str) -> Request | Rejection:
    """The request a readable record makes, or why it makes none."""
    if line.value is None:
        return Rejection({"id": None, "line": line.number, "error": line.error})
    record = line.value
    if is_batch_line(record):
        return _batch_line(line.number, record, kind, shard_uri)
    if "id" not in record:
        message = 'missing field "id": a plain record is {"id": ..., <task fields>}'
        return Rejection({"id": None, "line": line.number, "error": message})
    rid = record["id"]
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        message = f'field "id": expected a string or an integer, found {type(rid).__name__}'
        return Rejection({"id": None, "line": line.number, "error": message})
    if kind == "embed":
        if "text" not in record:
            message = 'missing field "text": an embed record is {"id": ..., "text": "..."}'
            return Rejection({"id": rid, "line": line.number, "error": message})
        return PlainRecord(line.number, rid, record["text"], kind)
    return PlainRecord(line.number, rid, {k: v for k, v in record.items() if k != "id"}, kind)


def _batch_line(
    number: int, record: Mapping[str, Any], kind: TaskName, shard: str
) -> Request | Rejection:
    custom_id = record.get("custom_id")
    # Deterministic ids: a rerun writes the same line for the same input line.
    request_id = hashlib.sha256(f"{shard}\n{number}".encode()).hexdigest()[:24]
    try:
        line = parse(BatchRequestLine, record)
    except InvalidInput as err:
        return Rejection(_batch_rejection(custom_id, number, request_id, str(err)))
    wanted = BATCH_URLS.get(line.url)
    if wanted is None:
        known = ", ".join(BATCH_URLS)
        message = f"url: expected one of {known}, found {line.url!r}"
        return Rejection(_batch_rejection(line.custom_id, number, request_id, message))
    if wanted != kind:
        message = f"url: {line.url} is for task {wanted!r}, but this workload's task is {kind!r}"
        return Rejection(_batch_rejection(line.custom_id, number, request_id, message))
    try:
        if line.url == "/v1/embeddings":
            body = parse(EmbeddingsRequest, line.body)
            return EmbeddingsLine(number, line.custom_id, request_id, body)
        shape = CompletionRequest if line.url == "/v1/completions" else ChatCompletionRequest
        return CompletionLine(number, line.custom_id, request_id, parse(shape, line.body))
    except InvalidInput as err:
        message = f"body.{err}"
        return Rejection(_batch_rejection(line.custom_id, number, request_id, message))


def _batch_rejection(custom_id: Any, number: int, request_id: str, message: str) -> dict[str, Any]:
    # The errors file doubles as OpenAI's error file: the 400 the endpoint would answer.
    answer = batch_output(str(custom_id), request_id, 400, invalid_request_body(message))
    return {
        "id": custom_id,
        "line": number,
        "error": message,
        "custom_id": custom_id,
        "response": answer["response"],
    }


def _length(item: Any) -> int:
    if isinstance(item, str):
        return len(item)
    if isinstance(item, Mapping) and isinstance(item.get("prompt"), str):
        return len(item["prompt"])
    return 0


def jsonable(value: Any) -> Any:
    """Arrays, numpy scalars, dataclasses and nested containers as JSON values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
