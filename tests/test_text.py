"""A stream's text token by token: by the tokens' bytes (byte-level tokenizers) and by
the tokenizer's own decode() on a window, against decode() of the whole sequence."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lanes.generation.seq import Seq
from lanes.generation.text import ByteText, WindowText, byte_pieces

TEXT = [
    "def naïve(x):\n    return x  # déjà vu, 日本語のテキスト 🙂🚀\n",
    "Grüße aus Köln — ½ € über 3 µs; Ελληνικά, русский, עברית, हिन्दी\n",
    "for i in range(10):\n    print(f'{i:>4} ✓')\n",
]
SPECIAL = "<|endoftext|>"


def trained() -> Tokenizer:
    """A small byte-level BPE with merges, an added special token and an added plain
    one: characters of two to four bytes split across tokens, every way."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXT * 20, trainer)
    tokenizer.add_tokens(["<plain>", "ñandú"])
    return tokenizer


def streamed(text: ByteText | WindowText, ids: list[int]) -> tuple[str, list[str]]:
    """The text as a stream makes it, and the pieces it handed out token by token."""
    seq = Seq(1, (0,), len(ids) + 1)
    pieces = []
    for token in ids:
        seq.tokens.append(token)
        pieces.append(text.delta(seq))
    pieces.append(text.rest(seq))
    return "".join(pieces), pieces


def test_text_by_bytes_equals_decode_of_the_whole_and_the_window_way() -> None:
    tokenizer = trained()
    pieces = byte_pieces(tokenizer)
    assert pieces is not None and len(pieces) == tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(ids: object) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[call-overload]

    rng = random.Random(7)
    vocab = len(pieces)
    encoded = [tokenizer.encode(t).ids for t in TEXT]
    for trial in range(400):
        if trial % 2:  # any ids at all: bytes that make no character, ids past the vocabulary
            ids = [rng.randrange(vocab + 3) for _ in range(rng.randint(1, 24))]
        else:  # real text, cut anywhere, with the special and the added tokens among it
            whole = rng.choice(encoded)
            start = rng.randrange(len(whole))
            ids = whole[start : start + rng.randint(1, 40)]
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([0, vocab - 1, vocab - 2]))
        by_bytes, handed = streamed(ByteText(pieces), ids)
        by_window, _ = streamed(WindowText(decode), ids)
        assert by_bytes == by_window == decode(i for i in ids if i < vocab), ids
        # Nothing handed out ends inside a character: only the rest at the end may.
        assert not any(p.endswith("\ufffd") for p in handed[:-1])


def test_a_character_split_across_tokens_comes_out_whole_once_its_last_byte_is_in() -> None:
    tokenizer = trained()
    pieces = byte_pieces(tokenizer)
    assert pieces is not None
    byte_ids = {p: i for i, p in enumerate(pieces) if len(p) == 1}
    ids = [byte_ids[bytes([b])] for b in "a🙂".encode()]  # one byte, then four
    _, handed = streamed(ByteText(pieces), ids)
    assert handed == ["a", "", "", "", "🙂", ""]
    _, cut = streamed(ByteText(pieces), ids[:3])  # it ends after two of the four
    assert cut == ["a", "", "", "\ufffd"]  # as decode() shows the bytes left over


@pytest.mark.parametrize(
    "decoder", [decoders.WordPiece(), decoders.Metaspace(), decoders.ByteFallback()]
)
def test_other_decoders_keep_the_window_way(decoder: decoders.Decoder) -> None:
    tokenizer = trained()
    tokenizer.decoder = decoder
    assert byte_pieces(tokenizer) is None
