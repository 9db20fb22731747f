"""From an input record to task items, and from task outputs to an output line.

Two record shapes, told apart line by line:

- a plain record, by default `{"id": ..., <task fields>}`; the workload's `fields:`
  say where its id and text (or prompt) are and which fields to carry to the output
  (flows.shape). embed reads `text` (other fields are ignored); infer and generate
  take every field but the id and the kept ones as the item (a kept prompt or
  generation option is still generate's); a handler's `pre` gets
  the whole record and makes the item. Its output line is `{"id", <kept fields>,
  "embedding": [...]}` (embed), or the id and kept fields with the output's fields
  (infer's named tensors, a handler's mapping), or with `"result": ...`.
- an OpenAI batch line `{"custom_id", "method", "url", "body"}` for /v1/embeddings,
  /v1/completions or /v1/chat/completions: the body is what the online endpoint
  takes (a handler's `pre` gets each text or prompt, as online), within the same
  per-request limits, the output line carries the body it answers, and a rejected
  line the 400 body it answers. A batch answers whole: `stream: true` is refused, as
  OpenAI's Batch API refuses it.

Text over the model's `max_length` tokens is rejected as online, unless the workload
declares `truncate: true`.

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

from lanes.errors import InvalidInput, LanesError
from lanes.flows.records import Line
from lanes.flows.shape import RecordShape
from lanes.protocols.answers import (
    Choice,
    Prompt,
    chat_response,
    completion_response,
)
from lanes.protocols.chat import ChatCompletionRequest
from lanes.protocols.completions import CompletionRequest, prepare_prompts
from lanes.protocols.openai import (
    BATCH_URLS,
    BatchRequestLine,
    EmbeddingsRequest,
    batch_output,
    check_dimensions,
    embeddings_response,
    error_of,
    is_batch_line,
    parse,
    prepare_texts,
)
from lanes.tasks.base import Task
from lanes.tasks.decoder import Completion
from lanes.tasks.embed import EmbedItem, EmbedTask
from lanes.tasks.generate import GenerateRequest, GenerateTask


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

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any], task: Task) -> dict[str, Any]:
        """The output line, given one output per prepared item (`task`'s)."""
        ...

    def reject(self, problem: str | LanesError) -> dict[str, Any]:
        """The errors-file line for this record (an error keeps its field, code and status)."""
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
    record: Mapping[str, Any]
    kept: dict[str, Any]
    item: Any  # made from the record already, unless the shape defers it to `pre`
    shape: RecordShape

    def prepare(self, task: Task) -> list[Any]:
        item = self.shape.item_of(self.record) if self.shape.defers_item else self.item
        try:
            return [task.check(item)]
        except InvalidInput as err:
            if self.shape.kind != "embed" or err.param not in ("input", None):
                raise
            # The task names its argument `input`; in a plain record it is the text field.
            raise err.at(self.shape.item_label()) from None

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any], task: Task) -> dict[str, Any]:
        (output,) = outputs
        body: dict[str, Any]
        if self.shape.kind == "embed" and isinstance(output, np.ndarray):
            # Left an array: the writer prints float32's shortest decimals, which read
            # back to the same float32, in about half the bytes and time of tolist().
            body = {"embedding": np.ascontiguousarray(output, dtype=np.float32)}
        else:
            value = jsonable(output)
            if isinstance(output, Completion) and output.logprobs is None:
                del value["logprobs"]  # a plain record asks for none: its line stays as it was
            body = value if isinstance(value, dict) and "id" not in value else {"result": value}
        clash = next((name for name in self.kept if name in body), None)
        if clash is not None:
            raise InvalidInput(
                f'fields.keep: "{clash}" is a field of the output too; '
                "drop it from `fields.keep` or rename it in a handler"
            )
        return {"id": self.id, **self.kept, **body}

    def reject(self, problem: str | LanesError) -> dict[str, Any]:
        return {"id": self.id, "line": self.number, "error": str(problem)}

    def sort_key(self) -> int:
        return _length(self.record if self.shape.defers_item else self.item)


@dataclass(frozen=True)
class EmbeddingsLine:
    number: int
    id: str  # the line's custom_id
    request_id: str
    request: EmbeddingsRequest

    def prepare(self, task: Task) -> list[Any]:
        if isinstance(task, EmbedTask):
            check_dimensions(self.request, task.dimensions)
        return prepare_texts(self.request, task.prepare)

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any], task: Task) -> dict[str, Any]:
        tokens = sum(item.n_tokens for item in prepared if isinstance(item, EmbedItem))
        body = embeddings_response(
            self.request.model, list(outputs), tokens, self.request.encoding_format
        )
        return batch_output(self.id, self.request_id, 200, body)

    def reject(self, problem: str | LanesError) -> dict[str, Any]:
        return _batch_rejection(self.id, self.number, self.request_id, problem)

    def sort_key(self) -> int:
        given = self.request.input
        return len(given) if isinstance(given, str) else sum(_length(t) for t in given)


@dataclass(frozen=True)
class CompletionLine:
    """A /v1/completions or /v1/chat/completions line: `n` completions per prompt, in
    the online route's order."""

    number: int
    id: str
    request_id: str
    request: CompletionRequest | ChatCompletionRequest

    def prepare(self, task: Task) -> list[Any]:
        if not isinstance(task, GenerateTask):  # _batch_line matched the url to the task
            raise TypeError(f"a completions line runs on a generate task, not {task.kind!r}")
        config = task.decoder.config
        template, opening = config.chat_template, config.chat_generation_prompt
        prepared = prepare_prompts(self.request, template, opening, task.prepare)
        if self.request.ignore_eos:  # as online: run to max_tokens
            prepared = [
                dataclasses.replace(p, ignore_eos=True) if isinstance(p, GenerateRequest) else p
                for p in prepared
            ]
        # As online: logprobs of its tokens and its prompt's, an echo's prefill alone,
        # and each prompt's n choices (a handler's own items: n of each).
        n = self.request.choices
        return [
            choice
            for p in prepared
            for choice in (
                self.request.choices_of(p) if isinstance(p, GenerateRequest) else [p] * n
            )
        ]

    def answer(self, prepared: Sequence[Any], outputs: Sequence[Any], task: Task) -> dict[str, Any]:
        done = [o for o in outputs if isinstance(o, Completion)]
        if len(done) != len(outputs):
            wrong = next(type(o).__name__ for o in outputs if not isinstance(o, Completion))
            raise TypeError(f"the handler's post returned {wrong}, not a Completion")
        chat = isinstance(self.request, ChatCompletionRequest)
        id = f"{'chatcmpl' if chat else 'cmpl'}-{self.request_id}"
        created = int(time.time())
        # Each prompt counted once, as online: its first choice's.
        prompt_tokens = sum(c.prompt_tokens for c in done[:: self.request.choices])
        completion_tokens = sum(c.completion_tokens for c in done)
        choices = [self._choice(p, c, task) for p, c in zip(prepared, done, strict=True)]
        respond = chat_response if chat else completion_response
        body = respond(id, created, self.request.model, choices, prompt_tokens, completion_tokens)
        return batch_output(self.id, self.request_id, 200, body)

    def _choice(self, prepared: Any, done: Completion, task: Task) -> Choice:
        """A completion's choice, as the online route writes it (its logprobs, its
        prompt in front where it asked for an echo)."""
        if not isinstance(task, GenerateTask):
            return Choice(done.text, done.finish_reason)
        prompt = None
        if isinstance(prepared, GenerateRequest):
            prompt = Prompt(prepared.prompt, prepared.prompt_ids, done.prompt_logprobs)
        records = done.logprobs or ()
        return self.request.choice(done.text, done.finish_reason, records, prompt, task.spelling)

    def reject(self, problem: str | LanesError) -> dict[str, Any]:
        return _batch_rejection(self.id, self.number, self.request_id, problem)

    def sort_key(self) -> int:
        if isinstance(self.request, CompletionRequest):
            prompt = self.request.prompt
            return len(prompt) if isinstance(prompt, str) else sum(_length(p) for p in prompt)
        return sum(len(m.text) for m in self.request.messages)


def to_request(
    line: Line, shape: RecordShape, shard_uri: str, max_inputs: int
) -> Request | Rejection:
    """The request a readable record makes, or why it makes none. An OpenAI batch line
    meets the endpoint's per-request limits (`max_inputs`: LANES_MAX_INPUTS_PER_REQUEST):
    one over them is rejected alone, with the endpoint's message and status."""
    if line.value is None:
        return Rejection({"id": None, "line": line.number, "error": line.error})
    record: Mapping[str, Any] = line.value
    if is_batch_line(record):
        return _batch_line(line.number, record, shape, shard_uri, max_inputs)
    rid, problem = shape.id_of(record)
    if problem is not None:
        return Rejection({"id": None, "line": line.number, "error": problem})
    try:
        record = shape.typed(record, line.text, line.parquet)
        kept = shape.kept(record)
        item = None if shape.defers_item else shape.item_of(record)
    except InvalidInput as err:
        return Rejection({"id": rid, "line": line.number, "error": str(err)})
    return PlainRecord(line.number, rid, record, kept, item, shape)


def _batch_line(
    number: int, record: Mapping[str, Any], shape: RecordShape, shard: str, max_inputs: int
) -> Request | Rejection:
    custom_id = record.get("custom_id")
    # Deterministic ids: a rerun writes the same line for the same input line.
    request_id = hashlib.sha256(f"{shard}\n{number}".encode()).hexdigest()[:24]
    try:
        line = parse(BatchRequestLine, record)
    except InvalidInput as err:
        return Rejection(_batch_rejection(custom_id, number, request_id, err))
    wanted = BATCH_URLS.get(line.url)
    if wanted is None:
        known = ", ".join(BATCH_URLS)
        message = f"url: expected one of {known}, found {line.url!r}"
        return Rejection(_batch_rejection(line.custom_id, number, request_id, message))
    if wanted != shape.kind:
        message = (
            f"url: {line.url} is for task {wanted!r}, but this workload's task is {shape.kind!r}"
        )
        return Rejection(_batch_rejection(line.custom_id, number, request_id, message))
    try:
        request: EmbeddingsRequest | CompletionRequest | ChatCompletionRequest
        if line.url == "/v1/embeddings":
            request = parse(EmbeddingsRequest, line.body)
        elif line.url == "/v1/completions":
            request = parse(CompletionRequest, line.body)
        else:
            request = parse(ChatCompletionRequest, line.body)
        request.check_limits(max_inputs)  # one implementation with the endpoint's
        if not isinstance(request, EmbeddingsRequest):
            request.check_batch_line()
    except InvalidInput as err:
        # The errors file's message says where in the line; the body is the endpoint's own.
        return Rejection(_batch_rejection(line.custom_id, number, request_id, err, "body."))
    if request.model != shape.workload:
        # This workload answers the line, whatever model it names (a file written for
        # another provider, or for the interactive workload a backfill runs on): its
        # answer says so, rather than echo a model that did not answer.
        request = request.model_copy(update={"model": shape.workload})
    if isinstance(request, EmbeddingsRequest):
        return EmbeddingsLine(number, line.custom_id, request_id, request)
    return CompletionLine(number, line.custom_id, request_id, request)


def _batch_rejection(
    custom_id: Any, number: int, request_id: str, problem: str | LanesError, where: str = ""
) -> dict[str, Any]:
    # The errors file doubles as OpenAI's error file: the 400 the endpoint would answer.
    error = problem if isinstance(problem, LanesError) else InvalidInput(problem)
    answer = batch_output(str(custom_id), request_id, error.status, error_of(error))
    return {
        "id": custom_id,
        "line": number,
        "error": where + str(error),
        "custom_id": custom_id,
        "response": answer["response"],
    }


def _length(item: Any) -> int:
    if isinstance(item, str | list):
        return len(item)
    if isinstance(item, Mapping):
        # A prompt, or a whole record's longest text (its `pre` has not run yet).
        if isinstance(item.get("prompt"), str):
            return len(item["prompt"])
        return max((len(v) for v in item.values() if isinstance(v, str)), default=0)
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
