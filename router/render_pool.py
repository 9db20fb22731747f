"""The offline half of `lanes render k8s`: a Prefect Kubernetes work pool's base job
template (each flow run a Job of the worker image, one GPU on cuda, the serving
group's Service as LANES_ENDPOINT for an endpoint runner without a url) and the Prefect
worker that polls the pool, with the service account and role it needs to make Jobs.

The flow runs' Jobs and the Dask worker pods (lanes.router.render_dask) load the spec
as it was rendered: the whole document, the overrides of where `lanes render k8s` ran
merged in (lanes.specfile's `read_document`), in a ConfigMap (`offline_spec`) mounted
over the image's copy, as each serving group's pods load theirs. Without it they would
load the image's workloads.yaml and miss every `LANES_WORKLOADS__...` given at render
time.

The template has the shape of prefect-kubernetes' own (a `job_configuration` whose
`{{ placeholders }}` Prefect fills from `variables`, a JSON schema with defaults), so
`prefect work-pool create POOL --type kubernetes --base-job-template FILE` takes it.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from lanes.backfill import served_workload
from lanes.errors import InvalidInput
from lanes.router.render_k8s import (
    GPU,
    K8sOptions,
    Manifest,
    dump,
    groups,
    labels,
    models_volume,
    s3_credentials,
    secret_env,
    uses_gpu,
)
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec

JOB_CONTAINER = "prefect-job"
# The ConfigMap of the whole spec, for the Jobs and the Dask workers. Serving groups'
# are named lanes-GROUP: a group would need to be called offline-spec to meet it.
OFFLINE_SPEC = "lanes-offline-spec"
SPEC_KEY = "workloads.yaml"  # the ConfigMap's key


def offline_spec(raw: dict[str, Any], namespace: str) -> Manifest:
    """The ConfigMap holding the spec every offline pod in `namespace` loads: `raw`, the
    whole document with the render's overrides merged (an offline workload may run an
    interactive one's model, and the Batch API's flow runs run interactive workloads
    in the offline lane). A Job mounts it from its own namespace: one per namespace
    that Jobs run in (K8sOptions.all_job_namespaces)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": OFFLINE_SPEC,
            "namespace": namespace,
            "labels": labels("offline", "spec"),
        },
        "data": {SPEC_KEY: dump(raw)},
    }


def spec_volume(options: K8sOptions) -> tuple[Manifest, Manifest]:
    """The mount of `offline_spec` over the image's spec (options.spec_file in
    options.project_dir, where the deployments' `spec` parameter names it), and its
    volume."""
    mount = {"name": "spec", "mountPath": options.spec_path, "subPath": SPEC_KEY, "readOnly": True}
    return mount, {"name": "spec", "configMap": {"name": OFFLINE_SPEC}}


def offline_volumes(spec: Spec, options: K8sOptions) -> tuple[list[Manifest], list[Manifest]]:
    """The volume mounts and volumes of every offline pod: the spec, the models claim."""
    mount, volume = spec_volume(options)
    mounts, volumes = [mount], [volume]
    if options.models_claim:
        mount, volume = models_volume(spec, options)
        mounts.append(mount)
        volumes.append(volume)
    return mounts, volumes


def uses_endpoint(spec: Spec) -> bool:
    """Whether an offline workload runs its shards on the serving endpoint."""
    return any(
        isinstance(w, OfflineWorkload) and w.runner.kind == "endpoint"
        for w in spec.workloads.values()
    )


def endpoint_env(spec: Spec, options: K8sOptions) -> dict[str, str]:
    """LANES_ENDPOINT for the flow runs: the Service of the group that serves the
    endpoint-runner workloads without a `runner.url` (their default is LANES_ENDPOINT,
    whose own default, 127.0.0.1, is no endpoint inside a Job's pod). Empty when there
    are none; InvalidInput when they run on several groups, which one variable of the
    pool's cannot point at."""
    group_of = {name: group for group in groups(spec) for name in group.workloads}
    by_url: dict[str, list[str]] = {}
    for name, w in spec.workloads.items():
        if isinstance(w, OfflineWorkload) and w.runner.kind == "endpoint" and not w.runner.url:
            group = group_of[served_workload(spec.workloads, name)]
            by_url.setdefault(group.service_url(options.namespace), []).append(name)
    if len(by_url) > 1:
        each = "; ".join(
            f"{name}: {url}" for url, names in sorted(by_url.items()) for name in names
        )
        raise InvalidInput(
            "runner.url: the flow runs of one work pool share one LANES_ENDPOINT, but "
            "these endpoint-runner workloads run on the endpoints of different groups; "
            f"set each one's runner.url ({each})"
        )
    if not by_url:
        return {}
    (url,) = by_url
    return {"LANES_ENDPOINT": url}


def _variable(kind: str, default: Any, description: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind, "description": description}
    if default is not None:
        schema["default"] = default
    return schema


def base_job_template(
    spec: Spec, settings: Settings, options: K8sOptions, image: str
) -> dict[str, Any]:
    """The work pool's base job template for the spec's offline workloads."""
    gpu = uses_gpu(settings.device)
    env = {
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": "/tmp/prefect",
        "LANES_HOME": "/tmp/lanes",
        "LANES_DEVICE": settings.device,
        # onnxruntime would size its pool by the node's cores, not the pod's share.
        "LANES_THREADS": str(options.offline_cpu),
        **settings.shared_env(),
        **endpoint_env(spec, options),
    }
    resources: dict[str, Any] = {
        "requests": {"cpu": str(options.offline_cpu), "memory": options.offline_memory},
        "limits": {"memory": options.offline_memory},
    }
    if gpu:
        resources["limits"][GPU] = 1
    container: dict[str, Any] = {
        "name": JOB_CONTAINER,
        "image": "{{ image }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        "args": "{{ command }}",
        "env": "{{ env }}",
        "workingDir": options.project_dir,
        "resources": resources,
    }
    # Secrets need a list here: Prefect's worker puts the pool's `env` before it. A runner
    # of kind endpoint sends the server's internal key, which the serving pods take from
    # the API key's Secret (LANES_API_KEY; the internal key defaults to it).
    secrets = s3_credentials(options)
    if uses_endpoint(spec):
        secrets.append(secret_env("LANES_INTERNAL_KEY", options.api_key_secret, "api-key"))
    if secrets:
        container["env"] = secrets
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": "{{ service_account_name }}",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "containers": [container],
    }
    if gpu:
        pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    container["volumeMounts"], pod["volumes"] = offline_volumes(spec, options)
    job_manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "generateName": "{{ name }}-",
            "namespace": "{{ namespace }}",
            "labels": "{{ labels }}",
        },
        "spec": {
            # Prefect retries shards itself; a failed pod is a failed flow run.
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
            "template": {"spec": pod},
        },
    }
    variables = {
        "name": _variable("string", None, "Name given to infrastructure created by a worker."),
        # Prefect checks a deployment's job variables against this schema when it is
        # deployed and run: a namespace without the spec's ConfigMap and the worker's
        # rights is refused there, not left to a Job that never starts.
        "namespace": {
            **_variable("string", options.namespace, "The Kubernetes namespace of the Jobs."),
            "enum": list(options.all_job_namespaces),
        },
        "image": _variable("string", image, "The image each flow run's Job runs."),
        "image_pull_policy": {
            **_variable("string", "IfNotPresent", "When the kubelet pulls the image."),
            "enum": ["IfNotPresent", "Always", "Never"],
        },
        "service_account_name": _variable(
            "string", "default", "The Jobs' service account (S3 access, e.g. IRSA)."
        ),
        "finished_job_ttl": _variable("integer", 3600, "Seconds a finished Job is kept."),
        "job_watch_timeout_seconds": _variable(
            "integer", None, "How long the worker watches a Job (none: no limit)."
        ),
        "pod_watch_timeout_seconds": _variable(
            "integer", 600, "How long the worker waits for the pod to start (image pull, GPU node)."
        ),
        "stream_output": _variable("boolean", True, "Copy the Job's output to the worker's log."),
        "env": {
            **_variable("object", env, "Environment of the flow run."),
            "additionalProperties": {"type": ["string", "null"]},
        },
        "labels": {
            **_variable("object", labels("offline", "flow-run"), "Labels of the Jobs."),
            "additionalProperties": {"type": "string"},
        },
        "command": _variable("string", None, "The command (default: Prefect's flow-run command)."),
        "cluster_config": _variable("object", None, "A cluster config block (none: in-cluster)."),
    }
    return {
        "job_configuration": {
            "command": "{{ command }}",
            "env": "{{ env }}",
            "labels": "{{ labels }}",
            "name": "{{ name }}",
            "namespace": "{{ namespace }}",
            "job_manifest": job_manifest,
            "cluster_config": "{{ cluster_config }}",
            "job_watch_timeout_seconds": "{{ job_watch_timeout_seconds }}",
            "pod_watch_timeout_seconds": "{{ pod_watch_timeout_seconds }}",
            "stream_output": "{{ stream_output }}",
        },
        "variables": {"type": "object", "properties": variables},
    }


WORKER = "prefect-worker"
# What the worker does with its Jobs and their pods, in each namespace they run in.
_WORKER_RULES = [
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["pods", "pods/log", "pods/status", "events"],
        "verbs": ["get", "list", "watch"],
    },
]


def _worker_access(settings: Settings, options: K8sOptions, namespace: str) -> list[Manifest]:
    """A Role in `namespace` and its binding to the worker's ServiceAccount (which lives
    in options.namespace): the rights to make and watch Jobs there."""
    meta = {"name": WORKER, "namespace": namespace, "labels": labels(WORKER, settings.work_pool)}
    account = {"kind": "ServiceAccount", "name": WORKER, "namespace": options.namespace}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": _WORKER_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "subjects": [account],
            "roleRef": {"kind": "Role", "name": WORKER, "apiGroup": "rbac.authorization.k8s.io"},
        },
    ]


def job_namespace_objects(
    raw: dict[str, Any], settings: Settings, options: K8sOptions
) -> list[Manifest]:
    """For each of options.job_namespaces (besides the worker's own): the spec's
    ConfigMap and the worker's rights there."""
    found: list[Manifest] = []
    for ns in options.all_job_namespaces[1:]:
        found += [offline_spec(raw, ns), *_worker_access(settings, options, ns)]
    return found


def worker_objects(settings: Settings, options: K8sOptions, image: str) -> list[Manifest]:
    """The Prefect worker that polls the pool and makes one Job per flow run."""
    name, ns = WORKER, options.namespace
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "labels": labels("prefect-worker", settings.work_pool),
    }
    selector = {"app.kubernetes.io/name": "lanes", "app.kubernetes.io/component": "prefect-worker"}
    container = {
        "name": "worker",
        "image": image,
        "args": [
            "prefect",
            "worker",
            "start",
            "--pool",
            settings.work_pool,
            "--type",
            "kubernetes",
        ],
        "env": [
            secret_env("PREFECT_API_URL", options.prefect_api_secret, "url"),
            {"name": "DO_NOT_TRACK", "value": "1"},
            {"name": "PREFECT_SERVER_ANALYTICS_ENABLED", "value": "false"},
            {"name": "PREFECT_HOME", "value": "/tmp/prefect"},
        ],
        "workingDir": str(PurePosixPath(options.project_dir)),
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False},
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        *_worker_access(settings, options, ns),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                # One poller per pool: two would only race for the same flow runs.
                "replicas": 1,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": {**meta["labels"]}},
                    "spec": {
                        "serviceAccountName": name,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                        "containers": [container],
                    },
                },
            },
        },
    ]
