"""The ``edge0 bench run`` options that the pairing scripts (``benchmarks/
code_pair.py``, ``read_ahead_pair.py``) read and rewrite between rounds:
they pass the rest through untouched, so they handle the two spellings click
accepts, ``--name VALUE`` and ``--name=VALUE``, in one place."""

from __future__ import annotations

from typing import Optional


def _find(args: list[str], name: str) -> Optional[tuple[int, bool]]:
    """(index, written with ``=``) of ``name``'s first use with a value."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return i, False
        if arg.startswith(f"{name}="):
            return i, True
    return None


def option_value(args: list[str], name: str) -> Optional[str]:
    """The value ``args`` give option ``name``; None where they give none."""
    found = _find(args, name)
    if found is None:
        return None
    i, inline = found
    return args[i].partition("=")[2] if inline else args[i + 1]


def with_option_value(args: list[str], name: str, value: str) -> list[str]:
    """A copy of ``args`` with option ``name``'s value replaced by ``value``
    (in the spelling they use); ``args`` themselves are left as they were.

    Raises:
        ValueError: ``args`` give ``name`` no value (names the option).
    """
    found = _find(args, name)
    if found is None:
        raise ValueError(f"the bench options give no {name}")
    i, inline = found
    changed = list(args)
    if inline:
        changed[i] = f"{name}={value}"
    else:
        changed[i + 1] = value
    return changed
