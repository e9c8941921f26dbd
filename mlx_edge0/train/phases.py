"""What the three training phases share: models, text, generation, reports.

Every phase trains on the *served* model — the edge0 checkpoint's int4
weights, computed resident through :class:`StudentPath` — with the base
frozen; the fp teacher is a plain mlx-lm checkpoint held in memory. Text
comes from the stdlib corpus (:mod:`mlx_edge0.train.data`), tokenized with the
checkpoint's own tokenizer; held-out files never feed training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..atomic import atomic_path
from ..progress import bar, note, track
from .data import split_corpus, tokenize_documents
from .loop import LoopOptions

TOKENIZER_FILE = "tokenizer.json"
REPORT_FILE = "report.json"


@dataclass(frozen=True)
class PhaseOptions:
    """What every phase is run with (the loop's options plus the text it reads)."""

    checkpoint: Path  # the edge0 checkpoint; outputs drop into it
    out_dir: Path  # run state: step checkpoints, log.json, report.json, a copy of the outputs
    steps: int = 200
    learning_rate: float = 1e-3
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    max_files: int = 200  # corpus files read per split (evenly spaced; 0 = all)
    eval_windows: int = 8  # held-out windows scored at every checkpoint
    checkpoint_every: int = 50
    log_every: int = 10
    warmup_steps: int = 10

    def __post_init__(self):
        if self.batch_size < 1 or self.seq_len < 2 or self.max_files < 0 or self.eval_windows < 1:
            raise ValueError("batch_size >= 1, seq_len >= 2, max_files >= 0 and eval_windows >= 1 are required")
        self.loop()  # the loop's own checks (steps, learning_rate, ...) before any slow work

    def loop(self) -> LoopOptions:
        return LoopOptions(
            out_dir=Path(self.out_dir),
            steps=self.steps,
            learning_rate=self.learning_rate,
            seed=self.seed,
            checkpoint_every=self.checkpoint_every,
            log_every=self.log_every,
            warmup_steps=min(self.warmup_steps, self.steps),
        )


def load_served(checkpoint: Path, *, prerouter: bool = True, lora: bool = False) -> nn.Module:
    """The edge0 model as served (float32 compute, no hot cache: the training
    forward reads every expert once, resident)."""
    from .. import load_model

    return load_model(checkpoint, compute_dtype="float32", cache_gib=0, prerouter=prerouter, lora=lora)


def text_tokenizer(checkpoint: Path):
    """The checkpoint's ``tokenizers.Tokenizer`` (fast batched encoding)."""
    from tokenizers import Tokenizer

    path = Path(checkpoint) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the checkpoint has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def corpus_tokens(checkpoint: Path, which: str, max_files: int = 0) -> np.ndarray:
    """The ``"train"`` or ``"held_out"`` split as one token stream; ``max_files``
    evenly spaced files of it (0 = all), so short runs read little."""
    split = split_corpus()
    files = getattr(split, which)
    if max_files and len(files) > max_files:
        files = [files[i] for i in np.linspace(0, len(files) - 1, max_files).astype(int)]
    texts = [(split.root / f).read_text(encoding="utf-8") for f in files]
    return tokenize_documents(text_tokenizer(checkpoint), texts)


def prompt_windows(tokens: np.ndarray, count: int, length: int, seed: int) -> mx.array:
    """``count`` prompts of ``length`` tokens starting at seeded random offsets."""
    if len(tokens) <= length:
        raise ValueError(f"{len(tokens)} tokens are too few for prompts of {length}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, size=count)
    return mx.array(np.stack([tokens[s : s + length] for s in starts]))


def generate_batch(model: nn.Module, prompts: mx.array, max_tokens: int, temperature: float, seed: int) -> mx.array:
    """Continue equal-length ``prompts`` [B, P] by ``max_tokens`` tokens: [B, P + max_tokens].

    Follows ``mlx_lm.generate_step``: the first P-1 prompt tokens are one
    prefill chunk, then one token per forward through the model's cache
    (so an edge0 model decodes on its served path, prerouter included).
    ``temperature`` 0 is greedy; otherwise sampling keyed by ``seed``.
    """
    keys = mx.random.split(mx.random.key(seed), max_tokens)
    cache = make_prompt_cache(model)
    if prompts.shape[1] > 1:
        mx.eval(model(prompts[:, :-1], cache=cache))
    out, y = [prompts], prompts[:, -1:]
    for step in range(max_tokens):
        logits = model(y, cache=cache)[:, -1]
        if temperature == 0:
            y = logits.argmax(axis=-1)[:, None]
        else:
            y = mx.random.categorical(logits / temperature, key=keys[step])[:, None]
        mx.eval(y)  # each step completes before the next one's staged fill
        out.append(y)
    return mx.concatenate(out, axis=1).astype(mx.int32)


@dataclass(frozen=True)
class GenerationOptions:
    """Generated training text: ``sequences`` prompts of real train text, each continued."""

    sequences: int = 256
    prompt_tokens: int = 32
    new_tokens: int = 96
    temperature: float = 1.0  # 0 = greedy
    batch: int = 16  # sequences generated together

    def __post_init__(self):
        if self.sequences < 1 or self.prompt_tokens < 2 or self.new_tokens < 1 or self.batch < 1:
            raise ValueError("sequences >= 1, prompt_tokens >= 2, new_tokens >= 1 and batch >= 1 are required")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.new_tokens


def generate_rows(
    model: nn.Module,
    prompts: mx.array,
    options: GenerationOptions,
    seed: int,
    label: str,
    *,
    show_progress: bool = True,
) -> np.ndarray:
    """Continue every prompt (``options.batch`` at a time, a bar counting sequences)."""
    rows = []
    with bar(prompts.shape[0], label, unit="seq", show=show_progress) as done:
        for i in range(0, prompts.shape[0], options.batch):
            chunk = generate_batch(
                model, prompts[i : i + options.batch], options.new_tokens, options.temperature, seed * 1_000_003 + i
            )
            rows.append(np.array(chunk))
            done.update(chunk.shape[0])
    return np.concatenate(rows)


def token_rows(path: Path, make, *, label: str) -> np.ndarray:
    """Rows cached in ``path`` (``.npy``) or made by ``make()`` and saved:
    generated data survives a resume and is made once."""
    path = Path(path)
    if path.is_file():
        return np.load(path)
    rows = np.asarray(make(), dtype=np.int32)
    with atomic_path(path) as tmp:
        np.save(tmp, rows)
    note(f"{label}: {rows.shape[0]} rows of {rows.shape[1]} tokens -> {path}")
    return rows


def masked_mean(values: mx.array, mask: mx.array) -> mx.array:
    mask = mask.astype(values.dtype)
    return (values * mask).sum() / mx.maximum(mask.sum(), 1)


def continuation_mask(batch: int, length: int, prompt: int) -> mx.array:
    """[B, L] True at positions whose *target* token is generated (index >= prompt)."""
    return mx.broadcast_to(mx.arange(1, length + 1)[None] >= prompt, (batch, length))


def held_out_windows(checkpoint: Path, options: PhaseOptions) -> mx.array:
    """Fixed held-out windows ``[n, seq_len + 1]`` for evaluation."""
    from .data import eval_windows

    tokens = corpus_tokens(checkpoint, "held_out", options.max_files)
    return mx.array(eval_windows(tokens, options.seq_len, options.eval_windows))


def mean_nll(forward, windows: mx.array, batch_size: int, *, label: Optional[str] = None) -> float:
    """Mean next-token NLL of ``forward(inputs) -> logits`` over ``windows`` [n, T+1];
    with a ``label``, a progress bar counts the batches."""
    total, count = 0.0, 0
    for i in track(range(0, windows.shape[0], batch_size), label or "", unit="batch", show=label is not None):
        w = windows[i : i + batch_size]
        logits = forward(w[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum")
        total += nll.item()
        count += w[:, 1:].size
    return total / count


def write_report(options: PhaseOptions, report: dict[str, Any]) -> Path:
    """``report.json`` in the run dir: options, the phase's numbers, outputs."""
    path = Path(options.out_dir) / REPORT_FILE
    body = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}, **report}
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def last_loss(log: list[dict]) -> Optional[float]:
    losses = [e["loss"] for e in log if "loss" in e]
    return losses[-1] if losses else None
