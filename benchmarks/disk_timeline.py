"""When is the disk idle during a decode? One edge0 arm measured as the bench
measures it (``measure.measure``: cold page cache, seeded prompt, warm-up,
teacher-forced steps built as ``generate_step`` builds them), in its own
memory-capped, read-throttled cgroup (the bench's ``ArmCgroup``), with the
start and end of every expert read taken on the I/O threads, the time every
forward opens (``Telemetry.begin_step``, at its first MoE layer, in every
arm) and how long a prerouter arm's ``Prerouting.begin_forward`` took.

Prints, per forward (0 is the prompt, then the warm-up steps, then the
decoded ones and the one the bench queues after the last), its length, the
share of it the disk was busy (the union of the reads in flight) and its
idle gaps longer than 20 ms, and the busy share
over the decoded steps, and how long the disk idled at each decoded
forward's start (to its first read) and end (after its last read: the last
MoE layer's compute, the lm_head, the next token's first layers); writes
every interval as JSON. The read bound of the issue-19 target assumes a disk
that never idles: this shows where it does.

    python benchmarks/disk_timeline.py EDGE0 --arm edge0-prerouter+bypass \\
        --memory-cap 12 --read-mbps 144 --out timeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlx_edge0.bench.run_spec import WARMUP_STEPS

GAP_S = 0.02


def child(a: argparse.Namespace) -> None:
    """Measure the arm with reads and forward opens timed; write the JSON."""
    import mlx_edge0.store as store
    from mlx_edge0.bench.measure import measure
    from mlx_edge0.bench.run_spec import RunSpec
    from mlx_edge0.prerouting import Prerouting
    from mlx_edge0.telemetry import Telemetry

    t0 = time.perf_counter()
    reads: list[tuple[float, float, int]] = []
    opens: list[tuple[float, float]] = []
    forwards: list[float] = []
    lock = threading.Lock()
    read_run, begin_forward, begin_step = store.read_run, Prerouting.begin_forward, Telemetry.begin_step

    def timed_read(*args, **kwargs) -> int:
        start = time.perf_counter() - t0
        n = read_run(*args, **kwargs)
        with lock:
            reads.append((start, time.perf_counter() - t0, n))
        return n

    def timed_open(self, *args, **kwargs) -> None:
        start = time.perf_counter() - t0
        begin_forward(self, *args, **kwargs)
        opens.append((start, time.perf_counter() - t0))

    def timed_step(self, *args, **kwargs):
        forwards.append(time.perf_counter() - t0)
        return begin_step(self, *args, **kwargs)

    store.read_run, Prerouting.begin_forward, Telemetry.begin_step = timed_read, timed_open, timed_step
    spec = RunSpec(a.arm, a.checkpoint, a.prompt_tokens, a.decode_tokens, "float32", 0)
    record = measure(spec)
    record.update(reads=sorted(reads), opens=opens, forwards=forwards)
    a.out.write_text(json.dumps(record))


def busy(reads: list, start: float, end: float) -> tuple[float, list[tuple[float, float]]]:
    """Seconds some read was in flight within [start, end), and the gaps longer than GAP_S."""
    total, gaps, edge = 0.0, [], start
    for s, e, _ in reads:
        s, e = max(s, start), min(e, end)
        if e <= s or e <= edge:
            continue
        if s > edge + GAP_S:
            gaps.append((edge - start, s - edge))
        total += e - max(s, edge)
        edge = e
    if end > edge + GAP_S:
        gaps.append((edge - start, end - edge))
    return total, gaps


def report(record: dict) -> None:
    reads, opens = record["reads"], record["opens"]
    starts = record.get("forwards") or [s for s, _ in opens]  # records before "forwards": prerouter arms only
    print(f"{record['arm']}: {record['decode_tok_s']:.3f} tok/s, {record['device_bytes_per_token'] / 1e6:.1f} MB/token")
    if len(starts) < 2:
        print("(no forwards timed)")
        return
    print("| forward | s | disk busy | idle gaps (at s into the forward: s idle) | open s |")
    print("|---|---|---|---|---|")
    for i, (start, end) in enumerate(zip(starts, starts[1:])):
        total, gaps = busy(reads, start, end)
        shown = ", ".join(f"{at:.2f}: {g:.2f}" for at, g in gaps[:4]) + (" …" if len(gaps) > 4 else "")
        took = f"{opens[i][1] - opens[i][0]:.3f}" if len(opens) == len(starts) else "–"
        print(f"| {i} | {end - start:.2f} | {total / (end - start):.2f} | {shown} | {took} |")
    decoded = starts[1 + WARMUP_STEPS :]
    if len(decoded) > 1:
        total, _ = busy(reads, decoded[0], decoded[-1])
        print(f"disk busy over the decoded steps' forwards: {total / (decoded[-1] - decoded[0]):.2f}")
        leads, tails = [], []
        for start, end in zip(decoded, decoded[1:]):
            inside = [(s, e) for s, e, _ in reads if start <= s < end]
            if inside:
                leads.append(inside[0][0] - start)
                tails.append(max(0.0, end - max(e for _, e in inside)))
        if leads:
            print(
                f"idle at a decoded forward's start / after its last read, median: "
                f"{statistics.median(leads):.3f} / {statistics.median(tails):.3f} s "
                f"(of {statistics.median(b - a for a, b in zip(decoded, decoded[1:])):.3f} s a forward)"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--arm", default="edge0-prerouter+bypass")
    p.add_argument("--memory-cap", type=float, help="GiB (page cache included)")
    p.add_argument("--read-mbps", type=float)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    from mlx_edge0.bench.run_spec import checkpoint_files, drop_page_cache
    from mlx_edge0.bench.regime import ArmCgroup, Regime, block_device, own_cgroups, regime_unavailable

    regime = Regime(a.memory_cap, a.read_mbps)
    problem = regime_unavailable(regime, a.checkpoint)
    if problem:
        sys.exit(problem)
    drop_page_cache(checkpoint_files(a.checkpoint), sync=True)
    with ArmCgroup(regime, own_cgroups(), block_device(a.checkpoint), f"edge0-timeline-{a.out.stem}") as cgroup:
        subprocess.run([sys.executable, *sys.argv, "--child"], preexec_fn=cgroup.join, check=True)
    report(json.loads(a.out.read_text()))


if __name__ == "__main__":
    main()
