"""How close can a victim choice that learns from past uses get to Belady's MIN?

The runtime's LFU sits 12-14 points below MIN where a 2 GiB cache must evict
on the calibrated 35B (BENCHMARKS.md, "A 2 GiB hot cache"), and sparing the
next token's experts closes only 3 of them. This replays synthetic traces of
that run's shape (``mlx_edge0.bench.synthetic_routing``: a Zipf popularity
per layer solved for the measured 90% coverage, tokens drawn independently
when popularity alone gives the measured reuse) through one shared cache
(``mlx_edge0.bench.eviction``) under:

- ``lru``, ``lfu``: the runtime's policies, learning from past uses;
- ``lfu+next``: LFU that spares the next token's experts (a perfect
  one-token-ahead prerouter);
- ``popularity``: the generator's true popularity, the long-run optimum for
  independent references (A0): how far knowing each expert's popularity in
  advance, rather than learning it, would take a cache;
- ``min``: Belady's MIN, which knows the whole future.

Every replay starts empty; longer traces show the steady state.

``--bench RESULTS.json`` replays, beside them, the decodes an ``edge0 bench``
run recorded, each from the cache it began with and at its rows, under the
same policies (the runtime's LFU, and ``lfu+next``, from the state it had
then, where the record kept it: the prompt's and warm-up's uses, the
profile's counts); ``popularity`` there is each expert's share of that very
decode's routings (measured on the trace it is replayed on, so it knows in
advance what a learning cache must estimate): what no victim choice that
knows only popularity can beat on average.

``--next-lags 0,2,4`` adds, for the recorded decodes, ``lfu+next`` that knows
the next token's experts only ``lag`` layers behind the call it places (of
the next token, the layers up to ``layer - lag``; all of this token's): what
a cache could gain by choosing each miss's row when its read starts, from
what the heads have predicted of the next token by then, instead of when the
step opens, as the runtime does (it knows none of the next token then).

Prints a table (medians over seeds, ranges) and writes JSON:

    python benchmarks/eviction_bound.py [--layers 40] [--experts 256] [--k 4]
        [--capacity 1092] [--coverage90 0.51] [--reuse 0.107]
        [--tokens 24,64,256,1024] [--seeds 0,1,2] [--bench RESULTS.json ...] [--next-lags 0,2,4]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Sequence

from mlx_edge0.bench.eviction import (
    POPULARITY,
    RecordedDecode,
    ceiling,
    measured_popularity,
    recorded_decodes,
    simulate,
)
from mlx_edge0.bench.locality import LocalitySummary
from mlx_edge0.bench.synthetic_routing import CALIBRATED_35B_2GIB as SHAPE
from mlx_edge0.bench.synthetic_routing import calibrate, generate_with_popularity
from mlx_edge0.progress import bar

POLICIES = ("lru", "lfu", "lfu+next", POPULARITY, "min")


def replay(layers: int, experts: int, k: int, capacity: int, tokens: int, seed: int, knobs) -> dict:
    """Every policy on one synthetic trace."""
    trace, weights = generate_with_popularity(tuple(range(layers)), experts, k, tokens, knobs, seed)
    popularity = {(layer, e): float(weights[layer, e]) for layer in range(layers) for e in range(experts)}
    summary = LocalitySummary.of(trace)
    hit_rate = {p: simulate(trace, capacity, p, popularity=popularity).hit_rate for p in POLICIES}
    return {
        "tokens": tokens,
        "seed": seed,
        "reuse": summary.mean("reuse"),
        "coverage90": summary.mean("coverage90"),
        "distinct": summary.mean("distinct"),
        "ceiling": ceiling(trace),
        "hit_rate": hit_rate,
    }


def replay_recorded(path: Path, run: dict, decode: RecordedDecode, next_lags: Sequence[int] = ()) -> dict:
    """Every policy on one bench run's decode, from the cache it began with;
    the runtime's kind of policy (and ``lfu+next``, built on it) from what it
    had learned then, where the record kept it, so that one replays what
    the runtime served."""
    start = decode.runtime_start()
    popularity = measured_popularity(decode.trace)
    hit_rate = {
        p: simulate(decode.trace, decode.capacity, p, popularity=popularity, **start).hit_rate for p in POLICIES
    }
    layers = len(decode.trace.layers)
    # lag 0 knows the whole next token: the lfu+next column above, replayed once
    lagged = {
        lag: hit_rate["lfu+next"]
        if lag == 0
        else simulate(decode.trace, decode.capacity, "lfu+next", lookahead=layers - lag, **start).hit_rate
        for lag in next_lags
    }
    summary = LocalitySummary.of(decode.trace)
    return {
        "run": f"{path.parent.name}/{path.name}: {run['arm']} round {run['round']}",
        "tokens": len(decode.trace.tokens),
        "capacity": decode.capacity,
        "distinct": summary.mean("distinct"),
        "reuse": summary.mean("reuse"),
        "ceiling": ceiling(decode.trace, decode.permanent, decode.resident),
        "hit_rate": hit_rate,
        "next_lag_hit_rate": lagged,
        "runtime_hit_rate": decode.runtime_hit_rate,
        "from_runtime_state": decode.policy_state is not None,
    }


def recorded_table(rows: list[dict]) -> str:
    head = (
        "| recorded decode | tokens | rows | "
        + " | ".join(POLICIES)
        + " | unbounded | runtime served | gap to MIN (points) | distinct experts/layer |"
    )
    lines = [head, "|" + "---|" * (len(POLICIES) + 7)]
    for r in rows:
        best = r["hit_rate"]["min"]
        gaps = ["runtime"] + list(POLICIES[:-1])
        rates = r["hit_rate"] | {"runtime": r["runtime_hit_rate"]}
        lines.append(
            f"| {r['run']} | {r['tokens']} | {r['capacity']} | "
            + " | ".join(f"{r['hit_rate'][p]:.3f}" for p in POLICIES)
            + f" | {r['ceiling']:.3f} | {r['runtime_hit_rate']:.3f} | "
            + ", ".join(f"{p} {100 * (best - rates[p]):.1f}" for p in gaps)
            + f" | {r['distinct']:.1f} |"
        )
    return "\n".join(lines)


def lag_table(rows: list[dict]) -> str:
    """``lfu+next`` by how many layers behind it knows the next token."""
    lags = list(rows[0]["next_lag_hit_rate"])
    head = "| recorded decode | runtime served | " + " | ".join(f"lag {lag}" for lag in lags) + " | MIN |"
    lines = [head, "|" + "---|" * (len(lags) + 3)]
    for r in rows:
        best = r["hit_rate"]["min"]
        cells = [f"{rate:.4f} ({100 * (best - rate):.1f})" for rate in r["next_lag_hit_rate"].values()]
        served = r["runtime_hit_rate"]
        lines.append(
            f"| {r['run']} | {served:.4f} ({100 * (best - served):.1f}) | " + " | ".join(cells) + f" | {best:.4f} |"
        )
    return "\n".join(lines)


def table(runs: list[dict], token_counts: list[int]) -> str:
    head = "| tokens | " + " | ".join(POLICIES) + " | unbounded | gap to MIN (points) | distinct experts/layer |"
    rows = [head, "|" + "---|" * (len(POLICIES) + 4)]
    for tokens in token_counts:
        these = [r for r in runs if r["tokens"] == tokens]

        def med(values: list[float]) -> float:
            return statistics.median(values)

        cells = []
        for p in POLICIES:
            values = [r["hit_rate"][p] for r in these]
            cells.append(f"{med(values):.3f} ({min(values):.3f}–{max(values):.3f})")
        best = med([r["hit_rate"]["min"] for r in these])
        gaps = ", ".join(f"{p} {100 * (best - med([r['hit_rate'][p] for r in these])):.1f}" for p in POLICIES[:-1])
        rows.append(
            f"| {tokens} | "
            + " | ".join(cells)
            + f" | {med([r['ceiling'] for r in these]):.3f} | {gaps} | {med([r['distinct'] for r in these]):.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=SHAPE.layers, help="MoE layers sharing the cache")
    p.add_argument("--experts", type=int, default=SHAPE.experts, help="experts per layer (E)")
    p.add_argument("--k", type=int, default=SHAPE.k, help="routed experts per token (K)")
    p.add_argument("--capacity", type=int, default=SHAPE.capacity, help="cache rows shared by all layers")
    p.add_argument(
        "--coverage90", type=float, default=SHAPE.coverage90, help="share of experts covering 90%% of routings"
    )
    p.add_argument("--reuse", type=float, default=SHAPE.reuse, help="adjacent-token reuse to calibrate for")
    p.add_argument("--tokens", default="24,64,256,1024", help="synthetic trace lengths ('' for none)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--bench", type=Path, action="append", default=[], help="an edge0 bench results JSON")
    p.add_argument(
        "--next-lags", default="", help="recorded decodes: lfu+next knowing the next token this many layers behind"
    )
    p.add_argument("--out", type=Path, help="write the results as JSON")
    a = p.parse_args()
    token_counts = [int(t) for t in a.tokens.split(",") if t]
    seeds = [int(s) for s in a.seeds.split(",")]
    try:
        next_lags = [int(lag) for lag in a.next_lags.split(",") if lag]
    except ValueError:
        raise SystemExit(f"--next-lags: give whole numbers separated by commas, not {a.next_lags!r}") from None
    if any(lag < 0 for lag in next_lags):
        raise SystemExit(f"--next-lags: a lag is 0 or more layers, not {a.next_lags!r}")
    if a.capacity < a.k * a.layers:
        raise SystemExit(f"--capacity {a.capacity} is below one token's routed sets ({a.k} x {a.layers} layers)")
    knobs = calibrate(a.experts, a.k, a.coverage90, a.reuse)
    try:
        recorded = [(path, run, decode) for path in a.bench for run, decode in recorded_decodes(path)]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    runs, recorded_rows = [], []
    total = sum(token_counts) * len(seeds) + sum(len(d.trace.tokens) for _, _, d in recorded)
    with bar(total, "replayed tokens", unit="tok") as b:
        for tokens in token_counts:
            for seed in seeds:
                runs.append(replay(a.layers, a.experts, a.k, a.capacity, tokens, seed, knobs))
                b.update(tokens)
        for path, run, decode in recorded:
            recorded_rows.append(replay_recorded(path, run, decode, next_lags))
            b.update(len(decode.trace.tokens))
    if runs:
        print(
            f"\n{a.layers} layers x E={a.experts}, K={a.k}, {a.capacity} rows"
            f" ({a.capacity / (a.layers * a.experts):.1%} of all experts); {knobs};"
            f" medians over seeds {a.seeds} (range)\n"
        )
        print(table(runs, token_counts))
    if recorded_rows:
        print("\nRecorded decodes, each from the cache it began with; popularity: the decode's own shares\n")
        print(recorded_table(recorded_rows))
        if next_lags:
            print("\nLFU sparing the next token's experts it knows, that many layers behind; (gap to MIN, points)\n")
            print(lag_table(recorded_rows))
    if a.out:
        options = {k: v for k, v in vars(a).items() if k != "out"}
        knob_values = {"popularity": knobs.popularity, "keep": knobs.keep}
        out = {"options": options, "knobs": knob_values, "runs": runs, "recorded": recorded_rows}
        a.out.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
