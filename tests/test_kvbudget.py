"""The KV-cache budget (lanes/generation/kvbudget.py) in the scheduler, on fabricated
logits: admission by every row's worst case, and the request over the whole budget."""

from __future__ import annotations

import pytest

from lanes.errors import InvalidInput
from lanes.generation.kvbudget import KvBudget
from lanes.generation.reserve import Reserve
from lanes.generation.seq import StepOutputs
from tests.test_scheduler import A, ids, logits, make, seq, step

# One byte per cached position: a sequence's worst case is its prompt + max_new.
BYTE = 1


def test_a_sequence_waits_until_the_rows_worst_cases_leave_it_room() -> None:
    s = make(max_running=4, kv=KvBudget(16, BYTE))
    s.add(seq(0, prompt=3, max_new=2))  # 5 bytes at most
    s.add(seq(1, prompt=3, max_new=5))  # 8
    s.add(seq(2, prompt=3, max_new=5))  # 8: 21 with both, over 16
    s.add(seq(3, prompt=1, max_new=1))  # would fit, but waits its turn behind 2
    plan, _ = step(s)
    assert ids(plan.prefill) == [0, 1], "rows are free, the budget is not"
    assert s.kv_reserved == 13 and s.num_waiting == 2
    plan, events = step(s)  # seq 0 reaches its budget of 2 tokens
    assert {e.seq_id for e in events if e.finish} == {0}
    plan, _ = step(s)
    assert ids(plan.prefill) == [2], "its row's worst case freed: 8 + 8 fits 16"
    assert s.kv_reserved == 16 and s.num_waiting == 1


def test_the_worst_case_stops_at_the_context() -> None:
    s = make(max_running=4, max_position=6, kv=KvBudget(12, BYTE, max_position=6))
    for i in range(3):
        s.add(seq(i, prompt=3, max_new=100))  # 6 each: the context, not 103
    plan, _ = step(s)
    assert ids(plan.prefill) == [0, 1] and s.kv_reserved == 12


def test_one_sequence_alone_always_runs() -> None:
    """The edge refuses what can never fit (`KvBudget.check`); a sequence that reaches
    the scheduler anyway runs alone rather than waiting for ever."""
    s = make(kv=KvBudget(4, BYTE))
    s.add(seq(0, prompt=3, max_new=5))
    s.add(seq(1, prompt=1, max_new=1))
    plan, _ = step(s)
    assert ids(plan.prefill) == [0] and s.num_waiting == 1


def test_without_a_budget_every_free_row_is_taken_and_the_worst_cases_still_counted() -> None:
    s = make(max_running=3, kv=KvBudget(None, BYTE))
    for i in range(4):
        s.add(seq(i, prompt=3, max_new=5))
    plan, _ = step(s)
    assert ids(plan.prefill) == [0, 1, 2] and s.kv_reserved == 24


def test_an_interactive_arrival_preempts_offline_rows_until_it_fits() -> None:
    s = make(max_running=4, reserve=Reserve(share=0), kv=KvBudget(24, BYTE))
    s.offline_rides = True
    for i in range(3):
        s.add(seq(10 + i, offline=True))  # 11 bytes each: two fit
    plan, _ = step(s)
    assert ids(plan.prefill) == [10, 11] and s.num_offline_waiting == 1
    s.add(seq(1))
    plan = s.schedule()
    assert ids(plan.preempted) == [11], "a row is free, the budget is not: the newest goes"
    assert ids(plan.prefill) == [1] and s.kv_reserved == 22


def test_an_arrival_preempts_nobody_when_the_interactive_rows_leave_it_no_room() -> None:
    s = make(max_running=4, reserve=Reserve(share=0), kv=KvBudget(20, BYTE))
    s.offline_rides = True
    s.add(seq(10, offline=True))  # 11 bytes
    step(s)
    s.add(seq(1))  # 11: 22 with seq 10, over 20
    plan = s.schedule()
    assert ids(plan.preempted) == [10] and ids(plan.prefill) == [1]
    s.update(plan, StepOutputs(prefill=logits(A)))
    s.add(seq(2, max_new=12))  # 15: 26 with seq 1 alone, whatever offline rows leave
    s.add(seq(11, offline=True, prompt=1, max_new=1))
    plan = s.schedule()
    assert not plan.preempted and not plan.prefill, "preempting would not make it fit"
    assert s.kv_reserved == 11


def test_a_request_over_the_whole_budget_is_refused_naming_max_tokens() -> None:
    budget = KvBudget(1000, 10, max_position=512)
    budget.check(50, 50)  # 1000 bytes: fits exactly
    with pytest.raises(InvalidInput) as caught:
        budget.check(50, 51)
    assert caught.value.param == "max_tokens"
    assert "batching.max_kv_bytes (1000 bytes)" in str(caught.value)
    KvBudget(None, 10).check(10**6, 10**6)  # no budget: nothing refused
