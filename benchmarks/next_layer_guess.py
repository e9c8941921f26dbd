"""How well the lookahead's guess names the next layer's experts.

The hot path's lookahead (``lookahead``, prompt chunks) guesses MoE layer N+1's
routing by running layer N+1's own router and routing math on layer N's input
(:class:`mlx_edge0.paths.NextLayerRouting`). This runs one forward of seeded
random token ids through an edge0 checkpoint (prerouter off, every layer
routed by its gate, whole layers read), records each MoE block's input, and
compares, token by token, the guess made from layer N's input with the
routing layer N+1 made from its own:

    python benchmarks/next_layer_guess.py $DATA/ling-edge0 --tokens 64 \\
        --out benchmarks/results/next-layer-guess-ling-3.0-tiny.json

Prints each layer's share of its routed experts the guess named, and the
guess's precision by its rank (the guessed score's order): how often the
guess's r-th surest expert was routed. Teacher-forced ids, not text: on
random weights the figures are the synthetic checkpoint's, not a trained
model's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlx_edge0
from mlx_edge0.streaming import StreamingMoE


class InputRecorder(nn.Module):
    """A streaming block that keeps its last input (the block computes as before)."""

    def __init__(self, block: StreamingMoE):
        super().__init__()
        self.block = block
        self.seen = None

    def __call__(self, x: mx.array) -> mx.array:
        self.seen = x
        return self.block(x)


def guess_overlap(path: Path, tokens: int, seed: int) -> dict:
    model = mlx_edge0.load_model(path, prerouter=False, cache_gib=0, prefill="whole-layer")
    recorders = {}
    for layer in model.layers:
        if isinstance(layer.mlp, StreamingMoE):
            recorders[layer.mlp.layer] = layer.mlp = InputRecorder(layer.mlp)
    ids = np.random.default_rng(seed).integers(0, 50_000, tokens)
    mx.eval(model(mx.array(ids)[None]))
    layers = sorted(recorders)
    per_layer, by_rank = {}, []
    for here, following in zip(layers, layers[1:]):
        block = recorders[following].block
        guessed, scores = block.route(block.router_logits(recorders[here].seen))
        routed, _ = block.route(block.router_logits(recorders[following].seen))
        guessed, scores, routed = np.array(guessed)[0], np.array(scores)[0], np.array(routed)[0]
        named = [len(set(g) & set(r)) / len(r) for g, r in zip(guessed, routed)]
        per_layer[following] = float(np.mean(named))
        for g, s, r in zip(guessed, scores, routed):
            by_rank.append([g[i] in set(r) for i in np.argsort(-s, kind="stable")])
    return {
        "checkpoint": str(path),
        "tokens": tokens,
        "seed": seed,
        "named_per_layer": per_layer,
        "named_mean": float(np.mean(list(per_layer.values()))),
        "precision_by_rank": np.mean(np.array(by_rank, dtype=float), axis=0).tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="An edge0 checkpoint.")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="Write the figures here as JSON.")
    a = ap.parse_args()
    result = guess_overlap(a.checkpoint, a.tokens, a.seed)
    print(f"{a.checkpoint}: {a.tokens} tokens, the guess named {result['named_mean']:.3f} of the routed experts")
    print("| layer | " + " | ".join(str(k) for k in result["named_per_layer"]) + " |")
    print("|---|" + "---|" * len(result["named_per_layer"]))
    print("| named | " + " | ".join(f"{v:.2f}" for v in result["named_per_layer"].values()) + " |")
    print("precision by the guess's rank: " + ", ".join(f"{p:.3f}" for p in result["precision_by_rank"]))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"Results: {a.out}")


if __name__ == "__main__":
    main()
