"""``edge0 bench sweep``: the same arms over a grid of memory caps × read throughputs.

Each grid point is one :func:`mlx_edge0.bench.runner.run_bench` call in its
own regime (:mod:`mlx_edge0.bench.regime`), with its results file at
``OUT/points/cap-X-mbps-Y.json``, kept and resumed like any bench results.
``OUT/sweep.json`` holds, per point, each arm's summary and the winner: the
arm with the highest median decode tok/s among those that decoded and none
of whose runs the OOM killer ended (none where no arm qualifies). Drawn over
the grid, the winners map where each arm wins
(:mod:`mlx_edge0.bench.sweep_report`).

Every point is checked (arms, checkpoints, whether this machine can set up
its cgroups) before the first run, so a bad grid fails in seconds, not after
hours of the points before it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..progress import bar, note
from .regime import Regime
from .runner import BenchOptions, load_run, machine_info, options_dict, run_bench, runs_to_make, write_json
from .summary import stats_of, summarize
from .tables import median, stat

# A cap needs a cold page cache (pages cached before the run are charged to another cgroup).
SWEEP_CACHES = ("cold", "pressure")
UNLIMITED = ("none", "uncapped")


def axis(values: Iterable[Optional[float]]) -> tuple[Optional[float], ...]:
    """Distinct values ascending, no limit (None) last: the order the map draws."""
    return tuple(sorted(set(values), key=lambda v: (v is None, v or 0.0)))


def parse_grid(text: str, unit: str) -> tuple[Optional[float], ...]:
    """``"0.5,1,none"`` -> (0.5, 1.0, None): one axis of the grid, sorted by :func:`axis`.

    Raises:
        ValueError: empty, not a number, or not positive (says which item).
    """
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{text!r}: give a comma list of {unit}, or none for no limit")
    values: list[Optional[float]] = []
    for item in items:
        if item.lower() in UNLIMITED:
            values.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a number of {unit} (or none for no limit)") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{item!r}: must be a positive number of {unit} (or none for no limit)")
        values.append(value)
    return axis(values)


def point_name(regime: Regime) -> str:
    """``cap-0.5-mbps-200``: a grid point's results file name, without ``.json``."""

    def tag(v: Optional[float]) -> str:
        return "none" if v is None else f"{v:g}"

    return f"cap-{tag(regime.memory_cap_gib)}-mbps-{tag(regime.read_mbps)}"


@dataclass(frozen=True)
class SweepOptions:
    """Which arms, at which memory caps and read throughputs.

    Attributes:
        out: results directory (sweep.json, sweep.md, sweep.html, points/).
        memory_caps: GiB per arm's process, page cache included (None: no cap).
        read_mbps: device read throughput per arm's process (None: unthrottled).
        cache: page-cache state of every run, ``cold`` or ``pressure``.
        resume: keep the runs of an earlier sweep into ``out`` made with the
            same options (per point, as :func:`run_bench` does).

    The other fields are :class:`BenchOptions`' (checkpoints, arms, how long).
    """

    out: Path
    memory_caps: tuple[Optional[float], ...] = (None,)
    read_mbps: tuple[Optional[float], ...] = (None,)
    stock: Optional[Path] = None
    edge0: Optional[Path] = None
    gguf: Optional[Path] = None
    arms: tuple[str, ...] = ("stock", "edge0-exact")
    cache: str = "cold"
    rounds: int = 3
    prompt_tokens: int = 32
    decode_tokens: int = 16
    dtype: str = "float32"
    seed: int = 0
    timeout_s: float = 3600.0
    k: int = 0
    memory_wait_s: float = 900.0
    resume: bool = True

    def __post_init__(self):
        if self.cache not in SWEEP_CACHES:
            raise ValueError(f"cache must be one of {', '.join(SWEEP_CACHES)} (a cap needs a cold page cache)")
        if not self.memory_caps or not self.read_mbps:
            raise ValueError("the grid needs at least one memory cap and one read throughput (None: no limit)")
        for regime in self.regimes():  # every point's arms, checkpoints and cgroups, before any run
            self.bench(regime)

    def regimes(self) -> list[Regime]:
        """The grid's points, memory cap by memory cap, each over every read throughput."""
        return [Regime(cap, mbps) for cap in axis(self.memory_caps) for mbps in axis(self.read_mbps)]

    def bench(self, regime: Regime) -> BenchOptions:
        """What :func:`run_bench` measures at one point.

        Raises:
            ValueError: from :class:`BenchOptions` (e.g. the regime cannot be set up here).
        """
        return BenchOptions(
            out=Path(self.out) / "points" / f"{point_name(regime)}.json", stock=self.stock, edge0=self.edge0,
            gguf=self.gguf, arms=self.arms, caches=(self.cache,), rounds=self.rounds,
            prompt_tokens=self.prompt_tokens, decode_tokens=self.decode_tokens, dtype=self.dtype, seed=self.seed,
            timeout_s=self.timeout_s, k=self.k, memory_wait_s=self.memory_wait_s, resume=self.resume, regime=regime,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return options_dict(self)


def arm_summary(entry: dict, runs: list[dict]) -> dict:
    """One arm at one point, from its :func:`summary.summarize` entry and its
    runs: decode tok/s (median, min, max), OOM kills, device bytes per decoded
    token, peak MLX memory and the cgroup's peak (page cache included); its
    decode over llama.cpp's mmap arm's round by round, and the exposed wait's
    share of its step, where the point has them (issue 19's targets)."""
    cgroups = [r["cgroup"] for r in runs if r["ok"] and r["arm"] == entry["arm"] and "cgroup" in r]
    return {
        "arm": entry["arm"],
        "runs": entry["runs"],
        "ok": entry["ok"],
        "oom": entry.get("oom", 0),
        "decode_tok_s": entry.get("decode_tok_s"),
        "device_bytes_per_token": median(entry, "device_bytes_per_token", "metrics"),
        "peak_memory": entry.get("peak_memory"),
        "cgroup_peak_bytes": stats_of(cgroups, ["cgroup_peak_bytes"]).get("cgroup_peak_bytes"),
        "decode_vs_llamacpp": entry.get("decode_vs_llamacpp_paired"),
        "wait_share": stat(entry, "wait_share", "metrics"),
        "error": entry.get("last_error"),
    }


def winner(arms: list[dict]) -> Optional[str]:
    """The arm with the highest median decode tok/s among those that decoded
    and were never OOM-killed (an arm that fits only in some rounds does not
    fit); None where no arm qualifies. Ties go to the arm listed first."""
    fits = [a for a in arms if a["decode_tok_s"] is not None and not a["oom"]]
    return max(fits, key=lambda a: a["decode_tok_s"]["median"])["arm"] if fits else None


def point_arms(entries: dict, runs: list[dict], arms: Iterable[str], cache: str) -> list[dict]:
    """Each of ``arms``' summary at a point (:func:`arm_summary`), in that
    order, from :func:`summary.summarize`'s ``entries`` of ``runs``; an arm
    with no entry there is left out."""
    return [arm_summary(entries[f"{arm}/{cache}"], runs) for arm in arms if f"{arm}/{cache}" in entries]


def point_record(bench: BenchOptions, results: dict) -> dict:
    """A point of ``sweep.json``: its regime, results file, arm summaries and winner."""
    arms = point_arms(results["summary"]["arms"], results["runs"], bench.arms, bench.caches[0])
    return {
        "memory_cap_gib": bench.regime.memory_cap_gib,
        "read_mbps": bench.regime.read_mbps,
        "regime": bench.regime.label(),
        "results": str(Path(bench.out).relative_to(Path(bench.out).parents[1])),
        "arms": arms,
        "winner": winner(arms),
    }


def writable_dir(out: Path) -> None:
    """Make ``out``, or say why its results cannot be written there.

    Raises:
        ValueError: ``out`` cannot be made or written.
    """
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{out}: cannot make the results directory ({e.strerror}); give another --out") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"{out}: not writable; give another --out")


def run_sweep(
    options: SweepOptions,
    command: list[str],
    progress: Callable[[str], None] = note,
    *,
    show_progress: bool = True,
) -> dict:
    """Run every point, writing ``sweep.json`` after each.

    ``progress`` gets a line per point and run; with ``show_progress`` one bar
    counts the runs of every point still to measure, so its ETA is the sweep's.
    """
    out = Path(options.out)
    writable_dir(out)
    benches = [options.bench(regime) for regime in options.regimes()]
    sweep = {
        "command": command, "machine": machine_info(), "options": options.to_dict(),
        "started": time.time(), "points": [],
    }  # fmt: skip
    runs = bar(sum(map(runs_to_make, benches)), "sweep runs", unit="run", show=show_progress)
    for i, bench in enumerate(benches):
        progress(f"[sweep] point {i + 1}/{len(benches)}: {bench.regime.label()}")
        results = run_bench(bench, command, progress, runs_bar=runs)
        sweep["points"].append(point_record(bench, results))
        sweep["finished"] = time.time()
        write_json(out / "sweep.json", sweep)
    runs.close()
    return sweep


def failed_arms(sweep: dict) -> list[str]:
    """``arm at regime`` for every arm that failed every run for another reason than an OOM kill."""
    return [f"{a['arm']} at {p['regime']}" for p in sweep["points"] for a in p["arms"]
            if a["ok"] == 0 and a["oom"] < a["runs"]]  # fmt: skip


def load_sweep(out: Path) -> dict:
    """``out/sweep.json``.

    Raises:
        ValueError: missing or not JSON (names the file).
    """
    path = Path(out) / "sweep.json"
    if not path.is_file():
        raise ValueError(f"{path}: no sweep results here (run `edge0 bench sweep --out {out}` first)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def refresh_points(sweep: dict, out: Path) -> dict:
    """``sweep`` with each point's arms summarized again from the runs in its
    results file (``out/points/...``), so a sweep made before a column
    existed reports it too; a point whose file is gone keeps its summary.

    Raises:
        ValueError: a point's file is not a bench run's results (names it).
    """
    for p in sweep["points"]:
        path = Path(out) / p["results"]
        if not path.is_file():
            continue
        runs, _ = load_run(path)
        arms = point_arms(summarize(runs)["arms"], runs, sweep["options"]["arms"], sweep["options"]["cache"])
        p.update(arms=arms, winner=winner(arms))
    return sweep
