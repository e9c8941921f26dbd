"""benchmarks/cache_rows.py replays a recorded decode at more hot-cache rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark_script

from mlx_edge0.bench.eviction import recorded_decodes

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_rows.py"
CYCLE = 12  # tokens routing 0, 1, 2, 0, 1, 2, ... in one layer of 4 experts, K=1


@pytest.fixture(scope="module")
def cache_rows():
    return load_benchmark_script("cache_rows")


def _run(loads: int = 8) -> dict:
    return {
        "arm": "edge0-hot",
        "round": 0,
        "ok": True,
        "routing": {"layers": [1], "num_experts": 4, "k": 1, "tokens": [[[t % 3]] for t in range(CYCLE)]},
        "eviction_replay": {"capacity": 2, "permanent_keys": [], "resident_keys": []},
        "decode_counters": {"expert_loads": loads, "bytes_read": loads * 2_000_000, "hot_hits": 4, "hot_misses": 8},
        "device_bytes_per_token": 8 * 2_000_000 / CYCLE,
    }


def test_a_cycle_one_longer_than_the_cache_fits_at_one_and_a_half_times_its_rows(cache_rows, tmp_path):
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"options": {"regime": {"read_mbps": 20}}, "runs": [_run()]}))
    ((run, decode),) = recorded_decodes(results)
    assert cache_rows.bundle_bytes(run) == 2_000_000
    at_2, at_3, at_4 = cache_rows.replay_rows(decode, [1, 1.5, 3], 2_000_000, read_mbps=20)
    assert (at_2["rows"], at_3["rows"], at_4["rows"]) == (2, 3, 4)  # never more rows than experts
    # 2 rows: MIN keeps one of the pair, missing every other routing after the first 2; LFU misses more
    assert at_2["min_hit_rate"] == pytest.approx(5 / 12) and at_2["lfu_hit_rate"] < at_2["min_hit_rate"]
    # 3 rows hold the cycle: only the first use of each expert misses, under either policy
    assert at_3["lfu_hit_rate"] == at_3["min_hit_rate"] == pytest.approx(9 / 12)
    assert at_3["lfu_mb_per_token"] == pytest.approx(3 * 2.0 / 12)
    assert at_3["read_bound_tok_s"] == pytest.approx(20 / 0.5)
    assert at_4["lfu_hit_rate"] == at_3["lfu_hit_rate"]


def test_bad_input_is_named_not_a_traceback(tmp_path):
    def call(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)

    results = tmp_path / "r.json"
    results.write_text(json.dumps({"runs": [_run(loads=0)]}))
    for args, message in (
        (["--bench", str(results)], "its decode read no expert"),
        (["--bench", str(results), "--factors", "1,x"], "--factors: give positive multiples of the rows, got '1,x'"),
        (["--bench", str(results), "--factors", "1,0"], "got '1,0'"),
        (["--bench", str(tmp_path / "missing.json")], "missing.json: not an edge0 bench results file"),
    ):
        out = call(*args)
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    results.write_text(json.dumps({"runs": [_run()]}))
    out = call("--bench", str(results), "--factors", "1,1.5")
    assert out.returncode == 0, out.stderr
    assert "| r.json: edge0-hot round 0 | 3 (1.5) | 75% | 0.750 | 0.750 | 0.0 | 0.5 | – |" in out.stdout
