"""Recipe: the project's default model, from nothing, in one command.

Trains a small stock qwen3_moe from scratch on the Python standard library
(the same as ``edge0 train base WORKDIR --steps 700``), converts the bf16 teacher to an
int4 edge0 checkpoint (``edge0 convert``), writes warm-started prerouter heads
(``edge0 heads init``), then scores both on the held-out stdlib files and
prints a sample. Resumes if interrupted. About 40 minutes on one CPU core.

    python examples/train_tiny_moe.py WORKDIR [--steps N] [--install-default]

``--install-default`` copies the teacher and the edge0 checkpoint into
``mlx_edge0/default/``, the package data ``edge0 generate`` uses without ``--model``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from mlx_lm import generate

import mlx_edge0
from mlx_edge0.conversions import ConvertOptions, convert
from mlx_edge0.default_model import DEFAULT_ROOT, EDGE0_DIR, TEACHER_DIR
from mlx_edge0.prerouter_heads import PrerouterSpec, init_heads, save_heads
from mlx_edge0.train.base import BaseOptions, held_out_perplexity, load_teacher, train_base
from mlx_edge0.train.data import eval_windows, split_corpus, tokenize_documents

PROMPT = "def fibonacci(n):"
STEPS = 700  # the embedded default's training steps (``edge0 train base`` defaults to 400)


def main(workdir: Path, steps: int, install: bool) -> None:
    options = BaseOptions(out_dir=workdir, steps=steps, warmup_steps=min(BaseOptions.warmup_steps, steps))
    report = train_base(options)
    print(
        f"teacher: {report.teacher}, final train loss {report.final_train_loss:.3f}, "
        f"{report.tokens_per_s:.0f} tok/s, {report.training_seconds / 60:.1f} min of training steps"
    )

    edge0_dir = workdir / EDGE0_DIR
    converted = convert(report.teacher, edge0_dir, ConvertOptions(force=True))
    print(
        f"converted: {converted.moe_layers} MoE layers, experts {converted.expert_bytes} bytes, "
        f"resident {converted.resident_bytes} bytes"
    )
    model = mlx_edge0.load_model(edge0_dir, compute_dtype="float32", cache_gib=0, prerouter=False)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    save_heads(edge0_dir, init_heads(model, spec), spec)

    # Score the saved files, not the training weights: bf16 teacher and int4 experts.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(report.teacher / "tokenizer.json"))
    held = tokenize_documents(tokenizer, split_corpus().texts("held_out"))
    windows = eval_windows(held, options.seq_len)
    rows = {}
    began = time.perf_counter()
    rows["fp teacher (bf16 weights)"] = held_out_perplexity(load_teacher(report.teacher), windows)
    rows["int4 edge0, exact routing"] = held_out_perplexity(model, windows)
    print(f"\nheld-out perplexity ({len(windows)} windows of {options.seq_len}, {time.perf_counter() - began:.0f} s)")
    for name, r in rows.items():
        print(f"  {name:28s} {r['perplexity']:8.2f}  (loss {r['loss']:.4f}, {r['tokens']} tokens)")

    served, served_tokenizer = mlx_edge0.load(edge0_dir)
    sample = generate(served, served_tokenizer, prompt=PROMPT, max_tokens=64)
    print(f"\nsample (edge0, greedy):\n{PROMPT}{sample}")
    sizes = {name: _dir_bytes(path) for name, path in (("teacher", report.teacher), ("edge0", edge0_dir))}
    print(f"\nsizes: {json.dumps(sizes)}")
    result = {"base": report.as_dict(), "held_out": rows, "sizes_bytes": sizes, "sample": sample}
    (workdir / "quality.json").write_text(json.dumps(result, indent=2) + "\n")

    if install:
        for name, path in ((TEACHER_DIR, report.teacher), (EDGE0_DIR, edge0_dir)):
            shutil.rmtree(DEFAULT_ROOT / name, ignore_errors=True)
            shutil.copytree(path, DEFAULT_ROOT / name)
        print(f"installed into {DEFAULT_ROOT}")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--install-default", action="store_true")
    args = parser.parse_args()
    main(args.workdir, args.steps, args.install_default)
