"""The command-line options ``edge0 bench``'s commands share, and their
parsers: each turns a comma list into checked values, or a click error that
names the option (never a traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from .arms import BUDGET_ARMS, KNOWN_ARMS, arm_base, parse_arm, with_budget
from .run_spec import DTYPES
from .suite import check_suite_arm
from .sweep import parse_grid


def csv_choice(allowed: tuple[str, ...], allow_empty: bool = False):
    """A click callback: a comma list, each item one of ``allowed``."""

    def parse(ctx, param, value: str) -> tuple[str, ...]:
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        bad = [v for v in items if v not in allowed]
        if bad or not (items or allow_empty):
            raise click.BadParameter(f"{value!r}: use a comma list of {', '.join(allowed)}")
        return items

    return parse


def arm_list(ctx, param, value: str) -> tuple[str, ...]:
    """``--arms``: a comma list of arm names (:func:`~.arms.parse_arm` checks each)."""
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    try:
        for arm in items:
            parse_arm(arm)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if not items:
        raise click.BadParameter("no arms given")
    return items


def suite_arm_list(allow_empty: bool = False):
    """A click callback: a comma list of the suite's arms."""

    def parse(ctx, param, value: str) -> tuple[str, ...]:
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        if not (items or allow_empty):
            raise click.BadParameter("no arms given")
        for arm in items:
            try:
                check_suite_arm(arm)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None
        return items

    return parse


def budget_list(ctx, param, value: str) -> tuple[float, ...]:
    """``--cache-gib``: a comma list of GiB."""
    try:
        return tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: use a comma list of GiB, e.g. 0.25,0.5,1") from None


# Every command that runs arms takes it.
TIMEOUT_OPTION = click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds before a run is killed and recorded as failed.",
)

# The checkpoint, arm and measurement options `run` and `sweep` share.
MEASUREMENT_OPTIONS = (
    click.option(
        "--stock",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Stock mlx-lm checkpoint (e.g. from `edge0 bench synth`).",
    ),
    click.option(
        "--edge0",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="The same model converted by `edge0 convert`.",
    ),
    click.option(
        "--gguf",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="The same model as a GGUF, for the llama.cpp arms [default: STOCK.gguf from `edge0 bench gguf`].",
    ),
    click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True),
    click.option("--prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True),
    click.option("--decode-tokens", type=click.IntRange(min=1), default=16, show_default=True),
    click.option(
        "--arms",
        default="stock,edge0-exact",
        show_default=True,
        callback=arm_list,
        help=f"Comma list of {', '.join(KNOWN_ARMS)}; edge0 arms may add a page-cache policy "
        "(ARM+bypass); hot/staged/prerouter take a budget as ARM@GiB; edge0 arms a K tier last, ARM/k4 "
        "(run on EDGE0-k4, a copy with K=4 heads).",
    ),
    click.option(
        "--cache-gib",
        "budgets",
        default="",
        callback=budget_list,
        help="Comma list of GiB: every hot/staged arm without @GiB runs at each budget.",
    ),
    click.option(
        "--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help="Compute dtype of both arms."
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Prompt token seed."),
    click.option(
        "--k",
        "k",
        type=int,
        default=0,
        show_default=True,
        help="K on the prerouted layers of edge0 arms (needs heads for it); stock stays native.",
    ),
    TIMEOUT_OPTION,
)


def measurement_options(command):
    """Add :data:`MEASUREMENT_OPTIONS` to a command, in that order."""
    for option in reversed(MEASUREMENT_OPTIONS):
        command = option(command)
    return command


def with_budgets(arms: tuple[str, ...], budgets: tuple[float, ...]) -> tuple[str, ...]:
    """Every hot/staged arm without @GiB at each of ``budgets`` (none: as given)."""
    expanded = []
    for arm in arms:
        if budgets and "@" not in arm and arm_base(arm) in BUDGET_ARMS:
            expanded += [with_budget(arm, b) for b in budgets]
        else:
            expanded.append(arm)
    return tuple(expanded)


def grid_values(unit: str):
    """A click callback: a sweep's grid of values in ``unit`` (:func:`~.sweep.parse_grid`)."""

    def parse(ctx, param, value: str) -> tuple[Optional[float], ...]:
        try:
            return parse_grid(value, unit)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return parse
