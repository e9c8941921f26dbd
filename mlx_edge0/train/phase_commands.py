"""``edge0 train heads|sft|distill``: the three phases on an edge0 checkpoint.

Each writes its output files into CHECKPOINT (``prerouter.safetensors``;
``adapters.safetensors`` + ``adapter_config.json``) and keeps its run state
(step checkpoints, ``log.json``, generated text, ``report.json`` and a copy
of the outputs) in ``--out``; running the same command again resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .. import lora
from .phases import GenerationOptions, PhaseOptions


def _fail(message: str) -> None:
    raise click.ClickException(message)


def phase_flags(steps: int, learning_rate: float):
    """The :class:`PhaseOptions` fields as flags, with a phase's own defaults."""

    def decorate(f):
        flags = [
            click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False)),
            click.option(
                "--out",
                "out_dir",
                type=click.Path(path_type=Path),
                required=True,
                help="Run dir: step checkpoints, log.json, report.json (resumes from it).",
            ),
            click.option("--steps", default=steps, show_default=True),
            click.option("--learning-rate", "--lr", "learning_rate", default=learning_rate, show_default=True),
            click.option("--batch-size", default=PhaseOptions.batch_size, show_default=True),
            click.option("--seq-len", default=PhaseOptions.seq_len, show_default=True),
            click.option("--seed", default=PhaseOptions.seed, show_default=True),
            click.option(
                "--max-files",
                default=PhaseOptions.max_files,
                show_default=True,
                help="Corpus files read per split (evenly spaced; 0 = all).",
            ),
            click.option(
                "--eval-windows",
                default=PhaseOptions.eval_windows,
                show_default=True,
                help="Held-out windows scored at each checkpoint.",
            ),
            click.option("--checkpoint-every", default=PhaseOptions.checkpoint_every, show_default=True),
            click.option("--warmup-steps", default=PhaseOptions.warmup_steps, show_default=True),
        ]
        for flag in reversed(flags):
            f = flag(f)
        return f

    return decorate


def generation_flags(sequences: int, temperature: float):
    def decorate(f):
        flags = [
            click.option(
                "--sequences", default=sequences, show_default=True, help="Prompts of train text to continue."
            ),
            click.option("--prompt-tokens", default=GenerationOptions.prompt_tokens, show_default=True),
            click.option("--new-tokens", default=GenerationOptions.new_tokens, show_default=True),
            click.option("--temperature", default=temperature, show_default=True, help="0 = greedy."),
        ]
        for flag in reversed(flags):
            f = flag(f)
        return f

    return decorate


def _options(**fields) -> PhaseOptions:
    try:
        return PhaseOptions(**fields)
    except ValueError as e:
        _fail(str(e))


def _generation(**fields) -> GenerationOptions:
    try:
        return GenerationOptions(**fields)
    except ValueError as e:
        _fail(str(e))


def _run(train, *args, **kwargs) -> None:
    from ..checkpoint import CheckpointError
    from ..tensorfile import TensorFileError

    try:
        report = train(*args, **kwargs)
    except (CheckpointError, TensorFileError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    summary = {k: v for k, v in report.items() if k not in ("generation",)}
    click.echo(json.dumps(summary, indent=2))


@click.command("heads")
@phase_flags(steps=300, learning_rate=3e-3)
@click.option("--mse-weight", default=0.1, show_default=True, help="Weight of the logit MSE next to the KL.")
def heads_command(mse_weight: float, **fields) -> None:
    """Phase 1: train CHECKPOINT's prerouter heads (base frozen) to predict the next
    layer's router; writes prerouter.safetensors into CHECKPOINT."""
    from .heads import train_heads

    _run(train_heads, _options(**fields), mse_weight)


@click.command("sft")
@phase_flags(steps=300, learning_rate=1e-3)
@generation_flags(sequences=256, temperature=1.0)
@click.option(
    "--teacher",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="The fp teacher (an mlx-lm checkpoint dir with the same tokenizer).",
)
@click.option("--rank", default=lora.RANK, show_default=True)
@click.option("--alpha", default=lora.ALPHA, show_default=True)
def sft_command(
    teacher: Path,
    rank: int,
    alpha: float,
    sequences: int,
    prompt_tokens: int,
    new_tokens: int,
    temperature: float,
    **fields,
) -> None:
    """Phase 2: train LoRA adapters on text the teacher generates, through the
    served (prerouted) forward; writes the adapters into CHECKPOINT."""
    from .sft import train_sft

    generation = _generation(
        sequences=sequences, prompt_tokens=prompt_tokens, new_tokens=new_tokens, temperature=temperature
    )
    _run(train_sft, _options(**fields), teacher, generation, rank, alpha)


@click.command("distill")
@phase_flags(steps=60, learning_rate=5e-4)
@generation_flags(sequences=26, temperature=1.0)
@click.option(
    "--teacher",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="The fp teacher (an mlx-lm checkpoint dir with the same tokenizer).",
)
@click.option("--topk-weight", default=1.0, show_default=True)
@click.option("--tail-weight", default=1.0, show_default=True)
def distill_command(
    teacher: Path,
    topk_weight: float,
    tail_weight: float,
    sequences: int,
    prompt_tokens: int,
    new_tokens: int,
    temperature: float,
    **fields,
) -> None:
    """Phase 3: on-policy distillation of CHECKPOINT's (Phase-2) adapters from the
    teacher on the student's own served rollouts; writes the adapters into CHECKPOINT."""
    from .distill import train_distill

    generation = _generation(
        sequences=sequences, prompt_tokens=prompt_tokens, new_tokens=new_tokens, temperature=temperature
    )
    _run(train_distill, _options(**fields), teacher, generation, topk_weight, tail_weight)


def add_phase_commands(group: click.Group) -> None:
    for command in (heads_command, sft_command, distill_command):
        group.add_command(command)
