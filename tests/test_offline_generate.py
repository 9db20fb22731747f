"""Offline generate answers as the endpoint does, line for line: the same prompts run
through a real `lanes run` (a Prefect flow, the shard path, the continuous step loop
with fewer rows than prompts, so rows are refilled) and through a real server's
/v1/completions and /v1/chat/completions, greedy or sampled with a seed, give the same
texts, finishes and token counts, for plain records and for OpenAI batch lines alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.flows_fixtures import outputs_of, write_jsonl
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
GENERATION = "generation: {max_new_tokens: 20, temperature: 0}"
WORKLOADS = f"""\
  live:
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: 4}}
    {GENERATION}
  nightly:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: out/
    batch_size: 3
    retries: 0
    {GENERATION}
"""
PROMPTS = [
    "def ",
    "import os\n",
    "class Config:\n    def __init__(self, path",
    "    for name in sorted(names):\n        if name.startswith('_'):\n",
    "# Copyright 2001 Python Software Foundation\n\nimport sys\n",
    "    return self.",
    "for i in range(",
]


def plain(i: int, prompt: str) -> dict[str, Any]:
    """A plain record; budgets and a stop string differ, so rows finish apart."""
    record: dict[str, Any] = {"id": f"p{i}", "prompt": prompt, "max_tokens": 4 + 3 * i}
    if i == 2:
        record["stop"] = [" ", "\n", "("]
    if i == 3:  # vLLM's controls, as a plain record may carry them too
        record |= {"stop_token_ids": [199], "min_tokens": 2, "include_stop_str_in_output": True}
    if i == 4:
        record |= {"logit_bias": {"199": 5}, "frequency_penalty": 1.0, "repetition_penalty": 1.2}
    if i >= 5:  # sampled, each with its seed: the same draws offline as online
        record |= {"temperature": 1.3, "seed": -i} | ({"top_p": 0.9} if i == 6 else {})
    return record


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def readme_scoring_line() -> dict[str, Any]:
    """The README's offline scoring example (Logprobs), as it is written there."""
    section = (ROOT / "README.md").read_text().split("**Scoring a text: `echo`.**", 1)[1]
    line: dict[str, Any] = json.loads(section.split("```jsonl\n", 1)[1].split("```", 1)[0])
    return line


def test_offline_generate_equals_the_endpoints_greedy_and_seeded_answers(
    demo_models: Path, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, demo_models, WORKLOADS)
    records: list[dict[str, Any]] = [plain(i, p) for i, p in enumerate(PROMPTS)]
    completions = {"model": "nightly", "prompt": PROMPTS[:3], "max_tokens": 12}
    chat = {
        "model": "nightly",
        "messages": [{"role": "user", "content": "write a loop"}],
        "max_tokens": 16,
    }
    records += [
        batch_line("c-1", "/v1/completions", completions),
        batch_line("c-2", "/v1/chat/completions", chat),
        batch_line("c-3", "/v1/completions", {**completions, "prompt": PROMPTS[4]}),
        # Logprobs answer as online, one line's prompts among others that asked none.
        batch_line("c-4", "/v1/completions", {**completions, "logprobs": 2, "stop": ["("]}),
        batch_line("c-5", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 3}),
        # Scoring texts: the prompts echoed with their tokens' logprobs, a completion
        # after them or none at all.
        batch_line("c-6", "/v1/completions", {**completions, "echo": True, "logprobs": 1}),
        batch_line(
            "c-7", "/v1/completions", {**completions, "echo": True, "logprobs": 2, "max_tokens": 0}
        ),
        readme_scoring_line(),
        # n choices per prompt, sampled: each its own seed, derived as online.
        batch_line(
            "c-8",
            "/v1/completions",
            {**completions, "n": 2, "temperature": 1, "seed": 5, "logprobs": 1},
        ),
        batch_line("c-9", "/v1/chat/completions", {**chat, "n": 2, "temperature": 1, "seed": 9}),
        # vLLM's controls, one line's prompts among others that declared none.
        batch_line(
            "c-10",
            "/v1/completions",
            {**completions, "stop_token_ids": [199], "min_tokens": 3, "stop": ["("]}
            | {"include_stop_str_in_output": True},
        ),
        batch_line(
            "c-11",
            "/v1/completions",
            {**completions, "logit_bias": {"9": -100, "12": 4}, "presence_penalty": 1.5}
            | {"repetition_penalty": 1.3, "min_p": 0.1, "temperature": 1, "seed": 11},
        ),
    ]
    write_jsonl(tmp_path / "in" / "part-0.jsonl", records)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    done = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "run", "nightly", "--file", str(spec)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    offline = {line.get("custom_id") or line["id"]: line for line in outputs_of(tmp_path / "out")}
    assert len(offline) == len(records)

    with ServerThread(spec) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for record in records[: len(PROMPTS)]:
            body = {k: v for k, v in record.items() if k != "id"}
            online = http.post("/v1/completions", json={"model": "live", **body}).json()
            (choice,) = online["choices"]
            line = offline[record["id"]]
            assert line["text"] == choice["text"], record
            assert line["finish_reason"] == choice["finish_reason"], record
            # The eos or stop token that ended it is counted too, as vLLM counts it.
            made = len(line["tokens"]) + (line["stop_token"] is not None)
            assert made == online["usage"]["completion_tokens"]
            assert line["prompt_tokens"] == online["usage"]["prompt_tokens"]
            assert "logprobs" not in line  # a plain record's line is as it was
        for record in records[len(PROMPTS) :]:
            online = http.post(record["url"], json={**record["body"], "model": "live"}).json()
            response = offline[record["custom_id"]]["response"]
            assert response["status_code"] == 200
            assert_same(response["body"]["choices"], online["choices"], record["custom_id"])
            assert response["body"]["usage"] == online["usage"]
    finishes = {offline[r["id"]]["finish_reason"] for r in records[: len(PROMPTS)]}
    assert "length" in finishes and "stop" in finishes, "the records should end both ways"
    asked = offline["c-4"]["response"]["body"]["choices"]
    assert all(c["logprobs"]["tokens"] for c in asked)
    assert offline["c-5"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    (scored,) = offline["conv-1"]["response"]["body"]["choices"]
    assert scored["text"] == readme_scoring_line()["body"]["prompt"]
    assert scored["logprobs"]["token_logprobs"][0] is None
    sampled = offline["c-8"]["response"]["body"]["choices"]
    assert [c["index"] for c in sampled] == list(range(6))
    assert [c["index"] for c in offline["c-9"]["response"]["body"]["choices"]] == [0, 1]
    for choice, prompt in zip(offline["c-7"]["response"]["body"]["choices"], PROMPTS, strict=False):
        assert choice["text"] == prompt and choice["logprobs"]["token_logprobs"][0] is None
        assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])


def assert_same(got: Any, want: Any, where: str) -> None:
    """Equal answers; logprobs to float32 rounding (a row batched with others may
    round its logits' last bits otherwise)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key, value in want.items():
            assert_same(got[key], value, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where
