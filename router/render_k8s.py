"""`lanes render k8s`: Kubernetes objects from workloads.yaml, the same bytes for the same
spec and options.

Interactive workloads, per `deploy.group`: a Deployment of `lanes serve` (startup probe
on /readyz while the models load, readiness /readyz, liveness /healthz, a grace period
longer than the drain, one nvidia.com/gpu on cuda), a Service, a ConfigMap holding the
group's own spec (mounted over the image's /app/workloads.yaml), a PodDisruptionBudget,
a KEDA ScaledObject whose Prometheus triggers read the server's own queue gauges, and a
ServiceMonitor. The API key comes from a Secret the renderer never sees.

Offline workloads: lanes.router.render_pool (the Prefect work pool and its worker) and
lanes.router.render_dask (a Dask runner's scheduler and workers in the cluster).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from lanes.backfill import served_workload
from lanes.errors import InvalidInput
from lanes.quantity import whole_cores
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload, OfflineWorkload, Spec
from lanes.specinteractive import PER_WORKLOAD_DEPLOY_KEYS, Deploy

Manifest = dict[str, Any]
APP = "lanes"
GPU = "nvidia.com/gpu"
HTTP_PORT = 8000
SERVICE_PORT = 80  # a group's Service, in front of HTTP_PORT
# uvicorn's timeout_graceful_shutdown in lanes.serving.server: after the drain, queued
# and running requests get this long to finish.
SHUTDOWN_S = 30
# Seconds of grace beyond drain + shutdown, so Kubernetes never SIGKILLs a clean exit.
GRACE_MARGIN_S = 15
# The startup probe gives the models this long to load before the pod is restarted.
MODEL_LOAD_S = 600
PROBE_PERIOD_S = 5
MAX_DRAIN_S = 3600
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# What Kubernetes takes as the name of a Secret or a PersistentVolumeClaim (at most 253).
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class K8sOptions:
    """What the spec does not say about the cluster."""

    image: str  # the serving image (infra/images/serve.Dockerfile)
    namespace: str = "lanes"
    worker_image: str | None = None  # the offline image (infra/images/worker.Dockerfile)
    api_key_secret: str = "lanes-api-key"  # a Secret with key `api-key`
    prometheus: str = "http://prometheus-operated.monitoring.svc:9090"
    models_claim: str | None = None  # a PersistentVolumeClaim holding the models
    project_dir: str = "/app"  # where the image holds the project (workloads.yaml)
    # The spec's path relative to project_dir (config/workloads.yaml for a spec in a
    # subfolder of the project): where the pods' ConfigMaps are mounted, the path the
    # deployments' `spec` parameter names (`lanes compile --project-dir`).
    spec_file: str = "workloads.yaml"
    drain_s: float = 5.0  # LANES_DRAIN_S: readiness 503 after SIGTERM, still serving
    prefect_api_secret: str = "prefect-api"  # a Secret with key `url`
    offline_cpu: int = 2  # CPUs of a flow run's Job and of a Dask worker pod
    offline_memory: str = "4Gi"
    # A Secret with keys `access-key-id` and `secret-access-key`: static S3 credentials
    # (MinIO's, say) for every pod that reads or writes S3; None: the pods' own (IRSA).
    s3_secret: str | None = None
    # Namespaces besides `namespace` that deployments send flow-run Jobs to (their
    # `namespace` job variable): each gets the spec's ConfigMap and the worker's rights.
    job_namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """InvalidInput naming the option, for what the cluster (or the pods) would refuse."""
        named = [("--namespace", self.namespace)]
        named += [("--job-namespace", ns) for ns in self.job_namespaces]
        for option, ns in named:
            if not DNS_LABEL.match(ns):
                raise InvalidInput(
                    f"{option}: expected a DNS label (lower-case letters, digits and '-', "
                    f"at most 63, starting and ending alphanumeric), found {ns!r}"
                )
        # The API server refuses a pod naming another, at apply, long after this.
        names = [("--api-key-secret", self.api_key_secret), ("--s3-secret", self.s3_secret)]
        for option, name in [*names, ("--models-claim", self.models_claim)]:
            if name is not None and not (len(name) <= 253 and DNS_SUBDOMAIN.match(name)):
                raise InvalidInput(
                    f"{option}: expected a Kubernetes object name (lower-case letters, "
                    f"digits, '-' and '.', at most 253, starting and ending alphanumeric), "
                    f"found {name!r}"
                )
        # The pods mount the spec and start the runs there: a relative folder is no place.
        if not PurePosixPath(self.project_dir).is_absolute():
            raise InvalidInput(
                "--project-dir: expected the project's absolute folder in the images, "
                f"e.g. /app, found {self.project_dir!r}"
            )
        # LANES_DRAIN_S's own bounds (lanes.settings): the server refuses the rest at start.
        if not 0 <= self.drain_s <= MAX_DRAIN_S:  # NaN is in no range
            raise InvalidInput(
                f"--drain-s: expected seconds from 0 to {MAX_DRAIN_S}, found {self.drain_s:g}"
            )

    @property
    def spec_path(self) -> str:
        """The spec's path in the images."""
        return str(PurePosixPath(self.project_dir) / self.spec_file)

    @property
    def spec_dir(self) -> str:
        """The spec's folder in the images, which its relative paths are read against."""
        return str(PurePosixPath(self.spec_path).parent)

    @property
    def all_job_namespaces(self) -> tuple[str, ...]:
        """Every namespace a flow run's Job may run in, the worker's first, once each."""
        return tuple(dict.fromkeys((self.namespace, *self.job_namespaces)))


@dataclass(frozen=True)
class Group:
    """The interactive workloads one Deployment serves, and the settings they share."""

    name: str
    workloads: tuple[str, ...]
    deploy: Deploy

    @property
    def app_name(self) -> str:
        return f"{APP}-{self.name}"

    def service_url(self, namespace: str) -> str:
        """The group's Service as pods of any namespace of the cluster reach it."""
        return f"http://{self.app_name}.{namespace}.svc:{SERVICE_PORT}"


def groups(spec: Spec) -> list[Group]:
    """The spec's interactive workloads by `deploy.group`, in the order groups first
    appear, each with the group-wide keys its workloads set (the spec's rules made
    sure they agree: lanes.specrules)."""
    members: dict[str, list[tuple[str, InteractiveWorkload]]] = {}
    for name, workload in spec.workloads.items():
        if isinstance(workload, InteractiveWorkload):
            members.setdefault(workload.deploy.group, []).append((name, workload))
    found = []
    for group, named in members.items():
        values: dict[str, Any] = {}
        for _, workload in named:
            for key in workload.deploy.model_fields_set - PER_WORKLOAD_DEPLOY_KEYS:
                values[key] = getattr(workload.deploy, key)
        deploy = Deploy(group=group, **values)
        found.append(Group(group, tuple(name for name, _ in named), deploy))
    return found


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


def uses_gpu(device: str) -> bool:
    return device in ("cuda", "tensorrt")


def labels(component: str, instance: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/instance": instance,
    }


def models_mount(spec: Spec, spec_dir: str) -> str:
    """Where the models claim is mounted in every pod of the spec: the folder above every
    model and tokenizer file the spec names, as the pod sees it (relative paths are under
    spec_dir, the spec's folder in the images). One folder for the whole spec, so the claim's layout mirrors the spec's
    model folder in every group, Job and Dask worker. InvalidInput when only / is common."""
    files: list[Path] = []
    for model in spec.models.values():
        files += [model.path] + ([model.tokenizer] if model.tokenizer else [])
    root = spec.root or Path.cwd()
    seen = []
    for file in files:
        try:
            seen.append(str(PurePosixPath(spec_dir) / file.relative_to(root)))
        except ValueError:  # outside the project: the pod sees the same absolute path
            seen.append(str(file))
    where = os.path.commonpath([str(PurePosixPath(f).parent) for f in seen])
    if where == "/":
        raise InvalidInput(
            "--models-claim: the spec's model files share no folder but / ("
            + ", ".join(sorted(seen))
            + "): keep them under one folder (e.g. .lanes/models), the claim's root"
        )
    return where


def models_volume(spec: Spec, options: K8sOptions) -> tuple[Manifest, Manifest]:
    """The models claim's volume mount and volume (options.models_claim must be set)."""
    assert options.models_claim
    mount = {"name": "models", "mountPath": models_mount(spec, options.spec_dir)}
    volume = {
        "name": "models",
        "persistentVolumeClaim": {"claimName": options.models_claim, "readOnly": True},
    }
    return {**mount, "readOnly": True}, volume


def s3_credentials(options: K8sOptions) -> list[Manifest]:
    """The env of every pod that reads or writes S3 (the serving pods store the Batch
    API's files, the Jobs and Dask workers read inputs and write outputs): boto3's own
    variables from `--s3-secret`, or nothing, leaving boto3 to the pod's identity."""
    if options.s3_secret is None:
        return []
    return [
        secret_env("AWS_ACCESS_KEY_ID", options.s3_secret, "access-key-id"),
        secret_env("AWS_SECRET_ACCESS_KEY", options.s3_secret, "secret-access-key"),
    ]


def secret_env(name: str, secret: str, key: str, optional: bool = False) -> Manifest:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


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


class _Dumper(yaml.SafeDumper):
    """Block style, the spec's text as a literal block: readable and stable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(value: Any) -> str:
    """YAML in the order the dicts were built, never wrapped."""
    text: str = yaml.dump(
        value, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1_000_000
    )
    return text


def dump_all(objects: Sequence[Manifest]) -> str:
    return "".join("---\n" + dump(o) for o in objects)
