#!/usr/bin/env bash
# The GPU run in one script, a few minutes: checks that sessions really run on the CUDA
# provider (a silent CPU fallback fails the run), then prints the figures that travel
# between machines, on the demo models `make up` built under .lanes/models (nothing
# heavy is built here):
#   1. the check: onnxruntime's build offers CUDAExecutionProvider, a GPU is present,
#      and a session of each demo model gets CUDA first and runs on it (LANES_DEVICE=cuda:
#      lanes' runtime refuses a session that fell back to the CPU);
#   2. bench/bound.py: session.run vs IO binding in process (minilm, the MLP, decode steps);
#   3. bench/serve.py: served vs raw onnxruntime, minilm and the MLP;
#   4. bench/generate.py: continuous batching vs raw decode steps, tinycode;
#   5. bench/cost.py: offline vs interactive $ per 1k items, minilm.
#
#   bash bench/gpu.sh                  on a machine with an NVIDIA GPU and onnxruntime-gpu
#   bash bench/gpu.sh --allow-cpu      the same steps on the CPU provider, IO binding on
#                                      (proves the script end to end where there is no GPU)
#   bash bench/gpu.sh --quick          shorter slices and fewer levels (with either)
#
# Environment: PYTHON (default .venv/bin/python, else python3), LANES_MODELS_DIR
# (default .lanes/models), LANES_PRICE_PER_DEVICE_HOUR (the GPU's price, for the cost
# step), STEP_TIMEOUT (seconds per step, default 300).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

allow_cpu=0
quick=0
for arg in "$@"; do
    case "$arg" in
        --allow-cpu) allow_cpu=1 ;;
        --quick) quick=1 ;;
        -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "bench/gpu.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MODELS="${LANES_MODELS_DIR:-$ROOT/.lanes/models}"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
for file in minilm/model.onnx minilm/tokenizer.json classifier/model.onnx \
    tinycode/model.onnx tinycode/tokenizer.json; do
    if [[ ! -f "$MODELS/$file" ]]; then
        echo "bench/gpu.sh: no $MODELS/$file; build the demo models first (make up, or lanes models build)" >&2
        exit 1
    fi
done

export LANES_MODELS_DIR="$MODELS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.lanes/prefect}"
mkdir -p "$PREFECT_HOME"
if ((allow_cpu)); then
    # The CPU provider, with the bound path forced on: the code a GPU runs.
    export LANES_DEVICE=cpu LANES_IO_BINDING=on
else
    # cuda, not auto: a session that does not get CUDAExecutionProvider is an error.
    export LANES_DEVICE=cuda LANES_IO_BINDING=auto
fi

if ((quick)); then
    seconds=0.5 levels=1,8 gen_levels=1,4 batches=1,32 rows=1,16 items=300
else
    seconds=2 levels=1,32,128 gen_levels=1,16,64 batches=1,32,128 rows=1,16,64 items=2000
fi

step() {
    echo
    echo "=== $1"
    shift
    if ! timeout "$STEP_TIMEOUT" "$@"; then
        echo "bench/gpu.sh: step failed: $*" >&2
        exit 1
    fi
}

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv || true
fi

step "1. providers: does every session run where it was asked to?" \
    "$PYTHON" - "$allow_cpu" <<'EOF'
import sys

import numpy as np
import onnxruntime as ort

from lanes.binding import Placement
from lanes.runtime import CUDA, Runtime, detect_gpu
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import load_task
from lanes.tasks.embed import EmbedTask

allow_cpu = sys.argv[1] == "1"
available = ort.get_available_providers()
probe = detect_gpu()
print(f"onnxruntime {ort.__version__}; available providers: {', '.join(available)}")
print(f"GPU present: {probe.present} ({probe.evidence})")
problems = []
if CUDA not in available:
    problems.append(f"this onnxruntime build offers no {CUDA}: install onnxruntime-gpu")
if not probe.present:
    problems.append("no GPU is present")
if problems and not allow_cpu:
    sys.exit("bench/gpu.sh: " + "; ".join(problems))
import os

m = os.environ["LANES_MODELS_DIR"]
spec = Spec.model_validate(
    {
        "models": {
            "minilm": {"path": f"{m}/minilm/model.onnx", "tokenizer": f"{m}/minilm/tokenizer.json"},
            "classifier": {"path": f"{m}/classifier/model.onnx"},
            "tinycode": {
                "path": f"{m}/tinycode/model.onnx",
                "tokenizer": f"{m}/tinycode/tokenizer.json",
            },
        },
        "workloads": {
            "minilm": {"mode": "interactive", "task": "embed", "model": "minilm"},
            "mlp": {"mode": "interactive", "task": "infer", "model": "classifier"},
            "decoder": {"mode": "interactive", "task": "generate", "model": "tinycode"},
        },
    }
)
settings = Settings()
runtime = Runtime(settings)  # device cuda: a session that fell back raises ModelError
print(f"LANES_DEVICE={settings.device} LANES_IO_BINDING={settings.io_binding}: {runtime.choice.reason}")
for name in spec.workloads:
    task = load_task(name, spec, runtime)
    session = task.decoder.session if hasattr(task, "decoder") else task.session
    placement = Placement.of(session)
    binds = runtime.binds(session)
    task.warm_up()  # a first run: CUDA kernels (cuBLAS, cuDNN) load here or fail here
    print(f"  {name}: {', '.join(session.get_providers())}; tensors on {placement}; io binding {binds}")
    if not allow_cpu and not placement.on_gpu:
        sys.exit(f"bench/gpu.sh: {name} runs on {placement}, not on the GPU")
    if not binds:
        sys.exit(f"bench/gpu.sh: {name} does not use IO binding (LANES_IO_BINDING={settings.io_binding})")
    if isinstance(task, EmbedTask):
        vector = task.vectors([task.prepare("a GPU check")])
        assert np.isfinite(vector).all() and abs(float(np.linalg.norm(vector)) - 1) < 1e-3
print("every session runs where it was asked to" + (" (CPU allowed)" if allow_cpu else ", on the GPU"))
EOF

require=()
((allow_cpu)) || require=(--require-gpu)
step "2. IO binding vs session.run, in process (bench/bound.py)" \
    "$PYTHON" bench/bound.py --seconds "$seconds" --batches "$batches" --rows "$rows" "${require[@]}"
step "3. served vs raw: minilm and the MLP (bench/serve.py)" \
    "$PYTHON" bench/serve.py --models minilm,tiny --levels "$levels" --seconds "$seconds" --no-baseline
step "4. served vs raw: the decoder, continuous batching (bench/generate.py)" \
    "$PYTHON" bench/generate.py --policies continuous --levels "$gen_levels" --repeats 1 \
    --seconds "$seconds" --warm 1 --max-batch 64
step "5. offline vs interactive cost: minilm (bench/cost.py)" \
    "$PYTHON" bench/cost.py --items "$items" --seconds "$seconds"

echo
if ((allow_cpu)); then
    echo "bench/gpu.sh: done on the CPU provider (--allow-cpu): the figures above are not GPU figures"
else
    echo "bench/gpu.sh: done; every session ran on CUDAExecutionProvider"
fi
