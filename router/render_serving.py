"""The serving half of `lanes render k8s`: per `deploy.group` of interactive workloads,
a Deployment of `lanes serve` (startup probe on /readyz while the models load, readiness
/readyz, liveness /healthz, a grace period longer than the drain, one nvidia.com/gpu on
cuda), a Service, a ConfigMap holding the group's own spec (mounted over the image's
/app/workloads.yaml), a PodDisruptionBudget, a KEDA ScaledObject whose Prometheus
triggers read the server's own queue gauges, and a ServiceMonitor. The API key comes
from a Secret the renderer never sees.

Apart from lanes.router.render_k8s, which holds what the offline objects use too.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from lanes.backfill import served_workload
from lanes.quantity import whole_cores
from lanes.router.render_k8s import (
    APP,
    GPU,
    SERVICE_PORT,
    Group,
    K8sOptions,
    Manifest,
    dump,
    labels,
    models_volume,
    s3_credentials,
    secret_env,
    uses_gpu,
)
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload, OfflineWorkload, Spec

HTTP_PORT = 8000
# uvicorn's timeout_graceful_shutdown in lanes.serving.server: after the drain, queued
# and running requests get this long to finish.
SHUTDOWN_S = 30
# Seconds of grace beyond drain + shutdown, so Kubernetes never SIGKILLs a clean exit.
GRACE_MARGIN_S = 15
# The startup probe gives the models this long to load before the pod is restarted.
MODEL_LOAD_S = 600
PROBE_PERIOD_S = 5


def group_spec(raw: dict[str, Any], spec: Spec, group: Group) -> dict[str, Any]:
    """The spec a group's pods load: its workloads, the offline workloads whose batches
    run on their sessions (`runner: {kind: endpoint}`: the server then runs those at
    idle priority beside the interactive ones, as `lanes serve` does with the whole
    spec), and the models they name, as written."""
    names = [*group.workloads, *_runs_on(spec, group)]
    used = {spec.workloads[name].model for name in names}
    models = {name: model for name, model in raw["models"].items() if name in used}
    workloads = {name: raw["workloads"][name] for name in names}
    return {"version": raw.get("version", 1), "models": models, "workloads": workloads}


def _runs_on(spec: Spec, group: Group) -> list[str]:
    """The offline workloads whose batches run on the group's sessions."""
    found = []
    for name, workload in spec.workloads.items():
        if isinstance(workload, OfflineWorkload) and workload.runner.kind == "endpoint":
            with contextlib.suppress(ValueError):  # the spec's own check says why
                if served_workload(spec.workloads, name) in group.workloads:
                    found.append(name)
    return found


def device_of(group: Group, settings: Settings) -> str:
    return group.deploy.device or settings.device


def serving_objects(
    raw: dict[str, Any], spec: Spec, settings: Settings, options: K8sOptions, group: Group
) -> list[Manifest]:
    """The objects of one group, in the order `kubectl apply` should see them."""
    name, ns = group.app_name, options.namespace
    meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels("serve", group.name)}
    selector = {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/component": "serve",
        "app.kubernetes.io/instance": group.name,
    }
    spec_text = dump(group_spec(raw, spec, group))
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {"workloads.yaml": spec_text},
    }
    return [
        config,
        _deployment(spec, settings, options, group, meta, selector, spec_text),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": selector,
                "ports": [
                    {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            # A voluntary eviction (a node drain) takes one pod at a time.
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        },
        _scaled_object(spec, options, group, meta),
        _service_monitor(options, meta, selector),
    ]


def _deployment(
    spec: Spec,
    settings: Settings,
    options: K8sOptions,
    group: Group,
    meta: dict[str, Any],
    selector: dict[str, str],
    spec_text: str,
) -> Manifest:
    device = device_of(group, settings)
    spec_path = options.spec_path
    env: list[dict[str, Any]] = [
        {"name": "LANES_HOST", "value": "0.0.0.0"},
        {"name": "LANES_PORT", "value": str(HTTP_PORT)},
        {"name": "LANES_HOME", "value": "/tmp/lanes"},
        {"name": "LANES_DEVICE", "value": device},
        *_threads(group.deploy.cpu),
        {"name": "LANES_DRAIN_S", "value": f"{options.drain_s:g}"},
        *({"name": k, "value": v} for k, v in settings.shared_env().items()),
        secret_env("LANES_API_KEY", options.api_key_secret, "api-key"),
        # The Batch API starts each batch as a flow run on this Prefect API; optional, so
        # a cluster without Prefect still serves (its /v1/batches says what is missing).
        secret_env("PREFECT_API_URL", options.prefect_api_secret, "url", optional=True),
        *s3_credentials(options),
    ]
    resources: dict[str, dict[str, Any]] = {
        "requests": {"cpu": group.deploy.cpu, "memory": group.deploy.memory},
        "limits": {"cpu": group.deploy.cpu, "memory": group.deploy.memory},
    }
    if uses_gpu(device):
        resources["limits"][GPU] = 1
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": spec_path, "subPath": "workloads.yaml", "readOnly": True},
        # The root file system is read-only: LANES_HOME and temporary files live here.
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": group.app_name}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if options.models_claim:
        mount, volume = models_volume(spec, options)
        mounts.append(mount)
        volumes.append(volume)
    container: dict[str, Any] = {
        "name": "serve",
        "image": options.image,
        "args": ["serve", spec_path],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "startupProbe": _probe("/readyz", MODEL_LOAD_S // PROBE_PERIOD_S),
        "readinessProbe": _probe("/readyz", 2),
        "livenessProbe": _probe("/healthz", 3),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod: dict[str, Any] = {
        # SIGTERM starts the drain (readiness 503, still answering), then uvicorn's
        # graceful shutdown; Kubernetes must not SIGKILL before both are done.
        "terminationGracePeriodSeconds": int(options.drain_s) + SHUTDOWN_S + GRACE_MARGIN_S,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "containers": [container],
        "volumes": volumes,
    }
    if uses_gpu(device):
        pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    digest = hashlib.sha256(spec_text.encode()).hexdigest()
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            # KEDA owns the count; this is the count before its first decision.
            "replicas": max(group.deploy.min_replicas, 1),
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                # A changed spec changes the pod template: the Deployment rolls.
                "metadata": {
                    "labels": {**meta["labels"]},
                    "annotations": {"lanes.dev/spec-sha256": digest},
                },
                "spec": pod,
            },
        },
    }


def _threads(cpu: str) -> list[dict[str, str]]:
    """LANES_THREADS: the whole cores of the pod's CPU quota (lanes.quantity), since
    onnxruntime would otherwise size its pool by the node's cores."""
    return [{"name": "LANES_THREADS", "value": str(whole_cores(cpu))}]


def _probe(path: str, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _scaled_object(spec: Spec, options: K8sOptions, group: Group, meta: dict[str, Any]) -> Manifest:
    """One Prometheus trigger per workload (KEDA scales to the highest): the requests
    waiting, and for generate the sequences in flight too, per pod (AverageValue)."""
    triggers = []
    for name in group.workloads:
        workload = spec.workloads[name]
        assert isinstance(workload, InteractiveWorkload)
        where = f'namespace="{options.namespace}",service="{group.app_name}",workload="{name}"'
        query = f"sum(lanes_queue_depth{{{where}}})"
        if workload.task == "generate":
            query += f" + sum(lanes_sequences_in_flight{{{where}}})"
        target = workload.deploy.target_queue_depth or workload.batching.max_batch_size
        triggers.append(
            {
                "type": "prometheus",
                "name": name,
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": options.prometheus,
                    "query": query,
                    "threshold": str(target),
                    # From zero, the first waiting request wakes the group.
                    "activationThreshold": "0",
                    "ignoreNullValues": "true",
                },
            }
        )
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]},
            "minReplicaCount": group.deploy.min_replicas,
            "maxReplicaCount": group.deploy.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": triggers,
        },
    }


def _service_monitor(
    options: K8sOptions, meta: dict[str, Any], selector: dict[str, str]
) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "namespaceSelector": {"matchNames": [options.namespace]},
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": "15s",
                    # /metrics takes the API key like every route but the health checks.
                    "authorization": {
                        "type": "Bearer",
                        "credentials": {"name": options.api_key_secret, "key": "api-key"},
                    },
                }
            ],
        },
    }
