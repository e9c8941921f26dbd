"""What more hot-cache rows would buy a recorded decode: its hit rate and
device bytes a token at the runtime's rows times each factor, under the
runtime's LFU (from what it had learned when the decode began) and Belady's
MIN, each from the cache the decode began with (``mlx_edge0.bench.eviction``).

Where reads bind, bytes a token set the speed, and the rows a memory cap
buys set the bytes. On ling's K=8 prerouter in its ``small-mac`` cap the
rows held scales and biases widened to float32 for the CPU's compute until
3d905f2 (``row_scales``), and the ``auto`` budget leaves part of its
headroom unused (BENCHMARKS.md, "What more rows would buy"): this prices
such levers before one is built. A bundle's bytes are the run's own (bytes read over
bundles read, from its decode counters); where the run was throttled, the
read bound at each row count is the throttle's MB/s over the MB a token.

``--profile CHECKPOINT`` replays LFU told of the checkpoint's routing profile
(``edge0 profile``) at the runtime's weight instead of the state the run
began with, for decodes that ran without one. Prints a table and writes JSON:

    python benchmarks/cache_rows.py --bench RESULTS.json [--bench ...]
        [--factors 1,1.111,1.25,1.5] [--profile CHECKPOINT] [--out FILE.json]
"""

from __future__ import annotations

import json
import statistics
from typing import Optional

from mlx_edge0.bench.eviction import RecordedDecode, simulate
from mlx_edge0.bench.replay_args import comma_list, read_replay_inputs, replay_parser
from mlx_edge0.popularity import RoutingProfile, prior_counts

MB = 1e6


def bundle_bytes(run: dict) -> int:
    """Bytes one bundle read cost the run: its decode's bytes over its bundles read.

    Raises:
        ValueError: the run read no bundle in its decode (names the arm and round).
    """
    counters = run.get("decode_counters", {})
    if not counters.get("expert_loads"):
        raise ValueError(
            f"{run['arm']} round {run['round']}: its decode read no expert, so a bundle's bytes are unknown"
        )
    return round(counters["bytes_read"] / counters["expert_loads"])


def replay_rows(
    decode: RecordedDecode,
    factors: list[float],
    bundle: int,
    profile: Optional[RoutingProfile] = None,
    read_mbps: Optional[float] = None,
) -> list[dict]:
    """LFU and MIN on ``decode`` at its rows times each factor (never more
    rows than the trace's layers hold experts)."""
    trace = decode.trace
    experts = len(trace.layers) * trace.num_experts
    if profile is None:
        lfu_start = decode.runtime_start()
    else:
        k_of = dict(zip(trace.layers, trace.routed_k()))
        lfu_start = decode.start() | {"prior": prior_counts(profile, k_of)}
    rows = []
    for factor in factors:
        capacity = min(experts, round(decode.capacity * factor))
        lfu = simulate(trace, capacity, "lfu", bundle_bytes=bundle, **lfu_start)
        best = simulate(trace, capacity, "min", bundle_bytes=bundle, **decode.start())
        mb = lfu.bytes_per_token / MB
        rows.append(
            {
                "factor": factor,
                "rows": capacity,
                "share_of_experts": capacity / experts,
                "lfu_hit_rate": lfu.hit_rate,
                "min_hit_rate": best.hit_rate,
                "lfu_mb_per_token": mb,
                "min_mb_per_token": best.bytes_per_token / MB,
                "read_bound_tok_s": read_mbps / mb if read_mbps and mb else None,
            }
        )
    return rows


def main() -> None:
    p = replay_parser(__doc__)
    p.add_argument("--factors", default="1,1.111,1.25,1.5", help="multiples of the runtime's rows")
    a = p.parse_args()
    factors = comma_list(a.factors, "--factors", float, lambda fs: min(fs) > 0, "positive multiples of the rows")
    profile, recorded = read_replay_inputs(a)
    decodes = []
    for path, runs in recorded:
        try:
            regime = (json.loads(path.read_text()).get("options") or {}).get("regime") or {}
            found = [(run, decode, bundle_bytes(run)) for run, decode in runs]
        except ValueError as e:
            raise SystemExit(f"{path}: {e}") from None
        for run, decode, bundle in found:
            decodes.append(
                {
                    "run": f"{path.name}: {run['arm']} round {run['round']}",
                    "arm": run["arm"],
                    "tokens": len(decode.trace.tokens),
                    "bundle_bytes": bundle,
                    "runtime_hit_rate": decode.runtime_hit_rate,
                    "runtime_mb_per_token": (run.get("device_bytes_per_token") or float("nan")) / MB,
                    "rows": replay_rows(decode, factors, bundle, profile, regime.get("read_mbps")),
                }
            )
    if not decodes:
        raise SystemExit("no recorded decode with a hot cache in the files given")
    print(
        "| decode | rows (x runtime's) | share of experts | LFU hit rate | MIN | gap (points) "
        "| LFU MB/token | read bound tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in decodes:
        for r in d["rows"]:
            bound = f"{r['read_bound_tok_s']:.3f}" if r["read_bound_tok_s"] else "–"
            print(
                f"| {d['run']} | {r['rows']} ({r['factor']:g}) | {r['share_of_experts']:.0%} | "
                f"{r['lfu_hit_rate']:.3f} | {r['min_hit_rate']:.3f} | "
                f"{100 * (r['min_hit_rate'] - r['lfu_hit_rate']):.1f} | {r['lfu_mb_per_token']:.1f} | {bound} |"
            )
    for arm in dict.fromkeys(d["arm"] for d in decodes):
        mine = [d for d in decodes if d["arm"] == arm]
        medians = [statistics.median(d["rows"][i]["lfu_mb_per_token"] for d in mine) for i in range(len(factors))]
        cells = ", ".join(f"x{f:g} {mb:.1f}" for f, mb in zip(factors, medians))
        print(f"{arm}, LFU MB/token by rows (median of {len(mine)}): {cells}")
    if a.out:
        source = profile.source if profile else "the runtime's state at the decode's start"
        a.out.write_text(json.dumps({"factors": factors, "lfu_from": source, "decodes": decodes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
