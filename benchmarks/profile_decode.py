"""Where a decode step's time goes: cProfile over greedy decode steps of an
edge0 checkpoint (the per-layer host sync shows up as ``numpy.array``: it is
the MLX compute of everything up to that layer's router).

    python benchmarks/profile_decode.py CKPT [--tokens 8] [--cache-gib G] [--staged]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.checkpoint import read_config, text_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--cache-gib", type=float, default=0.0)
    p.add_argument("--staged", action="store_true")
    a = p.parse_args()
    model = mlx_edge0.load_model(a.checkpoint, cache_gib=a.cache_gib, staged=a.staged)
    vocab = text_config(read_config(a.checkpoint))["vocab_size"]
    cache = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, a.prompt_tokens), mx.int32)

    def step(tokens: mx.array) -> mx.array:
        y = mx.argmax(model(tokens, cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        return y[:, None]

    y = step(prompt[None])
    for _ in range(2):
        y = step(y)
    model.reset_stats()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(a.tokens):
        y = step(y)
    profile.disable()
    per_token = (time.perf_counter() - start) / a.tokens
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print(f"s/token {per_token:.3f}")
    print(
        "counters per token:",
        {
            k: round(v / a.tokens, 2)
            for k, v in model.stats().items()
            if isinstance(v, (int, float)) and k != "peak_memory"
        },
    )
    print(out.getvalue())


if __name__ == "__main__":
    main()
