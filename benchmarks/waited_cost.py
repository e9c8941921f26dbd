"""How much more should a use of a waited-for bundle count in the hot cache's
LFU? With the prerouter, a prerouted layer's misses are read behind the
compute, but the first MoE layer (no head predicts it) is read when it routes,
and the compute waits. ``mlx_edge0.cache_policy.WAITED_MISS_COST`` weighs that
layer's uses; this replays recorded prerouter decodes (``edge0 bench`` results
JSON, ``--bench``) from the cache each began with, LFU told of the
checkpoint's routing profile as the runtime is (``--profile CHECKPOINT``, for
decodes of a profiled checkpoint), at several costs (``inf``: the layer never
a victim, as a permanent layer), beside Belady's MIN.

The waited bundles are the record's own (``waited_keys``); a record made
before the runtime weighed them has none, and then its first MoE layer's
bundles are taken, for an arm that runs the prerouter. Per cost it prints the
hit rate, the waited layer's misses per token (each one a wait) and all
misses per token (each one a read). Prints a table and writes JSON:

    python benchmarks/waited_cost.py --bench RESULTS.json [--bench ...] [--profile CHECKPOINT]
        [--costs 1,1.5,2,4,inf] [--out FILE.json]
"""

from __future__ import annotations

import json
import math
from typing import Optional

from mlx_edge0.bench.eviction import RecordedDecode, simulate
from mlx_edge0.bench.replay_args import comma_list, read_replay_inputs, replay_parser
from mlx_edge0.popularity import prior_counts


def waited_keys(run: dict, decode: RecordedDecode) -> frozenset:
    """The bundles whose misses the run waited for: the record's, or for an
    older prerouter record, its first MoE layer's (none for other arms)."""
    if decode.waited or decode.permanent or "prerouter" not in run["arm"]:
        return decode.waited
    first = decode.trace.layers[0]
    return frozenset((first, e) for e in range(decode.trace.num_experts))


def replay(decode: RecordedDecode, waited: frozenset, cost: float, prior) -> Optional[dict]:
    """LFU at one waited cost; ``inf``: the waited bundles permanent instead
    (None where they leave fewer rows than a routed set)."""
    start = decode.start() | {"waited": waited}
    if math.isinf(cost):  # resident from the start and never a victim: nothing left to weigh
        start |= {"permanent": decode.permanent | waited, "waited": frozenset()}
    try:
        r = simulate(decode.trace, decode.capacity, "lfu", prior=prior, waited_cost=cost, **start)
    except ValueError:
        return None
    tokens = len(decode.trace.tokens)
    return {
        "hit_rate": r.hit_rate,
        "waited_misses_per_token": r.waited_misses / tokens,
        "misses_per_token": r.misses / tokens,
    }


def parse_costs(text: str) -> list[float]:
    """``--costs``: comma-separated positive numbers, ``inf`` allowed."""
    rule = "positive numbers separated by commas (inf: permanent)"
    return comma_list(text, "--costs", float, lambda costs: all(c > 0 for c in costs), rule)


def main() -> None:
    p = replay_parser(__doc__)
    p.add_argument("--costs", default="1,1.5,2,4,inf", help="waited costs to replay (inf: permanent)")
    a = p.parse_args()
    costs = parse_costs(a.costs)
    profile, recorded = read_replay_inputs(a)
    rows = []
    print("| decode | tokens | " + " | ".join(f"cost {c:g}" for c in costs) + " | MIN |")
    print("|---|---|" + "---|" * (len(costs) + 1))
    for path, decodes in recorded:
        for run, decode in decodes:
            waited = waited_keys(run, decode)
            if not waited:
                continue
            k_of = dict(zip(decode.trace.layers, decode.trace.routed_k()))
            prior = prior_counts(profile, k_of) if profile is not None else None
            by_cost = {f"{c:g}": replay(decode, waited, c, prior) for c in costs}
            best = simulate(decode.trace, decode.capacity, "min", **decode.start()).hit_rate
            rows.append(
                {
                    "decode": f"{path.parent.name}/{path.name}: {run['arm']} round {run['round']}",
                    "tokens": len(decode.trace.tokens),
                    "capacity": decode.capacity,
                    "waited_bundles": len(waited),
                    "profile": profile.source if profile is not None else None,
                    "lfu": by_cost,
                    "min": best,
                    "runtime_hit_rate": decode.runtime_hit_rate,
                }
            )
            cells = " | ".join(
                f"{r['hit_rate']:.3f}, {r['waited_misses_per_token']:.2f} / {r['misses_per_token']:.1f}" if r else "–"
                for r in by_cost.values()
            )
            print(f"| {rows[-1]['decode']} | {rows[-1]['tokens']} | {cells} | {best:.3f} |")
    print("(cells: LFU's hit rate, the waited layer's misses per token / all misses per token)")
    if a.out:
        a.out.write_text(json.dumps({"costs": [f"{c:g}" for c in costs], "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
