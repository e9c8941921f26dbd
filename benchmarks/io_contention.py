"""Does reading expert bytes slow MLX's compute? (Linux)

Times a token's worth of routed-expert compute (40 layers x 3 ``gather_qmm`` of
8 experts of 512x2048, int4) alone, and beside 4 threads that read one token's
worth of random cold expert bundles from a checkpoint (320 bundles: 1.69 MiB
each on qwen3.5-35b-a3b), either
buffered ``preadv`` into the destination, ``O_DIRECT`` into an aligned buffer
plus a copy (``direct``: rows that are not page-aligned), or ``O_DIRECT``
straight into a page-aligned destination (``direct-in-place``: edge0's slot
buffer rows). Modes alternate, each round in a fresh page cache; medians
(min-max) of the rounds, kernel CPU of the readers per token.

    python benchmarks/io_contention.py CKPT --rounds 3 --out benchmarks/io-contention-qwen3.5-35b-a3b.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_edge0.bench.run_spec import drop_page_cache
from mlx_edge0.checkpoint import Edge0Section, read_config
from mlx_edge0.bench.summary import stats_of

MODES = ("alone", "buffered", "direct", "direct-in-place")
LOADS_PER_TOKEN = 320
TOKENS = 5


def experts_compute():
    """One token of routed-expert math at the 35B geometry, as a function."""
    gate = mx.quantize(mx.random.normal((64, 512, 2048)), group_size=64, bits=4)
    down = mx.quantize(mx.random.normal((64, 2048, 512)), group_size=64, bits=4)
    mx.eval(gate, down)
    x = mx.random.normal((1, 1, 1, 2048))
    idx = mx.array([[3, 17, 40, 7, 10, 15, 20, 25]], dtype=mx.uint32)

    def qmm(v, w):
        return mx.gather_qmm(v, *w, rhs_indices=idx, transpose=True, group_size=64, bits=4)

    def token() -> None:
        for _ in range(40):
            mx.eval(qmm(qmm(x, gate) * qmm(x, gate), down))

    return token


def readers(mode: str, files: list[Path], bundle: int, seed: int) -> tuple[list[threading.Thread], list[int]]:
    """4 threads reading TOKENS tokens' worth of random bundles."""
    rng = random.Random(seed)
    fds = [os.open(f, os.O_RDONLY | (os.O_DIRECT if mode.startswith("direct") else 0)) for f in files]
    jobs = []
    for _ in range(TOKENS * LOADS_PER_TOKEN):
        i = rng.randrange(len(fds))
        jobs.append((fds[i], rng.randrange(1, os.fstat(fds[i]).st_size // bundle - 1) * bundle))
    lock, done = threading.Lock(), [0]

    def work() -> None:
        dst = np.zeros(bundle, np.uint8)
        aligned = mmap.mmap(-1, bundle)
        while True:
            with lock:
                if not jobs:
                    return
                fd, off = jobs.pop()
            if mode == "direct":
                os.preadv(fd, [aligned], off)
                dst[:] = np.frombuffer(aligned, np.uint8)
            elif mode == "direct-in-place":
                os.preadv(fd, [aligned], off)
            else:
                os.preadv(fd, [memoryview(dst)], off)
            with lock:
                done[0] += bundle

    return [threading.Thread(target=work, daemon=True) for _ in range(4)], done


def measure(mode: str, ckpt: Path, seed: int) -> dict:
    files = sorted((ckpt / "experts").glob("*.safetensors"))
    token = experts_compute()
    token()
    drop_page_cache(files)
    section = Edge0Section.from_config(read_config(ckpt))
    bundle = section.experts.bundle_bytes + section.experts.pad_bytes(section.alignment)  # 4096-aligned
    threads, done = readers(mode, files, bundle, seed) if mode != "alone" else ([], [0])
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for t in threads:
        t.start()
    for _ in range(TOKENS):
        token()
    compute = (time.perf_counter() - t0) / TOKENS
    for t in threads:
        t.join()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "mode": mode,
        "compute_ms_per_token": compute * 1e3,
        "read_mb": done[0] / 1e6,
        "kernel_cpu_ms_per_token": (r1.ru_stime - r0.ru_stime) / TOKENS * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a.checkpoint, a.seed)))
        return
    runs = []
    for rnd in range(a.rounds):
        turn = rnd % len(MODES)
        for mode in MODES[turn:] + MODES[:turn]:
            out = subprocess.run(
                [sys.executable, __file__, str(a.checkpoint), "--child", mode, "--seed", str(rnd)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs.append({**json.loads(out.strip().splitlines()[-1]), "round": rnd})
    print("| reads beside the compute | compute ms/token | reader kernel CPU ms/token |")
    print("|---|---|---|")
    summary = {}
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        summary[mode] = stats_of(rows, ("compute_ms_per_token", "kernel_cpu_ms_per_token"))
        c, k = summary[mode]["compute_ms_per_token"], summary[mode]["kernel_cpu_ms_per_token"]
        print(
            f"| {mode} | {c['median']:.0f} ({c['min']:.0f}–{c['max']:.0f}) "
            f"| {k['median']:.0f} ({k['min']:.0f}–{k['max']:.0f}) |"
        )
    if a.out:
        a.out.write_text(json.dumps({"command": sys.argv, "runs": runs, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
