"""A job's status: its flow run's Prefect state, as `Job.status()` reports it.

A run's state type is its status (SCHEDULED, RUNNING, COMPLETED, FAILED, ...), save
for three that the flow or `Job.expire` mark, and runs cancelled before they started:

    Completed named WITH_ERRORS_STATE (flows.outcome)   COMPLETED_WITH_ERRORS
    Completed named EXPIRED_STATE (flows.outcome)       EXPIRED
    Cancelled, the run tagged EXPIRED_TAG (Job.expire)  EXPIRED
    Cancelling, never started                           CANCELLED (EXPIRED if tagged)

A run a worker had taken (PENDING: its process starting) when it was cancelled is
CANCELLING. Prefect refuses such a run RUNNING from then on, so its engine exits
without running the flow; but only a worker with cancellation on (off by default in
Prefect 3) would mark it CANCELLED, so it would read CANCELLING, and its batch
`cancelling`, forever. It has ended: nothing of it ran and nothing will.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

# A Batch API batch whose completion window passed: its run was cancelled (`expire`)
# and tagged EXPIRED_TAG, so it reads as expired, not as cancelled by someone; or the
# run itself ended with shards not started past the window (EXPIRED_STATE).
EXPIRED = "EXPIRED"
EXPIRED_TAG = "lanes-expired"
FAILED_STATES = frozenset({"FAILED", "CRASHED", "CANCELLED", "CANCELLING", EXPIRED})
# The name of the Completed state a run ends in when some records were rejected
# (flows.outcome sets it), and the status a Job reports for it.
WITH_ERRORS_STATE = "CompletedWithErrors"
# The name of the Completed state a run ends in when shards did not start past its
# `finish_by` (flows.outcome): it reads EXPIRED, as a batch expired by `expire` does.
EXPIRED_STATE = "Expired"
COMPLETED_WITH_ERRORS = "COMPLETED_WITH_ERRORS"
FINISHED = frozenset({"COMPLETED", COMPLETED_WITH_ERRORS})


def status_of(run: FlowRun) -> str:
    """The status a Job reports for `run` (the module docstring); UNKNOWN without a state."""
    if run.state is None:
        return "UNKNOWN"
    cancelled = run.state.type.value == "CANCELLED" or (
        run.state.type.value == "CANCELLING" and run.start_time is None
    )
    if cancelled:
        return EXPIRED if EXPIRED_TAG in run.tags else "CANCELLED"
    if run.state.type.value == "COMPLETED" and run.state.name == WITH_ERRORS_STATE:
        return COMPLETED_WITH_ERRORS
    if run.state.type.value == "COMPLETED" and run.state.name == EXPIRED_STATE:
        return EXPIRED
    return run.state.type.value
