"""Cold and warm reads of K routed experts: mmap page faults vs the store's preadv.

For each trial a layer file is dropped from the page cache (cold) or read once
(warm), then K random experts are copied into stacked buffers by
(a) ``mmap`` slices copied with numpy (page faults), (b) the expert store's
``preadv`` from 1 I/O thread, (c) from 4 I/O threads. Arms alternate per trial.

    python benchmarks/read_methods.py CKPT [--k 8] [--trials 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
from pathlib import Path

import numpy as np

from mlx_edge0.checkpoint import Edge0Section, expert_file, read_config
from mlx_edge0.slots import SlotBuffers
from mlx_edge0.store import ExpertStore


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def read_mmap(store: ExpertStore, layer: int, ids, target: SlotBuffers) -> None:
    lf = store.layers[layer]
    with open(lf.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for row, e in enumerate(ids):
            offset = lf.offsets[e]
            for view, nb in zip(target.row_views(row), lf.part_bytes):
                np.frombuffer(view, np.uint8)[:] = np.frombuffer(m, np.uint8, nb, offset)
                offset += nb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    section = Edge0Section.from_config(read_config(a.checkpoint))
    stores = {n: ExpertStore(a.checkpoint, section, io_threads=n) for n in (1, 4)}
    target = SlotBuffers(section.experts, a.k)  # disk dtype: a pure copy in every arm
    rng = np.random.default_rng(0)
    arms = {
        "mmap": lambda layer, ids: read_mmap(stores[1], layer, ids, target),
        "preadv x1": lambda layer, ids: stores[1].submit(layer, ids, range(len(ids)), target).wait(),
        "preadv x4": lambda layer, ids: stores[4].submit(layer, ids, range(len(ids)), target).wait(),
    }
    times = {(arm, cache): [] for arm in arms for cache in ("cold", "warm")}
    for trial in range(a.trials):
        for i, arm in enumerate(list(arms)[trial % 3 :] + list(arms)[: trial % 3]):
            layer = section.moe_layers[(trial * 3 + i) % len(section.moe_layers)]
            ids = sorted(rng.choice(section.experts.num_experts, a.k, replace=False).tolist())
            path = a.checkpoint / expert_file(layer)
            for cache in ("cold", "warm"):
                _drop(path) if cache == "cold" else _warm(path)
                t = time.perf_counter()
                arms[arm](layer, ids)
                times[(arm, cache)].append((time.perf_counter() - t) * 1e3)
    print(f"| method | cold ms / {a.k} experts | warm ms / {a.k} experts |\n|---|---|---|")
    rows = []
    for arm in arms:
        cold, warm = (statistics.median(times[(arm, c)]) for c in ("cold", "warm"))
        rows.append({"method": arm, "cold_ms": cold, "warm_ms": warm})
        print(f"| {arm} | {cold:.1f} | {warm:.1f} |")
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "k": a.k,
                    "trials": a.trials,
                    "bundle_bytes": section.experts.bundle_bytes,
                    "results": rows,
                    "raw_ms": {f"{k[0]}/{k[1]}": v for k, v in times.items()},
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
