"""Compressed request bodies (serving/encoding.py): decoding bounded by the limit, and
the error each malformed body gets."""

from __future__ import annotations

import gzip
import zlib

import pytest

from lanes.errors import InvalidInput, RequestTooLarge, UnsupportedEncoding
from lanes.serving.encoding import coding_of, decode, inflate
from lanes.serving.offload import Offload

BODY = b'{"inputs": []}' * 100


def gz(data: bytes) -> bytes:
    """gzip without the time in its header: the same bytes in every process (pytest-xdist
    workers must collect the same test ids)."""
    return gzip.compress(data, mtime=0)


@pytest.mark.parametrize(
    ("header", "coding"),
    [
        (None, None),
        ("identity", None),
        ("GZIP", "gzip"),
        (" deflate ", "deflate"),
        ("x-gzip", "x-gzip"),
        ("gzip, identity", "gzip"),
    ],
)
def test_the_header_names_one_coding(header: str | None, coding: str | None) -> None:
    assert coding_of(header) == coding


@pytest.mark.parametrize("header", ["br", "zstd", "compress", "gzip, deflate"])
def test_any_other_coding_is_a_415_naming_those_accepted(header: str) -> None:
    with pytest.raises(UnsupportedEncoding) as caught:
        coding_of(header)
    assert caught.value.status == 415 and caught.value.param == "Content-Encoding"
    assert "gzip, deflate or identity" in str(caught.value) and repr(header) in str(caught.value)


@pytest.mark.parametrize(
    ("coding", "compressed"),
    [
        ("gzip", gz(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("gzip", gz(BODY[:500]) + gz(BODY[500:])),  # two members
        ("gzip", b""),  # nothing to decode
    ],
    ids=["gzip", "deflate", "two-gzip-members", "empty"],
)
def test_a_body_decodes_whole(coding: str, compressed: bytes) -> None:
    expected = BODY if compressed else b""
    assert inflate(compressed, coding, len(expected)) == expected
    if expected:
        assert inflate(compressed, coding, len(expected) - 1) is None  # one byte over


def test_a_bomb_stops_one_byte_past_the_limit() -> None:
    bomb = gzip.compress(bytes(64 * 1024 * 1024), 9)  # 64 MiB of zeros in ~64 kB
    assert len(bomb) < 128 * 1024
    assert inflate(bomb, "gzip", 1024) is None


@pytest.mark.parametrize(
    ("coding", "compressed", "message"),
    [
        ("gzip", b"not gzip at all", "not valid gzip data"),
        ("deflate", gz(BODY), "not valid deflate data"),
        ("gzip", gz(BODY)[:-12], "cut short"),
        ("deflate", zlib.compress(BODY) + b"tail", "4 bytes follow the end"),
        ("gzip", gz(BODY) + b"tail", "not valid gzip data"),
    ],
    ids=["not-gzip", "gzip-as-deflate", "gzip-cut-short", "deflate-tail", "gzip-tail"],
)
def test_a_malformed_body_is_a_400_naming_content_encoding(
    coding: str, compressed: bytes, message: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        inflate(compressed, coding, 1024 * 1024)
    assert caught.value.status == 400 and caught.value.param == "Content-Encoding"
    assert message in str(caught.value), caught.value


async def test_a_large_body_decodes_on_the_thread_and_the_limit_holds() -> None:
    offload = Offload(threshold_bytes=100)
    try:
        assert await decode(gzip.compress(BODY), "gzip", len(BODY), offload) == BODY
        assert offload._pool is not None  # over the threshold: on the thread
        with pytest.raises(RequestTooLarge) as caught:
            await decode(gzip.compress(BODY), "gzip", len(BODY) - 1, offload)
        assert "decoded from gzip, over the limit" in str(caught.value)
    finally:
        offload.close()


async def test_a_large_body_that_decodes_to_little_decodes_on_the_thread() -> None:
    offload = Offload(threshold_bytes=100)
    try:
        assert await decode(gzip.compress(b"") * 20, "gzip", 1000, offload) == b""
        assert offload._pool is not None
    finally:
        offload.close()


async def test_a_small_body_decodes_on_the_loop() -> None:
    offload = Offload(threshold_bytes=len(BODY))
    assert await decode(zlib.compress(BODY), "deflate", 10 * len(BODY), offload) == BODY
    assert offload._pool is None
    with pytest.raises(RequestTooLarge):  # the limit below the threshold: all on the loop
        await decode(zlib.compress(BODY), "deflate", len(BODY) - 1, offload)
    assert offload._pool is None
