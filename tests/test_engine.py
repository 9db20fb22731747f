"""The step loop's two users on the demo tinycode decoder, without HTTP: the online
engine (every batching policy) and the offline batch give each request exactly the
tokens it gets alone (`Decoder.complete`, the plain single-sequence loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lanes.errors import DeadlineExceeded, ModelError
from lanes.generation.batch import generate_batch, scheduler_for
from lanes.generation.loop import StepLoop
from lanes.generation.prefill import Join, prefill
from lanes.generation.prefill_tokens import PrefillTokens
from lanes.generation.prefixes import SHARED_PREFIX_MIN, PrefixCache, common_prefix
from lanes.generation.scheduler import POLICIES, Policy
from lanes.generation.seq import Event, Seq
from lanes.isolation import Failed
from lanes.runtime import Runtime
from lanes.serving.engine import Engine
from lanes.serving.guard import TextGuard, pieces
from lanes.serving.metrics import Metrics
from lanes.serving.token_stream import TokenStream
from lanes.settings import Settings
from lanes.spec import Guard, Spec
from lanes.tasks import GenerateTask, load_task
from lanes.tasks.decoder import Completion, Decoder
from tests.gates import WAIT_S, Gate, GatedRuntime, eventually

pytestmark = pytest.mark.slow

# Prompts of very different lengths, so joiners both fill holes in place and
# force the cache to grow; budgets differ so rows leave at different steps.
PROMPTS = [
    ("def f(x", 9),
    ("class Foo:\n    def __init__(self, name", 3),
    ("import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv[1:]:\n        if", 12),
    ("x", 5),
    ("    return self._", 7),
    ("# Copyright 2001 Python Software Foundation\n" * 6 + "from", 6),
    ("for i in range(", 11),
    ('"""Utilities for ', 4),
]


# tinycode's weights in the Optimum signature (rows grouped by length, one run per
# group) and with its cache kept in slots (lanes/demo/slots.py: one run per step).
LAYOUTS = [pytest.param("model.onnx", id="concat"), pytest.param("model-slots.onnx", id="slots")]

# Always open: it counts the decoder's runs (one per prefill, one per row group a step).
RUNS = Gate()


@pytest.fixture(scope="module", params=LAYOUTS)
def task(demo_models: Path, request: pytest.FixtureRequest) -> GenerateTask:
    return gated_task(demo_models, request.param, rows=3)


def gated_task(
    demo_models: Path, layout: str, rows: int, max_kv_bytes: int | None = None
) -> GenerateTask:
    """Greedy tinycode in `layout`, at most `rows` rows (their caches within
    `max_kv_bytes`), its runs through RUNS."""
    folder = demo_models / "tinycode"
    spec = Spec.model_validate(
        {
            "models": {
                "tinycode": {
                    "path": folder / layout,
                    "tokenizer": folder / "tokenizer.json",
                }
            },
            "workloads": {
                "code": {
                    "mode": "interactive",
                    "task": "generate",
                    "model": "tinycode",
                    "batching": {"max_batch_size": rows, "max_kv_bytes": max_kv_bytes},
                    "generation": {"temperature": 0},
                }
            },
        }
    )
    runtime = GatedRuntime(Settings(device="cpu"), {spec.models["tinycode"].path: RUNS})
    loaded = load_task("code", spec, runtime)
    assert isinstance(loaded, GenerateTask)
    return loaded


async def collect(stream: TokenStream) -> tuple[list[int], str, str | None]:
    tokens: list[int] = []
    text: list[str] = []
    finish = None
    async with asyncio.timeout(60):
        async for event in stream:
            tokens += event.tokens
            text.append(event.text)
            finish = event.finish
    return tokens, "".join(text), finish


def alone(task: GenerateTask, item: dict[str, object]) -> Completion:
    """The item completed by the decoder's own single-sequence loop, no scheduler."""
    r = task.prepare(item)
    return task.decoder.complete(r.prompt_ids, r.max_new_tokens, r.sampling, r.stop, r.seed)


Got = list[tuple[list[int], str, str | None]]
# Who drives the step loop: the online engine under each policy, or the offline batch.
# `beside`: the online engine with arrivals prefilled beside a decode, each request
# sent once the one before has its first token (so most arrive while rows decode).
USERS = [*(("online", p) for p in POLICIES), ("offline", "continuous"), ("beside", "continuous")]


async def run_all(
    task: GenerateTask,
    policy: Policy,
    items: list[dict[str, object]],
    max_padding: float = 64,
    metrics: Metrics | None = None,
    user: str = "online",
) -> Got:
    """Every item's tokens, text and finish."""
    if user == "offline":
        return run_offline(task, items, max_padding)
    beside = user == "beside"
    engine = Engine(task, metrics or Metrics(), policy, max_padding, prefill_beside=beside)
    engine.start()
    try:
        streams = []
        for item in items:
            stream = engine.submit(task.prepare(item))
            streams.append(stream)
            if beside:  # its first event (not consumed: collect reads it below)
                async with asyncio.timeout(WAIT_S):
                    await stream._signal.wait()
        return list(await asyncio.gather(*(collect(s) for s in streams)))
    finally:
        await engine.stop()


def run_offline(task: GenerateTask, items: list[dict[str, object]], max_padding: float) -> Got:
    """The offline lane's loop, 3 rows in flight as the engine's."""
    requests = [task.prepare(item) for item in items]
    done = generate_batch(task.decoder, requests, 3, "code", max_padding=max_padding)
    assert not any(isinstance(d, Failed) for d in done)
    return [(d.tokens, d.text, d.finish_reason) for d in done if isinstance(d, Completion)]


@pytest.mark.parametrize(("user", "policy"), USERS)
async def test_every_policy_gives_each_request_its_tokens_alone(
    task: GenerateTask, user: str, policy: Policy
) -> None:
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": n} for p, n in PROMPTS]
    want_all = [alone(task, item) for item in items]
    got = await run_all(task, policy, items, user=user)
    for want, (tokens, text, finish) in zip(want_all, got, strict=True):
        assert tokens == want.tokens
        assert text == want.text
        assert finish == want.finish_reason
    assert len({tuple(c.tokens) for c in want_all}) > 1, "the prompts should not all agree"


@pytest.mark.parametrize("max_padding", [0, 24])
async def test_rows_in_groups_of_similar_length_give_the_same_tokens(
    task: GenerateTask, max_padding: float
) -> None:
    """Small padding budgets split the batch into several groups (one decoder run
    each), merged again as lengths come close; nothing changes for any request. A
    slot-layout decoder pads nothing: every step is one run, whatever the lengths."""
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": n + 8} for p, n in PROMPTS]
    want = [alone(task, item).tokens for item in items]
    assert [tokens for tokens, _, _ in run_offline(task, items, max_padding)] == want
    metrics, runs = Metrics(), RUNS.passed
    got = await run_all(task, "continuous", items, max_padding, metrics)
    assert [tokens for tokens, _, _ in got] == want
    runs = RUNS.passed - runs
    prefills = metrics.registry.get_sample_value(
        "lanes_prefill_seconds_count", {"workload": "code"}
    )
    steps = metrics.registry.get_sample_value(
        "lanes_decode_step_seconds_count", {"workload": "code"}
    )
    assert prefills is not None and steps is not None
    if task.decoder.slots:
        assert runs == prefills + steps, "one run per prefill and per step"
    else:
        assert runs > prefills + steps, "the rows should have been split into groups"


def test_long_prompts_prefilled_in_parts_give_the_tokens_alone(task: GenerateTask) -> None:
    """Prompts over the prefill budget go in parts, each on the cache of the parts before
    it (on the slot graph too, through Decoder.step on a past); nothing changes."""
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": n} for p, n in PROMPTS]
    requests = [task.prepare(item) for item in items]
    assert max(len(r.prompt_ids) for r in requests) > 3 * 8, "a prompt in several parts"
    done = generate_batch(task.decoder, requests, 3, "code", max_prefill_tokens=8, chunked=True)
    assert [d.tokens for d in done if isinstance(d, Completion)] == [
        alone(task, item).tokens for item in items
    ]


def test_offline_joiners_fill_every_free_row_at_once(task: GenerateTask) -> None:
    """generate_batch queues its prompts a few at a time (the scheduler walks its
    queue at every plan): still, every plan admits as many as there are free rows.
    Seven equal budgets on 3 rows finish together: 3 prefills (3, 3, 1 joiners) and
    3 decode steps after each, one decoder run each, and the tokens made alone."""
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": 4} for p, _ in PROMPTS[:7]]
    requests = [dataclasses.replace(task.prepare(item), ignore_eos=True) for item in items]
    want = [alone(task, item).tokens for item in items]
    runs = RUNS.passed
    done = generate_batch(task.decoder, requests, 3, "code", max_padding=10**6)
    assert RUNS.passed - runs == 3 * (1 + 3)
    assert [d.tokens for d in done if isinstance(d, Completion)] == want


def test_joiners_of_one_prompt_share_one_row_of_their_prefill(task: GenerateTask) -> None:
    """A prompt asked for twice (a request's n choices) takes one row of the prefill's
    run, and each of its joiners gets the logits and cache the prompt gets alone."""
    decoder = task.decoder
    prompts = [PROMPTS[0][0], PROMPTS[2][0], PROMPTS[0][0]]
    seqs = [Seq(i, tuple(decoder.encode(p)), 4) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool, RUNS.closed():
        ran = pool.submit(prefill, decoder, seqs)
        RUNS.wait_held()
        assert RUNS.held_rows() == 2
        RUNS.allow(1)
        logits, (join,) = ran.result(timeout=WAIT_S)
    assert (join.ids, join.rows_run, len(logits), join.past.batch) == ([0, 1, 2], 2, 3, 3)
    by_itself, (its_join,) = prefill(decoder, seqs[:1])
    n = len(seqs[0].prompt_ids)
    for row in (0, 2):
        np.testing.assert_allclose(logits[row], by_itself[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(join.mask[row, -n:], its_join.mask[0])
        for ours, its in zip(join.past.arrays, its_join.past.arrays, strict=True):
            np.testing.assert_allclose(ours[row, :, -n:], its[0], rtol=1e-4, atol=1e-4)


INSTRUCTIONS = (
    "# Copyright 2001 Python Software Foundation\n" * 2,
    "# Licensed under the Apache License, Version 2.0 (the License)\n" * 2,
)


def assert_as_alone(
    decoder: Decoder, seqs: list[Seq], logits: np.ndarray[Any, Any], joins: list[Join]
) -> None:
    """Each joiner's logits and cache are what its prompt gets in a run alone."""
    rows = {sid: (join, r) for join in joins for r, sid in enumerate(join.ids)}
    for j, seq in enumerate(seqs):
        by_itself, (its_join,) = prefill(decoder, [seq])
        join, row = rows[seq.id]
        n = len(seq.prompt_ids)
        np.testing.assert_allclose(logits[j], by_itself[0], rtol=1e-4, atol=1e-4)
        assert join.mask[row].sum() == n and (join.mask[row, -n:] == 1).all()
        for ours, its in zip(join.past.arrays, its_join.past.arrays, strict=True):
            np.testing.assert_allclose(ours[row, :, -n:], its[0], rtol=1e-4, atol=1e-4)


def gated_prefill(
    decoder: Decoder, seqs: list[Seq], prefixes: PrefixCache | None, runs: int
) -> tuple[list[int], np.ndarray[Any, Any], list[Join]]:
    """`prefill` of `seqs`, its `runs` model runs let through RUNS one at a time: the
    rows of each run, and what the prefill returned."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool, RUNS.closed():
        ran = pool.submit(prefill, decoder, seqs, False, prefixes)
        rows = []
        for _ in range(runs):
            RUNS.wait_held()
            rows.append(RUNS.held_rows())
            RUNS.allow(1)
        logits, joins = ran.result(timeout=WAIT_S)
    return rows, logits, joins


def test_joiners_sharing_a_long_prefix_run_it_once(task: GenerateTask) -> None:
    """Prompts that start with one long instruction: it runs once, in one row, then
    each prompt's rest on its cache; every joiner gets the logits and cache its
    prompt gets alone. A slot-layout graph runs prompts on a past row by row, so
    there they run whole, in one run."""
    decoder = task.decoder
    prompts = [INSTRUCTIONS[0] + end for end in ("x", "def f(x", "import os\nimport sys\n")]
    seqs = [Seq(i, tuple(decoder.encode(p)), 4) for i, p in enumerate(prompts)]
    assert len({s.prompt_ids[:SHARED_PREFIX_MIN] for s in seqs}) == 1, "a prefix to share"
    rows, logits, joins = gated_prefill(decoder, seqs, None, 1 if decoder.slots else 2)
    assert rows == ([3] if decoder.slots else [1, 3])
    assert_as_alone(decoder, seqs, logits, joins)
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": 6} for p in prompts]
    done = generate_batch(decoder, [task.prepare(item) for item in items], 3, "code")
    assert [d.tokens for d in done if isinstance(d, Completion)] == [
        alone(task, item).tokens for item in items
    ]


def test_a_later_joiner_runs_only_its_rest_on_the_prompt_kept(task: GenerateTask) -> None:
    """The last prompt's cache stays (PrefixCache): a joiner of a later step that
    starts with a long part of it (requests one at a time, each with the same system
    prompt) runs the rest of its prompt alone, on that part, and gets what its prompt
    gets alone. Not on a slot-layout graph, where nothing is shared."""
    decoder = task.decoder
    first = Seq(0, tuple(decoder.encode(INSTRUCTIONS[0] + "x")), 4)
    later = Seq(9, tuple(decoder.encode(INSTRUCTIONS[0] + "for i in range(")), 4)
    common = common_prefix(first.prompt_ids, later.prompt_ids)
    assert common >= SHARED_PREFIX_MIN
    prefixes = PrefixCache()
    prefill(decoder, [first], prefixes=prefixes)
    assert len(prefixes) == 0, "an opening seen once: kept when it comes again"
    prefill(decoder, [first], prefixes=prefixes)
    assert len(prefixes) == (0 if decoder.slots else 1)
    rows, logits, (join,) = gated_prefill(decoder, [later], prefixes, 1)
    assert rows == [1]
    n = len(later.prompt_ids)
    assert join.tokens_run == (n if decoder.slots else n - common)
    assert_as_alone(decoder, [later], logits, [join])


def test_joiners_of_two_openings_each_share_their_own_in_runs_apart(task: GenerateTask) -> None:
    """Prompts of two instructions, interleaved in one prefill (an offline job of two
    templates; rows go by length): each instruction runs once, then its prompts'
    rests, apart from the other's, and each joiner gets what its prompt gets alone."""
    decoder = task.decoder
    ends = ("x", "def f(x", "import os\n", "y = 1\n")
    prompts = [INSTRUCTIONS[i % 2] + end for i, end in enumerate(ends)]
    seqs = [Seq(i, tuple(decoder.encode(p)), 4) for i, p in enumerate(prompts)]
    rows, logits, joins = gated_prefill(decoder, seqs, PrefixCache(), 1 if decoder.slots else 4)
    assert rows == ([4] if decoder.slots else [1, 2, 1, 2])
    assert sorted(sid for join in joins for sid in join.ids) == [0, 1, 2, 3]
    assert_as_alone(decoder, seqs, logits, joins)


def test_prompts_of_other_openings_keep_their_own_caches(task: GenerateTask) -> None:
    """Requests of two system prompts taking turns: each opening's last prompt stays,
    so a later joiner of the first runs only its rest though one of the second came
    between (the cache kept one prompt in all before)."""
    decoder = task.decoder
    first, other, later = (
        Seq(i, tuple(decoder.encode(INSTRUCTIONS[k] + end)), 4)
        for i, (k, end) in enumerate([(0, "x"), (1, "y"), (0, "for i in range(")])
    )
    prefixes = PrefixCache()
    for seq in (first, other, first, other):  # each opening's second comer is kept
        prefill(decoder, [seq], prefixes=prefixes)
    assert len(prefixes) == (0 if decoder.slots else 2)
    rows, logits, joins = gated_prefill(decoder, [later], prefixes, 1)
    assert rows == [1]
    n, common = len(later.prompt_ids), common_prefix(first.prompt_ids, later.prompt_ids)
    assert joins[0].tokens_run == (n if decoder.slots else n - common)
    assert_as_alone(decoder, [later], logits, joins)


def test_conversations_of_one_system_prompt_each_run_on_their_own_last_turn(
    task: GenerateTask,
) -> None:
    """Two users with one system prompt take turns: a next turn runs only what
    follows its own last turn, though the other user's came between (it shared only
    the system prompt before), and gets what its prompt gets alone."""
    decoder = task.decoder
    mine, theirs, next_turn = (
        Seq(i, tuple(decoder.encode(INSTRUCTIONS[0] + text)), 4)
        for i, text in enumerate(
            ["def area(r):\n    return", "import sys\n", "def area(r):\n    return r * r\n"]
        )
    )
    prefixes = PrefixCache()
    for seq in (theirs, mine, theirs):  # the opening's second comer on is kept
        prefill(decoder, [seq], prefixes=prefixes)
    assert len(prefixes) == (0 if decoder.slots else 2)
    rows, logits, joins = gated_prefill(decoder, [next_turn], prefixes, 1)
    assert rows == [1]
    n, common = len(next_turn.prompt_ids), common_prefix(mine.prompt_ids, next_turn.prompt_ids)
    assert common > common_prefix(theirs.prompt_ids, next_turn.prompt_ids)
    assert joins[0].tokens_run == (n if decoder.slots else n - common)
    assert_as_alone(decoder, [next_turn], logits, joins)


def charge(seqs: list[Seq], prefixes: PrefixCache | None) -> int:
    """What the scheduler's budget charges the prefill of `seqs`."""
    charged = PrefillTokens(prefixes)
    for seq in seqs:
        charged = charged.plus(seq)
    return charged.tokens


def test_the_prefill_budget_charges_what_the_prefill_runs(task: GenerateTask) -> None:
    """The scheduler's charge for a step's joiners, known before their prefill, is the
    padded tokens the prefill runs: a prefix they share once, a kept prompt's common
    part not at all, the rest whole, equal prompts one row (as the step loop hands the
    scheduler its prefix cache: not on a slot-layout graph, where nothing is shared)."""
    decoder = task.decoder
    prefixes = PrefixCache()
    shared = None if decoder.slots else prefixes

    def seqs(*prompts: str) -> list[Seq]:
        return [Seq(i, tuple(decoder.encode(p)), 4) for i, p in enumerate(prompts)]

    kept = seqs(INSTRUCTIONS[0] + "x")
    for _ in range(2):  # its opening's second comer is kept
        prefill(decoder, kept, prefixes=prefixes)
    assert len(prefixes) == (0 if decoder.slots else 1)
    for joiners in (
        seqs(*(INSTRUCTIONS[1] + end for end in ("x", "def f(x", "import os\n"))),
        seqs(*(INSTRUCTIONS[i % 2] + end for i, end in enumerate(("a", "b = 1", "c", "d")))),
        seqs(INSTRUCTIONS[0] + "for i in range(", INSTRUCTIONS[0] + "y", "x", "def f(x"),
        seqs(INSTRUCTIONS[0] + "z", INSTRUCTIONS[1] + "lone", "x", "x", PROMPTS[2][0]),
        seqs("def f(x", "x", "def f(x"),
        # Turns of conversations: each shares most with a kept prompt of the opening
        # that is not its most recent one.
        seqs(INSTRUCTIONS[0] + "for i in range(10):\n", INSTRUCTIONS[0] + "for i in range(3"),
        seqs(INSTRUCTIONS[1] + "x = 2", INSTRUCTIONS[0] + "for i in range(10):\n    pass"),
    ):
        charged = charge(joiners, shared)
        _, joins = prefill(decoder, joiners, prefixes=shared)
        assert charged == sum(join.tokens_run for join in joins), [
            len(s.prompt_ids) for s in joiners
        ]
    if decoder.slots:
        return
    # A cache with room for one prompt: the pair of another opening, run first, keeps
    # one of theirs in the kept prompt's place; the joiner of the kept one still runs
    # on it, as charged (every part's kept head is taken before any part keeps).
    small = PrefixCache()
    long = seqs(INSTRUCTIONS[0] + PROMPTS[2][0])
    for _ in range(2):
        prefill(decoder, long, prefixes=small)
    small.max_bytes = small.kept_bytes
    short = INSTRUCTIONS[1][:60]
    joiners = seqs(short + "a", short + "b", INSTRUCTIONS[0] + PROMPTS[2][0][:-3])
    charged = charge(joiners, small)
    _, joins = prefill(decoder, joiners, prefixes=small)
    assert long[0].prompt_ids[:SHARED_PREFIX_MIN] not in small, "the pair's took its place"
    assert charged == sum(join.tokens_run for join in joins)


def test_joiners_sharing_a_kept_opening_join_one_step_within_the_budget(
    task: GenerateTask,
) -> None:
    """With a budget of one whole prompt and two rests, three joiners that start with
    a long part of the kept prompt run only their rests: they join one step, and their
    prefill runs within it (charged whole, one joined a step). On a slot-layout graph
    nothing is shared: one joins a step."""
    decoder = task.decoder
    first = INSTRUCTIONS[0] + "x"
    prompts = [INSTRUCTIONS[0] + end for end in ("y = 1", "def f(x", "for i in range(")]
    joiners = [Seq(i, tuple(decoder.encode(p)), 2) for i, p in enumerate(prompts, 1)]
    longest = max(len(s.prompt_ids) for s in joiners)
    rest = longest - min(common_prefix(tuple(decoder.encode(first)), s.prompt_ids) for s in joiners)
    budget = longest + 2 * rest
    scheduler = scheduler_for(decoder, 4, max_prefill_tokens=budget)
    loop = StepLoop(decoder, scheduler, "code")
    for i in (10, 11):  # its opening's second comer is kept
        scheduler.add(Seq(i, tuple(decoder.encode(first)), 1))
        while scheduler.has_work:
            loop.run(scheduler.schedule())
    for seq in joiners:
        scheduler.add(seq)
    steps = []
    while scheduler.waiting:
        plan = scheduler.schedule()
        step = loop.run(plan)
        steps.append(([s.id for s in plan.prefill], step.prefill_tokens))
    if decoder.slots:
        assert [ids for ids, _ in steps] == [[1], [2], [3]]
    else:
        assert steps == [([1, 2, 3], 3 * rest)] and 3 * rest <= budget


def test_a_prompt_asked_again_later_in_an_offline_batch_joins_its_first_asking(
    task: GenerateTask,
) -> None:
    """The offline loop orders prompts by length, then by their tokens, so equal prompts
    far apart in a batch join together and share one row of their prefill."""
    prompts = [[5, 6, 7], [9, 9, 9], [5, 6, 7]]
    requests = [task.prepare({"prompt": p, "max_tokens": 2}) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(1) as pool, RUNS.closed():
        ran = pool.submit(generate_batch, task.decoder, requests, 2, "code")
        RUNS.wait_held()
        assert RUNS.held_rows() == 1, "the prefill of both [5, 6, 7]"
        RUNS.open()
        done = ran.result(timeout=WAIT_S)
    first, _, again = (d.tokens for d in done if isinstance(d, Completion))
    assert first == again == alone(task, {"prompt": prompts[0], "max_tokens": 2}).tokens


@pytest.mark.parametrize(("user", "policy"), USERS)
async def test_seeded_sampling_batched_equals_alone(
    task: GenerateTask, user: str, policy: Policy
) -> None:
    items: list[dict[str, object]] = [
        {"prompt": p, "max_tokens": n, "temperature": 0.9, "top_k": 40, "seed": i}
        for i, (p, n) in enumerate(PROMPTS)
    ]
    want = [alone(task, item).tokens for item in items]
    got = await run_all(task, policy, items, user=user)
    assert [tokens for tokens, _, _ in got] == want


async def test_cache_stays_as_long_as_its_longest_row(task: GenerateTask) -> None:
    """A long prompt joins, leaves, and the cache's leading padding is trimmed away;
    rows that left are compacted out."""
    engine = Engine(task, Metrics(), "continuous")
    engine.start()
    try:
        long_one = engine.submit(task.prepare({"prompt": PROMPTS[5][0], "max_tokens": 2}))
        short = engine.submit(task.prepare({"prompt": "x", "max_tokens": 40}))
        await collect(long_one)
        tokens, _, _ = await collect(short)
        assert len(tokens) == 40
        # The short row alone: its prompt (2 with bos) + 39 fed tokens, not the long prompt.
        assert engine.cache.length <= 2 + 40
        assert engine.cache.rows <= 1
    finally:
        await engine.stop()


async def next_run() -> int:
    """The rows of the next decoder run, waiting at the gate."""
    await asyncio.to_thread(RUNS.wait_held)
    return RUNS.held_rows()


async def two_prefilled(
    engine: Engine, task: GenerateTask, items: list[dict[str, object]]
) -> tuple[TokenStream, TokenStream]:
    """With the gate closed: the first two items submitted and their prefills let
    through, the second arriving while the first's prefill runs (none beside a decode)."""
    first = engine.submit(task.prepare(items[0]))
    assert await next_run() == 1, "the first prompt's prefill"
    second = engine.submit(task.prepare(items[1]))
    RUNS.allow(1)
    assert await next_run() == 1, "the second prompt's prefill, alone"
    RUNS.allow(1)
    return first, second


def each_as_alone(task: GenerateTask, items: list[dict[str, object]], got: Got) -> None:
    for item, (tokens, text, finish) in zip(items, got, strict=True):
        want = alone(task, item)
        assert (tokens, text, finish) == (want.tokens, want.text, want.finish_reason)


async def test_a_kv_budget_of_two_worst_cases_holds_a_third_until_one_leaves(
    task: GenerateTask, demo_models: Path
) -> None:
    """With `batching.max_kv_bytes` just the first two sequences' worst cases (prompt +
    max_tokens), the third waits though a row is free, and joins once one of them has
    left; no plan ever reserves more. Each makes the tokens it makes alone, and an
    offline batch under the same budget too."""
    items: list[dict[str, object]] = [
        {"prompt": p, "max_tokens": n} for p, n in (PROMPTS[0], PROMPTS[1], PROMPTS[3])
    ]
    requests = [task.prepare(item) for item in items]
    worst = [task.decoder.position_bytes * (len(r.prompt_ids) + r.max_new_tokens) for r in requests]
    budget = worst[0] + worst[1]
    assert worst[2] <= budget, "the third fits alone"
    layout = "model-slots.onnx" if task.decoder.slots else "model.onnx"
    budgeted = gated_task(demo_models, layout, rows=3, max_kv_bytes=budget)
    metrics = Metrics()
    engine = Engine(budgeted, metrics, "continuous", prefill_beside=False)
    scheduler = engine.scheduler
    engine.start()
    try:
        with RUNS.closed():
            first = engine.submit(budgeted.prepare(items[0]))
            assert await next_run() == 1, "the first prompt's prefill"
            second = engine.submit(budgeted.prepare(items[1]))
            third = engine.submit(budgeted.prepare(items[2]))
            RUNS.allow(1)
            assert await next_run() == 1, "the second prompt's prefill, without the third"
            assert scheduler.num_waiting == 1 and scheduler.kv_reserved == budget
            reserved = metrics.registry.get_sample_value(
                "lanes_kv_reserved_bytes", {"workload": "code"}
            )
            assert reserved == budget
            for _ in range(64):  # each held run: a plan made, the engine thread waiting
                if not scheduler.num_waiting:
                    break
                RUNS.allow(1)
                await next_run()
                assert scheduler.kv_reserved <= budget
            running = {s.id for s in scheduler.rows}
            assert third.id in running and not {first.id, second.id} <= running
        got = [await collect(stream) for stream in (first, second, third)]
    finally:
        await engine.stop()
    each_as_alone(budgeted, items, got)
    done = generate_batch(budgeted.decoder, requests, 3, "code", max_kv_bytes=budget)
    assert [(d.tokens, d.text, d.finish_reason) for d in done if isinstance(d, Completion)] == got


async def test_without_a_kv_budget_the_reserved_gauge_reads_zero(task: GenerateTask) -> None:
    """Nothing bounds the rows' worst cases: the engine does not sum them each plan,
    and `lanes_kv_reserved_bytes` reads 0 (the README says so) while a row runs."""
    metrics = Metrics()
    engine = Engine(task, metrics, "continuous", prefill_beside=False)
    engine.start()
    try:
        with RUNS.closed():
            stream = engine.submit(task.prepare({"prompt": "def f(x", "max_tokens": 4}))
            assert await next_run() == 1, "its prefill, planned and held"
            assert engine.scheduler.kv_reserved > 0, "a worst case the scheduler counts"
            sample = {"workload": "code"}
            assert metrics.registry.get_sample_value("lanes_kv_reserved_bytes", sample) == 0
        await collect(stream)
    finally:
        await engine.stop()


async def test_the_cache_gauge_reads_what_the_caches_arrays_hold(task: GenerateTask) -> None:
    """Two rows of different lengths decode together. Held at a run, with the step
    before reported (no arrivals thread: a step's report comes as the next one's runs
    begin, after a settle that changes nothing here), `lanes_kv_cache_bytes` is what the
    cache's arrays hold: more than the rows' positions (the shorter row's padding; the
    slots' whole contexts)."""
    metrics = Metrics()
    engine = Engine(task, metrics, "continuous", prefill_beside=False)
    items: list[dict[str, object]] = [
        {"prompt": p, "max_tokens": 8, "min_tokens": 8} for p in (PROMPTS[0][0], PROMPTS[2][0])
    ]
    sample = {"workload": "code"}
    engine.start()
    try:
        with RUNS.closed():
            streams = await two_prefilled(engine, task, items)
            assert await next_run() == 2, "their first decode, together"
            RUNS.allow(1)
            assert await next_run() == 2, "the next one's: the first's report is in"
            held = metrics.registry.get_sample_value("lanes_kv_cache_bytes", sample)
            positions = sum(len(task.prepare(item).prompt_ids) + 1 for item in items)
            assert held == engine.cache.nbytes > positions * task.decoder.position_bytes
            peak = metrics.registry.get_sample_value("lanes_kv_cache_peak_bytes", sample)
            assert peak is not None and peak >= held
        for stream in streams:
            await collect(stream)
    finally:
        await engine.stop()


def test_a_generate_workload_logs_what_its_rows_caches_may_take(
    demo_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At its load, without a budget: rows x context x bytes per token (tinycode: 4
    layers x key and value x 4 heads x 32 dims x float32), so operators see the risk."""
    with caplog.at_level(logging.INFO, logger="lanes.tasks.generate"):
        loaded = gated_task(demo_models, "model.onnx", rows=3)
    per_token = loaded.decoder.position_bytes
    assert per_token == 4 * 2 * 4 * 32 * 4
    assert (
        f"workload code: KV cache of {per_token} bytes per token; 3 rows of the whole context "
        f"(512 tokens) may take {3 * 512 * per_token} bytes (0.0 GiB); no batching.max_kv_bytes"
    ) in caplog.text


async def test_a_joiner_sharing_the_rows_step_has_its_first_token_before_their_decode(
    task: GenerateTask,
) -> None:
    """Joiners prefill alone, but never twice in a row while rows wait: the second of
    two arrivals between steps shares its step with the rows' decode. Its prefill runs
    first, and its first token is on its stream while that decode still waits at the
    gate. (Each arrives while a prefill runs, so none is prefilled beside a decode.)"""
    engine = Engine(task, Metrics(), "continuous", max_padding=1e9)  # rows in one group
    engine.start()
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": 8} for p, _ in PROMPTS[:3]]
    try:
        with RUNS.closed():
            first = engine.submit(task.prepare(items[0]))
            assert await next_run() == 1, "the first prompt's prefill"
            second = engine.submit(task.prepare(items[1]))
            RUNS.allow(1)
            assert await next_run() == 1, "the second prompt's prefill, alone"
            third = engine.submit(task.prepare(items[2]))
            RUNS.allow(1)
            assert await next_run() == 1, "the third prompt's prefill, ahead of the decode"
            RUNS.allow(1)
            assert await next_run() == 2, "the two rows' decode"
            await eventually(lambda: third.completion_tokens == 1, "its first token")
            assert second.completion_tokens == 1, "the second has made no token since"
        got = [await collect(stream) for stream in (first, second, third)]
    finally:
        await engine.stop()
    each_as_alone(task, items, got)


async def third_beside(
    engine: Engine, task: GenerateTask, items: list[dict[str, object]]
) -> tuple[TokenStream, TokenStream, TokenStream]:
    """With the gate closed: the first two items prefilled, their decode held at the
    gate, and the third submitted then: its prefill held there too, beside the decode."""
    first, second = await two_prefilled(engine, task, items)
    assert await next_run() == 2, "the two rows' decode"
    third = engine.submit(task.prepare(items[2]))
    await asyncio.to_thread(RUNS.wait_held, 2)
    assert RUNS.held_rows() == 2 + 1, "the third prompt's prefill beside the decode"
    return first, second, third


async def test_an_arrival_during_a_decode_is_prefilled_beside_it(task: GenerateTask) -> None:
    """A request that arrives while the rows' decode runs, and finds a free row, is
    prefilled at once beside that decode: its first token is on its stream while the
    decode still waits at the gate, and it decodes with the rows from the next step
    on. Every sequence makes the tokens it makes alone."""
    # Whatever the cores: beside is the default only where a run has some of its own.
    engine = Engine(task, Metrics(), "continuous", max_padding=1e9, prefill_beside=True)
    engine.start()
    items: list[dict[str, object]] = [{"prompt": p, "max_tokens": 8} for p, _ in PROMPTS[:3]]
    try:
        with RUNS.closed():
            first, second, third = await third_beside(engine, task, items)
            RUNS.allow(1, rows=1)
            await eventually(lambda: third.completion_tokens == 1, "its first token")
            assert RUNS.held_rows() == 2, "the decode still waits"
            assert (first.completion_tokens, second.completion_tokens) == (1, 1)
            RUNS.allow(1)
            assert await next_run() == 3, "the next decode: the third among the rows"
        got = [await collect(stream) for stream in (first, second, third)]
    finally:
        await engine.stop()
    each_as_alone(task, items, got)


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_arrivals_whose_padding_costs_more_than_a_run_are_prefilled_apart(
    demo_models: Path, layout: str
) -> None:
    """Two arrivals of very different lengths, beside a decode, where the prefill cost
    model says padding the short prompt to the long one costs more than a run: the
    short one is prefilled first, alone, and its first token goes out while the long
    one's prefill still waits. Every sequence makes the tokens it makes alone."""
    task = gated_task(demo_models, layout, rows=5)
    engine = Engine(task, Metrics(), "continuous", max_padding=1e9, prefill_beside=True)
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):  # a CPU's costs, exaggerated
        engine.steer.prefill_cost.observe(1, tokens, 1e-4 + 1e-3 * tokens)
    engine.start()
    items: list[dict[str, object]] = [
        {"prompt": p, "max_tokens": 6} for p, _ in (*PROMPTS[:3], PROMPTS[5], PROMPTS[3])
    ]
    try:
        with RUNS.closed():
            first, second, third = await third_beside(engine, task, items)
            # Both arrive while the third's prefill runs: the arrivals thread takes them
            # together once it is done.
            long, short = (engine.submit(task.prepare(item)) for item in items[3:])
            RUNS.allow(1, rows=1)
            await eventually(lambda: third.completion_tokens == 1, "the third's first token")
            await asyncio.to_thread(RUNS.wait_held, 2)
            assert RUNS.held_rows() == 2 + 1, "one prompt's prefill, not both in one run"
            RUNS.allow(1, rows=1)
            await eventually(lambda: short.completion_tokens == 1, "the short one's first token")
            await asyncio.to_thread(RUNS.wait_held, 2)
            assert RUNS.held_rows() == 2 + 1 and long.completion_tokens == 0, "the long one's"
            RUNS.allow(1, rows=1)
            await eventually(lambda: long.completion_tokens == 1, "the long one's first token")
        streams = (first, second, third, long, short)
        got = [await collect(stream) for stream in streams]
    finally:
        await engine.stop()
    each_as_alone(task, items, got)


class _PrefillTakes:
    """onnxruntime's session, with a clock that moves on by `seconds` during each run
    of more than one token (a prefill): a prefill that takes that long, on cue."""

    def __init__(self, session: Any, clock: list[float], seconds: float) -> None:
        self.session, self.clock, self.seconds = session, clock, seconds

    def run(self, names: Any, feeds: dict[str, Any]) -> Any:
        if feeds["input_ids"].shape[1] > 1:
            self.clock[0] += self.seconds
        return self.session.run(names, feeds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


async def test_a_deadline_that_passes_before_the_first_token_is_deadline_exceeded(
    demo_models: Path,
) -> None:
    """It joined in time but its first token came too late: 504, not one token and 200."""
    folder = demo_models / "tinycode"
    spec = Spec.model_validate(
        {
            "models": {
                "tiny": {"path": folder / "model.onnx", "tokenizer": folder / "tokenizer.json"}
            },
            "workloads": {"code": {"mode": "interactive", "task": "generate", "model": "tiny"}},
        }
    )
    task = load_task("code", spec, Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    now = [1000.0]
    task.decoder.session = _PrefillTakes(task.decoder.session, now, seconds=5.0)  # type: ignore[assignment]
    engine = Engine(task, Metrics(), clock=lambda: now[0])
    engine.start()
    try:
        late = engine.submit(task.prepare({"prompt": "def f(x", "max_tokens": 8}), timeout_s=1.0)
        with pytest.raises(DeadlineExceeded):
            async with asyncio.timeout(60):
                async for _ in pieces(late, None, streaming=True):
                    pass
        assert late.completion_tokens == 0
        on_time = engine.submit(task.prepare({"prompt": "def f(x", "max_tokens": 3}), timeout_s=60)
        tokens, _, finish = await collect(on_time)
        assert len(tokens) == 3 and finish == "length"
    finally:
        await engine.stop()


async def test_tokens_that_arrive_with_their_failure_are_sent_before_it(
    task: GenerateTask,
) -> None:
    """However soon a sequence fails after its first tokens (both in one `next()`),
    the tokens are a piece of their own before the ModelError, so a stream's answer
    always opens with 200 once the model made text."""
    stream = TokenStream(1, 3, Engine(task, Metrics()))
    stream._push(Event(1, (5,), "w1", first=True))
    stream._push(Event(1, finish="error", error="position 8 is past the table"))
    flow = pieces(stream, None, streaming=True)
    first = await anext(flow)
    assert (first.text, first.finish) == ("w1", None)
    with pytest.raises(ModelError, match="position 8"):
        await anext(flow)


async def test_a_chunked_guard_scores_every_n_tokens_however_they_arrive(
    task: GenerateTask,
) -> None:
    """Six steps' tokens read in one `next()` (a reader slower than the model) are
    still scored two tokens at a time: the chunks before the failing one are sent."""
    spec = Guard(handler="lanes.demo.guard:blocklist", mode="chunked", every_tokens=2)
    guard = TextGuard(spec, lambda text: float("bad" in text))
    stream = TokenStream(1, 3, Engine(task, Metrics()))
    words = ["a", "b", "c", "bad", "d", "e"]
    for i, word in enumerate(words):
        stream._push(Event(1, (i,), word, first=i == 0, finish="length" if i == 5 else None))
    got = [(p.text, p.finish) async for p in pieces(stream, guard, streaming=True)]
    assert got == [("ab", None), ("", "content_filter")]
