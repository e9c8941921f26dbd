"""The command line the offline replay scripts share (``benchmarks/
settled_victims.py``, ``waited_cost.py``, ``gap_by_length.py``): recorded
decodes to replay, the checkpoint whose routing profile the runtime's LFU
started from, and where to write the results; each script adds its own knob."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional, TypeVar

from ..popularity import RoutingProfile, require_profile
from .eviction import RecordedDecode, recorded_decodes

Recorded = list[tuple[Path, list[tuple[dict, RecordedDecode]]]]
Number = TypeVar("Number", int, float)


def replay_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with ``--bench`` (repeatable), ``--profile`` and ``--out``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", type=Path, action="append", required=True, help="an edge0 bench results JSON")
    p.add_argument("--profile", type=Path, help="the decodes' checkpoint, with popularity.safetensors")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    return p


def read_replay_inputs(args: argparse.Namespace) -> tuple[Optional[RoutingProfile], Recorded]:
    """The profile (None without ``--profile``) and each ``--bench`` file's
    recorded decodes. Exits with the message naming the file that is not a
    checkpoint with a profile or not a results file, never a traceback."""
    try:  # a CheckpointError is a ValueError too
        profile = require_profile(args.profile) if args.profile is not None else None
        return profile, [(path, recorded_decodes(path)) for path in args.bench]
    except ValueError as e:
        raise SystemExit(str(e)) from None


def comma_list(
    text: str, flag: str, number: Callable[[str], Number], valid: Callable[[list[Number]], bool], rule: str
) -> list[Number]:
    """A script knob's comma-separated numbers (``number`` reads each one),
    which ``valid`` must accept as a whole. Exits with ``flag``, what to give
    (``rule``) and what was given, never a traceback."""
    try:
        values = [number(c) for c in text.split(",")]
    except ValueError:
        values = []
    if not values or not valid(values):
        raise SystemExit(f"{flag}: give {rule}, got {text!r}")
    return values
