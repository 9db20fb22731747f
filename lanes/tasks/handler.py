"""A workload's own pre/post-processing: `handler: module:attr` in workloads.yaml.

The object named may have `pre(item) -> item` (runs before the task's own checks)
and/or `post(output) -> output` (runs per item after the model). Either may be
absent; an object with neither is an error, caught when the workload loads. An
interactive generate workload takes `pre` only (lanes/specrules.py): its answers are
OpenAI's completion shapes, which a `post` could not change.

What `pre` gets: online, the request's input (a text, a prompt or its options, the
named tensors); in an offline OpenAI batch line, the same (each text or prompt); in
an offline plain record, the whole record as a dict (id and all: CSV, JSONL, ...),
and it returns a record (a mapping, then read by the workload's `fields:` like any
record) or the task's item itself (embed: the text; generate: the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes.errors import HandlerError, InvalidInput, LanesError
from lanes.imports import import_object

# A pre that raises one of these is rejecting the input (HTTP 400), not crashing.
_REJECTIONS = (ValueError, TypeError, KeyError, IndexError)


@dataclass(frozen=True)
class Handler:
    """The loaded hooks; `ref` is the `module:attr` they came from."""

    ref: str
    pre: Callable[[Any], Any] | None
    post: Callable[[Any], Any] | None

    def before(self, item: Any) -> Any:
        """`pre(item)`, or the item itself. ValueError/TypeError/KeyError/IndexError
        from `pre` become `InvalidInput` naming the handler."""
        if self.pre is None:
            return item
        try:
            return self.pre(item)
        except InvalidInput:
            raise
        except _REJECTIONS as err:
            raise InvalidInput(f"handler {self.ref} rejected the input: {err}") from err

    def after(self, output: Any) -> Any:
        """`post(output)`, or the output itself. What `post` raises becomes a
        `HandlerError` naming the handler: the model did its part."""
        if self.post is None:
            return output
        try:
            return self.post(output)
        except LanesError:
            raise
        except Exception as err:
            raise HandlerError(
                f"handler {self.ref}: post failed on this output ({type(err).__name__}: "
                f"{err}); the model's output is fine: fix the handler"
            ) from err


NO_HANDLER = Handler("", None, None)


def load_handler(ref: str, root: Path | None = None) -> Handler:
    """Import `module:attr` (attr may be dotted) with the spec's folder `root` on the
    import path; raise `HandlerError` naming what failed."""
    target = import_object(ref, root, "handler")
    try:
        hooks = {name: getattr(target, name, None) for name in ("pre", "post")}
    except Exception as err:  # a property of the user's that raises
        raise HandlerError(f"handler {ref}: reading pre/post failed: {err!r}") from err
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise HandlerError(f"handler {ref}: {name} is {type(hook).__name__}, not callable")
    if hooks["pre"] is None and hooks["post"] is None:
        raise HandlerError(f"handler {ref}: has neither pre(item) nor post(output); define one")
    return Handler(ref, hooks["pre"], hooks["post"])


def load_scorer(ref: str, root: Path | None = None) -> Callable[[str], Any]:
    """A generate workload's guard: `module:fn` with `fn(text) -> score`, imported with the
    spec's folder `root` on the import path; `HandlerError` when it cannot be."""
    score = import_object(ref, root, "guard")
    if not callable(score):
        raise HandlerError(f"guard {ref}: is {type(score).__name__}, not callable")
    return score  # type: ignore[no-any-return]
