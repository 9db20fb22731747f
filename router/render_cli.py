"""`lanes render k8s`: the files, from lanes.router.render_serving, render_pool and render_dask."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from lanes.errors import InvalidInput
from lanes.router.console import SpecFile, guarded
from lanes.router.render_dask import dask_objects
from lanes.router.render_k8s import K8sOptions, dump_all, groups
from lanes.router.render_pool import (
    base_job_template,
    job_namespace_objects,
    offline_spec,
    worker_objects,
)
from lanes.router.render_serving import serving_objects
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec
from lanes.specfile import load_spec, read_document
from lanes.specinteractive import QUANTITY_PATTERN

render_app = typer.Typer(no_args_is_help=True, help="Write what runs the spec elsewhere.")


def render_files(
    raw: dict[str, Any], spec: Spec, settings: Settings, options: K8sOptions, dask_workers: int = 2
) -> dict[str, str]:
    """File name -> text: `serve-GROUP.yaml` per group of interactive workloads; for
    offline workloads `prefect-worker.yaml` (with the ConfigMap of the whole spec the
    Jobs load), `work-pool-POOL.json` and, for a Dask
    runner whose address is in the cluster, `dask.yaml`. Same inputs, same bytes."""
    files: dict[str, str] = {}
    for group in groups(spec):
        objects = serving_objects(raw, spec, settings, options, group)
        files[f"serve-{group.name}.yaml"] = dump_all(objects)
    if any(isinstance(w, OfflineWorkload) for w in spec.workloads.values()):
        if not options.worker_image:
            raise InvalidInput(
                "--worker-image: the spec has offline workloads, whose Jobs run the worker "
                "image (infra/images/worker.Dockerfile); name it"
            )
        image = options.worker_image
        pool = [offline_spec(raw, options.namespace), *worker_objects(settings, options, image)]
        pool += job_namespace_objects(raw, settings, options)
        files["prefect-worker.yaml"] = dump_all(pool)
        template = base_job_template(spec, settings, options, image)
        files[f"work-pool-{settings.work_pool}.json"] = json.dumps(template, indent=2) + "\n"
        cluster = dask_objects(raw, spec, settings, options, image, dask_workers)
        if cluster:
            files["dask.yaml"] = dump_all(cluster)
    return files


def spec_in_project(spec_file: Path, project_root: Path | None, project_dir: str) -> str:
    """The spec's path relative to the project's root here (`project_root`, default its
    own folder), as the images hold it under project_dir and as `lanes compile
    --project-dir` names it: config/workloads.yaml for a spec in config/. InvalidInput
    for a spec outside that folder, which the images would not hold."""
    root = (project_root or spec_file.parent).resolve()
    try:
        return spec_file.resolve().relative_to(root).as_posix()
    except ValueError:
        raise InvalidInput(
            f"--project-root: the spec {spec_file} is not inside {root}, the folder the "
            f"images copy to {project_dir}: name the folder that holds it (the build "
            "context of infra/images/*.Dockerfile)"
        ) from None


def handler_warnings(spec: Spec, spec_dir: str) -> list[str]:
    """A line per `handler:` or `guard: {handler:}` whose module is neither lanes' own nor
    in the spec's folder: the images carry that folder (at spec_dir) and lanes alone,
    so such a module would not import in the pods."""
    root = spec.root or Path.cwd()
    found = []
    for name, workload in spec.workloads.items():
        refs = [("handler", workload.handler)]
        refs.append(("guard.handler", workload.guard.handler if workload.guard else None))
        for key, ref in refs:
            top = (ref or "").partition(":")[0].split(".")[0]
            if not top or top == "lanes":
                continue
            if (root / f"{top}.py").is_file() or (root / top).is_dir():
                continue
            found.append(
                f"warning: workloads.{name}.{key} {ref}: module {top!r} is not in the "
                f"spec's folder {root}, which the images copy to {spec_dir}: put it "
                "there, or install it in both images"
            )
    return found


@render_app.command("k8s")
def k8s(
    file: SpecFile = None,
    image: Annotated[
        str, typer.Option(help="The serving image (infra/images/serve.Dockerfile).")
    ] = "",
    worker_image: Annotated[
        str | None, typer.Option(help="The offline image (infra/images/worker.Dockerfile).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Folder to write one file per part (default: stdout).")
    ] = None,
    namespace: Annotated[str, typer.Option(help="Namespace of every object.")] = "lanes",
    job_namespace: Annotated[
        list[str] | None,
        typer.Option(
            help="Another namespace that deployments send flow-run Jobs to (their "
            "`namespace` job variable); repeat for each. Each gets the spec's ConfigMap "
            "and the worker's rights; the pool accepts no other."
        ),
    ] = None,
    api_key_secret: Annotated[
        str, typer.Option(help="Secret whose key `api-key` is the endpoint's API key.")
    ] = "lanes-api-key",
    prometheus: Annotated[
        str, typer.Option(help="Prometheus the KEDA triggers query.")
    ] = "http://prometheus-operated.monitoring.svc:9090",
    models_claim: Annotated[
        str | None,
        typer.Option(
            help="PersistentVolumeClaim holding the models (default: baked in the image)."
        ),
    ] = None,
    s3_secret: Annotated[
        str | None,
        typer.Option(
            help="Secret whose keys `access-key-id` and `secret-access-key` are the S3 "
            "credentials of every pod (default: the pods' own identity)."
        ),
    ] = None,
    project_dir: Annotated[str, typer.Option(help="The project's folder in the images.")] = "/app",
    project_root: Annotated[
        Path | None,
        typer.Option(
            help="The folder here that the images copy to --project-dir (default: the "
            "spec's folder); a spec in its subfolder is found there at the same path."
        ),
    ] = None,
    drain_s: Annotated[float, typer.Option(help="LANES_DRAIN_S of the serving pods.")] = 5.0,
    dask_workers: Annotated[
        int, typer.Option(help="Dask worker pods per in-cluster scheduler.")
    ] = 2,
    offline_cpu: Annotated[
        int, typer.Option(help="CPUs of each flow-run Job and Dask worker pod.")
    ] = 2,
    offline_memory: Annotated[str, typer.Option(help="Memory of each of those pods.")] = "4Gi",
) -> None:
    """Kubernetes objects for the spec: per group of interactive workloads a Deployment,
    Service, ConfigMap (the spec), PodDisruptionBudget, KEDA ScaledObject and
    ServiceMonitor; for offline workloads the Prefect work pool's base job template, its
    worker and a Dask cluster. The same spec gives the same bytes."""
    settings = guarded(Settings)

    def run() -> dict[str, str]:
        if not image:
            raise InvalidInput(
                "--image: name the serving image, e.g. registry.example/lanes-serve:1.0"
            )
        for option, named in (("--image", image), ("--worker-image", worker_image)):
            # Kubernetes takes any string here and fails each pod at its pull, much later.
            if named is not None and (not named.strip() or re.search(r"\s", named)):
                raise InvalidInput(
                    f"{option}: expected an image reference without spaces, e.g. "
                    f"registry.example/lanes-serve:1.0, found {named!r}"
                )
        if offline_cpu < 1:
            raise InvalidInput(f"--offline-cpu: expected at least 1, found {offline_cpu}")
        if not re.match(QUANTITY_PATTERN, offline_memory):
            raise InvalidInput(
                f"--offline-memory: expected a quantity such as 4Gi, found {offline_memory!r}"
            )
        if dask_workers < 1:
            raise InvalidInput(f"--dask-workers: expected at least 1, found {dask_workers}")
        options = K8sOptions(
            image=image,
            namespace=namespace,
            worker_image=worker_image,
            api_key_secret=api_key_secret,
            prometheus=prometheus,
            models_claim=models_claim,
            project_dir=project_dir,
            drain_s=drain_s,
            offline_cpu=offline_cpu,
            offline_memory=offline_memory,
            s3_secret=s3_secret,
            spec_file=spec_in_project(Path(file or settings.spec), project_root, project_dir),
            job_namespaces=tuple(job_namespace or ()),
        )
        path = file or settings.spec
        spec = load_spec(path, settings, check_files=False)
        raw = read_document(path, settings)
        for line in handler_warnings(spec, options.spec_dir):
            typer.echo(line, err=True)
        return render_files(raw, spec, settings, options, dask_workers)

    files = guarded(run)
    if out is None:
        for name, text in files.items():
            if name.endswith(".yaml"):
                typer.echo(text, nl=False)
        if any(name.endswith(".json") for name in files):
            typer.echo("# the work pool's base job template is written with --out DIR", err=True)
        return

    def write() -> None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (out / name).write_text(text)
                typer.echo(str(out / name))
        except OSError as e:
            raise InvalidInput(
                f"--out: cannot write into {out} ({e.strerror or e}): give a folder "
                "(it is made if missing)"
            ) from None

    guarded(write)
