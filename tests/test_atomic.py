"""``mlx_edge0.atomic``: a file is replaced whole or not at all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_edge0.atomic import atomic_path, write_json_atomic


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
