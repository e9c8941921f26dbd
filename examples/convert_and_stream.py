"""End to end in one file: make a small MoE checkpoint, convert it, stream it.

Builds a tiny random-weight Qwen3-MoE with the stock mlx-lm class (and a
tokenizer trained locally), saves it as an int4 mlx-lm checkpoint, converts it
to the edge0 layout, then generates with experts read from disk and prints
what was read. Swap SOURCE for any local mlx-lm / Hugging Face MoE checkpoint.

    python examples/convert_and_stream.py [WORKDIR]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from mlx_lm import generate

import mlx_edge0
from mlx_edge0 import tiny
from mlx_edge0.conversions import ConvertOptions, convert


def main(workdir: Path) -> None:
    source, out = workdir / "source-int4", workdir / "edge0"
    tokenizer_dir = tiny.train_tokenizer(workdir / "tokenizer")
    model, config = tiny.build_tiny_model("qwen3_moe", seed=0)
    tiny.save_mlx(model, config, source, tokenizer_dir, bits=4)

    report = convert(source, out, ConvertOptions(force=True))
    print(f"converted: {report.moe_layers} MoE layers, {report.expert_bytes} expert bytes on disk")

    model, tokenizer = mlx_edge0.load(out, cache_gib=0.001)  # a hot cache of ~70 bundles
    text = generate(model, tokenizer, prompt="def fibonacci(n):", max_tokens=24)
    print(repr(text))  # random weights: the text is meaningless, the path is real
    stats = model.stats()
    print(
        json.dumps(
            {
                k: stats[k]
                for k in ("expert_loads", "bytes_read", "hot_hits", "hot_misses", "exposed_wait_ms", "resident_bytes")
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
