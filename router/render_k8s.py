"""What every part of `lanes render k8s` shares: the options the spec does not say
(`K8sOptions`), the spec's serving groups, labels, the models claim's volume, secrets
in env, and the YAML, the same bytes for the same spec and options.

Interactive workloads: lanes.router.render_serving (a Deployment of `lanes serve` per
`deploy.group`, and what comes with it). Offline workloads: lanes.router.render_pool
(the Prefect work pool and its worker) and lanes.router.render_dask (a Dask runner's
scheduler and workers in the cluster).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from lanes.errors import InvalidInput
from lanes.spec import InteractiveWorkload, Spec
from lanes.specinteractive import PER_WORKLOAD_DEPLOY_KEYS, Deploy

Manifest = dict[str, Any]
APP = "lanes"
GPU = "nvidia.com/gpu"
SERVICE_PORT = 80  # a group's Service, in front of the pods' HTTP port
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
