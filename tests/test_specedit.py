"""Setting numbers in a workloads.yaml by text edits: every other byte stays."""

from __future__ import annotations

import pytest
import yaml

from lanes.specedit import SpecEditError, set_scalars

SIZE = ("workloads", "search", "batching", "max_batch_size")
WAIT = ("workloads", "search", "batching", "max_wait_ms")

COMMENTED = """\
# The demo workloads.
version: 1

workloads:
  search:            # someone waits
    mode: interactive
    batching: {max_batch_size: 32, max_wait_ms: 0}   # rows, ms
    slo: {p99_ms: 50}

  other:
    mode: interactive
    batching: {max_batch_size: 32, max_wait_ms: 0}
"""


def test_values_that_are_there_are_replaced_where_they_stand() -> None:
    edited = set_scalars(COMMENTED, {SIZE: 8, WAIT: 2.5})
    assert edited == COMMENTED.replace(
        "{max_batch_size: 32, max_wait_ms: 0}   # rows",
        "{max_batch_size: 8, max_wait_ms: 2.5}   # rows",
    )
    # A whole float is written as the integer it is.
    assert "max_wait_ms: 2}" in set_scalars(COMMENTED, {WAIT: 2.0})


def test_a_missing_key_joins_its_block_mapping_at_its_indentation() -> None:
    text = """\
workloads:
  search:
    batching:
      max_batch_size: 4   # rows
    slo: {p99_ms: 5}
"""
    edited = set_scalars(text, {SIZE: 16, WAIT: 1.0})
    assert edited == text.replace(
        "      max_batch_size: 4   # rows\n",
        "      max_batch_size: 16   # rows\n      max_wait_ms: 1\n",
    )


def test_a_missing_mapping_is_written_as_one_flow_mapping() -> None:
    block = "workloads:\n  search:\n    mode: interactive  # last\n  other: {mode: offline}\n"
    edited = set_scalars(block, {SIZE: 8, WAIT: 0.5})
    assert edited == block.replace(
        "# last\n", "# last\n    batching: {max_batch_size: 8, max_wait_ms: 0.5}\n"
    )
    flow = "workloads:\n  search: {mode: interactive}"  # and no newline at the end
    assert set_scalars(flow, {SIZE: 8}) == (
        "workloads:\n  search: {mode: interactive, batching: {max_batch_size: 8}}"
    )
    empty = "workloads:\n  search:\n    batching: {}\n"
    assert set_scalars(empty, {SIZE: 8}) == empty.replace("{}", "{max_batch_size: 8}")
    unended = "workloads:\n  search:\n    mode: interactive"
    assert set_scalars(unended, {SIZE: 8}) == unended + "\n    batching: {max_batch_size: 8}"


def test_windows_line_ends_stay_windows_line_ends() -> None:
    text = "workloads:\r\n  search:\r\n    batching:\r\n      max_batch_size: 4\r\n"
    edited = set_scalars(text, {WAIT: 3.0})
    assert edited == text + "      max_wait_ms: 3\r\n"


def test_what_an_anchor_shares_or_a_merge_may_give_is_refused() -> None:
    shared = """\
defaults: &batching {max_batch_size: 4}
workloads:
  search:
    batching: *batching
"""
    with pytest.raises(SpecEditError, match=r"workloads\.search\.batching: an anchor"):
        set_scalars(shared, {SIZE: 8})
    anchored_here = """\
workloads:
  search:
    batching: &b {max_batch_size: 4}
  other:
    batching: *b
"""
    with pytest.raises(SpecEditError, match="an anchor"):
        set_scalars(anchored_here, {SIZE: 8})
    merged = """\
base: &base {batching: {max_batch_size: 4}}
workloads:
  search:
    <<: *base
    mode: interactive
"""
    with pytest.raises(SpecEditError, match=r"workloads\.search\.batching: .* merge"):
        set_scalars(merged, {SIZE: 8})


def test_a_path_through_a_value_or_a_block_scalar_is_refused() -> None:
    with pytest.raises(SpecEditError, match=r"workloads\.search: not a mapping"):
        set_scalars("workloads:\n  search: 3\n", {SIZE: 8})
    block = "workloads:\n  search:\n    batching:\n      max_batch_size: |\n        4\n"
    with pytest.raises(SpecEditError, match="not a plain value"):
        set_scalars(block, {SIZE: 8})


def test_every_edit_loads_back_with_only_the_new_values() -> None:
    edited = set_scalars(COMMENTED, {SIZE: 64, WAIT: 1.5})
    data = yaml.safe_load(edited)
    assert data["workloads"]["search"]["batching"] == {"max_batch_size": 64, "max_wait_ms": 1.5}
    assert data["workloads"]["other"] == yaml.safe_load(COMMENTED)["workloads"]["other"]
