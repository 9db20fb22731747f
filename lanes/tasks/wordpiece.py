"""Token ids for plain ASCII text from a BERT-style WordPiece tokenizer, without `tokenizers`.

`tokenizers` tracks every character's alignment through normalising and splitting,
which lanes never reads: 32 tokens cost 0.12-0.15 ms hot and 0.25-0.3 ms right
after a model run has evicted the caches, a fifth of a lone request's overhead on a
small VM. For the tokenizers BERT-family encoders ship (BertNormalizer,
BertPreTokenizer, WordPiece, specials around the sequence) and text that is
printable ASCII, the same ids come from one regex and dict lookups in 0.02-0.05 ms.

Anything else returns None and goes to `tokenizers` itself: another tokenizer shape,
a character outside printable ASCII (accents, CJK, controls: BertNormalizer's rules
for those are not repeated here), or text that contains one of the tokenizer's added
tokens. tests/test_wordpiece.py holds the ids equal to `tokenizers`' own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# Printable ASCII and the three whitespace controls that BertNormalizer turns into spaces.
_OUTSIDE = re.compile(r"[^\x20-\x7e\t\n\r]")
# BertPreTokenizer on ASCII: runs of letters and digits, and each punctuation mark alone.
_WORDS = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r]")


@dataclass(frozen=True)
class WordPiece:
    """The parts of a BERT-style tokenizer that decide the ids of ASCII text."""

    vocab: dict[str, int]
    unk_id: int
    prefix: str  # of a word's continuing pieces, "##"
    max_word_chars: int  # longer words are one unknown token
    lowercase: bool
    before: list[int]  # special ids around the sequence, [CLS] ... [SEP]
    after: list[int]
    max_tokens: int | None  # of the sequence itself, after truncation
    keep_start: bool  # truncation direction: drop from the end (True) or the start
    added: tuple[str, ...]  # added tokens' texts, lowercased: text with one goes to tokenizers

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> WordPiece | None:
        """This fast path for `tokenizer` as it is now configured; None if it does not apply.

        It reads the padding and truncation settings as they are now: set them first.
        """
        config = json.loads(tokenizer.to_str())
        model = config.get("model") or {}
        normalizer = config.get("normalizer") or {}
        if (
            model.get("type") != "WordPiece"
            or normalizer.get("type") != "BertNormalizer"
            or (config.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
            or tokenizer.padding is not None
        ):
            return None
        specials = _specials(config.get("post_processor"))
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        if specials is None or model.get("unk_token") not in vocab:
            return None
        before, after = specials
        max_tokens, keep_start = None, True
        if tokenizer.truncation is not None:
            max_tokens = tokenizer.truncation["max_length"] - len(before) - len(after)
            keep_start = tokenizer.truncation["direction"] == "right"
            if max_tokens < 1:
                return None
        added = tokenizer.get_added_tokens_decoder().values()
        return cls(
            vocab=vocab,
            unk_id=vocab[model["unk_token"]],
            prefix=model.get("continuing_subword_prefix", "##"),
            max_word_chars=model.get("max_input_chars_per_word", 100),
            lowercase=bool(normalizer.get("lowercase", True)),
            before=before,
            after=after,
            max_tokens=max_tokens,
            keep_start=keep_start,
            added=tuple(token.content.lower() for token in added),
        )

    def encode(self, text: str) -> list[int] | None:
        """`tokenizer.encode(text).ids`, or None when `text` is not for this path."""
        if _OUTSIDE.search(text):
            return None
        lowered = text.lower()
        if any(token in lowered for token in self.added):
            return None
        vocab = self.vocab
        ids: list[int] = []
        for word in _WORDS.findall(lowered if self.lowercase else text):
            found = vocab.get(word) if len(word) <= self.max_word_chars else None
            if found is not None:  # most words are whole vocabulary entries
                ids.append(found)
            else:
                ids += self._pieces(word)
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            ids = ids[: self.max_tokens] if self.keep_start else ids[-self.max_tokens :]
        return self.before + ids + self.after

    def _pieces(self, word: str) -> list[int]:
        """Greedy longest-match-first WordPiece; one unknown id if any part has no match."""
        if len(word) > self.max_word_chars:
            return [self.unk_id]
        pieces = []
        start = 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                found = self.vocab.get(piece)
                if found is not None:
                    pieces.append(found)
                    start = end
                    break
            else:
                return [self.unk_id]
        return pieces


def _specials(processor: Any) -> tuple[list[int], list[int]] | None:
    """The special ids before and after a single sequence; None for another shape."""
    if processor is None:
        return [], []
    kind = processor.get("type")
    if kind == "BertProcessing":
        return [processor["cls"][1]], [processor["sep"][1]]
    if kind != "TemplateProcessing":
        return None
    parts: tuple[list[int], list[int]] = ([], [])
    sequences = 0
    for piece in processor["single"]:
        if "Sequence" in piece:
            sequences += 1
        elif "SpecialToken" in piece:
            name = piece["SpecialToken"]["id"]
            parts[min(sequences, 1)].extend(processor["special_tokens"][name]["ids"])
        else:
            return None
    return parts if sequences == 1 else None
