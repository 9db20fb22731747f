"""How one workload's plain records become requests: its `fields:` and its handler's `pre`.

    shape = RecordShape.of(workload, handler)
    shape.id_of(record)      # the id, from `fields.id`
    shape.typed(record, text)  # a CSV record's numbers, as a JSON record holds them
    shape.kept(record)       # the `fields.keep` fields, for the output line
    shape.item_of(record)    # the task's item

The item comes from the record by the mapping: embed reads the text field or
template (`fields.text`, default the field `text`); generate the prompt field or
template (`fields.prompt`) with the record's fields named as generation options
(max_tokens, temperature, ...: `GenerationOptions`), else every field but the id and
the kept ones (prompt, max_tokens, ...), a kept prompt or option still the request's;
infer every field but the id and the kept ones. A handler's
`pre` gets the whole record first, id and all, and returns a record (a mapping, then
read by the mapping like any record) or the item itself (embed: the text; generate:
the prompt). The id and the kept fields always come from the record as read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from lanes.errors import InvalidInput, with_article
from lanes.spec import OfflineWorkload, TaskName, a_task
from lanes.specoffline import Fields
from lanes.tasks.generate import OPTIONS, from_table, from_text
from lanes.tasks.handler import Handler
from lanes.template import Template, is_template
from lanes.validation import describe

# What a record of each task looks like by default, for messages.
_EXAMPLE = {
    "embed": '{"id": ..., "text": "..."}',
    "generate": '{"id": ..., "prompt": "...", <generation options>}',
    "infer": '{"id": ..., <input name>: <array>, ...}',
}


@dataclass(frozen=True)
class RecordShape:
    """`handler` None: not known here (the records check runs without loading the
    model); then the item is not made, only the id and kept fields are checked."""

    workload: str  # its name: an OpenAI batch line's body.model must be it
    kind: TaskName
    fields: Fields
    handler: Handler | None
    defers_item: bool  # the item is made by `pre`, or by a handler not loaded here
    source: str | Template | None  # fields.text (embed) or fields.prompt (generate)

    @classmethod
    def of(cls, name: str, workload: OfflineWorkload, handler: Handler | None) -> RecordShape:
        fields = workload.fields
        pre = handler is not None and handler.pre is not None
        unknown = handler is None and workload.handler is not None
        named = {"embed": fields.text, "generate": fields.prompt}.get(workload.task)
        source = Template.parse(named) if named is not None and is_template(named) else named
        return cls(name, workload.task, fields, handler, pre or unknown, source)

    def id_of(self, record: Mapping[str, Any]) -> tuple[Any, str | None]:
        """The record's id, or None and why it has none."""
        name = self.fields.id
        if name not in record:
            if name == "id" and "url" in record and "body" in record:
                # An OpenAI batch line but for its custom_id: not a plain record without an id.
                return None, (
                    'missing field "custom_id": an OpenAI batch line is {"custom_id": ..., '
                    '"method": "POST", "url": ..., "body": {...}}'
                )
            if name == "id":
                hint = "; if your records name it otherwise, set the workload's `fields.id`"
                example = _EXAMPLE[self.kind]
                return None, f'missing field "id": a plain record is {example}{hint}'
            return None, f'missing field "{name}" (the id, by `fields.id`)'
        rid = record[name]
        if not isinstance(rid, str | int) or isinstance(rid, bool):
            return None, (
                f'field "{name}" (the id): expected a string or an integer, found {describe(rid)}'
            )
        if rid == "":  # as a CSV cell with nothing in it reads
            return None, f'field "{name}" (the id): expected a non-empty id, found an empty string'
        return rid, None

    def typed(
        self, record: Mapping[str, Any], text: bool, parquet: bool = False
    ) -> Mapping[str, Any]:
        """The record as a JSON record holds it. With `text` (a CSV record: every value
        a string), a generate record has its generation fields read as numbers
        (lanes.tasks.generate.from_text): `max_tokens`, `temperature`, `top_k`, `top_p`
        and `seed`, an empty one as null; its other fields stay text. `InvalidInput`
        names a field that is no such number. With `parquet` (a Parquet row), its
        integer fields' whole floats are integers, NaN null (`from_table`)."""
        if self.kind != "generate":
            return record
        if text:
            return from_text(record)
        return from_table(record) if parquet else record

    def kept(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The fields to carry to the output; `InvalidInput` names one that is missing,
        or one that JSON cannot hold (Parquet's binary and decimal values), before the
        model runs for it."""
        missing = [name for name in self.fields.keep if name not in record]
        if missing:
            raise InvalidInput(f'missing field "{missing[0]}" (in `fields.keep`)')
        kept = {name: record[name] for name in self.fields.keep}
        for name, value in kept.items():
            try:
                orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError:
                raise InvalidInput(
                    f'field "{name}" (in `fields.keep`): {with_article(type(value).__name__)} cannot be '
                    "written in a JSON output line; cast it in the input, or keep it out"
                ) from None
        return kept

    def item_of(self, record: Mapping[str, Any]) -> Any:
        """The task's item for `record`; `InvalidInput` says which field is missing."""
        if self.handler is not None and self.handler.pre is not None:
            made = self.handler.before(record)
            if not isinstance(made, Mapping):
                return made
            record = made
        if self.kind == "embed":
            return self._from(record, "text")
        skip = {self.fields.id, *self.fields.keep}
        if self.kind == "generate":
            # Checked here, not left to the task: the validating step then catches it.
            prompt = self._from(record, "prompt")
            # Keeping copies, it does not withdraw: a kept prompt or max_tokens is still
            # the request's (a field named as an option is one, kept or not), so the
            # output line shows the budget that bounded it.
            options = {k: v for k, v in record.items() if k in OPTIONS and k != self.fields.id}
            if self.source is not None:
                # The prompt is made, and the record's options still apply: a record's
                # max_tokens is its own whichever field holds its prompt. Its other
                # fields are the template's, or the user's own.
                return {"prompt": prompt, **options}
            rest = {k: v for k, v in record.items() if k not in skip}
            return {**rest, "prompt": prompt, **options}
        return {k: v for k, v in record.items() if k not in skip}

    def item_label(self) -> str:
        """What an embed record's text is called in messages."""
        field = self.source if isinstance(self.source, str) else "text"
        if self.handler is not None and self.handler.pre is not None:
            return f"{field} (after {self.handler.ref} pre)"
        return field

    def _from(self, record: Mapping[str, Any], key: str) -> Any:
        source = self.source
        if source is None:
            if key not in record:
                raise InvalidInput(
                    f'missing field "{key}": {a_task(self.kind)} record is {_EXAMPLE[self.kind]}; '
                    f"if your records name it otherwise, set the workload's `fields.{key}`"
                )
            return record[key]
        if isinstance(source, str):
            if source not in record:
                raise InvalidInput(f'missing field "{source}" (the {key}, by `fields.{key}`)')
            return record[source]
        try:
            return source.render(record)
        except KeyError as err:
            raise InvalidInput(
                f'missing field "{err.args[0]}" (in `fields.{key}`: {source.source!r})'
            ) from None
