"""Compressed request bodies: `Content-Encoding: gzip` or `deflate`, as Triton takes them.

tritonclient sends them with `request_compression_algorithm=`; other clients with the
header. The decoded body counts against the body limit, and decoding stops one byte
past it: a small body that would expand without end (a "zip bomb") is a 413 that never
held more than the limit in memory.

A body that is sent and decodes in no more than `offload_body_bytes` is decoded on the
event loop, as a plain body of that size is parsed there; a larger one is decoded on
the offload thread (serving/offload.py; again from the start when it proved large
while decoding: the first try cost at most that many bytes), so that a large body
does not stop the loop. The sent size counts too: thousands of empty gzip members
decode to nothing, one by one.
"""

from __future__ import annotations

import zlib

from lanes.errors import InvalidInput, RequestTooLarge, UnsupportedEncoding, shown
from lanes.serving.offload import Offload

HEADER = "Content-Encoding"
# zlib's window bits for each coding; `deflate` is the zlib format (RFC 9110 8.4.1.2),
# which is what tritonclient sends (zlib.compress).
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPTED = "gzip, deflate or identity"


def coding_of(header: str | None) -> str | None:
    """The content coding a Content-Encoding header names: None for no header or
    `identity`; UnsupportedEncoding (415) for any other coding, or for several."""
    if header is None:
        return None
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in WBITS:
        raise UnsupportedEncoding.field(
            HEADER, f"expected {ACCEPTED} (one coding), found {shown(header.strip())}"
        )
    return codings[0]


def inflate(body: bytes, coding: str, most: int) -> bytes | None:
    """`body` decoded from `coding`; None when it decodes to more than `most` bytes
    (decoding stops there). InvalidInput naming Content-Encoding when `body` is not
    `coding` data, is cut short, or has bytes after its end (gzip may hold several
    members, one after another, as `gzip.decompress` takes them)."""
    parts: list[bytes] = []
    size = 0
    rest = body
    while rest:
        stream = zlib.decompressobj(WBITS[coding])
        try:
            while rest and not stream.eof:
                part = stream.decompress(rest, most + 1 - size)
                size += len(part)
                if size > most:
                    return None
                parts.append(part)
                rest = stream.unconsumed_tail
            part = stream.flush()  # at most a few bytes: every input byte went in
        except zlib.error as e:
            detail = (
                f"the body is not valid {coding} data (zlib: {e}); compress the whole body "
                f"with {coding}, or send it as it is without {HEADER}"
            )
            raise InvalidInput.field(HEADER, detail) from None
        size += len(part)
        if size > most:
            return None
        parts.append(part)
        if not stream.eof:
            detail = f"the {coding} body is cut short: its stream does not end"
            raise InvalidInput.field(HEADER, detail)
        rest = stream.unused_data
        if rest and coding == "deflate":
            detail = f"{len(rest)} bytes follow the end of the deflate stream"
            raise InvalidInput.field(HEADER, detail)
    return b"".join(parts)


async def decode(body: bytes, coding: str, limit: int, offload: Offload) -> bytes:
    """`body` decoded from `coding`, on the loop while small (see the module docstring);
    RequestTooLarge when it decodes to more than `limit` bytes."""
    small = offload.threshold_bytes
    decoded = None
    if len(body) <= small:
        decoded = inflate(body, coding, min(small, limit))
    if decoded is None and (len(body) > small or small < limit):
        # Over `small` bytes, sent or decoded: the size the thread is told.
        decoded = await offload.run(max(len(body), small + 1), inflate, body, coding, limit)
    if decoded is None:
        detail = f"decoded from {coding}, over the limit of {limit} bytes"
        raise RequestTooLarge.field("body", detail)
    return decoded
