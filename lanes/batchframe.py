"""The internal batch route's body, both ways: prepared items out, raw outputs back.

One frame:

    MAGIC, uint32 little-endian header length, orjson header, array bytes

The header lists one entry per item: its named arrays (dtype, shape, where its bytes
lie) and its JSON fields (a generate request's parameters, a completion's text), or,
in an answer, the error that item failed with alone. Text tensors (infer's BYTES)
travel as JSON lists in the header.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
from pydantic import ValidationError

from lanes.backfill import CONTENT_TYPE
from lanes.errors import InvalidInput, LanesError, ModelError, from_wire
from lanes.generation.logprobs import MAX_TOP_LOGPROBS, Alternative, TokenLogprob
from lanes.isolation import Failed
from lanes.spec import Generation, TaskName
from lanes.tasks.base import Task
from lanes.tasks.decoder import Completion
from lanes.tasks.embed import EmbedItem, EmbedTask
from lanes.tasks.generate import GenerateRequest, GenerateTask
from lanes.tasks.infer import InferItem, InferTask
from lanes.tasks.sampling import SamplingParams
from lanes.validation import invalid_input

MAGIC = b"LNB1"
_LENGTH = struct.Struct("<I")

Arrays = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class Entry:
    """One item of a frame: named arrays, and fields that JSON holds as they are."""

    arrays: Arrays
    fields: dict[str, Any] = field(default_factory=dict)


def _pack(entries: Sequence[Arrays | Entry | LanesError]) -> bytes:
    header: list[Any] = []
    chunks: list[bytes] = []
    at = 0
    for entry in entries:
        if isinstance(entry, LanesError):
            error = {"message": str(entry), "status": entry.status, "code": entry.code}
            header.append({"error": error | ({"param": entry.param} if entry.param else {})})
            continue
        if not isinstance(entry, Entry):
            entry = Entry(entry)
        described: dict[str, Any] = {}
        for name, array in entry.arrays.items():
            if array.dtype == object:
                described[name] = {"text": [str(v) for v in array.ravel()], "shape": array.shape}
                continue
            data = np.ascontiguousarray(array).tobytes()
            described[name] = {
                "dtype": array.dtype.str,
                "shape": array.shape,
                "at": at,
                "size": len(data),
            }
            chunks.append(data)
            at += len(data)
        header.append({"arrays": described, **({"fields": entry.fields} if entry.fields else {})})
    head = orjson.dumps({"items": header})
    return b"".join([MAGIC, _LENGTH.pack(len(head)), head, *chunks])


def _unpack(body: bytes, what: str) -> list[Entry | LanesError]:
    """The frame's entries; InvalidInput naming what is wrong with it."""
    view = memoryview(body)
    start = len(MAGIC) + _LENGTH.size
    if len(body) < start or bytes(view[: len(MAGIC)]) != MAGIC:
        raise InvalidInput(
            f"{what}: expected a lanes batch frame ({CONTENT_TYPE}), found other bytes"
        )
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    try:
        header = orjson.loads(view[start : start + length])
        entries = header["items"]
        blob = view[start + length :]
        return [_entry(e, blob) for e in entries]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise InvalidInput(f"{what}: the batch frame does not parse ({err})") from None


def _entry(entry: Mapping[str, Any], blob: memoryview) -> Entry | LanesError:
    if "error" in entry:
        error = entry["error"]
        message, status = str(error["message"]), int(error["status"])
        return from_wire(message, status, error.get("code"), error.get("param"))
    arrays: Arrays = {}
    for name, spec in entry["arrays"].items():
        shape = tuple(int(d) for d in spec["shape"])
        if "text" in spec:
            arrays[name] = np.array(spec["text"], dtype=object).reshape(shape)
            continue
        at, size = int(spec["at"]), int(spec["size"])
        if at < 0 or at + size > len(blob):
            raise ValueError(f"array {name!r} lies past the end of the body")
        arrays[name] = np.frombuffer(blob[at : at + size], dtype=np.dtype(spec["dtype"])).reshape(
            shape
        )
    fields = entry.get("fields", {})
    if not isinstance(fields, dict):
        raise ValueError("an item's fields are not an object")
    return Entry(arrays, fields)


# ---- items out, outputs back -----------------------------------------------------------


def encode_items(items: Sequence[Any]) -> bytes:
    """Prepared embed or infer items, as the route's request body."""
    entries: list[Arrays | Entry | LanesError] = []
    for item in items:
        if isinstance(item, EmbedItem):
            entries.append({"ids": item.ids})
        elif isinstance(item, InferItem):
            entries.append(dict(item.inputs))
        elif isinstance(item, GenerateRequest):
            entries.append(_generate_entry(item))
        else:
            raise TypeError(f"cannot send a {type(item).__name__} to the endpoint's batch route")
    return _pack(entries)


def decode_items(task: Task, body: bytes) -> list[Any]:
    """The request body as `task`'s prepared items, each checked as `prepare` would;
    InvalidInput (400) for what does not fit."""
    entries = _unpack(body, "body")
    items: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, LanesError):
            raise InvalidInput(f"body: item {i} is an error, not an input")
        try:
            items.append(_item(task, entry.arrays, entry.fields))
        except InvalidInput as err:
            raise InvalidInput(f"body: item {i}: {err}") from None
    if not items:
        raise InvalidInput("body: expected at least one item, found none")
    return items


def _item(task: Task, arrays: Arrays, fields: dict[str, Any]) -> Any:
    if isinstance(task, EmbedTask):
        ids = arrays.get("ids")
        if ids is None or ids.ndim != 1 or ids.dtype != np.int64 or len(ids) == 0:
            raise InvalidInput("expected `ids`, a non-empty 1-d int64 array of token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= task.vocab_size:
            raise InvalidInput(f"token ids outside the vocabulary (0 to {task.vocab_size - 1})")
        if len(ids) > task.max_length:
            raise InvalidInput(f"{len(ids)} tokens, over the model's {task.max_length}")
        return EmbedItem(ids, len(ids))
    if isinstance(task, InferTask):
        return task.check(arrays)
    if isinstance(task, GenerateTask):
        return _generate_request(task, arrays, fields)
    raise InvalidInput(f"workload {task.name!r} ({task.kind}) takes no offline batches")


def run_unhandled(
    task: Task, items: Sequence[Any], options: ort.RunOptions | None = None
) -> list[Any]:
    """The model run behind `task.run`, without the workload's handler (the offline
    workload applies its own): embed, one vector per item; infer, named tensors.
    `options`: the runs', see lanes.binding.run."""
    if isinstance(task, EmbedTask):
        return list(task.vectors(items, options))
    if isinstance(task, InferTask):
        return list(task.tensors(items, options))
    raise ModelError(f"workload {task.name!r} ({task.kind}) takes no offline batches")


def encode_outputs(outcomes: Sequence[Any]) -> bytes:
    """Each item's raw output (a vector, or named tensors) or the error it failed
    with alone, as the route's answer."""
    entries: list[Arrays | Entry | LanesError] = []
    for outcome in outcomes:
        if isinstance(outcome, LanesError):
            entries.append(outcome)
        elif isinstance(outcome, Completion):
            tokens = np.asarray(outcome.tokens, dtype=np.int64)
            fields: dict[str, Any] = {
                "text": outcome.text,
                "finish_reason": outcome.finish_reason,
                "prompt_tokens": outcome.prompt_tokens,
            }
            if outcome.stop_token is not None:
                fields["stop_token"] = outcome.stop_token
            if outcome.logprobs is not None:
                fields["logprobs"] = [_logprob_fields(lp) for lp in outcome.logprobs]
            if outcome.prompt_logprobs is not None:
                fields["prompt_logprobs"] = [_logprob_fields(lp) for lp in outcome.prompt_logprobs]
            entries.append(Entry({"tokens": tokens}, fields))
        elif isinstance(outcome, Exception):
            entries.append(ModelError(f"the model failed on this item: {outcome}"))
        elif isinstance(outcome, np.ndarray):
            entries.append({"embedding": outcome})
        else:
            entries.append(dict(outcome))
    return _pack(entries)


def decode_outputs(body: bytes, count: int, kind: TaskName) -> list[Any]:
    """The route's answer: per item its raw output (embed: the vector; infer: named
    tensors; generate: the `Completion`) or a `Failed` holding its error. ModelError when it does not hold
    `count` entries."""
    try:
        entries = _unpack(body, "the endpoint's answer")
    except InvalidInput as err:
        raise ModelError(str(err)) from None
    if len(entries) != count:
        raise ModelError(f"the endpoint answered {len(entries)} outputs for {count} items")
    outputs: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, LanesError):
            outputs.append(Failed(i, entry))
        elif kind == "embed":
            outputs.append(entry.arrays["embedding"].copy())  # writable, as a local run's
        elif kind == "generate":
            outputs.append(_completion(entry))
        else:
            outputs.append({name: array.copy() for name, array in entry.arrays.items()})
    return outputs


# ---- generate: a request's parameters and a completion travel as fields ----------------


def _generate_entry(request: GenerateRequest) -> Entry:
    sampling = request.sampling
    fields = {
        "max_new_tokens": request.max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "stop": list(request.stop),
        "seed": request.seed,
        "ignore_eos": request.ignore_eos,
        "top_logprobs": request.top_logprobs,
        "prompt_logprobs": request.prompt_logprobs,
        "stop_token_ids": sorted(request.stop_token_ids),
        "min_tokens": request.min_tokens,
        "include_stop": request.include_stop,
        "min_p": sampling.min_p,
        # JSON keys are strings: the bias travels as pairs.
        "logit_bias": [[token, bias] for token, bias in request.logit_bias.items()],
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
    }
    return Entry({"prompt_ids": np.asarray(request.prompt_ids, dtype=np.int64)}, fields)


def _generate_request(task: GenerateTask, arrays: Arrays, fields: dict[str, Any]) -> Any:
    """A prepared request as the flow settled it (every parameter given), checked by
    the spec's rules and the model's vocabulary and context."""
    ids = arrays.get("prompt_ids")
    if ids is None or ids.ndim != 1 or ids.dtype != np.int64 or len(ids) == 0:
        raise InvalidInput("expected `prompt_ids`, a non-empty 1-d int64 array of token ids")
    decoder = task.decoder
    vocab = decoder.config.vocab_size or decoder.tokenizer.get_vocab_size()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InvalidInput(f"token ids outside the vocabulary (0 to {vocab - 1})")
    seed, ignore_eos = fields.get("seed"), fields.get("ignore_eos", False)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidInput("`seed`: expected an integer or null")
    if not isinstance(ignore_eos, bool):
        raise InvalidInput("`ignore_eos`: expected true or false")
    top = fields.get("top_logprobs")
    if top is not None and (
        not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise InvalidInput(f"`top_logprobs`: expected null or 0 to {MAX_TOP_LOGPROBS}")
    scored = fields.get("prompt_logprobs")
    if scored is not None and (
        not isinstance(scored, int)
        or isinstance(scored, bool)
        or not 0 <= scored <= MAX_TOP_LOGPROBS
    ):
        raise InvalidInput(f"`prompt_logprobs`: expected null or 0 to {MAX_TOP_LOGPROBS}")
    stop_ids = fields.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids
    ):
        raise InvalidInput(f"`stop_token_ids`: expected token ids from 0 to {vocab - 1}")
    least, include_stop = fields.get("min_tokens", 0), fields.get("include_stop", False)
    if not isinstance(least, int) or isinstance(least, bool) or least < 0:
        raise InvalidInput("`min_tokens`: expected an integer from 0")
    if not isinstance(include_stop, bool):
        raise InvalidInput("`include_stop`: expected true or false")
    bias = _bias(fields.get("logit_bias", []), vocab)
    names = (
        *("max_new_tokens", "temperature", "top_k", "top_p", "stop", "min_p"),
        *("presence_penalty", "frequency_penalty", "repetition_penalty"),
    )
    checked = {n: fields[n] for n in names if n in fields}
    # An echo's prefill alone (Seq.prompt_logprobs): no token, so no budget to check,
    # and its prompt may fill the context.
    nothing = scored is not None and checked.get("max_new_tokens") == 0
    decoder.check_context(len(ids), 0 if nothing else None)
    if nothing:
        checked["max_new_tokens"] = 1
    try:
        params = Generation.model_validate(checked)
    except ValidationError as err:
        raise invalid_input(err) from None
    prompt_ids = tuple(int(i) for i in ids)
    return GenerateRequest(
        prompt=str(decoder.tokenizer.decode(list(prompt_ids))),
        prompt_ids=prompt_ids,
        max_new_tokens=0 if nothing else params.max_new_tokens,
        sampling=SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p),
        stop=tuple(params.stop),
        seed=seed,
        ignore_eos=ignore_eos,
        top_logprobs=top,
        prompt_logprobs=scored,
        stop_token_ids=frozenset(stop_ids),
        min_tokens=least,
        include_stop=include_stop,
        logit_bias=bias,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )


def _bias(pairs: Any, vocab: int) -> dict[int, float]:
    """A frame's logit_bias: [token id, bias] pairs, the ids in the vocabulary."""
    bias: dict[int, float] = {}
    for pair in pairs if isinstance(pairs, list) else [None]:
        token, value = pair if isinstance(pair, list) and len(pair) == 2 else (None, None)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise InvalidInput(f"`logit_bias`: expected [token id below {vocab}, bias] pairs")
        if not isinstance(value, int | float) or isinstance(value, bool) or abs(value) > 100:
            raise InvalidInput("`logit_bias`: expected [token id, bias] pairs, biases -100 to 100")
        bias[token] = float(value)
    return bias


def _completion(entry: Entry) -> Completion:
    fields = entry.fields
    tokens = entry.arrays.get("tokens")
    reason = fields.get("finish_reason")
    if tokens is None or reason not in ("stop", "length"):
        raise ModelError("the endpoint answered a generate item without tokens or finish")
    logprobs = fields.get("logprobs")
    prompt = fields.get("prompt_logprobs")
    stop_token = fields.get("stop_token")
    return Completion(
        str(fields.get("text", "")),
        [int(t) for t in tokens],
        reason,
        int(fields.get("prompt_tokens", 0)),
        None if logprobs is None else [_logprob_of(lp) for lp in logprobs],
        None if prompt is None else [_logprob_of(lp) for lp in prompt],
        None if stop_token is None else int(stop_token),
    )


def _logprob_fields(record: TokenLogprob) -> dict[str, Any]:
    top = [[a.token, a.logprob] for a in record.top]
    return {"token": record.token, "logprob": record.logprob, "top": top}


def _logprob_of(fields: Mapping[str, Any]) -> TokenLogprob:
    try:
        top = tuple(Alternative(int(t), float(lp)) for t, lp in fields["top"])
        return TokenLogprob(int(fields["token"]), float(fields["logprob"]), top)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(
            f"the endpoint answered a token's logprobs that do not parse ({err})"
        ) from None
