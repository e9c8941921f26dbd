"""Does a routing trace remember? Reuse at a distance against what
popularity alone gives.

A victim choice that learns from past uses can beat one that knows each
expert's popularity only where routing has memory: where an expert used now
is likelier to be used again soon than its popularity says. For tokens that
route independently, the optimal such choice evicts the least popular
expert (Aho, Denning and Ullman's A0; ``mlx_edge0.bench.eviction``), and the
rest of the way to Belady's MIN is what only knowing the future buys.

For each trace this prints the reuse at distance ``d``: the share of a
token's routings that token ``t + d`` routes again in the same layer,
``sum |S_t & S_t+d| / sum |S_t|`` over every MoE layer and every ``t``, for
several ``d``; and beside it the reuse popularity alone gives, the same for
tokens drawn independently with the trace's own per-layer shares (the
unbiased ``sum c (c - 1) / (T (T - 1))`` over each layer's expert counts
``c`` in ``T`` tokens, so it does not credit the trace with its own sampling
noise). A ratio near 1 at every distance: the trace is memoryless, and
popularity is all a cache can learn from it.

Traces are routing trace files (``RoutingTrace.save``; ``--trace``) or the
decodes ``edge0 bench`` runs recorded (``--bench``, the first recorded run
of each file). Prints a table, writes JSON and, beside it, an SVG of the
ratio against the distance:

    python benchmarks/reuse_by_distance.py [--trace TRACE.json ...] [--bench RESULTS.json ...]
        [--distances 1,2,4,8,16,32,64,128] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mlx_edge0.bench.charts import Point, line_chart
from mlx_edge0.bench.eviction import recorded_decodes
from mlx_edge0.bench.locality import RoutingTrace


def usage(trace: RoutingTrace) -> np.ndarray:
    """``[token, layer, expert]``: whether the token routed there."""
    used = np.zeros((len(trace.tokens), len(trace.layers), trace.num_experts), bool)
    for t, token in enumerate(trace.tokens):
        for i, ids in enumerate(token):
            used[t, i, list(ids)] = True
    return used


def reuse_at(used: np.ndarray, distance: int) -> float:
    """The share of token ``t``'s routings token ``t + distance`` routes again."""
    if distance >= len(used):
        return float("nan")
    now = used[:-distance]
    return float((now & used[distance:]).sum() / now.sum())


def memoryless_reuse(used: np.ndarray) -> float:
    """The reuse at any distance of tokens drawn independently with each
    layer's measured shares (unbiased in the counts)."""
    tokens = len(used)
    counts = used.sum(axis=0).astype(np.float64)  # [layer, expert]
    pairs = (counts * (counts - 1)).sum() / (tokens * (tokens - 1))
    return float(pairs / (used.sum() / tokens))


def measure(name: str, trace: RoutingTrace, distances: list[int]) -> dict:
    """One trace's row: its reuse at each distance, and each over the memoryless reuse.

    Raises:
        ValueError: the trace has fewer than two tokens (``name`` in the message).
    """
    if len(trace.tokens) < 2:
        raise ValueError(f"{name}: {len(trace.tokens)} tokens, and a reuse needs two")
    used = usage(trace)
    base = memoryless_reuse(used)
    reuse = {d: reuse_at(used, d) for d in distances}
    return {
        "trace": name,
        "tokens": len(trace.tokens),
        "layers": len(trace.layers),
        "num_experts": trace.num_experts,
        "k": trace.k,
        "memoryless_reuse": base,
        "reuse": {str(d): r for d, r in reuse.items()},
        "ratio": {str(d): r / base if base else float("nan") for d, r in reuse.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, action="append", default=[], help="a routing trace file")
    ap.add_argument("--bench", type=Path, action="append", default=[], help="an edge0 bench results JSON")
    ap.add_argument("--distances", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        distances = [int(d) for d in args.distances.split(",")]
    except ValueError:
        raise SystemExit(f"--distances: {args.distances!r} is not a comma-separated list of whole numbers") from None
    if any(d < 1 for d in distances):
        raise SystemExit(f"--distances: every distance must be at least 1, got {args.distances}")
    traces = []
    for path in args.trace:
        try:
            traces.append((path.name, RoutingTrace.load(path)))
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"{path}: not a readable routing trace ({e})") from None
    for path in args.bench:
        try:
            decodes = recorded_decodes(path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if not decodes:
            raise SystemExit(f"{path}: no run recorded its decode's routing")
        traces.append((path.name, decodes[0][1].trace))
    if not traces:
        raise SystemExit("give at least one --trace or --bench")
    try:
        rows = [measure(name, trace, distances) for name, trace in traces]
    except ValueError as e:
        raise SystemExit(str(e)) from None

    head = " | ".join(f"d={d}" for d in distances)
    print(f"| trace | tokens | layers x experts, K | memoryless reuse | {head} |")
    print("|---|---|---|---|" + "---|" * len(distances))
    for r in rows:
        cells = " | ".join(f"{r['reuse'][str(d)]:.4f} ({r['ratio'][str(d)]:.2f})" for d in distances)
        shape = f"{r['layers']} x {r['num_experts']}, {r['k']}"
        print(f"| {r['trace']} | {r['tokens']} | {shape} | {r['memoryless_reuse']:.4f} | {cells} |")
    print("(reuse at distance d; in brackets, its ratio to the memoryless reuse)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"distances": distances, "traces": rows}, indent=1) + "\n")
    series = {
        r["trace"]: [Point(float(np.log2(d)), r["ratio"][str(d)]) for d in distances if d < r["tokens"]] for r in rows
    }
    svg = line_chart(series, "Reuse at a distance ÷ what popularity alone gives", "log2 distance (tokens)", "ratio")
    args.out.with_suffix(".svg").write_text(svg + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.svg')}")


if __name__ == "__main__":
    main()
