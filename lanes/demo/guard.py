"""A demo guard for generate workloads: a blocklist scorer.

    guard: {handler: lanes.demo.guard:blocklist, mode: chunked, every_tokens: 16}

`blocklist(text)` scores 1.0 when the text contains one of `DEFAULT_TERMS`
(ignoring case), else 0.0; `make_blocklist(terms)` builds a scorer with your own
terms. A real guard would be a classifier; the contract is the same: text in, a
risk score in [0, 1] out, at or above the workload's `threshold` fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

DEFAULT_TERMS = ("password", "secret_key", "api_key", "rm -rf /")


def make_blocklist(terms: Iterable[str]) -> Callable[[str], float]:
    """A scorer that gives 1.0 to text containing any of `terms` (ignoring case)."""
    lowered = tuple(term.lower() for term in terms if term)

    def score(text: str) -> float:
        folded = text.lower()
        return 1.0 if any(term in folded for term in lowered) else 0.0

    return score


blocklist = make_blocklist(DEFAULT_TERMS)
