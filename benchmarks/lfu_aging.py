"""How long should the hot cache's LFU remember? Its counts halve every
``aging x capacity`` touches (``mlx_edge0.cache_policy.FrequencyPolicy``); this
replays traces through the runtime's cache planner under several agings
(0: never halve) beside Belady's MIN:

- recorded traces (``--trace``, RoutingTrace JSON as
  ``benchmarks/routing_locality.py --trace-out`` writes them), at cache
  sizes given as fractions of all experts;
- bench runs (``--bench``, an ``edge0 bench`` results JSON): each run's
  decode routing from the cache its decode began with, at the run's rows,
  with its permanent bundles, beside the runtime's own hit rate (which also
  knew the prompt's and warm-up's uses);
- synthetic traces of the calibrated 35B's shape (``--synthetic`` lengths):
  40 layers x 256 experts, K=4, 1,092 rows (the 2 GiB cache of BENCHMARKS.md),
  Zipf popularity solved for 90% coverage 0.51, seeds 0-2.

Prints a table and writes JSON:

    python benchmarks/lfu_aging.py [--trace TRACE.json ...] [--fractions 0.125,0.25,0.5]
        [--bench RESULTS.json ...] [--synthetic 256,1024] [--agings 2,8,32,128,0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

from mlx_edge0.bench.eviction import RecordedDecode, recorded_decodes, simulate
from mlx_edge0.bench.locality import RoutingTrace
from mlx_edge0.bench.synthetic_routing import CALIBRATED_35B_2GIB, calibrate, generate
from mlx_edge0.cache_policy import LFU_AGING
from mlx_edge0.progress import bar

SHAPE = CALIBRATED_35B_2GIB
SEEDS = (0, 1, 2)


def rates(trace: RoutingTrace, capacity: int, agings: list[int], **start) -> dict:
    """LFU's hit rate at each aging, and MIN's (``start``: ``permanent`` and
    ``resident`` keys, as :func:`~mlx_edge0.bench.eviction.simulate` takes)."""
    out = {f"lfu@{a}": simulate(trace, capacity, "lfu", lfu_aging=a, **start).hit_rate for a in agings}
    return out | {"min": simulate(trace, capacity, "min", **start).hit_rate}


def replay_run(path: Path, run: dict, decode: RecordedDecode, agings: list[int]) -> dict:
    """One bench run's decode from its start, and what the runtime served."""
    start = decode.start()
    hit_rate = rates(decode.trace, decode.capacity, agings, **start)
    name = f"{path.name}: {run['arm']} round {run['round']}"
    return {"trace": name, "tokens": len(decode.trace.tokens), "capacity": decode.capacity, "hit_rate": hit_rate} | {
        "runtime_hit_rate": decode.runtime_hit_rate
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, action="append", default=[], help="a recorded RoutingTrace JSON")
    p.add_argument("--fractions", default="0.125,0.25,0.5", help="cache sizes for recorded traces")
    p.add_argument("--bench", type=Path, action="append", default=[], help="an edge0 bench results JSON")
    p.add_argument("--synthetic", default="256,1024", help="synthetic trace lengths ('' for none)")
    p.add_argument("--agings", default="2,8,32,128,0", help="LFU agings to replay (0: counts never halve)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    a = p.parse_args()
    agings = [int(x) for x in a.agings.split(",")]
    lengths = [int(x) for x in a.synthetic.split(",") if x]
    traces = [RoutingTrace.load(path) for path in a.trace]
    fractions = [float(f) for f in a.fractions.split(",")]
    rows = []
    try:
        runs = [(path, run, decode) for path in a.bench for run, decode in recorded_decodes(path)]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    jobs = len(traces) * len(fractions) + len(runs) + len(lengths) * len(SEEDS)
    with bar(jobs, "replays", unit="trace") as b:
        for path, run, decode in runs:
            rows.append(replay_run(path, run, decode, agings))
            b.update(1)
        for path, trace in zip(a.trace, traces):
            total = len(trace.layers) * trace.num_experts
            for f in fractions:
                capacity = max(trace.k, round(f * total))
                hit_rate = rates(trace, capacity, agings)
                rows.append(
                    {"trace": str(path), "tokens": len(trace.tokens), "capacity": capacity, "hit_rate": hit_rate}
                )
                b.update(1)
        knobs = calibrate(SHAPE.experts, SHAPE.k, SHAPE.coverage90, SHAPE.reuse)
        for tokens in lengths:
            for seed in SEEDS:
                trace = generate(tuple(range(SHAPE.layers)), SHAPE.experts, SHAPE.k, tokens, knobs, seed)
                hit_rate = rates(trace, SHAPE.capacity, agings)
                name = f"synthetic 35B shape, seed {seed}"
                rows.append(
                    {"trace": name, "tokens": tokens, "seed": seed, "capacity": SHAPE.capacity, "hit_rate": hit_rate}
                )
                b.update(1)
    names = [f"lfu@{x}" for x in agings] + ["min"]
    labels = [("never halves" if x == 0 else f"aging {x}") + (" (runtime)" if x == LFU_AGING else "") for x in agings]
    print("\n| trace | tokens | rows | " + " | ".join(labels) + " | MIN | runtime served |")
    print("|" + "---|" * (len(names) + 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:  # synthetic seeds: one row, medians
        key = (r["trace"] if "seed" not in r else "synthetic 35B shape (median of 3 seeds)", r["tokens"], r["capacity"])
        groups.setdefault(key, []).append(r)
    for (name, tokens, capacity), group in groups.items():
        cells = [f"{statistics.median(g['hit_rate'][n] for g in group):.3f}" for n in names]
        served = [g["runtime_hit_rate"] for g in group if "runtime_hit_rate" in g]
        cells.append(f"{statistics.median(served):.3f}" if served else "–")
        print(f"| {name} | {tokens} | {capacity} | " + " | ".join(cells) + " |")
    if a.out:
        a.out.write_text(json.dumps({"agings": agings, "shape": asdict(SHAPE), "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
