"""The sweep's report: ``sweep.md`` and ``sweep.html`` from ``sweep.json``.

First the map (which arm decodes fastest at each memory cap × read
throughput, every other arm's speed or OOM beside it), as an inline SVG grid
in the HTML and as a table in both; then one table per point. Rendered from
the same sections and page templates as the suite's report
(:mod:`mlx_edge0.bench.report`), so the two files say the same thing.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Optional, Union

from .charts import Cell, grid_map
from .report import Section, html_page, machine_line, markdown_page
from .sweep import axis
from .tables import GIB, MB, Table, arm_label, cell, rate_digits, ratio, read_bound_cells

TITLE = "Benchmark sweep: memory cap × read throughput"
MAP_TITLE = "Fastest arm per memory cap and read throughput (median decode tok/s)"


def cap_label(cap: Optional[float]) -> str:
    return "uncapped" if cap is None else f"{cap:g} GiB"


def mbps_label(mbps: Optional[float]) -> str:
    return "uncapped" if mbps is None else f"{mbps:g} MB/s"


def arm_value(a: dict) -> Union[float, str]:
    """An arm's median decode tok/s where it can win, else why not ("OOM", "failed")."""
    if a["oom"]:
        return "OOM" if a["oom"] == a["runs"] else f"OOM {a['oom']}/{a['runs']}"
    if a["decode_tok_s"] is None:
        return "failed"
    return a["decode_tok_s"]["median"]


def _axes(sweep: dict) -> tuple[list[Optional[float]], list[Optional[float]]]:
    points = sweep["points"]
    return list(axis(p["memory_cap_gib"] for p in points)), list(axis(p["read_mbps"] for p in points))


def map_chart(sweep: dict) -> str:
    caps, speeds = _axes(sweep)
    cells = [Cell(mbps_label(p["read_mbps"]), cap_label(p["memory_cap_gib"]), p["winner"],
                  {a["arm"]: arm_value(a) for a in p["arms"]}) for p in sweep["points"]]  # fmt: skip
    return grid_map(
        cells, columns=[mbps_label(v) for v in speeds], rows=[cap_label(v) for v in caps],
        series=list(sweep["options"]["arms"]), title=MAP_TITLE, x_label="device read throughput per arm",
        y_label="memory cap per arm", unit="tok/s",
    )  # fmt: skip


def map_table(sweep: dict) -> Table:
    """The map as text: a row per memory cap (largest first, as the chart draws
    them), a column per read throughput, the winner and its tok/s in each cell."""
    caps, speeds = _axes(sweep)
    at = {(p["memory_cap_gib"], p["read_mbps"]): p for p in sweep["points"]}
    rows = []
    for cap in reversed(caps):
        row = [cap_label(cap)]
        for mbps in speeds:
            p = at.get((cap, mbps))
            row.append("-" if p is None else _winner_cell(p))
        rows.append(row)
    return Table(["memory cap \\ reads", *map(mbps_label, speeds)], rows)


def _winner_cell(point: dict) -> str:
    if point["winner"] is None:
        return "all OOM" if all(a["oom"] == a["runs"] for a in point["arms"]) else "no winner"
    best = next(a for a in point["arms"] if a["arm"] == point["winner"])
    return f"{point['winner']} ({best['decode_tok_s']['median']:.3f} tok/s)"


def point_table(point: dict) -> Table:
    """Every arm at one point, decode against the winner's and llama.cpp's,
    and against the read bound (the point's MB/s ÷ the arm's device MB a
    token) as :func:`~mlx_edge0.bench.tables.regime_table` sets it."""
    best = next((a["decode_tok_s"]["median"] for a in point["arms"] if a["arm"] == point["winner"]), None)
    mbps, rows = point["read_mbps"], []
    for a in point["arms"]:
        tok_s, device = a["decode_tok_s"], a["device_bytes_per_token"]
        med = tok_s and tok_s["median"]
        rows.append([
            arm_label(a["arm"]), f"{a['ok']}/{a['runs']}", cell(tok_s, digits=rate_digits(med)),
            ratio(med, best), cell(a.get("decode_vs_llamacpp")), str(a["oom"]),
            "-" if device is None else f"{device / MB:.1f}", *read_bound_cells(med, device, mbps),
            cell(a.get("wait_share"), 0.01, 1, spread=False),
            cell(a["peak_memory"], GIB, spread=False), cell(a["cgroup_peak_bytes"], GIB, spread=False),
        ])  # fmt: skip
    headers = ["arm", "ok/runs", "decode tok/s", "× best", "× llama.cpp (per round)", "OOM kills", "device MB/token",
               f"read bound tok/s ({mbps:g} ÷ MB)" if mbps else "read bound tok/s", "of the bound",
               "exposed wait, % of the step", "peak MLX GiB", "cgroup peak GiB"]  # fmt: skip
    winner = point["winner"] or "none (no arm decoded without an OOM kill)"
    notes = [f"{a['arm']} failed: {a['error']} (stderr tail in {point['results']})"
             for a in point["arms"] if a["error"] and not a["oom"]]  # fmt: skip
    return Table(headers, rows, caption=f"Winner: {winner}.", notes=notes)


def intro(sweep: dict) -> list[str]:
    o = sweep["options"]
    when = datetime.datetime.fromtimestamp(sweep["started"]).strftime("%Y-%m-%d %H:%M")
    took = (sweep.get("finished", sweep["started"]) - sweep["started"]) / 60
    checkpoints = ", ".join(f"{k} `{o[k]}`" for k in ("stock", "edge0", "gguf") if o.get(k))
    return [
        f"Arms {', '.join(o['arms'])} on {checkpoints}, each run a fresh process, at a capped point in a "
        f"cgroup of its own (the page cache charged to its memory cap, its device reads throttled); "
        f"{o['cache']} page cache; "
        f"{o['rounds']} round(s) per point, arm order rotated per round; prompt {o['prompt_tokens']} tokens, "
        f"decode {o['decode_tokens']} tokens, compute dtype {o['dtype']}.",
        "A point's winner is the arm with the highest median decode tok/s among those that decoded and were "
        "never OOM-killed there. × best is an arm's median over the winner's.",
        f"Started {when}, took {took:.0f} min.",
        machine_line(sweep["machine"]),
        f"Command: `{' '.join(sweep['command'])}`",
    ]


def build_sections(sweep: dict) -> list[Section]:
    sections = [Section("Where each arm wins", tables=[map_table(sweep)], charts=[map_chart(sweep)])]
    for p in sweep["points"]:
        title = f"Memory cap {cap_label(p['memory_cap_gib'])}, reads {mbps_label(p['read_mbps'])}"
        sections.append(Section(title, tables=[point_table(p)]))
    return sections


def write_sweep_report(sweep: dict, out: Path) -> tuple[Path, Path]:
    """Write ``sweep.md`` and ``sweep.html`` into ``out``."""
    sections, text = build_sections(sweep), intro(sweep)
    out = Path(out)
    md, html = out / "sweep.md", out / "sweep.html"
    records = "`sweep.json` and, per point, `points/`"
    md.write_text(
        markdown_page(TITLE, text, sections, f"Map: `sweep.html` in this directory; every run's record: {records}.")
    )
    html.write_text(html_page(TITLE, text, sections, f"Every run's record (stderr of failures included): {records}."))
    return md, html
