"""What the SDK clients send and how they read the answers, with no I/O: requests
built from a workload's label, results or typed errors out (lanes.wireerrors words the
errors), and the retry policy. `lanes.client` holds the two clients that do the I/O
around it.
"""

from __future__ import annotations

import difflib
import functools
import math
import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel

from lanes.errors import InvalidInput, LanesError, Overloaded, WrongMode
from lanes.payloads import (
    Request,
    embed_input,
    guessed,
    infer_inputs,
    output_array,
    tensor,
    vector,
)
from lanes.protocols import REQUEST_ID_HEADER, TIMEOUT_HEADER
from lanes.protocols.chat import ChatCompletionRequest
from lanes.protocols.completions import CompletionRequest
from lanes.protocols.openai import EmbeddingsRequest
from lanes.protocols.v2 import InferRequest
from lanes.settings import Settings
from lanes.spec import (
    InteractiveWorkload,
    OfflineWorkload,
    Spec,
    Workload,
    a_task,
    as_interactive,
    as_offline,
)
from lanes.specfile import load_spec
from lanes.streamed import DONE, Completion, Gathered, Usage, sse_data
from lanes.tracing import Tracing
from lanes.validation import describe
from lanes.wireerrors import answer_error, final_failure, parsed_error

# What a generate workload takes: a text, the model's token ids, or chat messages.
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]

BACKOFF_BASE_S = 0.2
# The longest a client sleeps before a retry; a longer Retry-After is the caller's call.
MAX_BACKOFF_S = 8.0


def endpoint_root(endpoint: str) -> str:
    """The server's root URL, checked now rather than at the first call (by the clients
    and `lanes top` alike)."""
    try:
        url: httpx.URL | None = httpx.URL(endpoint)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise InvalidInput.field(
            "endpoint", f"expected a URL like http://host:8000, found {endpoint!r}"
        )
    root = endpoint.rstrip("/")
    if url.path.rstrip("/").endswith(("/v1", "/v2")):  # an OpenAI base_url habit
        raise InvalidInput.field(
            "endpoint",
            f"{endpoint!r} ends in an API's path: give the server's root, "
            f"{root.rsplit('/', 1)[0]} (lanes adds each API's path itself)",
        )
    return root


class Core:
    """What both clients share. No I/O here: requests in, results or typed errors out."""

    def __init__(
        self,
        endpoint: str | None,
        api_key: str | None,
        spec: Spec | str | Path | None,
        settings: Settings | None,
        max_retries: int,
        prefect_api_url: str | None,
        tracing: Tracing | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries: expected 0 or more, found {max_retries}")
        self.settings = settings or Settings()
        self.endpoint = endpoint_root(endpoint or self.settings.endpoint)
        key = api_key or (
            self.settings.api_key.get_secret_value() if self.settings.api_key else None
        )
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._spec = spec
        # Relative input/output paths in the spec are read against its folder.
        where = spec if isinstance(spec, str | Path) else self.settings.spec
        self.base = Path(where).resolve().parent
        self.max_retries = max_retries
        # The same chain as the endpoint's Batch API: a job submitted here and a batch
        # made there are followed on one Prefect API (LANES_PREFECT_API_URL), else
        # Prefect's own PREFECT_API_URL (lanes.prefectapi).
        self.prefect_api_url = prefect_api_url or self.settings.prefect_api_url
        self.tracing = tracing if tracing is not None else Tracing.from_settings(self.settings)
        # infer workload -> input name -> v2 datatype, from its metadata (see types_request).
        self._input_types: dict[str, dict[str, str]] = {}

    @property
    def spec(self) -> Spec:
        # Loaded on first use: a client that only follows jobs needs no spec at all.
        if not isinstance(self._spec, Spec):
            self._spec = load_spec(self._spec, self.settings, check_files=False)
        return self._spec

    def workload(self, name: str, mode: Literal["interactive", "offline"]) -> Workload:
        """The workload, if it runs in `mode`; else WrongMode naming the method to use."""
        w = self.spec.workload(name)
        if w.mode == mode:
            return w
        if mode == "interactive":
            raise WrongMode(
                f"workload {name!r} is offline: submit its records with "
                f"client.submit({name!r}, records) instead of call or stream"
            )
        raise WrongMode(
            f"workload {name!r} is interactive: use client.call({name!r}, ...) "
            "(or client.stream), not submit"
        )

    def interactive(self, name: str) -> InteractiveWorkload:
        """The workload, if it is interactive; else WrongMode naming the method to use."""
        return as_interactive(self.workload(name, "interactive"))

    def offline(self, name: str) -> OfflineWorkload:
        """The workload, if it is offline; else WrongMode naming the method to use."""
        return as_offline(self.workload(name, "offline"))

    # ---- requests -----------------------------------------------------------------

    def call_request(
        self, name: str, input: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.interactive(name)
        headers = self._headers(timeout_ms)
        if w.task == "embed":
            _check_options(options, EmbeddingsRequest, "call", name)
            # base64 float32 is a quarter of the JSON and decodes without parsing floats.
            sent = embed_input(input)
            body = {**options, "model": name, "input": sent, "encoding_format": "base64"}
            return Request("POST", "/v1/embeddings", body, headers, timeout_ms=timeout_ms)
        if w.task == "generate":
            # The workload's `stream:` says how the answer travels; `call` returns the
            # same Completion either way (a guard's chunked mode sends what passed).
            return self._generate_request(
                name, input, options, headers, timeout_ms, w.stream, "call"
            )
        _check_options(options, InferRequest, "call", name)
        types = self._input_types.get(name, {})
        named = infer_inputs(input, list(types), name)
        tensors = [tensor(k, v, types.get(k)) for k, v in named.items()]
        body = {**options, "inputs": tensors}
        return Request("POST", f"/v2/models/{name}/infer", body, headers, timeout_ms=timeout_ms)

    def types_request(self, name: str, input: Any, options: dict[str, Any]) -> Request | None:
        """The metadata request of an infer workload, when the client has not learned
        the model's inputs yet and needs them: `input` is no mapping (which input is
        it?), or has values whose datatype it would have to guess (the server takes
        only the model's datatypes); else None. Hand its answer to `learn_types`.
        The call's `options` are checked first: a bad one sends nothing at all."""
        w = self.workload(name, "interactive")
        if w.task != "infer":
            return None
        _check_options(options, InferRequest, "call", name)
        if name in self._input_types:
            return None
        if isinstance(input, Mapping) and not any(guessed(v) for v in input.values()):
            return None
        return Request("GET", f"/v2/models/{name}", None, dict(self.headers))

    def learn_types(self, name: str, metadata: Any) -> None:
        try:
            self._input_types[name] = {i["name"]: i["datatype"] for i in metadata["inputs"]}
        except (KeyError, TypeError) as e:
            raise LanesError(
                f"{self.endpoint}: the metadata of {name!r} is not the v2 shape "
                f"({type(e).__name__}: {e}); is this a lanes endpoint?"
            ) from None

    def stream_request(
        self, name: str, prompt: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.workload(name, "interactive")
        if w.task != "generate":
            raise WrongMode(
                f"workload {name!r} is {a_task(w.task)} workload: use client.call, not stream"
            )
        headers = self._headers(timeout_ms)
        return self._generate_request(name, prompt, options, headers, timeout_ms, True, "stream")

    def _headers(self, timeout_ms: float | None) -> dict[str, str]:
        # One id per call, kept by its retries: the server's logs and errors say it.
        headers = {
            **self.headers,
            REQUEST_ID_HEADER: uuid.uuid4().hex,
            "Content-Type": "application/json",  # every request with a body
        }
        if timeout_ms is not None:
            if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float):
                raise InvalidInput.field(
                    "timeout_ms", f"expected a number of milliseconds, found {describe(timeout_ms)}"
                )
            if not 0 < timeout_ms < math.inf:  # else the server's 400 names its header
                raise InvalidInput.field(
                    "timeout_ms",
                    f"expected a positive number of milliseconds, found {timeout_ms!r}",
                    "invalid_value",
                )
            headers[TIMEOUT_HEADER] = _ms(timeout_ms)
        return headers

    @staticmethod
    def _generate_request(
        name: str,
        prompt: Any,
        options: dict[str, Any],
        headers: dict[str, str],
        timeout_ms: float | None,
        stream: bool,
        method: str,
    ) -> Request:
        body: dict[str, Any] = {**options, "model": name, "stream": stream}
        if stream and method == "call":  # gathered into a Completion, usage and all
            body["stream_options"] = {"include_usage": True}
        ids = token_ids(prompt)
        if isinstance(prompt, str):
            _check_options(options, CompletionRequest, method, name)
            path, body = "/v1/completions", {**body, "prompt": prompt}
        elif ids is not None:
            _check_options(options, CompletionRequest, method, name)
            path, body = "/v1/completions", {**body, "prompt": ids}
        elif (
            isinstance(prompt, list | tuple)
            and prompt
            and all(isinstance(m, Mapping) for m in prompt)
        ):
            _check_options(options, ChatCompletionRequest, method, name)
            path, body = "/v1/chat/completions", {**body, "messages": list(prompt)}
        else:
            raise InvalidInput.field(
                "prompt",
                "expected a string, a list of token ids, or a list of chat messages "
                f"({{'role': ..., 'content': ...}}), found {_described_prompt(prompt)}",
                "empty_array" if isinstance(prompt, list | tuple) and not prompt else None,
            )
        _check_one_choice(options, method)
        return Request("POST", path, body, headers, streamed=stream, timeout_ms=timeout_ms)

    def traced(self, request: Request) -> AbstractContextManager[object]:
        """A CLIENT span around a request's attempts, its context in the request's
        headers (traceparent); nothing when tracing is off."""
        if self.tracing is None:
            return nullcontext()
        return self._traced(self.tracing, request)

    @contextmanager
    def _traced(self, tracing: Tracing, request: Request) -> Iterator[object]:
        attributes = {
            "http.request.method": request.method,
            "url.full": self.endpoint + request.path,
            "lanes.request_id": request.headers.get(REQUEST_ID_HEADER, ""),
        }
        name = f"{request.method} {request.path}"
        with tracing.span(name, tracing.kinds.CLIENT, attributes=attributes) as span:
            tracing.inject(request.headers)
            yield span

    @contextmanager
    def submitting(self, workload: str) -> Iterator[dict[str, str] | None]:
        """A span around a submit (with tracing on), and its context as W3C headers
        for the flow run to continue; None when tracing is off."""
        if self.tracing is None:
            yield None
            return
        tracing = self.tracing
        with tracing.span(f"submit {workload}", tracing.kinds.PRODUCER):
            yield tracing.carrier()

    def gathering(self) -> Gathered:
        """What reads a `call`'s streamed answer back into its Completion."""
        return Gathered(self.chunk_text, self.endpoint)

    # ---- responses ----------------------------------------------------------------

    def call_result(self, name: str, input: Any, body: Any) -> Any:
        task = self.spec.workload(name).task
        try:
            if task == "embed":
                vectors = np.stack([vector(d["embedding"]) for d in body["data"]])
                return vectors[0] if isinstance(input, str) else vectors
            if task == "generate":
                choice = body["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                usage = Usage(**{k: int(body["usage"][k]) for k in Usage.__dataclass_fields__})
                return Completion(text, choice["finish_reason"], usage, choice.get("logprobs"))
            return {o["name"]: output_array(o) for o in body["outputs"]}
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LanesError(
                f"{self.endpoint}: the answer for {name!r} is not the {task} shape lanes "
                f"serves ({type(e).__name__}: {e}); is this a lanes endpoint?"
            ) from None

    def line_text(self, line: str) -> str | None:
        """The text one SSE line of a stream carries ("" when none); None at `data: [DONE]`."""
        event = sse_data(line)
        if event is DONE:
            return None
        return self.chunk_text(event) if event is not None else ""

    def chunk_text(self, event: dict[str, Any]) -> str:
        """The text of one SSE event; an error event raises its typed error."""
        error = event.get("error")
        if error is not None:
            raise parsed_error(self.endpoint, None, event)
        choices = event.get("choices") or []
        if not choices:
            return ""  # a usage chunk
        choice = choices[0]
        if "delta" in choice:
            return str(choice["delta"].get("content") or "")
        return str(choice.get("text") or "")

    def error(self, status: int, body: bytes, headers: Mapping[str, str]) -> LanesError:
        """The typed error for a failed response (lanes.wireerrors)."""
        return answer_error(self.endpoint, status, body, headers, "Authorization" in self.headers)

    def failure(self, error: Exception, tries: int | None = None) -> LanesError:
        """What the caller sees once retries are over (`tries` attempts, by default
        every one): always a LanesError (lanes.wireerrors)."""
        return final_failure(self.endpoint, error, tries or self.max_retries + 1)

    # ---- retries ------------------------------------------------------------------

    def attempt_headers(self, request: Request, attempt: int, started: float) -> dict[str, str]:
        """The headers of an attempt that starts now: a retry's deadline is what is left
        of the call's (`started`: its first attempt's time.monotonic())."""
        if attempt == 0 or request.timeout_ms is None:
            return request.headers
        left_ms = request.timeout_ms - (time.monotonic() - started) * 1000
        # A sleep that overslept the deadline: the server's 504 says so (0 is a 400).
        return {**request.headers, TIMEOUT_HEADER: _ms(max(left_ms, 1.0))}

    def retry_delay(
        self, error: Exception, attempt: int, request: Request, started: float
    ) -> float | None:
        """Seconds to wait before the next attempt; None when there is none: the error
        is not retried, the attempts are spent, or the wait would pass the call's
        deadline (its last answer is the caller's, not a retry that cannot succeed)."""
        if not self.retryable(error, attempt):
            return None
        delay = self.backoff(attempt, error)
        waited_s = time.monotonic() + delay - started
        if request.timeout_ms is not None and waited_s >= request.timeout_ms / 1000:
            return None
        return delay

    def retryable(self, error: Exception, attempt: int) -> bool:
        """Connection errors and 503s, while attempts are left; never a 4xx, never a
        read or write timeout (the server may still be working on the request)."""
        if attempt >= self.max_retries:
            return False
        if isinstance(error, Overloaded):
            return error.retry_after <= MAX_BACKOFF_S
        return isinstance(error, httpx.TransportError) and not isinstance(
            error, httpx.ReadTimeout | httpx.WriteTimeout | httpx.PoolTimeout
        )

    @staticmethod
    def backoff(attempt: int, error: Exception) -> float:
        """Exponential backoff with full jitter; a server's Retry-After is a floor."""
        delay = random.uniform(0, min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2**attempt))
        if isinstance(error, Overloaded):
            delay = max(delay, error.retry_after)
        return delay


# ---- wire helpers ---------------------------------------------------------------------

# What the client fills in itself: an option of that name would be overwritten.
_SET_BY_CLIENT = frozenset(
    {"model", "stream", "prompt", "messages", "input", "encoding_format", "inputs"}
)
# And by `call`: a streamed answer's usage, which its Completion carries. The CLI words
# its refusal of these as its own (router/client_cli.py).
SET_BY_CALL = _SET_BY_CLIENT | {"stream_options"}


def _check_options(
    options: Mapping[str, Any], route: type[BaseModel], method: str, name: str
) -> None:
    """Refuse an option the request `route` does not define (or one the client sets
    itself). The server ignores fields it does not know, as vLLM does, so a misspelt
    `max_token` would be dropped there without a word: the SDK knows the request's
    fields (the server's own request models) and says so before sending anything."""
    if not options:  # most calls: nothing to look up
        return
    set_here = SET_BY_CALL if method == "call" else _SET_BY_CLIENT
    allowed = _allowed(route, set_here)
    for option in options:
        if option in allowed:
            continue
        if option in set_here:
            detail = f"{method}() sets {option!r} itself; leave it out"
        else:
            near = difflib.get_close_matches(option, allowed, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            detail = (
                f"unknown option {option!r} for workload {name!r}"
                f"{hint} (it takes: {', '.join(allowed)})"
            )
        raise InvalidInput.field(option, detail, "unknown_parameter")


def _ms(timeout_ms: float) -> str:
    """A deadline as X-Timeout-Ms carries it: exact (`:g` kept six digits, so 1234567
    went as 1.23457e+06)."""
    return repr(float(timeout_ms))


def _check_one_choice(options: Mapping[str, Any], method: str) -> None:
    """Refuse `n` other than 1: `call` returns one Completion and `stream` yields one
    text, so the server's other choices would be dropped, or their chunks interleaved
    into one text. And `logprobs` of a `stream`, which yields the text alone."""
    asked = options.get("logprobs")
    if method == "stream" and asked is not None and asked is not False:  # 0 asks too
        raise InvalidInput.field(
            "logprobs",
            "stream() yields the text alone, so the logprobs would be dropped: use call() "
            f"(its Completion carries them), found {describe(asked)}",
            "unsupported_value",
        )
    n = options.get("n")
    if n is None or (n == 1 and not isinstance(n, bool)):
        return
    returns = "call() returns one Completion" if method == "call" else "stream() yields one text"
    raise InvalidInput.field(
        "n",
        f"{returns}: expected 1 or none, found {describe(n)}; for several choices, "
        "make several calls (each with its own seed)",
        "unsupported_value",
    )


@functools.cache
def _allowed(route: type[BaseModel], set_here: frozenset[str]) -> tuple[str, ...]:
    """The options a request model takes from a caller, less those the client sets
    (`set_here`), sorted (said in errors); its fields are fixed, so one look each."""
    return tuple(sorted(set(route.model_fields) - set_here))


def token_ids(prompt: Any) -> list[int] | None:
    """A prompt given as the model's token ids, as /v1/completions takes them; None
    when `prompt` is not a list (or tuple, or 1-d integer array) of integers.

    An id below 0 is an InvalidInput here; one beyond the vocabulary only the server
    can tell (a 400 naming the vocabulary's range)."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            return None
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple) or not prompt:
        return None
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
        return None
    ids = [int(t) for t in prompt]
    for i, token in enumerate(ids):
        if token < 0:
            raise InvalidInput.field(
                f"prompt[{i}]", f"expected a token id (0 or more), found {token}", "invalid_value"
            )
    return ids


def _described_prompt(prompt: Any) -> str:
    if isinstance(prompt, list | tuple) and not prompt:
        return "an empty array"
    return describe(prompt)
