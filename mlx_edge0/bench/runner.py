"""Time stock mlx-lm against edge0 on the same model, each run in a fresh process.

Every measurement runs in its own child (``python -m mlx_edge0.bench.runner``),
so one arm's resident weights, page cache warmth from loading, allocator state
and peak counters cannot leak into the next. The parent only prepares the page
cache (dropped for ``cold``, pre-read for ``warm``), alternates arm order per
round, and aggregates. A failing arm becomes a record with its stderr tail; the
other arms still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

ARMS = ("stock", "edge0-exact", "edge0-hot", "edge0-staged", "edge0-prerouter")
# Load options per edge0 arm. Staged uses the routing of the current step until
# the prerouter provides predictions; hot and staged take a budget: ARM@GiB.
ARM_OPTIONS = {
    "edge0-exact": dict(cache_gib=0, staged=False, prefill="exact", prerouter=False),
    "edge0-hot": dict(staged=False, prefill="auto", prerouter=False),
    "edge0-staged": dict(staged=True, prefill="auto", prerouter=False),
    "edge0-prerouter": dict(staged=False, prefill="auto", prerouter=True),
}
ARM_LABELS = {"edge0-staged": "edge0-staged (current-step routing)"}


def parse_arm(arm: str) -> tuple[str, dict]:
    """``edge0-hot@0.5`` -> ("edge0-hot", load options with cache_gib=0.5)."""
    base, _, budget = arm.partition("@")
    if base not in ARMS or (budget and base not in ("edge0-hot", "edge0-staged", "edge0-prerouter")):
        raise ValueError(f"unknown arm {arm!r}: use {', '.join(ARMS)} (hot/staged may add @GiB)")
    options = dict(ARM_OPTIONS.get(base, {}))
    if budget:
        try:
            options["cache_gib"] = float(budget)
        except ValueError:
            raise ValueError(f"arm {arm!r}: budget {budget!r} is not a number of GiB") from None
    return base, options
CACHES = ("cold", "warm")
DTYPES = ("float32", "bfloat16", "float16", "native")
WARMUP_STEPS = 2
STDERR_TAIL = 4000
READ_CHUNK = 16 << 20

CACHE_NOTES = {
    "cold": "files dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before start",
    "warm": "files read once before start",
}


@dataclass(frozen=True)
class BenchOptions:
    """One benchmark: which arms, which page-cache states, how long.

    Attributes:
        out: results JSON, rewritten after every run so partial results survive.
        stock: stock mlx-lm checkpoint (``edge0 bench synth`` output).
        edge0: the same model converted by ``edge0 convert``.
        timeout_s: a child running longer is killed and recorded as failed.
    """

    out: Path
    stock: Optional[Path] = None
    edge0: Optional[Path] = None
    arms: tuple[str, ...] = ("stock", "edge0-exact")
    caches: tuple[str, ...] = CACHES
    rounds: int = 3
    prompt_tokens: int = 32
    decode_tokens: int = 16
    dtype: str = "float32"
    seed: int = 0
    timeout_s: float = 3600.0
    k: int = 0  # K on prerouted layers of edge0 arms (0 = native); stock stays native

    def __post_init__(self):
        if not self.arms:
            raise ValueError(f"no arms; choose from {', '.join(ARMS)}")
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
            if path is None:
                flag = "--stock" if arm == "stock" else "--edge0"
                raise ValueError(f"arm {arm!r} needs {flag} DIR")
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"{path}: no config.json; is this a checkpoint directory?")

    def arm_path(self, arm: str) -> Optional[Path]:
        return self.stock if parse_arm(arm)[0] == "stock" else self.edge0


@dataclass(frozen=True)
class RunSpec:
    """What one child measures."""

    arm: str
    path: Path
    prompt_tokens: int
    decode_tokens: int
    dtype: str
    seed: int
    k: int = 0

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "mlx_edge0.bench.runner",
            "--arm", self.arm, "--path", str(self.path),
            "--prompt-tokens", str(self.prompt_tokens),
            "--decode-tokens", str(self.decode_tokens),
            "--dtype", self.dtype, "--seed", str(self.seed), "--k", str(self.k),
        ]  # fmt: skip


# ---------------------------------------------------------------- child side


def _load(arm: str, path: Path, dtype: str, k: int = 0):
    import mlx.core as mx

    base, options = parse_arm(arm)
    if base == "stock":
        from mlx_lm.utils import load_model

        model, _ = load_model(path)
        if dtype != "native":
            model.set_dtype(getattr(mx, dtype))
            mx.eval(model.parameters())
        return model
    from mlx_edge0 import load_model

    model = load_model(path, compute_dtype=dtype, **options, **({"k": k} if k else {}))
    mx.eval(model.parameters())
    return model


def _vocab_size(path: Path) -> int:
    from mlx_edge0.checkpoint import read_config, text_config

    return text_config(read_config(path))["vocab_size"]


def _counters(model, reset: bool = False) -> Optional[dict]:
    """Expert read counters of an edge0 model (None for stock), optionally reset."""
    if not hasattr(model, "stats"):
        return None
    counters = dict(model.stats())
    if reset:
        model.reset_stats()
    return counters


def _peak_rss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def measure(spec: RunSpec) -> dict:
    """Load, prefill a seeded random prompt, then greedy-decode; time each phase."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    mx.reset_peak_memory()
    start = time.perf_counter()
    model = _load(spec.arm, spec.path, spec.dtype, spec.k)
    load_s = time.perf_counter() - start
    active_after_load = mx.get_active_memory()
    load_peak = mx.get_peak_memory()
    mx.reset_peak_memory()

    rng = np.random.default_rng(spec.seed)
    prompt = mx.array(rng.integers(0, _vocab_size(spec.path), spec.prompt_tokens), mx.int32)
    cache = make_prompt_cache(model)
    _counters(model, reset=True)
    start = time.perf_counter()
    logits = model(prompt[None], cache=cache)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y, logits)
    prefill_s = time.perf_counter() - start
    finite = bool(mx.all(mx.isfinite(logits)).item())
    prefill_counters = _counters(model)
    tokens = [y.item()]

    def step(y: mx.array) -> mx.array:
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        tokens.append(y.item())
        return y

    for _ in range(WARMUP_STEPS):
        y = step(y)
    _counters(model, reset=True)
    steps = []
    for _ in range(spec.decode_tokens):
        start = time.perf_counter()
        y = step(y)
        steps.append(time.perf_counter() - start)
    decode_counters = _counters(model)

    decode_s = sum(steps)
    record = {
        "arm": spec.arm,
        "ok": True,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": spec.prompt_tokens / prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": spec.decode_tokens / decode_s,
        "decode_s_per_token": decode_s / spec.decode_tokens,
        "decode_step_s": steps,
        "active_memory_after_load": active_after_load,
        "load_peak_memory": load_peak,
        "generate_peak_memory": mx.get_peak_memory(),
        "peak_memory": max(load_peak, mx.get_peak_memory()),
        "peak_rss": _peak_rss_bytes(),
        "logits_finite": finite,
        "tokens": tokens,
    }
    if decode_counters is not None:
        record["prefill_counters"] = prefill_counters
        record["decode_counters"] = decode_counters
        record["counters_per_token"] = {
            k: v / spec.decode_tokens
            for k, v in decode_counters.items()
            if isinstance(v, (int, float))
        }
    return record


def main(argv: Optional[list[str]] = None) -> None:
    """Child mode: measure one arm and print one JSON line."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--arm", required=True, help="an arm name, hot/staged optionally @GiB")
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=0)
    a = p.parse_args(argv)
    spec = RunSpec(a.arm, a.path, a.prompt_tokens, a.decode_tokens, a.dtype, a.seed, a.k)
    print(json.dumps(measure(spec)), flush=True)


# --------------------------------------------------------------- parent side


def prepare_page_cache(root: Path, mode: str) -> str:
    """Drop (``cold``) or pre-read (``warm``) every file under ``root``; says what was done."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())
    if mode == "warm":
        buf = bytearray(READ_CHUNK)
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return CACHE_NOTES["warm"]
    if not hasattr(os, "posix_fadvise"):
        return "NOT dropped: this OS has no posix_fadvise; results are warm-ish"
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return CACHE_NOTES["cold"]


def _child_env() -> dict[str, str]:
    """The parent's environment, with this mlx_edge0 importable by the child."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_child(spec: RunSpec, timeout_s: float) -> dict:
    """Run one measurement in a fresh process; failures come back as records."""
    start = time.perf_counter()
    failed = {"arm": spec.arm, "ok": False}
    try:
        proc = subprocess.run(
            spec.argv(), capture_output=True, text=True, timeout=timeout_s, env=_child_env()
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


SUMMARY_METRICS = (
    "load_s", "prefill_tok_s", "decode_tok_s", "decode_s_per_token",
    "active_memory_after_load", "peak_memory", "generate_peak_memory", "peak_rss", "wall_s",
)  # fmt: skip


def _stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    """Median and min/max of every metric per arm and cache state, plus token agreement."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["arm"], r["cache"]), []).append(r)
    arms = {}
    for (arm, cache), rs in groups.items():
        ok = [r for r in rs if r["ok"]]
        entry = {"arm": arm, "cache": cache, "runs": len(rs), "ok": len(ok)}
        for key in SUMMARY_METRICS:
            if ok and all(key in r for r in ok):
                entry[key] = _stat([r[key] for r in ok])
        counters = [r["counters_per_token"] for r in ok if "counters_per_token" in r]
        if counters:
            entry["counters_per_token"] = {k: _stat([c[k] for c in counters]) for k in counters[0]}
        failures = [r for r in rs if not r["ok"]]
        if failures:
            entry["last_error"] = failures[-1]["error"]
        arms[f"{arm}/{cache}"] = entry

    agree = {}
    by_slot: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        if r["ok"]:
            by_slot.setdefault((r["round"], r["cache"]), []).append(r)
    for (rnd, cache), rs in sorted(by_slot.items()):
        if len({r["arm"] for r in rs}) > 1:
            agree[f"round {rnd}/{cache}"] = all(r["tokens"] == rs[0]["tokens"] for r in rs)
    return {"arms": arms, "greedy_tokens_agree": agree}


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


def _write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_bench(
    options: BenchOptions,
    command: list[str],
    progress: Callable[[str], None] = _stderr_progress,
) -> dict:
    """Run every (round, cache, arm) in a fresh child; arm order rotates per round."""
    results = {
        "machine": machine_info(),
        "command": command,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "cache_notes": {c: CACHE_NOTES[c] for c in options.caches},
        "runs": [],
        "summary": {},
    }
    arms = list(options.arms)
    for rnd in range(options.rounds):
        order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        for cache in options.caches:
            for position, arm in enumerate(order):
                path = options.arm_path(arm)
                note = prepare_page_cache(path, cache)
                spec = RunSpec(
                    arm, path, options.prompt_tokens, options.decode_tokens,
                    options.dtype, options.seed, 0 if arm == "stock" else options.k,
                )  # fmt: skip
                progress(f"[bench] round {rnd + 1}/{options.rounds} {cache} {arm} ...")
                record = run_child(spec, options.timeout_s)
                record.update(round=rnd, cache=cache, cache_note=note, position=position)
                progress(f"[bench]   {_one_line(record)}")
                results["runs"].append(record)
                results["summary"] = summarize(results["runs"])
                _write_json(options.out, results)
    return results


def _one_line(r: dict) -> str:
    if not r["ok"]:
        return f"FAILED: {r['error']}\n{r.get('stderr_tail', '')}"
    return (
        f"load {r['load_s']:.2f} s, prefill {r['prefill_tok_s']:.2f} tok/s, "
        f"decode {r['decode_tok_s']:.3f} tok/s, peak {r['peak_memory'] / 2**30:.2f} GiB"
    )


def _fmt(stat: Optional[dict], scale: float = 1.0, digits: int = 2) -> str:
    if stat is None:
        return "-"
    med, lo, hi = (stat[k] / scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def _hit_rate(c: dict) -> str:
    hits, misses = c.get("hot_hits"), c.get("hot_misses")
    if not hits or hits["median"] + misses["median"] == 0:
        return "-"
    return f"{hits['median'] / (hits['median'] + misses['median']):.2f}"


def markdown_table(summary: dict) -> str:
    """Medians with (min–max) per arm and cache state."""
    gib, mb = 2**30, 1e6
    head = (
        "| arm | cache | ok/runs | load s | prefill tok/s | decode tok/s | s/token "
        "| active after load GiB | peak MLX GiB | peak RSS GiB | expert loads/token "
        "| expert MB/token | exposed wait ms/token | hot hit rate |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for e in summary.get("arms", {}).values():
        c = e.get("counters_per_token", {})
        lines.append(
            f"| {ARM_LABELS.get(e['arm'].split('@')[0], e['arm'].split('@')[0])}"
            f"{'@' + e['arm'].split('@')[1] + ' GiB' if '@' in e['arm'] else ''} "
            f"| {e['cache']} | {e['ok']}/{e['runs']} "
            f"| {_fmt(e.get('load_s'))} | {_fmt(e.get('prefill_tok_s'))} "
            f"| {_fmt(e.get('decode_tok_s'), digits=3)} | {_fmt(e.get('decode_s_per_token'), digits=3)} "
            f"| {_fmt(e.get('active_memory_after_load'), gib)} | {_fmt(e.get('peak_memory'), gib)} "
            f"| {_fmt(e.get('peak_rss'), gib)} | {_fmt(c.get('expert_loads'), digits=1)} "
            f"| {_fmt(c.get('bytes_read'), mb, 1)} | {_fmt(c.get('exposed_wait_ms'), digits=1)} "
            f"| {_hit_rate(c)} |"
        )
    agree = summary.get("greedy_tokens_agree", {})
    if agree:
        slots = ", ".join(f"{slot}: {'yes' if same else 'NO'}" for slot, same in agree.items())
        lines.append(f"\nGreedy tokens agree across arms: {slots}")
    failed = [e for e in summary.get("arms", {}).values() if "last_error" in e]
    for e in failed:
        lines.append(f"\n{e['arm']}/{e['cache']} failed: {e['last_error']} (stderr tail in JSON)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
