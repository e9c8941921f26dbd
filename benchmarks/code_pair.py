"""edge0 arms at two versions of the code, or of the checkpoint, rounds alternated.

Where a change has no option to turn it off, the before and after of it are
two source trees (``git worktree add $OLD COMMIT``, or a ``git archive`` of
it): this runs ``edge0 bench run --rounds 1`` once per tree per round, in the
order old, new, new, old, ... (each tree put first on ``PYTHONPATH``, so the
bench's child process imports it), and prints the medians side by side:

    python benchmarks/code_pair.py --old $OLD --new $NEW --rounds 3 --out DIR -- \\
        --edge0 $DATA/q35cal-edge0 --arms edge0-hot+bypass/k4 --memory-cap 12 --read-mbps 144 \\
        --cache cold --prompt-tokens 64 --decode-tokens 16

A tree's ``model_patches/`` and ``conversions/``, which the install maps into
the package, are linked into ``TREE/mlx_edge0/`` the same way before the first
run (:func:`map_packages`).

Each run's results are ``DIR/{old,new}-r{N}.json`` (every arm ``--arms``
names, in the bench's order); the tables, one per arm, are also
``DIR/summary.json`` (``tables``; a pair summarized before they were per arm
has one ``table``, its first arm's). Runs already in DIR are kept (a stopped
pair resumes; one with every run there prints its tables again); the bench options are
written to ``DIR/pair.json`` before the first run, and a DIR made with other
options is refused rather than mixed or relabelled.
The runs start in the tree they import, so give paths in the bench options
absolute (``$DATA`` is).

Where what changes is written into the checkpoint instead (a routing profile,
``edge0 profile``), ``--new-edge0 DIR`` gives the new runs that checkpoint in
place of the bench options' ``--edge0`` (a ``cp -al`` copy of it shares the
expert files); ``--old`` and ``--new`` are then one tree:

    python benchmarks/code_pair.py --old $TREE --new $TREE --new-edge0 $DATA/ling-edge0-profiled \\
        --rounds 3 --out DIR -- --edge0 $DATA/ling-edge0 --arms edge0-prerouter+bypass ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

from mlx_edge0.bench.pair_args import with_option_value
from mlx_edge0.bench.runner import run_bench_round
from mlx_edge0.bench.summary import run_metrics
from mlx_edge0.progress import bar
from mlx_edge0.telemetry import hot_hit_rate

COLUMNS = {  # name -> (heading, value of one run record)
    "decode_tok_s": ("decode tok/s", lambda r: r["decode_tok_s"]),
    "ttft_s": ("TTFT s", lambda r: r["ttft_s"]),
    "device_mb_per_token": ("device MB/token", lambda r: r["device_bytes_per_token"] / 1e6),
    "hot_hit_rate": ("hot hit rate", lambda r: hot_hit_rate(r["counters_per_token"])),
    "prompt_copied": ("bundles copied from the prompt", lambda r: r["prefill_counters"].get("prompt_copied", 0)),
    "resident_at_decode": (
        "bundles resident at the decode's start",
        lambda r: len(r["eviction_replay"]["resident_keys"]),
    ),
    "held_at_decode": ("held bundles at the decode's start", lambda r: r["held_at_decode_start"]),
    "held_released": ("held bundles released in the decode", lambda r: r["decode_counters"]["held_released"]),
    "min_from_start": ("MIN from the decode's start", lambda r: r["eviction_replay"]["from_start"]["hit_rate"]["min"]),
    "exposed_wait_ms": ("exposed wait ms/step", lambda r: r["counters_per_token"]["exposed_wait_ms"]),
    # the bench's own step (the wall time per decoded token), not the runtime's step counter
    "step_ms": ("step ms", lambda r: run_metrics(r)["step_ms"]),
    "wait_share": ("exposed wait, share of the step", lambda r: run_metrics(r)["wait_share"]),
    "hot_overlapped": ("overlapped hot calls/token", lambda r: r["counters_per_token"]["hot_overlapped"]),
    "distinct_experts": ("experts/layer touched", lambda r: r["locality"]["mean_distinct"]),
    "reuse": ("token-to-token reuse", lambda r: r["locality"]["mean_reuse"]),
}


def order(rounds: int) -> list[tuple[int, str]]:
    """(round, tree) in ABBA order, so neither tree always runs first."""
    pairs = []
    for r in range(1, rounds + 1):
        trees = ("old", "new") if r % 2 else ("new", "old")
        pairs += [(r, t) for t in trees]
    return pairs


def run_one(tree: Path, bench_args: list[str], out: Path) -> None:
    """One bench run importing ``tree``: first on ``PYTHONPATH``, and the
    working directory, since ``python -m`` (the bench's child) puts the
    working directory before it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    run_bench_round(bench_args, out, env=env, cwd=tree)


def value(record: dict, name: str):
    try:
        return COLUMNS[name][1](record)
    except (KeyError, TypeError, ZeroDivisionError):  # an arm without that counter (exact: no hot cache)
        return None


def summarize(out: Path, rounds: int) -> dict:
    """Per arm of the runs (``--arms`` may name several: each round runs them
    all), per tree, each column's median, min and max over the rounds; and
    ``ratio``: new ÷ old decode tok/s in each round, and their median.

    Raises:
        SystemExit: a run file lacks an arm the others have (names the file).
    """
    records = {
        (tree, r): json.loads((out / f"{tree}-r{r}.json").read_text())["runs"]
        for tree in ("old", "new")
        for r in range(1, rounds + 1)
    }
    arms = list(dict.fromkeys(run["arm"] for runs in records.values() for run in runs))
    tables = {}
    for arm in arms:
        table, tok_s = {}, {}
        for tree in ("old", "new"):
            runs = []
            for r in range(1, rounds + 1):
                mine = [run for run in records[tree, r] if run["arm"] == arm]
                if not mine:
                    raise SystemExit(f"{out / f'{tree}-r{r}.json'}: no run of arm {arm!r}")
                runs.append(mine[0])
            tok_s[tree] = [run["decode_tok_s"] for run in runs]
            table[tree] = {}
            for name in COLUMNS:
                values = [v for v in (value(run, name) for run in runs) if v is not None]
                table[tree][name] = (
                    {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
                )
        per_round = [new / old for old, new in zip(tok_s["old"], tok_s["new"])]
        table["ratio"] = {"per_round": per_round, "median": statistics.median(per_round)}
        tables[arm] = table
    return tables


def print_tables(tables: dict) -> None:
    """One table per arm, then its new ÷ old by round."""
    for arm, table in tables.items():
        print(f"\n{arm}\n")
        print("| code | " + " | ".join(h for h, _ in COLUMNS.values()) + " |")
        print("|---" * (len(COLUMNS) + 1) + "|")
        for tree in ("old", "new"):
            row = table[tree]
            cells = []
            for name in COLUMNS:
                v = row[name]
                cells.append("-" if v is None else f"{v['median']:.3f} ({v['min']:.3f}–{v['max']:.3f})")
            print(f"| {tree} | " + " | ".join(cells) + " |")
        ratio = table["ratio"]
        rounds = ", ".join(f"{r:.3f}" for r in ratio["per_round"])
        print(f"new ÷ old decode tok/s: median {ratio['median']:.3f} (by round: {rounds})")


def same_options(out: Path, bench_args: list[str], new_edge0: Optional[str] = None) -> None:
    """Refuse a DIR whose runs were made with other bench options (or another
    ``--new-edge0``): resuming it would mix two conditions in one table,
    reprinting it would relabel it."""
    for name in ("pair.json", "summary.json"):
        path = out / name
        kept = json.loads(path.read_text()) if path.is_file() else {}
        if "bench_args" not in kept:
            continue
        if kept["bench_args"] != bench_args:
            raise SystemExit(
                f"{path}: its runs were made with bench options {' '.join(kept['bench_args'])!r}, "
                f"not {' '.join(bench_args)!r}; give the same options, or another --out"
            )
        if kept.get("new_edge0") != new_edge0:
            raise SystemExit(
                f"{path}: its new runs loaded --new-edge0 {kept.get('new_edge0')}, not {new_edge0};"
                " give the same, or another --out"
            )


def with_edge0(bench_args: list[str], edge0: str) -> list[str]:
    """``bench_args`` with ``--edge0``'s value replaced by ``edge0``."""
    try:
        return with_option_value(bench_args, "--edge0", edge0)
    except ValueError:
        raise SystemExit("--new-edge0 replaces the bench options' --edge0, and they give none") from None


# Top-level folders the install maps into the package (pyproject's package-dir):
# a bare source tree on PYTHONPATH has them only beside it.
MAPPED_PACKAGES = ("model_patches", "conversions")


def map_packages(tree: Path) -> list[Path]:
    """Link ``TREE/mlx_edge0/NAME`` to ``TREE/NAME`` for each mapped package the
    tree has beside the package and not in it, as its install would map them
    (a worktree or ``git archive`` has them only at the top). Returns the links made."""
    made = []
    for name in MAPPED_PACKAGES:
        link, target = tree / "mlx_edge0" / name, tree / name
        if target.is_dir() and not link.exists() and not link.is_symlink():
            link.symlink_to(Path("..") / name, target_is_directory=True)
            made.append(link)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="Source tree of the code before.")
    ap.add_argument("--new", type=Path, required=True, help="Source tree of the code after.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True, help="Directory for the runs and summary.json.")
    ap.add_argument(
        "--new-edge0", type=Path, help="The new runs load this checkpoint in place of the bench options' --edge0."
    )
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `edge0 bench run` options.")
    a = ap.parse_args()
    a.old, a.new, a.out = a.old.resolve(), a.new.resolve(), a.out.resolve()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    for tree in (a.old, a.new):
        if not (tree / "mlx_edge0" / "__init__.py").is_file():
            raise SystemExit(f"{tree} is not a source tree of mlx-edge0 (no mlx_edge0/__init__.py)")
        for link in map_packages(tree):
            print(f"linked {link} -> {link.readlink()} (the install's package-dir mapping)")
    new_edge0 = str(a.new_edge0.resolve()) if a.new_edge0 else None
    new_args = with_edge0(bench_args, new_edge0) if new_edge0 else bench_args
    recorded = {"bench_args": bench_args} | ({"new_edge0": new_edge0} if new_edge0 else {})
    a.out.mkdir(parents=True, exist_ok=True)
    same_options(a.out, bench_args, new_edge0)
    (a.out / "pair.json").write_text(json.dumps(recorded, indent=1) + "\n")
    todo = [(r, t) for r, t in order(a.rounds) if not (a.out / f"{t}-r{r}.json").is_file()]
    started = time.perf_counter()
    with bar(len(todo), "code pair", unit="run") as progress:
        for r, tree in todo:
            progress.set_postfix_str(f"round {r}, {tree}")
            if tree == "old":
                run_one(a.old, bench_args, a.out / f"{tree}-r{r}.json")
            else:
                run_one(a.new, new_args, a.out / f"{tree}-r{r}.json")
            progress.update()
    tables = summarize(a.out, a.rounds)
    summary = a.out / "summary.json"
    # a reprint (no run made now) keeps the trees the runs were made from
    trees = json.loads(summary.read_text()) if not todo and summary.is_file() else {}
    trees = {"old": trees.get("old", str(a.old)), "new": trees.get("new", str(a.new))}
    summary.write_text(json.dumps(trees | recorded | {"tables": tables}, indent=1) + "\n")
    print_tables(tables)
    print(f"{len(todo)} runs in {time.perf_counter() - started:.0f} s; results: {a.out}")


if __name__ == "__main__":
    main()
