"""How much should a routing profile weigh in the hot cache's LFU? Replays
recorded decodes (``edge0 bench`` results JSON, ``--bench``) from the cache
each began with, LFU told of a profile's routings before the first call
(``mlx_edge0.popularity.prior_counts`` at several weights, in tokens' worth),
beside plain LFU and Belady's MIN at the same rows.

The profile is either a checkpoint's ``popularity.safetensors`` (``--profile
CHECKPOINT``, written by ``edge0 profile``) or the routing of decoded tokens
``A:B`` of a recorded decode (``--profile-from RESULTS.json --profile-tokens
A:B``), which must not be the tokens replayed (``--first N`` replays a
decode's first N tokens only). ``--preload`` also replays each decode from
a cache that holds the profile's most popular bundles instead of what the
decode began with (a cache filled from the profile at load, before any
prompt), LFU at the runtime's weight and MIN from that start. Prints a table
and writes JSON:

    python benchmarks/popularity_prior.py --bench RESULTS.json [--first 128]
        (--profile CHECKPOINT | --profile-from RESULTS.json --profile-tokens 512:1024)
        [--weights 0,32,64,128,256,512] [--preload] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from mlx_edge0.bench.eviction import recorded_decodes, simulate
from mlx_edge0.checkpoint import CheckpointError
from mlx_edge0.popularity import PRIOR_TOKENS, RoutingProfile, prior_counts, require_profile


def profile_from_trace(path: Path, first: int, end: int) -> RoutingProfile:
    """The routing counts of decoded tokens ``[first, end)`` of the first recorded run of ``path``."""
    trace = recorded_decodes(path)[0][1].trace
    if not 0 <= first < end <= len(trace.tokens):
        raise SystemExit(f"{path}: tokens {first}:{end} are not within its {len(trace.tokens)} decoded tokens")
    counts = np.zeros((len(trace.layers), trace.num_experts), np.float32)
    for token in trace.tokens[first:end]:
        for row, ids in enumerate(token):
            counts[row, list(ids)] += 1
    source = f"{path.name} tokens {first}:{end}"
    return RoutingProfile(tuple(trace.layers), counts, end - first, trace.routed_k(), source)


def most_popular(prior: dict, capacity: int, permanent: frozenset) -> list:
    """The ``capacity`` bundles (less the permanent ones) a preload from the
    profile would hold, least popular first (the order ``simulate`` fills
    rows in; ties by key, so the replay is deterministic)."""
    ranked = sorted((k for k in prior if k not in permanent), key=lambda k: (-prior[k], k))
    return ranked[: capacity - len(permanent)][::-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", type=Path, action="append", required=True, help="an edge0 bench results JSON")
    p.add_argument("--first", type=int, default=0, help="replay only each decode's first N tokens (0: all)")
    p.add_argument("--profile", type=Path, help="a checkpoint with popularity.safetensors")
    p.add_argument("--profile-from", type=Path, help="a results JSON whose decode routing is the profile")
    p.add_argument("--profile-tokens", default="", help="A:B, the decoded tokens of --profile-from counted")
    p.add_argument("--weights", default=f"0,32,64,{PRIOR_TOKENS},256,512", help="prior weights, in tokens")
    p.add_argument("--preload", action="store_true", help="also replay from the profile's most popular bundles")
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    a = p.parse_args()
    if (a.profile is None) == (a.profile_from is None):
        raise SystemExit("give one of --profile CHECKPOINT or --profile-from RESULTS.json --profile-tokens A:B")
    if a.profile is not None:
        try:
            profile = require_profile(a.profile)
        except CheckpointError as e:
            raise SystemExit(str(e)) from None
    else:
        first, _, end = a.profile_tokens.partition(":")
        profile = profile_from_trace(a.profile_from, int(first), int(end))
    weights = [int(w) for w in a.weights.split(",")]
    rows = []
    for path in a.bench:
        for run, decode in recorded_decodes(path):
            trace = decode.trace
            if a.first:
                trace = dataclasses.replace(trace, tokens=trace.tokens[: a.first])
            start = decode.start()
            k_of = dict(zip(trace.layers, trace.routed_k()))
            best = simulate(trace, decode.capacity, "min", **start).hit_rate
            lfu = {
                w: simulate(
                    trace, decode.capacity, "lfu", prior=prior_counts(profile, k_of, tokens=w), **start
                ).hit_rate
                for w in weights
            }
            preload = None
            if a.preload:
                prior = prior_counts(profile, k_of)
                start = decode.start() | {"resident": most_popular(prior, decode.capacity, decode.permanent)}
                preload = {
                    "lfu": simulate(trace, decode.capacity, "lfu", prior=prior, **start).hit_rate,
                    "min": simulate(trace, decode.capacity, "min", **start).hit_rate,
                }
            rows.append(
                {
                    "trace": f"{path.name}: {run['arm']} round {run['round']}",
                    "tokens": len(trace.tokens),
                    "capacity": decode.capacity,
                    "profile": profile.source,
                    "profile_tokens": profile.tokens,
                    "min": best,
                    "lfu_with_prior": {str(w): r for w, r in lfu.items()},
                    "runtime_hit_rate": decode.runtime_hit_rate if not a.first else None,
                    "from_preload": preload,
                }
            )
            cells = " | ".join(f"{lfu[w]:.3f} ({100 * (best - lfu[w]):.1f})" for w in weights)
            if preload:
                gap = 100 * (preload["min"] - preload["lfu"])
                cells += f" | {preload['lfu']:.3f} ({gap:.1f}) | {preload['min']:.3f}"
            print(f"| {rows[-1]['trace']} | {len(trace.tokens)} | {cells} | {best:.3f} |")
    preloaded = f"; from a preload: LFU at {PRIOR_TOKENS} (gap), MIN" if a.preload else ""
    print(
        f"(columns: LFU told of the profile at {', '.join(map(str, weights))} tokens' worth (gap to MIN, points)"
        f"{preloaded}; MIN from the decode's start)"
    )
    if a.out:
        a.out.write_text(json.dumps({"weights": weights, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
