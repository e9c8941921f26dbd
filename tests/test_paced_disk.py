"""benchmarks/paced_disk.py serves a folder at a fixed rate, its idle time lost;
benchmarks/disk_pair.py sets the same arms on two disks side by side."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import load_benchmark_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "paced_disk.py"


def _run(arm: str, round_: int, tok_s: float, mb: float, wait_ms: float) -> dict:
    counters = {"bytes_read": mb * 1e6, "exposed_wait_ms": wait_ms}
    return {
        "arm": arm,
        "ok": True,
        "round": round_,
        "decode_tok_s": tok_s,
        "decode_s_per_token": 1 / tok_s,
        "counters_per_token": counters,
    }


def test_disk_pair_sets_each_arm_against_the_hot_arm_by_round(tmp_path, monkeypatch):
    disk_pair = load_benchmark_script("disk_pair")
    paced = [
        _run("edge0-hot+bypass", 0, 0.5, 50.0, 1000.0),
        _run("edge0-prerouter+bypass", 0, 0.8, 50.0, 100.0),
        _run("edge0-hot+bypass", 1, 0.4, 50.0, 1200.0),
        _run("edge0-prerouter+bypass", 1, 0.8, 50.0, 100.0),
        _run("edge0-hot+bypass/k4", 0, 0.25, 25.0, 1000.0),
        _run("edge0-prerouter+bypass/k4", 0, 1.0, 25.0, 100.0),
    ]
    throttled = [
        _run("edge0-hot+bypass", 0, 0.9, 50.0, 50.0),
        _run("edge0-prerouter+bypass", 0, 0.9, 50.0, 50.0),
        {"arm": "edge0-hot+bypass", "ok": False, "round": 1},
        _run("edge0-prerouter+bypass/k4", 0, 1.0, 25.0, 100.0),
    ]
    for name, runs in (("paced", paced), ("throttled", throttled)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": runs}))
    out = tmp_path / "pair.json"
    argv = [
        "disk_pair",
        "--paced",
        str(tmp_path / "paced.json"),
        "--throttled",
        str(tmp_path / "throttled.json"),
        "--read-mbps",
        "40",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    disk_pair.main()
    table = json.loads(out.read_text())["arms"]
    pre = table["edge0-prerouter+bypass"]
    assert pre["paced"]["x_base_by_round"] == pytest.approx([1.6, 2.0])
    assert pre["paced"]["x_base"] == pytest.approx(1.8)
    assert pre["paced"]["of_read_bound"] == pytest.approx(0.8 / (40 / 50))  # 50 MB a token at 40 MB/s: 0.8 tok/s
    assert pre["paced"]["wait_share"] == pytest.approx(0.08)
    assert pre["throttled"]["x_base_by_round"] == pytest.approx([1.0])  # round 1's hot run failed
    assert table["edge0-hot+bypass"]["paced"]["tok_s"] == pytest.approx(0.45)
    k4 = table["edge0-prerouter+bypass/k4"]  # set against the hot arm of its K tier, not K=8's
    assert k4["paced"]["x_base_by_round"] == pytest.approx([4.0])
    assert k4["throttled"]["x_base"] is None  # that tier has no hot arm there
    assert "edge0-hot+bypass/k4" not in table  # not run on both disks


def test_the_clock_loses_idle_time_instead_of_banking_it():
    pytest.importorskip("pyfuse3")
    paced_disk = load_benchmark_script("paced_disk")
    clock = paced_disk.DiskClock(40e6)
    assert clock.done_at(4_000_000, now=0.0) == pytest.approx(0.1)
    assert clock.done_at(4_000_000, now=0.05) == pytest.approx(0.2)  # queued behind the first
    assert clock.done_at(4_000_000, now=10.0) == pytest.approx(10.1)  # 9.8 s idle: nothing handed back
    assert clock.served == 12_000_000 and clock.busy_s == pytest.approx(0.3)


def _mounted(path: Path, proc: subprocess.Popen) -> bool:
    for _ in range(100):
        if os.path.ismount(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def test_a_read_after_idle_takes_its_bytes_time_and_the_view_is_read_only(tmp_path):
    pytest.importorskip("pyfuse3")
    if not Path("/dev/fuse").exists() or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root to mount")
    source, view = tmp_path / "source", tmp_path / "view"
    (source / "experts").mkdir(parents=True)
    view.mkdir()
    data = os.urandom(4_000_000)
    (source / "experts" / "layer.bin").write_bytes(data)
    (source / "link").symlink_to("experts/layer.bin")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(source), str(view), "--read-mbps", "40"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert _mounted(view, proc), "the view did not mount"
        assert sorted(os.listdir(view)) == ["experts", "link"]
        assert os.readlink(view / "link") == "experts/layer.bin"
        time.sleep(0.3)  # idle: the kernel's throttle would hand this to the read below
        started = time.perf_counter()
        assert (view / "experts" / "layer.bin").read_bytes() == data
        took = time.perf_counter() - started
        assert 0.1 <= took < 2.0  # 4 MB at 40 MB/s
        with pytest.raises(OSError):
            open(view / "experts" / "layer.bin", "r+b")
        with pytest.raises(OSError):
            (view / "new").write_bytes(b"x")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert not os.path.ismount(view)
    assert out.startswith("served ")
