"""The one trust check: which code an edge0 checkpoint could make Python run.

An edge0 checkpoint's config.json names a model file (``model_file``) that
mlx-lm imports under ``--trust-remote-code``; the converter writes there a
one-line shim that imports the installed ``mlx_edge0`` and binds it to the
shim's own directory. mlx-edge0's entry points (``load``, ``load_model`` and
every command built on them: generate, serve, eval, train, bench, heads)
import nothing from a checkpoint: they build the model from the installed
package, and only after :func:`check_code` has passed. So does the shim
itself (``plugin.bind``), for stock ``mlx_lm`` commands run with the flag.

What passes:

- ``model_file`` is a plain file name (no directory part, no ``..``, not
  absolute) of a *regular* file in the checkpoint directory (not a symlink,
  which could make the shim of one checkpoint stream another's experts),
  whose bytes are exactly our shim's;
- no other Python file anywhere under the directory and no ``auto_map`` in
  config.json or tokenizer_config.json: transformers runs such code for a
  tokenizer or config loaded with ``trust_remote_code``.

:func:`inspect_code` reports the same facts without raising (``edge0 info``
prints them, including what ``--trust-remote-code`` would execute).
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checkpoint import CONFIG_FILE, SHIM_FILE, SHIM_SOURCE, CheckpointError, read_config

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SHIM_CODE = compile(SHIM_SOURCE, SHIM_FILE, "exec", dont_inherit=True)


class UntrustedCodeError(CheckpointError):
    """The checkpoint could make Python run code that mlx-edge0 did not write."""


@dataclass(frozen=True)
class CodeReport:
    """Which code a checkpoint names, and what is wrong with it (if anything)."""

    checkpoint: Path  # absolute, symlinks in the directory path kept
    model_file: Optional[str]  # as config.json names it
    model_file_path: Optional[Path]  # what mlx-lm would import (None: nothing)
    shim_ok: bool  # a regular file inside the checkpoint with exactly our bytes
    other_code: tuple[str, ...]  # other Python files, relative to the checkpoint
    auto_map: tuple[str, ...]  # files with an auto_map
    problems: tuple[str, ...]  # each names the file

    @property
    def trusted(self) -> bool:
        return not self.problems


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as an absolute directory (``~`` expanded), or a clear error.

    Raises:
        CheckpointError: the directory does not exist or is not a directory.
    """
    directory = Path(os.path.abspath(Path(path).expanduser()))
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (an edge0 checkpoint is a directory)")
    return directory


def inspect_code(path: str | Path) -> CodeReport:
    """What ``--trust-remote-code`` would run for the checkpoint at ``path``.

    Raises:
        CheckpointError: no such directory, or config.json unreadable.
    """
    directory = checkpoint_dir(path)
    config = read_config(directory)
    model_file = config.get("model_file")
    problems: list[str] = []
    target: Optional[Path] = None
    shim_ok = False
    if model_file is None:
        problems.append(f"{directory / CONFIG_FILE}: names no model_file (edge0 convert writes {SHIM_FILE})")
    elif not _is_plain_name(model_file):
        problems.append(
            f"{directory / CONFIG_FILE}: model_file {model_file!r} is not a file name inside the checkpoint"
        )
        if isinstance(model_file, str):
            target = Path(os.path.abspath(directory / model_file))
    else:
        target = directory / model_file
        shim_ok, problem = _check_shim(target)
        if problem:
            problems.append(problem)
    other_code = tuple(
        p
        for p in _python_files(directory)
        if target is None or not (directory / p == target or _is_shim_bytecode(directory / p, target))
    )
    if other_code:
        problems.append(f"{directory}: holds other Python code {list(other_code)}")
    auto_map = tuple(n for n in (CONFIG_FILE, TOKENIZER_CONFIG_FILE) if _has_auto_map(directory / n))
    if auto_map:
        problems.append(f"{directory}: auto_map in {list(auto_map)} names code transformers would import")
    return CodeReport(
        checkpoint=directory,
        model_file=model_file if isinstance(model_file, str) else None,
        model_file_path=target,
        shim_ok=shim_ok,
        other_code=other_code,
        auto_map=auto_map,
        problems=tuple(problems),
    )


def check_code(path: str | Path) -> Path:
    """The checkpoint directory, once it names only our shim and holds no other code.

    Raises:
        CheckpointError: no such directory, or config.json unreadable.
        UntrustedCodeError: naming each file and what is wrong with it.
    """
    report = inspect_code(path)
    if report.problems:
        raise UntrustedCodeError(
            "; ".join(report.problems) + ". mlx-edge0 runs only the shim its converter writes; inspect the checkpoint "
            "(edge0 info) and re-convert it, or, if you trust its code, run it with mlx_lm "
            "--trust-remote-code yourself"
        )
    return report.checkpoint


def _is_plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and "/" not in name
        and "\\" not in name
    )


def _check_shim(file: Path) -> tuple[bool, Optional[str]]:
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        return False, f"{file}: model file not found"
    except OSError as e:
        return False, f"{file}: cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return False, f"{file}: is a symlink (to {os.readlink(file)}); the shim must be a file of this checkpoint"
    if not stat.S_ISREG(st.st_mode):
        return False, f"{file}: not a regular file"
    try:
        source = file.read_bytes()
    except OSError as e:
        return False, f"{file}: cannot be read ({e.strerror})"
    if source != SHIM_SOURCE.encode():
        return False, f"{file}: not the mlx-edge0 shim, so --trust-remote-code would run code mlx-edge0 did not write"
    return True, None


def _python_files(directory: Path) -> list[str]:
    """Python files under ``directory`` (symlinked directories not followed)."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith((".py", ".pyc")):
                found.append(str((Path(root) / name).relative_to(directory)))
    return sorted(found)


def _is_shim_bytecode(file: Path, shim: Path) -> bool:
    """Python caches the shim's bytecode in ``__pycache__`` when mlx-lm
    imports it, and would run that cache instead of the source while its
    recorded size and mtime match: so a cache passes only when its code is
    exactly the shim's, compiled."""
    if file.parent != shim.parent / "__pycache__" or not file.name.startswith(shim.stem + "."):
        return False
    try:
        data = file.read_bytes()
        code = marshal.loads(data[16:])
    except (OSError, EOFError, ValueError, TypeError):
        return False
    return data[:4] == importlib.util.MAGIC_NUMBER and code == _SHIM_CODE


def _has_auto_map(file: Path) -> bool:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "auto_map" in data
