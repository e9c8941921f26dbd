"""Phase 2: student-path SFT of the recovery LoRA on text the fp teacher wrote.

The fp teacher continues prompts of real train text (seeded sampling, or
greedy); the served model — int4, prerouter ON, heads frozen — learns those
continuations with cross-entropy through :class:`StudentPath`, routed exactly
as serving routes a prompt followed by decoding (``gate_positions=1``, see
student.py). Only the LoRA A/B matrices
train; the base and the heads stay frozen. Heads first, SFT second: the
adapters learn around the heads the model will be served with.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .. import lora
from .base import load_teacher
from .data import TokenBatches
from .loop import run_loop
from .phases import (
    GenerationOptions, PhaseOptions, continuation_mask, corpus_tokens, generate_rows,
    held_out_windows, last_loss, load_served, masked_mean, mean_nll,
    prompt_windows, token_rows, write_report,
)  # fmt: skip
from .student import StudentPath

DATA_FILE = "sft_data.npy"


def student_logits(student: StudentPath, rows: mx.array) -> mx.array:
    """Logits for ``rows[:, :-1]`` routed as served (prompt and continuation alike)."""
    return student(rows[:, :-1], gate_positions=1)


def sft_loss(student: StudentPath, rows: mx.array, prompt_tokens: int) -> mx.array:
    """Cross-entropy on the generated tokens of ``rows`` [B, P + G]."""
    logits = student_logits(student, rows)
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), rows[:, 1:])
    return masked_mean(ce, continuation_mask(*ce.shape, prompt_tokens))


def attach_trainable_adapters(model: nn.Module, seed: int, rank: int, alpha: float) -> None:
    """Fresh adapters (B = 0: the model is unchanged) on every target; only they train."""
    mx.random.seed(seed)
    lora.attach(model, tuple(lora.lora_targets(model)), rank, alpha)
    lora.train_only_adapters(model)


def held_out_eval(student: StudentPath, held: mx.array, batch_size: int) -> dict:
    """Held-out perplexity decoding from position 0 (``gate_positions=1``)."""
    nll = mean_nll(lambda x: student(x, gate_positions=1), held, batch_size)
    return {"held_out_nll": nll, "held_out_ppl": math.exp(nll)}


def install_adapters(model: nn.Module, options: PhaseOptions) -> list[str]:
    """The adapters into the checkpoint (they drop in) and a copy in the run dir."""
    checkpoint = Path(options.checkpoint)
    path = lora.save_adapters(checkpoint, model, checkpoint, lora.consumer_k(model))
    for name in (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE):
        shutil.copy(checkpoint / name, Path(options.out_dir) / name)
    return [str(path), str(checkpoint / lora.ADAPTER_CONFIG_FILE)]


def train_sft(
    options: PhaseOptions,
    teacher: Path,
    generation: GenerationOptions = GenerationOptions(),
    rank: int = lora.RANK,
    alpha: float = lora.ALPHA,
    *,
    show_progress: bool = True,
) -> dict:
    """Phase 2 on ``options.checkpoint``; writes the adapters into it. Returns the report."""
    checkpoint, out_dir = Path(options.checkpoint), Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def make_data():
        prompts = prompt_windows(
            corpus_tokens(checkpoint, "train", options.max_files),
            generation.sequences,
            generation.prompt_tokens,
            options.seed,
        )
        return generate_rows(
            load_teacher(teacher),
            prompts,
            generation,
            options.seed,
            "phase 2 teacher text",
            show_progress=show_progress,
        )

    rows = token_rows(out_dir / DATA_FILE, make_data, label="phase 2 teacher text")
    model = load_served(checkpoint)
    attach_trainable_adapters(model, options.seed, rank, alpha)
    student = StudentPath(model)
    held = held_out_windows(checkpoint, options)
    before = held_out_eval(student, held, options.batch_size)
    batches = TokenBatches(rows.reshape(-1), generation.length - 1, options.batch_size, options.seed)
    P = generation.prompt_tokens

    def loss_fn(m: nn.Module, batch: mx.array) -> mx.array:
        return sft_loss(student, batch, P)

    log = run_loop(
        model,
        loss_fn,
        batches,
        options.loop(),
        "phase 2 sft",
        lambda m: held_out_eval(student, held, options.batch_size),
        show_progress=show_progress,
    )
    report = {
        "phase": "sft",
        "teacher": str(teacher),
        "generation": vars(generation),
        "rank": rank,
        "alpha": alpha,
        "prerouter": bool(student.heads),
        "data_rows": int(rows.shape[0]),
        "before": before,
        "after": held_out_eval(student, held, options.batch_size),
        "final_loss": last_loss(log),
        "outputs": install_adapters(model, options),
    }
    write_report(options, report)
    return report
