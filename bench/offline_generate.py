"""Benchmark of offline generate: the shard path against the raw batched decode loop and
against one sequence at a time, in one run, on the demo tinycode decoder.

    python bench/offline_generate.py [--prompts 256] [--tokens 64] [--batch-size 32]
        [--model model-slots.onnx] [--n 4] [--longer 8] [--instruction 6 [--templates 4]]

The same `--prompts` code prompts (greedy, `ignore_eos`, so every completion is
`--tokens` long) go through:

- raw: `Decoder.step` alone, batch by batch: `--batch-size` prompts sorted by length,
  one left-padded prefill, then a token per step for every row (argmax), the present
  fed back as the past. No scheduler, no detokenising, no files: the limit. On the
  slot-layout graph (`--model model-slots.onnx`, lanes/demo/slots.py) the same, the
  prefill's cache copied into the buffers once and each step a `SlotRun` bound once.
- offline lane: the shard path of `lanes run` in process (flows.shard.run_shard:
  read the JSONL of OpenAI /v1/completions batch lines, tokenize, the continuous step
  loop with `--batch-size` rows, detokenise, write the response bodies, commit), no
  Prefect. Timed around the shard.
- one at a time: `Decoder.complete` per prompt, the path offline generate took before
  it ran in the step loop.

With `--n N` the offline lane gets `--prompts / N` batch lines asking for N choices
each (OpenAI's `n`), and raw and one at a time get each of those prompts N times: the
same sequences everywhere. `--longer K` makes each prompt K times its text, for
prompts whose prefill weighs (a summary's document, say). `--instruction L` starts
every prompt with the same L lines (a few-shot instruction), which the offline lane
prefills once per step and the raw loop in every row; `--templates M` makes M such
instructions, each opening with a line of its own, prompt i taking the (i % M)-th
(a job over several templates, their prompts interleaved by length).

With `--breakdown`, raw and the offline lane run once more each, their decoder runs
counted: prefill and decode runs, padded against real positions, and the seconds inside
`Decoder.step` against the rest (where the offline lane's own Python shows).

Each runs `--repeats` times, interleaved, after an untimed warm-up; the best of each is
kept. Prints tokens/s and the ratios offline/raw (target >= 0.9) and
offline/one-at-a-time. On a shared machine the wall-clock figures drift: the load
average is printed with them, and so are the same figures in this process's CPU time
(every thread's, onnxruntime's included), which other processes' load moves far less.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.flows.job import folder_job, plan_shards  # noqa: E402
from lanes.flows.runners import Model  # noqa: E402
from lanes.flows.shard import run_shard  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.storage import Storage  # noqa: E402
from lanes.tasks import GenerateTask, load_task  # noqa: E402
from lanes.tasks.past import Past, StepOutput  # noqa: E402
from lanes.tasks.sampling import SamplingParams  # noqa: E402
from lanes.tasks.slot_graph import SlotRun  # noqa: E402

Array = np.ndarray[Any, Any]
WORKLOAD = "gen"
SPEC = """\
version: 1
models:
  tinycode:
    path: {m}/tinycode/{file}
    tokenizer: {m}/tinycode/tokenizer.json
    session: {{intra_op_threads: {threads}}}
workloads:
  gen:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: out/
    batch_size: {batch}
    generation: {{max_new_tokens: {tokens}, temperature: 0}}
"""
PROMPTS = [
    "def ",
    "import os\n",
    "class Config:\n    def __init__(self, path",
    "    for name in sorted(names):\n        if name.startswith('_'):\n            continue\n",
    "# Copyright 2001 Python Software Foundation\n\nimport sys\nimport re\n",
    "    return self.",
    'def parse(text, *, strict=False):\n    """Parse text into a list of tokens.\n\n',
    "for i in range(",
    "    if not path.exists():\n        raise FileNotFoundError(",
    "from collections import",
]


INSTRUCTION_LINE = "# Complete the function below; keep to the style of the module.\n"


def prompts(n: int, longer: int = 1, instruction: int = 0, templates: int = 1) -> list[str]:
    """`n` distinct prompts: joiners of one prompt share their prefill's row, which the
    raw loop does not, so a repeated prompt would flatter the offline lane. With
    `templates` > 1, prompt i starts with instruction i % templates, each opening with
    a line of its own."""
    heads = [INSTRUCTION_LINE * instruction]
    if instruction and templates > 1:
        heads = [f"# Template {t}.\n{heads[0]}" for t in range(templates)]
    return [f"{heads[i % len(heads)]}# {i}\n{PROMPTS[i % len(PROMPTS)] * longer}" for i in range(n)]


class Timer:
    """Wall-clock and CPU seconds (this process's, every thread) since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def seconds(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


@dataclass
class Runs:
    """Decoder runs of one kind (prefill or decode): their rows, attention positions
    (padded, and real: mask 1) and CPU seconds inside `Decoder.step`."""

    runs: int = 0
    rows: int = 0
    positions: int = 0
    real: int = 0
    seconds: float = 0.0


class Counted:
    """Counts the runs of `task.decoder.step` (and of `SlotRun`, a slot-layout graph's
    decode) while it is entered (the one decoder that raw and the offline lane share)."""

    def __init__(self, task: GenerateTask) -> None:
        self.decoder, self.runs = task.decoder, {"prefill": Runs(), "decode": Runs()}

    def __enter__(self) -> Counted:
        step = type(self.decoder).step

        def counted(
            input_ids: Array, attention_mask: Array, position_ids: Array, past: Past
        ) -> StepOutput:
            at = time.process_time()
            out = step(self.decoder, input_ids, attention_mask, position_ids, past)
            runs = self.runs["decode" if input_ids.shape[1] == 1 else "prefill"]
            runs.seconds += time.process_time() - at
            runs.runs, runs.rows = runs.runs + 1, runs.rows + input_ids.shape[0]
            runs.positions += attention_mask.size
            runs.real += int(attention_mask.sum())
            return out

        slot_step = self.slot_step = SlotRun.__call__
        decode = self.runs["decode"]

        def counted_slots(run: SlotRun, input_ids: Array, lengths: list[int]) -> Array:
            at = time.process_time()
            out = slot_step(run, input_ids, lengths)
            decode.seconds += time.process_time() - at
            decode.runs, decode.rows = decode.runs + 1, decode.rows + run.rows
            decode.positions += sum(lengths) + run.rows
            decode.real += sum(lengths) + run.rows
            return out

        self.decoder.step = counted  # type: ignore[method-assign]
        SlotRun.__call__ = counted_slots  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.decoder.step
        SlotRun.__call__ = self.slot_step  # type: ignore[method-assign]

    def report(self, name: str, cpu: float) -> None:
        inside = sum(r.seconds for r in self.runs.values())
        print(
            f"  {name:<8} CPU {cpu:.3f} s: {inside:.3f} in the decoder's runs, "
            f"{cpu - inside:.3f} outside"
        )
        for kind, r in self.runs.items():
            print(
                f"    {kind:<8} {r.runs:>4} runs, {r.rows:>5} rows, {r.positions:>7} positions "
                f"for {r.real:>7} real ({r.positions / max(r.real, 1):.2f}x), {r.seconds:.3f} s"
            )


def raw(task: GenerateTask, texts: list[str], tokens: int, batch: int) -> tuple[float, float]:
    """Seconds (wall, CPU) of the plain batched decode loop over `texts`."""
    decoder = task.decoder
    encoded = sorted((decoder.encode(t) for t in texts), key=len)
    pad = decoder.config.pad_token_id
    timer = Timer()
    for at in range(0, len(encoded), batch):
        part = encoded[at : at + batch]
        width = max(len(p) for p in part)
        ids = np.full((len(part), width), pad, dtype=np.int64)
        mask = np.zeros((len(part), width), dtype=np.int64)
        positions = np.zeros((len(part), width), dtype=np.int64)
        for j, p in enumerate(part):
            ids[j, width - len(p) :], mask[j, width - len(p) :] = p, 1
            positions[j, width - len(p) :] = np.arange(len(p))
        out = decoder.step(ids, mask, positions, decoder.empty_past(len(part)))
        if decoder.slots:
            slot_steps(task, out, mask, [len(p) for p in part], tokens)
            continue
        step_positions = positions[:, -1:]
        for _ in range(tokens - 1):
            ids = out.logits[:, -1].argmax(axis=-1)[:, None]
            mask = np.concatenate([mask, np.ones((len(part), 1), dtype=np.int64)], axis=1)
            step_positions = step_positions + 1
            out = decoder.step(ids, mask, step_positions, out.present)
    return timer.seconds()


def slot_steps(
    task: GenerateTask, prefilled: StepOutput, mask: Array, lengths: list[int], tokens: int
) -> None:
    """The raw loop's decode on a slot-layout graph: the prefill's real columns into
    buffers as long as the context, then `tokens - 1` steps in place."""
    c = task.decoder.config
    assert c.max_position is not None
    rows = len(lengths)
    shape = (rows, c.num_heads, c.max_position, c.head_dim)
    present = prefilled.present
    keys = tuple(np.zeros(shape, dtype=np.float32) for _ in range(c.num_layers))
    values = tuple(np.zeros(shape, dtype=np.float32) for _ in range(c.num_layers))
    for j, n in enumerate(lengths):
        for ours, theirs in zip((*keys, *values), (*present.keys, *present.values), strict=True):
            ours[j, :, :n] = theirs[j, :, mask.shape[1] - n :]
    at = list(lengths)
    logits = prefilled.logits[:, -1]
    run = task.decoder.slot_run(Past(keys, values), rows)
    for _ in range(tokens - 1):
        ids = logits.argmax(axis=-1)[:, None]
        logits = run(ids, at)[:, -1]
        at = [n + 1 for n in at]


def serial(task: GenerateTask, texts: list[str], tokens: int) -> tuple[float, float]:
    """Seconds (wall, CPU) of `Decoder.complete` over `texts`, one after another (eos
    ends some early: the token count is what they made)."""
    decoder, greedy = task.decoder, SamplingParams(temperature=0)
    timer = Timer()
    made = 0
    for text in texts:
        made += len(decoder.complete(decoder.encode(text), tokens, greedy).tokens)
    wall, cpu = timer.seconds()
    full = (len(texts) * tokens) / max(made, 1)  # per token, as if all were full
    return wall * full, cpu * full


def lane(
    model: Model,
    spec: Any,
    settings: Settings,
    folder: Path,
    texts: list[str],
    tokens: int,
    n: int = 1,
) -> tuple[float, float]:
    """Seconds (wall, CPU) of the shard path over OpenAI batch lines of `texts`, each
    asking for `n` choices."""
    (folder / "in").mkdir(parents=True)
    with (folder / "in" / "part.jsonl").open("wb") as out:
        for i, text in enumerate(texts):
            body = {
                "model": WORKLOAD,
                "prompt": text,
                "max_tokens": tokens,
                "ignore_eos": True,
                "n": n,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            out.write(orjson.dumps(line) + b"\n")
    job = folder_job(spec, WORKLOAD, folder, settings)
    storage = Storage(settings)
    (plan,) = plan_shards(job, storage)
    timer = Timer()
    stats = run_shard(plan, model, storage, job.batch_size, job.max_record_bytes, job.max_inputs)
    elapsed = timer.seconds()
    assert stats.outputs == len(texts), stats
    assert stats.errors == 0, stats
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 96 x 48 (the first measurement) ran 0.15 s a path: one run's drift
    # swung offline / raw from 0.68x to 1.04x. This runs about 0.5 s a path.
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument(
        "--breakdown", action="store_true", help="count decoder runs and time spent around them"
    )
    parser.add_argument(
        "--model", default="model.onnx", help="tinycode's graph: model.onnx or model-slots.onnx"
    )
    parser.add_argument("--n", type=int, default=1, help="choices per batch line (see above)")
    parser.add_argument("--longer", type=int, default=1, help="each prompt this many times over")
    parser.add_argument("--instruction", type=int, default=0, help="lines every prompt starts with")
    parser.add_argument(
        "--templates", type=int, default=1, help="distinct instructions, prompt i the (i %% M)-th"
    )
    args = parser.parse_args()
    if args.prompts % args.n:
        parser.error(f"--prompts ({args.prompts}) must be a multiple of --n ({args.n})")
    models = ROOT / ".lanes" / "models"
    with tempfile.TemporaryDirectory(prefix="lanes-bench-") as tmp:
        root = Path(tmp)
        spec_path = root / "workloads.yaml"
        spec_path.write_text(
            SPEC.format(
                m=models,
                file=args.model,
                threads=args.threads,
                batch=args.batch_size,
                tokens=args.tokens,
            )
        )
        settings = Settings(device="cpu")
        spec = load_spec(spec_path, settings)
        runtime = Runtime(settings)
        task = load_task(WORKLOAD, spec, runtime)
        assert isinstance(task, GenerateTask)
        model = Model(task, runtime.providers[0])
        lines = prompts(args.prompts // args.n, args.longer, args.instruction, args.templates)
        texts = [text for text in lines for _ in range(args.n)]  # every choice's sequence
        total = args.prompts * args.tokens
        # Warm-up, untimed: every path once on a few prompts.
        raw(task, texts[:4], 4, args.batch_size)
        serial(task, texts[:2], 4)
        lane(model, spec, settings, root / "warm", lines[:4], 4, args.n)
        names = ("raw", "offline", "one at a time")
        wall, cpu = dict.fromkeys(names, np.inf), dict.fromkeys(names, np.inf)
        for r in range(args.repeats):
            timed = {
                "raw": raw(task, texts, args.tokens, args.batch_size),
                "offline": lane(
                    model, spec, settings, root / f"run{r}", lines, args.tokens, args.n
                ),
                "one at a time": serial(task, texts, args.tokens),
            }
            for name, (seconds, cpu_seconds) in timed.items():
                wall[name], cpu[name] = min(wall[name], seconds), min(cpu[name], cpu_seconds)
        breakdown = []
        if args.breakdown:
            with Counted(task) as counted_raw:
                _, raw_cpu = raw(task, texts, args.tokens, args.batch_size)
            with Counted(task) as counted_lane:
                _, lane_cpu = lane(
                    model, spec, settings, root / "counted", lines, args.tokens, args.n
                )
            breakdown = [("raw", counted_raw, raw_cpu), ("offline", counted_lane, lane_cpu)]
    print(
        f"tinycode ({args.model}), {args.prompts} prompts x {args.tokens} tokens (greedy, "
        f"ignore_eos; {args.prompts // args.n} lines of n={args.n}, texts x{args.longer}, "
        f"{args.instruction} instruction lines in {args.templates} template(s)), "
        f"batch_size {args.batch_size}, {args.threads} onnxruntime thread(s), best of "
        f"{args.repeats}; load average {os.getloadavg()[0]:.1f}"
    )
    for clock, best in (("wall clock", wall), ("CPU time", cpu)):
        rates = {name: total / seconds for name, seconds in best.items()}
        print(f" {clock}:")
        for name, rate in rates.items():
            print(f"  {name:<14} {rate:>9.0f} tokens/s")
        print(f"  offline / raw           {rates['offline'] / rates['raw']:.2f}x (target >= 0.9)")
        print(f"  offline / one at a time {rates['offline'] / rates['one at a time']:.2f}x")
    if breakdown:
        print(" decoder runs, one more run of each:")
        for name, counts, seconds in breakdown:
            counts.report(name, seconds)


if __name__ == "__main__":
    main()
