"""generate: a prompt -> a `Completion`, on a decoder with a KV cache.

An item is a prompt string, or a dict {"prompt", "max_tokens"?, "temperature"?,
"top_k"?, "top_p"?, "stop"?, "seed"?, "logit_bias"?, "presence_penalty"?,
"frequency_penalty"?, and vLLM's "stop_token_ids"?, "min_tokens"?,
"include_stop_str_in_output"?, "repetition_penalty"?, "min_p"?} in an OpenAI request's ranges
(`GenerationOptions`, whichever lane it came by) whose missing fields come from the
workload's `generation:`; a prompt may also be a list of the model's token ids
(taken as they are, as vLLM does). A prompt and an explicit `max_tokens` must fit
the model's context together; without one, the completion stops where the context
ends. `run` completes a batch in the step loop of lanes/generation (continuous
batching: as many sequences in flight as the workload's batch size, refilled as
they finish), the loop the serving engine runs too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from lanes.errors import InvalidInput, shown
from lanes.generation.kvbudget import KvBudget
from lanes.isolation import Failed
from lanes.protocols.generateparams import GenerationOptions
from lanes.runtime import Runtime
from lanes.spec import (
    Generation,
    InteractiveWorkload,
    ModelSpec,
    OfflineWorkload,
    TaskName,
    Workload,
)
from lanes.tasks.base import check_count
from lanes.tasks.decoder import Completion, Decoder
from lanes.tasks.handler import NO_HANDLER, Handler
from lanes.tasks.sampling import SamplingParams
from lanes.validation import describe, invalid_input

if TYPE_CHECKING:
    from lanes.generation.text import ByteText, Spelling

log = logging.getLogger(__name__)

# Request field -> Generation field; the request uses OpenAI's spelling.
_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
}
_KNOWN = ("prompt", *GenerationOptions.model_fields)
# An item's fields beside its prompt: a record's generation options, by these names.
OPTIONS = frozenset(GenerationOptions.model_fields)
_REQUEST_NAMES = {target: field for field, target in _FIELDS.items()}
# The numeric request fields, and whether each takes only an integer.
_NUMBERS = {
    "max_tokens": True,
    "top_k": True,
    "seed": True,
    "min_tokens": True,
    "temperature": False,
    "top_p": False,
    "min_p": False,
    "presence_penalty": False,
    "frequency_penalty": False,
    "repetition_penalty": False,
}


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt, tokenized, with every generation parameter settled."""

    prompt: str  # the text (token ids given as a prompt: their decoding)
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool = False  # run to the budget (benchmarks)
    # Each token's logprob and this many alternatives (an OpenAI request's logprobs);
    # None: none at all.
    top_logprobs: int | None = None
    # Each prompt token's logprob (after the first) and this many alternatives (an
    # OpenAI completion's echo); None: the prompt is not scored. With it,
    # max_new_tokens may be 0: the prompt is scored, and nothing generated.
    prompt_logprobs: int | None = None
    # vLLM's: see Seq (lanes/generation/seq.py).
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False
    # OpenAI's and vLLM's: see Seq.
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


# A CSV record's generation fields that are no number nor text, written as JSON in
# their cell: `[199, 200]`, `{"199": 5}`, `true`.
_JSON_VALUES = ("stop_token_ids", "logit_bias", "include_stop_str_in_output")


def from_text(item: Mapping[str, Any]) -> dict[str, Any]:
    """`item` read as text (a CSV record: every value a string), its generation fields
    as a JSON record holds them: an empty one is null (the workload's default), a
    number is read as JSON reads it, `stop` is one stop string, `stop_token_ids`,
    `logit_bias` and `include_stop_str_in_output` are JSON; the other fields are left
    as they are. Raises `InvalidInput` naming a field whose text is no such number
    (`max_tokens: expected an integer, found 'abc'`); a JSON field's text that is no
    JSON stays text, for the request's check to name."""
    typed = dict(item)
    for field, value in item.items():
        if field not in (*_NUMBERS, *_JSON_VALUES, "stop") or not isinstance(value, str):
            continue
        if field == "stop":
            typed[field] = value or None  # a blank stop string ("\n\n") is one
        elif not value.strip():
            typed[field] = None
        elif field in _JSON_VALUES:
            typed[field] = _json_or_text(value)
        else:
            typed[field] = _number(field, value, whole=_NUMBERS[field])
    return typed


def from_table(item: Mapping[str, Any]) -> dict[str, Any]:
    """`item` read from a Parquet row, its integer generation fields as a JSON record
    holds them: pandas writes a column of integers with a missing value as float64, so
    a whole float there is its integer and NaN is not given (null, the workload's
    default). Any other float stays, for the request's check to name."""
    typed = dict(item)
    for field, whole in _NUMBERS.items():
        value = item.get(field)
        if not whole or not isinstance(value, float):
            continue
        if math.isnan(value):
            typed[field] = None
        elif value.is_integer():
            typed[field] = int(value)
    return typed


def _json_or_text(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _number(field: str, text: str, whole: bool) -> int | float:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = text
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and not whole:
        return value
    expected = "an integer" if whole else "a number"
    raise InvalidInput.field(field, f"expected {expected}, found {describe(text)}", "invalid_type")


def _generate_batch(
    task: GenerateTask, requests: Sequence[GenerateRequest], rows: int
) -> list[Completion | Failed]:
    # lanes.generation sits on lanes.tasks.decoder, which imports this package's
    # __init__ (and so this module): imported when first used, the cycle never closes.
    from lanes.generation.batch import generate_batch

    return generate_batch(
        task.decoder,
        requests,
        rows,
        task.name,
        byte_text=task.byte_text,
        prefix_bytes=task.prefix_bytes,
        max_kv_bytes=task.kv_budget.max_bytes,
    )


class GenerateTask:
    """A decoder workload; outputs are `Completion`s (or the handler's `post` of them)."""

    kind: TaskName = "generate"

    def __init__(
        self,
        name: str,
        workload: Workload,
        model: ModelSpec,
        runtime: Runtime,
        handler: Handler = NO_HANDLER,
    ) -> None:
        self.name = name
        self.workload = workload
        self.handler = handler
        self.decoder = Decoder.load(model, runtime)
        # Whether the online engine prefills arrivals beside a decode (serving/engine.py).
        self.room_beside = runtime.room_beside(model)
        self.prefix_bytes = runtime.settings.prefix_cache_bytes  # offline batches' bound
        # An offline workload has no batching: its budget is a key of its own, unless it
        # is an interactive workload's offline copy (a Batch API batch's).
        if isinstance(workload, InteractiveWorkload):
            key, most = "batching.max_kv_bytes", workload.batching.max_kv_bytes
        else:
            key, most = workload.max_kv_bytes_key, workload.max_kv_bytes
        config = self.decoder.config
        self.kv_budget = KvBudget(most, self.decoder.position_bytes, config.max_position, key)
        self._log_kv_risk()

    def _log_kv_risk(self) -> None:
        """What the rows' caches may take without a budget, for operators to see the risk."""
        context, budget = self.decoder.config.max_position, self.kv_budget
        if context is None:
            return
        worst = self.rows * context * budget.position_bytes
        bound = f"; no {budget.key}"
        if budget.max_bytes is not None:
            bound = f"; {budget.key} bounds it to {budget.max_bytes}"
        log.info(
            "workload %s: KV cache of %d bytes per token; %d rows of the whole context "
            "(%d tokens) may take %d bytes (%.1f GiB)%s",
            self.name,
            budget.position_bytes,
            self.rows,
            context,
            worst,
            worst / 2**30,
            bound,
        )

    @cached_property
    def byte_text(self) -> ByteText | None:
        """Text from the tokens' bytes where the tokenizer's decoder joins them (no
        decode() calls, lanes/generation/text.py), for the task's engine and offline
        batches alike: it walks the vocabulary once; None for other decoders."""
        from lanes.generation.text import ByteText, byte_pieces  # see _generate_batch

        pieces = byte_pieces(self.decoder.tokenizer)
        return None if pieces is None else ByteText(pieces)

    @cached_property
    def spelling(self) -> Spelling:
        """How logprobs name this model's tokens (lanes/generation/text.py)."""
        from lanes.generation.batch import detokenizer  # see _generate_batch
        from lanes.generation.text import Spelling

        byte_text = self.byte_text
        return Spelling(detokenizer(self.decoder), byte_text.pieces if byte_text else None)

    def prepare(self, item: Any, *, prompt_only: bool = False) -> GenerateRequest:
        """A prompt, or a dict of prompt and parameters (null means "the default"),
        -> a tokenized request. Raises `InvalidInput` naming the field. `prompt_only`:
        the prefill alone (an OpenAI echo with max_tokens 0): the request scores its
        prompt and makes no token, whatever the item's max_tokens, and its prompt may
        fill the context, as vLLM lets it."""
        return self.check(self.handler.before(item), prompt_only=prompt_only)

    def check(self, item: Any, *, prompt_only: bool = False) -> GenerateRequest:
        """`prepare` without the handler's `pre`."""
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, Mapping):
            raise InvalidInput(
                f"input: expected a prompt string or an object with 'prompt', "
                f"found {describe(item)}"
            )
        unknown = [str(k) for k in item if k not in _KNOWN]
        if unknown:
            raise InvalidInput(
                f"unknown field {shown(unknown[0])}; expected some of {', '.join(_KNOWN)}"
            )
        try:  # the request's ranges, as the OpenAI routes check them
            options = GenerationOptions.model_validate(
                {k: v for k, v in item.items() if k != "prompt"}
            )
        except ValidationError as err:
            raise invalid_input(err) from None
        params = self._generation(options)
        budget = 0 if prompt_only else options.max_tokens
        prompt, ids = self._prompt(item.get("prompt"), budget)
        self.decoder.check_context(len(ids), budget)
        most = 0 if prompt_only else params.max_new_tokens
        self.kv_budget.check(len(ids), most)
        if options.min_tokens and options.min_tokens > most:
            detail = f"expected at most max_tokens ({most}), found {options.min_tokens}"
            raise InvalidInput.field("min_tokens", detail, "invalid_value")
        return GenerateRequest(
            prompt=prompt,
            prompt_ids=tuple(ids),
            max_new_tokens=most,
            sampling=SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p),
            stop=tuple(params.stop),
            seed=options.seed,
            stop_token_ids=frozenset(self._token_ids("stop_token_ids", options.stop_token_ids)),
            min_tokens=options.min_tokens or 0,
            include_stop=options.include_stop_str_in_output is True,
            logit_bias=self._bias(options.logit_bias),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            # A sequence that makes no token finishes at its prefill only when its
            # prompt is scored (Seq.prompt_logprobs); the protocol's settle() says how.
            prompt_logprobs=0 if prompt_only else None,
        )

    def _token_ids(self, field: str, ids: list[int] | None) -> list[int]:
        """`ids` (a request's `field`), each checked to be in the model's vocabulary."""
        vocab = self.vocab_size
        for i, token in enumerate(ids or ()):
            if not 0 <= token < vocab:
                detail = f"expected token ids from 0 to {vocab - 1}, found {token} at [{i}]"
                raise InvalidInput.field(field, detail, "invalid_value")
        return ids or []

    def _bias(self, bias: Mapping[str, Any] | None) -> dict[int, float]:
        """A request's logit_bias, each key a token id of the model, each value -100..100."""
        vocab, checked = self.vocab_size, {}
        for key, value in (bias or {}).items():
            number = isinstance(value, int | float) and not isinstance(value, bool)
            # isascii: "²" is a digit to isdigit(), and no number to int().
            if (
                not (key.isascii() and key.isdigit())
                or int(key) >= vocab
                or not number
                or not -100 <= value <= 100
            ):
                detail = (
                    f"expected token ids from 0 to {vocab - 1} (as strings) mapped to numbers "
                    f"from -100 to 100, found {shown(key)}: {describe(value)}"
                )
                raise InvalidInput.field("logit_bias", detail, "invalid_value")
            checked[int(key)] = float(value)
        return checked

    @property
    def vocab_size(self) -> int:
        return self.decoder.config.vocab_size or self.decoder.tokenizer.get_vocab_size()

    def _prompt(self, prompt: Any, budget: int | None) -> tuple[str, list[int]]:
        """The prompt's text and token ids, from a text or from token ids; a text's,
        checked to leave room in the context for `budget` tokens (None: at least one)."""
        if isinstance(prompt, str):
            return prompt, self.decoder.encode(prompt, budget)
        if not isinstance(prompt, list) or not prompt:
            detail = f"expected a string or token ids, found {describe(prompt)}"
            raise InvalidInput.field("prompt", detail, "invalid_type")
        vocab = self.vocab_size
        for i, token in enumerate(prompt):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                detail = (
                    f"expected token ids from 0 to {vocab - 1}, found {describe(token)} at [{i}]"
                )
                raise InvalidInput.field("prompt", detail, "invalid_value")
        return self.decoder.tokenizer.decode(prompt), list(prompt)

    def _generation(self, options: GenerationOptions) -> Generation:
        """The workload's defaults overridden by the options set, checked by the spec's
        own rules too (e.g. at most 16 stop strings)."""
        merged = self.workload.generation.model_dump()
        for field, target in _FIELDS.items():
            value = getattr(options, field)
            if field == "stop" and isinstance(value, str):
                value = [value]
            elif field == "top_k" and value == -1:  # vLLM's "no cut", as 0 is here
                value = 0
            if value is not None:
                merged[target] = value
        try:
            return Generation.model_validate(merged, strict=True)
        except ValidationError as err:
            error = invalid_input(err, _REQUEST_NAMES)
            # A stop sent as one string is checked as a list of it: name what was sent.
            if isinstance(options.stop, str) and error.param == "stop[0]":
                error = error.at("stop")
            raise error from None

    @property
    def rows(self) -> int:
        """Sequences in flight at once: the workload's batch size."""
        workload = self.workload
        if isinstance(workload, OfflineWorkload):
            return workload.batch_size
        return workload.batching.max_batch_size

    def run(self, batch: Sequence[GenerateRequest]) -> list[Any]:
        """One `Completion` per request (the handler's `post` of it); raises what the
        first request that failed alone raised (`run_apart` says which)."""
        outputs = self.run_apart(batch)
        failed = next((o for o in outputs if isinstance(o, Failed)), None)
        if failed is not None:
            raise failed.error
        return outputs

    def run_apart(self, batch: Sequence[GenerateRequest]) -> list[Any]:
        """`run`, where a request the model (or the handler's `post`) failed on alone
        gets a `Failed` and every other request its output. Raises only when a step
        failed outside any one request's run."""
        outputs: list[Any] = []
        for i, done in enumerate(_generate_batch(self, batch, self.rows)):
            if isinstance(done, Failed):
                outputs.append(done)
                continue
            try:
                outputs.append(self.handler.after(done))
            except Exception as error:  # one output's post: its request alone fails
                outputs.append(Failed(i, error))
        check_count(self.name, outputs, batch)
        return outputs

    def complete(self, request: GenerateRequest) -> Completion:
        """One request, without the handler."""
        (done,) = _generate_batch(self, [request], 1)
        if isinstance(done, Failed):
            raise done.error
        return done

    def warm_up(self) -> None:
        self.decoder.complete(self.decoder.encode("warm up"), 2, SamplingParams(temperature=0))
