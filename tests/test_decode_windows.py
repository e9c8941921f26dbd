"""benchmarks/decode_windows.py splits each decode into windows of steps and pairs arms by round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_windows.py"


@pytest.fixture(scope="module")
def windows():
    return load_benchmark_script("decode_windows")


def _run(arm: str, rnd: int, steps_s: list[float], mb: list[float] | None = None) -> dict:
    run = {"arm": arm, "round": rnd, "cache": "cold", "ok": True, "decode_tok_s": 1.0, "decode_step_s": steps_s}
    if mb is not None:
        run["decode_step_counters"] = [{"bytes_read": m * 1e6} for m in mb]
    return run


def test_whole_windows_only(windows):
    assert windows.window_rates([1.0, 1.0, 0.5, 0.5, 9.0], 2) == pytest.approx([1.0, 2.0])  # the tail dropped
    assert windows.window_mb([{"bytes_read": 4e6}, {"bytes_read": 2e6}, {"bytes_read": 1e6}], 2) == [3.0]


def test_each_window_is_paired_with_the_peer_of_its_own_round(windows):
    # round 0: the peer 1 s a step, then 0.5; edge0 0.5 s throughout. Round 1: everything twice as slow.
    files = [
        ("a.json", [_run("llamacpp", 0, [1.0, 1.0, 0.5, 0.5]), _run("edge0-hot", 0, [0.5] * 4, [40, 40, 10, 10])]),
        ("b.json", [_run("llamacpp", 0, [2.0, 2.0, 1.0, 1.0]), _run("edge0-hot", 0, [1.0] * 4, [40, 40, 20, 20])]),
    ]
    table = windows.arm_windows(windows.by_round(files), 2)
    assert table["llamacpp"]["tok_s"] == pytest.approx([0.75, 1.5]) and table["llamacpp"]["x_peer"] is None
    edge0 = table["edge0-hot"]
    assert edge0["rounds"] == 2
    assert edge0["tok_s"] == pytest.approx([1.5, 1.5]) and edge0["tok_s_range"] == [(1.0, 2.0), (1.0, 2.0)]
    assert edge0["mb_per_token"] == pytest.approx([40.0, 15.0])
    assert edge0["x_peer_by_round"] == [pytest.approx([2.0, 2.0]), pytest.approx([1.0, 1.0])]


def test_the_table_and_a_bad_window_from_the_command_line(tmp_path):
    results = tmp_path / "r.json"
    runs = [_run("llamacpp", 0, [1.0, 1.0]), _run("edge0-hot", 0, [0.5, 0.5], [10, 10])]
    results.write_text(json.dumps({"runs": runs}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(results), "--window", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| edge0-hot | 1 | 1–2 | 2.000 (2.000–2.000) | 10.0 | 2.00 (2.00) |" in out.stdout
    for window, message in (("0", "at least 1"), ("3", "no successful run has 3 decode steps")):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), str(results), "--window", window], capture_output=True, text=True
        )
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


def test_cache_states_of_one_round_are_paired_apart(windows):
    runs = [
        {**_run("llamacpp", 0, [1.0, 1.0]), "cache": "cold"},
        {**_run("edge0-hot", 0, [0.5, 0.5]), "cache": "cold"},
        {**_run("llamacpp", 0, [0.25, 0.25]), "cache": "pressure"},
        {**_run("edge0-hot", 0, [0.5, 0.5]), "cache": "pressure"},
    ]
    table = windows.arm_windows(windows.by_round([("a.json", runs)]), 2)
    assert table["edge0-hot"]["x_peer_by_round"] == [pytest.approx([2.0, 0.5])]
