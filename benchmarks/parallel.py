"""Expert parallel and pipeline parallel on one machine: N ranks of
``mlx.launch --backend ring`` on 127.0.0.1 against one process.

Each round runs every N (order rotated per round) in fresh processes; a rank
loads the checkpoint as its share (``parallel``), prefills a fixed prompt and
decodes a fixed token sequence teacher-forced (random-weight checkpoints
loop under greedy decoding), after warm-up steps. Per rank it records decode
tok/s, peak MLX memory and peak RSS, bytes it asked the store for per decoded
token, bytes the kernel fetched from the device for it per token
(``/proc/self/io`` ``read_bytes``: page-cache hits cost none), the distinct
experts it read per MoE layer, and the time of one ``all_sum`` of a decode
step's combine tensor (``[1, 1, K, D]`` in the compute dtype, timed after the
run, median of 50) times the MoE layers: the collective's cost per step.
Medians over rounds (min-max). N above the core count oversubscribes the
CPUs: reported as such. Ranks start with the ring backend's own
configuration (a hostfile of loopback addresses, one per rank); an arm
``N@mlx.launch`` starts them with ``mlx.launch`` instead.

    python benchmarks/parallel.py $DATA/ling-3.0-tiny-int4-embeddings-edge0 --ranks 1,2,4,2@mlx.launch \\
        --rounds 3 --page-cache bypass --out benchmarks/parallel-ling-3.0-tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_edge0.bench.run_spec import device_read_bytes
from mlx_edge0.options import parse_cache_gib

WARMUP = 2
GIB, MB = 1 << 30, 1e6


def rank_main(args: argparse.Namespace) -> None:
    """One rank: load its share, prefill, decode teacher-forced, write JSON."""
    import mlx_edge0
    from mlx_lm.models.cache import make_prompt_cache

    group = mx.distributed.init()
    size = group.size()
    model = mlx_edge0.load_model(
        args.model,
        group=group if size > 1 else None,
        parallel=args.parallel,
        page_cache=args.page_cache,
        cache_gib=args.cache_gib,
    )
    model.limit_buffer_cache()
    section = model.edge0_section
    config = json.loads(Path(args.model, "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens + WARMUP + args.decode_tokens)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens[None, : args.prompt_tokens]), cache=cache))
    step = args.prompt_tokens
    for _ in range(WARMUP):
        mx.eval(model(mx.array(tokens[None, step : step + 1]), cache=cache))
        step += 1
    runtime = model.edge0_runtime
    runtime.telemetry.read_trace = []
    runtime.telemetry.routing_trace = []
    before = runtime.telemetry.summed().bytes_read
    device_before = device_read_bytes()
    t0 = time.perf_counter()
    for _ in range(args.decode_tokens):
        mx.eval(model(mx.array(tokens[None, step : step + 1]), cache=cache))
        step += 1
    seconds = time.perf_counter() - t0
    n = args.decode_tokens
    read, touched = {}, {}
    for layer, ids in runtime.telemetry.read_trace:
        read.setdefault(layer, set()).update(ids)
    for layer, ids in runtime.telemetry.routing_trace:
        touched.setdefault(str(layer), set()).update(ids)
    layers = [i for i in section.moe_layers if i in runtime.store.layers]
    allsum_ms = 0.0
    if size > 1:
        k, d = section.num_experts_per_tok, section.experts.hidden_size
        probe = mx.zeros((1, 1, k, d), runtime.compute_dtype or mx.bfloat16)
        times = []
        for _ in range(50):
            t = time.perf_counter()
            mx.eval(mx.distributed.all_sum(probe, group=group))
            times.append(time.perf_counter() - t)
        allsum_ms = statistics.median(times) * 1e3 * len(layers)
    result = {
        "rank": group.rank(),
        "ranks": size,
        "decode_tok_s": n / seconds,
        "peak_mlx_gib": mx.get_peak_memory() / GIB,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "mb_read_per_token": (runtime.telemetry.summed().bytes_read - before) / n / MB,
        "device_mb_per_token": (device_read_bytes() - device_before) / n / MB,
        "allsum_ms_per_step": allsum_ms,
        "moe_layers": len(layers),
        "experts_read_per_layer": statistics.mean(len(read.get(i, ())) for i in layers) if layers else 0,
        "touched": {layer: sorted(ids) for layer, ids in touched.items()},
        "resident_bytes": model.stats()["resident_bytes"],
        "cache_gib": args.cache_gib,
    }
    Path(args.rank_out, f"rank{group.rank()}.json").write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_ranks(worker: list[str], ranks: int, out: str, timeout: int) -> None:
    """Start ``ranks`` processes of ``worker`` with the ring backend's own
    configuration (``MLX_HOSTFILE``: one loopback address per rank, ``MLX_RANK``),
    as ``mlx.launch`` does locally, but without its output relay, whose
    threads poll in a loop (a child's stdin is always writable) and take most
    of a core of this 2-vCPU machine (the ``@mlx.launch`` arms measure that)."""
    base = free_port()
    hostfile = Path(out, "hosts.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"rank {rank} of {ranks} failed:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def parse_arm(arm: str, default_mode: str) -> tuple[int, str, str]:
    """ "N[:mode][@mlx.launch]" -> (ranks, parallel mode, launcher)."""
    head, _, launcher = arm.partition("@")
    ranks, _, mode = head.partition(":")
    return int(ranks), mode or default_mode, launcher


def run_arm(args: argparse.Namespace, arm: str) -> list[dict]:
    """One arm in fresh processes: its ranks' results."""
    ranks, mode, launcher = parse_arm(arm, args.parallel)
    with tempfile.TemporaryDirectory() as out:
        budget = args.cache_gib if args.group_cache_gib is None else args.group_cache_gib / ranks
        worker = [sys.executable, __file__, "--rank-worker", out, *args.worker_args, f"--parallel={mode}"]
        worker += [f"--cache-gib={budget}"]
        if ranks > 1 and launcher == "mlx.launch":
            command = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1"]
            command += ["-n", str(ranks), "--starting-port", str(free_port()), "--", *worker]
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{arm} failed:\n{done.stderr[-3000:]}")
        elif ranks > 1:
            ring_ranks(worker, ranks, out, args.timeout)
        else:
            subprocess.run(worker, check=True, capture_output=True, timeout=args.timeout)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]


def touched_per_layer(result: list[dict]) -> float:
    """Distinct experts the model routed to per MoE layer over the decoded
    tokens (the union over ranks: each records the experts it computed)."""
    layers: dict[str, set] = {}
    for rank in result:
        for layer, ids in rank["touched"].items():
            layers.setdefault(layer, set()).update(ids)
    return statistics.mean(len(ids) for ids in layers.values()) if layers else 0.0


def med_of(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per N: the median over rounds of each rank's numbers, then the worst rank."""
    rows = []
    one = None
    for arm, rounds in runs.items():

        def med(key: str, pick=max) -> tuple[float, float, float]:
            return med_of([pick(r[key] for r in result) for result in rounds])

        ranks = int(arm.partition("@")[0].partition(":")[0])
        row = {
            "arm": arm,
            "ranks": ranks,
            "oversubscribed": ranks > (os.cpu_count() or 1),
            "decode_tok_s": med("decode_tok_s", min),
            "peak_mlx_gib": med("peak_mlx_gib"),
            "peak_rss_gib": med("peak_rss_gib"),
            "mb_read_per_token": med("mb_read_per_token"),
            "device_mb_per_token": med("device_mb_per_token"),
            "allsum_ms_per_step": med("allsum_ms_per_step"),
            "experts_read_per_layer": med("experts_read_per_layer"),
            "experts_touched_per_layer": med_of([touched_per_layer(result) for result in rounds]),
        }
        one = one or row
        for key in ("decode_tok_s", "peak_mlx_gib", "peak_rss_gib", "mb_read_per_token", "device_mb_per_token"):
            row[f"{key}_vs_1"] = row[key][0] / one[key][0] if one[key][0] else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def cell(v: tuple[float, float, float], digits: int = 3) -> str:
        return f"{v[0]:.{digits}f} ({v[1]:.{digits}f}–{v[2]:.{digits}f})"

    def ratio(v) -> str:
        return "–" if v is None else f"{v:.2f}×"

    lines = [
        "| ranks | decode tok/s (slowest rank) | × 1 | peak MLX GiB / rank | × 1 | peak RSS GiB / rank | × 1 "
        "| MB read / token / rank | × 1 | device MB / token / rank | × 1 | all_sum ms / step "
        "| experts read / layer / rank | experts touched / layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = f"{r['arm']}{' (oversubscribed)' if r['oversubscribed'] else ''}"
        lines.append(
            f"| {n} | {cell(r['decode_tok_s'])} | {ratio(r['decode_tok_s_vs_1'])} | {cell(r['peak_mlx_gib'], 2)} | "
            f"{ratio(r['peak_mlx_gib_vs_1'])} | {cell(r['peak_rss_gib'], 2)} | {ratio(r['peak_rss_gib_vs_1'])} | "
            f"{cell(r['mb_read_per_token'], 1)} | {ratio(r['mb_read_per_token_vs_1'])} | "
            f"{cell(r['device_mb_per_token'], 1)} | {ratio(r['device_mb_per_token_vs_1'])} | "
            f"{cell(r['allsum_ms_per_step'], 1)} | {cell(r['experts_read_per_layer'], 1)} | "
            f"{cell(r['experts_touched_per_layer'], 1)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument(
        "--ranks",
        default="1,2",
        help="Arms: N[:expert|pipeline][@mlx.launch], e.g. 1,2,2:pipeline,4,2@mlx.launch (the first is the x 1).",
    )
    parser.add_argument(
        "--parallel", default="expert", choices=("expert", "pipeline"), help="Mode of arms that name none."
    )
    parser.add_argument("--page-cache", default="keep", choices=("keep", "drop-prefill", "bypass"))
    parser.add_argument(
        "--cache-gib",
        default="auto",
        type=parse_cache_gib,
        help="Hot-cache budget of each process ('auto', or GiB: more than its experts holds every one of them).",
    )
    parser.add_argument(
        "--group-cache-gib",
        type=float,
        help="Hot-cache budget of the whole group instead, divided among its ranks: GiB / N each "
        "(the experts one process would hold, held once across the ranks).",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds one arm may take.")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        args.rank_out = args.rank_worker
        return rank_main(args)
    if args.model is None:
        parser.error("MODEL is required")
    args.worker_args = [
        str(args.model),
        f"--page-cache={args.page_cache}",
        f"--prompt-tokens={args.prompt_tokens}",
        f"--decode-tokens={args.decode_tokens}",
    ]
    from mlx_edge0.progress import bar

    arms = args.ranks.split(",")
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    with bar(args.rounds * len(arms), "parallel bench", unit="run") as progress:
        for round_ in range(args.rounds):
            for n in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
                runs[n].append(run_arm(args, n))
                progress.update(1)
    rows = summarize(runs)
    print(table(rows))
    if args.out:
        args.out.write_text(
            json.dumps(
                {"command": sys.argv, "model": str(args.model.name), "rows": rows, "runs": runs},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
