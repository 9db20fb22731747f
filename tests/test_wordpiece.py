"""The WordPiece fast path gives `tokenizers`' own ids, or steps aside (None)."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from lanes.tasks.wordpiece import WordPiece

# Cases each rule of BertNormalizer + BertPreTokenizer + WordPiece meets on ASCII.
TRICKY = [
    "Hello, World!",
    "don't stop-me now...",
    "snake_case and camelCase and ALLCAPS",
    "e-mail me at someone@example.com (or not)",
    "3.14159 is pi; 42 is the answer",
    "tabs\tand\nnewlines\r\nand  double  spaces",
    "unbelievably unaffordable xylophonists",
    "zzqxj qqqq jjjjjjjjjjjjjjjjjjjjj",  # pieces, and words with no piece at all
    "a" * 99 + " " + "b" * 100 + " " + "c" * 101,  # around max_input_chars_per_word
    "[unused1] [ mask ] [mas k]",  # brackets that are no added token
    "!@#$%^&*()_+-=[]{}|;':\",./<>?`~\\",
    " leading and trailing spaces ",
    "x",
]
# Texts the fast path must leave to `tokenizers`.
NOT_ASCII = ["café au lait", "naïve", "日本語のテキスト", "emoji 🙂", "nbsp\u00a0here"]
CONTROLS = ["a\x00b", "vertical\x0btab", "form\x0cfeed", "bell\x07", "del\x7f"]
ADDED = ["see [MASK] here", "[CLS] twice [SEP]", "lower [cls] too", "[PAD]"]

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "un", "##believ", "##able",
    "##ably", "hello", "Hello", "world", "World", ",", "!", ".", "-", "'", "_",
    "a", "##a", "b", "##b", "t", "##s", "##t", "don", "stop", "me", "now",
]  # fmt: skip


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Printable ASCII with whitespace runs, and texts of vocabulary-like words."""
    rng = random.Random(seed)
    chars = string.ascii_letters + string.digits + string.punctuation + " " * 8 + "\t\n\r"
    words = ["the", "Hello", "unbelievable", "world", "don't", "a" * 12, "bb", "x-y"]
    texts = []
    for i in range(count):
        if i % 2:
            texts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 120))))
        else:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))))
    return texts


def small_tokenizer(
    lowercase: bool = True,
    processor: processors.PostProcessor | None = None,
    max_word_chars: int = 100,
) -> Tokenizer:
    tokenizer = Tokenizer(
        models.WordPiece(
            {w: i for i, w in enumerate(VOCAB)},
            unk_token="[UNK]",
            max_input_chars_per_word=max_word_chars,
        )
    )
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processor
    tokenizer.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return tokenizer


def assert_same_ids(tokenizer: Tokenizer, texts: list[str]) -> None:
    fast = WordPiece.of(tokenizer)
    assert fast is not None
    for text in texts:
        assert fast.encode(text) == tokenizer.encode(text).ids, repr(text)


@pytest.fixture(scope="module")
def minilm(demo_models: Path) -> Tokenizer:
    """The demo encoder's tokenizer, set up as the embed task sets it up."""
    tokenizer = Tokenizer.from_file(str(demo_models / "minilm" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=256)
    return tokenizer


def test_minilm_ids_are_tokenizers_ids(minilm: Tokenizer) -> None:
    assert_same_ids(minilm, TRICKY + random_texts(2000))


def test_truncation_keeps_the_specials(minilm: Tokenizer) -> None:
    long = " ".join(["unbelievable"] * 300)  # 600 tokens
    assert_same_ids(minilm, [long])
    minilm.enable_truncation(max_length=16, direction="left")
    try:
        assert_same_ids(minilm, [long, "one two three", *random_texts(200, seed=1)])
    finally:
        minilm.enable_truncation(max_length=256)


@pytest.mark.parametrize("text", NOT_ASCII + CONTROLS + ADDED)
def test_other_text_is_left_to_tokenizers(minilm: Tokenizer, text: str) -> None:
    fast = WordPiece.of(minilm)
    assert fast is not None
    assert fast.encode(text) is None


@pytest.mark.parametrize(
    "tokenizer",
    [
        small_tokenizer(lowercase=False),
        small_tokenizer(processor=processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))),
        small_tokenizer(
            processor=processors.TemplateProcessing(
                single="[CLS] [MASK] $A [SEP]",
                special_tokens=[("[CLS]", 2), ("[SEP]", 3), ("[MASK]", 4)],
            )
        ),
        small_tokenizer(processor=None, max_word_chars=4),  # "hello" is in vocab, but too long
    ],
    ids=["cased", "bert-processing", "template", "no-specials"],
)
def test_each_tokenizer_setting_gives_tokenizers_ids(tokenizer: Tokenizer) -> None:
    assert_same_ids(tokenizer, TRICKY + random_texts(500, seed=2))


def test_other_tokenizers_get_no_fast_path(demo_models: Path) -> None:
    bpe = Tokenizer.from_file(str(demo_models / "tinycode" / "tokenizer.json"))
    assert WordPiece.of(bpe) is None
    padded = small_tokenizer()
    padded.enable_padding(length=8)
    assert WordPiece.of(padded) is None
    other = small_tokenizer()
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    assert WordPiece.of(other) is None
