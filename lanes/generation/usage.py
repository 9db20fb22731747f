"""What a completion's usage counts, one rule for both lanes.

A leaf: lanes.tasks.decoder (whose package lanes.generation.seq imports for its
sampling) and lanes.generation.seq both count with it, so it imports neither.
"""

from __future__ import annotations


def completion_tokens(shown: int, stop_token: int | None) -> int:
    """What `usage.completion_tokens` counts, in both lanes: the `shown` tokens and, as
    vLLM counts it (its output token ids hold it), the eos or stop_token_ids token that
    ended the sequence though neither its text nor its tokens show it. A stop string's
    tokens are shown tokens already."""
    return shown + (stop_token is not None)
