"""The S3 client lanes.storage (and the locks and listings it hands it to) calls, and
an object's streamed body as a file-like stream.

boto3 is imported on first S3 use, here; credentials come from boto3's usual chain
(environment, profile, instance role), the endpoint from `Settings.s3_endpoint`, else
boto3's own `AWS_ENDPOINT_URL`. Apart from lanes.storage because they are about the
connection, not about files: Storage makes one client, on first use, and hands it on.
"""

from __future__ import annotations

import io
from typing import Any

from lanes.errors import PermanentStorageError
from lanes.s3errors import s3_errors


def s3_client(endpoint: str | None) -> Any:
    """A new boto3 S3 client (thread-safe) for `endpoint` (None: boto3's own), with
    retries. An endpoint botocore refuses is a `PermanentStorageError` saying what to set."""
    import boto3
    from botocore.config import Config

    # A client is thread-safe; a Session is not, so one client is made here.
    session = boto3.session.Session()
    try:
        return session.client(
            "s3",
            endpoint_url=endpoint or None,
            config=Config(retries={"max_attempts": 5, "mode": "standard"}),
        )
    except ValueError as err:  # botocore's "Invalid endpoint: 127.0.0.1:9000"
        raise PermanentStorageError(
            f"S3 endpoint: {err}; set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3, "
            "LANES_S3_ENDPOINT) to an http:// or https:// URL"
        ) from None


class S3Body(io.RawIOBase):
    """botocore's streaming body as a raw stream, so io.BufferedReader can wrap it; a
    read that fails is a `StorageError` about `uri` (lanes.s3errors)."""

    def __init__(self, body: Any, uri: str, endpoint: str | None) -> None:
        self._body, self._uri, self._endpoint = body, uri, endpoint

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with s3_errors(self._uri, "read", self._endpoint):
            data: bytes = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
