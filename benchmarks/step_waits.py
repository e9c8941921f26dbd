"""Where in a decode an arm's exposed wait falls: step by step, from a bench run.

``edge0 bench run`` reports an arm's exposed wait as a mean over the decoded
tokens; that mean hides whether the wait recurs every token (reads that bind)
or comes once (the pipeline filling at the decode's start). This reads the
per-step counters every edge0 run records (``decode_step_counters``) and the
per-step times (``decode_step_s``), and prints, per arm, the median over
rounds at each step, the share of the decode spent waiting, and that share
over the steps after the first. The timing loop queues step t+1 before reading
step t's token back, as mlx-lm's ``generate_step`` does, so the first step's
time and counters cover two forwards and the last step's only the tail of one.

Where the runs were read-throttled, each step's reads also give the disk's
busy share at the throttle (the bytes the runtime read that step at the
rate, over the step's time), and each step is checked against issue 19's
target as the step it is: where it waited at most 5% of its time compute
bound it, otherwise reads did and the disk must have been busy at least 0.9
of it. A decode whose first steps read a filling cache and whose later ones
compute is read-bound only in part, which the mean over tokens mixes.

Prints a table, writes JSON and an SVG of the wait per step:

    python benchmarks/step_waits.py RESULTS.json [RESULTS.json ...] [--arms A,B]
        [--out FILE.json] [--svg FILE.svg]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_edge0.bench.charts import Point, line_chart
from mlx_edge0.bench.runner import load_run
from mlx_edge0.bench.tables import arm_label

COMPUTE_BOUND_WAIT = 0.05  # issue 19: where compute binds, exposed wait at most 5% of the step
READ_BOUND_BUSY = 0.9  # where reads bind, the disk busy at least 0.9 of the time


def step_verdict(wait_ms: float, step_ms: float, busy: float) -> str:
    """Which bound a step met: ``compute`` (it waited at most 5%), ``reads``
    (it waited more, and the disk was busy at least 0.9 of it), or ``neither``
    (it waited while the disk idled: the shortfall)."""
    if wait_ms <= COMPUTE_BOUND_WAIT * step_ms:
        return "compute"
    return "reads" if busy >= READ_BOUND_BUSY else "neither"


def arm_steps(runs: list[dict], arm: str, read_mbps: float | None = None) -> dict:
    """Per-step medians over one arm's rounds, and its wait shares; with the
    throttle's ``read_mbps``, each step's disk busy share and verdict."""
    rounds = [r for r in runs if r["arm"] == arm and r.get("decode_step_counters")]
    waits = [[s["exposed_wait_ms"] for s in r["decode_step_counters"]] for r in rounds]
    steps = [[s * 1000 for s in r["decode_step_s"]] for r in rounds]
    per_step_wait = [statistics.median(col) for col in zip(*waits)]
    per_step_ms = [statistics.median(col) for col in zip(*steps)]
    later = [sum(w[1:]) / sum(s[1:]) for w, s in zip(waits, steps)]
    disk = {}
    if read_mbps:
        reads_ms = [[s["bytes_read"] / (read_mbps * 1e3) for s in r["decode_step_counters"]] for r in rounds]
        busy = [
            statistics.median(b / t for b, t in zip(col_b, col_t)) for col_b, col_t in zip(zip(*reads_ms), zip(*steps))
        ]
        verdicts = [step_verdict(w, t, b) for w, t, b in zip(per_step_wait, per_step_ms, busy)]
        disk = {"read_mbps": read_mbps, "disk_busy": busy, "verdicts": verdicts}
    return {
        "arm": arm,
        "rounds": len(rounds),
        "wait_ms": per_step_wait,
        "step_ms": per_step_ms,
        "share": statistics.median(sum(w) / sum(s) for w, s in zip(waits, steps)),
        "share_after_first_step": statistics.median(later),
        "first_step_wait_ms": per_step_wait[0],
        "later_wait_ms_per_step": statistics.median(statistics.mean(w[1:-1]) for w in waits),
        **disk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="edge0 bench run JSON files")
    parser.add_argument("--arms", help="comma-separated arms (default: every edge0 arm with step counters)")
    parser.add_argument("--out", type=Path, help="write the table as JSON")
    parser.add_argument("--svg", type=Path, help="draw the wait per step")
    args = parser.parse_args()

    rows, series = [], {}
    for path in args.results:
        try:
            runs, read_mbps = load_run(path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        present = list(dict.fromkeys(r["arm"] for r in runs if r.get("decode_step_counters")))
        wanted = args.arms.split(",") if args.arms else present
        for arm in (a for a in wanted if a in present):
            row = {"results": path.name, **arm_steps(runs, arm, read_mbps)}
            rows.append(row)
            series[f"{arm_label(arm)} ({path.stem})"] = [Point(i + 1, w) for i, w in enumerate(row["wait_ms"])]

    columns = ("results", "arm", "rounds", "wait ms per step (median over rounds)", "step ms per step",
               "waiting, all steps", "after the first step", "disk busy per step (at the throttle)",
               "steps: compute-bound / at the read bound / neither")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        waits = ", ".join(f"{w:,.0f}" for w in r["wait_ms"])
        steps = ", ".join(f"{s:,.0f}" for s in r["step_ms"])
        busy = ", ".join(f"{b:.2f}" for b in r["disk_busy"]) if "disk_busy" in r else "–"
        counts = (
            "/".join(str(r["verdicts"].count(v)) for v in ("compute", "reads", "neither")) if "verdicts" in r else "–"
        )
        print(
            f"| {r['results']} | {r['arm']} | {r['rounds']} | {waits} | {steps} | "
            f"{r['share']:.1%} | {r['share_after_first_step']:.2%} | {busy} | {counts} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.svg:
        args.svg.write_text(line_chart(series, "Exposed wait per decode step", "decode step", "ms"))


if __name__ == "__main__":
    main()
