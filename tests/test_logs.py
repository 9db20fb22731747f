"""Log lines: the formats, and the one line per offline shard."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import orjson
import pytest

from lanes import logs
from lanes.flows.batch import offline
from tests.flows_fixtures import text, write_jsonl, write_spec


def _logged(format: logs.LogFormat) -> list[str]:
    out = io.StringIO()
    handler = logs.handler(format, out)
    logger = logging.getLogger(f"tests.logs.{format}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        token = logs.request_id.set("abc123")
        logger.info("inside %d", 1, extra={"lanes": {"status": 200}})
        logs.request_id.reset(token)
        logger.info("outside")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    return out.getvalue().splitlines()


def test_text_lines_end_with_the_request_id() -> None:
    inside, outside, _failed, *traceback = _logged("text")
    assert inside.endswith("tests.logs.text: inside 1 request_id=abc123")
    assert outside.endswith("tests.logs.text: outside")
    assert "ValueError: boom" in traceback[-1]


def test_json_lines_hold_the_id_the_fields_and_the_traceback() -> None:
    inside, outside, failed = (orjson.loads(line) for line in _logged("json"))
    assert inside["message"] == "inside 1" and inside["request_id"] == "abc123"
    assert inside["status"] == 200 and inside["level"] == "INFO"
    assert "request_id" not in outside
    assert "ValueError: boom" in failed["exc"]


def test_each_shard_logs_one_line_with_records_errors_and_rate(
    prefect_api: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workload = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/"}
    fields = {"output": "out/", "batch_size": 4, "max_error_rate": 0.5}
    spec = write_spec(tmp_path, {"emb": {**workload, **fields}})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"a{i}", "text": text(i)} for i in range(6)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b0", "text": "w1"}, {"id": "b1"}])
    with caplog.at_level(logging.INFO, logger="lanes.flows.shard"):
        offline(workload="emb", spec=str(spec))
    lines = {r.lanes["shard"]: r for r in caplog.records if hasattr(r, "lanes")}
    assert sorted(lines) == ["a.jsonl", "b.jsonl"]
    a, b = lines["a.jsonl"].lanes, lines["b.jsonl"].lanes
    assert (a["records"], a["errors"], a["items"]) == (6, 0, 6)
    assert (b["records"], b["errors"], b["items"]) == (2, 1, 1)
    assert a["items_per_s"] > 0 and a["batches"] == 2
    assert "6 records, 0 errors" in lines["a.jsonl"].getMessage()
