"""The matmuls behind the router calibration's cost, on whichever BLAS MLX has.

Times, on one projection of a qwen3.5-35b-a3b layer (2,048 -> 12,288) over
``--rows`` tokens: MLX's int4 kernel, MLX's float32 matmul (BLAS) on the
dequantized weight, and numpy's float32 matmul; and the routed experts of one
projection (E=256, 2,048 -> 512, K=8) through ``gather_mm`` on sorted rows
against ``dense_forward.DenseSwitchLinear`` (one dense matmul per expert).
Medians of ``--rounds``. Run it twice to see what the BLAS buys:

    python benchmarks/calibration_matmuls.py --out stock-blas.json
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/calibration_matmuls.py --out openblas.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlx_edge0.bench.dense_forward import DenseSwitchLinear

D, F_ATTN, F_EXPERT, E, K = 2048, 12288, 512, 256, 8


def timed(fn, rounds: int) -> float:
    mx.eval(fn())  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="tokens through the attention projection")
    parser.add_argument("--expert-tokens", type=int, default=512, help="tokens routed to K experts each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    mx.random.seed(0)
    x = mx.random.normal((args.rows, D))
    w = mx.random.normal((F_ATTN, D)) * 0.02
    q, scales, biases = mx.quantize(w, 64, 4)
    dense = mx.dequantize(q, scales, biases, 64, 4)
    xn, dn = np.array(x), np.array(dense).T.copy()
    mx.eval(x, q, scales, biases, dense)
    flop = 2 * args.rows * D * F_ATTN
    rows = []
    for name, fn in (
        ("MLX int4 quantized_matmul", lambda: mx.quantized_matmul(x, q, scales, biases, group_size=64, bits=4)),
        ("MLX float32 matmul", lambda: x @ dense.T),
        ("numpy float32 matmul", lambda: mx.array(xn @ dn)),
    ):
        s = timed(fn, args.rounds)
        rows.append({"what": name, "seconds": s, "gflop_s": flop / s / 1e9})

    experts = QuantizedSwitchLinear(D, F_EXPERT, E, bias=False)
    stand_in = DenseSwitchLinear(experts)
    flat = mx.random.randint(0, E, (args.expert_tokens * K,)).astype(mx.uint32)
    order = mx.argsort(flat)
    xs, idx = mx.random.normal((args.expert_tokens * K, 1, D))[order], flat[order]
    weight = mx.dequantize(experts.weight, experts.scales, experts.biases, 64, 4)
    mx.eval(xs, idx, weight, stand_in.parameters())
    flop = 2 * args.expert_tokens * K * D * F_EXPERT
    for name, fn in (
        (
            "gather_mm, sorted rows (float32)",
            lambda: mx.gather_mm(xs, weight.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True),
        ),
        ("DenseSwitchLinear (dequantize + a matmul per expert)", lambda: stand_in(xs, idx, sorted_indices=True)),
    ):
        s = timed(fn, args.rounds)
        rows.append({"what": name, "seconds": s, "gflop_s": flop / s / 1e9})

    blas = os.environ.get("LD_PRELOAD", "") or "the wheel's own"
    print(f"BLAS: {blas}; {args.rows} rows through {D}->{F_ATTN}; {args.expert_tokens} tokens x K={K} of E={E}")
    print("| what | s (median) | GFLOP/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['seconds']:.3f} | {r['gflop_s']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"blas": blas, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
