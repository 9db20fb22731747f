"""`lanes render k8s`: every object valid against the Kubernetes OpenAPI schemas (built-in
kinds, kubernetes-validate) or its CRD's schema (KEDA ScaledObject, ServiceMonitor:
tests/fixtures), the same bytes from every run, the GPU only where the device is cuda,
and autoscaling on series the server really exports."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from lanes.backfill import backfilled
from lanes.errors import InvalidInput, SpecError
from lanes.router.cli import app
from lanes.router.render_cli import render_files
from lanes.router.render_k8s import K8sOptions
from lanes.router.render_serving import SHUTDOWN_S
from lanes.serving.metrics import Metrics
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload, OfflineWorkload
from lanes.specfile import load_spec

K8S_VERSION = "1.33.0"
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
CRD_SCHEMAS = {
    "ScaledObject": FIXTURES / "keda-scaledobject-v2.20.2.schema.json",
    "ServiceMonitor": FIXTURES / "servicemonitor-v0.93.0.schema.json",
}

SPEC = """\
version: 1
models:
  minilm: {path: models/minilm/model.onnx, tokenizer: models/minilm/tokenizer.json}
  tinycode: {path: models/tinycode/model.onnx, tokenizer: models/tinycode/tokenizer.json}
  classifier: {path: models/classifier/model.onnx}
workloads:
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 32}
  flower-classify:
    mode: interactive
    task: infer
    model: classifier
    deploy: {target_queue_depth: 8}
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 16}
    deploy: {group: generate, device: cuda, min_replicas: 0, max_replicas: 8, cpu: "4", memory: 16Gi}
  embed-corpus:
    mode: offline
    task: embed
    model: minilm
    input: s3://corpus/in/
    output: s3://corpus/out/
    runner: {kind: dask, address: "tcp://dask-scheduler:8786"}
"""
OPTIONS = K8sOptions(
    image="registry.example/lanes-serve:1.0",
    worker_image="registry.example/lanes-worker:1.0",
    models_claim="lanes-models",
)


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "workloads.yaml"
    path.write_text(SPEC)
    return path


def _render(spec_path: Path, **settings: Any) -> dict[str, str]:
    s = Settings(**settings)
    spec = load_spec(spec_path, s, check_files=False)
    return render_files(yaml.safe_load(spec_path.read_text()), spec, s, OPTIONS)


def _objects(files: dict[str, str]) -> list[dict[str, Any]]:
    return [
        o
        for name, text in files.items()
        if name.endswith(".yaml")
        for o in yaml.safe_load_all(text)
    ]


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server would silently prune
    them, so a misspelt key would be lost without a word."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validate(obj: dict[str, Any]) -> None:
    kind = obj["kind"]
    if kind in CRD_SCHEMAS:
        schema = json.loads(CRD_SCHEMAS[kind].read_text())
        jsonschema.validate(obj, _strict(schema))
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [(o["kind"], o["metadata"]["name"]) for o in objects])
    return found[0]


def _filled(template: dict[str, Any]) -> dict[str, Any]:
    """The Job a Prefect Kubernetes worker makes from the base job template: each
    "{{ var }}" replaced by the variable's default, a key without one dropped, env as
    the name/value list the worker writes."""
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    defaults["name"] = "lanes-offline-run"
    defaults["env"] = [{"name": k, "value": v} for k, v in defaults["env"].items()]

    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            filled = {k: fill(v) for k, v in value.items()}
            return {k: v for k, v in filled.items() if v is not None}
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, str):
            whole = re.fullmatch(r"\{\{ (\w+) \}\}", value)
            if whole:
                return defaults[whole.group(1)]
            return re.sub(r"\{\{ (\w+) \}\}", lambda m: str(defaults[m.group(1)]), value)
        return value

    job: dict[str, Any] = fill(template["job_configuration"]["job_manifest"])
    container = job["spec"]["template"]["spec"]["containers"][0]
    if container["env"] is not defaults["env"]:  # a list of its own: the pool's env first
        container["env"] = [*defaults["env"], *container["env"]]
    return job


def test_every_rendered_object_is_valid_against_its_schema(spec_path: Path) -> None:
    files = _render(spec_path)
    assert sorted(files) == [
        "dask.yaml",
        "prefect-worker.yaml",
        "serve-generate.yaml",
        "serve-serve.yaml",
        "work-pool-lanes.json",
    ]
    objects = _objects(files)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "ScaledObject",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    ]
    for obj in objects:
        _validate(obj)
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == OPTIONS.worker_image


def test_a_misspelt_key_fails_validation(spec_path: Path) -> None:
    """The checks above can fail: a key the schema does not know is refused, in a
    built-in kind and in a CRD."""
    objects = _objects(_render(spec_path))
    deployment = _by_kind(objects, "Deployment", "lanes-serve")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)
    scaled = _by_kind(objects, "ScaledObject", "lanes-serve")
    scaled["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled)


def test_the_same_spec_gives_the_same_bytes_in_every_process(
    spec_path: Path, tmp_path: Path
) -> None:
    folders = []
    for seed in ("1", "2"):
        out = tmp_path / f"out-{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        args = [
            sys.executable, "-m", "lanes.router.cli", "render", "k8s", str(spec_path),
            "--image", OPTIONS.image, "--worker-image", str(OPTIONS.worker_image),
            "--models-claim", "lanes-models", "--out", str(out),
        ]  # fmt: skip
        subprocess.run(args, env=env, check=True, capture_output=True, timeout=120)
        folders.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert folders[0] == folders[1]
    in_process = {name: text.encode() for name, text in _render(spec_path).items()}
    assert folders[0] == in_process


def test_a_gpu_group_asks_for_the_gpu_and_a_cpu_group_does_not(spec_path: Path) -> None:
    objects = _objects(_render(spec_path))
    gpu = _by_kind(objects, "Deployment", "lanes-generate")["spec"]["template"]["spec"]
    container = gpu["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1}
    assert {"name": "LANES_DEVICE", "value": "cuda"} in container["env"]
    assert gpu["tolerations"][0]["key"] == "nvidia.com/gpu"
    cpu = _by_kind(objects, "Deployment", "lanes-serve")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
    assert "tolerations" not in cpu
    # Offline Jobs and Dask workers follow LANES_DEVICE where the spec is rendered.
    files = _render(spec_path, device="cuda")
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    assert (
        job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        == 1
    )
    dask_worker = _by_kind(_objects(files), "Deployment", "dask-scheduler-worker")
    assert (
        dask_worker["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpu"
        ]
        == 1
    )
    cpu_job = _filled(json.loads(_render(spec_path, device="cpu")["work-pool-lanes.json"]))
    assert (
        "nvidia.com/gpu"
        not in cpu_job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


def test_probes_grace_secret_and_models_volume(spec_path: Path) -> None:
    objects = _objects(_render(spec_path))
    pod = _by_kind(objects, "Deployment", "lanes-serve")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert (
        container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"]
        >= 300
    )
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["terminationGracePeriodSeconds"] > OPTIONS.drain_s + SHUTDOWN_S
    key = next(e for e in container["env"] if e["name"] == "LANES_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "lanes-api-key", "key": "api-key"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/app/models" and mounts["models"]["readOnly"]
    assert mounts["spec"]["mountPath"] == "/app/workloads.yaml"


def test_each_group_gets_its_own_spec_which_loads(spec_path: Path, tmp_path: Path) -> None:
    objects = _objects(_render(spec_path))
    config = _by_kind(objects, "ConfigMap", "lanes-generate")["data"]["workloads.yaml"]
    pod_spec = tmp_path / "pod" / "workloads.yaml"
    pod_spec.parent.mkdir()
    pod_spec.write_text(config)
    loaded = load_spec(pod_spec, Settings(), check_files=False)
    assert list(loaded.workloads) == ["code-complete"]
    assert list(loaded.models) == ["tinycode"]
    serve = yaml.safe_load(_by_kind(objects, "ConfigMap", "lanes-serve")["data"]["workloads.yaml"])
    assert list(serve["workloads"]) == ["search-query", "flower-classify"]


def test_autoscaling_reads_series_the_server_exports(spec_path: Path) -> None:
    objects = _objects(_render(spec_path))
    exported = {family.name for family in Metrics().registry.collect()}
    triggers = {
        t["name"]: t
        for name in ("lanes-serve", "lanes-generate")
        for t in _by_kind(objects, "ScaledObject", name)["spec"]["triggers"]
    }
    assert sorted(triggers) == ["code-complete", "flower-classify", "search-query"]
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus"
        for series in re.findall(r"(lanes_\w+)\{", trigger["metadata"]["query"]):
            assert series in exported, series
    assert "lanes_sequences_in_flight" in triggers["code-complete"]["metadata"]["query"]
    assert triggers["search-query"]["metadata"]["threshold"] == "32"
    assert triggers["flower-classify"]["metadata"]["threshold"] == "8"
    generate = _by_kind(objects, "ScaledObject", "lanes-generate")["spec"]
    assert (generate["minReplicaCount"], generate["maxReplicaCount"]) == (0, 8)


def test_workloads_of_one_group_that_disagree_are_a_spec_error_on_every_key(
    tmp_path: Path,
) -> None:
    """`lanes validate` catches it (not only render), and names each key that differs."""
    path = tmp_path / "workloads.yaml"
    path.write_text(
        SPEC.replace(
            "deploy: {target_queue_depth: 8}", "deploy: {device: cuda, max_replicas: 4}"
        ).replace(
            "batching: {max_batch_size: 32}",
            "batching: {max_batch_size: 32}\n    deploy: {device: cpu, max_replicas: 2}",
        )
    )
    with pytest.raises(SpecError) as refused:
        load_spec(path, Settings(), check_files=False)
    message = str(refused.value)
    for key in ("device", "max_replicas"):
        assert f"workloads.flower-classify.deploy.{key}" in message, message
    assert "disagrees with workload search-query's" in message


def test_a_bad_deploy_block_fails_at_load_with_its_field(tmp_path: Path) -> None:
    path = tmp_path / "workloads.yaml"
    path.write_text(
        SPEC.replace("min_replicas: 0, max_replicas: 8", "min_replicas: 9, max_replicas: 8")
    )
    with pytest.raises(SpecError, match=r"workloads\.code-complete\.deploy"):
        load_spec(path, Settings(), check_files=False)


def test_offline_workloads_need_the_worker_image(spec_path: Path) -> None:
    s = Settings()
    spec = load_spec(spec_path, s, check_files=False)
    options = K8sOptions(image=OPTIONS.image)
    with pytest.raises(InvalidInput, match="--worker-image"):
        render_files(yaml.safe_load(spec_path.read_text()), spec, s, options)


def _plan_render_command() -> list[str]:
    """The `lanes render k8s` line of infra/README.md's 10M plan, as written."""
    text = (ROOT / "infra" / "README.md").read_text()
    section = text.split("**The rendered config.**", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    command = next(line for line in lines if line.startswith("lanes render k8s"))
    return shlex.split(command, comments=True)


def test_the_10m_plan_in_infra_renders_valid_objects(tmp_path: Path) -> None:
    """infra/README.md's overnight plan, its command as written: valid objects, and the
    Dask workers it counts on, each with onnxruntime's threads fitted to its CPUs."""
    args = _plan_render_command()
    out = args.index("--out")
    args[out + 1] = str(tmp_path / "k8s")
    subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", *args[1:]],
        cwd=ROOT, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    files = {p.name: p.read_text() for p in (tmp_path / "k8s").iterdir()}
    objects = _objects(files)
    for obj in objects:
        _validate(obj)
    kubernetes_validate.validate(
        _filled(json.loads(files["work-pool-lanes.json"])), K8S_VERSION, strict=True
    )
    workers = _by_kind(objects, "Deployment", "dask-scheduler-worker")
    assert workers["spec"]["replicas"] == 29
    container = workers["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["dask", "worker"]
    assert container["resources"]["requests"]["cpu"] == "2"
    assert {"name": "LANES_THREADS", "value": "2"} in container["env"]
    _by_kind(objects, "Service", "dask-scheduler")
    spec = load_spec(ROOT / "infra" / "plans" / "embed-10m.yaml", Settings(), check_files=False)
    assert spec.workloads["embed-corpus"].runner.max_concurrent_shards == 29


# Two groups whose models sit in different folders under one, and an offline workload
# run on the serving endpoint (the operator's probe).
TWO_GROUPS = """\
version: 1
models:
  minilm: {path: .lanes/models/minilm/model.onnx, tokenizer: .lanes/models/minilm/tokenizer.json}
  classifier: {path: .lanes/models/classifier/model.onnx}
workloads:
  search-query:
    mode: interactive
    task: embed
    model: minilm
  flower-classify:
    mode: interactive
    task: infer
    model: classifier
    deploy: {group: small, device: cpu, cpu: CPU}
  nightly-embed:
    mode: offline
    task: embed
    model: minilm
    input: s3://corpus/in/
    output: s3://corpus/out/
    runner: {kind: endpoint, url: "http://lanes-serve", workload: search-query}
  dask-embed:
    mode: offline
    task: embed
    model: minilm
    input: s3://corpus/in/
    output: s3://corpus/out-dask/
    runner: {kind: dask, address: "tcp://dask-scheduler:8786"}
"""


def _two_groups(tmp_path: Path, cpu: str = '"1"', **settings: Any) -> dict[str, str]:
    path = tmp_path / "two-groups" / "workloads.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(TWO_GROUPS.replace("CPU", cpu))
    return _render(path, **settings)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_models_claim_is_mounted_at_one_folder_in_every_pod(tmp_path: Path) -> None:
    files = _two_groups(tmp_path)
    objects = _objects(files)
    pods = {
        name: _by_kind(objects, "Deployment", name)["spec"]["template"]["spec"]
        for name in ("lanes-serve", "lanes-small", "dask-scheduler-worker")
    }
    pods["job"] = _filled(json.loads(files["work-pool-lanes.json"]))["spec"]["template"]["spec"]
    for name, pod in pods.items():
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
        assert mounts == [
            {"name": "models", "mountPath": "/app/.lanes/models", "readOnly": True}
        ], name
        claims = [v for v in pod["volumes"] if v["name"] == "models"]
        assert claims[0]["persistentVolumeClaim"]["claimName"] == "lanes-models", name


def test_models_with_no_common_folder_but_the_root_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "workloads.yaml"
    path.write_text(
        TWO_GROUPS.replace(".lanes/models/classifier", "/srv/classifier").replace("CPU", "1")
    )
    with pytest.raises(InvalidInput, match=r"--models-claim: .*share no folder but /"):
        _render(path)


@pytest.mark.parametrize(
    ("cpu", "threads"),
    # Whole cores, rounded down: a thread on half a core would stall the others.
    [('"2000m"', "2"), ('"1.5"', "1"), ('"500m"', "1"), ("3", "3"), ("2.5", "2")],
)
def test_threads_are_the_whole_cores_of_the_cpu_quota(
    tmp_path: Path, cpu: str, threads: str
) -> None:
    objects = _objects(_two_groups(tmp_path, cpu))
    deployment = _by_kind(objects, "Deployment", "lanes-small")
    _validate(deployment)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert _env(container)["LANES_THREADS"] == threads
    assert container["resources"]["limits"]["cpu"] == cpu.strip('"')


@pytest.mark.parametrize("cpu", ['"0"', "0", "0m", '"0.0"', '"2Gi"'])
def test_a_cpu_of_nothing_is_a_spec_error(tmp_path: Path, cpu: str) -> None:
    path = tmp_path / "workloads.yaml"
    path.write_text(TWO_GROUPS.replace("CPU", cpu))
    with pytest.raises(SpecError, match=r"workloads\.flower-classify\.deploy\.cpu: expected"):
        load_spec(path, Settings(), check_files=False)


def test_an_endpoint_runner_gets_the_key_the_serving_pods_hold(
    tmp_path: Path, spec_path: Path
) -> None:
    files = _two_groups(tmp_path)
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    env = _env(job["spec"]["template"]["spec"]["containers"][0])
    serve = _by_kind(_objects(files), "Deployment", "lanes-serve")
    served = _env(serve["spec"]["template"]["spec"]["containers"][0])["LANES_API_KEY"]
    # The server's internal key is its API key (LANES_INTERNAL_KEY unset there).
    assert env["LANES_INTERNAL_KEY"] == served
    assert served == {"secretKeyRef": {"name": "lanes-api-key", "key": "api-key"}}
    assert env["LANES_THREADS"] == "2"  # the pool's own env is still there
    # Without an endpoint runner, the Jobs hold no key.
    plain = json.loads(_render(spec_path)["work-pool-lanes.json"])
    container = plain["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert container["containers"][0]["env"] == "{{ env }}"


# An offline workload run on the endpoint of group `small` (flower-classify's), with no
# runner.url: its flow runs must find that group's Service.
ON_SMALL = """\
  nightly-classify:
    mode: offline
    task: infer
    model: classifier
    input: s3://flowers/in/
    output: s3://flowers/out/
    runner: {kind: endpoint}
"""


def _service_serving(files: dict[str, str], workload: str) -> dict[str, Any]:
    """The Service rendered beside the ConfigMap whose spec serves `workload`."""
    for name, text in files.items():
        if not name.startswith("serve-"):
            continue
        objects = list(yaml.safe_load_all(text))
        (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
        if workload in yaml.safe_load(config["data"]["workloads.yaml"])["workloads"]:
            (service,) = [o for o in objects if o["kind"] == "Service"]
            return service
    raise AssertionError(f"no rendered group serves {workload}")


def test_an_endpoint_runner_without_a_url_reaches_its_groups_service(tmp_path: Path) -> None:
    path = tmp_path / "workloads.yaml"
    path.write_text(TWO_GROUPS.replace("CPU", "1") + ON_SMALL)
    files = _render(path)
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    env = _env(job["spec"]["template"]["spec"]["containers"][0])
    service = _service_serving(files, "flower-classify")
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    where = service["metadata"]
    assert env["LANES_ENDPOINT"] == f"http://{where['name']}.{where['namespace']}.svc:{port}"
    # nightly-embed's runner.url is its own: with only it, the Jobs keep the default.
    plain = _filled(json.loads(_two_groups(tmp_path)["work-pool-lanes.json"]))
    assert "LANES_ENDPOINT" not in _env(plain["spec"]["template"]["spec"]["containers"][0])


def test_endpoint_runners_on_two_groups_without_urls_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "workloads.yaml"
    url = 'url: "http://lanes-serve", '
    path.write_text(TWO_GROUPS.replace("CPU", "1").replace(url, "") + ON_SMALL)
    with pytest.raises(InvalidInput) as refused:
        _render(path)
    message = str(refused.value)
    assert message.startswith("runner.url: the flow runs of one work pool share one")
    assert "nightly-embed: http://lanes-serve.lanes.svc:80" in message
    assert "nightly-classify: http://lanes-small.lanes.svc:80" in message


def test_serving_pods_reach_prefect_and_share_the_batch_store(tmp_path: Path) -> None:
    """The Batch API starts flow runs on PREFECT_API_URL and keeps files where the
    flow run's Job reads them: the same store on both sides."""
    files = _two_groups(
        tmp_path, batch={"store": "s3://lanes-batches/prod/"}, s3_endpoint="http://minio:9000"
    )
    objects = _objects(files)
    for name in ("lanes-serve", "lanes-small"):
        env = _env(
            _by_kind(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        )
        assert env["PREFECT_API_URL"] == {
            "secretKeyRef": {"name": "prefect-api", "key": "url", "optional": True}
        }
        assert env["LANES_BATCH__STORE"] == "s3://lanes-batches/prod/"
        assert env["LANES_S3_ENDPOINT"] == "http://minio:9000"
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    env = _env(job["spec"]["template"]["spec"]["containers"][0])
    assert env["LANES_BATCH__STORE"] == "s3://lanes-batches/prod/"
    worker = _by_kind(objects, "Deployment", "prefect-worker")
    assert _env(worker["spec"]["template"]["spec"]["containers"][0])["PREFECT_API_URL"] == {
        "secretKeyRef": {"name": "prefect-api", "key": "url"}
    }
    # Unset where the spec is rendered: the pods keep the default, LANES_HOME/batches.
    plain = _by_kind(_objects(_two_groups(tmp_path)), "Deployment", "lanes-serve")
    assert "LANES_BATCH__STORE" not in _env(plain["spec"]["template"]["spec"]["containers"][0])


def test_settings_both_sides_read_reach_the_pods_and_the_jobs(tmp_path: Path) -> None:
    """Set where the spec is rendered, what the server and the flow runs both read goes
    to both: the roots a job may read and write (the Job's worker refuses the rest), the
    off-peak window (deadlines, Batch API starts) and the price (manifests, metrics)."""
    roots = '["s3://shared/corpora/"]'
    env_vars = {
        "LANES_ALLOWED_INPUT_ROOTS": roots,
        "LANES_ALLOWED_OUTPUT_ROOTS": '["s3://shared/results/"]',
        "LANES_OFFPEAK__CRON": "0 22 * * *",
        "LANES_OFFPEAK__TIMEZONE": "Europe/Berlin",
        "LANES_OFFPEAK__FINISH_BY": "06:00",
        "LANES_PRICE_PER_DEVICE_HOUR": "2.5",
    }
    path = tmp_path / "workloads.yaml"
    path.write_text(TWO_GROUPS.replace("CPU", "1"))
    spec_settings = Settings()
    with pytest.MonkeyPatch.context() as env:
        for name, value in env_vars.items():
            env.setenv(name, value)
        rendered = Settings()
    spec = load_spec(path, spec_settings, check_files=False)
    files = render_files(yaml.safe_load(path.read_text()), spec, rendered, OPTIONS)
    serve = _by_kind(_objects(files), "Deployment", "lanes-serve")
    job = _filled(json.loads(files["work-pool-lanes.json"]))
    for container in (
        serve["spec"]["template"]["spec"]["containers"][0],
        job["spec"]["template"]["spec"]["containers"][0],
    ):
        env_of = _env(container)
        assert {name: env_of.get(name) for name in env_vars} == env_vars
    with pytest.MonkeyPatch.context() as env:
        for name, value in _env(job["spec"]["template"]["spec"]["containers"][0]).items():
            if name.startswith("LANES_") and isinstance(value, str):
                env.setenv(name, value)
        back = Settings()  # the pod reads back what was rendered
    assert back.allowed_input_roots == rendered.allowed_input_roots == ("s3://shared/corpora/",)
    assert back.allowed_output_roots == rendered.allowed_output_roots == ("s3://shared/results/",)
    assert back.offpeak == rendered.offpeak and back.offpeak.finish_by == "06:00"
    assert back.price_per_device_hour == rendered.price_per_device_hour == 2.5
    # Unset where the spec is rendered: the pods keep their defaults.
    plain = _filled(json.loads(_two_groups(tmp_path)["work-pool-lanes.json"]))
    assert not set(env_vars) & set(_env(plain["spec"]["template"]["spec"]["containers"][0]))


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (["--drain-s", "-5"], "error: --drain-s: expected seconds from 0 to 3600, found -5"),
        (["--drain-s", "nan"], "error: --drain-s: expected seconds from 0 to 3600, found nan"),
        (["--namespace", "Bad_NS"], "error: --namespace: expected a DNS label"),
        (["--job-namespace", "Bad_NS"], "error: --job-namespace: expected a DNS label"),
        # The API server would refuse each pod naming them, at apply.
        (
            ["--api-key-secret", "Lanes_Key"],
            "error: --api-key-secret: expected a Kubernetes object name (lower-case letters, "
            "digits, '-' and '.', at most 253, starting and ending alphanumeric), found "
            "'Lanes_Key'",
        ),
        (["--s3-secret", "minio creds"], "error: --s3-secret: expected a Kubernetes object"),
        (["--models-claim", "-models"], "error: --models-claim: expected a Kubernetes object"),
        # Where the pods mount the spec and start the runs: a relative folder is no place.
        (
            ["--project-dir", "app"],
            "error: --project-dir: expected the project's absolute folder in the images, "
            "e.g. /app, found 'app'",
        ),
        # Kubernetes would take it, and fail every pod at its pull.
        (
            ["--image", "lanes serve:1"],
            "error: --image: expected an image reference without spaces, e.g. "
            "registry.example/lanes-serve:1.0, found 'lanes serve:1'",
        ),
        (["--worker-image", " "], "error: --worker-image: expected an image reference"),
    ],
)
def test_a_bad_drain_or_namespace_is_one_line_and_exit_2(
    spec_path: Path, tmp_path: Path, option: list[str], expected: str
) -> None:
    """In this process, as tests/test_cli.py's bad settings are."""
    args = ["render", "k8s", str(spec_path), "--image", "i", "--worker-image", "w"]
    done = CliRunner().invoke(app, [*args, *option, "--out", str(tmp_path / "k8s")])
    assert isinstance(done.exception, SystemExit), done.exception
    assert done.exit_code == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(expected)
    assert not (tmp_path / "k8s").exists()


def test_the_pods_serve_the_spec_with_the_overrides_it_was_rendered_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An override where the spec is rendered (as for every command) is in the spec the
    pods load, not only in what was rendered from it (the autoscaling target); and a
    name YAML 1.1 would read otherwise (`on`) is a name, as lanes reads it."""
    path = tmp_path / "workloads.yaml"
    path.write_text(SPEC.replace("search-query", "on"))
    monkeypatch.setenv("LANES_WORKLOADS__ON__BATCHING__MAX_BATCH_SIZE", "8")
    args = ["render", "k8s", str(path), "--image", "i", "--worker-image", "w"]
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "k8s")])
    assert done.exit_code == 0, done.output
    objects = list(yaml.safe_load_all((tmp_path / "k8s" / "serve-serve.yaml").read_text()))
    config = _by_kind(objects, "ConfigMap", "lanes-serve")["data"]["workloads.yaml"]
    pod_spec = tmp_path / "pod" / "workloads.yaml"
    pod_spec.parent.mkdir()
    pod_spec.write_text(config)
    monkeypatch.delenv("LANES_WORKLOADS__ON__BATCHING__MAX_BATCH_SIZE")
    loaded = load_spec(pod_spec, Settings(), check_files=False)
    served = loaded.workloads["on"]
    assert isinstance(served, InteractiveWorkload)
    assert served.batching.max_batch_size == 8
    scaled = _by_kind(objects, "ScaledObject", "lanes-serve")["spec"]["triggers"]
    assert {t["name"]: t["metadata"]["threshold"] for t in scaled}["on"] == "8"


def test_the_jobs_and_dask_workers_load_the_spec_with_the_overrides_it_was_rendered_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An override where the spec is rendered reaches the flow runs too: their Jobs and
    the Dask worker pods mount the whole spec, overrides merged, over the image's copy,
    at the spec's own name in the project folder (where the deployments name it)."""
    path = tmp_path / "lanes.yaml"
    path.write_text(SPEC)
    monkeypatch.setenv("LANES_WORKLOADS__EMBED_CORPUS__BATCH_SIZE", "7")
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_BATCH_SIZE", "8")
    args = ["render", "k8s", str(path), "--image", "i", "--worker-image", "w"]
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "k8s")])
    assert done.exit_code == 0, done.output
    objects = [
        o
        for name in ("prefect-worker.yaml", "dask.yaml")
        for o in yaml.safe_load_all((tmp_path / "k8s" / name).read_text())
    ]
    for obj in objects:
        _validate(obj)
    config = _by_kind(objects, "ConfigMap", "lanes-offline-spec")
    job = _filled(json.loads((tmp_path / "k8s" / "work-pool-lanes.json").read_text()))
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pods = {
        "job": job["spec"]["template"]["spec"],
        "dask": _by_kind(objects, "Deployment", "dask-scheduler-worker")["spec"]["template"][
            "spec"
        ],
    }
    for name, pod in pods.items():
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "spec"]
        assert mount == {
            "name": "spec",
            "mountPath": "/app/lanes.yaml",
            "subPath": "workloads.yaml",
            "readOnly": True,
        }, name
        (volume,) = [v for v in pod["volumes"] if v["name"] == "spec"]
        assert volume["configMap"]["name"] == config["metadata"]["name"], name
    text = config["data"]["workloads.yaml"]
    digest = _by_kind(objects, "Deployment", "dask-scheduler-worker")["spec"]["template"][
        "metadata"
    ]["annotations"]["lanes.dev/spec-sha256"]
    assert digest == hashlib.sha256(text.encode()).hexdigest()  # a new spec rolls them

    monkeypatch.delenv("LANES_WORKLOADS__EMBED_CORPUS__BATCH_SIZE")
    monkeypatch.delenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_BATCH_SIZE")
    pod_spec = tmp_path / "app" / "lanes.yaml"
    pod_spec.parent.mkdir()
    pod_spec.write_text(text)
    loaded = load_spec(pod_spec, Settings(), check_files=False)
    assert sorted(loaded.workloads) == sorted(yaml.safe_load(SPEC)["workloads"])  # all
    offline = loaded.workloads["embed-corpus"]
    served = loaded.workloads["search-query"]
    assert isinstance(offline, OfflineWorkload) and offline.batch_size == 7
    assert isinstance(served, InteractiveWorkload) and served.batching.max_batch_size == 8


def test_a_handler_module_outside_the_project_is_warned_of(tmp_path: Path) -> None:
    path = tmp_path / "workloads.yaml"
    path.write_text(
        TWO_GROUPS.replace("CPU", '"1"').replace(
            "    model: classifier\n", "    model: classifier\n    handler: myhooks:handler\n"
        )
    )
    args = ["render", "k8s", str(path), "--image", "i", "--worker-image", "w"]
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "k8s")])
    assert done.exit_code == 0, done.stderr
    assert "warning: workloads.flower-classify.handler myhooks:handler: module 'myhooks'" in (
        done.stderr
    )
    (tmp_path / "myhooks.py").write_text("handler = None\n")
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "k8s")])
    assert done.exit_code == 0 and "warning" not in done.stderr, done.stderr


def test_a_group_s_spec_holds_the_offline_workloads_that_run_on_its_sessions(
    tmp_path: Path,
) -> None:
    """The serving pods then run those batches at idle priority beside the interactive
    ones, as `lanes serve` does with the whole spec (lanes.backfill.backfilled)."""
    path = tmp_path / "workloads.yaml"
    path.write_text(TWO_GROUPS.replace("CPU", "1") + ON_SMALL)
    served: dict[str, set[str]] = {}
    for name, text in _render(path).items():
        if name.startswith("serve-"):
            (config,) = [o for o in yaml.safe_load_all(text) if o["kind"] == "ConfigMap"]
            group = tmp_path / name / "workloads.yaml"
            group.parent.mkdir()
            group.write_text(config["data"]["workloads.yaml"])
            spec = load_spec(group, Settings(), check_files=False)
            served[name] = backfilled(spec.workloads)
            assert "dask-embed" not in spec.workloads, name
    assert sorted(map(sorted, served.values())) == [["flower-classify"], ["search-query"]]


def test_s3_credentials_from_a_secret_reach_every_pod_that_touches_s3(tmp_path: Path) -> None:
    """MinIO has no pod identity: its keys come from a Secret, into the serving pods
    (the Batch API's store), the flow runs' Jobs and the Dask workers; the Prefect
    worker, which touches no S3, holds none."""
    path = tmp_path / "workloads.yaml"
    path.write_text(TWO_GROUPS.replace("CPU", "1") + ON_SMALL)
    args = ["render", "k8s", str(path), "--image", "i", "--worker-image", "w"]

    def keys(env: list[dict[str, Any]]) -> dict[str, str]:
        return {
            e[
                "name"
            ]: f"{e['valueFrom']['secretKeyRef']['name']}/{e['valueFrom']['secretKeyRef']['key']}"
            for e in env
            if e["name"].startswith("AWS_")
        }

    def pods(out: Path) -> dict[str, list[dict[str, Any]]]:
        objects = [o for f in sorted(out.glob("*.yaml")) for o in yaml.safe_load_all(f.read_text())]
        found = {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0].get("env", [])
            for o in objects
            if o["kind"] == "Deployment"
        }
        pool = _filled(json.loads((out / "work-pool-lanes.json").read_text()))
        kubernetes_validate.validate(pool, K8S_VERSION, strict=True)
        found["job"] = pool["spec"]["template"]["spec"]["containers"][0]["env"]
        return found

    done = CliRunner().invoke(app, [*args, "--s3-secret", "minio", "--out", str(tmp_path / "a")])
    assert done.exit_code == 0, done.output
    expected = {
        "AWS_ACCESS_KEY_ID": "minio/access-key-id",
        "AWS_SECRET_ACCESS_KEY": "minio/secret-access-key",
    }
    with_secret = pods(tmp_path / "a")
    touching = {"lanes-serve", "lanes-small", "dask-scheduler-worker", "job"}
    assert touching <= set(with_secret)
    for name, env in with_secret.items():
        assert keys(env) == (expected if name in touching else {}), name
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert done.exit_code == 0, done.output
    assert all(not keys(env) for env in pods(tmp_path / "b").values())


def test_every_namespace_jobs_are_sent_to_gets_the_spec_and_the_workers_rights(
    spec_path: Path, tmp_path: Path
) -> None:
    """A Job mounts lanes-offline-spec from its own namespace, and the worker makes it
    there with a Role of that namespace: each --job-namespace gets both, and the pool
    refuses a namespace that has neither (Prefect checks job variables against the
    pool's schema when a deployment is made and run)."""
    args = ["render", "k8s", str(spec_path), "--image", "i", "--worker-image", "w"]
    args += ["--job-namespace", "batch", "--job-namespace", "lanes", "--out", str(tmp_path / "k8s")]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    objects = list(yaml.safe_load_all((tmp_path / "k8s" / "prefect-worker.yaml").read_text()))
    for obj in objects:
        _validate(obj)
    where = sorted((o["kind"], o["metadata"]["namespace"]) for o in objects)
    assert where == [
        ("ConfigMap", "batch"),
        ("ConfigMap", "lanes"),
        ("Deployment", "lanes"),
        ("Role", "batch"),
        ("Role", "lanes"),
        ("RoleBinding", "batch"),
        ("RoleBinding", "lanes"),
        ("ServiceAccount", "lanes"),
    ]
    specs = [o for o in objects if o["kind"] == "ConfigMap"]
    assert {o["metadata"]["name"] for o in specs} == {"lanes-offline-spec"}
    assert specs[0]["data"] == specs[1]["data"]
    roles = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "Role"}
    assert roles["batch"]["rules"] == roles["lanes"]["rules"]
    binding = next(
        o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == "batch"
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prefect-worker", "namespace": "lanes"}
    ]
    template = json.loads((tmp_path / "k8s" / "work-pool-lanes.json").read_text())
    variables = template["variables"]
    jsonschema.validate({"namespace": "batch"}, variables)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"namespace": "elsewhere"}, variables)
    job = _filled(template)
    (volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "spec"]
    assert volume["configMap"]["name"] == "lanes-offline-spec"


def test_a_spec_in_a_subfolder_is_mounted_where_the_deployments_name_it(tmp_path: Path) -> None:
    """`lanes compile --project-dir /app` of config/workloads.yaml names the spec
    config/workloads.yaml in /app; with --project-root, render mounts the spec there in
    the Jobs and the serving pods (which serve that path, so the spec's relative paths
    are read against /app/config), and the models claim where those paths point."""
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    spec = project / "config" / "workloads.yaml"
    spec.write_text(SPEC)
    for model in yaml.safe_load(SPEC)["models"].values():
        for file in model.values():  # compile checks that the files are there
            (project / "config" / file).parent.mkdir(parents=True, exist_ok=True)
            (project / "config" / file).write_bytes(b"")
    prefect_yaml = project / "prefect.yaml"
    compiled = CliRunner().invoke(
        app, ["compile", str(spec), "--output", str(prefect_yaml), "--project-dir", "/app"]
    )
    assert compiled.exit_code == 0, compiled.output
    (deployment, *_) = yaml.safe_load(prefect_yaml.read_text())["deployments"]
    named = "/app/" + deployment["parameters"]["spec"]
    assert named == "/app/config/workloads.yaml"

    args = ["render", "k8s", str(spec), "--image", "i", "--worker-image", "w"]
    args += ["--models-claim", "lanes-models", "--project-root", str(project)]
    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "k8s")])
    assert done.exit_code == 0, done.output
    job = _filled(json.loads((tmp_path / "k8s" / "work-pool-lanes.json").read_text()))
    serving = yaml.safe_load_all((tmp_path / "k8s" / "serve-serve.yaml").read_text())
    pod = _by_kind(list(serving), "Deployment", "lanes-serve")["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["serve", named]
    for each in (job["spec"]["template"]["spec"], pod):
        mounts = {m["name"]: m["mountPath"] for m in each["containers"][0]["volumeMounts"]}
        assert mounts["spec"] == named
        assert mounts["models"] == "/app/config/models"

    outside = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "elsewhere")])
    assert outside.exit_code == 2
    assert "--project-root: the spec" in outside.stderr
