"""The same bench run at several read-ahead windows of the checkpoints' disk, rounds alternated.

A page fault on a memory-mapped file reads the disk's read-ahead window around
the page (``/sys/class/bdi/MAJ:MIN/read_ahead_kb``). llama.cpp's mmap load
reads its weights by such faults, so in a memory cap what it reads from the
disk a token depends on that window; edge0's ``+bypass`` arms read with
``O_DIRECT`` and do not. The Linux kernel's default window is 128 KiB; a
virtual disk may come with another (this project's VMs: 8 MiB). This sets the
window of every disk that holds a checkpoint the bench options name
(``--stock``, its GGUF, ``--edge0``, ``--gguf``) before each run, runs ``edge0
bench run --rounds 1``, and puts each disk's own window back when it ends (on
an error or a stop too). Settings alternate by round (A B, B A, ...), and the
arms rotate by round as the bench's own rounds do:

    python benchmarks/read_ahead_pair.py --read-ahead-kb 128,8192 --rounds 3 --out DIR -- \\
        --stock $DATA/ling-stock --edge0 $DATA/ling-edge0 --arms llamacpp,edge0-prerouter+bypass/k4 \\
        --memory-cap 2.76 --read-mbps 50 --cache cold --prompt-tokens 8 --decode-tokens 8

Needs root; the window is the disk's, for every process on the machine, so run
nothing else beside it. Each run is ``DIR/ra{KB}-r{N}.json``; the table (per
window and arm: decode tok/s, device MB a token, and each arm's tok/s over
llama.cpp's in the same run, by round) is printed and written to
``DIR/summary.json``. Runs already in DIR are kept (each file is resumed by the
bench), so a stopped pair resumes.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mlx_edge0.bench.arms import peer_gguf_path
from mlx_edge0.bench.pair_args import option_value, with_option_value
from mlx_edge0.bench.regime import read_ahead_file
from mlx_edge0.bench.runner import round_order, run_bench_round
from mlx_edge0.progress import bar

PEER = "llamacpp"
CHECKPOINT_OPTIONS = ("--stock", "--edge0", "--gguf")


def parse_windows(text: str) -> list[int]:
    """``--read-ahead-kb``: one or more distinct positive KiB counts (one: the
    bench at that window, the disk's own put back after each run).

    Raises:
        ValueError: names the bad value.
    """
    try:
        windows = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--read-ahead-kb {text!r}: give KiB counts like 128,8192") from None
    if len(set(windows)) != len(windows) or min(windows) <= 0:
        raise ValueError(f"--read-ahead-kb {text!r}: give distinct positive KiB counts")
    return windows


def order(windows: list[int], rounds: int) -> list[tuple[int, int]]:
    """(round, window): the windows in the given order in odd rounds, reversed in even ones."""
    return [(r, w) for r in range(1, rounds + 1) for w in (windows if r % 2 else windows[::-1])]


def rotated_arms(bench_args: list[str], rnd: int) -> list[str]:
    """``bench_args`` with ``--arms`` rotated by ``rnd - 1``: each file is one
    round of the bench, which would run its arms in the same order every time."""
    value = option_value(bench_args, "--arms")
    if value is None:  # the bench's default arms
        return list(bench_args)
    return with_option_value(bench_args, "--arms", ",".join(round_order(value.split(","), rnd - 1)))


def checkpoint_paths(bench_args: list[str]) -> list[Path]:
    """The checkpoints the bench options name that exist, and the GGUF beside ``--stock``."""
    named = {name: Path(value) for name in CHECKPOINT_OPTIONS if (value := option_value(bench_args, name))}
    paths = list(named.values()) + ([peer_gguf_path(named["--stock"])] if "--stock" in named else [])
    return [path for path in paths if path.exists()]


def window_files(paths: list[Path]) -> list[Path]:
    """Each disk's read-ahead file once.

    Raises:
        ValueError: no checkpoint given, or a disk without one (names it).
    """
    if not paths:
        raise ValueError("the bench options name no existing --stock, --edge0 or --gguf")
    files = []
    for path in paths:
        file = read_ahead_file(path)
        if not file.is_file():
            raise ValueError(f"{path}: its disk has no read-ahead setting at {file}")
        if file not in files:
            files.append(file)
    return files


@contextmanager
def read_ahead(files: list[Path], kb: int) -> Iterator[None]:
    """Every file set to ``kb`` KiB; each one's own value written back on exit.

    Raises:
        ValueError: a file that cannot be written (names it; nothing is left changed).
    """
    own = {file: file.read_text().strip() for file in files}
    changed = []
    try:
        for file in files:
            try:
                file.write_text(f"{kb}\n")
                changed.append(file)
            except OSError as e:
                raise ValueError(f"{file}: cannot set the read-ahead window ({e.strerror}; it needs root)") from None
        yield
    finally:
        for file in changed:
            file.write_text(f"{own[file]}\n")


def summarize(runs: dict[tuple[int, int], dict]) -> dict:
    """Per window and arm: decode tok/s and device MB a token (median, min,
    max over the rounds), and the arm's tok/s over the peer's in each round."""
    table: dict = {}
    for (rnd, window), results in sorted(runs.items()):
        records = {r["arm"]: r for r in results["runs"] if r.get("ok")}
        for arm, r in records.items():
            row = table.setdefault(str(window), {}).setdefault(arm, {"tok_s": [], "mb": [], "x_peer": []})
            row["tok_s"].append(r["decode_tok_s"])
            row["mb"].append(r["device_bytes_per_token"] / 1e6)
            if PEER in records and records[PEER]["decode_tok_s"]:
                row["x_peer"].append(r["decode_tok_s"] / records[PEER]["decode_tok_s"])
    for arms in table.values():
        for row in arms.values():
            for name in ("tok_s", "mb", "x_peer"):
                values = row[name]
                row[name] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                             "by_round": values} if values else None  # fmt: skip
    return table


def print_table(table: dict) -> None:
    def cell(v: dict | None, digits: int) -> str:
        return "-" if v is None else f"{v['median']:.{digits}f} ({v['min']:.{digits}f}–{v['max']:.{digits}f})"

    print("| read-ahead | arm | decode tok/s | device MB/token | × llama.cpp (by round) |")
    print("|---|---|---|---|---|")
    for window, arms in table.items():
        for arm, row in arms.items():
            by_round = ", ".join(f"{v:.2f}" for v in row["x_peer"]["by_round"]) if row["x_peer"] else ""
            x_peer = f"{row['x_peer']['median']:.2f} ({by_round})" if row["x_peer"] else "-"
            print(f"| {window} KiB | {arm} | {cell(row['tok_s'], 4)} | {cell(row['mb'], 1)} | {x_peer} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--read-ahead-kb", required=True, help="windows to alternate, KiB: 128,8192 (or one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True, help="directory for the runs and summary.json")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `edge0 bench run` options")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    try:
        windows = parse_windows(a.read_ahead_kb)
        if a.rounds < 1:
            raise ValueError(f"--rounds {a.rounds}: give one or more")
        files = window_files(checkpoint_paths(bench_args))
    except ValueError as e:
        ap.error(str(e))
    a.out.mkdir(parents=True, exist_ok=True)
    kept = a.out / "pair.json"
    if kept.is_file() and json.loads(kept.read_text()).get("bench_args") != bench_args:
        ap.error(f"{kept}: its runs were made with other bench options; give the same, or another --out")
    kept.write_text(json.dumps({"bench_args": bench_args, "read_ahead_kb": windows}, indent=1) + "\n")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop puts the windows back too
    todo = order(windows, a.rounds)  # every one: the bench keeps a file's finished runs
    started = time.perf_counter()
    with bar(len(todo), "read-ahead pair", unit="run") as progress:
        for r, window in todo:
            progress.set_postfix_str(f"round {r}, {window} KiB")
            try:
                with read_ahead(files, window):
                    run_bench_round(rotated_arms(bench_args, r), a.out / f"ra{window}-r{r}.json")
            except ValueError as e:
                raise SystemExit(str(e)) from None
            except KeyboardInterrupt:
                raise SystemExit(f"stopped: each disk's own window put back; {a.out} keeps the runs finished") from None
            progress.update()
    runs = {(r, w): json.loads((a.out / f"ra{w}-r{r}.json").read_text()) for r, w in order(windows, a.rounds)}
    table = summarize(runs)
    (a.out / "summary.json").write_text(json.dumps({"bench_args": bench_args, "table": table}, indent=1) + "\n")
    print_table(table)
    print(f"{len(todo)} bench runs in {time.perf_counter() - started:.0f} s; results: {a.out}")


if __name__ == "__main__":
    main()
