"""The suite's report: ``summary.md`` and ``report.html`` from ``suite.json``.

Both are rendered from the same sections (text, tables, charts), so they say
the same thing; the HTML adds inline SVG charts (jinja2 template shipped as
package data). The machine, versions and commands are said once, at the top.
"""

from __future__ import annotations

import datetime
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .charts import Bar, Point, hbar_chart, line_chart, stacked_hbar_chart
from .arms import BUDGET_ARMS, TIER_MARK, WINDOW_ARMS, split_arm
from .summary import summarize
from .tables import (
    GIB,
    Table,
    agreement_note,
    arm_label,
    cell,
    change,
    median,
    memory_table,
    pressure_table,
    ratio,
    speed_table,
    stat,
)

# Acceptance targets on this project's reference machine: (peak MLX GiB, decode × stock).
TARGETS = {"qwen3.5-35b-a3b": (2.5, 1.0), "ling-3.0-tiny": (1.0, 1.0)}
PROFILE_ROWS = 10
BUDGET_AXIS = "hot cache budget (GiB)"
# Arms whose per-step exposed wait is charted (on-demand and prerouted).
PREROUTED_ARMS = ("edge0-prerouter", *WINDOW_ARMS)
STEP_WAIT_ARMS = ("edge0-exact", "edge0-hot") + PREROUTED_ARMS


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)


def machine_line(m: dict) -> str:
    """The machine and versions (``runner.machine_info``) in one sentence."""
    mem = f", {m['memory_bytes'] / GIB:.0f} GiB RAM" if "memory_bytes" in m else ""
    cpus = m.get("cpus_usable", m.get("cpu_count"))
    return (f"Machine: {m.get('cpu', m['machine'])}, {cpus} CPUs{mem}, {m['device']}; "
            f"{m['platform']}, Python {m['python']}; "
            f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, mlx-edge0 {m['mlx_edge0']}.")  # fmt: skip


def provenance(suite: dict) -> list[str]:
    """The machine and versions, then each command with the phases it ran:
    said once, at the top (every table is from that machine)."""
    ran: dict[str, list[str]] = {}
    for name, phase in suite["phases"].items():
        ran.setdefault(" ".join(phase.get("command", suite["command"])), []).append(name)
    machine = machine_line(suite["machine"])
    if len(ran) <= 1:
        return [machine, f"Command: `{next(iter(ran), ' '.join(suite['command']))}`"]
    return [machine, *(f"Command: `{c}` ran phase(s) {', '.join(names)}." for c, names in ran.items())]


def _summary(suite: dict, phase: str) -> Optional[dict]:
    p = suite["phases"].get(phase)
    return p["results"]["summary"] if p else None


def _entry(summary: Optional[dict], arm: str, cache: str) -> Optional[dict]:
    return (summary or {}).get("arms", {}).get(f"{arm}/{cache}")


def _depth(suite: dict) -> str:
    if suite.get("layers"):
        return f"{suite['layers']} of {suite['native_layers']} layers (per-layer shapes unchanged)"
    return f"all {suite['native_layers']} layers"


def noise_note(suite: dict) -> str:
    """How busy the machine was when runs started."""
    runs = [r for p in suite["phases"].values() for r in p["results"]["runs"] if r.get("ok")]
    loads = [r["loadavg_at_start"] for r in runs if r.get("loadavg_at_start") is not None]
    avail = [r["available_memory_at_start"] for r in runs if r.get("available_memory_at_start")]
    if not loads:
        return ""
    cpus = suite["machine"].get("cpus_usable", suite["machine"].get("cpu_count"))
    # Runs follow each other at once, so the 1-min average at a start still holds
    # the previous run, which keeps one to two threads busy: only more than the
    # machine's CPUs says something else was running.
    load = statistics.median(loads)
    shared = load > cpus
    return (f"Machine load at run start: 1-min load average median {load:.2f}, "
            f"max {max(loads):.2f} on {cpus} CPUs (it includes the previous run's own threads); "
            "available memory at least "
            f"{min(avail) / GIB:.1f} GiB. "
            + ("The machine was shared with other work during these runs: expect wide min–max ranges."
               if shared else "The machine was mostly idle."))  # fmt: skip


def headline_entries(suite: dict) -> list[tuple[str, dict, Optional[dict]]]:
    """(label, edge0 or stock entry, its stock reference) of every cold run
    the headline shows: the native-K arms, then the lower-K edge0 arms."""
    rows = []
    for phase in ("main", "low-k"):
        summary = _summary(suite, phase)
        if summary is None:
            continue
        stock = _entry(summary, "stock", "cold") or _entry(_summary(suite, "main"), "stock", "cold")
        k = suite["phases"][phase]["k"]
        for e in summary["arms"].values():
            if e["cache"] != "cold" or (phase == "low-k" and e["arm"] == "stock"):
                continue
            label = arm_label(e["arm"]) + ("" if phase == "main" else f", K={k}")
            rows.append((label, e, stock))
    return rows


def headline(suite: dict) -> Section:
    """Memory and decode of every edge0 arm against stock, cold page cache, with the target."""
    entries = headline_entries(suite)
    rows = [[label, cell(stat(e, "peak_memory"), GIB, spread=False),
             cell(stat(e, "decode_tok_s"), digits=3),
             ratio(median(e, "decode_tok_s"), median(stock, "decode_tok_s")),
             cell(stat(e, "decode_vs_stock_paired")),
             cell(stat(e, "exposed_wait_ms_per_step", "metrics"), digits=1)]
            for label, e, stock in entries]  # fmt: skip
    headers = ["arm (cold page cache)", "peak MLX GiB", "decode tok/s", "× stock (medians)",
               "× stock (per round)", "exposed wait ms/step"]  # fmt: skip
    section = Section("Headline", tables=[Table(headers, rows)])
    if "low-k" in suite["phases"]:
        section.text.append(
            f"Rows with K={suite['phases']['low-k']['k']} route the prerouted layers with fewer experts "
            "per token (a heads-file swap, as in the paper's 35B tier): that computes another model than "
            "stock's, whose quality these random-weight checkpoints cannot show (see QUALITY.md for a "
            "trained model); stock always runs its native K."
        )
    target = TARGETS.get(suite["geometry"])
    if target and any(stock is not None for _, _, stock in entries):
        section.text.append(target_verdict(suite, entries, *target))
    return section


def target_verdict(suite: dict, entries: list, gib: float, speed: float) -> str:
    """Which arms meet ≤ ``gib`` peak MLX memory at ≥ ``speed`` × stock decode."""
    met, best = [], None
    for label, e, stock in entries:
        if e["arm"] == "stock" or stock is None or median(e, "peak_memory") is None:
            continue
        mem = median(e, "peak_memory") / GIB
        x = median(e, "decode_vs_stock_paired") or median(e, "decode_tok_s") / median(stock, "decode_tok_s")
        if mem <= gib and x >= speed:
            met.append(f"{label} ({mem:.2f} GiB, {x:.2f}×)")
        if best is None or mem < best[1]:
            best = (label, mem, x)
    goal = (
        f"Target: peak MLX memory ≤ {gib} GiB at decode ≥ {speed}× stock (cold page cache; "
        "× stock = median of the per-round ratios)"
    )
    scope = (
        ""
        if not suite.get("layers")
        else (
            f" Measured at {_depth(suite)}: the resident part scales with depth, so this is not the "
            "full model's verdict."
        )
    )
    if met:
        return f"{goal}: **met** by {', '.join(met)}.{scope}"
    if best is None:
        return f"{goal}: no edge0 arm ran cold.{scope}"
    return (
        f"{goal}: **not met**. Lowest peak: {best[0]} at {best[1]:.2f} GiB, {best[2]:.2f}× stock; "
        f"see the per-step breakdown and profile below for where the time goes.{scope}"
    )


def phase_section(suite: dict, name: str) -> Optional[Section]:
    phase = suite["phases"].get(name)
    if phase is None:
        return None
    summary = phase["results"]["summary"]
    section = Section(f"{phase['title']}", text=[
        f"{phase['rounds']} round(s), each run a fresh process, arm order rotated per round; cells are "
        f"median (min–max). Cache states: " + "; ".join(f"`{c}` = {n}" for c, n in
                                                        phase["results"]["cache_notes"].items()) + ".",
    ])  # fmt: skip
    note = agreement_note(summary)
    if note:
        section.text.append(note)
    if name == "low-k":
        section.text.append(
            "Stock cannot change K: it runs its native K in these rounds (paired ratios)."
            if any(e["arm"] == "stock" for e in summary["arms"].values())
            else "× stock (medians) compares with the main phase's stock arm (native K, same page-cache "
            "state): stock cannot change K."
        )
    if name in ("main", "low-k"):
        reference = _summary(suite, "main") if name == "low-k" else None
        speed = speed_table(summary, reference)
        section.tables += [speed, memory_table(summary)]
        section.charts += [throughput_chart(summary, phase["title"]), memory_chart(summary)]
    else:
        section.tables.append(pressure_table(summary))
        if name == "sweep":
            section.charts += sweep_charts(summary)
            section.text += sweep_optimum(summary)
    section.charts.append(wait_chart(summary, phase["title"]))
    timeline = step_wait_chart(phase["results"]["runs"], suite["options"]["cache_gib"], phase["title"])
    if timeline:
        section.charts.append(timeline)
    return section


def step_wait_chart(runs: list[dict], budget: float, title: str) -> Optional[str]:
    """Exposed I/O wait of every decode step of one run (the first round) per
    on-demand / prerouter arm: the per-step view behind the medians."""

    def wanted(arm: str) -> bool:  # any page-cache variant; budget arms at this budget
        base, _, arm_budget = split_arm(arm)
        return base in STEP_WAIT_ARMS and arm_budget in ("", f"{budget:g}")

    series = {}
    for r in runs:
        if r.get("ok") and r["round"] == 0 and wanted(r["arm"]) and r.get("decode_step_counters"):
            steps = r["decode_step_counters"]
            series[f"{arm_label(r['arm'])} / {r['cache']}"] = [
                Point(i + 1, s["exposed_wait_ms"]) for i, s in enumerate(steps)
            ]
    if not series:
        return None
    return line_chart(series, f"Exposed I/O wait per decode step, round 1 — {title}", "decode step", "ms")


def throughput_chart(summary: dict, title: str) -> str:
    bars = [Bar(arm_label(e["arm"]), e["cache"], s["median"], s["min"], s["max"])
            for e in summary["arms"].values() if (s := stat(e, "decode_tok_s"))]  # fmt: skip
    return hbar_chart(bars, f"Decode throughput — {title}", "tokens/s (median, min–max)")


def memory_chart(summary: dict) -> str:
    bars = []
    for e in summary["arms"].values():
        if e["cache"] != "cold":
            continue
        for key, name in (("peak_memory", "peak MLX"), ("decode_peak_memory", "decode peak MLX"),
                          ("peak_rss", "peak RSS")):  # fmt: skip
            if (s := stat(e, key)) is not None:
                bars.append(Bar(arm_label(e["arm"]), name, s["median"] / GIB, s["min"] / GIB, s["max"] / GIB))
    return hbar_chart(bars, "Memory per arm (cold page cache)", "GiB")


def wait_chart(summary: dict, title: str) -> str:
    rows = []
    for e in summary["arms"].values():
        wait, step = median(e, "exposed_wait_ms_per_step", "metrics"), median(e, "step_ms", "metrics")
        if step is not None:
            rows.append((f"{arm_label(e['arm'])} / {e['cache']}", [wait or 0.0, step - (wait or 0.0)]))
    return stacked_hbar_chart(
        rows, ["exposed I/O wait", "compute and everything else"], f"Per decode step — {title}", "ms/step (medians)"
    )


def _budget_points(summary: dict, key: str, scale: float = 1.0) -> dict[str, list[Point]]:
    series: dict[str, list[Point]] = {}
    for e in summary["arms"].values():
        budget = split_arm(e["arm"])[2]  # a series per arm, page-cache policy and K tier
        name = e["arm"].replace(f"@{budget}", "") if budget else e["arm"]
        s = stat(e, key)
        if s is None or (split_arm(name)[0] in BUDGET_ARMS and not budget):
            continue
        x = float(budget) if budget else 0.0
        series.setdefault(arm_label(name), []).append(Point(x, s["median"] / scale, s["min"] / scale, s["max"] / scale))
    return series


def sweep_charts(summary: dict) -> list[str]:
    return [
        line_chart(
            _budget_points(summary, "decode_tok_s"), "Decode throughput vs hot-cache budget", BUDGET_AXIS, "tokens/s"
        ),
        line_chart(
            _budget_points(summary, "peak_memory", GIB), "Peak MLX memory vs hot-cache budget", BUDGET_AXIS, "GiB"
        ),
    ]


def sweep_optimum(summary: dict) -> list[str]:
    """Per sweep arm: the budget with the best decode (as a ratio to exact in
    the same round), and whether it stands out of the run-to-run spread."""
    lines = []
    one_round = min((e["ok"] for e in summary["arms"].values()), default=0) < 2
    for name, points in _budget_points(summary, "decode_vs_exact_paired").items():
        if len(points) < 2:
            continue
        best = max(points, key=lambda p: p.y)
        clear = all(best.low > p.high for p in points if p is not best)
        if one_round:
            verdict = "one run per budget: no spread to judge it by."
        elif clear:
            verdict = "its min–max range lies above every other budget's."
        else:
            verdict = "its min–max range overlaps other budgets', so the optimum is not distinguishable from noise."
        lines.append(
            f"{name}: best decode at {best.x:g} GiB ({best.y:.2f}× exact, median of the per-round ratios); {verdict}"
        )
    return lines


def prerouter_section(suite: dict) -> Optional[Section]:
    """On-demand (hot, same budget) vs prerouter per K and page-cache regime."""
    rows = []
    pairs = [("main", "cold"), ("main", "warm"), ("sweep", "pressure"), ("low-k", "cold"),
             ("low-k", "warm"), ("low-k-pressure", "pressure")]  # fmt: skip
    budget = f"{suite['options']['cache_gib']:g}"
    for phase, cache in pairs:
        summary = _summary(suite, phase)
        for od, pr in _prerouted_pairs(summary, budget, cache):
            rows.append(_prerouter_row(suite["phases"][phase]["k"], cache, od, pr))
    if not rows:
        return None
    headers = ["K", "cache", "on-demand arm", "prerouted arm", "wait on-demand ms/step", "wait prerouter ms/step",
               "wait cut", "tok/s on-demand", "tok/s prerouter", "tok/s change", "loads/token", "MiB/load",
               "MB/token", "peak MLX GiB"]  # fmt: skip
    return Section(f"Prerouter vs on-demand (prerouter @ {budget} GiB)", text=[
        "On-demand = edge0-hot at the same budget and page-cache policy where the suite ran it, else "
        "edge0-exact (routes with each layer's gate, reads on a miss); "
        "prerouter = the heads' prediction routes the consumer layers and their reads start ahead of "
        "them (when the step opens; with a staged window, two prerouted layers before). "
        "Warm-started (untrained) heads: the routing differs from stock by construction.",
    ], tables=[Table(headers, rows)])  # fmt: skip


def _prerouted_pairs(summary: Optional[dict], budget: str, cache: str) -> list[tuple[dict, dict]]:
    """(on-demand, prerouted) entries: every prerouted arm at ``budget``, each
    with the on-demand arm of its own page-cache policy."""
    pairs = []
    for e in (summary or {}).get("arms", {}).values():
        base, policy, arm_budget = split_arm(e["arm"])
        if e["cache"] != cache or base not in PREROUTED_ARMS or arm_budget != budget:
            continue
        suffix = f"+{policy}" if policy else ""
        tier = "".join(e["arm"].partition(TIER_MARK)[1:])
        od = _entry(summary, f"edge0-hot{suffix}@{budget}{tier}", cache) or _entry(
            summary, f"edge0-exact{suffix}{tier}", cache
        )
        if od is not None:
            pairs.append((od, e))
    return pairs


def _prerouter_row(k: int, cache: str, od: dict, pr: dict) -> list[str]:
    w_od, w_pr = median(od, "exposed_wait_ms_per_step", "metrics"), median(pr, "exposed_wait_ms_per_step", "metrics")
    return [
        str(k), cache, arm_label(od["arm"]), arm_label(pr["arm"]),
        cell(stat(od, "exposed_wait_ms_per_step", "metrics"), digits=1),
        cell(stat(pr, "exposed_wait_ms_per_step", "metrics"), digits=1),
        "-" if not w_od else f"{(1 - w_pr / w_od) * 100:.0f}%",
        cell(stat(od, "decode_tok_s"), digits=3), cell(stat(pr, "decode_tok_s"), digits=3),
        change(median(pr, "decode_tok_s"), median(od, "decode_tok_s")),
        f"{cell(stat(od, 'loads_per_token', 'metrics'), digits=1, spread=False)} → "
        f"{cell(stat(pr, 'loads_per_token', 'metrics'), digits=1, spread=False)}",
        f"{cell(stat(od, 'mib_per_load', 'metrics'), spread=False)} → "
        f"{cell(stat(pr, 'mib_per_load', 'metrics'), spread=False)}",
        f"{cell(stat(od, 'bytes_per_token', 'metrics'), 1e6, 1, spread=False)} → "
        f"{cell(stat(pr, 'bytes_per_token', 'metrics'), 1e6, 1, spread=False)}",
        f"{cell(stat(od, 'peak_memory'), GIB, spread=False)} → {cell(stat(pr, 'peak_memory'), GIB, spread=False)}",
    ]  # fmt: skip


def profile_section(suite: dict) -> Optional[Section]:
    phase = suite["phases"].get("profile")
    if phase is None:
        return None
    section = Section(
        phase["title"],
        text=[
            "One cProfiled warm run per arm (profiling inflates times; use the ratios). Own time per "
            "decoded token; `numpy.array` / `item` calls are host syncs, i.e. the MLX compute up to them."
        ],
    )
    for r in phase["results"]["runs"]:
        if not r.get("ok") or "profile_top" not in r:
            continue
        rows = [[p["function"], f"{p['calls_per_token']:.1f}", f"{p['own_ms_per_token']:.1f}",
                 f"{p['total_ms_per_token']:.1f}"] for p in r["profile_top"][:PROFILE_ROWS]]  # fmt: skip
        section.tables.append(
            Table(
                ["function", "calls/token", "own ms/token", "cumulative ms/token"],
                rows,
                f"{arm_label(r['arm'])}: {r['decode_s_per_token'] * 1e3:.0f} ms/token profiled.",
            )
        )
    return section


def build_sections(suite: dict) -> list[Section]:
    """The report's sections; summaries are recomputed from the runs, so a
    report rendered later uses the current aggregation."""
    suite = {**suite, "phases": {
        name: {**p, "results": {**p["results"], "summary": summarize(p["results"]["runs"])}}
        for name, p in suite["phases"].items()}}  # fmt: skip
    sections = [headline(suite)]
    pre = prerouter_section(suite)
    if pre:
        sections.append(pre)
    for name in ("main", "low-k", "sweep", "low-k-pressure"):
        s = phase_section(suite, name)
        if s:
            sections.append(s)
    prof = profile_section(suite)
    if prof:
        sections.append(prof)
    return sections


def _intro(suite: dict) -> list[str]:
    ck = suite["checkpoints"]
    when = datetime.datetime.fromtimestamp(suite["started"]).strftime("%Y-%m-%d %H:%M")
    took = (suite.get("finished", suite["started"]) - suite["started"]) / 60
    o = suite["options"]
    return [
        f"Synthetic random-weight int4 checkpoint of the {suite['geometry']} geometry, {_depth(suite)}: "
        f"stock {ck['stock']['bytes'] / 1e9:.2f} GB on disk; edge0 resident "
        f"{ck['edge0']['resident_bytes'] / GIB:.2f} GiB + experts {ck['edge0']['expert_bytes'] / GIB:.2f} GiB. "
        f"Native K={suite['native_k']}. Compute dtype {o['dtype']} in every arm. Prompt {o['prompt_tokens']} "
        f"tokens; decode {o['decode_tokens']} greedy tokens after 2 warm-up steps.",
        f"Started {when}, took {took:.0f} min. {noise_note(suite)}",
        *provenance(suite),
    ]


def markdown_page(title: str, intro: list[str], sections: list[Section], footer: str) -> str:
    """A report as Markdown: title, intro paragraphs, then each section's text and tables."""
    lines = [f"# {title}", "", *(p + "\n" for p in intro)]
    for s in sections:
        lines.append(f"## {s.title}\n")
        lines += [t + "\n" for t in s.text]
        lines += [t.markdown() + "\n" for t in s.tables]
    lines.append(footer)
    return "\n".join(lines) + "\n"


def render_markdown(suite: dict, sections: list[Section]) -> str:
    return markdown_page(
        f"Benchmark suite: {suite['geometry']}",
        _intro(suite),
        sections,
        "Charts: `report.html` in this directory; every run's record: `suite.json`.",
    )


def inline_markdown(text: str) -> str:
    """Escape, then render the two inline forms the report uses: `code` and **bold**."""
    from markupsafe import Markup, escape

    html = re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text)))
    return Markup(re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", html))


def html_page(title: str, intro: list[str], sections: list[Section], footer: str) -> str:
    """The same report as one HTML page, charts inline."""
    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(loader=jinja2.PackageLoader("mlx_edge0.bench", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)  # fmt: skip
    env.filters.update(inline=inline_markdown, svg=Markup)  # charts escape their own labels
    return env.get_template("report.html.j2").render(title=title, intro=intro, sections=sections, footer=footer)


def render_html(suite: dict, sections: list[Section]) -> str:
    return html_page(
        f"Benchmark suite: {suite['geometry']}",
        _intro(suite),
        sections,
        "Every run's record (per-step times and counters, stderr of failures): `suite.json` and `runs/`.",
    )


def write_report(suite: dict, out: Path) -> tuple[Path, Path]:
    """Write ``summary.md`` and ``report.html`` into ``out``."""
    sections = build_sections(suite)
    out = Path(out)
    md, html = out / "summary.md", out / "report.html"
    md.write_text(render_markdown(suite, sections))
    html.write_text(render_html(suite, sections))
    return md, html
