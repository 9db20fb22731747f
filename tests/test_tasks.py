"""lanes.tasks on tiny ONNX models built here with known outputs."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from lanes.errors import HandlerError, InvalidInput, ModelError
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import Completion, Decoder, SamplingParams, load_handler, load_task, sample
from lanes.tasks.base import encode
from lanes.tasks.embed import EmbedTask
from lanes.tasks.generate import GenerateTask
from lanes.tasks.infer import InferTask
from tests.flows_fixtures import decoder_model, sum_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def save(
    nodes: list[Any], inputs: list[Any], outputs: list[Any], path: Path, init: Any = ()
) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, initializer=list(init))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


def tensor(name: str, value: Any, dtype: Any = np.float32) -> Any:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def io(name: str, kind: int, shape: Sequence[int | str]) -> Any:
    return helper.make_tensor_value_info(name, kind, list(shape))


def spec_for(
    path: Path, task: str, tokenizer: Path | None = None, max_length: int = 256, **workload: Any
) -> Spec:
    return Spec.model_validate(
        {
            "models": {"m": {"path": path, "tokenizer": tokenizer, "max_length": max_length}},
            "workloads": {"w": {"mode": "interactive", "task": task, "model": "m", **workload}},
        }
    )


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime(Settings(device="cpu", threads=1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


class CountingSession:
    """Wraps a session to count model runs."""

    def __init__(self, session: Any) -> None:
        self.session, self.runs = session, 0

    def run(self, names: Any, feeds: Any, run_options: Any = None) -> Any:
        self.runs += 1
        return self.session.run(names, feeds, run_options)


# ---- infer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def affine(folder: Path) -> Path:
    """x float32 [batch, 3] -> y = 2x + 1 [batch, 3], total = sum(x, axis 1) [batch]."""
    return save(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Add", ["x2", "one"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axis1"], ["total"], keepdims=0),
        ],
        [io("x", F, ["batch", 3])],
        [io("y", F, ["batch", 3]), io("total", F, ["batch"])],
        folder / "affine.onnx",
        [tensor("two", 2.0), tensor("one", 1.0), tensor("axis1", [1], np.int64)],
    )


@pytest.fixture(scope="module")
def infer(affine: Path, runtime: Runtime) -> InferTask:
    task = load_task("w", spec_for(affine, "infer"), runtime)
    assert isinstance(task, InferTask)
    return task


def test_infer_output_is_exact(infer: InferTask) -> None:
    (out,) = infer.run([infer.prepare({"x": [[1, 2, 3]]})])  # ints become float32
    assert out["y"].tolist() == [[3.0, 5.0, 7.0]]
    assert out["total"].tolist() == [6.0]
    assert out["y"].dtype == np.float32


def test_an_unloaded_task_refuses_to_run_until_it_loads_again(
    affine: Path, runtime: Runtime
) -> None:
    task = load_task("w", spec_for(affine, "infer"), runtime)
    assert isinstance(task, InferTask)
    item = task.prepare({"x": [[1, 2, 3]]})  # preparing needs no session
    task.unload()
    assert not task.loaded
    with pytest.raises(ModelError, match="unloaded; load it first"):
        task.run([item])
    task.load()
    (out,) = task.run([item])
    assert out["y"].tolist() == [[3.0, 5.0, 7.0]]


def test_infer_batches_items_of_different_rows_in_one_run(
    infer: InferTask, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [1, 3, 2]
    xs = [np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 10 * i for i, n in enumerate(rows)]
    prepared = [infer.prepare({"x": x}) for x in xs]
    counting = CountingSession(infer.session)
    monkeypatch.setattr(infer.slot, "_session", counting)  # the task's session, counted
    outputs = infer.run(prepared)
    assert counting.runs == 1
    assert len(outputs) == 3
    for x, out in zip(xs, outputs, strict=True):
        np.testing.assert_array_equal(out["y"], 2 * x + 1)
        np.testing.assert_array_equal(out["total"], x.sum(axis=1))


def test_infer_stacks_items_of_one_shape_and_runs_other_shapes_apart(
    folder: Path, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A free dim after the rows (a sequence's length): a batch of requests of two
    # lengths cannot be one stack; as Triton's batcher, each length is its own run.
    ragged = save(
        [helper.make_node("Identity", ["x"], ["y"])],
        [io("x", F, ["batch", "length"])],
        [io("y", F, ["batch", "length"])],
        folder / "ragged.onnx",
    )
    task = load_task("w", spec_for(ragged, "infer"), runtime)
    assert isinstance(task, InferTask)
    xs = [
        np.full((rows, length), i, np.float32)
        for i, (rows, length) in enumerate([(1, 2), (2, 3), (1, 2)])
    ]
    prepared = [task.prepare({"x": x}) for x in xs]
    counting = CountingSession(task.session)
    monkeypatch.setattr(task.slot, "_session", counting)
    outputs = task.run(prepared)
    assert counting.runs == 2
    for x, out in zip(xs, outputs, strict=True):
        np.testing.assert_array_equal(out["y"], x)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({}, "missing input 'x'"),
        ({"x": [[1, 2, 3]], "z": [1]}, "unknown input 'z'"),
        ({"x": [["a", "b", "c"]]}, "input 'x': expected float32 values .* found strings"),
        ({"x": [1, 2, 3]}, r"input 'x': expected rank 2 \(shape \[batch, 3\]\), found shape \[3\]"),
        ({"x": [[1, 2, 3, 4]]}, "input 'x': .*dim 1 must be 3"),
        ({"x": [[1, 2, 3], [4, 5]]}, "input 'x': expected a rectangular array"),
        ({"x": np.zeros((0, 3))}, "at least one row"),
        # The model's one input, unnamed: its value must still be rows of 3.
        ([1, 2, 3], r"^input 'x': expected rank 2 \(shape \[batch, 3\]\), found shape \[3\]$"),
    ],
)
def test_infer_rejects_bad_inputs_naming_the_field(
    infer: InferTask, item: Any, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        infer.prepare(item)


def test_infer_takes_one_input_unnamed_and_several_by_name(
    infer: InferTask, folder: Path, runtime: Runtime
) -> None:
    (named,) = infer.run([infer.prepare({"x": [[1, 2, 3]]})])
    (alone,) = infer.run([infer.prepare([[1, 2, 3]])])
    assert alone["y"].tolist() == named["y"].tolist() == [[3.0, 5.0, 7.0]]
    pair = load_task("w", spec_for(sum_model(folder / "pair"), "infer"), runtime)
    (out,) = pair.run([pair.prepare({"a": [[1, 2]], "b": [[3, 4]]})])
    assert out["s"].tolist() == [[4.0, 6.0]]
    with pytest.raises(InvalidInput) as refused:
        pair.prepare([[1, 2]])
    assert str(refused.value) == (
        "input: workload 'w' takes 2 inputs ('a', 'b'): send a mapping of input name -> "
        "array, like {'a': [...], 'b': [...]}; found an array"
    )


def test_infer_refuses_floats_into_integers(folder: Path, runtime: Runtime) -> None:
    ids = save(
        [helper.make_node("Identity", ["ids"], ["out"])],
        [io("ids", I64, ["batch", 2])],
        [io("out", I64, ["batch", 2])],
        folder / "ids.onnx",
    )
    task = load_task("w", spec_for(ids, "infer"), runtime)
    (out,) = task.run([task.prepare({"ids": [[1, 2]]})])
    assert out["out"].dtype == np.int64
    with pytest.raises(InvalidInput, match=r"input 'ids': expected int64 values .* found floats"):
        task.prepare({"ids": [[1.5, 2.0]]})


def test_infer_names_what_a_string_input_was_given(folder: Path, runtime: Runtime) -> None:
    words = save(
        [helper.make_node("Identity", ["w"], ["out"])],
        [io("w", TensorProto.STRING, ["batch"])],
        [io("out", TensorProto.STRING, ["batch"])],
        folder / "words.onnx",
    )
    task = load_task("w", spec_for(words, "infer"), runtime)
    for value, found in [([1, 2], "integers"), ([True], "true/false values")]:
        with pytest.raises(InvalidInput, match=f"input 'w': expected .*, found {found}$"):
            task.prepare({"w": value})
    # numpy alone would make the numbers among strings strings ("1"): they are named.
    for value, found in [(["a", None], "null at (1,)"), ([1, "a"], "1 at (0,)")]:
        with pytest.raises(InvalidInput) as refused:
            task.prepare({"w": value})
        assert str(refused.value) == f"input 'w': expected strings, found {found}"
    with pytest.raises(InvalidInput, match=r"expected strings, found true at \(1,\)$"):
        task.prepare({"w": ["a", True]})


def test_infer_output_not_in_rows_is_a_model_error(folder: Path, runtime: Runtime) -> None:
    pooled = save(
        [helper.make_node("ReduceSum", ["x", "axis0"], ["s"], keepdims=1)],
        [io("x", F, ["batch", 2])],
        [io("s", F, [1, 2])],
        folder / "pooled.onnx",
        [tensor("axis0", [0], np.int64)],
    )
    task = load_task("w", spec_for(pooled, "infer"), runtime)
    items = [task.prepare({"x": [[1, 2]]}), task.prepare({"x": [[3, 4]]})]
    with pytest.raises(ModelError, match=r"output 's' has shape .* for 2 input rows"):
        task.run(items)


def test_infer_warm_up_runs(infer: InferTask) -> None:
    infer.warm_up()


# ---- handlers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier(folder: Path) -> Path:
    """features [batch, 4] -> logits = features @ W [batch, 3], W picks columns 0, 1, 2."""
    weights = np.zeros((4, 3), dtype=np.float32)
    weights[0, 0] = weights[1, 1] = weights[2, 2] = 1.0
    return save(
        [helper.make_node("MatMul", ["features", "W"], ["logits"])],
        [io("features", F, ["batch", 4])],
        [io("logits", F, ["batch", 3])],
        folder / "classifier.onnx",
        [tensor("W", weights)],
    )


def test_demo_labels_handler_pre_and_post(classifier: Path, runtime: Runtime) -> None:
    spec = spec_for(classifier, "infer", handler="lanes.demo.labels:handler")
    task = load_task("w", spec, runtime)
    flat = task.prepare([0.0, 5.0, 0.0, 9.0])  # a flat row of four numbers
    rows = task.prepare({"features": [[0, 0, 3, 0], [1, 0, 0, 0]]})
    one, two = task.run([flat, rows])
    assert [r["label"] for r in one] == ["versicolor"]
    assert [r["label"] for r in two] == ["virginica", "setosa"]
    expected = np.exp(5.0) / (np.exp(5.0) + 2.0)
    assert one[0]["score"] == pytest.approx(expected)
    with pytest.raises(InvalidInput, match="features: expected 4 numbers"):
        task.prepare({"features": [[1, 2, 3]]})
    # A V2 request's tensor arrives as an array: the error names its shape.
    with pytest.raises(InvalidInput, match=r"found a float32 tensor of shape \[1, 3\]$"):
        task.prepare({"features": np.zeros((1, 3), dtype=np.float32)})


def test_user_handler_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lanes_test_hooks.py").write_text(
        "class Hooks:\n"
        "    def pre(self, item):\n"
        "        return {'x': [[float(item['value'])] * 3]}\n"
        "hooks = Hooks()\n"
        "def post_only():\n"
        "    pass\n"
        "post_only.post = lambda out: out\n"
        "nothing = object()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    handler = load_handler("lanes_test_hooks:hooks")
    assert handler.before({"value": "2"}) == {"x": [[2.0, 2.0, 2.0]]}
    assert handler.after("unchanged") == "unchanged"  # no post: identity
    with pytest.raises(InvalidInput, match="lanes_test_hooks:hooks rejected the input"):
        handler.before({"value": "two"})  # pre's ValueError means a bad input
    assert load_handler("lanes_test_hooks:post_only").pre is None
    with pytest.raises(HandlerError, match="neither pre"):
        load_handler("lanes_test_hooks:nothing")
    with pytest.raises(HandlerError, match="has no attribute 'absent'"):
        load_handler("lanes_test_hooks:absent")
    sys.modules.pop("lanes_test_hooks", None)


def test_missing_handler_module_names_it() -> None:
    with pytest.raises(HandlerError, match="cannot import module 'no_such_module_for_lanes'"):
        load_handler("no_such_module_for_lanes:handler")


# ---- embed ------------------------------------------------------------------

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "a", "b", "c"]


def word_tokenizer(path: Path, words: Sequence[str], template: str | None) -> Path:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if template is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    tokenizer.save(str(path))
    return path


EMBEDDINGS = np.random.default_rng(0).standard_normal((len(WORDS), 4)).astype(np.float32)


@pytest.fixture(scope="module")
def encoder(folder: Path) -> Path:
    """hidden[t] = E[id_t] + masked mean of E over the sequence: the mask matters.

    Has a token_type_ids input (added to hidden, so zeros are required)."""
    return save(
        [
            helper.make_node("Gather", ["E", "input_ids"], ["emb"]),
            helper.make_node("Cast", ["attention_mask"], ["m"], to=F),
            helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
            helper.make_node("Mul", ["emb", "m3"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "axis1"], ["s"], keepdims=1),
            helper.make_node("ReduceSum", ["m3", "axis1"], ["n"], keepdims=1),
            helper.make_node("Div", ["s", "n"], ["ctx"]),
            helper.make_node("Add", ["emb", "ctx"], ["h0"]),
            helper.make_node("Cast", ["token_type_ids"], ["tt"], to=F),
            helper.make_node("Unsqueeze", ["tt", "axis2"], ["tt3"]),
            helper.make_node("Add", ["h0", "tt3"], ["last_hidden_state"]),
        ],
        [io(n, I64, ["batch", "seq"]) for n in ("input_ids", "attention_mask", "token_type_ids")],
        [io("last_hidden_state", F, ["batch", "seq", 4])],
        folder / "encoder.onnx",
        [tensor("E", EMBEDDINGS), tensor("axis1", [1], np.int64), tensor("axis2", [2], np.int64)],
    )


@pytest.fixture(scope="module")
def embed(encoder: Path, folder: Path, runtime: Runtime) -> EmbedTask:
    tokenizer = word_tokenizer(folder / "words.json", WORDS, "[CLS] $A [SEP]")
    spec = spec_for(encoder, "embed", tokenizer)
    task = load_task("w", spec, runtime)
    assert isinstance(task, EmbedTask)
    task.warm_up()
    return task


def test_embed_vector_is_the_masked_mean_normalised(embed: EmbedTask) -> None:
    item = embed.prepare("hello world")
    assert item.n_tokens == 4  # [CLS] hello world [SEP]: the tokenizer's own specials
    (vector,) = embed.run([item])
    rows = EMBEDDINGS[[2, 4, 5, 3]]
    expected = 2 * rows.mean(axis=0)  # mean of (E[t] + mean E)
    np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), rtol=1e-6)
    assert vector.dtype == np.float32


def test_embed_padding_does_not_change_a_vector(embed: EmbedTask) -> None:
    texts = ["hello", "a b c hello world world a", "world a", "unknown words here"]
    prepared = [embed.prepare(t) for t in texts]
    together = embed.run(prepared)
    for item, vector in zip(prepared, together, strict=True):
        (alone,) = embed.run([item])
        np.testing.assert_allclose(vector, alone, atol=1e-6)
        assert float(np.linalg.norm(vector)) == pytest.approx(1.0, abs=1e-6)


def test_embed_truncates_to_max_length_keeping_specials(
    encoder: Path, folder: Path, runtime: Runtime
) -> None:
    tokenizer = word_tokenizer(folder / "words.json", WORDS, "[CLS] $A [SEP]")
    spec = spec_for(encoder, "embed", tokenizer, max_length=4, truncate=True)
    task = load_task("w", spec, runtime)
    assert isinstance(task, EmbedTask)
    item = task.prepare("a b c a b c")
    assert item.ids.tolist() == [2, 6, 7, 3]
    assert task.prepare([2, 6, 7, 6, 7, 3]).ids.tolist() == [2, 6, 7, 6]  # ids: cut as given


def test_embed_refuses_text_over_max_length_unless_the_workload_truncates(
    encoder: Path, folder: Path, runtime: Runtime
) -> None:
    tokenizer = word_tokenizer(folder / "words.json", WORDS, "[CLS] $A [SEP]")
    task = load_task("w", spec_for(encoder, "embed", tokenizer, max_length=4), runtime)
    assert isinstance(task, EmbedTask)
    assert task.prepare("a b").n_tokens == 4  # [CLS] a b [SEP]: exactly the limit
    with pytest.raises(InvalidInput, match="maximum context length is 4 tokens") as refused:
        task.prepare("a b c")
    assert (refused.value.param, refused.value.code) == ("input", "context_length_exceeded")
    with pytest.raises(InvalidInput, match="maximum context length is 4 tokens"):
        task.prepare([2, 6, 7, 8, 3])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (3, "input: expected a string, found 3"),
        (None, "input: expected a string, found null"),
        ("", "^input: expected a non-empty string, found an empty one$"),
        (" \n\t", "^input: expected a non-empty string, found only whitespace$"),
        (["a"], r"^input: expected token ids \(integers\), found 'a' at \[0\]$"),
        ([4, None], r"^input: expected token ids \(integers\), found null at \[1\]$"),
        ([4, True], r"^input: expected token ids \(integers\), found true at \[1\]$"),
        ([4, 99], "token id 99 at .1. is outside the model's vocabulary"),
    ],
)
def test_embed_rejects_non_text(embed: EmbedTask, item: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        embed.prepare(item)


def test_embed_needs_its_inputs(affine: Path, folder: Path, runtime: Runtime) -> None:
    tokenizer = word_tokenizer(folder / "words.json", WORDS, None)
    with pytest.raises(ModelError, match="no input 'input_ids' and no input 'attention_mask'"):
        load_task("w", spec_for(affine, "embed", tokenizer), runtime)


def test_embed_refuses_a_decoder_at_load_naming_the_task_that_fits(
    folder: Path, runtime: Runtime
) -> None:
    model, tokenizer = decoder_model(folder / "decoder-as-embed")
    with pytest.raises(ModelError) as refused:
        load_task("w", spec_for(model, "embed", tokenizer), runtime)
    message = str(refused.value)
    assert "cannot serve task 'embed'" in message
    assert "position_ids, past_key_values.0.key, past_key_values.0.value" in message
    assert "declare `task: generate`" in message


def test_embed_refuses_an_encoder_with_an_input_it_cannot_feed(
    folder: Path, runtime: Runtime
) -> None:
    path = save(
        [helper.make_node("Gather", ["E", "input_ids"], ["last_hidden_state"])],
        [
            io("input_ids", I64, ["b", "t"]),
            io("attention_mask", I64, ["b", "t"]),
            io("pixel_values", F, ["b", 3]),
        ],
        [io("last_hidden_state", F, ["b", "t", 2])],
        folder / "extra-input.onnx",
        [tensor("E", np.ones((len(WORDS), 2)))],
    )
    tokenizer = word_tokenizer(folder / "words.json", WORDS, None)
    with pytest.raises(ModelError, match=r"also requires pixel_values; declare `task: infer`"):
        load_task("w", spec_for(path, "embed", tokenizer), runtime)


# ---- generate ---------------------------------------------------------------

VOCAB = ["<eos>", "a", "b", "c", "d", "[UNK]"]
# Bigram logits: a -> b -> c -> d -> <eos>, with a soft second choice for sampling.
BIGRAM = np.full((6, 6), -5.0, dtype=np.float32)
for _src, _dst in ((1, 2), (2, 3), (3, 4), (4, 0), (0, 0), (5, 0)):
    BIGRAM[_src, _dst] = 5.0
BIGRAM[1, 3] = 4.0


@pytest.fixture(scope="module")
def decoder_dir(folder: Path) -> Path:
    """One layer, one head, head_dim 2; logits = BIGRAM[input_ids]; the KV cache is
    Concat(past, K[input_ids]) so its length is checkable."""
    out = folder / "decoder"
    out.mkdir()
    keys = np.arange(12, dtype=np.float32).reshape(6, 2)
    save(
        [
            helper.make_node("Gather", ["L", "input_ids"], ["logits"]),
            helper.make_node("Gather", ["K", "input_ids"], ["k"]),
            helper.make_node("Unsqueeze", ["k", "axis1"], ["k4"]),
            helper.make_node("Concat", ["past_key_values.0.key", "k4"], ["present.0.key"], axis=2),
            helper.make_node(
                "Concat", ["past_key_values.0.value", "k4"], ["present.0.value"], axis=2
            ),
        ],
        [
            io("input_ids", I64, ["batch", "seq"]),
            io("attention_mask", I64, ["batch", "total"]),
            io("position_ids", I64, ["batch", "seq"]),
            io("past_key_values.0.key", F, ["batch", 1, "past", 2]),
            io("past_key_values.0.value", F, ["batch", 1, "past", 2]),
        ],
        [
            io("logits", F, ["batch", "seq", 6]),
            io("present.0.key", F, ["batch", 1, "total", 2]),
            io("present.0.value", F, ["batch", 1, "total", 2]),
        ],
        out / "model.onnx",
        [tensor("L", BIGRAM), tensor("K", keys), tensor("axis1", [1], np.int64)],
    )
    word_tokenizer(out / "tokenizer.json", VOCAB, None)
    config = {"eos_token_id": 0, "num_layers": 1, "num_heads": 1, "head_dim": 2}
    (out / "config.json").write_text(json.dumps({**config, "max_position": 64}))
    return out


@pytest.fixture(scope="module")
def generate(decoder_dir: Path, runtime: Runtime) -> GenerateTask:
    spec = spec_for(
        decoder_dir / "model.onnx",
        "generate",
        decoder_dir / "tokenizer.json",
        generation={"max_new_tokens": 8, "temperature": 0},
    )
    task = load_task("w", spec, runtime)
    assert isinstance(task, GenerateTask)
    task.warm_up()
    return task


def test_decoder_reads_its_shape_and_steps_on_the_cache(generate: GenerateTask) -> None:
    decoder = generate.decoder
    assert (decoder.config.num_layers, decoder.config.num_heads, decoder.config.head_dim) == (
        1,
        1,
        2,
    )
    assert decoder.config.eos_token_ids == frozenset({0})
    past = decoder.empty_past(2)
    ids = np.array([[1, 2, 3], [2, 3, 4]])
    first = decoder.step(ids, np.ones((2, 3)), np.tile(np.arange(3), (2, 1)), past)
    assert first.logits.shape == (2, 3, 6) and first.present.length == 3
    second = decoder.step(
        np.array([[4], [1]]), np.ones((2, 4)), np.array([[3], [3]]), first.present
    )
    assert second.present.length == 4
    np.testing.assert_array_equal(second.present.keys[0][:, :, :3], first.present.keys[0])
    with pytest.raises(ValueError, match=r"need attention_mask \(2, 5\)"):
        decoder.step(np.array([[4], [1]]), np.ones((2, 4)), np.array([[4], [4]]), second.present)


def test_generate_greedy_stops_at_eos_using_one_token_steps(generate: GenerateTask) -> None:
    decoder = generate.decoder
    counting = CountingSession(decoder.session)
    seen: list[tuple[int, ...]] = []
    real_run = counting.run

    def run(names: Any, feeds: Any) -> Any:
        seen.append(feeds["input_ids"].shape)
        return real_run(names, feeds)

    counting.run = run  # type: ignore[method-assign]
    decoder.session = counting  # type: ignore[assignment]
    try:
        completion = decoder.generate("a", max_new_tokens=10, temperature=0)
    finally:
        decoder.session = counting.session
    assert completion == Completion("b c d", [2, 3, 4], "stop", prompt_tokens=1, stop_token=0)
    assert completion.completion_tokens == 4  # the eos too, as vLLM counts it
    assert seen == [(1, 1), (1, 1), (1, 1), (1, 1)]  # prefill, then one token per step


def test_generate_task_defaults_length_and_stop(generate: GenerateTask) -> None:
    items = ["a b", {"prompt": "a", "max_tokens": 2}, {"prompt": "a", "stop": "c"}]
    by_default, short, stopped = generate.run([generate.prepare(i) for i in items])
    assert (by_default.text, by_default.finish_reason) == ("c d", "stop")
    assert (short.text, short.tokens, short.finish_reason) == ("b c", [2, 3], "length")
    assert (stopped.text, stopped.finish_reason) == ("b ", "stop")


def test_generate_sampling_is_seeded(generate: GenerateTask) -> None:
    item = {"prompt": "a", "temperature": 1.5, "seed": 7, "max_tokens": 4}
    runs = [generate.run([generate.prepare(item)])[0].tokens for _ in range(2)]
    assert runs[0] == runs[1]
    # OpenAI's seeds are signed: a negative one is a seed like any other (numpy's are not).
    negative = {**item, "seed": -(2**63)}
    runs = [generate.run([generate.prepare(negative)])[0].tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_generate_takes_token_ids_as_a_prompt(generate: GenerateTask) -> None:
    from_ids = generate.prepare({"prompt": [1]})
    assert from_ids.prompt_ids == (1,) and from_ids.prompt == "a"
    assert generate.complete(from_ids) == generate.complete(generate.prepare("a"))


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"prompt": "a", "temperature": -1}, "temperature: "),
        ({"prompt": "a", "max_tokens": 1.5}, "max_tokens: "),
        ({"prompt": "a", "top_p": 1.5}, "top_p: expected a value <= 1"),
        # The request's range (the spec's generation: takes up to 10).
        ({"prompt": "a", "temperature": 5}, "^temperature: expected a value <= 2, found 5$"),
        ({"prompt": "a", "seed": "x"}, "seed: expected an integer"),
        ({"prompt": "a", "n": 2}, "unknown field 'n'"),
        ({"max_tokens": 2}, "prompt: expected a string or token ids, found null"),
        ({"prompt": [1, 99]}, r"prompt: expected token ids from 0 to 5, found 99 at \[1\]"),
        ({"prompt": "a", "max_tokens": 64}, "maximum context length is 64 tokens"),
        # A prompt that fills the context alone, without max_tokens: no room for a token.
        ({"prompt": " ".join(["a"] * 64)}, r"64 in the prompt, at least 1 for the completion"),
        ({"prompt": [1] * 64}, r"64 in the prompt, at least 1 for the completion"),
        (7, "^input: expected a prompt string or an object with 'prompt', found 7$"),
        ([1], "^input: expected a prompt string or an object with 'prompt', found an array$"),
    ],
)
def test_generate_rejects_bad_requests(generate: GenerateTask, item: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        generate.prepare(item)


def test_decoder_config_disagreeing_with_the_model_is_an_error(
    decoder_dir: Path, runtime: Runtime, tmp_path: Path
) -> None:
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes((decoder_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"head_dim": 8, "eos_token_id": 0}))
    spec = spec_for(tmp_path / "model.onnx", "generate", tmp_path / "tokenizer.json")
    with pytest.raises(ModelError, match=r"head_dim=8 but input past_key_values\.0\.key has 2"):
        Decoder.load(spec.models["m"], runtime)


# ---- sampling ---------------------------------------------------------------


def test_sample_is_greedy_at_zero_and_cut_by_top_k_and_top_p() -> None:
    logits = np.array([0.0, 3.0, 2.9, -1.0])
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(temperature=0), rng) == 1
    assert {sample(logits, SamplingParams(1.0, top_k=1), rng) for _ in range(20)} == {1}
    assert {sample(logits, SamplingParams(1.0, top_p=0.1), rng) for _ in range(20)} == {1}
    top2 = {sample(logits, SamplingParams(1.0, top_k=2), rng) for _ in range(200)}
    assert top2 == {1, 2}
    assert {sample(logits, SamplingParams(1.0, top_p=0), rng) for _ in range(20)} == {1}
    with pytest.raises(ValueError, match="0 <= top_p <= 1"):
        SamplingParams(top_p=1.5)


def test_top_k_draws_as_if_the_rest_were_masked() -> None:
    """As vLLM (which masks the logits outside the top k): the kept tokens are drawn in
    the vocabulary's order, so a seeded draw depends on which tokens are kept and their
    probabilities, never on where argpartition happened to put them. (A row batched
    with others differs from its lone self in its last bits; that reshuffled
    argpartition's output, and a seeded request drew another token.)"""
    logits = np.random.default_rng(0).normal(0, 3, size=1024)
    for top_k in (2, 40, 1000):
        kept = np.argpartition(logits, -top_k)[-top_k:]
        masked = np.full_like(logits, -np.inf)
        masked[kept] = logits[kept]
        for seed in range(20):
            cut = sample(logits, SamplingParams(1.0, top_k=top_k), np.random.default_rng(seed))
            whole = sample(masked, SamplingParams(1.0), np.random.default_rng(seed))
            assert cut == whole, (top_k, seed)


def test_decoder_prepends_bos_from_config(
    decoder_dir: Path, runtime: Runtime, tmp_path: Path
) -> None:
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes((decoder_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    spec = spec_for(tmp_path / "model.onnx", "generate", tmp_path / "tokenizer.json")
    decoder = Decoder.load(spec.models["m"], runtime)
    assert decoder.encode("b c") == [1, 2, 3]
    assert decoder.encode("a b") == [1, 2]  # already starts with bos
    assert decoder.encode("") == [1]


def test_tokenizing_a_long_text_lets_other_threads_run(demo_models: Path) -> None:
    """`encode` lets go of the GIL while it tokenizes, so a server that prepares a large
    body on a thread keeps its event loop serving. Another thread counts the turns it
    gets while a long non-ASCII text is tokenized: holding the GIL throughout, it got
    one or two, as the tokenizer returned; letting go, hundreds here."""
    tokenizer = Tokenizer.from_file(str(demo_models / "tinycode" / "tokenizer.json"))
    text = "é " * 200_000
    encoding, done = threading.Event(), threading.Event()
    turns = 0

    def count() -> None:
        nonlocal turns
        while not done.is_set() and turns < 1_000_000:
            time.sleep(0.0005)
            turns += encoding.is_set()

    counter = threading.Thread(target=count)
    counter.start()
    try:
        encoding.set()
        ids = encode(tokenizer, text)
        encoding.clear()
    finally:
        done.set()
        counter.join(timeout=60)
    assert len(ids) >= 200_000
    assert turns >= 10
