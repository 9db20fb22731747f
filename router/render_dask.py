"""The Dask part of `lanes render k8s`: for each offline workload whose
`runner.address` names a host in the cluster (tcp://NAME:PORT), a Dask scheduler
(Deployment and Service) and a Deployment of worker pods, so that a flow run's shards
spread over them. The worker pods mount the spec's ConfigMap as the flow runs' Jobs do
(lanes.router.render_pool's `offline_volumes`), and roll when the spec changes.

Apart from lanes.router.render_pool because only a spec with a Dask runner in the
cluster renders these (`dask.yaml`), and they share nothing with the work pool's
template but the volumes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from lanes.router.render_k8s import (
    GPU,
    K8sOptions,
    Manifest,
    dump,
    labels,
    s3_credentials,
    secret_env,
    uses_gpu,
)
from lanes.router.render_pool import offline_volumes
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec


def dask_objects(
    raw: dict[str, Any],
    spec: Spec,
    settings: Settings,
    options: K8sOptions,
    image: str,
    workers: int,
) -> list[Manifest]:
    """A Dask scheduler (Deployment and Service) and `workers` worker pods for each
    offline workload whose `runner.address` names a host in the cluster
    (tcp://NAME:PORT), so the flow run's shards spread over those pods."""
    found: list[Manifest] = []
    done: set[str] = set()
    for w in spec.workloads.values():
        if not isinstance(w, OfflineWorkload) or w.runner.kind != "dask" or not w.runner.address:
            continue
        scheme, _, rest = w.runner.address.partition("://")
        host, _, port_text = rest.partition(":")
        if scheme != "tcp" or "." in host or host in done:
            continue  # an address outside the cluster, or one already rendered
        done.add(host)
        port = int(port_text or 8786)
        digest = hashlib.sha256(dump(raw).encode()).hexdigest()
        found += _dask_cluster(spec, settings, options, image, host, port, workers, digest)
    return found


def _dask_cluster(
    spec: Spec,
    settings: Settings,
    options: K8sOptions,
    image: str,
    host: str,
    port: int,
    workers: int,
    spec_digest: str,
) -> list[Manifest]:
    ns = options.namespace
    scheduler_sel = {
        "app.kubernetes.io/name": "lanes",
        "app.kubernetes.io/component": "dask-scheduler",
        "app.kubernetes.io/instance": host,
    }
    worker_name = f"{host}-worker"
    worker_sel = {
        "app.kubernetes.io/name": "lanes",
        "app.kubernetes.io/component": "dask-worker",
        "app.kubernetes.io/instance": worker_name,
    }
    prefect_env = [
        secret_env("PREFECT_API_URL", options.prefect_api_secret, "url"),
        {"name": "DO_NOT_TRACK", "value": "1"},
        {"name": "PREFECT_HOME", "value": "/tmp/prefect"},
        {"name": "LANES_HOME", "value": "/tmp/lanes"},
        {"name": "LANES_DEVICE", "value": settings.device},
        {"name": "LANES_THREADS", "value": str(options.offline_cpu)},
        *({"name": k, "value": v} for k, v in settings.shared_env().items()),
        *s3_credentials(options),
    ]
    resources: dict[str, Any] = {
        "requests": {"cpu": str(options.offline_cpu), "memory": options.offline_memory},
        "limits": {"memory": options.offline_memory},
    }
    worker_pod: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "containers": [
            {
                "name": "dask-worker",
                "image": image,
                # One shard at a time per pod: onnxruntime's threads take the cores.
                "args": [
                    "dask",
                    "worker",
                    f"tcp://{host}:{port}",
                    "--nworkers",
                    "1",
                    "--nthreads",
                    "1",
                ],
                "env": prefect_env,
                "workingDir": options.project_dir,
                "resources": resources,
            }
        ],
    }
    if uses_gpu(settings.device):
        resources["limits"][GPU] = 1
        worker_pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    worker_pod["containers"][0]["volumeMounts"], worker_pod["volumes"] = offline_volumes(
        spec, options
    )
    scheduler_meta: dict[str, Any] = {
        "name": host,
        "namespace": ns,
        "labels": labels("dask-scheduler", host),
    }
    worker_meta: dict[str, Any] = {
        "name": worker_name,
        "namespace": ns,
        "labels": labels("dask-worker", worker_name),
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": scheduler_meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": scheduler_sel},
                "template": {
                    "metadata": {"labels": {**scheduler_meta["labels"]}},
                    "spec": {
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                        "containers": [
                            {
                                "name": "dask-scheduler",
                                "image": image,
                                "args": ["dask", "scheduler", "--port", str(port)],
                                "ports": [
                                    {"name": "dask", "containerPort": port, "protocol": "TCP"},
                                    {"name": "dashboard", "containerPort": 8787, "protocol": "TCP"},
                                ],
                                "resources": {
                                    "requests": {"cpu": "500m", "memory": "1Gi"},
                                    "limits": {"memory": "2Gi"},
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": scheduler_meta,
            "spec": {
                "selector": scheduler_sel,
                "ports": [
                    {"name": "dask", "port": port, "targetPort": "dask", "protocol": "TCP"},
                    {
                        "name": "dashboard",
                        "port": 8787,
                        "targetPort": "dashboard",
                        "protocol": "TCP",
                    },
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": worker_meta,
            "spec": {
                "replicas": workers,
                "selector": {"matchLabels": worker_sel},
                "template": {
                    # A changed spec changes the pod template: the workers roll.
                    "metadata": {
                        "labels": {**worker_meta["labels"]},
                        "annotations": {"lanes.dev/spec-sha256": spec_digest},
                    },
                    "spec": worker_pod,
                },
            },
        },
    ]
