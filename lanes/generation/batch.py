"""Offline generation: many prompts through the step loop, as many rows in flight as
allowed, until every one is done.

Nobody waits for a first token, so the only aim is throughput: prompts join in order
of length (one prefill pads alike prompts, and the cache's groups stay few), as many
join per step as there are free rows and as fit `max_prefill_tokens`, and a row that
finishes is refilled at the next step. Every sequence goes through the same
scheduler as online (stop strings, token budgets, the model's context, detokenising,
sampling, `ignore_eos`), so a greedy prompt gets the same tokens here as on the
endpoint, alone or batched.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lanes.errors import ModelError
from lanes.generation.kvbudget import KvBudget
from lanes.generation.kvcache import MAX_PADDING
from lanes.generation.loop import StepLoop
from lanes.generation.prefixes import PREFIX_CACHE_BYTES
from lanes.generation.scheduler import PREFILL_TOKENS, Policy, Scheduler
from lanes.generation.seq import Seq
from lanes.generation.text import ByteText, Detokenize
from lanes.isolation import Failed
from lanes.tasks.decoder import Completion, Decoder

if TYPE_CHECKING:
    from lanes.tasks.generate import GenerateRequest

log = logging.getLogger(__name__)

# Padded prompt tokens one prefill may hold: it returns logits for every position
# ([rows, width, vocab]), so this bounds a prefill's memory, not anyone's wait.
OFFLINE_PREFILL_TOKENS = 16384


def detokenizer(decoder: Decoder) -> Detokenize:
    """Token ids -> text as a completion shows it (special tokens left out)."""
    tokenizer = decoder.tokenizer
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


def scheduler_for(
    decoder: Decoder,
    rows: int,
    *,
    policy: Policy = "continuous",
    max_prefill_tokens: int = PREFILL_TOKENS,
    prefill_alone: bool = False,
    chunked: bool = False,
    clock: Callable[[], float] = time.monotonic,
    byte_text: ByteText | None = None,
    max_kv_bytes: int | None = None,
) -> Scheduler:
    """A scheduler for `decoder`'s eos, context and tokenizer, with `rows` in flight
    and their caches within `max_kv_bytes` (None: no budget; lanes/generation/kvbudget.py).
    `byte_text` (lanes/generation/text.py): text without decode() calls, a stream's
    token by token and a completion's at its finish; building it walks the
    vocabulary, so a task keeps one (`GenerateTask.byte_text`)."""
    config = decoder.config
    return Scheduler(
        rows,
        config.eos_token_ids,
        detokenizer(decoder),
        policy=policy,
        max_position=config.max_position,
        max_prefill_tokens=max_prefill_tokens,
        prefill_alone=prefill_alone,
        chunked=chunked,
        kv=KvBudget(max_kv_bytes, decoder.position_bytes, config.max_position),
        clock=clock,
        byte_text=byte_text,
    )


def seq_of(
    seq_id: int,
    request: GenerateRequest,
    *,
    deadline: float | None = None,
    arrived: float = 0.0,
    offline: bool = False,
    ignore_eos: bool = False,
    stream: bool = True,
) -> Seq:
    """A prepared request's sequence, for either lane (`ignore_eos` or the request's);
    `stream`: its text is read as it is made (see Seq.stream)."""
    return Seq(
        id=seq_id,
        prompt_ids=request.prompt_ids,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        stop=request.stop,
        seed=request.seed,
        deadline=deadline,
        ignore_eos=ignore_eos or request.ignore_eos,
        arrived=arrived,
        offline=offline,
        stream=stream,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        stop_token_ids=request.stop_token_ids,
        min_tokens=request.min_tokens,
        include_stop=request.include_stop,
        logit_bias=request.logit_bias,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
    )


def generate_batch(
    decoder: Decoder,
    requests: Sequence[GenerateRequest],
    rows: int,
    name: str,
    *,
    max_prefill_tokens: int = OFFLINE_PREFILL_TOKENS,
    max_padding: float = MAX_PADDING,
    chunked: bool = False,
    byte_text: ByteText | None = None,
    prefix_bytes: int = PREFIX_CACHE_BYTES,
    max_kv_bytes: int | None = None,
) -> list[Completion | Failed]:
    """One `Completion` per request, in the requests' order; a `Failed` (a `ModelError`
    saying why) for a request the model failed on alone. Never more than `rows`
    sequences in flight. Raises `ModelError` when a step fails outside any one row's
    run (no row is to blame, so the caller may retry the whole batch). With `chunked`,
    prompts over `max_prefill_tokens` are prefilled in parts (see Scheduler).
    `byte_text` and `max_kv_bytes`: see `scheduler_for`; `prefix_bytes` bounds the
    prompts' caches kept for later joiners (lanes/generation/prefixes.py)."""
    scheduler = scheduler_for(
        decoder,
        rows,
        max_prefill_tokens=max_prefill_tokens,
        chunked=chunked,
        byte_text=byte_text,
        max_kv_bytes=max_kv_bytes,
    )
    # Nobody reads a completion's text before it is done: decoded once, at its finish.
    seqs = [seq_of(i, r, stream=False) for i, r in enumerate(requests)]
    # By length, then by tokens: a prompt asked again anywhere in the batch joins with
    # its first asking and shares its prefill's row; a rerun batches the same way.
    pending = deque(sorted(seqs, key=lambda s: (len(s.prompt_ids), s.prompt_ids)))
    loop = StepLoop(decoder, scheduler, name, max_padding, prefix_bytes=prefix_bytes)
    reserved = 0  # the most KV cache the rows' worst cases took at once
    # A sum over the rows each step: only where the debug line below is written.
    watch = log.isEnabledFor(logging.DEBUG)
    # Each step makes a token for, or finishes, every sequence it runs, and every
    # sequence has a budget: the loop ends.
    while True:
        _top_up(scheduler, pending, rows)
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        if watch:
            reserved = max(reserved, scheduler.kv_reserved)  # as admitted, before any leave
        step = loop.run(plan)
        if step.failed:
            why = next((e.error for e in step.events if e.error), "a step failed")
            raise ModelError(why)
    # What a budget would have to hold, or held: for operators sizing max_kv_bytes.
    if watch:
        log.debug(
            "workload %s: %d sequences; their worst cases reserved at most %d bytes of KV "
            "cache at once (budget: %s)",
            name,
            len(seqs),
            reserved,
            max_kv_bytes,
        )
    return [_result(i, seq) for i, seq in enumerate(seqs)]


def _top_up(scheduler: Scheduler, pending: deque[Seq], rows: int) -> None:
    """Queue the next prompts until `rows` wait: no plan admits more than there are
    rows, and each plan walks the whole queue (so a window of prompts queued at once
    would cost every step a pass over all of them). The queue's order is `pending`'s,
    so the plans are the same as with every prompt queued at the start."""
    waiting = scheduler.waiting
    while pending and len(waiting) < rows:
        scheduler.add(pending.popleft())


def _result(index: int, seq: Seq) -> Completion | Failed:
    logprobs = seq.logprobs if seq.top_logprobs is not None else None
    prompt = seq.prompt_scores if seq.prompt_logprobs is not None else None
    reason = seq.status.finish_reason
    if reason == "stop" or reason == "length":
        tokens = list(seq.tokens)
        return Completion(
            seq.text, tokens, reason, len(seq.prompt_ids), logprobs, prompt, seq.stop_token
        )
    why = seq.error or f"the sequence ended as {seq.status.name.lower()}"
    return Failed(index, ModelError(why))
