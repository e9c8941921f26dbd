"""The embedded default model of ``edge0 generate`` and ``edge0 serve``.

A 3.7M-parameter qwen3_moe (6 layers, 16 experts, K=4) trained from scratch
on the Python standard library by ``examples/train_tiny_moe.py``, shipped as
package data: ``default/edge0`` is its int4 edge0 checkpoint (with prerouter
heads), ``default/teacher`` the bf16 mlx-lm checkpoint it was converted from.
Both load straight from the installed package; nothing is built on first use.
It writes Python-looking code and nothing more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

DEFAULT_ROOT = Path(__file__).resolve().parent / "default"
EDGE0_DIR, TEACHER_DIR = "edge0", "teacher"
NOTICE = (
    "edge0: no --model given; using the embedded default, a 3.7M-parameter qwen3_moe "
    "trained on the Python standard library (it writes Python-like code, nothing more)"
)


def default_checkpoint() -> Path:
    """The packaged int4 edge0 checkpoint."""
    return _packaged(EDGE0_DIR)


def default_teacher() -> Path:
    """The packaged bf16 mlx-lm checkpoint the default was converted from."""
    return _packaged(TEACHER_DIR)


def ensure_default_model(log: Callable[[str], None] = print) -> Path:
    """Path of the default edge0 checkpoint, after telling the user what it is."""
    log(NOTICE)
    return default_checkpoint()


def _packaged(name: str) -> Path:
    path = DEFAULT_ROOT / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path / 'config.json'} is missing: the embedded default model is not installed "
            "with this copy of mlx-edge0; reinstall the package or pass --model"
        )
    return path
