"""``edge0 bench sweep``: the grid is parsed and checked before any run, each
point's winner is the fastest arm that was never OOM-killed, and the map
draws every cell's winner and values where its cap and throughput put it."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner
from test_regime import bench_cgroups_left, skip_unless_available

from mlx_edge0.bench.charts import CHART_W, PALETTE, Cell, grid_map
from mlx_edge0.bench.commands import bench
from mlx_edge0.bench.regime import Regime
from mlx_edge0.bench.summary import summarize
from mlx_edge0.bench.sweep import SweepOptions, arm_summary, parse_grid, point_name, refresh_points, winner
from mlx_edge0.bench.sweep_report import map_chart, point_table, write_sweep_report

SVG = "{http://www.w3.org/2000/svg}"


def test_grid_axes_parse_sorted_with_no_limit_last():
    assert parse_grid("1, 0.5,none,0.5", "GiB") == (0.5, 1.0, None)
    assert parse_grid("uncapped,200,50", "MB/s") == (50.0, 200.0, None)
    assert parse_grid("NONE", "MB/s") == (None,)
    for bad, message in (("abc", "'abc' is not a number of GiB"), ("1,-2", "'-2': must be a positive number"),
                         ("0", "'0': must be a positive"), ("inf", "'inf': must be a positive"),
                         (" , ", "give a comma list of GiB")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_grid(bad, "GiB")
    assert point_name(Regime(0.5, None)) == "cap-0.5-mbps-none"
    assert point_name(Regime(None, 200)) == "cap-none-mbps-200"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--memory-caps", "abc", "'abc' is not a number of GiB"), ("--read-mbps", "-5", "'-5': must be a positive"),
     ("--memory-caps", "", "give a comma list of GiB")],
)  # fmt: skip
def test_a_bad_grid_is_a_usage_error_naming_the_option(tmp_path, option, value, message):
    result = CliRunner().invoke(bench, ["sweep", "--edge0", str(tmp_path), "--out", str(tmp_path / "o"), option, value])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output and message in result.output
    assert not (tmp_path / "o").exists()


def test_options_are_checked_before_any_run(tmp_path, converted, monkeypatch):
    conv = converted("qwen3_moe")
    with pytest.raises(ValueError, match="a cap needs a cold page cache"):
        SweepOptions(out=tmp_path, edge0=conv.edge0, arms=("edge0-exact",), cache="warm")
    with pytest.raises(ValueError, match="at least one memory cap"):
        SweepOptions(out=tmp_path, edge0=conv.edge0, arms=("edge0-exact",), memory_caps=())
    with pytest.raises(ValueError, match="needs --stock"):
        SweepOptions(out=tmp_path, edge0=conv.edge0, arms=("stock",))
    # Where this machine cannot set up a point's cgroups, the CLI says why and runs nothing.
    monkeypatch.setattr("mlx_edge0.bench.runner.regime_unavailable",
                        lambda regime, path: "cgroup files not writable" if regime.active else None)  # fmt: skip
    out = tmp_path / "out"
    args = ["sweep", "--edge0", str(conv.edge0), "--arms", "edge0-exact", "--out", str(out)]
    result = CliRunner().invoke(bench, [*args, "--memory-caps", "none,2", "--read-mbps", "none"])
    assert result.exit_code == 1
    assert "memory capped at 2 GiB (page cache included): cgroup files not writable" in result.output
    assert not out.exists()
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = CliRunner().invoke(bench, [*args[:-1], str(blocked / "out")])
    assert result.exit_code == 1 and "cannot make the results directory" in result.output


def _run(arm: str, rnd: int, tok_s: float | None = None, oom: bool = False) -> dict:
    """A child's record as run_bench keeps it (decoded, OOM-killed or failed)."""
    base = {"arm": arm, "cache": "cold", "round": rnd}
    if tok_s is not None:
        return {**base, "ok": True, "decode_tok_s": tok_s, "peak_memory": 2**29, "tokens": [1],
                "device_bytes_per_token": 3e6, "cgroup": {"cgroup_peak_bytes": 2**30}}  # fmt: skip
    error = "OOM at 1 GiB (killed by the OOM killer)" if oom else "child exited with status 1"
    return {**base, "ok": False, "error": error, **({"oom": True} if oom else {})}


def _arms(runs: list[dict]) -> list[dict]:
    summary = summarize(runs)["arms"]
    return [arm_summary(summary[f"{arm}/cold"], runs) for arm in dict.fromkeys(r["arm"] for r in runs)]


def test_winner_is_the_fastest_arm_never_oom_killed():
    arms = _arms(
        [_run("stock", 0, 1.0), _run("edge0-exact", 0, 2.0), _run("stock", 1, 3.0), _run("edge0-exact", 1, 2.5)]
    )
    assert [a["decode_tok_s"]["median"] for a in arms] == [2.0, 2.25]
    assert winner(arms) == "edge0-exact"
    stock = arms[0]
    assert (stock["ok"], stock["oom"], stock["device_bytes_per_token"]) == (2, 0, 3e6)
    assert stock["cgroup_peak_bytes"]["median"] == 2**30 and stock["peak_memory"]["median"] == 2**29
    # Faster, but OOM-killed in one of its rounds: it does not fit at this cap.
    arms = _arms(
        [_run("stock", 0, 9.0), _run("edge0-exact", 0, 2.0), _run("stock", 1, oom=True), _run("edge0-exact", 1, 2.0)]
    )
    assert arms[0]["oom"] == 1 and winner(arms) == "edge0-exact"
    # A failure that is not an OOM kill leaves the arm out too; ties go to the arm listed first.
    assert winner(_arms([_run("stock", 0), _run("edge0-exact", 0, 1.0)])) == "edge0-exact"
    assert winner(_arms([_run("stock", 0, 1.0), _run("edge0-exact", 0, 1.0)])) == "stock"
    assert winner(_arms([_run("stock", 0, oom=True), _run("edge0-exact", 0, oom=True)])) is None


def _cells(svg: str) -> list[tuple[float, float, str, list[str]]]:
    """(x, y, fill, texts in order) of every map cell."""
    out = []
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        rect = g.find(f"{SVG}rect")
        out.append(
            (float(rect.get("x")), float(rect.get("y")), rect.get("fill"), [t.text for t in g.iter(f"{SVG}text")])
        )
    return out


def test_map_draws_each_cells_winner_and_values_in_place():
    series = ["stock", "edge0-exact", "edge0-hot@0.5"]
    cells = [
        Cell("100 MB/s", "1 GiB", None, {"stock": "OOM", "edge0-exact": "OOM", "edge0-hot@0.5": "OOM"}),
        Cell("uncapped", "1 GiB", "edge0-exact", {"stock": "OOM", "edge0-exact": 0.5, "edge0-hot@0.5": "failed"}),
        Cell("100 MB/s", "uncapped", "edge0-hot@0.5", {"stock": 0.25, "edge0-exact": 0.4, "edge0-hot@0.5": 0.75}),
        Cell("uncapped", "uncapped", "stock", {"stock": 2.0, "edge0-exact": 1.5, "edge0-hot@0.5": 1.0}),
    ]
    svg = grid_map(cells, ["100 MB/s", "uncapped"], ["1 GiB", "uncapped"], series, "map <t>", "reads", "cap", "tok/s")
    root = ET.fromstring(svg)
    assert root.get("width") == str(CHART_W) and "map &lt;t&gt;" in svg
    (x0, y0, f0, t0), (x1, y1, f1, t1), (x2, y2, f2, t2), (x3, y3, f3, t3) = _cells(svg)
    # Columns left to right as given; the first row (the smaller cap) at the bottom.
    assert x0 == x2 < x1 == x3 and y2 == y3 < y0 == y1
    # One precision for the chart: three significant digits of the largest value (2.0) for every value.
    assert t0 == ["all OOM", "stock: OOM", "edge0-exact: OOM", "edge0-hot@0.5: OOM"] and f0 == "#eeeeee"
    assert t1 == ["edge0-exact", "0.50 tok/s", "stock: OOM", "edge0-hot@0.5: failed"] and f1 == PALETTE[1]
    assert t2 == ["edge0-hot@0.5", "0.75 tok/s", "stock: 0.25", "edge0-exact: 0.40"] and f2 == PALETTE[2]
    assert t3 == ["stock", "2.00 tok/s", "edge0-exact: 1.50", "edge0-hot@0.5: 1.00"] and f3 == PALETTE[0]
    legend = [t.text for t in root.findall(f"{SVG}text")][1:4]  # after the title
    assert legend == series


def test_a_point_sets_each_arm_against_llamacpp_and_the_read_bound():
    """Issue 19's targets per point: decode over llama.cpp's mmap arm round by
    round, the share of the read bound (MB/s ÷ device MB a token) and of the
    step spent waiting."""
    runs = [
        _run("llamacpp", 0, 0.5),
        _run("edge0-exact", 0, 2.5),
        _run("llamacpp", 1, 0.4),
        _run("edge0-exact", 1, 2.4),
    ]
    for r in runs[1::2]:
        r.update(counters_per_token={"exposed_wait_ms": 40.0}, decode_s_per_token=1 / r["decode_tok_s"])
    arms = _arms(runs)
    exact = arms[1]
    assert exact["decode_vs_llamacpp"]["median"] == pytest.approx(5.5) and exact["wait_share"]["median"] == 0.098
    table = point_table({"read_mbps": 50.0, "arms": arms, "winner": winner(arms), "results": "points/x.json"})
    text = table.markdown()
    assert "| read bound tok/s (50 ÷ MB) | of the bound | exposed wait, % of the step |" in text
    assert "| llamacpp | 2/2 | 0.450 (0.400–0.500) | 0.18 | 1.00 | 0 | 3.0 | 16.667 | 0.03 | - |" in text
    assert (
        "| edge0-exact | 2/2 | 2.450 (2.400–2.500) | 1.00 | 5.50 (5.00–6.00) | 0 | 3.0 | 16.667 | 0.15 | 9.8 |" in text
    )


def test_report_summarizes_each_point_again_from_its_runs(tmp_path):
    """`bench report DIR` on a sweep made before a column existed: each point's
    arms come from the runs in its file, so the new columns are filled; a
    point file that is not a bench run's results is named."""
    runs = [_run("llamacpp", 0, 0.5), _run("edge0-exact", 0, 2.5)]
    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "cap-1-mbps-50.json").write_text(json.dumps({"runs": runs}))
    old_arms = [{k: v for k, v in a.items() if k not in ("decode_vs_llamacpp", "wait_share")} for a in _arms(runs)]
    point = {"memory_cap_gib": 1.0, "read_mbps": 50.0, "regime": "r", "results": "points/cap-1-mbps-50.json",
             "arms": old_arms, "winner": "llamacpp"}  # fmt: skip
    sweep = {"options": {"arms": ["llamacpp", "edge0-exact"], "cache": "cold"}, "points": [point]}
    (refreshed,) = refresh_points(sweep, tmp_path)["points"]
    assert refreshed["winner"] == "edge0-exact" and refreshed["arms"][1]["decode_vs_llamacpp"]["median"] == 5.0
    (tmp_path / "points" / "cap-1-mbps-50.json").write_text("{}")
    with pytest.raises(ValueError, match=r"cap-1-mbps-50.json: no list of 'runs'"):
        refresh_points(sweep, tmp_path)


def test_report_renders_the_map_and_a_table_per_point(tmp_path):
    """From records as run_sweep writes them: the Markdown map lists the largest cap first, as the chart draws."""

    def point(cap, mbps, runs):
        arms, regime = _arms(runs), Regime(cap, mbps)
        return {"memory_cap_gib": cap, "read_mbps": mbps, "regime": regime.label(),
                "results": f"points/{point_name(regime)}.json", "arms": arms, "winner": winner(arms)}  # fmt: skip

    sweep = {
        "command": ["edge0", "bench", "sweep", "--test"],
        "machine": {
            "machine": "x86_64",
            "cpu_count": 2,
            "device": "Device(cpu, 0)",
            "platform": "Linux",
            "python": "3.12",
            "mlx": "0",
            "mlx_lm": "0",
            "mlx_edge0": "0",
        },  # fmt: skip
        "options": {
            "arms": ["stock", "edge0-exact"],
            "stock": "/s",
            "edge0": "/e",
            "gguf": None,
            "cache": "cold",
            "rounds": 1,
            "prompt_tokens": 4,
            "decode_tokens": 2,
            "dtype": "float32",
        },  # fmt: skip
        "started": 0.0,
        "finished": 60.0,
        "points": [
            point(0.5, 100.0, [_run("stock", 0, oom=True), _run("edge0-exact", 0, oom=True)]),
            point(0.5, None, [_run("stock", 0, oom=True), _run("edge0-exact", 0, 0.8)]),
            point(None, 100.0, [_run("stock", 0, 1.5), _run("edge0-exact", 0, 0.75)]),
            point(None, None, [_run("stock", 0, 2.0), _run("edge0-exact", 0)]),
        ],
    }
    md, html = write_sweep_report(sweep, tmp_path)
    text = md.read_text()
    map_rows = [line for line in text.splitlines() if line.startswith("| uncapped |") or line.startswith("| 0.5 GiB |")]
    assert map_rows[:2] == [
        "| uncapped | stock (1.500 tok/s) | stock (2.000 tok/s) |",
        "| 0.5 GiB | all OOM | edge0-exact (0.800 tok/s) |",
    ]
    assert "| memory cap \\ reads | 100 MB/s | uncapped |" in text
    # at 100 MB/s, 3 MB a token: a read bound of 33.3 tok/s; no llama.cpp arm, no wait recorded
    assert "| stock | 1/1 | 1.500 | 1.00 | - | 0 | 3.0 | 33.333 | 0.04 | - | 0.50 | 1.00 |" in text
    assert "| edge0-exact | 1/1 | 0.750 | 0.50 | - | 0 | 3.0 | 33.333 | 0.02 | - | 0.50 | 1.00 |" in text
    assert "| stock | 0/1 | - | - | - | 1 | - | - | - | - | - | - |" in text
    assert "| edge0-exact | 1/1 | 0.800 | 1.00 | - | 0 | 3.0 | - | - | - | 0.50 | 1.00 |" in text  # reads uncapped
    assert "Winner: none (no arm decoded without an OOM kill)." in text
    assert "edge0-exact failed: child exited with status 1 (stderr tail in points/cap-none-mbps-none.json)" in text
    assert text.count("## Memory cap ") == 4 and "Command: `edge0 bench sweep --test`" in text
    page = html.read_text()
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 1 and svgs[0] == map_chart(sweep)
    assert page.count("<table>") == 5 and "<title>mlx-edge0: Benchmark sweep" in page


def test_sweep_runs_end_to_end_resumes_and_rerenders(tmp_path, converted):
    """One uncapped point (no cgroups needed): both arms decode, sweep.json and
    the report are written; a rerun keeps the runs; `bench report` re-renders."""
    conv = converted("qwen3_moe")
    out = tmp_path / "sweep"
    args = ["sweep", "--stock", str(conv.source), "--edge0", str(conv.edge0), "--rounds", "1",
            "--prompt-tokens", "4", "--decode-tokens", "2", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert "sweep runs: 100%" in result.stderr and "| 2/2 [" in result.stderr
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and saved["options"]["memory_caps"] == [None]
    (p,) = saved["points"]
    assert (p["memory_cap_gib"], p["read_mbps"], p["regime"]) == (None, None, "uncapped")
    assert [a["arm"] for a in p["arms"]] == ["stock", "edge0-exact"] and all(a["ok"] == 1 for a in p["arms"])
    fastest = max(p["arms"], key=lambda a: a["decode_tok_s"]["median"])
    assert p["winner"] == fastest["arm"] and fastest["decode_tok_s"]["median"] > 0
    assert json.loads((out / p["results"]).read_text())["regime"] == "uncapped"
    assert f"| uncapped | {p['winner']} (" in result.stdout
    again = CliRunner().invoke(bench, args)
    assert again.exit_code == 0 and again.stderr.count("kept from") == 2
    assert json.loads((out / "sweep.json").read_text())["points"][0]["arms"] == p["arms"]
    (out / "sweep.html").unlink()
    rendered = CliRunner().invoke(bench, ["report", str(out)])
    assert rendered.exit_code == 0 and (out / "sweep.html").is_file() and "sweep.md" in rendered.output


def test_capped_sweep_maps_oom_and_the_winner(tmp_path, converted):
    """2 caps × 1 read throughput in real cgroups: at 15 MB both arms are
    OOM-killed (no winner, a result: exit 0); at 4 GiB both decode."""
    conv = converted("qwen3_moe")
    skip_unless_available(Regime(memory_cap_gib=0.015, read_mbps=200), conv.edge0)
    assert bench_cgroups_left() == []
    out = tmp_path / "sweep"
    result = CliRunner().invoke(bench, [
        "sweep", "--stock", str(conv.source), "--edge0", str(conv.edge0), "--rounds", "1", "--prompt-tokens", "4",
        "--decode-tokens", "2", "--memory-caps", "4,0.015", "--read-mbps", "200", "--out", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    tight, roomy = json.loads((out / "sweep.json").read_text())["points"]
    assert (tight["memory_cap_gib"], tight["read_mbps"], tight["winner"]) == (0.015, 200, None)
    assert all(a["oom"] == 1 and a["decode_tok_s"] is None for a in tight["arms"])
    assert roomy["memory_cap_gib"] == 4 and roomy["winner"] in ("stock", "edge0-exact")
    for a in roomy["arms"]:
        assert a["ok"] == 1 and 0 < a["cgroup_peak_bytes"]["median"] <= 4 * 2**30
    assert "| 0.015 GiB | all OOM |" in (out / "sweep.md").read_text()
    cells = _cells(map_chart(json.loads((out / "sweep.json").read_text())))
    assert cells[0][3][0] == "all OOM" and cells[1][3][0] == roomy["winner"] and cells[1][1] < cells[0][1]
    assert bench_cgroups_left() == []
