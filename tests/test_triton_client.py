"""Open Inference v2 as Triton's own client speaks it: the official `tritonclient[http]`
against a real uvicorn on 127.0.0.1, with binary tensor data (its default) and with
JSON, on tiny real ONNX models whose answers are known."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import yaml
from onnx import TensorProto, helper, save_model
from tritonclient.utils import InferenceServerException

import lanes
from lanes.runtime import Runtime
from lanes.serving.app import route_label
from lanes.settings import Settings
from lanes.tasks import load_task
from tests.flows_fixtures import embed_model, infer_model, text
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

KEY = "triton-key"
BLOB = b"\xff\x00"  # not UTF-8, and ends in a zero byte
X = np.array([[1.5, -2.0, 0.25, 4.0], [0.0, 1.0, 2.0, 3.0]], dtype=np.float32)
KINDS = {  # the kinds model: each input comes back as the output of the same name
    "half": (TensorProto.FLOAT16, "FP16", np.array([[0.5, -1.25], [3.0, 0.0]], np.float16)),
    "flag": (TensorProto.BOOL, "BOOL", np.array([True, False])),
    "count": (TensorProto.INT32, "INT32", np.array([-7, 2**31 - 1], np.int32)),
    "word": (TensorProto.STRING, "BYTES", np.array(["café ☕", ""], dtype=object)),
}


class Tagged:
    """An affine workload's `post`: its output plus strings (a scalar and a list) and bytes."""

    @staticmethod
    def post(output: dict[str, Any]) -> dict[str, Any]:
        return {"y": output["y"], "tag": "affine ✓", "notes": ["two", "notes"], "blob": BLOB}


tagged = Tagged()


def kinds_model(folder: Path) -> Path:
    """Identity for an FP16, a BOOL, an INT32 and a string tensor, each with rows first."""
    folder.mkdir(parents=True, exist_ok=True)
    io = helper.make_tensor_value_info
    shapes = {name: ["batch", *([2] if name == "half" else [])] for name in KINDS}
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in KINDS],
        "kinds",
        [io(n, kind, shapes[n]) for n, (kind, _, _) in KINDS.items()],
        [io(f"{n}_out", kind, shapes[n]) for n, (kind, _, _) in KINDS.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("triton")
    enc, tokenizer = embed_model(folder / "models" / "enc")
    spec = {
        "version": 1,
        "models": {
            "affine": {"path": str(infer_model(folder / "models" / "affine"))},
            "kinds": {"path": str(kinds_model(folder / "models" / "kinds"))},
            "enc": {"path": str(enc), "tokenizer": str(tokenizer)},
        },
        "workloads": {
            "affine": {"mode": "interactive", "task": "infer", "model": "affine"},
            "kinds": {"mode": "interactive", "task": "infer", "model": "kinds"},
            "tagged": {
                "mode": "interactive",
                "task": "infer",
                "model": "affine",
                "handler": "tests.test_triton_client:tagged",
            },
            "words": {"mode": "interactive", "task": "embed", "model": "enc"},
        },
    }
    path = folder / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def server(spec_path: Path) -> Iterator[ServerThread]:
    with ServerThread(spec_path, api_key=KEY, max_body_bytes=64 * 1024) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


AUTH = {"Authorization": f"Bearer {KEY}"}


def auth() -> dict[str, str]:
    """A fresh headers dict per call: tritonclient writes its own headers into the one given."""
    return dict(AUTH)


def tensor(name: str, array: np.ndarray[Any, Any], datatype: str, binary: bool) -> Any:
    t = triton.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array, binary_data=binary)
    return t


def refused(call: Any) -> InferenceServerException:
    """The error a tritonclient call raised: the server's message, decoded from v2's shape."""
    with pytest.raises(InferenceServerException) as caught:
        call()
    error = caught.value
    assert isinstance(error.message(), str), error
    assert not error.message().startswith("an exception occurred in the client"), error
    return error


# ---- binary tensor data ----------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_as_tritonclient_sends_it(client: Any, binary: bool) -> None:
    x = tensor("x", X, "FP32", binary)
    # No outputs named: tritonclient asks for all of them, in binary.
    everything = client.infer("affine", [x], headers=auth())
    assert np.array_equal(everything.as_numpy("y"), 2 * X + 1)
    asked = triton.InferRequestedOutput("y", binary_data=binary)
    one = client.infer("affine", [x], outputs=[asked], headers=auth(), request_id="r-7")
    assert np.array_equal(one.as_numpy("y"), 2 * X + 1)
    answer = one.get_response()
    assert answer["id"] == "r-7" and answer["model_version"] == "1"
    assert ("parameters" in answer["outputs"][0]) == binary  # binary_data_size
    # Triton's timeout 0 is no timeout, its default.
    unbounded = client.infer("affine", [x], headers=auth(), timeout=0)
    assert np.array_equal(unbounded.as_numpy("y"), 2 * X + 1)


@pytest.mark.parametrize(
    ("in_binary", "out_binary"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_every_datatype_round_trips(client: Any, in_binary: bool, out_binary: bool) -> None:
    inputs = [tensor(n, a, datatype, in_binary) for n, (_, datatype, a) in KINDS.items()]
    outputs = [triton.InferRequestedOutput(f"{n}_out", binary_data=out_binary) for n in KINDS]
    result = client.infer("kinds", inputs, outputs=outputs, headers=auth())
    for name, (_, datatype, sent) in KINDS.items():
        got = result.as_numpy(f"{name}_out")
        assert result.get_output(f"{name}_out")["datatype"] == datatype
        if datatype == "BYTES":  # binary BYTES come back as bytes, JSON ones as str
            got = np.array([g.decode() if isinstance(g, bytes) else g for g in got], object)
        assert got.dtype == sent.dtype and np.array_equal(got, sent), name


def test_embed_takes_texts_as_binary_bytes(client: Any, server: ServerThread) -> None:
    texts = np.array([text(3).encode(), text(8).encode()], dtype=object)
    result = client.infer("words", [tensor("text", texts, "BYTES", True)], headers=auth())
    task = load_task("words", server.spec, Runtime(Settings()))
    expected = task.run([task.prepare(t.decode()) for t in texts])
    assert np.allclose(result.as_numpy("embedding"), np.stack(expected), atol=1e-6)


def post(server: ServerThread, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, headers={**AUTH, **headers}, timeout=30)


def binary_body(inputs: list[dict[str, Any]], *blobs: bytes) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": inputs})
    return header + b"".join(blobs), str(len(header))


def x_input(size: int, datatype: str = "FP32") -> dict[str, Any]:
    return {
        "name": "x",
        "shape": [2, 4],
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


BAD_BINARY: list[tuple[str, list[dict[str, Any]], bytes, str]] = [
    ("short", [x_input(31)], X.tobytes()[:31], "is 32 bytes, found parameters.binary_data_size 31"),
    ("long", [x_input(36)], X.tobytes() + b"1234", "is 32 bytes"),
    ("past the end", [x_input(64)], X.tobytes(), "only 32 bytes of binary data are left"),
    ("negative", [x_input(-1)], b"", "binary_data_size: expected a byte count"),
    (
        "both",
        [{**x_input(32), "data": X.ravel().tolist()}],
        X.tobytes(),
        "both data and parameters.binary_data_size",
    ),
    (
        "bytes cut",
        [
            {
                "name": "word",
                "shape": [1],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": 6},
            }
        ],
        (9).to_bytes(4, "little") + b"ab",
        "BYTES element 0 claims 9 bytes, but only 2",
    ),
    (
        "bytes count",
        [
            {
                "name": "word",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": 5},
            }
        ],
        (1).to_bytes(4, "little") + b"a",
        "needs 2 BYTES elements, found 1",
    ),
]


@pytest.mark.parametrize(
    ("inputs", "blob", "message"), [b[1:] for b in BAD_BINARY], ids=[b[0] for b in BAD_BINARY]
)
def test_binary_data_that_disagrees_with_its_shape_is_a_400_naming_the_input(
    server: ServerThread, inputs: list[dict[str, Any]], blob: bytes, message: str
) -> None:
    body, length = binary_body(inputs, blob)
    answer = post(
        server, "/v2/models/affine/infer", body, **{"Inference-Header-Content-Length": length}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert f"inputs.{inputs[0]['name']}" in error and message in error, error


def test_binary_framing_errors_are_400s(server: ServerThread) -> None:
    body, length = binary_body([x_input(32)], X.tobytes(), X.tobytes())
    path = "/v2/models/affine/infer"
    for header, expected in [
        (length, "body: 32 bytes after the JSON header that no input"),  # one tensor too many
        (str(len(body) + 1), "Inference-Header-Content-Length: expected the size"),
        ("ten", "Inference-Header-Content-Length: expected the size"),
        (None, "needs an Inference-Header-Content-Length header"),
    ]:
        headers = {} if header is None else {"Inference-Header-Content-Length": header}
        answer = post(server, path, body, **headers)
        assert answer.status_code == 400 and expected in answer.json()["error"], answer.text
    # A BOOL byte other than 0 or 1.
    flag = {"name": "flag", "shape": [1], "datatype": "BOOL", "parameters": {"binary_data_size": 1}}
    body, length = binary_body([flag], b"\x07")
    answer = post(
        server, "/v2/models/kinds/infer", body, **{"Inference-Header-Content-Length": length}
    )
    assert answer.status_code == 400 and "inputs.flag" in answer.json()["error"]


def test_text_that_is_not_utf8_is_a_400(client: Any) -> None:
    bad = np.array([BLOB], dtype=object)
    kinds = [tensor(n, a[:1], d, True) for n, (_, d, a) in KINDS.items() if n != "word"]
    for workload, inputs, message in [
        # a string model input, and an embed workload's texts
        (
            "kinds",
            [*kinds, tensor("word", bad, "BYTES", True)],
            "input 'word': element (0,) is not",
        ),
        ("words", [tensor("text", bad, "BYTES", True)], "inputs.text.data[0]: expected"),
    ]:
        error = refused(lambda: client.infer(workload, inputs, headers=auth()))  # noqa: B023
        assert error.status() == "400" and f"{message} UTF-8 text" in error.message(), error


def test_a_string_input_that_holds_no_string_says_what_it_found_in_json_s_words(
    server: ServerThread,
) -> None:
    inputs = [
        {"name": n, "shape": [2, *a.shape[1:]], "datatype": d, "data": a.ravel().tolist()}
        for n, (_, d, a) in KINDS.items()
    ]
    for data, found in [
        ([None, "a"], "null at (0,)"),
        (["a", {"b": 1}], "an object at (1,)"),
        ([1, "a"], "1 at (0,)"),
        (["a", 2.5], "2.5 at (1,)"),
    ]:
        inputs[-1]["data"] = data
        answer = post(server, "/v2/models/kinds/infer", orjson.dumps({"inputs": inputs}))
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == f"input 'word': expected strings, found {found}"


def test_the_sdk_sends_a_number_among_strings_as_the_number(
    server: ServerThread, spec_path: Path
) -> None:
    """numpy would make the list's 1 the string "1" before it left the client."""
    inputs: dict[str, Any] = {n: a.tolist() for n, (_, _, a) in KINDS.items()}
    inputs["word"] = [1, "a"]
    client = lanes.Client(server.url, api_key=KEY, spec=spec_path)
    with client, pytest.raises(lanes.InvalidInput) as caught:
        client.call("kinds", inputs)
    assert str(caught.value) == "input 'word': expected strings, found 1 at (0,)"


def test_the_body_limit_applies_to_binary_bodies(client: Any) -> None:
    big = np.zeros((3000, 4), dtype=np.float32)  # 48 kB of tensor: fine
    assert client.infer("affine", [tensor("x", big, "FP32", True)], headers=auth()).as_numpy(
        "y"
    ).shape == (3000, 4)
    huge = np.zeros((5000, 4), dtype=np.float32)  # 80 kB: over the server's 64 KiB
    error = refused(
        lambda: client.infer("affine", [tensor("x", huge, "FP32", True)], headers=auth())
    )
    assert error.status() == "413" and "over the limit" in error.message()


# ---- versioned paths -------------------------------------------------------------------


def test_versioned_paths_serve_version_1(client: Any) -> None:
    x = tensor("x", X, "FP32", True)
    result = client.infer("affine", [x], model_version="1", headers=auth())
    assert np.array_equal(result.as_numpy("y"), 2 * X + 1)
    meta = client.get_model_metadata("affine", model_version="1", headers=auth())
    assert meta["versions"] == ["1"] and meta["inputs"][0]["name"] == "x"
    assert client.is_model_ready("affine", model_version="1", headers=auth())
    for call in (
        lambda: client.infer("affine", [x], model_version="2", headers=auth()),
        lambda: client.get_model_metadata("affine", model_version="2", headers=auth()),
    ):
        error = refused(call)
        assert error.status() == "404" and "version '2'" in error.message()
    assert not client.is_model_ready("affine", model_version="2", headers=auth())


# ---- metadata describes what infer answers -------------------------------------------


def test_metadata_lists_the_model_s_inputs_and_outputs(client: Any) -> None:
    meta = client.get_model_metadata("kinds", headers=auth())
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("half", "FP16", [-1, 2]),
        ("flag", "BOOL", [-1]),
        ("count", "INT32", [-1]),
        ("word", "BYTES", [-1]),
    ]
    assert [o["name"] for o in meta["outputs"]] == [f"{n}_out" for n in KINDS]
    embed = client.get_model_metadata("words", headers=auth())
    assert [o["name"] for o in embed["outputs"]] == ["embedding"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_handler_s_strings_are_bytes_tensors_and_its_metadata_says_so(
    client: Any, binary: bool
) -> None:
    meta = client.get_model_metadata("tagged", headers=auth())
    assert meta["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [-1, -1]},
        {"name": "tag", "datatype": "BYTES", "shape": []},
        {"name": "notes", "datatype": "BYTES", "shape": [-1]},
        {"name": "blob", "datatype": "BYTES", "shape": []},
    ]
    x = tensor("x", X, "FP32", binary)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("y", "tag", "notes")]
    result = client.infer("tagged", [x], outputs=outputs, headers=auth())
    assert np.array_equal(result.as_numpy("y"), 2 * X + 1)
    tag, notes = result.as_numpy("tag"), result.as_numpy("notes")
    decode = np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else v, otypes=[object])
    assert decode(tag).item() == "affine ✓" and list(decode(notes)) == ["two", "notes"]
    blob = [triton.InferRequestedOutput("blob", binary_data=binary)]
    if binary:  # bytes as they are, trailing zero included
        got = client.infer("tagged", [x], outputs=blob, headers=auth()).as_numpy("blob")
        assert got.item() == BLOB
    else:  # JSON cannot carry them: the error says how to ask
        error = refused(lambda: client.infer("tagged", [x], outputs=blob, headers=auth()))
        assert error.status() == "400" and "parameters.binary_data: true" in error.message()


def test_a_handler_s_string_is_a_bytes_tensor_in_plain_json(server: ServerThread) -> None:
    x = {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": X.ravel().tolist()}
    answer = httpx.post(
        f"{server.url}/v2/models/tagged/infer",
        json={"inputs": [x], "outputs": [{"name": "tag"}, {"name": "notes"}]},
        headers=AUTH,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"] == [
        {"name": "tag", "datatype": "BYTES", "shape": [], "data": ["affine ✓"]},
        {"name": "notes", "datatype": "BYTES", "shape": [2], "data": ["two", "notes"]},
    ]


def test_a_requested_output_that_does_not_exist_is_a_400(client: Any) -> None:
    x = tensor("x", X, "FP32", True)
    for workload, outputs in [("affine", "'y'"), ("tagged", "'y', 'tag', 'notes', 'blob'")]:
        asked = [triton.InferRequestedOutput("y"), triton.InferRequestedOutput("z")]
        error = refused(lambda: client.infer(workload, [x], outputs=asked, headers=auth()))  # noqa: B023
        assert error.status() == "400"
        assert "no output 'z'" in error.message() and f"its outputs: {outputs}" in error.message()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_an_input_s_datatype_must_be_the_model_s(client: Any, binary: bool) -> None:
    for array, given in [(X.astype(np.float64), "FP64"), (X.astype(np.int64), "INT64")]:
        x = tensor("x", array, given, binary)
        error = refused(lambda: client.infer("affine", [x], headers=auth()))  # noqa: B023
        assert error.status() == "400"
        assert error.message() == f"inputs.x.datatype: the model takes FP32, found {given}"


# ---- errors ----------------------------------------------------------------------------

GOOD_X = {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": X.ravel().tolist()}
# A body that does not fit the protocol, and its whole answer: the field as the request
# spells it, what was expected and what was found, in JSON's words.
BAD_JSON: list[tuple[bytes, str]] = [
    (b"[]", "body: expected an object, found an array"),
    (b"{}", "inputs: missing required parameter"),
    (b'{"inputs": []}', "inputs: expected at least one item, found an empty array"),
    (b'{"inputs": {}}', "inputs: expected an array, found an object"),
    (
        b'{"inputs": [{"shape": [1], "datatype": "FP32"}]}',
        "inputs[0].name: missing required parameter",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "shape": "2x4"}]}),
        "inputs.x.shape: expected an array, found '2x4'",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "shape": [2, 1.5]}]}),
        "inputs.x.shape[1]: expected an integer, found 1.5",
    ),
    # A dim is an integer: pydantic's lax mode would have read each of these as 1.
    (
        orjson.dumps({"inputs": [{**GOOD_X, "shape": [True, 4]}]}),
        "inputs.x.shape[0]: expected an integer, found true",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "shape": [2, "4"]}]}),
        "inputs.x.shape[1]: expected an integer, found '4'",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "shape": [2.0, 4]}]}),
        "inputs.x.shape[0]: expected an integer, found 2.0",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "name": 1}]}),
        "inputs[0].name: expected a string, found 1",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "datatype": True}]}),
        "inputs.x.datatype: expected a string, found true",
    ),
    (
        orjson.dumps({"inputs": [GOOD_X], "outputs": [{"name": 0}]}),
        "outputs[0].name: expected a string, found 0",
    ),
    (
        b'{"inputs": [{"name": "x", "shape": [100000000000000000000000], "datatype": "FP32"}]}',
        "inputs.x.shape[0]: expected an integer of at most 64 bits, found 1e+23",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "datatype": None}]}),
        "inputs.x.datatype: expected a string, found null",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "data": 5}]}),
        "inputs.x.data: expected an array, found 5",
    ),
    (orjson.dumps({"inputs": [GOOD_X], "id": 7}), "id: expected a string, found 7"),
    (
        orjson.dumps({"inputs": [GOOD_X], "parameters": []}),
        "parameters: expected an object, found an array",
    ),
    (
        orjson.dumps({"inputs": [GOOD_X], "outputs": [{}]}),
        "outputs[0].name: missing required parameter",
    ),
    (
        orjson.dumps({"inputs": [{**GOOD_X, "parameters": {"binary_data_size": "32"}}]}),
        "inputs.x.parameters.binary_data_size: expected a byte count >= 0, found '32'",
    ),
    (
        orjson.dumps({"inputs": [GOOD_X], "parameters": {"binary_data_output": None}}),
        "parameters.binary_data_output: expected true or false, found null",
    ),
]


@pytest.mark.parametrize(("body", "message"), BAD_JSON)
def test_a_body_that_does_not_fit_the_protocol_is_a_400_in_our_words(
    server: ServerThread, body: bytes, message: str
) -> None:
    answer = post(server, "/v2/models/affine/infer", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["error"] == message
    assert error["param"] == message.split(": ")[0] and error["code"], error
    for leak in ("should be", "Field required", "pydantic", "None", "NoneType"):
        assert leak not in message


COUNT = {"name": "count", "shape": [2], "datatype": "INT32"}
HALF = {"name": "half", "shape": [2, 2], "datatype": "FP16", "data": [0.5, 1, 2, 3]}
FLAG = {"name": "flag", "shape": [2], "datatype": "BOOL", "data": [True, False]}
WORD = {"name": "word", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}
# JSON data of the wrong JSON type, which numpy would have read as numbers, and an
# integer past its datatype's range: each a 400 naming the value, as Triton refuses them.
WRONG_TYPES: list[tuple[str, dict[str, Any], str]] = [
    (
        "affine",
        {**GOOD_X, "data": ["1.5", *X.ravel().tolist()[1:]]},
        "inputs.x.data: expected numbers for FP32, found '1.5' at [0]",
    ),
    (
        "affine",
        {**GOOD_X, "data": [*X.ravel().tolist()[:7], True]},
        "inputs.x.data: expected numbers for FP32, found true at [7]",
    ),
    (
        "kinds",
        {**COUNT, "data": [1, 2**31]},
        "inputs.count.data: expected INT32 values (integers from -2147483648 to 2147483647)",
    ),
]


@pytest.mark.parametrize(("workload", "x", "message"), WRONG_TYPES)
def test_json_data_of_the_wrong_type_is_a_400_naming_the_value(
    server: ServerThread, workload: str, x: dict[str, Any], message: str
) -> None:
    others = [HALF, FLAG, {**COUNT, "data": [1, 2]}, WORD] if workload == "kinds" else []
    inputs = [x, *[o for o in others if o["name"] != x["name"]]]
    answer = post(server, f"/v2/models/{workload}/infer", orjson.dumps({"inputs": inputs}))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == message
    # The same numbers as numbers are served.
    good = {**x, "data": [1.5, *X.ravel().tolist()[1:]]} if workload == "affine" else None
    if good is not None:
        ok = post(server, f"/v2/models/{workload}/infer", orjson.dumps({"inputs": [good]}))
        assert ok.status_code == 200, ok.text


def test_ragged_json_data_is_a_400_saying_which_rows_differ(server: ServerThread) -> None:
    rows = [[1.5, 2.0, 0.25, 4.0], [0.0, 1.0, 2.0], [1.0] * 4]
    body = {"inputs": [{**GOOD_X, "shape": [3, 4], "data": rows}]}
    answer = post(server, "/v2/models/affine/infer", orjson.dumps(body))
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["param"] == "inputs.x.data", error
    detail = "expected rows of one length, found 4 values at [0] and 3 values at [1]"
    assert error["error"] == f"inputs.x.data: {detail}", error


TEXT = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}
# An error about one input or output names it as the client sent it, `inputs.<name>`,
# in its `param` wherever it is found (the body's shape, its data, the model's check),
# and the message opens with that param (the model's check, shared with offline
# records, says "input 'x'"); only a tensor without a usable name is named by its place.
PARAMS: list[tuple[str, dict[str, Any], str, str]] = [
    ("affine", {"inputs": [{**GOOD_X, "shape": [2, 1.5]}]}, "inputs.x.shape[1]", ""),
    ("affine", {"inputs": [{**GOOD_X, "data": 5}]}, "inputs.x.data", ""),
    ("affine", {"inputs": [{**GOOD_X, "datatype": "FP64"}]}, "inputs.x.datatype", ""),
    ("affine", {"inputs": [{**GOOD_X, "datatype": "NOPE"}]}, "inputs.x.datatype", ""),
    (
        "affine",
        {"inputs": [{**GOOD_X, "data": ["1.5", *X.ravel().tolist()[1:]]}]},
        "inputs.x.data",
        "",
    ),
    ("affine", {"inputs": [{**GOOD_X, "shape": [3, 4]}]}, "inputs.x", ""),
    ("affine", {"inputs": [GOOD_X, GOOD_X]}, "inputs.x", ""),
    ("affine", {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32"}]}, "inputs.x", ""),
    ("affine", {"inputs": [GOOD_X], "outputs": [{"name": "z"}]}, "outputs.z", ""),
    ("affine", {"inputs": [{**GOOD_X, "name": 1}]}, "inputs[0].name", ""),
    ("affine", {"inputs": [{**GOOD_X, "shape": [8]}]}, "inputs.x", "input 'x'"),
    ("affine", {"inputs": [{**GOOD_X, "name": "w"}]}, "inputs.x", "missing input 'x'"),
    ("affine", {"inputs": [{**GOOD_X, "shape": [0, 4], "data": []}]}, "inputs.x", "input 'x'"),
    ("words", {"inputs": [{**TEXT, "shape": [0], "data": []}]}, "inputs.text", ""),
    ("words", {"inputs": [{**TEXT, "data": [""]}]}, "inputs.text.data[0]", ""),
    ("words", {"inputs": [{**TEXT, "name": "texts"}]}, "inputs.texts.name", ""),
]


@pytest.mark.parametrize(("workload", "body", "param", "opening"), PARAMS)
def test_an_error_names_the_input_as_sent_in_its_param(
    server: ServerThread, workload: str, body: dict[str, Any], param: str, opening: str
) -> None:
    answer = post(server, f"/v2/models/{workload}/infer", orjson.dumps(body))
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error.get("param") == param, error
    assert error["error"].startswith(opening or f"{param}: "), error


def test_every_v2_error_is_an_error_string(server: ServerThread, client: Any) -> None:
    x = tensor("x", X, "FP32", True)
    error = refused(lambda: client.infer("affine", [x]))  # no key
    assert error.status() == "401" and "API key" in error.message()
    error = refused(lambda: client.get_model_metadata("ghost", headers=auth()))
    assert error.status() == "404" and "no workload named 'ghost'" in error.message()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path, headers, status in [
            ("POST", "/v2/models/affine/infer", {}, 401),
            ("GET", "/v2/models/affine", {"Authorization": "Bearer wrong"}, 401),
            ("GET", "/v2/models/affine/versions/1/infer", AUTH, 405),
            ("POST", "/v2/models/affine", AUTH, 405),
            ("GET", "/v2/models/affine/explain", AUTH, 404),
            ("GET", "/v2/nowhere", AUTH, 404),
            ("GET", "/v2/models/ghost/ready", AUTH, 404),
            ("GET", "/v2/models/affine/versions/3/ready", AUTH, 404),
        ]:
            answer = http.request(method, path, headers=headers)
            assert answer.status_code == status, (method, path, answer.text)
            assert answer.headers["content-type"] == "application/json", (method, path)
            message = answer.json()["error"]
            assert isinstance(message, str) and len(message) > 10, (method, path, message)
        # The OpenAI side keeps its own shape.
        assert http.get("/v1/models").json()["error"]["type"] == "authentication_error"
        assert http.get("/nowhere", headers=auth()).json()["error"]["type"] == (
            "invalid_request_error"
        )


def test_metrics_fold_versions_away() -> None:
    assert route_label("/v2/models/affine/versions/7/infer") == (
        "/v2/models/{name}/versions/{version}/infer"
    )
    assert route_label("/v2/models/affine/ready") == "/v2/models/{name}/ready"
