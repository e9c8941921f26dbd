"""Time stock mlx-lm against edge0 on the same model, each run in a fresh process.

Every measurement runs in its own child (:mod:`mlx_edge0.bench.measure`), so
one arm's resident weights, page cache warmth from loading, allocator state
and peak counters cannot leak into the next. The parent only prepares the page
cache (dropped for ``cold`` and ``pressure``, pre-read for ``warm``), waits for
enough free memory, rotates arm order per round, and aggregates. A failing arm
becomes a record with its stderr tail; the other arms still run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from ..atomic import write_json_atomic
from ..options import GIB, available_memory
from ..progress import bar, note
from .arms import arm_tier, is_peer_arm, parse_arm, peer_gguf_path, tier_checkpoint
from .run_spec import DTYPES, RunSpec, checkpoint_files, drop_page_cache
from .regime import ArmCgroup, Regime, block_device, own_cgroups, read_ahead_kb, regime_unavailable
from .summary import summarize

CACHES = ("cold", "warm", "pressure")
STDERR_TAIL = 4000
READ_CHUNK = 16 << 20
MEMORY_POLL_S = 15.0
MEMORY_MARGIN = GIB // 2
# Resident bytes per stored byte of a stock int4 checkpoint: fp32 widens the
# bf16 scales and biases (BENCHMARKS.md, "Measurements behind code comments").
STOCK_FP32_GROWTH = 1.12

CACHE_NOTES = {
    "cold": "files dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before start",
    "warm": "files read once before start",
    "pressure": "cold start, and the checkpoint's pages dropped from the page cache before "
    "every decode step (untimed): the page cache cannot help, as when the model does not fit",
}


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark: which arms, which page-cache states, how long.

    Attributes:
        out: results JSON, rewritten after every run so partial results survive.
        stock: stock mlx-lm checkpoint (``edge0 bench synth`` output).
        edge0: the same model converted by ``edge0 convert``.
        gguf: the same model as a GGUF for the llama.cpp arms (default: the
            file ``edge0 bench gguf`` writes beside ``stock``).
        k: K on the prerouted layers of edge0 arms (0 = the heads' K); stock stays native.
        warm_prefill: time a second request in each process (warm prefill).
        profile: cProfile the decode steps (for where the time goes, not for speed).
        timeout_s: a child running longer is killed and recorded as failed.
        memory_wait_s: how long to wait for the memory an arm needs before
            recording it as skipped.
        resume: keep the successful runs of an earlier ``out`` made with the
            same options and run only the rest.
        regime: memory cap and read throughput of every arm's process
            (:mod:`mlx_edge0.bench.regime`); an arm the OOM killer ends is a
            result, not an error.
    """

    out: Path
    stock: Optional[Path] = None
    edge0: Optional[Path] = None
    gguf: Optional[Path] = None
    arms: tuple[str, ...] = ("stock", "edge0-exact")
    caches: tuple[str, ...] = ("cold", "warm")
    rounds: int = 3
    prompt_tokens: int = 32
    decode_tokens: int = 16
    dtype: str = "float32"
    seed: int = 0
    timeout_s: float = 3600.0
    k: int = 0
    warm_prefill: bool = False
    profile: bool = False
    memory_wait_s: float = 900.0
    resume: bool = False
    regime: Regime = Regime()

    def __post_init__(self):
        if not self.arms:
            raise ValueError("no arms given")
        for arm in self.arms:
            parse_arm(arm)
        unknown = [x for x in self.caches if x not in CACHES]
        if unknown or not self.caches:
            raise ValueError(f"unknown or no cache state(s) {unknown}; choose from {', '.join(CACHES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.rounds < 1 or self.prompt_tokens < 1 or self.decode_tokens < 1:
            raise ValueError("rounds, prompt tokens and decode tokens must be at least 1")
        for arm in self.arms:
            path = self.arm_path(arm)
            if is_peer_arm(arm):
                if path is None or not Path(path).is_file():
                    raise ValueError(
                        f"arm {arm!r} needs a GGUF: --gguf FILE, or `edge0 bench gguf STOCK` to write "
                        f"{path or 'STOCK.gguf'}"
                    )
            elif path is None:
                flag = "--stock" if arm == "stock" else "--edge0"
                raise ValueError(f"arm {arm!r} needs {flag} DIR")
            if arm_tier(arm) and not (Path(path) / "config.json").is_file():
                k = arm_tier(arm)
                raise ValueError(
                    f"arm {arm!r} runs on {path}, which does not exist: make it with "
                    f"`cp -al {self.edge0} {path} && edge0 heads init {path} --k {k}`"
                )
            if not is_peer_arm(arm) and not (Path(path) / "config.json").is_file():
                raise ValueError(f"{path}: no config.json; is this a checkpoint directory?")
            unavailable = regime_unavailable(self.regime, Path(path))
            if unavailable:
                raise ValueError(f"{self.regime.label()}: {unavailable}")
        if self.regime.memory_cap_gib is not None and "warm" in self.caches:
            raise ValueError(
                "a memory cap needs a cold page cache (pages cached before the run are charged "
                "to another cgroup): use --cache cold or pressure"
            )

    def arm_path(self, arm: str) -> Optional[Path]:
        if is_peer_arm(arm):
            return self.gguf or (peer_gguf_path(self.stock) if self.stock else None)
        if parse_arm(arm)[0] == "stock":
            return self.stock
        tier = arm_tier(arm)
        return tier_checkpoint(self.edge0, tier) if tier and self.edge0 else self.edge0

    def arm_k(self, arm: str) -> int:
        """K on the prerouted layers: the arm's tier, else ``k``; stock and peers stay native."""
        return 0 if arm == "stock" or is_peer_arm(arm) else arm_tier(arm) or self.k

    def spec(self, arm: str, cache: str) -> RunSpec:
        return RunSpec(
            arm, self.arm_path(arm), self.prompt_tokens, self.decode_tokens, self.dtype, self.seed,
            k=self.arm_k(arm), warm_prefill=self.warm_prefill,
            evict_between_steps=cache == "pressure", profile=self.profile,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return options_dict(self)


def options_dict(options) -> dict:
    """A dataclass of options as results JSON records it (paths as text)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}


def prepare_page_cache(root: Path, mode: str) -> str:
    """Drop (``cold``, ``pressure``) or pre-read (``warm``) every file under ``root``."""
    files = checkpoint_files(root)
    if mode == "warm":
        buf = bytearray(READ_CHUNK)
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return CACHE_NOTES["warm"]
    os.sync()
    if not drop_page_cache(files, sync=True):
        return "NOT dropped: this OS has no posix_fadvise; results are warm-ish"
    return CACHE_NOTES[mode]


def memory_needed(spec: RunSpec) -> int:
    """Rough bytes an arm holds: a stock model is resident; edge0 holds its
    resident file, one cast copy's growth and its hot budget."""
    files = checkpoint_files(spec.path)
    base, options = parse_arm(spec.arm)
    if is_peer_arm(base):  # mmap'd or read whole: about the file
        return sum(p.stat().st_size for p in files)
    if base == "stock":
        stored = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
        return int(stored * (STOCK_FP32_GROWTH if spec.dtype == "float32" else 1.0))
    resident_file = Path(spec.path) / "model.safetensors"
    if not resident_file.is_file():
        return 0  # not an edge0 checkpoint: the child says so
    return int(resident_file.stat().st_size * 1.5 + float(options.get("cache_gib", 0) or 0) * GIB)


def wait_for_memory(need: int, limit_s: float, progress: Callable[[str], None]) -> tuple[bool, float]:
    """Wait until ``need`` bytes (plus a margin) are available; (enough, seconds waited)."""
    start = time.perf_counter()
    while available_memory() < need + MEMORY_MARGIN:
        waited = time.perf_counter() - start
        if waited >= limit_s:
            return False, waited
        progress(
            f"[bench]   waiting for memory: need {need / GIB:.1f} GiB + margin, "
            f"available {available_memory() / GIB:.1f} GiB"
        )
        time.sleep(MEMORY_POLL_S)
    return True, time.perf_counter() - start


# The directory holding this copy of mlx_edge0. Children run there with it first
# on PYTHONPATH, so they import the same code as the parent (``-m`` and ``-c``
# put the working directory first on sys.path).
CODE_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """The parent's environment, with this mlx_edge0 importable by the child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CODE_ROOT), env.get("PYTHONPATH")) if p)
    return env


def cgroup_prefix(pid: int) -> str:
    """How the names of the cgroups a bench process ``pid`` makes begin: one
    per capped run, each removed after it (tests find what is left by it)."""
    return f"edge0-bench-{pid}-"


def run_child(spec: RunSpec, timeout_s: float, regime: Regime = Regime()) -> dict:
    """Run one measurement in a fresh process (in its own cgroup when
    ``regime`` caps it); failures come back as records."""
    if not regime.active:
        return _run_child(spec, timeout_s)
    name = f"{cgroup_prefix(os.getpid())}{time.monotonic_ns()}"
    with ArmCgroup(regime, own_cgroups(), block_device(spec.path), name) as cgroup:
        record = _run_child(spec, timeout_s, preexec=cgroup.join)
        stats = cgroup.stats()
    record["cgroup"] = stats
    if not record["ok"] and stats.get("oom_kills"):
        record.update(oom=True, error=f"OOM at {regime.memory_cap_gib:g} GiB (killed by the OOM killer)")
    return record


def _run_child(spec: RunSpec, timeout_s: float, preexec: Optional[Callable[[], None]] = None) -> dict:
    start = time.perf_counter()
    failed = {"arm": spec.arm, "ok": False}
    try:
        proc = subprocess.run(
            spec.argv(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(),
            cwd=CODE_ROOT,
            preexec_fn=preexec,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-STDERR_TAIL:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {**failed, "error": f"timed out after {timeout_s:.0f} s", "stderr_tail": tail}
    wall_s = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        error = f"child exited with status {proc.returncode}"
        return {**failed, "error": error, "stderr_tail": proc.stderr[-STDERR_TAIL:], "wall_s": wall_s}
    return {**json.loads(lines[-1]), "wall_s": wall_s}


def run_bench_round(bench_args: list[str], out: Path, env: Optional[dict] = None, cwd: Optional[Path] = None) -> None:
    """One ``edge0 bench run --rounds 1 --out OUT`` in a child, for the scripts
    that change a condition between rounds (``benchmarks/code_pair.py``,
    ``read_ahead_pair.py``); a file already there is resumed by the bench. The
    child imports ``mlx_edge0`` as ``env`` and ``cwd`` give it. A stop sends it
    SIGTERM, so it ends its arm and removes its cgroups.

    Raises:
        SystemExit: the bench failed (its own error is on stderr).
    """
    entry = "from mlx_edge0.cli import main; main()"  # the `edge0` command
    cmd = [sys.executable, "-c", entry, "bench", "run", *bench_args, "--rounds", "1", "--out", str(out)]
    bench = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
    try:
        status = bench.wait()
    except BaseException:
        bench.terminate()
        bench.wait()
        raise
    if status != 0:
        raise SystemExit(f"{out}: the bench run failed (exit status {status}); its error is above")


def machine_info() -> dict:
    import mlx.core as mx
    import mlx_lm

    import mlx_edge0

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_edge0": mlx_edge0.__version__,
        "mlx_edge0_path": str(Path(mlx_edge0.__file__).parent),  # which copy of the code ran
        "device": str(mx.default_device()),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def write_json(path: Path, data: dict) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data, indent=2)


RUN_KEYS = ("arm", "cache", "round", "ok")  # what every run record has, failed or not


def load_run(path: Path) -> tuple[list[dict], Optional[float]]:
    """A ``bench run`` results file's runs and the read throttle they ran under (MB/s, None: none).

    Raises:
        ValueError: the file is not JSON or not a bench run's results (names the file and field).
    """
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    runs = results.get("runs") if isinstance(results, dict) else None
    if not isinstance(runs, list):
        raise ValueError(f"{path}: no list of 'runs' (not a results file of `edge0 bench run --out`)")
    for i, r in enumerate(runs):
        missing = [k for k in RUN_KEYS if not isinstance(r, dict) or k not in r]
        if not missing and r["ok"] and "decode_tok_s" not in r:
            missing = ["decode_tok_s"]
        if missing:
            raise ValueError(f"{path}: runs[{i}] has no {', '.join(missing)} (not a run of `edge0 bench run`)")
    options = results.get("options")
    regime = options.get("regime") if isinstance(options, dict) else None
    read_mbps = regime.get("read_mbps") if isinstance(regime, dict) else None
    if read_mbps is not None and not (isinstance(read_mbps, (int, float)) and read_mbps > 0):
        raise ValueError(f"{path}: options.regime.read_mbps must be a positive number, got {read_mbps!r}")
    return runs, read_mbps


# Options that only say which runs to make: an earlier file that differs in
# them still measured its runs the same way.
SELECTING = ("resume", "arms", "caches")
# Options that are no condition of a measurement: runs made under other ones are kept.
NOT_CONDITIONS = (*SELECTING, "out")  # a results file resumes wherever it was moved


def _earlier_runs(options: BenchOptions) -> dict[tuple, dict]:
    """Successful runs of an earlier results file made with the same options
    (it may have had other arms or cache states: e.g. a warm phase added later)."""
    if not options.resume or not Path(options.out).is_file():
        return {}
    earlier = json.loads(Path(options.out).read_text())
    now = json.loads(json.dumps(options.to_dict()))  # tuples as JSON has them
    same = {k: v for k, v in earlier.get("options", {}).items() if k not in NOT_CONDITIONS}
    if same != {k: v for k, v in now.items() if k not in NOT_CONDITIONS}:
        return {}
    return {(r["round"], r["cache"], r["arm"]): r for r in earlier.get("runs", []) if r["ok"]}


def runs_to_make(options: BenchOptions) -> int:
    """How many runs :func:`run_bench` will measure (the others it keeps from ``options.out``)."""
    earlier = _earlier_runs(options)
    return sum(
        (rnd, cache, arm) not in earlier
        for rnd in range(options.rounds)
        for cache in options.caches
        for arm in options.arms
    )


def round_order(arms: Sequence[str], rnd: int) -> list[str]:
    """The arms in the order round ``rnd`` (from 0) runs them: rotated by
    ``rnd``, so each arm takes each position in turn and a drift over the
    run (a filling disk cache, a warming CPU) falls on every arm alike."""
    turn = rnd % len(arms)
    return list(arms[turn:]) + list(arms[:turn])


def run_bench(
    options: BenchOptions,
    command: list[str],
    progress: Callable[[str], None] = note,
    *,
    runs_bar: Optional[tqdm] = None,
    show_progress: bool = True,
) -> dict:
    """Run every (round, cache, arm) in a fresh child; arm order rotates per round.

    ``progress`` gets a line per run; ``runs_bar`` (else a bar of its own,
    when ``show_progress``) advances once per run measured, kept runs aside,
    so its ETA is the time the remaining runs take.
    """
    own_bar = runs_bar is None
    if own_bar:
        runs_bar = bar(runs_to_make(options), "bench runs", unit="run", show=show_progress)
    results = {
        "machine": machine_info(),
        "command": command,
        "options": options.to_dict(),
        "cache_notes": {c: CACHE_NOTES[c] for c in options.caches},
        "regime": options.regime.label(),
        "runs": [],
        "summary": {},
    }
    earlier = _earlier_runs(options)
    arms = list(options.arms)
    total, done = options.rounds * len(options.caches) * len(arms), 0
    for rnd in range(options.rounds):
        order = round_order(arms, rnd)
        for cache in options.caches:
            for position, arm in enumerate(order):
                done += 1
                label = f"[bench] {done}/{total} round {rnd + 1}/{options.rounds} {cache} {arm}"
                if (rnd, cache, arm) in earlier:
                    progress(f"{label}: kept from {options.out}")
                    results["runs"].append(earlier[(rnd, cache, arm)])
                    continue
                spec = options.spec(arm, cache)
                need = memory_needed(spec)
                if options.regime.memory_cap_gib is not None:  # the cap bounds what the arm can hold
                    need = min(need, int(options.regime.memory_cap_gib * GIB))
                enough, waited = wait_for_memory(need, options.memory_wait_s, progress)
                note = prepare_page_cache(spec.path, cache)
                progress(f"{label} ...")
                if enough:
                    record = run_child(spec, options.timeout_s, options.regime)
                else:
                    record = {
                        "arm": arm,
                        "ok": False,
                        "error": (
                            f"skipped: needs about {memory_needed(spec) / GIB:.1f} GiB, "
                            f"{available_memory() / GIB:.1f} GiB available after {waited:.0f} s"
                        ),
                    }
                # what a page fault reads around its page on the disk the arm reads from
                record.update(round=rnd, cache=cache, cache_note=note, position=position,
                              memory_wait_s=waited, read_ahead_kb=read_ahead_kb(Path(spec.path)))  # fmt: skip
                progress(f"[bench]   {one_line(record)}")
                runs_bar.update()
                results["runs"].append(record)
                results["summary"] = summarize(results["runs"])
                write_json(options.out, results)
    results["summary"] = summarize(results["runs"])
    write_json(options.out, results)
    if own_bar:
        runs_bar.close()
    return results


def one_line(r: dict) -> str:
    if r.get("oom"):
        return f"{r['error']}: a result, not a failure"
    if not r["ok"]:
        return f"FAILED: {r['error']}\n{r.get('stderr_tail', '')}"
    wait = r.get("counters_per_token", {}).get("exposed_wait_ms")
    peak = f"peak {r['peak_memory'] / GIB:.2f} GiB" if "peak_memory" in r else f"peak RSS {r['peak_rss'] / GIB:.2f} GiB"
    return (
        f"load {r['load_s']:.2f} s, prefill {r['prefill_tok_s']:.2f} tok/s, "
        f"decode {r['decode_tok_s']:.3f} tok/s, {peak}" + (f", wait {wait:.1f} ms/step" if wait is not None else "")
    )
