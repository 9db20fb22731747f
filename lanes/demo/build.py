"""Build the demo models into one folder: `build_demo_models(dest)`.

Each model gets its own sub-folder (`minilm/`, `tinycode/`, `classifier/`);
see those modules for what each contains. A model is built in a hidden
`.<name>.partial-*` folder and renamed into place when complete, so an
interrupted build never leaves a folder that looks finished.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from lanes.demo import classifier, minilm, tinycode
from lanes.demo.place import MODEL_NAMES

THREADS = 2  # fixed, so that float reductions (and so the weights) repeat across machines

Step = Callable[[int, int], None]


@dataclass(frozen=True)
class DemoModel:
    name: str
    files: tuple[str, ...]
    build: Callable[[Path, Step], Path]

    def is_built(self, dest: Path) -> bool:
        return all((dest / self.name / f).is_file() for f in self.files)


# One builder per name the spec may use (`lanes.demo.place`, which must stay torch-free).
_BUILDERS: dict[str, tuple[tuple[str, ...], Callable[[Path, Step], Path]]] = {
    "minilm": (minilm.FILES, lambda out, step: minilm.build(out)),
    "tinycode": (
        tinycode.FILES,
        lambda out, step: tinycode.build(out, on_step=lambda s, n, loss: step(s, n)),
    ),
    "classifier": (classifier.FILES, lambda out, step: classifier.build(out)),
}
DEMO_MODELS = tuple(DemoModel(name, *_BUILDERS[name]) for name in MODEL_NAMES)


def build_demo_models(dest: Path, *, force: bool = False, progress: bool = True) -> list[Path]:
    """Build every demo model missing from `dest` (all of them if `force`).

    Returns the model folders, `dest/<name>`, in the order minilm, tinycode,
    classifier, whether built now or already there. Deterministic: seeded,
    on a fixed number of threads.
    """
    dest.mkdir(parents=True, exist_ok=True)
    todo = [m for m in DEMO_MODELS if force or not m.is_built(dest)]
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    columns = (
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, disable=not progress) as bar:
            overall = bar.add_task("demo models", total=len(todo))
            for model in todo:
                task = bar.add_task(model.name, total=None)

                def step(done: int, total: int, task: TaskID = task) -> None:
                    bar.update(task, completed=done, total=total)

                _build_one(model, dest, step)
                bar.update(task, completed=1, total=1)
                bar.advance(overall)
    finally:
        torch.set_num_threads(threads)
    return [dest / m.name for m in DEMO_MODELS]


def _build_one(model: DemoModel, dest: Path, step: Step) -> None:
    # A private partial folder per build, so two processes building into the
    # same `dest` (parallel test runs) never write into each other's files.
    partial = Path(tempfile.mkdtemp(prefix=f".{model.name}.partial-", dir=dest))
    try:
        model.build(partial, step)
        partial.chmod(0o755)  # mkdtemp's 0o700 would hide the models from other users
        shutil.rmtree(dest / model.name, ignore_errors=True)
        partial.rename(dest / model.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


if __name__ == "__main__":  # python -m lanes.demo.build [DEST] [--force]
    args = [a for a in sys.argv[1:] if a != "--force"]
    start = time.perf_counter()
    folders = build_demo_models(
        Path(args[0] if args else ".lanes/models"), force="--force" in sys.argv
    )
    print(f"built {', '.join(map(str, folders))} in {time.perf_counter() - start:.0f} s")
