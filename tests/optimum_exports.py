"""Tiny random-weight `transformers` decoders, exported by Hugging Face Optimum's own
ONNX exporter (optimum-onnx, task text-generation-with-past), as a user would export
a real one. Nothing is downloaded: configs are tiny, tokenizers are built here.

`export(family, root)` builds `<root>/<family>-<key>/` once and reuses it: `src/` is
the model as `save_pretrained` wrote it (the reference for `transformers`' `generate`),
`onnx/` what the exporter wrote (model.onnx, config.json, generation_config.json and
the tokenizer files). The key hashes the family's config and the versions of
everything that shapes the export, so an upgrade exports afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

FORMAT = 1  # bump when what export() writes changes
SEED = 0
SPECIALS = ["<pad>", "<s>", "</s>"]
PAD, BOS, EOS = 0, 1, 2
CONTEXT = 128
# Prompts of different lengths (the last fills most of the context); bytes are tokens.
PROMPTS = [
    "hello",
    "the quick brown fox jumps over",
    "def main(argv):\n    return 0",
    "x = [1, 2, 3]\nprint(sum(x))  # a longer prompt, so the batch is left-padded",
]
NEW_TOKENS = 16


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers classes (by name) and tiny config."""

    name: str
    config_class: str
    model_class: str
    tokenizer_class: str
    config: dict[str, Any]
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json's
    # generation_config.json lists a second eos id, as Qwen2's real one does: a token
    # this model makes a few tokens into PROMPTS[1], so that prompt stops early.
    second_eos: bool = False


COMMON = {"bos_token_id": BOS, "eos_token_id": EOS, "initializer_range": 0.2}
FAMILIES = {
    f.name: f
    for f in (
        # Absolute positions: a left-padded row fed the wrong positions gets other tokens.
        Family(
            "gpt2",
            "GPT2Config",
            "GPT2LMHeadModel",
            "GPT2TokenizerFast",
            {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": CONTEXT, **COMMON},
        ),
        # Grouped-query attention (2 key/value heads for 4 query heads) and RoPE; its
        # tokenizer adds bos itself.
        Family(
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM",
            "LlamaTokenizerFast",
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "max_position_embeddings": CONTEXT,
                "pad_token_id": PAD,
                **COMMON,
            },
        ),
        # GQA and RoPE with biased q/k/v; eos only in generation_config.json's list.
        Family(
            "qwen2",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            "Qwen2TokenizerFast",
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "max_position_embeddings": CONTEXT,
                **COMMON,
            },
            generation={"pad_token_id": PAD},
            second_eos=True,
        ),
    )
}


@dataclass(frozen=True)
class Export:
    family: Family
    src: Path  # save_pretrained's folder: the reference model
    onnx: Path  # the exporter's folder: what lanes serves

    @property
    def model(self) -> Path:
        return self.onnx / "model.onnx"

    @property
    def tokenizer(self) -> Path:
        return self.onnx / "tokenizer.json"


def byte_level_tokenizer() -> Any:
    """GPT-2's byte-level scheme with no merges: every byte is a token, so any text
    encodes and decodes back exactly. Ids: the specials, then the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate([*SPECIALS, *sorted(alphabet)])}
    tokenizer = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


VOCAB = len(SPECIALS) + 256


def cache_key(family: Family) -> str:
    shaping = {
        "format": FORMAT,
        "seed": SEED,
        "family": [family.config_class, family.config, family.generation],
        "tokenizer": [family.tokenizer_class, SPECIALS],
        **{p: version(p) for p in ("torch", "transformers", "optimum-onnx", "onnx", "tokenizers")},
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def export(family: Family, root: Path) -> Export:
    """The family's export under `root`, built on first use (a second or two)."""
    dest = root / f"{family.name}-{cache_key(family)}"
    done = Export(family, dest / "src", dest / "onnx")
    if done.model.is_file():
        return done
    building = root / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    _build(family, building / "src", building / "onnx")
    try:
        building.rename(dest)  # whole or not at all: an interrupted build is never reused
    except OSError:  # another session finished first
        shutil.rmtree(building, ignore_errors=True)
    return done


def float16(done: Export) -> Export:
    """The export with float16 weights, past and logits (as a GPU export is, made here on
    the CPU by onnxruntime's converter), beside the float32 one; built on first use."""
    dest = done.onnx.parent / "onnx-float16"
    half = Export(done.family, done.src, dest)
    if half.model.is_file():
        return half
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    building = dest.parent / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(done.onnx, building)
    model = convert_float_to_float16(onnx.load(str(done.model)), keep_io_types=False)
    onnx.save(model, str(building / "model.onnx"))
    try:
        building.rename(dest)
    except OSError:  # another session finished first
        shutil.rmtree(building, ignore_errors=True)
    return half


def _build(family: Family, src: Path, onnx: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    torch.manual_seed(SEED)
    config = getattr(transformers, family.config_class)(vocab_size=VOCAB, **family.config)
    model = getattr(transformers, family.model_class)(config).eval()
    tokenizer_class = getattr(transformers, family.tokenizer_class)
    tokenizer = tokenizer_class(
        tokenizer_object=byte_level_tokenizer(),
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        pad_token=SPECIALS[PAD],
        unk_token=None,
    )
    for key, value in family.generation.items():
        setattr(model.generation_config, key, value)
    if family.second_eos:
        made = greedy(model, tokenizer, [PROMPTS[1]], NEW_TOKENS)[0]
        # The first token at index 4 or later that was not made before it.
        second = next(t for i, t in enumerate(made) if i >= 4 and t not in made[:i] and t > EOS)
        model.generation_config.eos_token_id = [EOS, second]
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's: every axis the exporter names is dynamic
        main_export(str(src), onnx, task="text-generation-with-past", do_validation=False)


def greedy(model: Any, tokenizer: Any, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """`transformers`' own greedy `generate` over `prompts` batched together (left-padded,
    as batched generation must be), each cut before its first eos."""
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    config = model.generation_config
    eos = config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD if config.pad_token_id is None else config.pad_token_id,
        )
    made = out[:, batch["input_ids"].shape[1] :].tolist()
    return [next((row[:i] for i, t in enumerate(row) if t in eos), row) for row in made]
