"""Which victims should a prerouted step's misses take? When a prerouted
decode step opens, the hot cache places every planned layer's misses in
layer order, each plan pinned until its layer computes
(``HotCache.start_planned``). A victim chosen for layer i's misses may be an
expert that layer j > i routes in this same step, whose plan is not made yet:
it is read twice. A bundle of a layer that has routed in this step, to other
experts, cannot be wanted again before the next step: the cache now takes
such settled bundles first among the lowest ranked
(``mlx_edge0.cache_policy.plan_fill``, ``SETTLED_SPAN``).

This replays recorded decodes (``edge0 bench`` results JSON, ``--bench``)
from the cache each began with. LFU is told of the checkpoint's routing
profile as the runtime is (``--profile CHECKPOINT``) or, where the record
kept it, starts from what the runtime's LFU had learned by then
(``policy_at_start``: the prompt's and warm-up's uses too; ``--profile`` is
then not needed). Three ways: call by call with no
preference (the replay the bench made before it modelled the step's order),
in the runtime's order with no preference (the runtime before the change),
and in the runtime's order with settled victims first at each span
(``--spans``; 0: every settled bundle first), beside Belady's MIN and what the
runtime served. A record made before the bench kept its planned layers
replays a prerouter arm without a window as planning every layer but the
first (wrong for a run whose plans did not fit its cache, which staged them
instead). Prints a table and writes JSON:

    python benchmarks/settled_victims.py --bench RESULTS.json [--bench ...] [--profile CHECKPOINT]
        [--spans 4,8,16,32,0] [--out FILE.json]
"""

from __future__ import annotations

import json

from mlx_edge0.bench.eviction import RecordedDecode, simulate
from mlx_edge0.bench.replay_args import comma_list, read_replay_inputs, replay_parser
from mlx_edge0.popularity import prior_counts

EVERY_SETTLED = 1 << 30  # a span that covers the whole cache: every settled bundle first


def planned_layers(run: dict, decode: RecordedDecode) -> frozenset:
    """The layers the run placed when each step opened: the record's, or for
    an older record of a prerouter arm without a window, all but the first."""
    if decode.planned or "prerouter" not in run["arm"] or "window" in run["arm"]:
        return decode.planned
    return frozenset(decode.trace.layers[1:])


def hit_rate(decode: RecordedDecode, prior, **order) -> float:
    """LFU's hit rate from the decode's start, in the order ``order`` gives
    (``simulate``'s ``planned``, ``prefer_settled``, ``settled_span``): from
    the runtime policy's state where the record kept it, else from ``prior``."""
    return simulate(decode.trace, decode.capacity, "lfu", prior=prior, **(decode.runtime_start() | order)).hit_rate


def parse_spans(text: str) -> list[int]:
    """``--spans``: comma-separated whole numbers >= 1, or 0 (every settled bundle first)."""
    rule = "whole numbers >= 0 separated by commas (0: no limit)"
    return comma_list(text, "--spans", int, lambda spans: all(s >= 0 for s in spans), rule)


def main() -> None:
    p = replay_parser(__doc__)
    p.add_argument("--spans", default="4,8,16,32,0", help="spans to replay (0: every settled bundle first)")
    a = p.parse_args()
    spans = parse_spans(a.spans)
    profile, recorded = read_replay_inputs(a)
    rows = []
    print(
        "| decode | tokens | runtime | call by call | step order | "
        + " | ".join(f"span {s}" for s in spans)
        + " | MIN |"
    )
    print("|---|---|---|---|---|" + "---|" * (len(spans) + 1))
    for path, decodes in recorded:
        for run, decode in decodes:
            planned = planned_layers(run, decode)
            k_of = dict(zip(decode.trace.layers, decode.trace.routed_k()))
            prior = prior_counts(profile, k_of) if profile is not None else None
            row = {
                "decode": f"{path.parent.name}/{path.name}: {run['arm']} round {run['round']}",
                "tokens": len(decode.trace.tokens),
                "capacity": decode.capacity,
                "planned_layers": sorted(planned),
                "profile": profile.source if profile is not None else None,
                "from_runtime_state": decode.policy_state is not None,
                "runtime_hit_rate": decode.runtime_hit_rate,
                "call_by_call": hit_rate(decode, prior, planned=frozenset(), prefer_settled=False),
                "step_order": hit_rate(decode, prior, planned=planned, prefer_settled=False),
                "settled_first": {
                    str(s): hit_rate(decode, prior, planned=planned, settled_span=s or EVERY_SETTLED) for s in spans
                },
                "min": simulate(decode.trace, decode.capacity, "min", **decode.start()).hit_rate,
            }
            rows.append(row)
            cells = " | ".join(f"{r:.3f}" for r in row["settled_first"].values())
            print(
                f"| {row['decode']} | {row['tokens']} | {row['runtime_hit_rate']:.3f} | {row['call_by_call']:.3f} | "
                f"{row['step_order']:.3f} | {cells} | {row['min']:.3f} |"
            )
    print("(cells: LFU's hit rate from the decode's start; span: settled victims first among span x misses lowest)")
    if a.out:
        a.out.write_text(json.dumps({"spans": spans, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
