"""boto3's errors as `StorageError`s that say what to do (lanes.storage's,
lanes.listing's and lanes.s3client's S3 calls): which bucket or object, and whether a
retry could help (`PermanentStorageError` where it could not: access denied)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from lanes.errors import PermanentStorageError, StorageError


@contextmanager
def s3_errors(uri: str, action: str, endpoint: str | None) -> Iterator[None]:
    """Turn boto3's errors in the block into `StorageError`s about `action` on `uri`."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        yield
    except ClientError as err:
        raise _from_client_error(err, uri, action) from None
    except S3UploadFailedError as err:
        # boto3's transfer manager wraps the ClientError that says what went wrong;
        # it is usually in the exception's chain, and its code always in the message.
        cause = _client_error_in(err, ClientError)
        if cause is not None:
            raise _from_client_error(cause, uri, action) from None
        code = _UPLOAD_CODE.search(str(err))
        if code is not None:
            raise _s3_error(code[1], None, str(err), uri, action) from None
        raise StorageError(f"{uri}: cannot {action} on S3: {err}") from None
    except NoCredentialsError:
        raise StorageError(
            f"{uri}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role"
        ) from None
    except BotoCoreError as err:
        where = endpoint or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
        raise StorageError(
            f"{uri}: cannot {action} on S3 ({where}): {err}; check LANES_S3_ENDPOINT "
            "or AWS_ENDPOINT_URL and the network"
        ) from None


class Missing(StorageError):
    """The object (or, from lanes.storage, the local file) does not exist; read_bytes
    turns this into None."""


# botocore's ClientError message, which S3UploadFailedError repeats: "An error
# occurred (NoSuchBucket) when calling the PutObject operation: ...".
_UPLOAD_CODE = re.compile(r"\((\w+)\) when calling the \w+ operation")


def _client_error_in(err: BaseException, kind: type[Exception]) -> Any:
    """The first `kind` in `err`'s chain of causes and contexts, or None."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _from_client_error(err: Any, uri: str, action: str) -> StorageError:
    error = err.response.get("Error", {})
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    message = error.get("Message") or str(err)
    return _s3_error(str(error.get("Code", "")), status, message, uri, action)


# S3's codes for a request it will refuse again, however often it is sent.
DENIED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Unauthorized", "403"}
)


def _s3_error(code: str, status: int | None, message: str, uri: str, action: str) -> StorageError:
    """What S3's error `code` (or HTTP `status`) means for `action` on `uri`."""
    bucket = urlparse(uri).netloc
    if code == "NoSuchBucket" or (code == "404" and action in ("list", "write")):
        return StorageError(
            f"{uri}: bucket {bucket!r} does not exist; create it "
            f"(aws s3 mb s3://{bucket}) or fix the workload's input/output"
        )
    if code in ("NoSuchKey", "404"):
        return Missing(f"{uri}: no such object")
    # By the code: a 403 may also be a skewed clock (RequestTimeTooSkewed), which a retry
    # can outlive; a bare 401/403 (a HEAD has no body to say more) is a denial.
    bare = code in ("", "401", "403") and status in (401, 403)
    if bare or code in DENIED:
        return PermanentStorageError(
            f"{uri}: access denied ({code}) to {action}; check the credentials boto3 found "
            "(AWS_ACCESS_KEY_ID, AWS_PROFILE or the instance role) and the bucket's policy"
        )
    return StorageError(f"{uri}: cannot {action} on S3: {code or status}: {message}")
