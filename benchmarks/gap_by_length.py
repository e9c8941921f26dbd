"""How far the runtime's hot cache is from Belady's MIN as a decode goes on.

A 96-token decode starts cold: LFU knows only what the prompt, the warm-up
steps and a routing profile told it, and MIN knows the whole future. This
replays recorded decodes (``edge0 bench`` results JSON, ``--bench``) over
their first N decoded tokens, for each N of ``--lengths``, from the cache
each began with: the runtime's policy from its state when the decode began
(``policy_at_start``; a record made before the bench kept it starts LFU from
``--profile CHECKPOINT``'s counts, without the prompt's uses), beside MIN on
the same tokens. Over the whole decode the replay from the state is what the
runtime served (printed beside it). Prints a table and writes JSON:

    python benchmarks/gap_by_length.py --bench RESULTS.json [--bench ...] [--profile CHECKPOINT]
        [--lengths 32,96,192,384,512] [--out FILE.json]
"""

from __future__ import annotations

import dataclasses
import json

from mlx_edge0.bench.eviction import RecordedDecode, simulate
from mlx_edge0.bench.replay_args import comma_list, read_replay_inputs, replay_parser
from mlx_edge0.popularity import prior_counts


def parse_lengths(text: str) -> list[int]:
    """``--lengths``: comma-separated whole numbers >= 1, in increasing order."""
    rule = "increasing whole numbers >= 1 separated by commas"
    return comma_list(text, "--lengths", int, lambda ns: ns[0] >= 1 and ns == sorted(set(ns)), rule)


def gap_at(decode: RecordedDecode, tokens: int, prior) -> dict:
    """The runtime's policy and MIN over the decode's first ``tokens`` tokens."""
    trace = dataclasses.replace(decode.trace, tokens=decode.trace.tokens[:tokens])
    start = decode.runtime_start()
    policy = decode.policy_state["policy"] if decode.policy_state else "lfu"
    runtime = simulate(trace, decode.capacity, policy, prior=prior, **start).hit_rate
    best = simulate(trace, decode.capacity, "min", **start).hit_rate
    return {"tokens": tokens, "policy": runtime, "min": best, "gap_points": 100 * (best - runtime)}


def main() -> None:
    p = replay_parser(__doc__)
    p.add_argument("--lengths", default="32,96,192,384,512", help="decoded tokens to replay, increasing")
    a = p.parse_args()
    lengths = parse_lengths(a.lengths)
    profile, recorded = read_replay_inputs(a)
    rows = []
    print("| decode | from the runtime's state | runtime served | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|---|---|" + "---|" * len(lengths))
    for path, decodes in recorded:
        for run, decode in decodes:
            k_of = dict(zip(decode.trace.layers, decode.trace.routed_k()))
            prior = prior_counts(profile, k_of) if profile is not None and decode.policy_state is None else None
            row = {
                "decode": f"{path.parent.name}/{path.name}: {run['arm']} round {run['round']}",
                "capacity": decode.capacity,
                "from_runtime_state": decode.policy_state is not None,
                "profile": profile.source if prior is not None else None,
                "runtime_hit_rate": decode.runtime_hit_rate,
                "lengths": [gap_at(decode, n, prior) for n in lengths if n <= len(decode.trace.tokens)],
            }
            rows.append(row)
            cells = {g["tokens"]: f"{g['policy']:.3f} / {g['min']:.3f} ({g['gap_points']:.1f})" for g in row["lengths"]}
            print(
                f"| {row['decode']} | {'yes' if row['from_runtime_state'] else 'no'} | {row['runtime_hit_rate']:.3f} | "
                + " | ".join(cells.get(n, "-") for n in lengths)
                + " |"
            )
    print("(cells: the runtime's policy / MIN over the decode's first N tokens (gap, points); -: a shorter decode)")
    if a.out:
        a.out.write_text(json.dumps({"lengths": lengths, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
