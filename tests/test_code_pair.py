"""benchmarks/code_pair.py summarizes a pair's kept runs with the wall step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark_script


@pytest.fixture(scope="module")
def code_pair():
    return load_benchmark_script("code_pair")


def _run(tok_s: float, wait_ms: float, arm: str = "edge0-hot") -> dict:
    return {
        "arm": arm,
        "decode_tok_s": tok_s,
        "decode_s_per_token": 1 / tok_s,
        "ttft_s": 2.0,
        "device_bytes_per_token": 5e6,
        # the runtime's own step counter, short of the wall step: the table must not use it
        "decode_counters": {"step_ms": 0.5e3 / tok_s},
        "counters_per_token": {"exposed_wait_ms": wait_ms, "expert_loads": 4},
    }


def _write(out: Path, tree: str, r: int, tok_s: float, wait_ms: float) -> None:
    (out / f"{tree}-r{r}.json").write_text(json.dumps({"runs": [_run(tok_s, wait_ms)]}))


def test_step_is_the_wall_time_per_token_and_the_wait_its_share(tmp_path, code_pair):
    for r, (old, new) in enumerate([(0.5, 0.8), (0.4, 0.5), (0.5, 0.4)], start=1):
        _write(tmp_path, "old", r, old, wait_ms=100.0)
        _write(tmp_path, "new", r, new, wait_ms=50.0)
    (table,) = code_pair.summarize(tmp_path, rounds=3).values()
    assert table["old"]["step_ms"] == {"median": 2000.0, "min": 2000.0, "max": 2500.0}
    assert table["new"]["step_ms"]["median"] == 2000.0
    assert table["old"]["wait_share"] == pytest.approx({"median": 0.05, "min": 0.04, "max": 0.05})
    assert table["new"]["wait_share"]["max"] == pytest.approx(0.04)
    assert table["ratio"]["per_round"] == pytest.approx([1.6, 1.25, 0.8])
    assert table["ratio"]["median"] == pytest.approx(1.25)
    assert table["old"]["hot_hit_rate"] is None  # no hot counters in these runs


def test_each_arm_of_a_round_gets_its_own_table(tmp_path, code_pair):
    """A pair whose bench runs two arms a round summarizes each one against
    its own old runs, not the first arm alone."""
    for r in (1, 2, 3):
        for tree, k4, k8 in (("old", 0.9, 0.5), ("new", 0.9, 0.6)):
            runs = [_run(k4, 10.0, "edge0-prerouter/k4"), _run(k8 + r / 100, 10.0, "edge0-prerouter")]
            (tmp_path / f"{tree}-r{r}.json").write_text(json.dumps({"runs": runs}))
    tables = code_pair.summarize(tmp_path, rounds=3)
    assert list(tables) == ["edge0-prerouter/k4", "edge0-prerouter"]
    assert tables["edge0-prerouter/k4"]["ratio"]["per_round"] == pytest.approx([1.0, 1.0, 1.0])
    assert tables["edge0-prerouter"]["old"]["decode_tok_s"] == pytest.approx({"median": 0.52, "min": 0.51, "max": 0.53})
    assert tables["edge0-prerouter"]["ratio"]["per_round"] == pytest.approx([0.61 / 0.51, 0.62 / 0.52, 0.63 / 0.53])
    (tmp_path / "new-r2.json").write_text(json.dumps({"runs": [_run(0.9, 10.0, "edge0-prerouter/k4")]}))
    with pytest.raises(SystemExit, match="new-r2.json: no run of arm 'edge0-prerouter'"):
        code_pair.summarize(tmp_path, rounds=3)


def test_a_bare_tree_gets_the_packages_its_install_would_map(tmp_path, code_pair):
    tree = tmp_path / "tree"
    for d in ("mlx_edge0", "model_patches", "conversions"):
        (tree / d).mkdir(parents=True)
    (tree / "model_patches" / "__init__.py").write_text("FAMILY = 1\n")
    made = code_pair.map_packages(tree)
    assert made == [tree / "mlx_edge0" / "model_patches", tree / "mlx_edge0" / "conversions"]
    assert (tree / "mlx_edge0" / "model_patches" / "__init__.py").read_text() == "FAMILY = 1\n"
    assert code_pair.map_packages(tree) == []  # linked once; a second pair over the tree keeps them


def test_new_edge0_replaces_the_checkpoint_of_the_new_runs_only(code_pair):
    args = ["--edge0", "/d/ling-edge0", "--arms", "edge0-hot"]
    assert code_pair.with_edge0(args, "/d/profiled") == ["--edge0", "/d/profiled", "--arms", "edge0-hot"]
    assert args[1] == "/d/ling-edge0"  # the old runs' options are left as they were
    assert code_pair.with_edge0(["--edge0=/d/a", "--rounds", "1"], "/d/b") == ["--edge0=/d/b", "--rounds", "1"]
    with pytest.raises(SystemExit, match="they give none"):
        code_pair.with_edge0(["--arms", "edge0-hot"], "/d/b")


def test_a_pair_made_with_another_new_checkpoint_is_refused(tmp_path, code_pair):
    args = ["--edge0", "/d/a"]
    (tmp_path / "pair.json").write_text(json.dumps({"bench_args": args, "new_edge0": "/d/b"}))
    code_pair.same_options(tmp_path, args, "/d/b")  # the same pair resumes
    with pytest.raises(SystemExit, match="loaded --new-edge0 /d/b, not /d/c"):
        code_pair.same_options(tmp_path, args, "/d/c")
    with pytest.raises(SystemExit, match="loaded --new-edge0 /d/b, not None"):
        code_pair.same_options(tmp_path, args)
    with pytest.raises(SystemExit, match="bench options"):
        code_pair.same_options(tmp_path, ["--edge0", "/d/x"], "/d/b")
