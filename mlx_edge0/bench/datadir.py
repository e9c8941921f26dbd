"""Where the bench keeps its synthetic checkpoints, what they take, and removing them.

The suite keeps its checkpoints (a stock and an edge0 copy of each geometry,
gigabytes) so reruns skip synthesis; it says where and how much, and
``edge0 bench clean`` removes them. Only directories the bench made are
touched: a checkpoint whose ``config.json`` carries the ``edge0_synthetic``
record that synthesis writes (conversion copies it).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA = Path("~/.cache/mlx-edge0/bench").expanduser()
SYNTHETIC_KEY = "edge0_synthetic"


@dataclass(frozen=True)
class BenchCheckpoint:
    path: Path
    nbytes: int


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def bench_checkpoints(data: Path) -> list[BenchCheckpoint]:
    """The checkpoints the bench made directly under ``data``, by name."""
    if not data.is_dir():
        return []
    found = []
    for sub in sorted(p for p in data.iterdir() if p.is_dir() and not p.is_symlink()):
        try:
            config = json.loads((sub / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and SYNTHETIC_KEY in config:
            found.append(BenchCheckpoint(sub, dir_bytes(sub)))
    return found


def remove_checkpoints(data: Path) -> list[BenchCheckpoint]:
    """Remove the bench's checkpoints under ``data`` (and ``data`` once empty);
    returns what was removed."""
    found = bench_checkpoints(data)
    for c in found:
        shutil.rmtree(c.path)
    if data.is_dir() and not any(data.iterdir()):
        data.rmdir()
    return found
