"""Where `lanes models build` puts the demo models: where the spec expects them.

The spec is the one place that says where a model is (its paths are relative to
workloads.yaml; LANES_MODELS__* may override them), so the build follows it: a
LANES_HOME of its own moves job state, never the models a spec then cannot find.
Torch-free, so the CLI can say where before it imports the builders.
"""

from __future__ import annotations

from pathlib import Path

from lanes.errors import InvalidInput
from lanes.settings import Settings
from lanes.specfile import load_spec

# The folders `lanes.demo.build` writes, one per demo model, each named as the model.
MODEL_NAMES = ("minilm", "tinycode", "classifier")


def demo_models_folder(settings: Settings) -> Path:
    """The folder the spec at `settings.spec` expects the demo models in: the one that
    holds `<name>/` for each demo model it names (the demo workloads.yaml's
    `.lanes/models`, beside it). SpecError when the spec cannot be read; InvalidInput
    when it names no demo model so, or names them in more than one folder."""
    spec = load_spec(settings.spec, settings, check_files=False)
    folders: dict[Path, list[str]] = {}
    for name in MODEL_NAMES:
        model = spec.models.get(name)
        if model is not None and model.path.parent.name == name:
            folders.setdefault(model.path.parent.parent, []).append(name)
    if len(folders) == 1:
        return next(iter(folders))
    if not folders:
        raise InvalidInput(
            f"{settings.spec}: names no demo model ({', '.join(MODEL_NAMES)}) as "
            "FOLDER/NAME/model.onnx, so there is nowhere it would find them; pass --dest, "
            "or set LANES_SPEC to the spec that uses them"
        )
    found = "; ".join(f"{', '.join(names)} in {folder}" for folder, names in folders.items())
    raise InvalidInput(
        f"{settings.spec}: names the demo models in more than one folder ({found}); "
        "keep them in one, or build each with --dest"
    )
