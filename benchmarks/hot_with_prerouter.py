"""Does the hot cache serve the prerouted layers? (the default model, fixed tokens)

Decodes a fixed random token sequence (teacher-forced, after an 8-token prompt)
on the embedded default model with a given hot-cache budget, prerouter on and
off, and reports what the cache held and served: hits, misses, staging-slot
fills (kept / copied from the cache / read from disk), expert loads per token
and which MoE layers have rows in the cache at the end. Counts only (no
timing), so it is deterministic and may run beside other work.

    python benchmarks/hot_with_prerouter.py --tokens 200 --out benchmarks/hot-with-prerouter-default.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.default_model import default_checkpoint

KEYS = ("hot_hits", "hot_misses", "staged_kept", "staged_copied", "staged_read", "expert_loads")


def run(tokens: int, **options) -> dict:
    model = mlx_edge0.load_model(default_checkpoint(), **options)
    ids = np.random.default_rng(0).integers(0, 4096, 8 + tokens)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(ids[None, :8]), cache=cache))
    model.reset_stats()
    for i in range(8, 8 + tokens):
        mx.eval(model(mx.array(ids[None, i : i + 1]), cache=cache))
    stats, hot = model.stats(), model.edge0_runtime.hot
    return {k: stats[k] for k in KEYS} | {
        "hot_rows": hot.capacity if hot else 0,
        "layers_in_hot": sorted({layer for layer, _ in hot.row_of}) if hot else [],
        "loads_per_token": stats["expert_loads"] / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--budgets", default="0.0008,0.0016", help="cache_gib values (the model's experts: 1.6 MiB)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for gib in (float(b) for b in args.budgets.split(",")):
        for prerouter in (True, False):
            rows.append(
                {"cache_gib": gib, "prerouter": prerouter, **run(args.tokens, cache_gib=gib, prerouter=prerouter)}
            )
    print("| cache rows | prerouter | hot hits | hot misses | slots kept | slots copied from cache | slots read | "
          "loads/token | MoE layers with rows in the cache |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hot_rows']} | {'on' if r['prerouter'] else 'off'} | {r['hot_hits']} | {r['hot_misses']} | "
              f"{r['staged_kept']} | {r['staged_copied']} | {r['staged_read']} | {r['loads_per_token']:.2f} | "
              f"{r['layers_in_hot']} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
