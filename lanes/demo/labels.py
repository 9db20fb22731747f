"""The classifier workload's handler (`handler: lanes.demo.labels:handler`).

`pre` accepts friendlier inputs than the raw tensor; `post` turns logits into
named labels with probabilities. Imports no torch: the server loads this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lanes.errors import InvalidInput, with_article

LABELS = ("setosa", "versicolor", "virginica")  # logit order of lanes.demo.classifier
N_FEATURES = 4


class Labels:
    """pre: `{"features": [[f1, f2, f3, f4], ...]}`, a list of such rows, or one flat row
    -> `{"features": float32 [rows, 4]}`. post: `{"logits": [rows, 3]}` -> one
    `{"label", "score"}` per row, score the softmax probability of the label."""

    def pre(self, item: Any) -> dict[str, np.ndarray[Any, Any]]:
        rows = item.get("features") if isinstance(item, Mapping) else item
        if isinstance(item, Mapping) and rows is None:
            raise InvalidInput(f"features: missing; expected rows of {N_FEATURES} numbers")
        try:
            array = np.asarray(rows)
        except ValueError:
            array = np.asarray([], dtype=object)  # ragged: reported below
        if array.ndim == 1:
            array = array[None, :]
        if array.dtype.kind not in "iuf" or array.ndim != 2 or array.shape[1] != N_FEATURES:
            raise InvalidInput(
                f"features: expected {N_FEATURES} numbers or rows of {N_FEATURES} numbers, "
                f"found {_summary(rows)}"
            )
        return {"features": array.astype(np.float32)}

    def post(self, output: Mapping[str, Any]) -> list[dict[str, Any]]:
        logits = np.asarray(output["logits"], dtype=np.float64)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        best = probs.argmax(axis=1)
        return [
            {"label": LABELS[int(i)], "score": float(p[i])}
            for i, p in zip(best, probs, strict=True)
        ]


def _summary(value: Any) -> str:
    if isinstance(value, np.ndarray):  # a V2 tensor: its numbers say less than its shape
        return f"{with_article(str(value.dtype))} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


handler = Labels()
