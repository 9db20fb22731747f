#!/usr/bin/env bash
# Build both images and run each once, where docker (or podman as `docker`) can:
#   infra/images/smoke.sh            # builds lanes-serve:smoke and lanes-worker:smoke
# It stages a build context with links resolved (.lanes/models is often a link),
# then checks: the serving image answers /readyz and one embedding on the CPU provider,
# runs as a non-root user and holds neither torch nor prefect; the worker image imports
# the flows and prefect-kubernetes, holds no torch, and runs the demo offline workload
# on mounted models and data. It prints each image's size at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
DOCKER="${DOCKER:-docker}"
PORT="${PORT:-18000}"
context=$(mktemp -d)
name="lanes-smoke-$$"
cleanup() { "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$context"; }
trap cleanup EXIT

test -f .lanes/models/minilm/model.onnx || { echo "build the demo models first: make models" >&2; exit 1; }
mkdir -p "$context/.lanes"
# The whole project (its handler modules too); .dockerignore says what the images take.
cp -rL ./* .dockerignore "$context/"
cp -rL .lanes/models "$context/.lanes/models"
find "$context" -name __pycache__ -prune -exec rm -rf {} +
# lanes/serving etc. are links into the tree: copy them back as links, as git has them.
for wing in serving flows router; do rm -rf "$context/lanes/$wing"; ln -s "../$wing" "$context/lanes/$wing"; done

step() { printf '\n== %s\n' "$*"; }

step "build lanes-serve:smoke (models baked) and lanes-worker:smoke"
"$DOCKER" build -f infra/images/serve.Dockerfile -t lanes-serve:smoke "$context"
"$DOCKER" build -f infra/images/serve.Dockerfile --target serve -t lanes-serve:smoke-mounted "$context"
"$DOCKER" build -f infra/images/worker.Dockerfile -t lanes-worker:smoke "$context"

step "serving image: non-root, no torch, no prefect"
test "$("$DOCKER" run --rm --entrypoint id lanes-serve:smoke -u)" != 0
"$DOCKER" run --rm --entrypoint python3 lanes-serve:smoke -c \
  "import importlib.util as u; bad=[m for m in ('torch','prefect') if u.find_spec(m)]; assert not bad, bad"

step "serving image: /readyz and one embedding (CPU provider)"
"$DOCKER" run -d --name "$name" -p "127.0.0.1:$PORT:8000" -e LANES_DEVICE=cpu lanes-serve:smoke >/dev/null
for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break; sleep 0.5; done
curl -fsS "http://127.0.0.1:$PORT/readyz"; echo
curl -fsS "http://127.0.0.1:$PORT/v1/embeddings" -H 'content-type: application/json' \
  -d '{"model": "search-query", "input": "hello from a container"}' | head -c 200; echo
"$DOCKER" rm -f "$name" >/dev/null

step "serving image, models mounted"
"$DOCKER" run -d --name "$name" -p "127.0.0.1:$PORT:8000" -e LANES_DEVICE=cpu \
  -v "$context/.lanes/models:/app/.lanes/models:ro" lanes-serve:smoke-mounted >/dev/null
for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break; sleep 0.5; done
curl -fsS "http://127.0.0.1:$PORT/readyz"; echo
"$DOCKER" rm -f "$name" >/dev/null

step "worker image: flows and prefect-kubernetes import, no torch; the demo offline workload runs"
test "$("$DOCKER" run --rm lanes-worker:smoke id -u)" != 0
"$DOCKER" run --rm lanes-worker:smoke python3 -c \
  "import importlib.util as u, lanes.flows.batch, prefect_kubernetes; assert not u.find_spec('torch')"
"$DOCKER" run --rm -e LANES_DEVICE=cpu \
  -v "$context/.lanes/models:/app/.lanes/models:ro" -v "$context/data:/app/data:ro" \
  lanes-worker:smoke lanes run embed-corpus --output /tmp/out/

step "sizes"
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^lanes-(serve|worker):smoke'
