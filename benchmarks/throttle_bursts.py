"""What the bench's read throttle does to a call's reads: is it a steady disk?

``--read-mbps`` is the kernel's block throttle (v1 ``blkio.throttle.read_bps_device``,
v2 ``io.max rbps``). It meters a cgroup's reads per time slice, not byte by
byte: over a run it gives no more than its rate, but time the cgroup spent
not reading can go to its next reads, at the device's own speed. A disk that
is simply slow loses that time. The difference is the idle an on-demand arm
leaves between its calls' reads (while it computes): the throttle hands part
of it back to the next call, a slow disk never does.

This reads what one decode call of the hot path reads (``--experts`` routed
experts of one layer, on the urgent threads, ``O_DIRECT``), in a cgroup of the
bench's kind (``ArmCgroup``), call after call with ``--gaps`` of idle between
them standing for the compute, at each of ``--read-mbps``; and once unthrottled.
With ``--read-mbps ''`` it sets no throttle and times every gap: for a disk
that is slow of itself (``paced_disk.py``'s view).
Per point: how long a call's reads took (median, 90th percentile, longest)
against what the same bytes take on a disk of that rate, the share of calls
that finished in under half that time, the rate the reads got while reading
(bytes over the time spent reading) and over the whole point (idle included).

    python benchmarks/throttle_bursts.py $DATA/q35cal-edge0 --out throttle-bursts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def child(a: argparse.Namespace) -> None:
    """Time ``--calls`` calls' reads with ``--gap-ms`` between them; print JSON."""
    from mlx_edge0.checkpoint import Edge0Section, read_config
    from mlx_edge0.slots import SlotBuffers
    from mlx_edge0.store import ExpertStore

    section = Edge0Section.from_config(read_config(a.checkpoint))
    store = ExpertStore(a.checkpoint, section, bypass_page_cache=True)
    target = SlotBuffers(section.experts, a.experts)
    rng = np.random.default_rng(a.seed)
    calls = []
    for _ in range(a.calls):
        layer = section.moe_layers[int(rng.integers(len(section.moe_layers)))]
        ids = sorted(rng.choice(section.experts.num_experts, a.experts, replace=False).tolist())
        started = time.perf_counter()
        store.submit(layer, ids, range(a.experts), target, urgent=True).wait()
        calls.append(time.perf_counter() - started)
        time.sleep(a.gap_ms / 1e3)
    nbytes = store.telemetry.current.bytes_read
    store.close()
    print(json.dumps({"call_s": calls, "bytes": nbytes}))


def point(a: argparse.Namespace, mbps: float | None, gap_ms: float) -> dict:
    """One (rate, gap): the child in its own cgroup (none when unthrottled)."""
    from mlx_edge0.bench.regime import ArmCgroup, Regime, block_device, own_cgroups

    argv = [sys.executable, __file__, str(a.checkpoint), "--out", str(a.out), "--child", "--gap-ms", str(gap_ms)]
    argv += ["--experts", str(a.experts), "--calls", str(a.calls), "--seed", str(a.seed)]
    if mbps is None:
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    else:
        name = f"edge0-throttle-{int(mbps)}-{int(gap_ms)}"
        with ArmCgroup(Regime(None, mbps), own_cgroups(), block_device(a.checkpoint), name) as cgroup:
            out = subprocess.run(argv, preexec_fn=cgroup.join, check=True, capture_output=True, text=True).stdout
    record = json.loads(out)
    calls = record["call_s"][a.skip :]  # the first calls spend the budget the fresh cgroup starts with
    per_call = record["bytes"] / len(record["call_s"])
    steady = per_call / (mbps * 1e6) if mbps else None
    return {
        "read_mbps": mbps,
        "gap_ms": gap_ms,
        "call_mb": per_call / 1e6,
        "steady_disk_ms": None if steady is None else steady * 1e3,
        "median_ms": statistics.median(calls) * 1e3,
        "p90_ms": float(np.percentile(calls, 90)) * 1e3,
        "max_ms": max(calls) * 1e3,
        "under_half_steady": None if steady is None else sum(c < steady / 2 for c in calls) / len(calls),
        "reading_mbps": per_call * len(calls) / sum(calls) / 1e6,
        "overall_mbps": per_call * len(calls) / (sum(calls) + len(calls) * gap_ms / 1e3) / 1e6,
        "call_s": record["call_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="an edge0 checkpoint")
    p.add_argument(
        "--read-mbps", default="22,50,144", help="throttle rates, MB/s ('': none, at every gap: a paced_disk.py view)"
    )
    p.add_argument("--gaps", default="0,25,50,100,300", help="idle between calls, ms")
    p.add_argument("--experts", type=int, default=3, help="experts a call reads (one layer)")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--skip", type=int, default=4, help="first calls of a point left out of its numbers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gap-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    from mlx_edge0.bench.regime import Regime, regime_unavailable

    rates = [float(r) for r in a.read_mbps.split(",") if r]
    gaps = [float(g) for g in a.gaps.split(",")]
    problem = regime_unavailable(Regime(None, rates[0]), a.checkpoint) if rates else None
    if problem:
        sys.exit(problem)
    points = [point(a, None, 0.0)] if rates else []
    todo = [(r, g) for r in rates for g in gaps] if rates else [(None, g) for g in gaps]
    started = time.perf_counter()
    for i, (rate, gap) in enumerate(todo):
        points.append(point(a, rate, gap))
        left = (time.perf_counter() - started) / (i + 1) * (len(todo) - i - 1)
        where = "no throttle" if rate is None else f"{rate:g} MB/s"
        print(f"[{i + 1}/{len(todo)}] {where}, {gap:g} ms idle: done, about {left:.0f} s left", file=sys.stderr)
    print(f"\n{a.experts} experts a call, {a.calls - a.skip} calls a point, O_DIRECT, urgent threads\n")
    print(
        "| MB/s | idle between calls (ms) | call MB | a disk of that rate (ms) | median ms | p90 ms | longest ms "
        "| calls under half the disk's time | MB/s while reading | MB/s over the point, idle included |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for q in points:
        rate = "no throttle" if q["read_mbps"] is None else f"{q['read_mbps']:g}"
        steady = "–" if q["steady_disk_ms"] is None else f"{q['steady_disk_ms']:.1f}"
        under = "–" if q["under_half_steady"] is None else f"{q['under_half_steady']:.0%}"
        print(
            f"| {rate} | {q['gap_ms']:g} | {q['call_mb']:.2f} | {steady} | {q['median_ms']:.1f} | {q['p90_ms']:.1f} "
            f"| {q['max_ms']:.1f} | {under} | {q['reading_mbps']:.0f} | {q['overall_mbps']:.1f} |"
        )
    a.out.write_text(json.dumps({"checkpoint": a.checkpoint.name, "experts": a.experts, "points": points}, indent=1))


if __name__ == "__main__":
    main()
