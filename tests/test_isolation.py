"""Halving a failed batch until the items it fails on are found (lanes/isolation.py),
with runs that fail on some items as a model does: whole, whatever the rest is."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lanes.errors import InvalidInput, ModelError
from lanes.isolation import Failed, failed_alone, isolate, per_item


class Picky:
    """Doubles numbers in one run; a run holding one of `bad` fails whole."""

    def __init__(self, *bad: int) -> None:
        self.bad = set(bad)
        self.runs: list[list[int]] = []

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.runs.append(list(items))
        found = self.bad.intersection(items)
        if found:
            raise ValueError(f"cannot take {sorted(found)}")
        return [2 * i for i in items]


def test_a_run_that_succeeds_runs_once() -> None:
    run = Picky()
    isolated = isolate(run, [1, 2, 3])
    assert isolated.whole and not isolated.failed and isolated.error is None
    assert per_item(isolated, 3) == [2, 4, 6] and run.runs == [[1, 2, 3]]


def test_the_items_a_run_fails_on_fail_alone_and_the_rest_get_their_outputs() -> None:
    run = Picky(3, 6)
    items = list(range(8))
    isolated = isolate(run, items)
    assert not isolated.whole and not isolated.all_failed
    assert isinstance(isolated.error, ValueError)
    found = per_item(isolated, len(items))
    assert [o.index for o in found if isinstance(o, Failed)] == [3, 6]
    assert [o for o in found if not isinstance(o, Failed)] == [0, 2, 4, 8, 10, 14]
    assert "cannot take [3]" in str(found[3].error)  # type: ignore[union-attr]
    # Each half is run on its own, down to the culprits: never the whole twice.
    assert run.runs.count(items) == 1 and [3] in run.runs and [6] in run.runs


def test_a_failure_the_caller_already_had_starts_with_the_halves() -> None:
    run = Picky(1)
    isolated = isolate(run, [0, 1], ValueError("the whole run failed"))
    assert run.runs == [[0], [1]] and str(isolated.error) == "the whole run failed"
    assert [o.index for o in isolated.failed] == [1]


def test_every_item_failing_alone_is_the_models_fault() -> None:
    isolated = isolate(Picky(0, 1, 2), [0, 1, 2])
    assert isolated.all_failed and len(isolated.failed) == 3
    assert not isolate(Picky(), []).all_failed


def test_per_item_checks_each_run_returns_one_output_per_item() -> None:
    isolated = isolate(lambda items: [0], [1, 2])
    with pytest.raises(ModelError, match="a run of 2 items returned 1 outputs"):
        per_item(isolated, 2)


def test_the_error_an_item_gets_says_not_to_resend_it_as_it_is() -> None:
    raised = ValueError("index 9 out of bounds")
    alone = failed_alone(raised)
    assert isinstance(alone, ModelError) and alone.status == 500 and alone.repeats
    assert "this input, run on its own (ValueError: index 9 out of bounds)" in str(alone)
    assert "resending it as it is will not help" in str(alone)
    every = failed_alone(raised, "this record", every=True)
    assert "every other input of its batch" in str(every) and "the model" in str(every)
    refused = InvalidInput.field("input", "expected text")
    assert failed_alone(refused) is refused  # an error raised on purpose stays as it is
