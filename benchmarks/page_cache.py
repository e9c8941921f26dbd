"""Page-cache policy: what a prompt leaves in the OS page cache, and what decode pays.

For each policy (``drop-prefill`` | ``keep``), in a fresh process per run and
alternating: the checkpoint's expert files are dropped from the page cache, a
prompt is prefilled (whole-layer path), the expert files' cached bytes are
measured with ``fincore``, then greedy decode steps are timed.

    python benchmarks/page_cache.py CKPT [--rounds 2] [--prompt-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def cached_bytes(files: list[Path]) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(x) for x in out.split())


def child(path: Path, policy: str, prompt_tokens: int, decode_tokens: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_edge0
    from mlx_edge0.checkpoint import read_config, text_config

    files = sorted((path / "experts").glob("*.safetensors"))
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    model = mlx_edge0.load_model(path, cache_gib=0.5, page_cache=policy)
    vocab = text_config(read_config(path))["vocab_size"]
    cache = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, prompt_tokens), mx.int32)[None]
    y = mx.argmax(model(prompt, cache=cache)[:, -1], -1)[:, None]
    mx.eval(y)
    after_prefill = cached_bytes(files)
    model.reset_stats()
    start = time.perf_counter()
    for _ in range(decode_tokens):
        y = mx.argmax(model(y, cache=cache)[:, -1], -1)[:, None]
        mx.eval(y)
    s_per_token = (time.perf_counter() - start) / decode_tokens
    stats = model.stats()
    return {
        "policy": policy,
        "cached_after_prefill": after_prefill,
        "expert_bytes": sum(f.stat().st_size for f in files),
        "decode_s_per_token": s_per_token,
        "exposed_wait_ms_per_token": stats["exposed_wait_ms"] / decode_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=["drop-prefill", "keep"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.checkpoint, a.child, a.prompt_tokens, a.decode_tokens)))
        return
    runs = []
    for rnd in range(a.rounds):
        for policy in ("drop-prefill", "keep") if rnd % 2 == 0 else ("keep", "drop-prefill"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    str(a.checkpoint),
                    "--child",
                    policy,
                    "--prompt-tokens",
                    str(a.prompt_tokens),
                    "--decode-tokens",
                    str(a.decode_tokens),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs.append(json.loads(out.splitlines()[-1]))
            print(runs[-1], file=sys.stderr)
    print("| policy | expert bytes in page cache after prefill | decode s/token | exposed wait ms/token |")
    print("|---|---|---|---|")
    summary = []
    for policy in ("drop-prefill", "keep"):
        rs = [r for r in runs if r["policy"] == policy]
        row = {
            k: statistics.median(r[k] for r in rs)
            for k in ("cached_after_prefill", "decode_s_per_token", "exposed_wait_ms_per_token")
        }
        row["policy"] = policy
        summary.append(row)
        print(
            f"| {policy} | {row['cached_after_prefill'] / 2**30:.2f} GiB of "
            f"{rs[0]['expert_bytes'] / 2**30:.2f} | {row['decode_s_per_token']:.3f} "
            f"| {row['exposed_wait_ms_per_token']:.1f} |"
        )
    if a.out:
        a.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
