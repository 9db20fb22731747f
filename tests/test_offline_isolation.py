"""One record the model fails on never fails its batch-mates offline either, under
Prefect's test harness: the model (tests/failing_models.py) fails on texts holding
BAD_WORD; the other records of its batch are answered as alone, the bad ones are
error lines whose OpenAI response is the 500 `model_error` the endpoint answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from lanes.flows.batch import offline
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import load_task
from tests.failing_models import BAD_WORD, POSITIONS, positional_decoder, short_embed_model
from tests.flows_fixtures import outputs_of, read_jsonl, text, write_jsonl


def test_a_record_the_model_fails_on_is_an_error_line_and_the_rest_are_answered(
    prefect_api: str, tmp_path: Path
) -> None:
    model, tokenizer = short_embed_model(tmp_path / "enc")
    workload = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/"}
    spec = {
        "version": 1,
        "models": {"enc": {"path": str(model), "tokenizer": str(tokenizer)}},
        "workloads": {
            "emb": {
                **workload,
                "output": "out/",
                "batch_size": 8,
                "retries": 0,
                "max_error_rate": 0.2,
            },
        },
    }
    spec_path = tmp_path / "workloads.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    plain = [{"id": f"d{i}", "text": text(i).replace(BAD_WORD, "w0")} for i in range(12)]
    plain[5]["text"] = f"w1 {BAD_WORD}"
    line = {"method": "POST", "url": "/v1/embeddings"}
    bad_line = {**line, "custom_id": "req-bad", "body": {"model": "emb", "input": ["w3", BAD_WORD]}}
    good_line = {**line, "custom_id": "req-good", "body": {"model": "emb", "input": ["w3"]}}
    write_jsonl(tmp_path / "in" / "a.jsonl", [*plain, bad_line, good_line])

    summary = offline(workload="emb", spec=str(spec_path))

    assert (summary["outputs"], summary["errors"]) == (12, 2)
    out = tmp_path / "out"
    lines = {line.get("custom_id") or line["id"]: line for line in outputs_of(out)}
    assert sorted(lines) == sorted([p["id"] for p in plain if p["id"] != "d5"] + ["req-good"])
    task = load_task("emb", load_spec(spec_path, Settings()), Runtime(Settings(device="cpu")))
    for record in plain:
        if record["id"] != "d5":
            (alone,) = task.run([task.prepare(record["text"])])
            np.testing.assert_allclose(lines[record["id"]]["embedding"], alone, atol=1e-6)
    errors = {e["id"]: e for e in read_jsonl(out / "_errors" / "a.jsonl")}
    assert sorted(errors) == ["d5", "req-bad"]
    assert errors["d5"]["error"].startswith("the model failed on this record, run on its own")
    assert "out of data bounds" in errors["d5"]["error"]
    response = errors["req-bad"]["response"]
    assert response["status_code"] == 500, "the status the endpoint answers for it"
    assert response["body"]["error"]["code"] == "model_error"


def test_a_prompt_the_decoder_fails_on_fails_alone_in_the_offline_loop(
    prefect_api: str, tmp_path: Path
) -> None:
    """The offline lane runs generate in the same step loop as the endpoint: a prompt
    that fails in its prefill, and one that fails mid-way at a decode step, are each an
    error line; every other prompt of their batch gets what it gets alone."""
    model, tokenizer = positional_decoder(tmp_path / "dec")
    spec = {
        "version": 1,
        "models": {"dec": {"path": str(model), "tokenizer": str(tokenizer)}},
        "workloads": {
            "gen": {
                "mode": "offline",
                "task": "generate",
                "model": "dec",
                "input": "in/",
                "output": "out/",
                "batch_size": 4,
                "retries": 0,
                "max_error_rate": 0.3,
                "generation": {"max_new_tokens": 16, "temperature": 0},
            },
        },
    }
    spec_path = tmp_path / "workloads.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    good = ["a", "b", "c", "a b", "c a", "b b c", "a a"]
    bad = {
        "p-prefill": " ".join(["a"] * (POSITIONS + 1)),
        "p-decode": " ".join(["a"] * (POSITIONS - 1)),
    }
    records = [{"id": f"g{i}", "prompt": p} for i, p in enumerate(good)]
    records[3:3] = [{"id": k, "prompt": p} for k, p in bad.items()]
    write_jsonl(tmp_path / "in" / "a.jsonl", records)

    summary = offline(workload="gen", spec=str(spec_path))

    assert (summary["outputs"], summary["errors"]) == (len(good), 2)
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    task = load_task("gen", load_spec(spec_path, Settings()), Runtime(Settings(device="cpu")))
    for i, prompt in enumerate(good):
        r = task.prepare(prompt)
        alone = task.decoder.complete(r.prompt_ids, r.max_new_tokens, r.sampling)
        assert lines[f"g{i}"]["tokens"] == alone.tokens, prompt
        assert lines[f"g{i}"]["text"] == alone.text
    errors = {e["id"]: e["error"] for e in read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")}
    assert sorted(errors) == sorted(bad)
    assert "this prompt, run on its own" in errors["p-prefill"]
    assert f"at position {POSITIONS}, run on its own" in errors["p-decode"]
