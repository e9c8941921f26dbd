"""The same arms on two disks of one rate: a slow disk (``paced_disk.py``'s
view) and the bench's throttle. Reads two ``edge0 bench run`` JSON files and
prints, per arm and disk: median decode tok/s, the median over rounds of the
arm's ratio to ``--base`` (the on-demand hot arm by default; for an arm of a K
tier, ``ARM/k4``, the base arm of that tier), bytes the arm
asked for a token, tok/s against the read bound those bytes give at the rate
(a bypass arm's device bytes are the bytes it asked for; a buffered arm's
may be fewer, so no bound is given for it), and exposed wait as a share of
the step. Writes the same as JSON.

    python benchmarks/disk_pair.py --paced PACED.json --throttled THROTTLED.json --read-mbps 50 --out pair.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_edge0.bench.summary import run_metrics


def arms(path: Path) -> dict[str, list[dict]]:
    """Each arm's successful runs, in round order."""
    out: dict[str, list[dict]] = {}
    for run in json.loads(path.read_text())["runs"]:
        if run.get("ok"):
            out.setdefault(run["arm"], []).append(run)
    return out


def row(runs: list[dict], base: list[dict], rate: float) -> dict:
    tok_s = statistics.median(r["decode_tok_s"] for r in runs)
    by_round = {r["round"]: r["decode_tok_s"] for r in base}
    ratios = [r["decode_tok_s"] / by_round[r["round"]] for r in runs if r["round"] in by_round]
    metrics = [run_metrics(r) for r in runs]  # the bench's own per-run figures
    asked = statistics.median(m["bytes_per_token"] for m in metrics)
    wait = statistics.median(m["wait_share"] for m in metrics)
    bypass = "bypass" in runs[0]["arm"]
    return {
        "tok_s": tok_s,
        "x_base": statistics.median(ratios) if ratios else None,
        "x_base_by_round": ratios,
        "asked_mb_per_token": asked / 1e6,
        "of_read_bound": tok_s / (rate / asked) if bypass and asked else None,
        "wait_share": wait,
        "rounds": len(runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paced", type=Path, required=True)
    p.add_argument("--throttled", type=Path, required=True)
    p.add_argument("--read-mbps", type=float, required=True)
    p.add_argument("--base", default="edge0-hot+bypass")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rate = a.read_mbps * 1e6
    disks = {"paced": arms(a.paced), "throttled": arms(a.throttled)}
    table = {}
    for arm in disks["paced"]:
        if arm not in disks["throttled"]:
            continue
        tier = arm.partition("/")[2]  # a K tier's arm is set against the base arm of its tier
        base = f"{a.base}/{tier}" if tier else a.base
        table[arm] = {disk: row(runs[arm], runs.get(base, []), rate) for disk, runs in disks.items()}
    print(
        f"| arm | disk | tok/s | x {a.base} of its K (by round) | MB asked a token | of the read bound "
        "| exposed wait share |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm, by_disk in table.items():
        for disk, q in by_disk.items():
            ratio = (
                "–"
                if q["x_base"] is None
                else f"{q['x_base']:.2f} ({', '.join(f'{x:.2f}' for x in q['x_base_by_round'])})"
            )
            bound = "–" if q["of_read_bound"] is None else f"{q['of_read_bound']:.2f}"
            print(
                f"| {arm} | {disk} | {q['tok_s']:.3f} | {ratio} | {q['asked_mb_per_token']:.1f} | {bound} "
                f"| {q['wait_share']:.1%} |"
            )
    a.out.write_text(json.dumps({"read_mbps": a.read_mbps, "base": a.base, "arms": table}, indent=1))


if __name__ == "__main__":
    main()
