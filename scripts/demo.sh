#!/usr/bin/env bash
# The demo behind `make up`: both modes of the demo workloads.yaml on this machine.
#   1. validate and plan the spec
#   2. run the offline workload now on an embedded Prefect, print its manifest
#   3. serve the interactive workloads, one call each, stream a completion
#   4. the SDK client: one call, one stream, one job submitted to a Prefect server
# Everything binds 127.0.0.1 and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
PORT="${LANES_PORT:-8000}"
PREFECT_PORT="${PREFECT_PORT:-4242}"
export LANES_ENDPOINT="http://127.0.0.1:$PORT"
WORK=.lanes/demo
mkdir -p "$WORK"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_for() {  # URL SECONDS
  for _ in $(seq 1 $(($2 * 5))); do
    curl -fs "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "gave up waiting for $1" >&2
  return 1
}

step() { printf '\n== %s\n' "$*"; }

step "lanes validate && lanes plan"
"$BIN/lanes" validate
"$BIN/lanes" plan

step "offline: lanes run embed-corpus (embedded Prefect, no server)"
"$BIN/lanes" run embed-corpus
head -c 300 "$(ls .lanes/out/embed-corpus/*.jsonl | head -1)"; echo " ..."

step "interactive: lanes serve on 127.0.0.1:$PORT"
"$BIN/lanes" serve --port "$PORT" >"$WORK/serve.log" 2>&1 &
pids+=($!)
wait_for "$LANES_ENDPOINT/readyz" 120
curl -s "$LANES_ENDPOINT/v1/embeddings" -H 'content-type: application/json' \
  -d '{"model": "search-query", "input": "how do I reverse a list"}' | cut -c1-160; echo " ..."
curl -s "$LANES_ENDPOINT/v2/models/flower-classify/infer" -H 'content-type: application/json' \
  -d '{"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2, 6.7, 3.0, 5.2, 2.3]}]}'; echo
curl -s "$LANES_ENDPOINT/v1/completions" -H 'content-type: application/json' \
  -d '{"model": "code-complete", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}' | cut -c1-300; echo

step "streaming: lanes stream code-complete"
"$BIN/lanes" stream code-complete "import os
def " --max-tokens 48

step "the SDK client (lanes.Client): call, stream, submit"
PREFECT_HOME="$PWD/$WORK/prefect" "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" \
  --analytics-off >"$WORK/prefect.log" 2>&1 &
pids+=($!)
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
wait_for "$PREFECT_API_URL/health" 120
"$BIN/lanes" deploy >/dev/null
"$BIN/python" - <<'PY'
import lanes, subprocess, os

with lanes.Client() as client:
    vector = client.call("search-query", "how do I reverse a list")
    print("call   ->", vector.shape, vector[:3])
    print("stream ->", "".join(client.stream("code-complete", "def add(a, b):", max_tokens=24)))
    job = client.submit("embed-corpus", [{"id": f"r{i}", "text": f"record {i}"} for i in range(5)], when="now")
    print("submit ->", job.id, job.status())
    bin = os.path.join(os.environ.get("VENV", ".venv"), "bin")
    subprocess.run([f"{bin}/prefect", "worker", "start", "--pool", "lanes", "--run-once"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job.wait(300)
    print("job    ->", job.status(), [r["id"] for r in job.results()])
    print("manifest:", {k: job.manifest()[k] for k in ("records", "outputs", "errors", "items_per_second")})
PY
step "done: the server log is in $WORK/serve.log"
