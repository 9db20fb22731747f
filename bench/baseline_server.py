"""The baseline for bench/serve.py: plain FastAPI, one session.run per request, no batching.

    python bench/baseline_server.py WORKLOADS_YAML WORKLOAD PORT

It uses the same task code as lanes (tokenizer, pooling), so the difference measured
is batching and per-request overhead, not pre- or post-processing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks import load_task  # noqa: E402


def build(spec_path: str, workload: str) -> FastAPI:
    settings = Settings()
    task = load_task(workload, load_spec(spec_path, settings), Runtime(settings))
    app = FastAPI()

    @app.get("/readyz")
    def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v1/embeddings")
    def embeddings(body: dict[str, Any]) -> dict[str, Any]:
        [vector] = task.run([task.prepare(body["input"])])
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector.tolist()}],
        }

    @app.post("/v2/models/{name}/infer")
    def infer(name: str, body: dict[str, Any]) -> dict[str, Any]:
        tensors = {
            t["name"]: np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
            for t in body["inputs"]
        }
        [out] = task.run([task.prepare(tensors)])
        outputs = [
            {"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.reshape(-1).tolist()}
            for k, v in out.items()
        ]
        return {"model_name": name, "outputs": outputs}

    return app


if __name__ == "__main__":
    if len(sys.argv) != 4 or not sys.argv[3].isdigit():
        sys.exit(__doc__)  # the usage, not an IndexError
    spec_path, workload, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    uvicorn.run(
        build(spec_path, workload),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )
