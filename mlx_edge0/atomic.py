"""Writing a file or a directory so that a reader sees the old one or the new one, never half.

Every file is written to a temporary sibling (same directory, so one rename
replaces it; hidden, keeping the suffix so writers that append one, like
``np.save``, name it as given) and renamed over the target only once written
whole; on any error the temporary is removed and the target is untouched.

A directory is written the same way into a hidden sibling named after the
writer's pid (``.NAME.edge0-tmp-PID``), so the temp dirs a killed writer left
behind are recognised and removed by the next write of the same target. An
existing directory is replaced in one atomic exchange where the OS has one
(Linux, macOS), so a path under it names an old file or a new one, never a
mix and never nothing.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s new content to; it
    replaces ``path`` when the block exits without an error."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path | str, obj: Any, **dumps: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON (``json.dumps(obj, **dumps)``, then a newline)."""
    write_text_atomic(path, json.dumps(obj, **dumps) + "\n")


@contextmanager
def atomic_directory(target: Path | str, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling directory to write ``target``'s new
    content into. It takes ``target``'s place when the block exits without an
    error; on any exception (KeyboardInterrupt included) it is removed and
    ``target`` is untouched.

    Args:
        target: the directory to write; its parents are created.
        replace: allow an existing ``target``, whose old tree is deleted once
            the new one is in place.

    Raises:
        FileExistsError: ``target`` exists and ``replace`` is False.
    """
    target = Path(target)
    _refuse_existing(target, replace)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(target)
    tmp = _sibling(target, "tmp")
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _put_in_place(tmp, target, replace)
    except BaseException:
        _remove(tmp)
        raise


def remove_stale_temp_dirs(target: Path) -> list[Path]:
    """Remove the temp dirs next to ``target`` that a killed writer (SIGKILL,
    power loss) left: those whose writer process no longer runs."""
    removed = []
    prefixes = (f".{target.name}.edge0-tmp-", f".{target.name}.edge0-old-")
    for path in target.parent.iterdir():
        pid = path.name.rsplit("-", 1)[-1]
        if path.name.startswith(prefixes) and pid.isdigit() and not _pid_alive(int(pid)):
            _remove(path)
            removed.append(path)
    return removed


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2``
    RENAME_EXCHANGE, macOS ``renamex_np`` RENAME_SWAP): False where the OS
    or filesystem has no such call."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        call = libc.renameat2
        call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        rc = call(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 2
        call = libc.renamex_np
        call.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rc = call(os.fsencode(a), os.fsencode(b), rename_swap)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _put_in_place(new: Path, target: Path, replace: bool) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is exchanged with
    it where possible, else moved aside first (a moment without it) and put
    back if the second rename fails."""
    if not os.path.lexists(target):
        new.rename(target)
        return
    _refuse_existing(target, replace)
    if exchange(new, target):
        _remove(new)  # now the old tree
        return
    old = _sibling(target, "old")
    target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        old.rename(target)
        raise
    _remove(old)


def _refuse_existing(target: Path, replace: bool) -> None:
    if not replace and os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))


def _sibling(target: Path, kind: str) -> Path:
    """The hidden temp name next to ``target`` that this process writes (``kind``: tmp or old)."""
    return target.parent / f".{target.name}.edge0-{kind}-{os.getpid()}"


def _remove(path: Path) -> None:
    """Delete ``path`` if it is there, whether a directory, a file or a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
