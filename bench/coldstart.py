"""Cold start of an unloaded workload (`idle_unload_s`) against a warm request and raw
onnxruntime, in the same run.

    python bench/coldstart.py [--rounds 5] [--idle 0.5] [--model minilm]

Starts `lanes serve` with one embed workload whose `idle_unload_s` is `--idle`, and
per round: waits until /metrics says its model is unloaded, then times one request
(request in -> answer out: the load and the run), then one warm request, then, in this
process, raw onnxruntime's cold path (an InferenceSession with the server's session
options, plus one run of the same tokens). Prints each figure's median over the
rounds, the server's own load time (lanes_model_load_seconds), its resident memory
loaded and unloaded, and the ratios cold / raw and cold / warm. The server loads again
from its optimized copy of the model; raw creates a session of the declared file. Figures from a shared machine drift; the ratios travel.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks.base import load_tokenizer  # noqa: E402

TEXT = " ".join(["word"] * 30)  # 32 tokens with [CLS] and [SEP]
SPEC = """\
version: 1
models:
  {name}: {{path: {m}/{name}/model.onnx, tokenizer: {m}/{name}/tokenizer.json}}
workloads:
  cold:
    mode: interactive
    task: embed
    model: {name}
    idle_unload_s: {idle}
"""
PORT = 8437
WAIT_S = 120.0


def start(cmd: list[str], url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become ready")


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """A sample of workload cold; `labels`: any before `workload` (written sorted)."""
    text = client.get("/metrics").text
    found = re.search(rf'^{name}{{{labels}workload="cold"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else float("nan")


def wait_unloaded(client: httpx.Client) -> None:
    deadline = time.monotonic() + WAIT_S
    while metric(client, "lanes_model_loaded") != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the model was not unloaded within {WAIT_S} s")
        time.sleep(0.05)


def timed_request(client: httpx.Client) -> float:
    start = time.perf_counter()
    response = client.post("/v1/embeddings", json={"model": "cold", "input": TEXT})
    took = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"the request failed: {response.status_code} {response.text}")
    return took


def raw_cold(spec_path: Path, model: str) -> float:
    """InferenceSession creation (the server's options and providers) + one run."""
    settings = Settings(device="cpu")
    spec = load_spec(spec_path, settings)
    model_spec = spec.models[model]
    runtime = Runtime(settings)
    ids = np.asarray([load_tokenizer(model_spec, "embed").encode(TEXT).ids], dtype=np.int64)
    start = time.perf_counter()
    session = runtime.session(model_spec)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if "token_type_ids" in {i.name for i in session.get_inputs()}:
        feeds["token_type_ids"] = np.zeros_like(ids)
    session.run(None, feeds)
    return time.perf_counter() - start


def rss_mb(pid: int) -> float:
    """The process's resident memory (Linux /proc), in MB; nan elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=0.5, help="idle_unload_s of the workload")
    parser.add_argument("--model", default="minilm", help="a demo model with a tokenizer")
    args = parser.parse_args()
    models_dir = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    spec_path = Path(tempfile.mkdtemp(prefix="lanes-coldstart-")) / "workloads.yaml"
    spec_path.write_text(SPEC.format(m=models_dir, name=args.model, idle=args.idle))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LANES_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path), "--port", str(PORT)]
    url = f"http://127.0.0.1:{PORT}"
    cold: list[float] = []
    warm: list[float] = []
    raw: list[float] = []
    rss_loaded: list[float] = []
    rss_unloaded: list[float] = []
    proc = start(cmd, url, env)
    try:
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:
            timed_request(client)  # the connection, and the first run after start-up
            for _ in range(args.rounds):
                wait_unloaded(client)
                rss_unloaded.append(rss_mb(proc.pid))
                cold.append(timed_request(client))
                warm.append(min(timed_request(client) for _ in range(5)))
                rss_loaded.append(rss_mb(proc.pid))
                raw.append(raw_cold(spec_path, args.model))  # the server idles meanwhile
            wake = 'reason="wake",'  # the loads after an idle unload, not the start-up one
            loads = metric(client, "lanes_model_load_seconds_count", wake)
            load_s = metric(client, "lanes_model_load_seconds_sum", wake) / loads
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    c, w, r = (statistics.median(x) for x in (cold, warm, raw))
    print(f"{args.model}: medians of {args.rounds} rounds (CPU, onnxruntime {ort_version()})")
    print(f"  cold request (model unloaded), in -> out : {ms(c)}")
    print(f"    of which the server's load               : {ms(load_s)} ({loads:.0f} loads)")
    print(f"  warm request                             : {ms(w)}")
    print(f"  raw onnxruntime: session + one run       : {ms(r)}")
    loaded, unloaded = statistics.median(rss_loaded), statistics.median(rss_unloaded)
    print(f"  server RSS loaded / unloaded             : {loaded:.0f} / {unloaded:.0f} MB")
    print(f"  cold / raw = {c / r:.2f}x   cold / warm = {c / w:.0f}x   target cold <= 1000 ms")


def ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


if __name__ == "__main__":
    main()
