"""LRU vs frequency (LFU with aging) hit rates on a real routing trace.

Decodes greedy tokens on the exact path while recording every MoE layer's
routed set, then replays the trace through both hot-cache policies at several
budgets with the same planner the cache uses (``mlx_edge0.cache_policy.plan_fill``, through
``mlx_edge0.bench.eviction.simulate``).

    python benchmarks/hot_policy.py CKPT [--tokens 64] [--budgets 0.25,0.5,1,2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.checkpoint import read_config, text_config
from mlx_edge0.bench.eviction import simulate
from mlx_edge0.bench.locality import RoutingTrace
from mlx_edge0.slots import SlotBuffers


def record_trace(path: Path, tokens: int, prompt_tokens: int) -> tuple[RoutingTrace, int, int]:
    model = mlx_edge0.load_model(path, cache_gib=0, staged=False, prefill="exact")
    rt = model.edge0_runtime
    vocab = text_config(read_config(path))["vocab_size"]
    cache = make_prompt_cache(model)
    y = mx.array(np.random.default_rng(0).integers(0, vocab, prompt_tokens), mx.int32)[None]
    y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
    rt.telemetry.routing_trace = trace = []  # decode steps only
    for _ in range(tokens):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(y)
    row = SlotBuffers.row_nbytes(rt.section.experts, mx.float32)
    k = rt.section.num_experts_per_tok
    return RoutingTrace.from_calls(trace, rt.section.experts.num_experts, k, str(path)), row, k


def hit_rate(trace: RoutingTrace, capacity: int, policy_name: str) -> float:
    return simulate(trace, capacity, policy_name).hit_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--budgets", default="0.25,0.5,1,2")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    trace, row, k = record_trace(a.checkpoint, a.tokens, a.prompt_tokens)
    rows = []
    print("| budget GiB | slots | LRU hit rate | LFU hit rate |\n|---|---|---|---|")
    for budget in (float(b) for b in a.budgets.split(",")):
        capacity = int(budget * 2**30) // row
        if capacity < k:
            continue
        r = {
            "budget_gib": budget,
            "slots": capacity,
            "lru": hit_rate(trace, capacity, "lru"),
            "lfu": hit_rate(trace, capacity, "lfu"),
        }
        rows.append(r)
        print(f"| {budget:g} | {capacity} | {r['lru']:.3f} | {r['lfu']:.3f} |")
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "checkpoint": str(a.checkpoint),
                    "tokens": a.tokens,
                    "trace_tokens": len(trace.tokens),
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
