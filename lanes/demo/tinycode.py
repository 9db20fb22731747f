"""A tiny decoder-only transformer trained on the Python standard library.

It exists so that the `generate` task has a real model with a KV cache to
serve on any machine in a couple of minutes, not to write good code.

Output folder (`build(out)`):

- `model.onnx` with the Hugging Face/Optimum past-key-values signature:
  inputs `input_ids` [batch, seq] int64, `attention_mask` [batch, past_seq+seq]
  int64, `position_ids` [batch, seq] int64, `past_key_values.{i}.key|value`
  [batch, heads, past_seq, head_dim] float32; outputs `logits`
  [batch, seq, vocab] float32 and `present.{i}.key|value`
  [batch, heads, past_seq+seq, head_dim] float32. Every axis is dynamic and
  `past_seq` may be 0.
- `model-slots.onnx`: the same weights with a KV cache kept in place, one row of a
  buffer per sequence, each at its own length (lanes/demo/slots.py).
- `tokenizer.json`: byte-level BPE (decoding round-trips any text); the only
  special token is `<|endoftext|>`, both bos and eos. The tokenizer adds no
  special tokens itself: callers prepend `bos_token_id` to a prompt.
- `config.json`: `eos_token_id`, `bos_token_id`, `num_layers`, `num_heads`,
  `head_dim`, `vocab_size`, `max_position` (the longest past+new to serve:
  training used 128-token windows and rotary positions carry the model
  further, fading slowly), `chat_template` and `chat_generation_prompt`. A chat prompt is
  `"".join(chat_template.format(role=m.role, content=m.content) for m in
  messages) + chat_generation_prompt`, i.e. `"<|user|>\\nhi\\n<|assistant|>\\n"`.

Masking contract (what continuous batching relies on): a key position takes
part in attention iff its `attention_mask` entry is non-zero and it is not
after the query (causal over the concatenation past+new). So sequences with
different past lengths can share a batch with their pasts padded on the left
(mask 0) and get the logits each would get alone. Positions come only from
`position_ids`, never from cache indices.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from lanes.demo.slots import export_slots

EOT = "<|endoftext|>"
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
CHAT_GENERATION_PROMPT = "<|assistant|>\n"
FILES = ("model.onnx", "model-slots.onnx", "tokenizer.json", "config.json", "weights.pt")
# Finite, so a row with every key masked (a padding query) gives a uniform
# softmax rather than NaN.
MASKED = -1e9
ROPE_BASE = 10_000.0


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the model; the defaults give 0.92M parameters (131k of them the embedding)."""

    vocab_size: int = 1024
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    max_position: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class TrainConfig:
    """Training recipe. A fixed step count (not a time budget) keeps it deterministic."""

    seed: int = 0
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 15
    corpus_chars: int = 3_000_000  # text from the stdlib, in sorted file order


Past = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (
            z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
            for z in self.qkv(x).split(d, dim=-1)
        )
        q, k = _rotate(q, *rope), _rotate(k, *rope)  # the cache holds rotated keys
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed, MASKED)
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d)), k, v


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.attn(self.ln1(x), rope, allowed, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln2(x)), k, v


class TinyCode(nn.Module):
    """Pre-LN GPT with rotary positions and a tied output head."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        inv_freq = ROPE_BASE ** (-torch.arange(0, cfg.head_dim, 2) / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(_init)

    def empty_past(self, batch: int) -> Past:
        shape = (batch, self.cfg.num_heads, 0, self.cfg.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.blocks]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: Past,
    ) -> tuple[torch.Tensor, Past]:
        """Return `(logits [b, t, vocab], present)`; see the module docstring for the masks."""
        t, total = input_ids.shape[1], attention_mask.shape[1]
        key_index = torch.arange(total)
        query_index = torch.arange(t) + (total - t)  # new tokens sit at the end of the cache
        causal = key_index[None, :] <= query_index[:, None]  # [t, total]
        allowed = causal[None, None] & (attention_mask[:, None, None, :] != 0)
        angles = (position_ids[:, None, :, None].float() * self.inv_freq).repeat(1, 1, 1, 2)
        rope = (angles.cos(), angles.sin())  # [b, 1, t, head_dim], shared by all layers
        x = self.tok(input_ids)
        present: Past = []
        for block, (pk, pv) in zip(self.blocks, past, strict=True):
            x, k, v = block(x, rope, allowed, pk, pv)
            present.append((k, v))
        return self.ln_f(x) @ self.tok.weight.T, present


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, "rotate half" layout (as in GPT-NeoX and Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class _OnnxWrapper(nn.Module):
    """Flat positional signature for the exporter: past and present as k, v, k, v, ..."""

    def __init__(self, model: TinyCode) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past_flat: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        past = list(zip(past_flat[0::2], past_flat[1::2], strict=True))
        logits, present = self.model(input_ids, attention_mask, position_ids, past)
        return (logits, *(z for kv in present for z in kv))


def corpus_files(max_chars: int) -> list[Path]:
    """The stdlib's top-level modules in sorted order, until `max_chars` are reached."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= max_chars:
            break
    if not files:
        raise FileNotFoundError(f"no standard library sources (*.py) in {stdlib} to train on")
    return files


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE, so any text (unicode included) encodes and decodes losslessly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_corpus(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Return `(ids, starts)`: one stream of `EOT file EOT file ...`, and each EOT's offset.

    The EOT before each file doubles as bos, so a prompt that starts with it
    looks like the start of a file.
    """
    eot = tokenizer.token_to_id(EOT)
    pieces, starts, offset = [], [], 0
    for enc in tokenizer.encode_batch(texts):
        starts.append(offset)
        pieces.append(np.array([eot, *enc.ids], dtype=np.int64))
        offset += len(pieces[-1])
    return np.concatenate(pieces), np.array(starts, dtype=np.int64)


def train(
    tokenizer: Tokenizer,
    texts: list[str],
    cfg: TinyConfig = TinyConfig(),
    tcfg: TrainConfig = TrainConfig(),
    on_step: Callable[[int, int, float], None] | None = None,
) -> TinyCode:
    """Train from scratch with AdamW; `on_step(step, steps, loss)` reports progress.

    Each batch row is a window of `seq_len + 1` tokens; a quarter of them start
    at a file boundary, so that "bos at position 0, then code" is well learnt.
    """
    torch.manual_seed(tcfg.seed)
    rng = np.random.default_rng(tcfg.seed)
    ids, starts = encode_corpus(tokenizer, texts)
    starts = starts[starts + tcfg.seq_len + 1 <= len(ids)]
    model = TinyCode(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, tcfg))
    b, t = tcfg.batch_size, tcfg.seq_len
    mask = torch.ones(b, t, dtype=torch.int64)
    positions = torch.arange(t).expand(b, t)
    for step in range(tcfg.steps):
        offsets = rng.integers(0, len(ids) - t - 1, size=b)
        at_start = rng.random(b) < 0.25
        offsets[at_start] = rng.choice(starts, size=int(at_start.sum()))
        window = torch.from_numpy(np.stack([ids[o : o + t + 1] for o in offsets]))
        logits, _ = model(window[:, :-1], mask, positions, model.empty_past(b))
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, cfg.vocab_size), window[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step + 1, tcfg.steps, loss.item())
    return model.eval()


def _lr_factor(step: int, tcfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < tcfg.warmup:
        return (step + 1) / tcfg.warmup
    progress = (step - tcfg.warmup) / max(1, tcfg.steps - tcfg.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def export(model: TinyCode, path: Path) -> None:
    """Export with the Optimum signature; example sizes are >= 2 so no axis is frozen at 1."""
    cfg = model.cfg
    batch, past_len, new_len = 2, 3, 2
    shape = (batch, cfg.num_heads, past_len, cfg.head_dim)
    past_flat = [torch.zeros(shape) for _ in range(2 * cfg.num_layers)]
    args = (
        torch.zeros(batch, new_len, dtype=torch.int64),
        torch.ones(batch, past_len + new_len, dtype=torch.int64),
        torch.arange(past_len, past_len + new_len).expand(batch, new_len).contiguous(),
        *past_flat,
    )
    kv_names = [f"{i}.{kind}" for i in range(cfg.num_layers) for kind in ("key", "value")]
    past_names = [f"past_key_values.{n}" for n in kv_names]
    present_names = [f"present.{n}" for n in kv_names]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
        **{n: {0: "batch", 2: "past_sequence"} for n in past_names},
        **{n: {0: "batch", 2: "total_sequence"} for n in present_names},
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings about shapes: all axes are dynamic
        torch.onnx.export(
            _OnnxWrapper(model),
            args,
            str(path),
            input_names=["input_ids", "attention_mask", "position_ids", *past_names],
            output_names=["logits", *present_names],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )


def write_config(tokenizer: Tokenizer, cfg: TinyConfig, path: Path) -> None:
    eot = tokenizer.token_to_id(EOT)
    config = {
        "eos_token_id": eot,
        "bos_token_id": eot,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position": cfg.max_position,
        "chat_template": CHAT_TEMPLATE,
        "chat_generation_prompt": CHAT_GENERATION_PROMPT,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")


def load_model(out: Path) -> TinyCode:
    """Rebuild the torch model from `out/weights.pt` and `config.json` (kept for tests)."""
    config = json.loads((out / "config.json").read_text())
    cfg = TinyConfig(
        vocab_size=config["vocab_size"],
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        d_model=config["num_heads"] * config["head_dim"],
        max_position=config["max_position"],
    )
    state = torch.load(out / "weights.pt", weights_only=True)
    model = TinyCode(cfg)
    model.load_state_dict(state)
    return model.eval()


def build(
    out: Path,
    cfg: TinyConfig = TinyConfig(),
    tcfg: TrainConfig = TrainConfig(),
    on_step: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Train the tokenizer and the model, and write the folder described above; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    texts = [
        p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(tcfg.corpus_chars)
    ]
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    model = train(tokenizer, texts, cfg, tcfg, on_step)
    tokenizer.save(str(out / "tokenizer.json"))
    export(model, out / "model.onnx")
    export_slots(model, out / "model-slots.onnx")
    write_config(tokenizer, cfg, out / "config.json")
    torch.save(model.state_dict(), out / "weights.pt")
    return out


if __name__ == "__main__":  # quick timing run: python -m lanes.demo.tinycode DEST
    import sys

    start = time.perf_counter()
    build(Path(sys.argv[1]), on_step=lambda s, n, loss: print(f"{s}/{n} loss {loss:.3f}"))
    print(f"{time.perf_counter() - start:.1f} s")
