"""The Batch API's files: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET .../content.

An upload is parsed as it arrives (Starlette's multipart parser spools the file to a
temporary file past 1 MiB) and copied to the batch store (lanes.batchstore) in chunks:
never held whole in memory. Its size is bounded by `Settings.batch.max_file_bytes`,
counted as the bytes arrive. So is the store's quota (lanes.filequota): the file's
bytes are counted against the room left when the upload began, and it is refused as
soon as they pass it, not spooled whole first. Once parsed, it is stored only if it
still fits, which the quota checks again and holds until the file is listed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncGenerator
from typing import IO

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from lanes.batches import Batches
from lanes.batchstore import BatchStore, check_purpose, new_id
from lanes.errors import InvalidInput, LanesError, RequestTooLarge, shown
from lanes.filequota import over_quota
from lanes.serving.http import ClientGone, JSONResponse, openai_error

# What multipart framing adds around the file (boundaries, headers, the purpose field).
FRAMING_BYTES = 64 * 1024


def _store(request: Request) -> BatchStore:
    batches: Batches = request.app.state.batches
    return batches.store


async def _bounded(request: Request, limit: int) -> AsyncGenerator[bytes, None]:
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge.field("file", f"over the limit of {limit} bytes")
            yield chunk
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after {size} bytes of the upload") from None


class _RoomBounded(MultiPartParser):
    """Starlette's parser, refusing the file part as soon as its bytes and the `used`
    ones pass the `quota`: the quota's refusal, never the per-file 413."""

    def __init__(self, request: Request, limit: int, used: int, quota: int) -> None:
        super().__init__(request.headers, _bounded(request, limit), max_files=1, max_fields=8)
        self.used, self.quota = used, quota
        self.file_bytes = 0

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        super().on_part_data(data, start, end)
        # A wart: Starlette says which part is a file only in its private state (it
        # bounds a field part's size by this very test).
        if self._current_part.file is not None:
            self.file_bytes += end - start
            if self.used + self.file_bytes > self.quota:
                what = (
                    f"the upload's first {self.file_bytes} bytes would already take the store "
                    f"to {self.used + self.file_bytes} bytes"
                )
                raise over_quota("file", what, self.used, self.quota)


async def upload(request: Request) -> Response:
    store = _store(request)
    limit = store.settings.batch.max_file_bytes + FRAMING_BYTES
    try:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            detail = (
                f"{declared} bytes is over the limit of {limit} bytes (LANES_BATCH__MAX_FILE_BYTES)"
            )
            raise RequestTooLarge.field("file", detail)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidInput.field(
                "body", "expected multipart/form-data with `file` and `purpose`"
            )
        used = await asyncio.to_thread(store.quota.used)
        parser = _RoomBounded(request, limit, used, store.quota.quota)
        try:
            form = await parser.parse()
        except MultiPartException as err:
            raise InvalidInput.field("body", f"malformed multipart body: {err.message}") from None
        try:
            purpose, file = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str):
                raise InvalidInput.field("purpose", 'expected a form field `purpose`: "batch"')
            check_purpose(purpose)
            if not isinstance(file, UploadFile):
                raise InvalidInput.field("file", "expected a file part named `file`")
            most = store.settings.batch.max_file_bytes  # the body's bound has room for framing
            if file.size is not None and file.size > most:
                detail = f"{file.size} bytes is over the limit of {most} bytes (LANES_BATCH__MAX_FILE_BYTES)"
                raise RequestTooLarge.field("file", detail)
            made = await asyncio.to_thread(_save, store, file.file, file.filename or "upload.jsonl")
        finally:
            await form.close()
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(made)


def _save(store: BatchStore, source: IO[bytes], filename: str) -> dict[str, object]:
    file_id = new_id("file-")
    size = source.seek(0, os.SEEK_END)  # the parsed upload, spooled whole
    with store.quota.reserved(file_id, size, "file", f"the upload's {size} bytes"):
        source.seek(0)
        with store.writing(file_id) as out:
            shutil.copyfileobj(source, out, 1024 * 1024)
            size = out.tell()
        return store.add_file(file_id, filename, "batch", size).as_json()


async def list_files(request: Request) -> Response:
    store = _store(request)
    try:
        query = request.query_params
        limit = _int(query.get("limit", "10000"), "limit", 1, 10000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidInput.field("order", f'expected "asc" or "desc", found {shown(order)}')
        files = await asyncio.to_thread(store.files)
        if "purpose" in query:
            files = [f for f in files if f.purpose == query["purpose"]]
        if order == "asc":
            files.reverse()
        after = query.get("after")
        if after is not None:
            ids = [f.id for f in files]
            if after not in ids:
                raise InvalidInput.field("after", f"no file with id {shown(after)}")
            files = files[ids.index(after) + 1 :]
        page = files[:limit]
    except LanesError as err:
        return openai_error(err)
    data = [f.as_json() for f in page]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(files) > limit,
        }
    )


def _int(value: str, param: str, low: int, high: int) -> int:
    if not value.isdigit() or not low <= int(value) <= high:
        raise InvalidInput.field(
            param, f"expected an integer from {low} to {high}, found {shown(value)}"
        )
    return int(value)


async def retrieve(request: Request) -> Response:
    try:
        found = await asyncio.to_thread(_store(request).file, request.path_params["file_id"])
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(found.as_json())


async def content(request: Request) -> Response:
    store, file_id = _store(request), request.path_params["file_id"]
    try:
        await asyncio.to_thread(store.file, file_id)
    except LanesError as err:
        return openai_error(err)
    # A sync iterator: Starlette reads it in a thread, a chunk at a time.
    return StreamingResponse(store.chunks(file_id), media_type="application/octet-stream")


async def delete(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    try:
        await asyncio.to_thread(_store(request).delete_file, file_id)
    except LanesError as err:
        return openai_error(err)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


routes = [
    Route("/v1/files", upload, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
    Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", content, methods=["GET"]),
]
