"""What convert writes is plain safetensors: the reference library (``safetensors``)
reads the same names, shapes, dtypes, metadata and bytes as our own header parser."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from mlx_edge0.checkpoint import RESIDENT_FILE, expert_file
from mlx_edge0.tensorfile import read_header


@pytest.mark.parametrize("which", ["experts", "resident"])
def test_reference_reader_agrees_with_ours(converted, which):
    out = converted("qwen3_moe").edge0
    path = out / (expert_file(1) if which == "experts" else RESIDENT_FILE)
    ours = read_header(path)
    with safe_open(str(path), "numpy") as f:
        assert f.metadata() == ours.metadata
        assert sorted(f.keys()) == sorted(ours.entries)
        for name, entry in ours.entries.items():
            view = f.get_slice(name)
            assert (view.get_dtype(), tuple(view.get_shape())) == (entry.dtype, entry.shape), name
        uint32 = [n for n, e in ours.entries.items() if e.dtype == "U32"]
        assert uint32
        loaded = mx.load(str(path))
        for name in uint32:
            assert np.array_equal(f.get_tensor(name), np.array(loaded[name])), name


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.uint32, mx.float16])
def test_row_reader_reads_exactly_the_rows(tmp_path, dtype):
    """An expert-parallel rank's vocabulary rows come straight from the file:
    the bytes of rows [start, end), nothing else, for every dtype."""
    from mlx_edge0.tensorfile import row_reader

    full = (mx.arange(7 * 6).reshape(7, 6) * 3 + 1).astype(dtype)
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"emb.weight": full, "other": mx.zeros((2,))})
    read = row_reader(path)
    for start, end in [(0, 7), (2, 5), (6, 7), (3, 3)]:
        got = read("emb.weight", start, end)
        assert got.dtype == dtype and got.shape == (end - start, 6)
        assert mx.array_equal(got, full[start:end]).item()
    assert read("missing", 0, 1) is None
    assert read("emb.weight", 5, 9) is None  # past the rows: the caller slices instead
