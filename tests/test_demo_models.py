"""The demo models: ONNX graphs agree with their sources, and the decoder's
masks let sequences with different pasts share a batch.

The built models come from conftest's `demo_models` fixture (`LANES_MODELS_DIR`,
else `.lanes/models`; missing models are built there first, which takes a
couple of minutes). Tests on the built models are marked slow; the decoder's
masking and export are also checked on a freshly initialised model, which
takes a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tokenizers import Tokenizer

from lanes.demo import classifier, minilm, tinycode

ATOL = 1e-4
Feed = dict[str, np.ndarray]


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# --- minilm -----------------------------------------------------------------

SENTENCES = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Où est la bibliothèque ? Ich weiß es nicht. 東京は晴れです。",
    "emoji 🚀🔥 and symbols ∑∫√ → ok",
    "def add(a: int, b: int) -> int:\n    return a + b",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "   leading and trailing spaces   ",
    "A",
    "Batching with padding must not change any embedding.",
    "https://example.com/path?query=1&other=two#frag",
    "numbers 3.14159 2.71828 1e-9 42",
    " ".join(f"word{i} and then some filler text" for i in range(120)),  # > 256 tokens
]


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(demo_models: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = demo_models / "minilm"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encodings = tokenizer.encode_batch(SENTENCES)  # padded to the longest, truncated at 256
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    assert ids.shape[1] == minilm.MAX_TOKENS  # the long sentence was truncated
    (hidden,) = session(folder / "model.onnx").run(
        ["last_hidden_state"], {"input_ids": ids, "attention_mask": mask}
    )
    assert hidden.shape == (len(SENTENCES), ids.shape[1], minilm.HIDDEN)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    ours = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reference = SentenceTransformer(str(minilm.source_path()), device="cpu").encode(SENTENCES)
    cosine = (ours * reference).sum(1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, cosine


# --- tinycode ---------------------------------------------------------------

SMALL = tinycode.TinyConfig(vocab_size=300, num_layers=2, num_heads=2, d_model=32, max_position=64)


@pytest.fixture(scope="module")
def fresh_decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[tinycode.TinyCode, Path]:
    """An untrained decoder with large weights, so that any masking slip shows in the logits."""
    torch.manual_seed(0)
    model = tinycode.TinyCode(SMALL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    path = tmp_path_factory.mktemp("fresh") / "model.onnx"
    tinycode.export(model, path)
    return model, path


@pytest.fixture(scope="module", params=["fresh", pytest.param("built", marks=pytest.mark.slow)])
def decoder(
    request: pytest.FixtureRequest, fresh_decoder: tuple[tinycode.TinyCode, Path]
) -> tuple[tinycode.TinyCode, ort.InferenceSession]:
    if request.param == "fresh":
        model, path = fresh_decoder
    else:
        folder = request.getfixturevalue("demo_models") / "tinycode"
        model, path = tinycode.load_model(folder), folder / "model.onnx"
    return model, session(path)


def run_decoder(
    sess: ort.InferenceSession,
    cfg: tinycode.TinyConfig,
    ids: np.ndarray,
    mask: np.ndarray,
    positions: np.ndarray,
    past: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One ONNX call; `past` is flat (k0, v0, k1, ...), None for an empty one."""
    if past is None:
        past = [np.zeros((len(ids), cfg.num_heads, 0, cfg.head_dim), np.float32)] * (
            2 * cfg.num_layers
        )
    feed: Feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    for i in range(cfg.num_layers):
        feed[f"past_key_values.{i}.key"] = past[2 * i]
        feed[f"past_key_values.{i}.value"] = past[2 * i + 1]
    logits, *present = sess.run(None, feed)
    return logits, present


def tokens(cfg: tinycode.TinyConfig, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, n), dtype=np.int64)


def test_tinycode_signature(decoder: tuple[tinycode.TinyCode, ort.InferenceSession]) -> None:
    model, sess = decoder
    n = model.cfg.num_layers
    kv = [f"{i}.{kind}" for i in range(n) for kind in ("key", "value")]
    assert [i.name for i in sess.get_inputs()] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        *(f"past_key_values.{k}" for k in kv),
    ]
    assert [o.name for o in sess.get_outputs()] == ["logits", *(f"present.{k}" for k in kv)]
    cfg = model.cfg
    cache = [cfg.num_heads, cfg.head_dim]
    shapes = {t.name: t.shape for t in [*sess.get_inputs(), *sess.get_outputs()]}
    assert shapes["input_ids"] == shapes["position_ids"] == ["batch", "sequence"]
    assert shapes["attention_mask"] == ["batch", "total_sequence"]
    assert shapes["logits"] == ["batch", "sequence", cfg.vocab_size]
    for k in kv:
        assert shapes[f"past_key_values.{k}"] == ["batch", cache[0], "past_sequence", cache[1]]
        assert shapes[f"present.{k}"] == ["batch", cache[0], "total_sequence", cache[1]]


def test_tinycode_onnx_matches_torch(
    decoder: tuple[tinycode.TinyCode, ort.InferenceSession],
) -> None:
    model, sess = decoder
    ids = np.concatenate([tokens(model.cfg, 12, 1), tokens(model.cfg, 12, 2)])
    mask, positions = np.ones_like(ids), np.broadcast_to(np.arange(12), ids.shape).copy()
    logits, _ = run_decoder(sess, model.cfg, ids, mask, positions)
    with torch.no_grad():
        expected, _ = model(
            torch.from_numpy(ids),
            torch.from_numpy(mask),
            torch.from_numpy(positions),
            model.empty_past(2),
        )
    np.testing.assert_allclose(logits, expected.numpy(), atol=ATOL, rtol=0)


def test_tinycode_cached_decode_matches_recompute(
    decoder: tuple[tinycode.TinyCode, ort.InferenceSession],
) -> None:
    model, sess = decoder
    ids = tokens(model.cfg, 10, 3)
    full, _ = run_decoder(sess, model.cfg, ids, np.ones_like(ids), np.arange(10)[None])
    # A prompt of 4 from an empty past, then one token at a time through the cache.
    logits, past = run_decoder(
        sess, model.cfg, ids[:, :4], np.ones((1, 4), np.int64), np.arange(4)[None]
    )
    steps = [logits]
    for t in range(4, 10):
        logits, past = run_decoder(
            sess, model.cfg, ids[:, t : t + 1], np.ones((1, t + 1), np.int64), np.array([[t]]), past
        )
        assert past[0].shape[2] == t + 1
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("new", [1, 3])
def test_tinycode_left_padded_batch_matches_alone(
    decoder: tuple[tinycode.TinyCode, ort.InferenceSession], new: int
) -> None:
    """Two sequences with pasts of 5 and 9: the shorter past is padded on the
    left with garbage under mask 0, and each gets the logits it gets alone."""
    model, sess = decoder
    cfg = model.cfg
    lengths, alone, pasts = (5, 9), [], []
    for seed, n in enumerate(lengths):
        ids = tokens(cfg, n + new, 10 + seed)
        _, past = run_decoder(sess, cfg, ids[:, :n], np.ones((1, n), np.int64), np.arange(n)[None])
        logits, _ = run_decoder(
            sess,
            cfg,
            ids[:, n:],
            np.ones((1, n + new), np.int64),
            np.arange(n, n + new)[None],
            past,
        )
        alone.append((ids[:, n:], logits))
        pasts.append(past)

    width = max(lengths)
    rng = np.random.default_rng(0)
    batch_past = [
        np.concatenate(
            [
                np.concatenate(
                    [
                        rng.normal(size=(1, *p.shape[1:2], width - n, p.shape[3])).astype(
                            np.float32
                        ),
                        p,
                    ],
                    axis=2,
                )
                for p, n in ((past[j], n) for past, n in zip(pasts, lengths, strict=True))
            ]
        )
        for j in range(2 * cfg.num_layers)
    ]
    mask = np.array([[0] * (width - n) + [1] * (n + new) for n in lengths], np.int64)
    positions = np.array([np.arange(n, n + new) for n in lengths])
    ids = np.concatenate([a[0] for a in alone])
    logits, present = run_decoder(sess, cfg, ids, mask, positions, batch_past)
    for row, (_, expected) in enumerate(alone):
        np.testing.assert_allclose(logits[row : row + 1], expected, atol=ATOL, rtol=0)
    assert present[0].shape == (2, cfg.num_heads, width + new, cfg.head_dim)


@pytest.mark.slow
def test_tinycode_files(demo_models: Path) -> None:
    folder = demo_models / "tinycode"
    config = json.loads((folder / "config.json").read_text())
    assert set(config) == {
        "eos_token_id",
        "bos_token_id",
        "num_layers",
        "num_heads",
        "head_dim",
        "vocab_size",
        "max_position",
        "chat_template",
        "chat_generation_prompt",
    }
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(tinycode.EOT) == config["eos_token_id"]
    text = "def f(x):\n\treturn {'ü': x}  # 東京 🚀\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    prompt = config["chat_template"].format(role="user", content="hi")
    assert prompt + config["chat_generation_prompt"] == "<|user|>\nhi\n<|assistant|>\n"


def test_tinycode_training_is_deterministic() -> None:
    texts = ["def f(x):\n    return x + 1\n" * 40, "class A:\n    pass\n" * 40]
    tcfg = tinycode.TrainConfig(steps=3, batch_size=2, seq_len=16, warmup=1)
    tokenizer = tinycode.train_tokenizer(texts, 300)
    first, second = (tinycode.train(tokenizer, texts, SMALL, tcfg) for _ in range(2))
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# --- classifier -------------------------------------------------------------


def test_classifier_onnx_matches_torch(tmp_path: Path) -> None:
    model = classifier.train()
    classifier.export(model, tmp_path)
    x, _ = classifier.make_blobs(50, seed=1)
    (logits,) = session(tmp_path / "model.onnx").run(["logits"], {"features": x})
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_classifier_accuracy_on_held_out_blobs(demo_models: Path) -> None:
    folder = demo_models / "classifier"
    assert json.loads((folder / "labels.json").read_text()) == classifier.LABELS
    x, y = classifier.make_blobs(200, seed=123)  # training used seed 0
    (logits,) = session(folder / "model.onnx").run(["logits"], {"features": x})
    assert logits.shape == (len(x), 3)
    assert (logits.argmax(1) == y).mean() >= 0.9


def test_tinycode_left_padded_prompts_match_alone(
    decoder: tuple[tinycode.TinyCode, ort.InferenceSession],
) -> None:
    """Prefill of prompts of 3 and 7 tokens from an empty past in one batch: the
    short one padded on the left (mask 0) gets its own logits and no NaN."""
    model, sess = decoder
    cfg = model.cfg
    prompts = [tokens(cfg, 3, 20), tokens(cfg, 7, 21)]
    width = 7
    ids = np.concatenate([np.pad(p, ((0, 0), (width - p.shape[1], 0))) for p in prompts])
    mask = np.array([[0] * (width - p.shape[1]) + [1] * p.shape[1] for p in prompts], np.int64)
    positions = np.maximum(mask.cumsum(1) - 1, 0)
    logits, _ = run_decoder(sess, cfg, ids, mask, positions)
    assert np.isfinite(logits).all()
    for row, p in enumerate(prompts):
        n = p.shape[1]
        expected, _ = run_decoder(sess, cfg, p, np.ones_like(p), np.arange(n)[None])
        np.testing.assert_allclose(logits[row : row + 1, width - n :], expected, atol=ATOL, rtol=0)
