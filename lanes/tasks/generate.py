"""generate: a prompt -> a `Completion`, on a decoder with a KV cache.

An item is a prompt string, or a dict {"prompt", "max_tokens"?, "temperature"?,
"top_k"?, "top_p"?, "stop"?, "seed"?} whose missing fields come from the
workload's `generation:`. For now `run` completes its items one after another;
continuous batching (many sequences per step) is the serving engine's job and
reuses `Decoder.step` and `sampling.sample`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lanes.errors import InvalidInput
from lanes.runtime import Runtime
from lanes.spec import Generation, ModelSpec, TaskName, Workload
from lanes.tasks.base import check_count
from lanes.tasks.decoder import Completion, Decoder
from lanes.tasks.handler import NO_HANDLER, Handler
from lanes.tasks.sampling import SamplingParams

# Request field -> Generation field; the request uses OpenAI's spelling.
_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "stop": "stop",
}
_KNOWN = ("prompt", *_FIELDS, "seed")


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt, tokenized, with every generation parameter settled."""

    prompt: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None


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

    def prepare(self, item: Any) -> GenerateRequest:
        """A prompt, or a dict of prompt and parameters (null means "the default"),
        -> a tokenized request. Raises `InvalidInput` naming the field."""
        return self.check(self.handler.before(item))

    def check(self, item: Any) -> GenerateRequest:
        """`prepare` without the handler's `pre`."""
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, Mapping):
            raise InvalidInput(
                f"input: expected a prompt string or an object with 'prompt', "
                f"found {type(item).__name__}"
            )
        unknown = [str(k) for k in item if k not in _KNOWN]
        if unknown:
            raise InvalidInput(
                f"unknown field {unknown[0]!r}; expected some of {', '.join(_KNOWN)}"
            )
        prompt = item.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidInput(f"prompt: expected a string, found {type(prompt).__name__}")
        seed = item.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidInput(f"seed: expected an integer, found {seed!r}")
        params = self._generation(item)
        return GenerateRequest(
            prompt=prompt,
            prompt_ids=tuple(self.decoder.encode(prompt)),
            max_new_tokens=params.max_new_tokens,
            sampling=SamplingParams(params.temperature, params.top_k, params.top_p),
            stop=tuple(params.stop),
            seed=seed,
        )

    def _generation(self, item: Mapping[str, Any]) -> Generation:
        """The workload's defaults overridden by the item, checked by the spec's own rules."""
        merged = self.workload.generation.model_dump()
        for field, target in _FIELDS.items():
            value = item.get(field)
            if value is not None:
                merged[target] = [value] if field == "stop" and isinstance(value, str) else value
        try:
            return Generation.model_validate(merged, strict=True)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            target = str(first["loc"][0]) if first["loc"] else ""
            field = next((f for f, t in _FIELDS.items() if t == target), target)
            message = first["msg"][:1].lower() + first["msg"][1:]
            raise InvalidInput(f"{field}: {message}, found {first['input']!r}") from None

    def run(self, batch: Sequence[GenerateRequest]) -> list[Any]:
        """One `Completion` per request, one request after another (for now)."""
        outputs = [self.handler.after(self.complete(request)) for request in batch]
        check_count(self.name, outputs, batch)
        return outputs

    def complete(self, request: GenerateRequest) -> Completion:
        """One request, without the handler."""
        return self.decoder.complete(
            request.prompt_ids, request.max_new_tokens, request.sampling, request.stop, request.seed
        )

    def warm_up(self) -> None:
        self.decoder.complete(self.decoder.encode("warm up"), 2, SamplingParams(temperature=0))
