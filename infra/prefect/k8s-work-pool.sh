#!/usr/bin/env bash
# Create (or update) a Kubernetes work pool whose Jobs run IMAGE with one GPU.
#   infra/prefect/k8s-work-pool.sh POOL IMAGE [NAMESPACE]
# Needs PREFECT_API_URL and `pip install prefect-kubernetes` (for the default template).
set -euo pipefail
pool=${1:?usage: $0 POOL IMAGE [NAMESPACE]}
image=${2:?usage: $0 POOL IMAGE [NAMESPACE]}
namespace=${3:-lanes}
template=$(mktemp)
trap 'rm -f "$template"' EXIT

# Start from Prefect's own default, so the template matches the installed worker.
prefect work-pool get-default-base-job-template --type kubernetes > "$template"
python - "$template" "$image" "$namespace" <<'PY'
import json, sys
path, image, namespace = sys.argv[1:]
template = json.load(open(path))
variables = template["variables"]["properties"]
variables["image"]["default"] = image
variables["namespace"]["default"] = namespace
variables["env"]["default"] = {"DO_NOT_TRACK": "1", "LANES_DEVICE": "cuda"}
container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
# device: cuda fails loudly instead of falling back to the CPU (see lanes.runtime).
container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
json.dump(template, open(path, "w"), indent=2)
PY
if prefect work-pool inspect "$pool" >/dev/null 2>&1; then
  prefect work-pool update "$pool" --base-job-template "$template"
else
  prefect work-pool create "$pool" --type kubernetes --base-job-template "$template"
fi
