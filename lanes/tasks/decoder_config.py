"""What the generate loop needs to know about a decoder, from the graph and its folder.

The graph's `past_key_values.N.key|value` inputs give the layers, and their fixed dims
the key/value heads and head size. The files an exporter writes beside the model
(Hugging Face Optimum's `optimum-cli export onnx --task text-generation-with-past`
writes all three) fill in the rest:

- `config.json`: dims the graph leaves symbolic (`num_key_value_heads`, else
  `n_head` / `num_attention_heads`; `head_dim`, else hidden size / attention heads),
  the context (`max_position_embeddings`, `n_positions`, `n_ctx` or `max_position`),
  `vocab_size`, and eos, bos and pad ids;
- `generation_config.json`: eos (one id or a list), bos and pad ids, which win over
  config.json's, as they do in `transformers`' `generate`;
- `tokenizer_config.json` (beside tokenizer.json): whether bos is the tokenizer's
  business. With the file, the tokenizer adds bos or not, as `transformers` does,
  unless `add_bos_token` says otherwise; without it (lanes' own format, the demo's
  tinycode), config.json's `bos_token_id` is prepended to every prompt.

A value in config.json that contradicts the graph is a `ModelError`, as is a graph
input the loop cannot feed.

A graph that attends with onnxruntime's GroupQueryAttention keeps its cache in slots
(`kv_layout` "slots", lanes/tasks/slot_graph.py): each row's past at the front of a
buffer as long as the context, which the config files must then state. It takes
`seqlens_k` and `total_sequence_length` instead of `attention_mask`
(lanes/demo/slots.py builds one), or an `attention_mask` it derives them from
(onnxruntime-genai's model builder). Such an export has `genai_config.json` instead
of config.json; lanes reads its `model` section the same way (`context_length`,
the ids, `decoder.num_key_value_heads` and `head_size`).
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnxruntime as ort
from tokenizers import Tokenizer

from lanes.errors import ModelError
from lanes.runtime import TensorInfo, check_io, describe
from lanes.validation import describe as describe_value

PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
FED = ("input_ids", "attention_mask", "position_ids")  # besides past_key_values.N.*
SLOT_FED = ("input_ids", "seqlens_k", "total_sequence_length")
KvLayout = Literal["concat", "slots"]

# config.json's spellings, in the order they are tried.
LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
KV_HEADS = ("num_key_value_heads", "num_heads", "n_head", "num_attention_heads")
QUERY_HEADS = ("num_attention_heads", "n_head", "num_heads")
HIDDEN = ("hidden_size", "n_embd", "d_model")
CONTEXT = ("max_position_embeddings", "n_positions", "n_ctx", "max_position")
# Keys that state a past input's dim; the others (query heads, hidden / heads) only
# stand in for a symbolic one: multi-query models and Gemma's head_dim differ from them.
STATED = frozenset({"num_key_value_heads", "num_heads", "head_dim"})


@dataclass(frozen=True)
class DecoderConfig:
    """What the loop needs to know about the model, from its graph and config files."""

    num_layers: int
    num_heads: int  # key/value heads (fewer than query heads under GQA)
    head_dim: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None = None
    add_bos_token: bool = True  # prepend bos_token_id to prompts that do not start with it
    pad_token_id: int = 0  # fed where a batch row has no token (its mask is 0)
    vocab_size: int | None = None
    max_position: int | None = None  # the context: longest prompt + completion it can see
    chat_template: str | None = None
    chat_generation_prompt: str | None = None
    # "concat": present = past + the new columns, rows padded to one length (the
    # Optimum signature); "slots": each row's past in place in a buffer as long as
    # max_position, written one column per step (see the module docstring).
    kv_layout: KvLayout = "concat"


@dataclass(frozen=True)
class _Files:
    """The JSON files beside a model; an absent file reads as {}."""

    config: dict[str, Any]
    generation: dict[str, Any]
    tokenizer: dict[str, Any] | None  # None: no tokenizer_config.json

    @classmethod
    def read(cls, model: Path, tokenizer: Path | None) -> _Files:
        folder = model.parent
        tok = (tokenizer.parent if tokenizer else folder) / "tokenizer_config.json"
        config = _json(folder / "config.json")
        if config is None:
            config = _genai(_json(folder / "genai_config.json"))
        return cls(config, _json(folder / "generation_config.json") or {}, _json(tok))

    def first_int(self, key: str) -> int | None:
        """generation_config.json's value, else config.json's."""
        for raw in (self.generation, self.config):
            if _is_int(raw.get(key)):
                return int(raw[key])
        return None


def read_config(
    session: ort.InferenceSession,
    path: Path,
    tokenizer: Tokenizer,
    tokenizer_path: Path | None = None,
) -> DecoderConfig:
    """The decoder's config from its graph (authoritative) and the files beside `path`
    (and beside `tokenizer_path`, for tokenizer_config.json). `ModelError` when the graph
    lacks the signature, takes inputs the loop cannot feed, or disagrees with config.json."""
    where = str(path)
    inputs = describe(session.get_inputs())
    layers = sorted({int(m.group(1)) for n in inputs if (m := PAST_INPUT.match(n))})
    if not layers or layers != list(range(len(layers))):
        raise ModelError(
            f"model {where} cannot serve task 'generate': expected inputs "
            f"past_key_values.0.key, past_key_values.0.value, ...; found {', '.join(inputs)}. "
            "Export the decoder with its KV cache (Optimum: --task text-generation-with-past)"
        )
    past_in = [f"past_key_values.{i}.{p}" for i in layers for p in ("key", "value")]
    present = [f"present.{i}.{p}" for i in layers for p in ("key", "value")]
    lengths_fed = "seqlens_k" in inputs
    layout: KvLayout = "slots" if lengths_fed or _attends_in_slots(path) else "concat"
    fed = SLOT_FED if lengths_fed else FED
    check_io(
        session,
        where=where,
        task="generate",
        inputs=[*fed, *past_in] if lengths_fed else [*fed[:2], *past_in],
        outputs=["logits", *present],
    )
    unfed = [str(t) for n, t in inputs.items() if n not in fed and not PAST_INPUT.match(n)]
    if unfed:
        raise ModelError(
            f"model {where} cannot serve task 'generate': the loop feeds "
            f"{', '.join(fed)} and past_key_values.N.key|value, but the model "
            f"also takes {', '.join(unfed)}. Export one decoder with its KV cache "
            "(Optimum: optimum-cli export onnx --task text-generation-with-past, which "
            "writes a single model.onnx)"
        )
    files = _Files.read(path, tokenizer_path)
    raw = files.config
    configured = _int(raw, LAYERS)
    if configured is not None and configured[1] != len(layers):
        raise ModelError(
            f"config.json next to {where} says {configured[0]}={configured[1]} but the model "
            f"has {len(layers)} past_key_values layers; rebuild one of them"
        )
    first = inputs["past_key_values.0.key"]
    heads = _dim(first, 1, _int(raw, KV_HEADS), where)
    head_dim = _dim(first, 3, _int(raw, ("head_dim",)) or _derived_head_dim(raw), where)
    eos = _eos(files, tokenizer)
    vocab = _int(raw, ("vocab_size",))
    bos = files.first_int("bos_token_id")
    context = _int(raw, CONTEXT)
    if layout == "slots" and context is None:
        raise ModelError(
            f"model {where} keeps its cache in slots (it attends with GroupQueryAttention), "
            "whose buffers are as long as the context: config.json beside it must state it "
            f"({' or '.join(CONTEXT)}), or genai_config.json (model.context_length)"
        )
    return DecoderConfig(
        num_layers=len(layers),
        num_heads=heads,
        head_dim=head_dim,
        eos_token_ids=eos,
        bos_token_id=bos,
        add_bos_token=_adds_bos(files),
        pad_token_id=_pad(files, eos, vocab[1] if vocab else None),
        vocab_size=vocab[1] if vocab else None,
        max_position=context[1] if context else None,
        chat_template=_str(raw, "chat_template"),
        chat_generation_prompt=_str(raw, "chat_generation_prompt"),
        kv_layout=layout,
    )


def _json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, found {describe_value(data)}")
    return data


def _genai(raw: dict[str, Any] | None) -> dict[str, Any]:
    """onnxruntime-genai's genai_config.json, in config.json's keys."""
    model = raw.get("model") if raw else None
    if not isinstance(model, dict):
        return {}
    found = model.get("decoder")
    decoder: dict[str, Any] = found if isinstance(found, dict) else {}
    keys = {
        "max_position_embeddings": model.get("context_length"),
        "vocab_size": model.get("vocab_size"),
        "bos_token_id": model.get("bos_token_id"),
        "eos_token_id": model.get("eos_token_id"),
        "pad_token_id": model.get("pad_token_id"),
        "num_hidden_layers": decoder.get("num_hidden_layers"),
        "num_key_value_heads": decoder.get("num_key_value_heads"),
        "head_dim": decoder.get("head_size"),
    }
    return {k: v for k, v in keys.items() if v is not None}


def _attends_in_slots(path: Path) -> bool:
    """Whether the graph attends with GroupQueryAttention, which keeps each row's past
    at the front of its buffer (a left-padded batch would attend over the pads)."""
    op = "GroupQueryAttention"
    try:
        # An op's name is plain bytes in the file: most decoders (the Optimum exports,
        # weights often inside) are ruled out by one pass over a map of it, unparsed.
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(op.encode()) < 0:
                return False
        import onnx  # the runtime extra's; read only the graph, not external weights

        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as err:  # the session loaded it: an unreadable file is unlikely
        raise ModelError(f"cannot read the graph of {path}: {err}") from err
    return any(node.op_type == op for node in graph.node)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(raw: dict[str, Any], keys: Sequence[str]) -> tuple[str, int] | None:
    """The first of `keys` that config.json sets to an integer, and its value."""
    for key in keys:
        if _is_int(raw.get(key)):
            return key, int(raw[key])
    return None


def _str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    return value if isinstance(value, str) else None


def _derived_head_dim(raw: dict[str, Any]) -> tuple[str, int] | None:
    hidden, heads = _int(raw, HIDDEN), _int(raw, QUERY_HEADS)
    if hidden is None or heads is None or heads[1] <= 0 or hidden[1] % heads[1]:
        return None
    return f"{hidden[0]}/{heads[0]}", hidden[1] // heads[1]


def _dim(info: TensorInfo, axis: int, configured: tuple[str, int] | None, where: str) -> int:
    """Dim `axis` of a past input: the graph's when fixed (config.json must agree),
    else config.json's."""
    from_model = info.shape[axis] if len(info.shape) == 4 else None
    if isinstance(from_model, int):
        if configured is not None and configured[0] in STATED and configured[1] != from_model:
            raise ModelError(
                f"config.json next to {where} says {configured[0]}={configured[1]} but "
                f"input {info.name} has {from_model}; rebuild one of them"
            )
        return from_model
    if configured is None:
        wanted = "num_key_value_heads" if axis == 1 else "head_dim"
        raise ModelError(
            f"model {where}: dim {axis} of {info} is symbolic; put {wanted} in a "
            "config.json next to the model"
        )
    return configured[1]


def _ids(value: Any) -> frozenset[int] | None:
    if _is_int(value):
        return frozenset({int(value)})
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return frozenset(int(v) for v in value)
    return None


def _eos(files: _Files, tokenizer: Tokenizer) -> frozenset[int]:
    """generation_config.json's eos ids (one or a list), else config.json's, else the
    usual end-of-text tokens when the tokenizer has them."""
    for raw in (files.generation, files.config):
        found = _ids(raw.get("eos_token_id"))
        if found is not None:
            return found
    usual = (tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>"))
    return frozenset(i for i in usual if i is not None)


def _pad(files: _Files, eos: frozenset[int], vocab: int | None) -> int:
    """The pad id of the config files, else an eos id (as `generate` pads), else 0. An
    id outside the vocabulary (some configs say -1) would fail the embedding lookup."""
    candidates = [files.first_int("pad_token_id"), *sorted(eos)]
    for pad in candidates:
        if pad is not None and pad >= 0 and (vocab is None or pad < vocab):
            return pad
    return 0


def _adds_bos(files: _Files) -> bool:
    """Whether lanes prepends bos (see the module's docstring)."""
    if files.tokenizer is None:
        return True
    flag = files.tokenizer.get("add_bos_token")
    return flag if isinstance(flag, bool) else False
