"""What an item costs in each lane, for one model on this machine, in one run.

    python bench/cost.py [--items 2000] [--seconds 3] [--p99-ms 50]

The demo MiniLM encoder (.lanes/models/minilm) as one embed workload, measured in
both lanes by `lanes calibrate`'s code (router/calibrate.py) on the same synthetic
query-like texts (3-30 words):

- offline: the shard path (read, sort by length, tokenize, run in batches of 256 as
  the demo's embed-corpus does, write, commit), in process;
- interactive: the endpoint on 127.0.0.1 (`max_batch_size: 32`, `max_wait_ms: 0`, as
  the demo's search-query), closed-loop clients from a child process at 1, 2, 4, ...
  32; the lane's rate is the best whose p99 meets `--p99-ms` (search-query's SLO).

Then raw onnxruntime on the same texts: the task's own batched run, tokenized
beforehand, sorted by length, in batches of 256: the machine's limit, to which each
lane's rate is given as a ratio (the figure that travels between machines).

Prints items/s and $ per 1k items per lane at LANES_PRICE_PER_DEVICE_HOUR (one device
per endpoint replica or offline worker), and offline $ / interactive $ beside the
reference: providers sell batch inference at 50% of the online price. Asserts nothing;
stores nothing (its measurements go to a temporary LANES_HOME).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.measurements import Throughput  # noqa: E402
from lanes.router.calibrate import (  # noqa: E402
    lane_spec,
    measure_interactive,
    measure_offline,
)
from lanes.router.loadgen import Level  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks import load_task  # noqa: E402

SPEC = """\
version: 1
models:
  minilm: {{path: {model}/model.onnx, tokenizer: {model}/tokenizer.json, max_length: 256}}
workloads:
  minilm:
    mode: interactive
    task: embed
    model: minilm
    batching: {{max_batch_size: 32, max_wait_ms: 0}}
    slo: {{p99_ms: {p99}}}
    batch_size: 256
"""
BATCH_REFERENCE = 0.5  # batch price / online price, as providers sell them


def raw_rate(spec_path: Path, settings: Settings, texts: list[str], batch_size: int) -> float:
    """Items/s of the task's own batched run: tokenized beforehand, sorted, timed runs only."""
    spec = load_spec(spec_path, settings)
    task = load_task("minilm", lane_spec(spec, "minilm", "offline"), Runtime(settings))
    task.warm_up()
    prepared = sorted((task.prepare(t) for t in texts), key=lambda p: p.n_tokens)
    batches = [prepared[i : i + batch_size] for i in range(0, len(prepared), batch_size)]
    task.run(batches[0])  # the first run at a size allocates; not part of the figure
    start = time.perf_counter()
    for batch in batches:
        task.run(batch)
    return len(prepared) / (time.perf_counter() - start)


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=2000, help="offline items")
    parser.add_argument("--seconds", type=float, default=3.0, help="per interactive level")
    parser.add_argument("--p99-ms", type=float, default=50.0, help="the interactive SLO")
    args = parser.parse_args()
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    work = Path(tempfile.mkdtemp(prefix="lanes-bench-cost-"))
    spec_path = work / "workloads.yaml"
    spec_path.write_text(SPEC.format(model=models / "minilm", p99=args.p99_ms))
    settings = Settings(home=work / "home")
    spec = load_spec(spec_path, settings)
    price = settings.price_per_device_hour

    offline, items = measure_offline(spec, "minilm", settings, args.items)
    levels: list[Level] = []
    interactive, _ = measure_interactive(
        spec, "minilm", settings, items, args.seconds, levels.append
    )
    texts = [str(item.request.body["input"]) for item in items]
    raw = raw_rate(spec_path, settings, texts, batch_size=256)

    print(f"\nminilm, {len(items)} texts of 3-30 words; provider {offline.provider}")
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.seconds} s/level"
    )
    print(f"\ninteractive lane (closed loop, p99 target {args.p99_ms:g} ms):")
    rows = [
        [
            str(lv.concurrency),
            f"{lv.items_per_second:.0f}",
            f"{lv.p50_ms:.1f}" if lv.p50_ms is not None else "-",
            f"{lv.p99_ms:.1f}" if lv.p99_ms is not None else "-",
            str(lv.errors),
            "chosen" if lv.concurrency == interactive.concurrency else "",
        ]
        for lv in levels
    ]
    table(rows, ["clients", "items/s", "p50 ms", "p99 ms", "errors", ""])

    print(f"\nper lane, at ${price:g} per device-hour:")

    def row(name: str, r: Throughput, how: str) -> list[str]:
        cost = r.usd_per_1k_items(price)
        return [
            name,
            f"{r.items_per_second:.0f}",
            f"${cost:.6f}",
            f"{r.items_per_second / raw:.2f}",
            how,
        ]

    rows = [
        row("offline", offline, "shard path, batches of 256"),
        row(
            "interactive",
            interactive,
            f"{interactive.concurrency} clients, p99 {interactive.p99_ms:.1f} ms",
        ),
        ["raw onnxruntime", f"{raw:.0f}", "-", "1.00", "task.run, batches of 256, sorted"],
    ]
    table(rows, ["lane", "items/s", "$ / 1k items", "x raw", "how"])
    ratio = offline.usd_per_1k_items(price) / interactive.usd_per_1k_items(price)
    missed = "" if interactive.meets_slo else " (even one client missed the SLO)"
    print(
        f"\noffline $ / interactive $ = {ratio:.2f}{missed}; providers' batch price: "
        f"{BATCH_REFERENCE:.2f} of online"
    )


if __name__ == "__main__":
    main()
