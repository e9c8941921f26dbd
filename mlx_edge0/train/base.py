"""``edge0 train base``: a small stock qwen3_moe trained from scratch on the stdlib corpus.

The result is the project's real (not random) model: a normal mlx-lm
checkpoint dir (``config.json``, bf16 ``model.safetensors``, tokenizer files,
``training.json``) that ``mlx_lm.load`` reads and ``edge0 convert`` turns into
an edge0 checkpoint. Same Python minor version + same options -> same corpus,
same tokenizer, same batches, same weights.

Routers are trained with a Switch-style load-balancing term so every expert
keeps getting tokens (the stock forward has none; routing collapse would make
a poor streaming and prerouting fixture). The term reads the router logits
through :class:`TappedRouter`, a module swap that keeps parameter names.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..progress import track
from ..tiny import BOS_ID, EOS_ID, model_module, save_mlx, tiny_config, train_tokenizer
from .data import (
    HELD_OUT_FRACTION,
    CorpusSplit,
    TokenBatches,
    eval_windows,
    fingerprint,
    split_corpus,
    tokenize_documents,
)
from .loop import LoopOptions, run_loop

TOKENIZER_DIR, RUN_DIR, TEACHER_DIR = "tokenizer", "run", "teacher"
TRAINING_FILE = "training.json"


def base_config(vocab_size: int = 4096) -> dict:
    """config.json of the base model: tiny_config's qwen3_moe spelling, every layer MoE.

    6 layers x 16 experts (K=4, expert width 64), hidden 128, 4 query / 2 KV
    heads of 32, untied head: 3.7M parameters. Training throughput on one CPU
    core sets the size (the int4 + bf16 files are far below the package
    budget). Tied embeddings ended 0.2 nats worse on held-out text.
    """
    config = tiny_config("qwen3_moe", vocab_size)
    config.update({
        "num_hidden_layers": 6, "max_window_layers": 6, "mlp_only_layers": [],
        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
        "hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    })  # fmt: skip
    return dict(sorted(config.items()))


@dataclass(frozen=True)
class BaseOptions:
    out_dir: Path  # tokenizer/, run/ (checkpoints, log.json), teacher/
    steps: int = 400
    batch_size: int = 4
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    vocab_size: int = 4096
    balance_coef: float = 0.01  # weight of the load-balancing term
    held_out_fraction: float = HELD_OUT_FRACTION
    checkpoint_every: int = 50
    log_every: int = 10
    eval_windows: int = 16  # held-out windows scored at each checkpoint (all at the end)

    def __post_init__(self):
        if self.vocab_size < 512:
            raise ValueError(f"vocab_size must be >= 512 (the byte alphabet + specials), got {self.vocab_size}")
        if self.balance_coef < 0:
            raise ValueError(f"balance_coef must be >= 0, got {self.balance_coef}")
        if self.eval_windows < 1:
            raise ValueError(f"eval_windows must be >= 1, got {self.eval_windows}")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size} and {self.seq_len}")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        self.loop()  # the loop's own checks (steps, learning_rate, warmup_steps, ...) before any slow work

    def loop(self) -> LoopOptions:
        return LoopOptions(
            out_dir=Path(self.out_dir) / RUN_DIR, steps=self.steps, learning_rate=self.learning_rate,
            seed=self.seed, checkpoint_every=self.checkpoint_every,
            log_every=self.log_every, warmup_steps=self.warmup_steps,
        )  # fmt: skip


class RouterTap:
    """Collects router logits during one forward (a plain object, not a module child)."""

    def __init__(self):
        self.logits: list[mx.array] = []


class TappedRouter(nn.Linear):
    """A bias-free router Linear that also hands its logits to a :class:`RouterTap`."""

    def __init__(self, router: nn.Linear, tap: RouterTap):
        out_dims, in_dims = router.weight.shape
        super().__init__(in_dims, out_dims, bias=False)
        self.weight = router.weight
        self.tap = tap

    def __call__(self, x: mx.array) -> mx.array:
        logits = super().__call__(x)
        self.tap.logits.append(logits)
        return logits


def tap_routers(model: nn.Module) -> RouterTap:
    """Swap every MoE layer's ``mlp.gate`` for a :class:`TappedRouter` (names unchanged)."""
    tap = RouterTap()
    for layer in model.layers:
        if hasattr(layer.mlp, "switch_mlp"):
            layer.mlp.gate = TappedRouter(layer.mlp.gate, tap)
    return tap


def untap_routers(model: nn.Module) -> None:
    """Put plain ``nn.Linear`` routers back (same weights)."""
    for layer in model.layers:
        if isinstance(getattr(layer.mlp, "gate", None), TappedRouter):
            gate = layer.mlp.gate
            plain = nn.Linear(gate.weight.shape[1], gate.weight.shape[0], bias=False)
            plain.weight = gate.weight
            layer.mlp.gate = plain


def balance_loss(logits: mx.array, k: int) -> mx.array:
    """Switch-Transformer balance term E * sum_e f_e * P_e (1.0 when uniform).

    f_e is the fraction of top-k picks that went to expert e, P_e the mean
    router probability of e; only P_e carries gradient.
    """
    num_experts = logits.shape[-1]
    logits = logits.reshape(-1, num_experts)
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    picks = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    counts = mx.zeros_like(probs).at[mx.arange(probs.shape[0])[:, None], picks].add(1.0)
    fraction = mx.stop_gradient(counts.mean(axis=0) / k)
    return num_experts * mx.sum(fraction * probs.mean(axis=0))


def lm_loss(model: nn.Module, batch: mx.array) -> mx.array:
    """Mean next-token cross entropy of a ``[B, L + 1]`` batch."""
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), batch[:, 1:]).mean()


def held_out_perplexity(
    model: nn.Module, windows: np.ndarray, batch_size: int = 8, *, label: Optional[str] = None
) -> dict:
    """Perplexity over ``[n, L + 1]`` token windows (each scored from its own start);
    with a ``label``, a progress bar counts the windows."""
    total, count = 0.0, 0
    for i in track(range(0, len(windows), batch_size), label or "", unit="batch", show=label is not None):
        batch = mx.array(windows[i : i + batch_size])
        logits = model(batch[:, :-1])
        losses = nn.losses.cross_entropy(logits.astype(mx.float32), batch[:, 1:], reduction="sum")
        total += losses.item()
        count += batch[:, 1:].size
    return {"perplexity": math.exp(total / count), "loss": total / count, "tokens": count}


@dataclass(frozen=True)
class BaseReport:
    teacher: Path
    train_tokens: int
    held_out_tokens: int
    final_train_loss: float
    held_out: dict  # perplexity, loss, tokens of the saved (bf16) teacher
    training_seconds: float  # time inside training steps, summed over resumes
    tokens_per_s: float

    def as_dict(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def _tokenizer(tokenizer_dir: Path, texts: list[str], vocab_size: int, log: Callable[[str], None]):
    from tokenizers import Tokenizer

    if not (tokenizer_dir / "tokenizer.json").exists():
        log(f"training a {vocab_size}-token tokenizer on {len(texts)} files ...")
        train_tokenizer(tokenizer_dir, vocab_size, texts=texts)
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def train_base(options: BaseOptions, log: Callable[[str], None] = print, *, show_progress: bool = True) -> BaseReport:
    """Train the base model and write ``out_dir/teacher``; resumes from ``out_dir/run``.

    ``log`` gets a line per stage; ``show_progress`` draws bars on stderr for
    tokenizing, training and the final held-out scoring.
    """
    out = Path(options.out_dir)
    split = split_corpus(fraction=options.held_out_fraction)
    log(f"reading the corpus under {split.root} ...")
    train_texts, held_texts = split.texts("train"), split.texts("held_out")
    tokenizer = _tokenizer(out / TOKENIZER_DIR, train_texts, options.vocab_size, log)
    train_tokens = tokenize_documents(tokenizer, train_texts, label="tokenizing train files" if show_progress else None)
    held_tokens = tokenize_documents(
        tokenizer, held_texts, label="tokenizing held-out files" if show_progress else None
    )
    log(
        f"corpus: {len(split.train)} train files ({len(train_tokens)} tokens), "
        f"{len(split.held_out)} held-out files ({len(held_tokens)} tokens) under {split.root}"
    )

    config = base_config(options.vocab_size)
    arch = model_module(config)
    mx.random.seed(options.seed)
    model = arch.Model(arch.ModelArgs.from_dict(dict(config)))
    mx.eval(model.parameters())
    model.train()
    tap = tap_routers(model)
    k = config["num_experts_per_tok"]

    def loss_fn(model: nn.Module, batch: mx.array) -> mx.array:
        tap.logits.clear()
        loss = lm_loss(model, batch)
        if options.balance_coef > 0:
            loss = loss + options.balance_coef * sum(balance_loss(g, k) for g in tap.logits) / len(tap.logits)
        return loss

    probe = eval_windows(held_tokens, options.seq_len, options.eval_windows)

    def eval_fn(model: nn.Module) -> dict:
        model.eval()
        result = held_out_perplexity(model, probe)
        model.train()
        return result

    batches = TokenBatches(train_tokens, options.seq_len, options.batch_size, options.seed)
    history = run_loop(
        model, loss_fn, batches, options.loop(), "train base", eval_fn=eval_fn, show_progress=show_progress
    )
    untap_routers(model)
    model.eval()

    teacher = out / TEACHER_DIR
    save_mlx(model, config, teacher, out / TOKENIZER_DIR, dtype=mx.bfloat16)
    log(f"wrote {teacher}")
    held_out = held_out_perplexity(
        load_teacher(teacher),
        eval_windows(held_tokens, options.seq_len),
        label="scoring held-out text" if show_progress else None,
    )
    losses = [e for e in history if "loss" in e]
    report = BaseReport(
        teacher=teacher, train_tokens=len(train_tokens), held_out_tokens=len(held_tokens),
        final_train_loss=losses[-1]["loss"] if losses else math.nan, held_out=held_out,
        training_seconds=losses[-1]["elapsed_s"] if losses else 0.0,
        tokens_per_s=_mean_rate(losses),
    )  # fmt: skip
    (teacher / TRAINING_FILE).write_text(json.dumps(training_record(options, split, report), indent=2) + "\n")
    return report


def training_record(options: BaseOptions, split: CorpusSplit, report: BaseReport) -> dict:
    """What ``training.json`` says: options, Python version, corpus hash, held-out
    files, report. It ships with the model, so it holds no path of the machine that
    built it: the corpus is named by Python version and hash, the teacher by its
    directory name."""
    return {
        "options": {k: v for k, v in asdict(options).items() if k != "out_dir"},
        "python": platform.python_version(), "corpus": "the standard library of that Python",
        "corpus_sha256": fingerprint(split.root, split.train + split.held_out),
        "train_files": len(split.train), "held_out_files": list(split.held_out),
        "report": {**report.as_dict(), "teacher": report.teacher.name},
    }  # fmt: skip


def _mean_rate(entries: list[dict]) -> float:
    rates = [e["tokens_per_s"] for e in entries]
    return sum(rates) / len(rates) if rates else 0.0


def load_teacher(path: Path, dtype: Optional[mx.Dtype] = mx.float32) -> nn.Module:
    """The saved teacher as a stock mlx-lm model in eval mode, cast to ``dtype``
    (float32: MLX's CPU ``gather_mm`` has no bf16 kernel)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    if dtype is not None:
        model.set_dtype(dtype)
    model.eval()
    return model
