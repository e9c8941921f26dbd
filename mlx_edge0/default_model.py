"""The embedded default model of ``edge0 generate``.

Until the project ships its trained tiny MoE, the default is a small
RANDOM-WEIGHT qwen3_moe model with a locally trained BPE tokenizer, built and
converted on first use into the user's cache dir. Its text is gibberish by
construction; it exists so the whole path (convert, stream, generate) runs
on a fresh machine without downloading anything.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

DEFAULT_NAME = "random-tiny-qwen3_moe-v1"
NOTICE = (
    "edge0: no --model given; using the embedded default, a tiny RANDOM-WEIGHT "
    "qwen3_moe model (its output is meaningless; it only exercises the pipeline)"
)


def cache_dir() -> Path:
    return Path.home() / ".cache" / "mlx-edge0"


def ensure_default_model(log: Callable[[str], None] = print) -> Path:
    """Path of the default edge0 checkpoint, building it on first use."""
    out = cache_dir() / DEFAULT_NAME
    log(NOTICE)
    if (out / "config.json").exists():
        return out
    from .conversions import ConvertOptions, convert
    from .tiny import build_tiny_model, save_mlx, train_tokenizer

    log(f"edge0: building it once into {out} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tok = train_tokenizer(Path(tmp) / "tokenizer")
        model, config = build_tiny_model("qwen3_moe", seed=0)
        src = Path(tmp) / "source"
        save_mlx(model, config, src, tok)
        convert(src, out, ConvertOptions(force=True, show_progress=False))
    return out
