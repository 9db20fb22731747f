"""Decoders as users export them: Hugging Face Optimum's own exporter (optimum-onnx, task
text-generation-with-past) on tiny random-weight GPT-2, Llama (grouped-query attention,
RoPE, a tokenizer that adds bos) and Qwen2 (GQA with one key/value head, two eos ids in
generation_config.json). What lanes reads from the export's files matches them, and
greedy output equals `transformers`' `generate`: alone through `GenerateTask`, batched
(left-padded, and joining mid-decode) through the engine, and over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from lanes.errors import InvalidInput
from lanes.generation.batch import generate_batch
from lanes.generation.seq import Event
from lanes.runtime import Runtime
from lanes.serving.engine import Engine
from lanes.serving.metrics import Metrics
from lanes.serving.token_stream import TokenStream
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import Completion, GenerateTask, load_task
from tests.conftest import ROOT
from tests.optimum_exports import (
    BOS,
    CONTEXT,
    EOS,
    FAMILIES,
    NEW_TOKENS,
    PROMPTS,
    Export,
    export,
    float16,
    greedy,
)
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

EXPORTS = ROOT / ".lanes" / "optimum-exports"


@dataclass(frozen=True)
class Reference:
    """`transformers` itself: the tokenizer lanes serves, the model the export came from."""

    tokenizer: Any
    model: Any

    def greedy(self, prompts: list[str], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        return greedy(self.model, self.tokenizer, prompts, new_tokens)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request: pytest.FixtureRequest) -> Export:
    return export(FAMILIES[request.param], EXPORTS)


@pytest.fixture(scope="module")
def reference(exported: Export) -> Reference:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported.onnx)
    model = AutoModelForCausalLM.from_pretrained(exported.src).eval()
    return Reference(tokenizer, model)


def spec_of(exports: list[Export]) -> dict[str, Any]:
    return {
        "models": {
            e.family.name: {"path": str(e.model), "tokenizer": str(e.tokenizer)} for e in exports
        },
        "workloads": {
            e.family.name: {
                "mode": "interactive",
                "task": "generate",
                "model": e.family.name,
                "batching": {"max_batch_size": 4},
                "generation": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
            }
            for e in exports
        },
    }


def load(exported: Export) -> GenerateTask:
    spec = Spec.model_validate(spec_of([exported]))
    loaded = load_task(exported.family.name, spec, Runtime(Settings(device="cpu")))
    assert isinstance(loaded, GenerateTask)
    return loaded


@pytest.fixture(scope="module")
def task(exported: Export) -> Iterator[GenerateTask]:
    yield load(exported)


def test_config_comes_from_the_exports_files(
    exported: Export, task: GenerateTask, reference: Reference
) -> None:
    raw = json.loads((exported.onnx / "config.json").read_text())
    generation = json.loads((exported.onnx / "generation_config.json").read_text())
    config = task.decoder.config
    query_heads = raw.get("num_attention_heads", raw.get("n_head"))
    hidden = raw.get("hidden_size", raw.get("n_embd"))
    assert config.num_layers == raw.get("num_hidden_layers", raw.get("n_layer")) == 2
    assert config.num_heads == raw.get("num_key_value_heads", query_heads)
    assert config.head_dim == hidden // query_heads
    assert config.max_position == raw.get("max_position_embeddings", raw.get("n_positions"))
    assert config.max_position == CONTEXT
    eos = generation["eos_token_id"]
    assert config.eos_token_ids == frozenset(eos if isinstance(eos, list) else [eos])
    assert config.pad_token_id == generation.get("pad_token_id", EOS)
    assert config.bos_token_id == BOS
    if exported.family.name != "gpt2":
        assert config.num_heads < query_heads  # grouped-query attention
    if exported.family.second_eos:
        assert len(config.eos_token_ids) == 2 and raw["eos_token_id"] == EOS
    for prompt in PROMPTS:  # bos only where the tokenizer adds it (Llama's)
        assert task.decoder.encode(prompt) == reference.tokenizer(prompt)["input_ids"]


def test_greedy_alone_equals_transformers(task: GenerateTask, reference: Reference) -> None:
    finishes = []
    for prompt in PROMPTS:
        (want,) = reference.greedy([prompt])
        got = task.complete(task.prepare({"prompt": prompt, "max_tokens": NEW_TOKENS}))
        assert got.tokens == want, prompt
        assert got.text == reference.decode(want)
        assert got.finish_reason == ("length" if len(want) == NEW_TOKENS else "stop")
        finishes.append(got.finish_reason)
    if task.decoder.config.eos_token_ids != {EOS}:
        assert "stop" in finishes  # the second eos of generation_config.json ended one


def test_a_prompt_near_the_context_stops_where_the_context_ends(
    task: GenerateTask, reference: Reference
) -> None:
    prompt = "ab" * 57
    ids = task.decoder.encode(prompt)
    (want,) = reference.greedy([prompt], CONTEXT - len(ids))
    got = task.complete(task.prepare(prompt))  # no max_tokens: up to the context
    assert got.tokens == want
    with pytest.raises(InvalidInput, match=f"maximum context length is {CONTEXT} tokens"):
        task.prepare({"prompt": prompt, "max_tokens": CONTEXT - len(ids) + 1})


async def tokens_of(stream: TokenStream, seen: Sequence[Event] = ()) -> list[int]:
    """Every token of `stream`, after the events already taken from it (`seen`)."""
    made = [t for event in seen for t in event.tokens]
    if any(event.finish for event in seen):
        return made
    async with asyncio.timeout(60):
        return made + [t async for event in stream for t in event.tokens]


async def test_greedy_batched_equals_transformers(task: GenerateTask, reference: Reference) -> None:
    """Two prompts are prefilled together (left-padded); the other two are sent once
    both have a token, to join while they decode (into a cache of another length)."""
    want = reference.greedy(PROMPTS)
    assert want == [reference.greedy([p])[0] for p in PROMPTS]  # transformers agrees with itself
    metrics = Metrics()
    engine = Engine(task, metrics)
    # Submitted before the engine starts: its first plan prefills both in one run.
    first = [engine.submit(task.prepare(p)) for p in PROMPTS[:2]]
    engine.start()
    try:
        async with asyncio.timeout(60):
            early = [await stream.next() for stream in first]  # a first token each
        rest = [engine.submit(task.prepare(p)) for p in PROMPTS[2:]]
        got = [await tokens_of(s, e) for s, e in zip(first, early, strict=True)]
        got += [await tokens_of(s) for s in rest]
    finally:
        await engine.stop()
    assert got == want
    batch = metrics.registry.get_sample_value("lanes_batch_size_sum", {"workload": task.name}) or 0
    steps = (
        metrics.registry.get_sample_value("lanes_batch_size_count", {"workload": task.name}) or 1
    )
    assert batch / steps > 1, "the rows should have decoded together"


def test_prompts_prefilled_in_parts_decode_as_transformers(
    task: GenerateTask, reference: Reference
) -> None:
    """Prefill in parts of 5 tokens, each on the cache of the parts before it: the
    export takes several new tokens on a past, and greedy output is unchanged."""
    want = reference.greedy(PROMPTS)
    requests = [task.prepare(p) for p in PROMPTS]
    assert max(len(r.prompt_ids) for r in requests) > 3 * 5, "some prompt takes several parts"
    done = generate_batch(task.decoder, requests, 2, task.name, max_prefill_tokens=5, chunked=True)
    assert [d.tokens if isinstance(d, Completion) else d for d in done] == want


def test_greedy_batched_offline_equals_transformers(
    task: GenerateTask, reference: Reference
) -> None:
    """The offline lane's loop: two rows for four prompts, each refilled as it frees."""
    want = reference.greedy(PROMPTS)
    done = generate_batch(task.decoder, [task.prepare(p) for p in PROMPTS], 2, task.name)
    assert [d.tokens if isinstance(d, Completion) else d for d in done] == want


# A few-shot instruction every prompt starts with (bytes are tokens: 38 of them, over
# the shortest prefix that prefill runs once), then items of different lengths.
INSTRUCTED = [
    f"Classify each line as code or prose.\n\n{item}"
    for item in ("hello", "x = 1", "the quick brown fox", "def f(): pass")
]


def test_prompts_sharing_an_instruction_decode_as_transformers(
    task: GenerateTask, reference: Reference
) -> None:
    """The first two prefill the instruction once and each item on its cache; the
    others, joining as rows free up, run only their items on it (prefill.py)."""
    want = reference.greedy(INSTRUCTED)
    assert want == [reference.greedy([p])[0] for p in INSTRUCTED]
    done = generate_batch(task.decoder, [task.prepare(p) for p in INSTRUCTED], 2, task.name)
    assert [d.tokens if isinstance(d, Completion) else d for d in done] == want


async def test_a_float16_export_decodes_like_transformers(
    exported: Export, reference: Reference
) -> None:
    """float16 past and logits (a GPU export's dtypes): the cache is kept in the graph's
    dtype, alone and batched."""
    half = load(float16(exported))
    assert half.decoder.empty_past(1).keys[0].dtype == np.float16
    want = reference.greedy(PROMPTS)
    alone = [half.complete(half.prepare(p)).tokens for p in PROMPTS]
    engine = Engine(half, Metrics())
    streams = [engine.submit(half.prepare(p)) for p in PROMPTS]  # one prefill of all
    engine.start()
    try:
        batched = [await tokens_of(s) for s in streams]
    finally:
        await engine.stop()
    assert alone == batched == want


async def test_served_concurrently_over_http(tmp_path: Path) -> None:
    """Every family in one server, every prompt at once, through the OpenAI client."""
    exports = [export(FAMILIES[name], EXPORTS) for name in sorted(FAMILIES)]
    (tmp_path / "workloads.yaml").write_text(json.dumps({"version": 1, **spec_of(exports)}))
    references = {}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for e in exports:
        ref = Reference(
            AutoTokenizer.from_pretrained(e.onnx),
            AutoModelForCausalLM.from_pretrained(e.src).eval(),
        )
        references[e.family.name] = (ref, ref.greedy(PROMPTS))
    with ServerThread(tmp_path / "workloads.yaml", device="cpu") as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            async with asyncio.timeout(120):
                answers = await asyncio.gather(
                    *(
                        client.completions.create(model=name, prompt=prompt)
                        for name in references
                        for prompt in PROMPTS
                    )
                )
        finally:
            await client.close()
    expected = [(ref, tokens) for ref, want in references.values() for tokens in want]
    for (ref, tokens), answer in zip(expected, answers, strict=True):
        assert answer.choices[0].text == ref.decode(tokens)
        reason = "length" if len(tokens) == NEW_TOKENS else "stop"
        assert answer.choices[0].finish_reason == reason
        # The reference is cut before its eos; usage counts an ending eos, as vLLM does.
        made = len(tokens) + (reason == "stop")
        assert answer.usage is not None and answer.usage.completion_tokens == made
