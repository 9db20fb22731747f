"""Offline work on the endpoint's own sessions: what both wings agree on.

An offline workload with `runner: {kind: endpoint}` prepares its records in the flow
(the same `prepare` as the local runner) and sends each batch of prepared items to
the serving process, which runs them in its offline lane (interactive requests
first; a generate workload's sequences take free rows and are preempted when
interactive ones need them) through the model alone: the flow applies its own
handler's `post` to what comes back, so each output line is the one the local runner
writes.

Bodies of `POST /internal/v1/batch/{workload}` are frames of arrays
(lanes.batchframe). The route is authenticated with the server's internal key
(LANES_INTERNAL_KEY, else LANES_API_KEY). Light: the spec's rules import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from lanes.digests import MODEL_CONFIGS, TOKENIZER_CONFIG, Digests, model_digests
from lanes.spec import InteractiveWorkload, ModelSpec, OfflineWorkload, TaskName, Workload

INTERNAL_PREFIX = "/internal/"
BATCH_ROUTE = "/internal/v1/batch/{workload}"
CONTENT_TYPE = "application/x-lanes-batch"
PROVIDER_HEADER = "x-lanes-provider"  # the server's execution provider, for the manifest
# The model time the batch's items used in the offline lane, in seconds (each run's or
# step's time split among its items, as lanes_lane_busy_seconds_total splits it): what
# an endpoint run is priced on. Absent from servers older than it.
BUSY_HEADER = "x-lanes-offline-busy-seconds"
# The content digest of the flow's model and tokenizer (`weights_digest`): the server
# refuses a batch whose model is not the one it runs (token ids on other weights, or
# made by another tokenizer, would be answered, wrongly). Absent from flows older than
# it, and where the flow cannot read its model or tokenizer.
WEIGHTS_HEADER = "x-lanes-model-digest"
MODEL_MISMATCH = "model_mismatch"  # the error code of that refusal
ENDPOINT_TASKS: tuple[TaskName, ...] = ("embed", "infer", "generate")


def batch_path(workload: str) -> str:
    return BATCH_ROUTE.format(workload=workload)


def weights_digest(model: ModelSpec, task: TaskName, digests: Digests) -> str | None:
    """One digest of the files that decide a batch's answers, by their content
    (lanes.digests.model_digests): the ONNX model's files (the .onnx, its external data),
    for embed and generate its tokenizer's, which the flow encodes with and the server
    decodes with, and for generate the decoder's config files present beside them. None
    when the model or its tokenizer is not readable here."""
    configs = {f"model/{n}" for n in MODEL_CONFIGS} | {f"tokenizer/{TOKENIZER_CONFIG}"}
    named = []
    for role, digest in model_digests(model, digests).items():
        if role in configs:
            if task != "generate":
                continue
        elif role == "tokenizer" and task == "infer":
            continue
        if digest is None:
            return None
        named.append(f"{role}:{digest.blake2b}")
    return hashlib.sha256("\n".join(named).encode()).hexdigest()


def backfilled(workloads: Mapping[str, Workload]) -> set[str]:
    """The interactive workloads whose sessions run some offline workload's batches
    (those whose runner is the endpoint and whose target resolves)."""
    found = set()
    for name, workload in workloads.items():
        if isinstance(workload, OfflineWorkload) and workload.runner.kind == "endpoint":
            try:
                found.add(served_workload(workloads, name))
            except ValueError:
                continue  # the spec's own check says what is wrong with it
    return found


def served_workload(workloads: Mapping[str, Workload], name: str) -> str:
    """The interactive workload whose sessions run offline workload `name`'s batches
    (`runner.workload`: that workload, or its model's name; none: the one interactive
    workload of the same model and task). ValueError says what is wrong and what to
    declare."""
    offline = workloads[name]
    assert isinstance(offline, OfflineWorkload)
    if offline.task not in ENDPOINT_TASKS:
        raise ValueError(
            f"runner kind endpoint runs {', '.join(ENDPOINT_TASKS)} workloads; a "
            f"{offline.task} workload runs with kind local or dask for now"
        )
    wanted = offline.runner.workload
    target = workloads.get(wanted) if wanted is not None else None
    if isinstance(target, OfflineWorkload):
        raise ValueError(f"{wanted!r} is an offline workload; name an interactive one")
    if isinstance(target, InteractiveWorkload):
        if target.model != offline.model or target.task != offline.task:
            raise ValueError(
                f"{wanted!r} serves model {target.model!r} ({target.task}); this workload "
                f"needs model {offline.model!r} ({offline.task}): name an interactive "
                "workload of the same model and task"
            )
        assert wanted is not None
        return wanted
    if wanted is not None and wanted != offline.model:
        raise ValueError(
            f"expected an interactive workload or this workload's model "
            f"({offline.model!r}), found {wanted!r}"
        )
    fits = sorted(
        n
        for n, w in workloads.items()
        if isinstance(w, InteractiveWorkload)
        and w.model == offline.model
        and w.task == offline.task
    )
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise ValueError(
            f"no interactive {offline.task} workload serves model {offline.model!r}: declare "
            "one (the endpoint runs offline batches on its sessions)"
        )
    raise ValueError(
        f"interactive workloads {', '.join(fits)} all serve model {offline.model!r}: name "
        "one in `runner.workload`"
    )
