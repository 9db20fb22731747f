"""A second decoder with the same signature: a tiny GPT-2 from `transformers`, random
weights, exported here. The engine (batched, over HTTP too) must give exactly the
tokens of a plain step-by-step onnxruntime decode of the same file."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from openai import AsyncOpenAI
from tokenizers import Tokenizer

from lanes.runtime import Runtime
from lanes.serving.engine import Engine
from lanes.serving.metrics import Metrics
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import GenerateTask, load_task
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

LAYERS, HEADS, EMBED, VOCAB, POSITIONS = 2, 2, 64, 1024, 256
HEAD_DIM = EMBED // HEADS
KV = [f"{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
PROMPTS = [
    ("def f(x", 12),
    ("class Foo:\n    def __init__(self, a, b", 5),
    ("x", 9),
    ("import", 16),
]


def export_gpt2(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        n_embd=EMBED,
        n_layer=LAYERS,
        n_head=HEADS,
        initializer_range=0.2,  # decisive logits: greedy has no near-ties
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).eval()

    class Flat(torch.nn.Module):
        """The Optimum signature: past and present as flat key, value, key, value, ..."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any
        ) -> Any:
            cache = DynamicCache()
            for i in range(LAYERS):
                cache.update(past[2 * i], past[2 * i + 1], i)
            result = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            present = result.past_key_values
            flat = [t for layer in present.layers for t in (layer.keys, layer.values)]
            return (result.logits, *flat)

    past = [torch.zeros(2, HEADS, 3, HEAD_DIM) for _ in KV]
    args = (
        torch.zeros(2, 2, dtype=torch.int64),
        torch.ones(2, 5, dtype=torch.int64),
        torch.tensor([[3, 4], [3, 4]]),
        *past,
    )
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
        **{f"past_key_values.{n}": {0: "batch", 2: "past"} for n in KV},
        **{f"present.{n}": {0: "batch", 2: "total"} for n in KV},
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings: every axis is dynamic
        torch.onnx.export(
            Flat().eval(),
            args,
            str(out / "model.onnx"),
            input_names=["input_ids", "attention_mask", "position_ids"]
            + [f"past_key_values.{n}" for n in KV],
            output_names=["logits"] + [f"present.{n}" for n in KV],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    config_json = {
        "eos_token_id": 0,
        "bos_token_id": 0,
        "num_layers": LAYERS,
        "num_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position": POSITIONS,
    }
    (out / "config.json").write_text(json.dumps(config_json))


@pytest.fixture(scope="module")
def gpt2(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpt2")
    shutil.copy(demo_models / "tinycode" / "tokenizer.json", out / "tokenizer.json")
    export_gpt2(out)
    (out / "workloads.yaml").write_text(
        f"""\
version: 1
models:
  gpt2: {{path: {out}/model.onnx, tokenizer: {out}/tokenizer.json}}
workloads:
  gpt2:
    mode: interactive
    task: generate
    model: gpt2
    batching: {{max_batch_size: 3}}
    generation: {{temperature: 0}}
"""
    )
    return out


def plain_greedy(model: Path, tokenizer: Tokenizer, prompt: str, max_new: int) -> list[int]:
    """Step by step on onnxruntime alone: prefill, then one token at a time on the cache."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    ids = [0, *tokenizer.encode(prompt).ids]  # bos first, as the config says
    past = [np.zeros((1, HEADS, 0, HEAD_DIM), dtype=np.float32) for _ in KV]
    new, tokens = ids, []
    while len(tokens) < max_new:
        start = len(ids) + len(tokens) - len(new)
        feeds = {
            "input_ids": np.asarray([new], dtype=np.int64),
            "attention_mask": np.ones((1, start + len(new)), dtype=np.int64),
            "position_ids": np.arange(start, start + len(new))[None, :],
            **{f"past_key_values.{n}": p for n, p in zip(KV, past, strict=True)},
        }
        logits, *past = session.run(None, feeds)
        token = int(np.argmax(logits[0, -1]))
        if token == 0:
            break
        tokens.append(token)
        new = [token]
    return tokens


async def test_gpt2_batched_greedy_equals_a_plain_decode(gpt2: Path) -> None:
    spec = load_spec(gpt2 / "workloads.yaml", Settings())
    task = load_task("gpt2", spec, Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    tokenizer = Tokenizer.from_file(str(gpt2 / "tokenizer.json"))
    expected = [plain_greedy(gpt2 / "model.onnx", tokenizer, p, n) for p, n in PROMPTS]
    assert len({tuple(t) for t in expected}) == len(PROMPTS)
    engine = Engine(task, Metrics())
    engine.start()
    try:
        streams = [engine.submit(task.prepare({"prompt": p, "max_tokens": n})) for p, n in PROMPTS]
        got: list[list[int]] = []
        async with asyncio.timeout(60):
            for stream in streams:
                got.append([t async for event in stream for t in event.tokens])
    finally:
        await engine.stop()
    assert got == expected

    with ServerThread(gpt2 / "workloads.yaml") as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answers = await asyncio.gather(
            *(client.completions.create(model="gpt2", prompt=p, max_tokens=n) for p, n in PROMPTS)
        )
        await client.close()
    for tokens, answer in zip(expected, answers, strict=True):
        assert answer.choices[0].text == tokenizer.decode(tokens)
        assert answer.usage is not None and answer.usage.completion_tokens == len(tokens)
