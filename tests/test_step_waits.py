"""benchmarks/step_waits.py judges each decode step by the bound it met."""

from __future__ import annotations


import pytest
from conftest import load_benchmark_script


@pytest.fixture(scope="module")
def step_waits():
    return load_benchmark_script("step_waits")


def _run(waits_ms: list[float], steps_s: list[float], mb: list[float]) -> dict:
    counters = [{"exposed_wait_ms": w, "bytes_read": m * 1e6} for w, m in zip(waits_ms, mb)]
    return {"arm": "edge0-prerouter+bypass", "decode_step_counters": counters, "decode_step_s": steps_s}


def test_each_step_is_compute_bound_at_the_read_bound_or_neither(step_waits):
    # at 50 MB/s: 50 MB in 1 s keeps the disk busy; 20 MB in 1 s leaves it idle 60% of the step
    runs = [_run([300.0, 40.0, 300.0], [1.0, 1.0, 1.0], [50.0, 20.0, 20.0])] * 3
    row = step_waits.arm_steps(runs, "edge0-prerouter+bypass", read_mbps=50.0)
    assert row["disk_busy"] == pytest.approx([1.0, 0.4, 0.4])
    assert row["verdicts"] == ["reads", "compute", "neither"]  # the third waited while the disk idled
    assert row["share"] == pytest.approx(640 / 3000)
    assert "verdicts" not in step_waits.arm_steps(runs, "edge0-prerouter+bypass")  # no throttle: no disk share
