"""Arms in memory- and read-capped cgroups (``mlx_edge0.bench.regime``): set
up under this process's own cgroup, removed afterwards, an OOM kill reported
as a result, reads throttled and counted at the device."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from mlx_edge0.bench.run_spec import drop_page_cache
from mlx_edge0.bench.regime import ArmCgroup, Regime, block_device, own_cgroups, regime_unavailable
from mlx_edge0.bench.runner import cgroup_prefix

ALLOCATE = "import sys; blocks = [bytearray(64 << 20) for _ in range(int(sys.argv[1]))]; print('done')"
READ = (
    "import sys; f = open(sys.argv[1], 'rb', buffering=0); n = 0\n"
    "while chunk := f.read(1 << 20): n += len(chunk)\nprint(n)"
)


def bench_cgroups_left(pid: Optional[int] = None) -> list[str]:
    """The cgroups bench process ``pid`` (this one by default) made that are
    still there, in either hierarchy (:func:`cgroup_prefix` names them; the
    bench removes each afterwards). Only that process's are counted: another
    test run in the same parent cgroup makes and removes its own meanwhile."""
    own = own_cgroups()
    prefix = cgroup_prefix(os.getpid() if pid is None else pid)
    return sorted(
        {p.name for d in (own.memory, own.io) if d.is_dir() for p in d.iterdir() if p.name.startswith(prefix)}
    )


def skip_unless_available(regime: Regime, path: Path) -> None:
    why = regime_unavailable(regime, path)
    if why:
        pytest.skip(f"cgroups not available here: {why}")


def test_regime_is_validated():
    with pytest.raises(ValueError, match="memory cap must be a positive"):
        Regime(memory_cap_gib=0)
    with pytest.raises(ValueError, match="read throughput must be a positive"):
        Regime(read_mbps=-1)
    assert (
        Regime(1.5, 50).label() == "memory capped at 1.5 GiB (page cache included), device reads throttled to 50 MB/s"
    )
    assert not Regime().active


def test_layout_of_v1_and_v2_hierarchies(tmp_path):
    (tmp_path / "memory" / "a" / "b").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("7:blkio:/\n4:memory:/a/b\n0::/\n")
    layout = own_cgroups(proc, tmp_path)
    assert (layout.version, layout.memory, layout.io) == (1, tmp_path / "memory/a/b", tmp_path / "blkio")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("memory io\n")
    proc.write_text("0::/user.slice/x\n")
    layout = own_cgroups(proc, v2)
    assert (layout.version, layout.memory, layout.io) == (2, v2 / "user.slice/x", v2 / "user.slice/x")


def test_an_oom_kill_is_a_result_and_the_cgroup_is_removed(tmp_path):
    regime = Regime(memory_cap_gib=0.25)
    skip_unless_available(regime, tmp_path)
    layout = own_cgroups()
    name = f"edge0-test-{os.getpid()}"
    with ArmCgroup(regime, layout, None, name) as cgroup:
        assert (layout.memory / name / "cgroup.procs").is_file()
        small = subprocess.run(
            [sys.executable, "-c", ALLOCATE, "1"], preexec_fn=cgroup.join, capture_output=True, text=True, timeout=60
        )
        assert small.returncode == 0 and cgroup.stats()["oom_kills"] == 0
        big = subprocess.run(
            [sys.executable, "-c", ALLOCATE, "8"], preexec_fn=cgroup.join, capture_output=True, text=True, timeout=60
        )
        stats = cgroup.stats()
    assert big.returncode == -9 and stats["oom_kills"] >= 1
    assert 0.2 * 2**30 < stats["cgroup_peak_bytes"] <= 0.25 * 2**30
    assert not (layout.memory / name).exists()


def test_reads_are_throttled_and_counted_at_the_device(tmp_path):
    regime = Regime(read_mbps=20)
    skip_unless_available(regime, tmp_path)
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(24 * 1000 * 1000))
    os.sync()
    assert drop_page_cache([data], sync=True)
    layout = own_cgroups()
    name = f"edge0-test-io-{os.getpid()}"
    with ArmCgroup(regime, layout, block_device(data), name) as cgroup:
        t0 = time.perf_counter()
        read = subprocess.run(
            [sys.executable, "-c", READ, str(data)], preexec_fn=cgroup.join, capture_output=True, text=True, timeout=120
        )
        seconds = time.perf_counter() - t0
        stats = cgroup.stats()
    assert read.returncode == 0 and int(read.stdout) == 24 * 1000 * 1000
    assert stats["device_read_bytes"] >= 24 * 1000 * 1000
    assert seconds >= 0.8  # 24 MB at 20 MB/s: at least 1.2 s minus the throttle's initial slice
    assert not (layout.memory / name).exists() and not (layout.io / name).exists()


def test_bench_run_in_a_capped_cgroup_reports_oom_as_a_result(converted, tmp_path):
    """``edge0 bench run --memory-cap``: a cap below what an arm needs ends in
    "OOM at ..." (exit 0: a result); a cap it fits in runs, with the
    cgroup's peak memory and device bytes recorded, and no cgroup left."""
    import json

    from click.testing import CliRunner

    from mlx_edge0.cli import main

    conv = converted("qwen3_moe")
    regime = Regime(memory_cap_gib=0.015, read_mbps=200)
    skip_unless_available(regime, conv.edge0)
    assert bench_cgroups_left() == []
    common = [
        "bench",
        "run",
        "--stock",
        str(conv.source),
        "--edge0",
        str(conv.edge0),
        "--rounds",
        "1",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--cache",
        "cold",
        "--read-mbps",
        "200",
    ]
    tight = CliRunner().invoke(main, [*common, "--memory-cap", "0.015", "--out", str(tmp_path / "tight.json")])
    assert tight.exit_code == 0, tight.output
    runs = json.loads((tmp_path / "tight.json").read_text())["runs"]
    assert [r["error"] for r in runs] == ["OOM at 0.015 GiB (killed by the OOM killer)"] * 2
    assert all(r["oom"] and r["cgroup"]["oom_kills"] >= 1 for r in runs)
    roomy = CliRunner().invoke(main, [*common, "--memory-cap", "4", "--out", str(tmp_path / "roomy.json")])
    assert roomy.exit_code == 0, roomy.output
    saved = json.loads((tmp_path / "roomy.json").read_text())
    assert saved["regime"] == "memory capped at 4 GiB (page cache included), device reads throttled to 200 MB/s"
    for r in saved["runs"]:
        assert r["ok"] and 0 < r["cgroup"]["cgroup_peak_bytes"] <= 4 * 2**30
        assert r["cgroup"]["device_read_bytes"] > 0  # cold: the checkpoint came from the disk
    assert bench_cgroups_left() == []


def test_a_memory_cap_refuses_a_warm_page_cache(converted, tmp_path):
    from mlx_edge0.bench.runner import BenchOptions

    conv = converted("qwen3_moe")
    skip_unless_available(Regime(memory_cap_gib=1), conv.edge0)
    with pytest.raises(ValueError, match="a memory cap needs a cold page cache"):
        BenchOptions(
            out=tmp_path / "r.json",
            edge0=conv.edge0,
            arms=("edge0-exact",),
            caches=("warm",),
            regime=Regime(memory_cap_gib=1),
        )


def test_small_mac_preset_scales_with_the_checkpoint(converted, tmp_path):
    from click.testing import CliRunner

    from mlx_edge0.bench.regime import PRESETS
    from mlx_edge0.cli import main

    small_mac = PRESETS["small-mac"]
    assert small_mac.regime(int(19.5e9)) == Regime(12.0, 22)  # qwen3.5-35b-a3b on a 16 GB M2
    assert small_mac.regime(int(4.5e9)) == Regime(2.77, 22)  # ling-3.0-tiny, the same ratio
    with pytest.raises(ValueError, match="scales to a memory cap of 0 GiB, too small"):
        small_mac.regime(2_000_000)
    conv = converted("qwen3_moe")
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "run",
            "--edge0",
            str(conv.edge0),
            "--arms",
            "edge0-exact",
            "--regime",
            "small-mac",
            "--out",
            str(tmp_path / "r.json"),
        ],
    )
    assert result.exit_code == 1 and "too small for Python and MLX to start in" in result.output


def test_a_preset_scales_with_the_model_weights_not_the_heads_or_adapters(converted, tmp_path):
    import shutil

    from mlx_edge0.bench.regime import checkpoint_bytes

    conv = converted("qwen3_moe")
    edge0 = tmp_path / "edge0"
    shutil.copytree(conv.edge0, edge0)
    weights = sum(f.stat().st_size for f in (edge0 / "experts").glob("*.safetensors"))
    weights += (edge0 / "model.safetensors").stat().st_size
    assert checkpoint_bytes(edge0) == weights
    (edge0 / "prerouter.safetensors").write_bytes(b"h" * 100_000)
    (edge0 / "adapters.safetensors").write_bytes(b"a" * 50_000)
    assert checkpoint_bytes(edge0) == weights
    stock = sum(f.stat().st_size for f in Path(conv.source).glob("*.safetensors"))
    assert checkpoint_bytes(conv.source) == stock


def test_a_stopped_bench_kills_its_arm_and_removes_the_cgroups(converted, tmp_path):
    """SIGTERM to ``edge0 bench run`` (a user's ``kill``, a job's timeout)
    mid-arm ends the arm's process and removes the cgroups made for it, as
    Ctrl-C does: nothing is left under this process's own cgroups."""
    import signal

    conv = converted("qwen3_moe")
    regime = Regime(memory_cap_gib=4, read_mbps=200)
    skip_unless_available(regime, conv.edge0)
    layout = own_cgroups()
    argv = [
        sys.executable, "-c", "from mlx_edge0.cli import main; main()", "bench", "run", "--edge0", str(conv.edge0),
        "--arms", "edge0-exact", "--rounds", "1", "--prompt-tokens", "4", "--decode-tokens", "100000",
        "--cache", "cold", "--memory-cap", "4", "--read-mbps", "200", "--out", str(tmp_path / "r.json"),
    ]  # fmt: skip
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = cgroup_prefix(bench.pid)
    arm_pids: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not arm_pids and time.monotonic() < deadline and bench.poll() is None:
            made = [d for d in layout.memory.iterdir() if d.name.startswith(prefix)]
            arm_pids = [p for d in made for p in (d / "cgroup.procs").read_text().split()] if made else []
            time.sleep(0.05)
        assert arm_pids, "the arm never started in its cgroup"
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 1 and "Aborted" in err
        assert not any(Path(f"/proc/{pid}").exists() for pid in arm_pids)
        assert bench_cgroups_left(bench.pid) == []
    finally:  # on failure, leave no arm decoding and no cgroup behind
        bench.kill()
        for pid in arm_pids:
            if Path(f"/proc/{pid}").exists():
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)
        for root in {layout.memory, layout.io}:
            for d in root.iterdir():
                if d.name.startswith(prefix):
                    d.rmdir()
