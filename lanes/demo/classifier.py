"""A tiny MLP classifier over synthetic "iris-like" blobs, for the `infer` task.

Contract: `<out>/model.onnx` takes `features` float32 [batch, 4] and returns
`logits` float32 [batch, 3]; `<out>/labels.json` lists the class names in logit
order. Training is seeded and takes well under a second.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

LABELS = ["setosa", "versicolor", "virginica"]
# Blob centres in the spirit of the iris measurements (sepal length/width,
# petal length/width, cm), so that demo requests look plausible.
CENTRES = np.array(
    [[5.0, 3.4, 1.5, 0.2], [5.9, 2.8, 4.3, 1.3], [6.6, 3.0, 5.6, 2.0]], dtype=np.float32
)
SPREAD = 0.35
SEED = 0
FILES = ("model.onnx", "labels.json")


def make_blobs(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return `(features [3*n, 4] float32, labels [3*n] int64)`, class-major order."""
    rng = np.random.default_rng(seed)
    x = CENTRES[:, None, :] + SPREAD * rng.standard_normal((3, n_per_class, 4))
    y = np.repeat(np.arange(3), n_per_class)
    return x.reshape(-1, 4).astype(np.float32), y.astype(np.int64)


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def train(seed: int = SEED) -> nn.Sequential:
    """Train the MLP full-batch on 3x200 seeded blob points; deterministic."""
    torch.manual_seed(seed)
    x_np, y_np = make_blobs(200, seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    model = make_model()
    # Standardise inside the model, so callers send raw measurements.
    mean, std = x.mean(0), x.std(0)
    model.insert(0, _Standardise(mean, std))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return model.eval()


class _Standardise(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def export(model: nn.Module, out: Path) -> None:
    """Write `model.onnx` and `labels.json` into `out` (which must exist)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter, not our concern
        torch.onnx.export(
            model,
            (torch.zeros(2, 4),),
            str(out / "model.onnx"),
            input_names=["features"],
            output_names=["logits"],
            dynamic_axes={"features": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    (out / "labels.json").write_text(json.dumps(LABELS) + "\n")


def build(out: Path) -> Path:
    """Train and export the classifier into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    export(train(), out)
    return out
