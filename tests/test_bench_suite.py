"""The benchmark suite runs end to end on a tiny geometry and its report renders."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from mlx_edge0.bench.regime import Regime
from click.testing import CliRunner
from test_bench import SMALL

from mlx_edge0.bench.charts import (
    CHART_W,
    Bar,
    Point,
    hbar_chart,
    line_chart,
    nice_ticks,
    stacked_hbar_chart,
    value_formatter,
)
from mlx_edge0.bench.commands import bench
from mlx_edge0.bench.arms import arm_base, arm_tier, parse_arm, split_arm, with_budget
from mlx_edge0.bench.run_spec import RunSpec
from mlx_edge0.bench.report import inline_markdown, noise_note, write_report
from mlx_edge0.bench.tables import agreement_note, arm_label, rate_digits, regime_table, speed_table
from mlx_edge0.bench.runner import BenchOptions, load_run, run_bench, runs_to_make
from mlx_edge0.bench.summary import run_metrics, summarize
from mlx_edge0.bench.suite import (
    SuiteOptions,
    check_suite_arm,
    heads_k,
    load_suite,
    plan_phases,
    prepare_checkpoints,
    quick,
    run_suite,
)

LAYERS, LING_SMALL = SMALL["ling-3.0-tiny"]  # 4 layers, 16 experts, K=4


def tiny_suite(tmp_path: Path, **kwargs) -> SuiteOptions:
    return SuiteOptions(
        "ling-3.0-tiny", out=tmp_path / "out", data=tmp_path / "data", layers=LAYERS, rounds=1,
        prompt_tokens=8, decode_tokens=3, cache_gib=0.01, budgets=(0.0, 0.01),
        sweep_arms=("edge0-prerouter",), low_k=2, arms=("stock", "edge0-exact", "edge0-prerouter"),
        caches=("cold",), synth_overrides=LING_SMALL, **kwargs,
    )  # fmt: skip


def _svgs_parse(html: str) -> int:
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    for svg in svgs:
        ET.fromstring(svg)  # well-formed XML
    return len(svgs)


def test_suite_runs_end_to_end_and_report_renders(tmp_path, capsys):
    options = tiny_suite(tmp_path, phases=("main", "sweep", "profile", "low-k"))
    lines: list[str] = []
    suite = run_suite(options, command=["edge0", "bench", "suite", "--test"], progress=lines.append)
    assert list(suite["phases"]) == ["main", "sweep", "profile", "low-k"]
    runs = {name: p["results"]["runs"] for name, p in suite["phases"].items()}
    failed = [r for rs in runs.values() for r in rs if not r["ok"]]
    assert not failed, failed[0].get("stderr_tail")
    assert [r["arm"] for r in runs["main"]] == ["stock", "edge0-exact", "edge0-prerouter@0.01"]
    # One bar counts every phase's runs: the suite's ETA, not a phase's.
    err, total = capsys.readouterr().err, sum(map(len, runs.values()))
    assert "suite runs: 100%" in err and f"| {total}/{total} [" in err, err
    assert {r["arm"] for r in runs["sweep"]} == {"edge0-exact", "edge0-prerouter@0", "edge0-prerouter@0.01"}

    # K swapped by heads files: native K=4 first, K=2 for the low-K phases.
    assert suite["native_k"] == 4 and heads_k(options.edge0_dir) == 2
    assert [suite["phases"][p]["k"] for p in suite["phases"]] == [4, 4, 4, 2]
    per_token = {p: {r["arm"]: r.get("counters_per_token") for r in runs[p]} for p in runs}
    # Exact reads K experts per MoE layer per token (3 MoE layers); K=2 on the 2 consumers.
    assert per_token["main"]["edge0-exact"]["expert_loads"] <= 3 * 4
    assert per_token["low-k"]["edge0-exact"]["expert_loads"] <= 4 + 2 * 2
    assert per_token["main"]["edge0-prerouter@0.01"]["prerouted"] == 2  # consumer layers per token
    assert [r["arm"] for r in runs["low-k"]][0] == "stock"

    main = runs["main"][1]
    assert main["warm_prefill_tok_s"] > 0 and main["ttft_with_load_s"] > main["ttft_s"] > 0
    assert len(main["decode_step_counters"]) == options.decode_tokens
    assert all(r["evicted_between_steps"] for r in runs["sweep"])
    assert not any(r["evicted_between_steps"] for r in runs["main"] + runs["low-k"])
    assert all(r["profile_top"] and r["profiled"] for r in runs["profile"])

    md, html = write_report(load_suite(options.out), options.out)
    summary = md.read_text()
    for expected in ("## Headline", "× stock", "Target: peak MLX memory ≤ 1.0 GiB", "edge0-prerouter @ 0.01 GiB, K=2",
                     "Prerouter vs on-demand", "Budget sweep", "Command: `edge0 bench suite --test`",
                     "mlx-lm", "4 of 24 layers"):  # fmt: skip
        assert expected in summary, expected
    page = html.read_text()
    assert _svgs_parse(page) >= 8 and "<table>" in page and "<code>edge0 bench suite --test</code>" in page
    # The machine and command are said once, at the top, not under every table.
    assert page.count("Machine: ") == 1 and summary.count("Machine: ") == 1
    assert page.count("<code>edge0 bench suite --test</code>") == 1
    assert "hot cache budget (GiB)" in page and "cache_gib (GiB)" not in page

    # Rerunning a phase with the same options keeps its runs instead of re-measuring.
    kept: list[str] = []
    phase = suite["phases"]["main"]["results"]["options"]
    again = BenchOptions(**{**phase, "out": Path(phase["out"]), "stock": Path(phase["stock"]),
                            "edge0": Path(phase["edge0"]), "arms": tuple(phase["arms"]),
                            "caches": tuple(phase["caches"]), "regime": Regime(**phase["regime"])})  # fmt: skip
    assert runs_to_make(again) == 0
    moved = tmp_path / "moved.json"  # a results file resumes wherever it was moved
    moved.write_text(again.out.read_text())
    assert runs_to_make(replace(again, out=moved)) == 0
    run_bench(again, ["again"], progress=kept.append, show_progress=False)
    assert sum("kept from" in line for line in kept) == 3
    # Adding a cache state keeps the runs already made and measures only the new ones.
    kept.clear()
    run_bench(replace(again, arms=again.arms[:2], caches=("cold", "pressure")), ["again"], progress=kept.append)
    assert sum("kept from" in line for line in kept) == 2 and sum(line.endswith("...") for line in kept) == 2
    kept.clear()
    run_bench(replace(again, decode_tokens=2, arms=again.arms[:1]), ["again"], progress=kept.append)
    assert not any("kept from" in line for line in kept)  # measured differently: nothing kept

    # A later invocation of one phase keeps the earlier phases, each with its own command.
    later = run_suite(replace(options, phases=("profile",)), command=["edge0", "bench", "suite", "--later"],
                      progress=lines.append)  # fmt: skip
    assert list(later["phases"]) == ["main", "sweep", "low-k", "profile"]
    assert later["phases"]["main"]["command"][-1] == "--test" and later["phases"]["profile"]["command"][-1] == "--later"
    md, _ = write_report(load_suite(options.out), options.out)
    assert "Command: `edge0 bench suite --test`" in md.read_text()
    assert "Command: `edge0 bench suite --later`" in md.read_text()
    # Another checkpoint in the same directory: nothing earlier is kept.
    other = run_suite(replace(options, phases=("profile",), seed=1, data=tmp_path / "other"),
                      command=["x"], progress=lines.append)  # fmt: skip
    assert list(other["phases"]) == ["profile"]


def test_plan_phases_full_suite(tmp_path):
    o = SuiteOptions("ling-3.0-tiny", out=tmp_path, data=tmp_path)
    plan = {p.name: p for p in plan_phases(o, native_k=8)}
    assert list(plan) == ["main", "sweep", "profile", "low-k", "low-k-pressure"]
    assert plan["main"].arms == ("stock", "edge0-exact", "edge0-hot@0.5", "edge0-staged@0.5",
                                 "edge0-prerouter@0.5")  # fmt: skip
    assert plan["main"].caches == ("cold", "warm") and plan["main"].warm_prefill and plan["main"].rounds == 3
    # Stock runs its native K in the low-K rounds, so ratios to it are paired.
    assert plan["low-k"].arms == plan["main"].arms and plan["low-k"].k == 4
    custom = {p.name: p for p in plan_phases(replace(o, low_k_arms=("stock", "edge0-prerouter")), native_k=8)}
    assert custom["low-k"].arms == ("stock", "edge0-prerouter@0.5")
    bypass = replace(o, arms=("stock", "edge0-exact+bypass", "edge0-prerouter+bypass"),
                     sweep_arms=("edge0-prerouter+bypass",))  # fmt: skip
    bypass_plan = {p.name: p for p in plan_phases(bypass, native_k=8)}
    assert bypass_plan["main"].arms == ("stock", "edge0-exact+bypass", "edge0-prerouter+bypass@0.5")
    assert bypass_plan["sweep"].arms[:3] == ("edge0-exact+bypass", "edge0-prerouter+bypass@0",
                                             "edge0-prerouter+bypass@0.25")  # fmt: skip
    assert bypass_plan["low-k-pressure"].arms == ("edge0-exact+bypass", "edge0-prerouter+bypass@0.5")
    assert bypass_plan["profile"].arms == ("edge0-exact+bypass", "edge0-prerouter+bypass@0.5")
    window = {p.name: p for p in plan_phases(replace(o, arms=("stock", "edge0-exact", "edge0-prerouter-window+bypass")),
                                             native_k=8)}  # fmt: skip
    assert window["profile"].arms == ("edge0-exact", "edge0-prerouter-window+bypass@0.5")
    assert window["low-k-pressure"].arms == window["profile"].arms
    assert plan["sweep"].caches == ("pressure",) and len(plan["sweep"].arms) == 1 + 2 * 5
    assert plan["low-k-pressure"].arms == ("edge0-exact", "edge0-hot@0.5", "edge0-prerouter@0.5")
    assert plan["profile"].profile and plan["profile"].caches == ("warm",)
    # A lower K that is not lower than the native one has no phases.
    assert [p.name for p in plan_phases(o, native_k=4)] == ["main", "sweep", "profile"]
    assert [p.name for p in plan_phases(replace(o, phases=("low-k",)), native_k=8)] == ["low-k"]


def test_quick_is_small(tmp_path):
    q = quick(SuiteOptions("qwen3.5-35b-a3b", out=tmp_path, data=tmp_path))
    assert (q.layers, q.rounds, q.decode_tokens, q.budgets) == (4, 1, 4, (0.0, 0.25))
    assert quick(SuiteOptions("ling-3.0-tiny", out=tmp_path, data=tmp_path)).layers == 3


def test_suite_options_reject_bad_input(tmp_path):
    base = dict(out=tmp_path, data=tmp_path)
    with pytest.raises(ValueError, match="unknown geometry"):
        SuiteOptions("llama", **base)
    with pytest.raises(ValueError, match="phase"):
        SuiteOptions("ling-3.0-tiny", phases=("warmup",), **base)
    with pytest.raises(ValueError, match="sweep arms take a budget"):
        SuiteOptions("ling-3.0-tiny", sweep_arms=("edge0-exact",), **base)
    with pytest.raises(ValueError, match="without @GiB"):
        SuiteOptions("ling-3.0-tiny", arms=("edge0-hot@1",), **base)
    for arm in ("stock+bypass", "edge0-exact+uncached"):  # stock has no page-cache option
        with pytest.raises(ValueError, match="unknown arm"):
            SuiteOptions("ling-3.0-tiny", arms=(arm,), **base)
    with pytest.raises(ValueError, match="full_attention_interval"):
        SuiteOptions("qwen3.5-35b-a3b", layers=2, **base)
    result = CliRunner().invoke(bench, ["suite", "--geometry", "ling-3.0-tiny", "--phases", "main,x"])
    assert result.exit_code != 0 and "use a comma list of" in result.output
    result = CliRunner().invoke(bench, ["suite", "--geometry", "ling-3.0-tiny", "--arms", "edge0-hot@1"])
    assert result.exit_code != 0 and "the suite sets budgets itself" in result.output


def test_arm_names_carry_a_page_cache_policy():
    assert parse_arm("edge0-prerouter+bypass@0.5") == (
        "edge0-prerouter",
        dict(staged=False, prefill="auto", prerouter=True, page_cache="bypass", cache_gib=0.5),
    )
    assert "page_cache" not in parse_arm("edge0-exact")[1]  # the Options default: keep
    assert arm_base("edge0-hot+drop-prefill@1") == "edge0-hot" and arm_base("stock") == "stock"
    assert arm_label("edge0-prerouter+bypass@0") == "edge0-prerouter, page cache bypass @ 0 GiB"
    with pytest.raises(ValueError, match="budget 'x' is not a number"):
        parse_arm("edge0-hot+bypass@x")
    assert parse_arm("edge0-hot+bypass@0.5/k4") == parse_arm("edge0-hot+bypass@0.5")
    assert split_arm("edge0-hot+bypass@0.5/k4") == ("edge0-hot", "bypass", "0.5") and arm_tier("edge0-hot/k4") == 4
    assert with_budget("edge0-hot+bypass/k4", 0.5) == "edge0-hot+bypass@0.5/k4" and arm_tier("edge0-hot") == 0
    assert arm_label("edge0-hot@1/k4") == "edge0-hot @ 1 GiB, K=4"
    for arm in ("edge0-hot/k0", "llamacpp/k4", "edge0-hot/k"):
        with pytest.raises(ValueError, match="K tier|unknown arm"):
            parse_arm(arm)
    with pytest.raises(ValueError, match="low-k phase"):
        check_suite_arm("edge0-hot/k4")


def test_existing_checkpoint_of_another_model_is_refused(tmp_path):
    o = tiny_suite(tmp_path)
    o.stock_dir.mkdir(parents=True)
    config = {"model_type": "qwen3_moe", "edge0_synthetic": {"geometry": "qwen3-30b-a3b", "layers": 2}}
    (o.stock_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{o.stock_dir}.*qwen3-30b-a3b.*--data"):
        prepare_checkpoints(o, progress=lambda _: None)


def test_load_suite_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="suite.json: no suite results"):
        load_suite(tmp_path)
    (tmp_path / "suite.json").write_text("{")
    with pytest.raises(ValueError, match="suite.json: not valid JSON"):
        load_suite(tmp_path)


def test_run_metrics_from_counters():
    record = {
        "decode_s_per_token": 0.5,
        "counters_per_token": {
            "exposed_wait_ms": 20.0,
            "expert_loads": 10,
            "bytes_read": 10 * 2**20 * 1.5,
            "hot_hits": 30,
            "hot_misses": 10,
            "staged_kept": 2,
            "staged_copied": 2,
            "staged_read": 4,
        },
    }
    m = run_metrics(record)
    assert m["mib_per_load"] == 1.5 and m["hot_hit_rate"] == 0.75 and m["staged_hit_rate"] == 0.5
    assert m["step_ms"] == 500.0 and m["step_other_ms"] == 480.0 and m["loads_per_token"] == 10
    assert m["wait_share"] == pytest.approx(0.04)
    assert run_metrics({"decode_s_per_token": 1.0}) == {"step_ms": 1000.0, "step_other_ms": 1000.0}


def test_run_spec_flags():
    spec = RunSpec("edge0-hot@1", Path("/m"), 8, 4, "float32", 0, k=4, evict_between_steps=True)
    argv = spec.argv()
    assert "--evict-between-steps" in argv and "--warm-prefill" not in argv and "--profile" not in argv
    assert argv[argv.index("--k") + 1] == "4" and argv[argv.index("--arm") + 1] == "edge0-hot@1"


def test_charts_are_valid_svg_with_escaped_labels():
    assert nice_ticks(0.93) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(7) == [0, 2, 4, 6, 8]
    bars = hbar_chart([Bar("a<b>", "cold", 1.0, 0.8, 1.2), Bar("c&d", "warm", 2.0)], "t", "tok/s")
    lines = line_chart({"hot": [Point(0, 1.0, 0.9, 1.1), Point(1, 2.0)]}, "t", "GiB", "tok/s")
    stacked = stacked_hbar_chart([("x", [1.0, 2.0])], ["wait", "other"], "t", "ms")
    for svg in (bars, lines, stacked):
        root = ET.fromstring(svg)
        assert root.tag.endswith("svg")
    assert "a&lt;b&gt;" in bars and "c&amp;d" in bars
    assert bars.count("<rect") == 2 + 2  # two bars + a two-entry legend
    for svg in (bars, lines, stacked):  # drawn at the page's text width; the page scales them
        assert ET.fromstring(svg).get("width") == str(CHART_W)


def test_value_labels_of_a_chart_share_one_precision():
    assert list(map(value_formatter([0.326, 0.32, 0.248]), (0.326, 0.32))) == ["0.326", "0.320"]
    assert list(map(value_formatter([45.8, 3488.0]), (45.8, 3488.0))) == ["46", "3,488"]
    assert value_formatter([20.4, 1.64])(1.64) == "1.6" and value_formatter([0.0])(0.0) == "0.000"
    chart = stacked_hbar_chart([("a", [45.8, 3488.0]), ("b", [0.0, 3063.0])], ["wait", "other"], "t", "ms")
    assert ">46 + 3,488<" in chart and ">0 + 3,063<" in chart
    bars = hbar_chart([Bar("x", "s", 0.326), Bar("y", "s", 0.32)], "t", "tok/s")
    assert ">0.326<" in bars and ">0.320<" in bars


def test_inline_markdown_escapes_then_formats():
    assert inline_markdown("**met** by `a<b>`") == "<strong>met</strong> by <code>a&lt;b&gt;</code>"


def test_summary_pairs_runs_by_round():
    def run(arm, rnd, tok_s, tokens):
        return {"arm": arm, "cache": "cold", "round": rnd, "ok": True, "decode_tok_s": tok_s, "tokens": tokens}

    runs = [
        run("stock", 0, 1.0, [1, 2]),
        run("edge0-exact", 0, 0.8, [1, 2]),
        run("edge0-prerouter", 0, 0.9, [1, 3]),
        run("stock", 1, 2.0, [1, 2]),
        run("edge0-exact", 1, 1.8, [1, 2]),
        run("edge0-prerouter", 1, 2.2, [1, 2]),
    ]
    arms = summarize(runs)["arms"]
    assert arms["edge0-exact/cold"]["decode_vs_stock_paired"] == pytest.approx({"median": 0.85, "min": 0.8, "max": 0.9})
    assert arms["edge0-prerouter/cold"]["tokens_equal_reference"] == {"same": 1, "rounds": 2}
    note = agreement_note(summarize(runs))
    assert "equal stock's in every round: edge0-exact/cold." in note
    assert "edge0-prerouter/cold (1 of 2 rounds)" in note


def _capped_runs() -> list[dict]:
    """Two rounds of llama.cpp and an edge0 arm at a 20 MB/s throttle (hand-made records)."""

    def run(arm, rnd, tok_s, device_mb, wait_ms=None):
        r = {"arm": arm, "cache": "cold", "round": rnd, "ok": True, "decode_tok_s": tok_s,
             "decode_s_per_token": 1 / tok_s, "device_bytes_per_token": device_mb * 1e6}  # fmt: skip
        if wait_ms is not None:
            r["counters_per_token"] = {"exposed_wait_ms": wait_ms}
        return r

    return [
        run("llamacpp", 0, 0.10, 200.0),
        run("edge0-prerouter+bypass", 0, 0.50, 20.0, wait_ms=500.0),
        run("edge0-prerouter+bypass", 1, 0.80, 20.0, wait_ms=250.0),
        run("llamacpp", 1, 0.10, 200.0),
    ]


def test_capped_arms_are_paired_with_llamacpp_and_set_against_the_read_bound():
    arms = summarize(_capped_runs())["arms"]
    pre = arms["edge0-prerouter+bypass/cold"]
    assert pre["decode_vs_llamacpp_paired"] == pytest.approx({"median": 6.5, "min": 5.0, "max": 8.0})
    assert pre["metrics"]["wait_share"] == pytest.approx({"median": 0.225, "min": 0.2, "max": 0.25})
    rows = {row[0]: row for row in regime_table(summarize(_capped_runs()), read_mbps=20).rows}
    # 20 MB/s over 20 MB a token allows 1 tok/s; the median decode, 0.65, is 0.65 of it
    assert rows["edge0-prerouter, page cache bypass"][3:] == [
        "6.50 (5.00–8.00)", "20.0", "1.000", "0.65", "1625", "22.5", "1250",
    ]  # fmt: skip
    # llama.cpp at its bound; it records no wait, so no share and no step less wait
    assert rows["llamacpp"][3:] == ["1.00", "200.0", "0.100", "1.00", "10000", "-", "-"]
    assert regime_table(summarize(_capped_runs())).rows[0][5:7] == ["-", "-"]  # no throttle, no bound
    assert [rate_digits(v) for v in (0.00657, 0.0172, 0.155, 19.07, None)] == [5, 4, 3, 3, 3]


def test_speed_table_leaves_out_the_stock_columns_without_stock_and_keeps_a_slow_peers_digits():
    no_stock = speed_table(summarize(_capped_runs()))
    assert "× stock (medians)" not in no_stock.headers and "× stock (per round)" not in no_stock.headers
    rows = {row[0]: row for row in no_stock.rows}
    assert rows["llamacpp"][3] == "0.100" and rows["edge0-prerouter, page cache bypass"][3] == "0.650 (0.500–0.800)"
    slow = [dict(r, decode_tok_s=r["decode_tok_s"] / 10) for r in _capped_runs()]
    assert {row[0]: row for row in speed_table(summarize(slow)).rows}["llamacpp"][3] == "0.0100"
    stock = [dict(r, arm="stock") for r in _capped_runs() if r["arm"] == "llamacpp"]
    with_stock = speed_table(summarize(_capped_runs() + stock))
    assert with_stock.headers[4:6] == ["× stock (medians)", "× stock (per round)"]
    rows = {row[0]: row for row in with_stock.rows}
    assert rows["edge0-prerouter, page cache bypass"][4:6] == ["6.50", "6.50 (5.00–8.00)"]


def test_bench_report_prints_a_run_file_again_and_names_a_bad_one(tmp_path):
    good = tmp_path / "run.json"
    good.write_text(
        json.dumps({"options": {"regime": {"memory_cap_gib": 2.0, "read_mbps": 20}}, "runs": _capped_runs()})
    )
    assert load_run(good) == (_capped_runs(), 20)
    shown = CliRunner().invoke(bench, ["report", str(good)])
    assert shown.exit_code == 0, shown.output
    row = "| edge0-prerouter, page cache bypass | cold | 0.650 (0.500–0.800) | 6.50 (5.00–8.00) | 20.0 | 1.000 | 0.65 |"
    assert row in shown.output
    bad = {
        "{": "not a readable JSON file",
        "[]": "no list of 'runs'",
        '{"runs": [{"arm": "x", "ok": true}]}': r"runs\[0\] has no cache, round",
        '{"runs": [{"arm": "x", "ok": true, "cache": "cold", "round": 0}]}': r"runs\[0\] has no decode_tok_s",
        '{"runs": [], "options": {"regime": {"read_mbps": "fast"}}}': "options.regime.read_mbps must be a positive",
    }
    for text, message in bad.items():
        path = tmp_path / "bad.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"bad.json: {message}"):
            load_run(path)
        shown = CliRunner().invoke(bench, ["report", str(path)])
        assert shown.exit_code == 1 and "bad.json" in shown.output and "Traceback" not in shown.output


def test_noise_note_counts_a_busy_start_only_above_the_cpus():
    """The previous run's own threads are still in the 1-min load average at a start."""

    def suite(loads):
        runs = [{"ok": True, "loadavg_at_start": x, "available_memory_at_start": 20 * 2**30} for x in loads]
        return {"machine": {"cpus_usable": 2}, "phases": {"main": {"results": {"runs": runs}}}}

    idle = noise_note(suite([1.2, 1.6, 1.9]))
    assert "median 1.60, max 1.90 on 2 CPUs" in idle and "mostly idle" in idle
    assert "20.0 GiB" in idle
    assert "shared with other work" in noise_note(suite([2.4, 2.6, 1.0]))


def test_prerouted_arms_pair_with_the_on_demand_arm_of_their_page_cache_policy():
    from mlx_edge0.bench.report import _prerouted_pairs

    arms = ["edge0-exact", "edge0-exact+bypass", "edge0-prerouter@0", "edge0-prerouter+bypass@0",
            "edge0-prerouter-window+bypass@0", "edge0-prerouter@0.5", "edge0-hot@0.5"]  # fmt: skip
    summary = {"arms": {f"{a}/cold": {"arm": a, "cache": "cold"} for a in arms}}
    summary["arms"]["edge0-prerouter@0/warm"] = {"arm": "edge0-prerouter@0", "cache": "warm"}
    pairs = [(od["arm"], pr["arm"]) for od, pr in _prerouted_pairs(summary, "0", "cold")]
    assert pairs == [("edge0-exact", "edge0-prerouter@0"), ("edge0-exact+bypass", "edge0-prerouter+bypass@0"),
                     ("edge0-exact+bypass", "edge0-prerouter-window+bypass@0")]  # fmt: skip
    assert [(od["arm"], pr["arm"]) for od, pr in _prerouted_pairs(summary, "0.5", "cold")] == [
        ("edge0-hot@0.5", "edge0-prerouter@0.5")
    ]
    assert _prerouted_pairs(summary, "0", "warm") == []  # no on-demand arm ran warm


def test_agreement_names_exact_as_reference_when_stock_was_oom_killed():
    summary = {
        "arms": {
            "stock/cold": {"arm": "stock", "cache": "cold", "ok": 0, "runs": 3, "oom": 3},
            "edge0-exact/cold": {"arm": "edge0-exact", "cache": "cold", "ok": 3, "runs": 3},
            "edge0-hot/cold": {
                "arm": "edge0-hot",
                "cache": "cold",
                "ok": 3,
                "runs": 3,
                "tokens_equal_reference": {"same": 3, "rounds": 3},
            },
        }
    }
    assert agreement_note(summary).startswith(
        "Next-token picks (argmax on the same fed tokens) equal edge0-exact's in every round: edge0-hot"
    )
    summary["arms"]["stock/cold"]["ok"] = 3
    assert agreement_note(summary).startswith("Next-token picks (argmax on the same fed tokens) equal stock's")
