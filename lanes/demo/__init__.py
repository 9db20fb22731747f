"""Demo models that lanes serves out of the box, built locally with torch.

`lanes models build` calls `lanes.demo.build.build_demo_models`, which writes:

- `minilm/`: all-MiniLM-L6-v2's encoder (`model.onnx`, `tokenizer.json`) for the
  `embed` task;
- `tinycode/`: a tiny decoder trained on the Python standard library
  (`model.onnx`, `tokenizer.json`, `config.json`) for the `generate` task;
- `classifier/`: a small MLP over four features (`model.onnx`, `labels.json`)
  for the `infer` task.

The builders (`build`, `minilm`, `tinycode`, `classifier`) import torch, so
only `lanes models build` and tests import them. This `__init__` imports
nothing, so torch-free demo handlers that the server loads (`labels`,
`guard`) can live here too; `lanes/__init__.py` does not import this package.
"""
