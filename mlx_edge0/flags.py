"""The click flags that commands loading a model share (``edge0 generate``,
``edge0 serve``), generated from the :class:`Options` fields.

Every field becomes ``--field-name`` (``--name/--no-name`` for a boolean) with
the field's default, and the help text, choices and parser its metadata
declares (see :mod:`mlx_edge0.options`): a new option is one field there, and
every command offers it. The flags give :func:`options_from_flags` keyword
arguments named after the fields.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, Callable

import click

from .options import Options

model_option = click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Edge0 checkpoint dir (default: the embedded default model).",
)


def _parse_with(parse: Callable[[str], Any]) -> Callable:
    """A click callback that runs ``parse`` and reports its ``ValueError`` as a bad value."""

    def callback(ctx: click.Context, param: click.Parameter, value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return callback


def field_flag(f: Field) -> Callable:
    """The click option for one :class:`Options` field."""
    assert f.default is not MISSING, f"Options.{f.name} needs a default to be a flag"
    name = f.name.replace("_", "-")
    meta = f.metadata
    extra: dict[str, Any] = {}
    if meta.get("choices"):
        extra["type"] = click.Choice(meta["choices"])
    if meta.get("parse"):  # the parser gets the text, whatever the default's type
        extra["type"] = click.STRING
        extra["callback"] = _parse_with(meta["parse"])
    decls = [f"--{name}/--no-{name}" if isinstance(f.default, bool) else f"--{name}", f.name]
    return click.option(*decls, default=f.default, show_default=True, help=meta.get("help"), **extra)


def option_flags(f: Callable) -> Callable:
    """Decorate a click command with every :class:`Options` field as a flag, in field order."""
    for flag in reversed([field_flag(field) for field in fields(Options)]):
        f = flag(f)
    return f


def options_from_flags(**option_fields: Any) -> Options:
    """The validated :class:`Options` of a command's flags.

    Raises:
        click.ClickException: the combination is invalid (``Options``' message says how to fix it).
    """
    try:
        return Options(**option_fields)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
