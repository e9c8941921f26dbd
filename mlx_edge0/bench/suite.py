"""``edge0 bench suite``: every arm, both K, three page-cache regimes, a budget sweep.

One command goes from a geometry name to a report: synthesize the stock
checkpoint (or reuse it), convert it, write prerouter heads for the native K
and for a lower K (swapping heads files is swapping K), then run the phases
below with :func:`mlx_edge0.bench.runner.run_bench` (each run a fresh process,
arm order rotated per round) and render the report.

Phases (``PHASES``):
- ``main``: every arm at the native K, cold and warm page cache, with a warm
  second request per process.
- ``low-k``: the edge0 arms at the lower K, with stock (which cannot change K)
  rotated in the same rounds so ratios to it are paired, cold and warm.
- ``sweep``: exact, and the sweep arms at every budget, native K, under
  memory pressure (pages dropped before every decode step).
- ``low-k-pressure``: exact, hot and the prerouter arms at the lower K under pressure.
- ``profile``: one cProfiled warm run of exact and the prerouter arms: where a
  step's time goes.

Each phase's results file is rewritten after every run and kept when the suite
is run again with the same options, so an interrupted suite resumes. Phases an
earlier invocation ran into the same results directory (same geometry, depth
and checkpoints) stay in ``suite.json`` with the command that ran them, so the
phases of a long suite can be run one invocation at a time.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ..checkpoint import read_config, text_config
from ..progress import bar, note
from .arms import ARMS, BUDGET_ARMS, KNOWN_ARMS, WINDOW_ARMS, arm_base, arm_tier, parse_arm
from .run_spec import DTYPES, checkpoint_files
from .runner import (
    CODE_ROOT,
    BenchOptions,
    child_env,
    machine_info,
    options_dict,
    run_bench,
    runs_to_make,
    write_json,
)
from .synth import SynthOptions, source_config, synth_checkpoint, synthetic_origin

PHASES = ("main", "low-k", "sweep", "low-k-pressure", "profile")
PRESSURE_ARMS = ("edge0-exact", "edge0-hot", "edge0-prerouter", *WINDOW_ARMS)
PROFILE_ARMS = ("edge0-exact", "edge0-prerouter", *WINDOW_ARMS)
HEADS_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class SuiteOptions:
    """What one suite runs.

    Attributes:
        geometry: a name in ``geometries.json``.
        out: results directory (phase JSON, suite.json, report.html, summary.md).
        data: where the checkpoints live (``GEOMETRY[-LN]-stock`` and ``-edge0``).
        layers: keep only this many decoder layers (per-layer shapes unchanged).
        cache_gib: hot-cache budget of the hot, staged and prerouter arms
            outside the sweep.
        budgets: the sweep's budgets (GiB).
        low_k: the lower K (heads are made for it); 0 skips the low-K phases.
        arms: the arms of ``main`` (the other phases take the edge0 ones among them).
        low_k_arms: the arms of ``low-k`` (empty: those of ``main``).
        quantize_embeddings: synthesize with int4 embeddings and lm_head too
            (where mlx-lm's own predicate keeps them bf16).
        synth_overrides: text-config fields to change when synthesizing (tests).
    """

    geometry: str
    out: Path
    data: Path
    layers: Optional[int] = None
    rounds: int = 3
    prompt_tokens: int = 32
    decode_tokens: int = 32
    cache_gib: float = 0.5
    budgets: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
    sweep_arms: tuple[str, ...] = ("edge0-hot", "edge0-prerouter")
    low_k: int = 4
    arms: tuple[str, ...] = ARMS
    low_k_arms: tuple[str, ...] = ()
    caches: tuple[str, ...] = ("cold", "warm")
    phases: tuple[str, ...] = PHASES
    dtype: str = "float32"
    seed: int = 0
    timeout_s: float = 3600.0
    memory_wait_s: float = 900.0
    quantize_embeddings: bool = False
    synth_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        SynthOptions(self.geometry, layers=self.layers, seed=self.seed)  # validates both
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"unknown or no phase(s) {unknown}; choose from {', '.join(PHASES)}")
        bad = [a for a in self.arms + self.sweep_arms + self.low_k_arms if not _suite_arm(a)]
        if bad:
            raise ValueError(
                f"unknown arm(s) {bad} (give arms without @GiB); choose from {', '.join(KNOWN_ARMS)}, "
                "edge0 ones may add +PAGE_CACHE"
            )
        if any(arm_base(a) not in BUDGET_ARMS for a in self.sweep_arms):
            raise ValueError(f"sweep arms take a budget: choose from {', '.join(BUDGET_ARMS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if min(self.rounds, self.prompt_tokens, self.decode_tokens) < 1:
            raise ValueError("rounds, prompt tokens and decode tokens must be at least 1")
        if self.cache_gib < 0 or any(b < 0 for b in self.budgets) or self.low_k < 0:
            raise ValueError("budgets and K must not be negative")

    @property
    def name(self) -> str:
        return (
            self.geometry
            + (f"-L{self.layers}" if self.layers else "")
            + ("-int4-embeddings" if self.quantize_embeddings else "")
        )

    @property
    def stock_dir(self) -> Path:
        return Path(self.data) / f"{self.name}-stock"

    @property
    def edge0_dir(self) -> Path:
        return Path(self.data) / f"{self.name}-edge0"


def quick(options: SuiteOptions) -> SuiteOptions:
    """Minutes instead of hours: few layers, tokens and budgets, one round."""
    text = text_config(source_config(SynthOptions(options.geometry)))
    layers = max(3, text.get("full_attention_interval") or 0)
    return replace(options, layers=options.layers or layers, rounds=1, prompt_tokens=8,
                   decode_tokens=4, budgets=(0.0, 0.25), cache_gib=0.25)  # fmt: skip


@dataclass(frozen=True)
class Phase:
    """One ``run_bench`` call of the suite."""

    name: str
    title: str
    k: int  # 0 = native
    arms: tuple[str, ...]
    caches: tuple[str, ...]
    rounds: int
    warm_prefill: bool = False
    profile: bool = False


def check_suite_arm(arm: str) -> None:
    """Raise ValueError unless the suite can run ``arm`` at its budgets:
    ``ARM[+PAGE_CACHE]``, no ``@GiB``."""
    if "@" in arm:
        raise ValueError(f"{arm!r}: the suite sets budgets itself (no @GiB)")
    if arm_tier(arm):
        raise ValueError(f"{arm!r}: the suite runs its K tier in the low-k phase (no /kK)")
    parse_arm(arm)


def _suite_arm(arm: str) -> bool:
    try:
        check_suite_arm(arm)
    except ValueError:
        return False
    return True


def plan_phases(o: SuiteOptions, native_k: int) -> list[Phase]:
    """The phases ``o`` asks for, in run order (native-K phases first: one heads swap)."""

    def at(arm: str, gib: float) -> str:
        return f"{arm}@{gib:g}" if arm_base(arm) in BUDGET_ARMS else arm

    edge0 = tuple(a for a in o.arms if a != "stock")
    low_k = o.low_k if 0 < o.low_k < native_k else 0
    pressure = tuple(at(a, o.cache_gib) for a in edge0 if arm_base(a) in PRESSURE_ARMS)
    sweep = tuple(a for a in edge0 if arm_base(a) == "edge0-exact") + tuple(
        at(a, b) for a in o.sweep_arms for b in o.budgets
    )
    plan = {
        "main": Phase("main", f"All arms, K={native_k} (native)", 0,
                      tuple(at(a, o.cache_gib) for a in o.arms), o.caches, o.rounds, warm_prefill=True),
        "sweep": Phase("sweep", f"Budget sweep under memory pressure, K={native_k}", 0, sweep,
                       ("pressure",), o.rounds),
        "profile": Phase("profile", f"Where a decode step's time goes (cProfile, warm, K={native_k})", 0,
                         tuple(at(a, o.cache_gib) for a in edge0 if arm_base(a) in PROFILE_ARMS), ("warm",), 1,
                         profile=True),
        "low-k": Phase("low-k", f"Edge0 arms at K={low_k} (heads-file swap), stock at its native K", low_k,
                       tuple(at(a, o.cache_gib) for a in (o.low_k_arms or o.arms)), o.caches, o.rounds,
                       warm_prefill=True),
        "low-k-pressure": Phase("low-k-pressure", f"On-demand vs prerouter at K={low_k} under memory pressure",
                                low_k, pressure, ("pressure",), o.rounds),
    }  # fmt: skip
    order = ("main", "sweep", "profile") + (("low-k", "low-k-pressure") if low_k else ())
    return [plan[name] for name in order if name in o.phases and plan[name].arms]


def _synthetic_origin(path: Path) -> dict:
    return read_config(path).get("edge0_synthetic", {})


def prepare_checkpoints(o: SuiteOptions, progress: Callable[[str], None]) -> dict:
    """Synthesize and convert unless a matching checkpoint is already there."""
    from ..conversions import ConvertOptions, convert

    synth = SynthOptions(o.geometry, layers=o.layers, seed=o.seed, overrides=o.synth_overrides,
                         quantize_embeddings=o.quantize_embeddings)  # fmt: skip
    expected = synthetic_origin(synth)
    stock, edge0 = o.stock_dir, o.edge0_dir
    for path in (stock, edge0):
        if (path / "config.json").is_file() and _synthetic_origin(path) != expected:
            raise ValueError(
                f"{path} holds {_synthetic_origin(path) or 'another model'}, not {expected}; "
                "move it away or pass another --data directory"
            )
    if not (stock / "config.json").is_file():
        progress(f"[suite] synthesizing {stock}")
        synth_checkpoint(stock, replace(synth, force=stock.exists()), progress)
    else:
        progress(f"[suite] reusing {stock}")
    if not (edge0 / "config.json").is_file():
        progress(f"[suite] converting to {edge0}")
        convert(stock, edge0, ConvertOptions(force=edge0.exists(), show_progress=False))
    else:
        progress(f"[suite] reusing {edge0}")
    size = lambda root: sum(p.stat().st_size for p in checkpoint_files(root))  # noqa: E731
    return {"stock": {"path": str(stock), "bytes": size(stock)},
            "edge0": {"path": str(edge0), "bytes": size(edge0),
                      "resident_bytes": (edge0 / "model.safetensors").stat().st_size,
                      "expert_bytes": size(edge0 / "experts")}}  # fmt: skip


def native_k(edge0: Path) -> int:
    return int(read_config(edge0)["edge0"]["num_experts_per_tok"])


def heads_k(edge0: Path) -> Optional[int]:
    """K of the checkpoint's prerouter heads, None without heads."""
    section = read_config(edge0)["edge0"].get("prerouter")
    if not isinstance(section, dict) or not (edge0 / section.get("file", "")).is_file():
        return None
    return int(section["k"])


def ensure_heads(edge0: Path, k: int, progress: Callable[[str], None]) -> None:
    """Make the checkpoint's heads be for K=``k`` (``edge0 heads init --k``, in a
    child so its loaded model does not stay in this process)."""
    if heads_k(edge0) == k:
        return
    progress(f"[suite] writing K={k} prerouter heads into {edge0}")
    code = "import sys; from mlx_edge0.cli import main; main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, "heads", "init", str(Path(edge0).resolve()), "--k", str(k)],
                          capture_output=True, text=True, timeout=HEADS_TIMEOUT_S, env=child_env(),
                          cwd=CODE_ROOT)  # fmt: skip
    if proc.returncode != 0 or heads_k(edge0) != k:
        raise RuntimeError(f"{edge0}: edge0 heads init --k {k} failed:\n{proc.stderr[-2000:]}")


def phase_bench(o: SuiteOptions, phase: Phase) -> BenchOptions:
    """What :func:`run_bench` measures for one phase (its results file under ``o.out/runs``)."""
    return BenchOptions(
        out=Path(o.out) / "runs" / f"{phase.name}.json", stock=o.stock_dir, edge0=o.edge0_dir,
        arms=phase.arms, caches=phase.caches, rounds=phase.rounds,
        prompt_tokens=o.prompt_tokens, decode_tokens=o.decode_tokens, dtype=o.dtype, seed=o.seed,
        timeout_s=o.timeout_s, k=phase.k, warm_prefill=phase.warm_prefill, profile=phase.profile,
        memory_wait_s=o.memory_wait_s, resume=True,
    )  # fmt: skip


def run_suite(
    o: SuiteOptions,
    command: list[str],
    progress: Callable[[str], None] = note,
    *,
    show_progress: bool = True,
) -> dict:
    """Prepare checkpoints and heads, run every phase, write ``suite.json``.

    ``progress`` gets a line per step and run; with ``show_progress`` one bar
    counts the runs of every phase still to measure, so its ETA is the suite's.
    """
    out = Path(o.out)
    started = time.time()
    checkpoints = prepare_checkpoints(o, progress)
    k_native = native_k(o.edge0_dir)
    phases = plan_phases(o, k_native)
    suite = {
        "geometry": o.geometry, "layers": o.layers,
        "native_layers": text_config(source_config(SynthOptions(o.geometry)))["num_hidden_layers"],
        "native_k": k_native, "command": command, "machine": machine_info(),
        "options": options_dict(o),
        "checkpoints": checkpoints, "started": started,
        "phases": earlier_phases(out, o, checkpoints, {p.name for p in phases}, progress),
    }  # fmt: skip
    benches = [phase_bench(o, phase) for phase in phases]
    runs = bar(sum(map(runs_to_make, benches)), "suite runs", unit="run", show=show_progress)
    for i, (phase, bench) in enumerate(zip(phases, benches)):
        k = phase.k or k_native
        ensure_heads(o.edge0_dir, k, progress)
        progress(f"[suite] phase {i + 1}/{len(phases)} {phase.name}: {phase.title}")
        results = run_bench(bench, command, progress, runs_bar=runs)
        suite["phases"][phase.name] = {**asdict(phase), "k": k, "command": command, "results": results}
        suite["finished"] = time.time()
        write_json(out / "suite.json", suite)
    runs.close()
    write_json(out / "suite.json", suite)
    return suite


def earlier_phases(
    out: Path, o: SuiteOptions, checkpoints: dict, running: set[str], progress: Callable[[str], None]
) -> dict:
    """Phases of an earlier ``suite.json`` in ``out`` that this invocation does
    not run, when it measured the same checkpoints (else none)."""
    path = Path(out) / "suite.json"
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}

    def identity(ck: dict) -> tuple:  # heads files come and go with K; the model does not
        return (ck["stock"], ck["edge0"]["path"], ck["edge0"]["resident_bytes"], ck["edge0"]["expert_bytes"])

    try:
        same = (old["geometry"], old["layers"], identity(old["checkpoints"])) == (
            o.geometry,
            o.layers,
            identity(checkpoints),
        )
    except (KeyError, TypeError):
        same = False
    if not same:
        return {}
    kept = {name: {"command": old["command"], **p} for name, p in old.get("phases", {}).items()
            if name not in running}  # fmt: skip
    if kept:
        progress(f"[suite] keeping phase(s) {', '.join(kept)} from {path}")
    return kept


def command_line() -> list[str]:
    """This process's command, program by name (not the install path)."""
    return [shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]]]


def load_suite(out: Path) -> dict:
    path = Path(out) / "suite.json"
    if not path.is_file():
        raise ValueError(f"{path}: no suite results here (run `edge0 bench suite --out {out}` first)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
