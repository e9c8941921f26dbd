"""``edge0 train ...``: one subcommand per training phase, each a thin call into the library."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .base import BaseOptions
from .phase_commands import add_phase_commands


@click.group()
def train() -> None:
    """Train the base model, the prerouter heads and the recovery LoRA."""


@train.command("base")
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@click.option("--steps", default=BaseOptions.steps, show_default=True)
@click.option("--batch-size", default=BaseOptions.batch_size, show_default=True)
@click.option("--seq-len", default=BaseOptions.seq_len, show_default=True)
@click.option("--learning-rate", default=BaseOptions.learning_rate, show_default=True)
@click.option("--warmup-steps", default=BaseOptions.warmup_steps, show_default=True)
@click.option("--seed", default=BaseOptions.seed, show_default=True)
@click.option("--vocab-size", default=BaseOptions.vocab_size, show_default=True)
@click.option(
    "--balance-coef",
    default=BaseOptions.balance_coef,
    show_default=True,
    help="Weight of the router load-balancing term.",
)
@click.option("--checkpoint-every", default=BaseOptions.checkpoint_every, show_default=True)
@click.option("--log-every", default=BaseOptions.log_every, show_default=True)
@click.option(
    "--eval-windows",
    default=BaseOptions.eval_windows,
    show_default=True,
    help="Held-out windows scored at each checkpoint.",
)
def base(out: Path, **fields) -> None:
    """Train the stdlib base MoE from scratch into OUT (OUT/teacher is an mlx-lm
    checkpoint); run it again with the same options to resume."""
    from .base import train_base

    try:
        options = BaseOptions(out_dir=out, **fields)
        report = train_base(options, log=lambda m: click.echo(m, err=True))
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report.as_dict(), indent=2))


add_phase_commands(train)  # heads, sft, distill
