"""``mlx_edge0.atomic``: a file or a directory is replaced whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlx_edge0 import atomic
from mlx_edge0.atomic import atomic_directory, atomic_path, exchange, write_json_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    write_json_atomic(target, {"v": 1}, indent=2)
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("{half")
            raise RuntimeError("interrupted")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_the_temporary_keeps_the_suffix(tmp_path):
    """np.save appends ".npy" to a name without it: the temporary has it already."""
    with atomic_path(tmp_path / "rows.npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(tmp_path / "rows.npy").tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.npy"]


def _tree(root):
    """Relative path -> content of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _write_tree(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


OLD = {"a.txt": "old a", "shared.txt": "old shared", "sub/deep.txt": "old deep"}
NEW = {"shared.txt": "new shared", "b.txt": "new b", "sub/other.txt": "new other"}


def test_a_new_directory_appears_whole(tmp_path):
    target = tmp_path / "parent" / "ckpt"
    with atomic_directory(target) as tmp:
        assert tmp.is_dir() and not any(tmp.iterdir()) and tmp.parent == target.parent
        assert not target.exists()
        _write_tree(tmp, NEW)
    assert _tree(target) == NEW
    assert [p.name for p in target.parent.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("existing", [True, False])
def test_an_error_mid_write_leaves_the_target_and_no_temporary(tmp_path, error, existing):
    target = tmp_path / "ckpt"
    if existing:
        target.mkdir()
        _write_tree(target, OLD)
    with pytest.raises(error):
        with atomic_directory(target, replace=True) as tmp:
            _write_tree(tmp, {"shared.txt": "half"})
            raise error("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == (["ckpt"] if existing else [])
    if existing:
        assert _tree(target) == OLD


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_replacing_a_directory_leaves_only_the_new_files(tmp_path, monkeypatch, atomic_exchange):
    if not atomic_exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    target = tmp_path / "ckpt"
    target.mkdir()
    _write_tree(target, OLD)
    with atomic_directory(target, replace=True) as tmp:
        _write_tree(tmp, NEW)
        assert _tree(target) == OLD  # the old tree stays whole until the block ends
    assert _tree(target) == NEW
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_an_existing_target_is_kept_without_replace(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    _write_tree(target, OLD)
    with pytest.raises(FileExistsError):
        with atomic_directory(target):
            pass
    with pytest.raises(FileExistsError):  # one that appears while writing is kept too
        with atomic_directory(tmp_path / "late") as tmp:
            _write_tree(tmp, NEW)
            (tmp_path / "late").mkdir()
    assert _tree(target) == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "late"]
    assert not any((tmp_path / "late").iterdir())


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from_a").write_text("a")
    (b / "from_b").write_text("b")
    if not exchange(a, b):
        pytest.skip("no atomic exchange on this OS or filesystem")
    assert [p.name for p in a.iterdir()] == ["from_b"] and [p.name for p in b.iterdir()] == ["from_a"]


def test_a_dead_writers_temporary_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ckpt.edge0-tmp-{int(dead.stdout)}"
    live = tmp_path / f".ckpt.edge0-tmp-{os.getppid()}"
    stale.mkdir()
    live.mkdir()
    with atomic_directory(tmp_path / "ckpt") as tmp:
        _write_tree(tmp, NEW)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "ckpt"]
