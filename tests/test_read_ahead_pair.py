"""benchmarks/read_ahead_pair.py: the disk's read-ahead window set per run and
put back, rounds alternated, the runs summarized against the peer; and the
bench's record of the window (``regime.read_ahead_kb``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import load_benchmark_script

from mlx_edge0.bench.regime import read_ahead_file, read_ahead_kb
from mlx_edge0.bench.runner import run_bench_round


@pytest.fixture(scope="module")
def pair():
    return load_benchmark_script("read_ahead_pair")


def _bdi(tmp_path: Path, path: Path, kb: str) -> Path:
    """A stand-in /sys/class/bdi holding ``path``'s disk's window."""
    st = os.stat(path)
    file = tmp_path / "bdi" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" / "read_ahead_kb"
    file.parent.mkdir(parents=True)
    file.write_text(kb)
    return file


def test_the_window_of_the_disk_holding_a_path_is_read(tmp_path):
    data = tmp_path / "model.gguf"
    data.write_bytes(b"x")
    file = _bdi(tmp_path, data, "8192\n")
    assert read_ahead_file(data, tmp_path / "bdi") == file
    assert read_ahead_kb(data, tmp_path / "bdi") == 8192
    file.write_text("not a number\n")
    assert read_ahead_kb(data, tmp_path / "bdi") is None
    assert read_ahead_kb(data, tmp_path / "elsewhere") is None


def test_windows_are_checked_and_alternate_by_round(pair):
    assert pair.parse_windows("128,8192") == [128, 8192]
    assert pair.parse_windows("128") == [128]
    for bad in ("128,128", "0,128", "128,big", ""):
        with pytest.raises(ValueError, match="--read-ahead-kb"):
            pair.parse_windows(bad)
    assert pair.order([128, 8192], 3) == [(1, 128), (1, 8192), (2, 8192), (2, 128), (3, 128), (3, 8192)]
    assert pair.order([128], 2) == [(1, 128), (2, 128)]


def test_the_arms_rotate_by_round(pair):
    args = ["--edge0", "/d/e", "--arms", "llamacpp,edge0-hot,edge0-prerouter", "--rounds-not-ours"]
    assert pair.rotated_arms(args, 1) == args
    assert pair.rotated_arms(args, 2)[3] == "edge0-hot,edge0-prerouter,llamacpp"
    assert pair.rotated_arms(args, 3)[3] == "edge0-prerouter,llamacpp,edge0-hot"
    assert pair.rotated_arms(args, 4) == args
    assert pair.rotated_arms(["--arms=a,b"], 2) == ["--arms=b,a"]
    assert pair.rotated_arms(["--edge0", "/d/e"], 2) == ["--edge0", "/d/e"]  # the bench's default arms


def test_the_checkpoints_named_and_the_gguf_beside_stock(tmp_path, pair):
    stock, edge0 = tmp_path / "stock", tmp_path / "edge0"
    stock.mkdir()
    edge0.mkdir()
    args = ["--stock", str(stock), f"--edge0={edge0}", "--arms", "llamacpp", "--gguf", str(tmp_path / "missing")]
    assert pair.checkpoint_paths(args) == [stock, edge0]  # no GGUF written yet, and a missing --gguf skipped
    gguf = tmp_path / "stock.gguf"
    gguf.write_bytes(b"GGUF")
    assert pair.checkpoint_paths(args) == [stock, edge0, gguf]
    with pytest.raises(ValueError, match="name no existing"):
        pair.window_files([])


def test_each_window_is_put_back_after_the_run_and_after_a_failure(tmp_path, pair):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("8192\n")
    b.write_text("256\n")
    with pair.read_ahead([a, b], 128):
        assert a.read_text() == b.read_text() == "128\n"
    assert (a.read_text(), b.read_text()) == ("8192\n", "256\n")
    with pytest.raises(RuntimeError, match="run failed"):
        with pair.read_ahead([a, b], 128):
            raise RuntimeError("run failed")
    assert (a.read_text(), b.read_text()) == ("8192\n", "256\n")


def test_a_window_that_cannot_be_set_names_the_file_and_leaves_none_changed(tmp_path, pair):
    a, fixed = tmp_path / "a", Path("/proc/version")  # readable, and not writable even by root
    a.write_text("8192\n")
    if not fixed.is_file():
        pytest.skip("no /proc here")
    own = fixed.read_text()
    with pytest.raises(ValueError, match=f"{fixed}: cannot set the read-ahead window"):
        with pair.read_ahead([a, fixed], 128):
            pass
    assert a.read_text() == "8192\n" and fixed.read_text() == own


def test_a_failed_bench_run_is_named_not_a_traceback(tmp_path):
    out = tmp_path / "ra128-r1.json"
    with pytest.raises(SystemExit, match=f"{out}: the bench run failed \\(exit status 2\\)"):
        run_bench_round(["--no-such-option"], out)
    assert not out.exists()


def _results(peer: float, edge0: float, peer_mb: float) -> dict:
    run = lambda arm, tok_s, mb: {"arm": arm, "ok": True, "decode_tok_s": tok_s, "device_bytes_per_token": mb * 1e6}  # noqa: E731
    return {"runs": [run("llamacpp", peer, peer_mb), run("edge0-prerouter", edge0, 45.0)]}


def test_the_summary_sets_each_arm_against_the_peer_of_its_run(pair):
    runs = {
        (1, 128): _results(0.75, 1.10, 66.7),
        (1, 8192): _results(0.03, 1.08, 1700.0),
        (2, 8192): _results(0.02, 1.00, 1600.0),
        (2, 128): _results(0.50, 1.00, 70.0),
    }
    table = pair.summarize(runs)
    small, large = table["128"], table["8192"]
    assert small["llamacpp"]["tok_s"]["median"] == pytest.approx(0.625)
    assert small["edge0-prerouter"]["x_peer"]["by_round"] == pytest.approx([1.10 / 0.75, 2.0])
    assert large["edge0-prerouter"]["x_peer"]["by_round"] == pytest.approx([36.0, 50.0])
    assert large["llamacpp"]["mb"] == {"median": 1650.0, "min": 1600.0, "max": 1700.0, "by_round": [1700.0, 1600.0]}
    json.dumps(table)  # the summary is written as JSON
