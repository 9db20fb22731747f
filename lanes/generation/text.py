"""A sequence's text, made a token at a time as a stream shows it.

Two ways to the same text. `WindowText` asks the tokenizer to decode a short window
of the last tokens (vLLM's offsets): right for any tokenizer, two decode() calls per
token. `ByteText` serves tokenizers whose decode() is the UTF-8 of their tokens'
bytes joined (a plain byte-level decoder: GPT-2's, Qwen2's, the demo's): a token's
text is a table lookup, no call into the tokenizer. Either holds text back while the
bytes so far end inside a multi-byte character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer, decoders

from lanes.generation.seq import Seq

Detokenize = Callable[[Sequence[int]], str]
_REPLACEMENT = "\ufffd"  # what a decode makes of bytes that are no character (yet)


class WindowText:
    """Text by the tokenizer's own decode() of the last tokens."""

    def __init__(self, detokenize: Detokenize) -> None:
        self.detokenize = detokenize

    def delta(self, seq: Seq) -> str:
        """New text of the tokens since the last text: decode(tokens[prefix:]) past
        decode(tokens[prefix:read]), the window that came before them."""
        prefix = self.detokenize(seq.tokens[seq._prefix : seq._read])
        full = self.detokenize(seq.tokens[seq._prefix :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            seq._prefix, seq._read = seq._read, len(seq.tokens)
            return full[len(prefix) :]
        return ""

    def rest(self, seq: Seq) -> str:
        """At the end, the text of tokens held back mid-character, as decode() gives it."""
        if seq._read == len(seq.tokens):
            return ""
        window = seq.tokens[seq._prefix : seq._read]
        prefix = self.detokenize(window) if window else ""
        text = self.detokenize(seq.tokens[seq._prefix :])[len(prefix) :]
        seq._prefix = seq._read = len(seq.tokens)
        return text


class ByteText:
    """Text by the tokens' bytes (`byte_pieces`): the bytes since the last text,
    decoded as decode() would (undecodable bytes are U+FFFD)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces
        # Each token's own text where its bytes are whole characters: what delta() gives
        # for a token that follows text already out (most tokens), without a decode.
        self._whole = [_whole(piece) for piece in pieces]

    def _text(self, tokens: Sequence[int]) -> str:
        pieces, known = self.pieces, len(self.pieces)
        # An id past the tokenizer's vocabulary (a model's padded one) decodes to nothing.
        joined = b"".join(pieces[t] if t < known else b"" for t in tokens)
        return joined.decode("utf-8", "replace")

    def delta(self, seq: Seq) -> str:
        tokens, read = seq.tokens, seq._read
        if read == len(tokens) - 1 and tokens[-1] < len(self._whole):
            whole = self._whole[tokens[-1]]
            if whole is not None:
                seq._read = len(tokens)
                return whole
        text = self._text(tokens[read:])
        if text and not text.endswith(_REPLACEMENT):
            seq._read = len(seq.tokens)
            return text
        return ""

    def rest(self, seq: Seq) -> str:
        text = self._text(seq.tokens[seq._read :])
        seq._read = len(seq.tokens)
        return text


class Spelling:
    """How logprobs name a token: its own text (decode() of that one id, special
    tokens left out, as a completion's text) and its bytes: its byte-level piece where
    the tokenizer has them (part of a character, maybe), else that text's UTF-8."""

    def __init__(self, detokenize: Detokenize, pieces: Sequence[bytes] | None = None) -> None:
        self.detokenize = detokenize
        self.pieces = pieces
        self._texts: dict[int, str] = {}  # a token's text, decoded once

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.detokenize((token,))
        return text

    def bytes(self, token: int) -> bytes:
        if self.pieces is not None and token < len(self.pieces):
            return self.pieces[token]
        return self.text(token).encode()


def _whole(piece: bytes) -> str | None:
    """`piece` decoded, where it is whole characters (and not nothing); else None."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text and not text.endswith(_REPLACEMENT) else None


def byte_pieces(tokenizer: Tokenizer) -> list[bytes] | None:
    """Each token id's bytes, as decode(skip_special_tokens=True) joins them, where the
    tokenizer's decoder is a plain byte-level one; None for any other decoder."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    byte_of = _byte_of_char()
    pieces = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            pieces.append(b"")
        elif all(c in byte_of for c in token):
            pieces.append(bytes(byte_of[c] for c in token))
        else:  # an added token's own text, which the decoder passes through
            pieces.append(token.encode())
    return pieces


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the byte each character stands for.
    Printable bytes stand for themselves; the rest for the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update((b, chr(0x100 + n)) for n, b in enumerate(others))
    return {c: b for b, c in chars.items()}
