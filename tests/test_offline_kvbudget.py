"""An offline generate workload's `max_kv_bytes` on the real tinycode decoder, through
the flow's shards: the budget bounds the rows' worst cases and changes no answer, and a
record that could never fit is that record's error line, the others answered."""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from lanes.errors import InvalidInput
from lanes.flows.batch import offline
from lanes.flows.job import settle_job
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import GenerateTask, load_task
from tests.flows_fixtures import errors_of, outputs_of, write_jsonl
from tests.servers import write_spec
from tests.test_offline_generate import PROMPTS

pytestmark = pytest.mark.slow

WORKLOAD = """\
  {name}:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: {name}/
    batch_size: 4
    retries: 0
    max_error_rate: 0.5
    generation: {{temperature: 0}}
{budget}"""
RESERVED = re.compile(r"workload bounded: \d+ sequences; .* reserved at most (\d+) bytes")


def test_an_offline_kv_budget_bounds_the_rows_and_refuses_only_what_never_fits(
    prefect_api: str, demo_models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    free = write_spec(tmp_path, demo_models, WORKLOAD.format(name="free", budget=""))
    task = load_task("free", load_spec(free, Settings()), Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    # Prompt and max_tokens of 32 positions each: every worst case is the same.
    records: list[dict[str, Any]] = [
        {"id": f"p{i}", "prompt": p, "max_tokens": 32 - len(task.prepare(p).prompt_ids)}
        for i, p in enumerate(PROMPTS[:5])
    ]
    worst = task.kv_budget.worst(32, 0)
    budget = 2 * worst + worst // 2  # two rows' worst cases fit, not three
    huge = {"id": "huge", "prompt": "def ", "max_tokens": 400}  # alone over the budget
    workloads = WORKLOAD.format(name="free", budget="") + WORKLOAD.format(
        name="bounded", budget=f"    max_kv_bytes: {budget}\n"
    )
    spec = write_spec(tmp_path, demo_models, workloads)
    write_jsonl(tmp_path / "in" / "part-0.jsonl", [*records, huge])

    offline(workload="free", spec=str(spec))
    with caplog.at_level(logging.DEBUG, logger="lanes.generation.batch"):
        summary = offline(workload="bounded", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (len(records), 1)
    reserved = [int(m.group(1)) for m in RESERVED.finditer(caplog.text)]
    assert reserved and max(reserved) <= budget
    assert max(reserved) == 2 * worst, "two rows ran together, never three"
    answers = {line["id"]: line for line in outputs_of(tmp_path / "free")}
    for line in outputs_of(tmp_path / "bounded"):
        want = answers[line["id"]]
        assert (line["text"], line["tokens"], line["finish_reason"]) == (
            want["text"],
            want["tokens"],
            want["finish_reason"],
        )
    assert answers["huge"]["finish_reason"] in ("stop", "length"), "unbounded, it runs"
    (error,) = errors_of(tmp_path / "bounded")
    assert error["id"] == "huge"
    assert f"max_kv_bytes ({budget} bytes)" in str(error) and "max_tokens" in str(error)


def test_a_batch_api_batch_names_the_budget_its_user_set(demo_models: Path, tmp_path: Path) -> None:
    """A Batch API batch runs an interactive workload as its offline copy, whose
    max_kv_bytes is the workload's batching.max_kv_bytes: a line over it names the key
    the user set, through the pickle that takes the job to a Dask worker."""
    live = "  live:\n    mode: interactive\n    task: generate\n    model: tinycode\n"
    spec = load_spec(write_spec(tmp_path, demo_models, live), Settings())
    position_bytes = load_task(
        "live", spec, Runtime(Settings(device="cpu"))
    ).kv_budget.position_bytes
    budget = 20 * position_bytes  # 20 positions: prompt and max_tokens
    spec = load_spec(
        write_spec(tmp_path, demo_models, live + f"    batching: {{max_kv_bytes: {budget}}}\n"),
        Settings(),
    )
    settings = Settings(batch={"store": str(tmp_path / "store")})
    staged = f"{settings.batch_store()}batches/b1/"
    job = settle_job(spec, "live", tmp_path, settings, f"{staged}in/", f"{staged}out/", "offline")
    job = pickle.loads(pickle.dumps(job))
    task = load_task(job.workload, job.spec, Runtime(Settings(device="cpu")))
    with pytest.raises(InvalidInput) as caught:
        task.prepare({"prompt": "def ", "max_tokens": 400})
    assert f"batching.max_kv_bytes ({budget} bytes)" in str(caught.value)
