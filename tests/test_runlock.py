"""One run at a time per output folder (lanes.runlock), on a real Prefect API: a second
run of a workload whose run is still going refuses, naming it, instead of redoing every
shard that run has not committed yet."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from lanes.errors import OutputBusy
from lanes.flows.batch import offline
from tests.flows_fixtures import outputs_of, write_jsonl, write_spec
from tests.gates import HELD, WAIT_S


def test_a_second_run_of_an_output_being_written_is_refused_naming_the_first(
    prefect_api: str, tmp_path: Path
) -> None:
    held = {"mode": "offline", "task": "infer", "model": "affine", "handler": "tests.gates:held"}
    spec = write_spec(tmp_path, {"held": {**held, "input": "in/", "output": "out/", "retries": 0}})
    for shard in range(2):
        records = [{"id": f"{shard}-{i}", "x": [[i, 0, 0, 0]]} for i in range(3)]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", records)
    first: dict[str, Any] = {}
    second: list[Exception] = []

    def run_second() -> None:
        try:
            offline(workload="held", spec=str(spec))
        except Exception as err:
            second.append(err)

    running = threading.Thread(
        target=lambda: first.update(offline(workload="held", spec=str(spec)))
    )
    refusing = threading.Thread(target=run_second)
    HELD.close()
    try:
        running.start()  # it holds the output while its model waits at the gate
        HELD.wait_held()
        # Without the lock, the second would wait for the gate too, and redo both shards.
        refusing.start()
        refusing.join(WAIT_S)
        assert second, "the second run did not refuse while the first was running"
    finally:
        HELD.open()
        for thread in (running, refusing):
            if thread.is_alive():
                thread.join(WAIT_S)

    out = tmp_path / "out"
    assert first["shards_run"] == 2, first
    manifests = list((out / "_manifests").iterdir())
    assert len(manifests) == 1, "the refused run wrote no manifest"
    first_run = json.loads(manifests[0].read_text())["flow_run"]
    (refused,) = second
    assert isinstance(refused, OutputBusy), refused
    message = str(refused)
    assert f"{out} is being written by another run (flow run " in message
    assert f"({first_run}) on host " in message and "wrote nothing" in message
    seen = Counter(line["id"] for line in outputs_of(out))
    assert set(seen.values()) == {1} and len(seen) == 6

    # Released when the first ended: the next run goes, and redoes nothing.
    again = offline(workload="held", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"]) == (0, 2)
