"""Phase 3: on-policy distillation of the recovery LoRA from the fp teacher.

The Phase-2 student (its adapters load from the checkpoint) continues prompts
of real train text on its served path — streaming experts, prerouter on —
and the fp teacher scores those rollouts. Per generated position, with p the
student's and q the teacher's next-token distribution and S the teacher's
top-k tokens::

    loss = KL(p || q)                                   reverse KL (mode seeking)
         + topk_weight * sum_{i in S} q_i log(q_i / p_i)   the teacher's top-k
         + tail_weight * q_tail log(q_tail / p_tail)       mass outside the top-k

(the last two together are the forward KL of the distributions lumped into
k + 1 buckets). Only the LoRA trains; about a tenth of Phase 2's data.
"""

from __future__ import annotations

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
    held_out_windows, last_loss, load_served, masked_mean, prompt_windows,
    token_rows, write_report,
)  # fmt: skip
from .sft import held_out_eval, install_adapters, student_logits
from .student import StudentPath

DATA_FILE = "distill_data.npy"
START_DIR = "start"  # the Phase-2 adapters this run started from
TOP_K = 8
EPS = 1e-9


def distill_terms(student_logits: mx.array, teacher_logits: mx.array, top_k: int = TOP_K) -> dict[str, mx.array]:
    """Per-position reverse KL, top-k and tail terms ([B, L] each)."""
    log_p = nn.log_softmax(student_logits.astype(mx.float32), axis=-1)
    log_q = nn.log_softmax(teacher_logits.astype(mx.float32), axis=-1)
    p, q = mx.exp(log_p), mx.exp(log_q)
    reverse_kl = (p * (log_p - log_q)).sum(axis=-1)
    top = mx.stop_gradient(mx.argpartition(-log_q, kth=top_k - 1, axis=-1)[..., :top_k])
    q_top, log_q_top = mx.take_along_axis(q, top, -1), mx.take_along_axis(log_q, top, -1)
    log_p_top = mx.take_along_axis(log_p, top, -1)
    topk = (q_top * (log_q_top - log_p_top)).sum(axis=-1)
    q_tail = mx.maximum(1 - q_top.sum(axis=-1), EPS)
    p_tail = mx.maximum(1 - mx.take_along_axis(p, top, -1).sum(axis=-1), EPS)
    tail = q_tail * (mx.log(q_tail) - mx.log(p_tail))
    return {"reverse_kl": reverse_kl, "topk": topk, "tail": tail}


def distill_loss(
    student: StudentPath, batch: dict, prompt_tokens: int, topk_weight: float = 1.0, tail_weight: float = 1.0
) -> mx.array:
    rows, teacher_logits = batch["tokens"], batch["teacher_logits"]
    terms = distill_terms(student_logits(student, rows), teacher_logits)
    per_position = terms["reverse_kl"] + topk_weight * terms["topk"] + tail_weight * terms["tail"]
    return masked_mean(per_position, continuation_mask(*per_position.shape, prompt_tokens))


def train_distill(
    options: PhaseOptions,
    teacher: Path,
    generation: GenerationOptions = GenerationOptions(sequences=26),
    topk_weight: float = 1.0,
    tail_weight: float = 1.0,
    *,
    show_progress: bool = True,
) -> dict:
    """Phase 3 on ``options.checkpoint``, starting from its (Phase-2) adapters,
    copied to ``out_dir/start`` on the first run so a resume starts from
    the same ones; writes the new adapters into the checkpoint. Returns the report."""
    checkpoint, out_dir = Path(options.checkpoint), Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = out_dir / START_DIR
    if not lora.has_adapters(start):  # first run: keep the Phase-2 adapters it starts from
        if not lora.has_adapters(checkpoint):
            raise FileNotFoundError(
                f"{checkpoint / lora.ADAPTERS_FILE}: no Phase-2 adapters to start from (run `edge0 train sft` first)"
            )
        start.mkdir(exist_ok=True)
        for name in (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE):
            shutil.copy(checkpoint / name, start / name)
    model = load_served(checkpoint)
    lora.apply_adapters(model, start)
    lora.train_only_adapters(model)

    def make_rollouts():
        prompts = prompt_windows(
            corpus_tokens(checkpoint, "train", options.max_files),
            generation.sequences,
            generation.prompt_tokens,
            options.seed + 1,
        )
        return generate_rows(
            model, prompts, generation, options.seed + 1, "phase 3 student rollouts", show_progress=show_progress
        )

    rows = token_rows(out_dir / DATA_FILE, make_rollouts, label="phase 3 student rollouts")
    teacher_model = load_teacher(teacher)
    student = StudentPath(model)
    held = held_out_windows(checkpoint, options)
    before = held_out_eval(student, held, options.batch_size)
    batches = TokenBatches(rows.reshape(-1), generation.length - 1, options.batch_size, options.seed)
    P = generation.prompt_tokens

    def batch_at(step: int) -> dict:
        tokens = batches(step)
        teacher_logits = mx.stop_gradient(teacher_model(tokens[:, :-1]))
        mx.eval(teacher_logits)
        return {"tokens": tokens, "teacher_logits": teacher_logits}

    def loss_fn(m: nn.Module, batch: dict) -> mx.array:
        return distill_loss(student, batch, P, topk_weight, tail_weight)

    log = run_loop(
        model,
        loss_fn,
        batch_at,
        options.loop(),
        "phase 3 distill",
        lambda m: held_out_eval(student, held, options.batch_size),
        show_progress=show_progress,
    )
    report = {
        "phase": "distill",
        "teacher": str(teacher),
        "generation": vars(generation),
        "topk": TOP_K,
        "topk_weight": topk_weight,
        "tail_weight": tail_weight,
        "prerouter": bool(student.heads),
        "data_rows": int(rows.shape[0]),
        "before": before,
        "after": held_out_eval(student, held, options.batch_size),
        "final_loss": last_loss(log),
        "outputs": install_adapters(model, options),
    }
    write_report(options, report)
    return report
