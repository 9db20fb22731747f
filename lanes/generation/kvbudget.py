"""A generate workload's KV-cache budget (`batching.max_kv_bytes`; an offline
workload's `max_kv_bytes`).

Without one, a workload's cache is bounded only by its rows times the model's
context: a burst of long prompts with large `max_tokens` can take the process out of
memory. With one, the scheduler (lanes/generation/scheduler.py) admits a sequence
only while every running sequence's worst case (its prompt and `max_tokens`, at most
the context) fits the budget together. Conservative: a running sequence never needs
more than it was admitted with, so nothing is preempted for memory. A request whose
own worst case is over the whole budget is refused as it is prepared (`check`), as
one over the context is, instead of waiting for ever. A leaf: lanes.tasks checks
requests with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanes.errors import InvalidInput


@dataclass(frozen=True)
class KvBudget:
    """`max_bytes` (None: no budget, the worst cases only counted) over sequences
    whose every cached position takes `position_bytes` (every layer's key and value)."""

    max_bytes: int | None
    position_bytes: int
    max_position: int | None = None  # the context: no sequence caches more
    key: str = "batching.max_kv_bytes"  # the workload's key that set it, for refusals

    def worst(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The most bytes a sequence's cache takes: its prompt and every token it may make."""
        positions = prompt_tokens + max_new_tokens
        if self.max_position is not None:
            positions = min(positions, self.max_position)
        return positions * self.position_bytes

    def check(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """`InvalidInput` about `max_tokens` when a request's worst case alone is over
        the budget: it could never be admitted."""
        worst = self.worst(prompt_tokens, max_new_tokens)
        if self.max_bytes is None or worst <= self.max_bytes:
            return
        raise InvalidInput.field(
            "max_tokens",
            f"expected a completion whose KV cache fits the workload's {self.key} "
            f"({self.max_bytes} bytes); {prompt_tokens} prompt tokens and max_tokens "
            f"{max_new_tokens} may take {worst} bytes ({self.position_bytes} per token). "
            "Please reduce max_tokens or the prompt.",
            "invalid_value",
        )
