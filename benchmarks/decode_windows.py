"""How each arm's decode speed changes as its cache fills: tok/s over windows of steps.

``edge0 bench run`` reports a decode's mean tok/s. From a cold start both
edge0's hot cache and llama.cpp's page cache fill over the first tokens, so
a short decode's mean mixes the filling with the steady state a long answer
runs in, and the two caches need not fill alike. This splits every run's
recorded step times (``decode_step_s``) into windows of ``--window`` steps
and prints, per arm, the median over rounds of each window's tok/s, the
device bytes the runtime read a token in it (edge0's per-step counters;
llama.cpp records no per-step bytes), and each window's ratio to llama.cpp's
mmap arm (``llamacpp``) in the same round. A round is one results file of
``benchmarks/read_ahead_pair.py`` or one ``round`` (and cache state) of a
``bench run`` file.
edge0's timing loop queues step t+1 before reading step t's token back, as
mlx-lm's ``generate_step`` does, so its first step holds two forwards and its
last the tail of one; llama.cpp's steps are one forward each.

Prints a table, writes JSON and an SVG of tok/s per window:

    python benchmarks/decode_windows.py RESULTS.json [RESULTS.json ...] [--window 16]
        [--out FILE.json] [--svg FILE.svg]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_edge0.bench.charts import Point, line_chart
from mlx_edge0.bench.runner import load_run
from mlx_edge0.bench.summary import side_by_side
from mlx_edge0.bench.tables import arm_label

PEER = "llamacpp"


def window_rates(step_s: list[float], window: int) -> list[float]:
    """tok/s over each whole window of ``window`` steps (a shorter tail is dropped)."""
    return [window / sum(step_s[i : i + window]) for i in range(0, len(step_s) - window + 1, window)]


def window_mb(step_counters: list[dict], window: int) -> list[float]:
    """MB the runtime read a token over each whole window of steps."""
    read = [s["bytes_read"] for s in step_counters]
    return [sum(read[i : i + window]) / window / 1e6 for i in range(0, len(read) - window + 1, window)]


def by_round(files: list[tuple[str, list[dict]]]) -> dict[tuple, dict[str, dict]]:
    """(file, round, cache state) -> arm -> its successful run with step times:
    the runs made side by side (:func:`~mlx_edge0.bench.summary.side_by_side`)."""
    rounds: dict[tuple, dict[str, dict]] = {}
    for name, runs in files:
        for (rnd, cache), arms in side_by_side(runs).items():
            timed = {arm: r for arm, r in arms.items() if r.get("decode_step_s")}
            if timed:
                rounds[(name, rnd, cache)] = timed
    return rounds


def arm_windows(rounds: dict[tuple, dict[str, dict]], window: int) -> dict[str, dict]:
    """Per arm: each window's median tok/s over rounds and its range, MB a
    token (where the runs count their reads) and ratio to the peer by round."""
    arms = list(dict.fromkeys(arm for runs in rounds.values() for arm in runs))
    table = {}
    for arm in arms:
        rates, mbs, ratios = [], [], []
        for runs in rounds.values():
            if arm not in runs:
                continue
            rate = window_rates(runs[arm]["decode_step_s"], window)
            rates.append(rate)
            if runs[arm].get("decode_step_counters"):
                mbs.append(window_mb(runs[arm]["decode_step_counters"], window))
            if PEER in runs and arm != PEER:
                peer = window_rates(runs[PEER]["decode_step_s"], window)
                ratios.append([a / b for a, b in zip(rate, peer)])
        table[arm] = {
            "rounds": len(rates),
            "tok_s": [statistics.median(col) for col in zip(*rates)],
            "tok_s_range": [(min(col), max(col)) for col in zip(*rates)],
            "mb_per_token": [statistics.median(col) for col in zip(*mbs)] if mbs else None,
            "x_peer": [statistics.median(col) for col in zip(*ratios)] if ratios else None,
            "x_peer_by_round": [list(col) for col in zip(*ratios)] if ratios else None,
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="edge0 bench run JSON files")
    parser.add_argument("--window", type=int, default=16, help="steps a window (default 16)")
    parser.add_argument("--out", type=Path, help="write the table as JSON")
    parser.add_argument("--svg", type=Path, help="draw tok/s per window")
    args = parser.parse_args()
    if args.window < 1:
        raise SystemExit(f"--window {args.window}: give a number of steps, at least 1")
    files = []
    for path in args.results:
        try:
            runs, _ = load_run(path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        files.append((str(path), runs))
    table = arm_windows(by_round(files), args.window)
    if not table or not any(row["tok_s"] for row in table.values()):
        raise SystemExit(f"no successful run has {args.window} decode steps or more")

    def steps(i: int) -> str:
        return f"{i * args.window + 1}–{(i + 1) * args.window}"

    print("| arm | rounds | window (steps) | tok/s (median, range) | MB/token | × llama.cpp (by round) |")
    print("|---|---|---|---|---|---|")
    for arm, row in table.items():
        for i, rate in enumerate(row["tok_s"]):
            low, high = row["tok_s_range"][i]
            mb = f"{row['mb_per_token'][i]:.1f}" if row["mb_per_token"] else "–"
            ratio = "–"
            if row["x_peer"]:
                rounds = ", ".join(f"{x:.2f}" for x in row["x_peer_by_round"][i])
                ratio = f"{row['x_peer'][i]:.2f} ({rounds})"
            name = arm_label(arm) if i == 0 else ""
            count = str(row["rounds"]) if i == 0 else ""
            print(f"| {name} | {count} | {steps(i)} | {rate:.3f} ({low:.3f}–{high:.3f}) | {mb} | {ratio} |")
    if args.out:
        args.out.write_text(json.dumps({"window": args.window, "arms": table}, indent=1) + "\n")
    if args.svg:
        series = {
            arm_label(arm): [
                Point((i + 0.5) * args.window, rate, low, high)
                for i, (rate, (low, high)) in enumerate(zip(row["tok_s"], row["tok_s_range"]))
            ]
            for arm, row in table.items()
        }
        title = f"Decode tok/s over windows of {args.window} steps (median over rounds, range)"
        args.svg.write_text(line_chart(series, title, "decode step (window's middle)", "tok/s"))


if __name__ == "__main__":
    main()
