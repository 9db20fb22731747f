"""IO binding against `session.run`, in process, on the demo models: what binding saves.

    python bench/bound.py [--seconds 1] [--batches 1,32,128] [--rows 1,16,64] [--require-gpu]

For minilm (embed), the classifier MLP (infer) and tinycode (decode steps), on the
providers LANES_DEVICE chooses: items/s (tokens/s for the decoder) of the task's run
with `io_binding: off` and with `on`, over the same session and inputs, and the
bound/plain ratio. The decoder's loop feeds each step's present back as the next
past, as serving does: on the plain path through the host every step, on the bound
path as OrtValues that stay on the device. It prints the largest difference between
the two paths' outputs (0 on the CPU; on a GPU the same kernels run, so also 0 or
rounding) and where every session runs; `--require-gpu` fails unless every session
runs on the CUDA provider (a silent CPU fallback is an error, not a figure).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.binding import Placement, run  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.spec import Spec  # noqa: E402
from lanes.tasks import GenerateTask, load_task  # noqa: E402
from lanes.tasks.decoder import Decoder, DevicePast  # noqa: E402
from lanes.tasks.past import Past  # noqa: E402

Array = np.ndarray[Any, Any]
from lanes.tasks.embed import EmbedTask  # noqa: E402
from lanes.tasks.infer import InferTask  # noqa: E402

TEXT = " ".join(["word"] * 30)  # 32 tokens for minilm


def rate(run: Callable[[], Any], items: int, seconds: float) -> float:
    run()  # the first run at a size allocates
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or done < 3:
        run()
        done += 1
    return done * items / (time.perf_counter() - start)


def row(name: str, size: int, plain: float, bound: float, diff: float) -> str:
    return (
        f"{name:>10}  {size:>5}  {plain:>12.0f}  {bound:>12.0f}  {bound / plain:>6.2f}x  "
        f"{diff:>9.2e}"
    )


def bench_session(name: str, session: Any, feeds: dict[str, Any], size: int, s: float) -> str:
    """One batched run of `session`, plain and bound, on the same feeds."""
    names = [o.name for o in session.get_outputs()]
    placements = (None, Placement.of(session))
    want, got = (run(session, names, feeds, p) for p in placements)
    diff = max(float(np.max(np.abs(w - g), initial=0.0)) for w, g in zip(want, got, strict=True))
    rates = [rate(partial(run, session, names, feeds, p), size, s) for p in placements]
    return row(name, size, rates[0], rates[1], diff)


def bench_decoder(decoder: Decoder, rows: int, past_len: int, seconds: float) -> str:
    """Decode steps on a growing past, plain (host past) and bound (device past)."""
    c = decoder.config
    rng = np.random.default_rng(0)
    shape = (rows, c.num_heads, past_len, c.head_dim)
    dtype = decoder.empty_past(1).keys[0].dtype
    start_keys = tuple(rng.standard_normal(shape).astype(dtype) for _ in range(c.num_layers))
    ids = np.ones((rows, 1), dtype=np.int64)
    steps = 16  # per timed loop: the past grows by that many positions, then starts over

    def host_loop() -> Array:
        past = Past(start_keys, start_keys)
        for n in range(steps):
            mask = np.ones((rows, past_len + n + 1), dtype=np.int64)
            out = decoder.step(ids, mask, np.full((rows, 1), past_len + n), past)
            past = out.present
        return out.logits

    device_start = decoder.to_device(Past(start_keys, start_keys))

    def bound_loop() -> Array:
        past: DevicePast = device_start
        for n in range(steps):
            mask = np.ones((rows, past_len + n + 1), dtype=np.int64)
            out = decoder.step_bound(ids, mask, np.full((rows, 1), past_len + n), past)
            past = out.present
        return out.logits

    diff = float(np.max(np.abs(host_loop().astype(np.float64) - bound_loop())))
    plain = rate(host_loop, rows * steps, seconds)
    bound = rate(bound_loop, rows * steps, seconds)
    return row("decoder", rows, plain, bound, diff)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="per path and size")
    parser.add_argument("--batches", default="1,32,128", help="embed/infer batch sizes")
    parser.add_argument("--rows", default="1,16,64", help="decoder rows per step")
    parser.add_argument("--past", type=int, default=128, help="decoder past length")
    parser.add_argument("--require-gpu", action="store_true")
    args = parser.parse_args()
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    settings = Settings()
    runtime = Runtime(settings)
    spec = Spec.model_validate(
        {
            "models": {
                "minilm": {
                    "path": models / "minilm" / "model.onnx",
                    "tokenizer": models / "minilm" / "tokenizer.json",
                    "max_length": 256,
                },
                "classifier": {"path": models / "classifier" / "model.onnx"},
                "tinycode": {
                    "path": models / "tinycode" / "model.onnx",
                    "tokenizer": models / "tinycode" / "tokenizer.json",
                },
            },
            "workloads": {
                name: {"mode": "interactive", "task": task, "model": model}
                for name, task, model in (
                    ("minilm", "embed", "minilm"),
                    ("mlp", "infer", "classifier"),
                    ("decoder", "generate", "tinycode"),
                )
            },
        }
    )
    embed, mlp, generate = (load_task(n, spec, runtime) for n in ("minilm", "mlp", "decoder"))
    assert isinstance(embed, EmbedTask) and isinstance(mlp, InferTask)
    assert isinstance(generate, GenerateTask)
    decoder = generate.decoder
    sessions = {"minilm": embed.session, "mlp": mlp.session, "decoder": decoder.session}
    for name, session in sessions.items():
        placement = Placement.of(session)
        print(f"{name}: {', '.join(session.get_providers())} -> tensors on {placement}")
        if args.require_gpu and not placement.on_gpu:
            sys.exit(f"{name}'s session runs on {placement}, not on the GPU: refusing to bench")
    print(f"\nLANES_DEVICE={settings.device}; items/s (decoder: tokens/s), same session both ways")
    print(
        f"{'model':>10}  {'batch':>5}  {'session.run':>12}  {'io binding':>12}  {'ratio':>7}  {'max diff':>9}"
    )
    item = embed.prepare(TEXT)
    (features,) = mlp.inputs
    width = mlp.inputs[features].shape[1]
    for size in (int(x) for x in args.batches.split(",")):
        ids = np.tile(item.ids, (size, 1))
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "token_type_ids" in {i.name for i in embed.session.get_inputs()}:
            feeds["token_type_ids"] = np.zeros_like(ids)
        print(bench_session("minilm", embed.session, feeds, size, args.seconds))
    rng = np.random.default_rng(0)
    for size in (int(x) for x in args.batches.split(",")):
        x = rng.normal(size=(size, width if isinstance(width, int) else 4)).astype(np.float32)
        print(bench_session("mlp", mlp.session, {features: x}, size, args.seconds))
    for rows in (int(x) for x in args.rows.split(",")):
        print(bench_decoder(decoder, rows, args.past, args.seconds))


if __name__ == "__main__":
    main()
