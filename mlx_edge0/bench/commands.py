"""``edge0 bench``: synthetic checkpoints, stock-vs-edge0 timings, the regime sweep, the full suite."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import click

from ..checkpoint import human_bytes
from ..interrupts import terminate_as_interrupt
from ..progress import bar
from .datadir import DEFAULT_DATA, bench_checkpoints, remove_checkpoints
from .gguf_peer import RESIDENT_TYPES
from .arms import ARMS, BUDGET_ARMS, peer_gguf_path
from .run_spec import DTYPES
from .regime import PRESETS, Regime, checkpoint_bytes
from .runner import CACHES, BenchOptions, load_run, run_bench
from .summary import summarize
from .synth import SynthOptions, geometries, synth_checkpoint
from .synthetic_router import ROUTINGS
from .report import write_report
from .sweep import SWEEP_CACHES, SweepOptions, failed_arms, load_sweep, refresh_points, run_sweep
from .sweep_report import write_sweep_report
from .command_options import (
    TIMEOUT_OPTION,
    budget_list,
    csv_choice,
    grid_values,
    measurement_options,
    suite_arm_list,
    with_budgets,
)
from .suite import PHASES, SuiteOptions, command_line, load_suite, quick as quick_options, run_suite
from .tables import markdown_table


@click.group()
@click.pass_context
def bench(ctx: click.Context):
    """Synthetic checkpoints and timing benchmarks."""
    # A stopped bench (SIGTERM) kills its arm's process and removes the arm's cgroups on the way out.
    ctx.with_resource(terminate_as_interrupt())


@bench.command()
@click.option("--geometry", required=True, type=click.Choice(sorted(geometries())))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), help="Keep only N decoder layers.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--quantize-embeddings",
    is_flag=True,
    help="Also quantize embeddings and lm_head where mlx-lm's predicate keeps them bf16.",
)
@click.option(
    "--routing",
    type=click.Choice(ROUTINGS),
    default="random",
    show_default=True,
    help="Router weights: random (locality is an accident of the init); uniform (no popular experts, "
    "reuse about K/E); calibrated (popularity solved for the published 90%-coverage figure). The "
    "checkpoint's own routers do it: every runtime routes alike.",
)
def synth(
    geometry: str, out: Path, layers: Optional[int], seed: int, force: bool, quantize_embeddings: bool, routing: str
):
    """Write a random-weight stock mlx-lm int4 checkpoint of a public model's shape to OUT."""
    try:
        options = SynthOptions(
            geometry, layers=layers, seed=seed, force=force, quantize_embeddings=quantize_embeddings, routing=routing
        )
        report = synth_checkpoint(out, options)
    except (ValueError, FileExistsError) as e:
        raise click.ClickException(str(e)) from None
    routers = f" ({report.router_seconds:.1f} s setting {routing} routers)" if routing != "random" else ""
    click.echo(
        f"Wrote {report.path}: {report.total_bytes / 1e9:.2f} GB in {report.shards} shards, "
        f"{report.tensors} tensors, {report.seconds:.1f} s{routers}"
    )


@bench.command("gguf")
@click.argument("stock", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--resident-type",
    type=click.Choice(RESIDENT_TYPES),
    default="f16",
    show_default=True,
    help="Type of the attention, shared-expert, embedding and LM-head matrices: dequantized (f16, f32) or "
    "requantized like the experts (q4_0: the int4 checkpoint's bytes, for memory-capped runs). Routers, gates "
    "and norms are F32.",
)
def gguf(stock: Path, out: Optional[Path], resident_type: str):
    """Write the stock qwen3_moe, qwen3_5_moe or bailing_moe_v3 (Ling 3.0) checkpoint STOCK as a GGUF
    for the llama.cpp arms (llama.cpp's qwen3moe / qwen35moe / bailingmoe3; experts requantized to
    Q4_0) [default OUT: STOCK.gguf beside STOCK]. Needs the peers extra."""
    from .gguf_peer import GGUFConversionError, write_gguf

    out = out or peer_gguf_path(stock)
    layers = None

    def progress(written: int, total: int) -> None:
        nonlocal layers
        layers = layers or bar(total, "gguf", unit="layer")
        layers.update(written - layers.n)

    try:
        report = write_gguf(stock, out, resident_type=resident_type, progress=progress)
    except GGUFConversionError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if layers is not None:
            layers.close()
    click.echo(
        f"Wrote {out} ({report.arch}): {report.file_bytes / 1e9:.2f} GB "
        f"({report.expert_bytes / 1e9:.2f} GB Q4_0 experts), "
        f"{report.tensors} tensors, {report.seconds:.1f} s; Q4_0 requantization error of the experts: "
        f"{report.expert_rel_error:.2%} relative, {report.expert_max_abs_error:.3g} max abs"
    )


@bench.command("run")
@measurement_options
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Results JSON (rewritten after every run).",
)
@click.option(
    "--cache",
    "caches",
    default="cold,warm",
    show_default=True,
    callback=csv_choice(CACHES),
    help="Page-cache states: cold, warm, pressure (pages dropped before every decode step).",
)
@click.option("--warm-prefill", is_flag=True, help="Also time a second request in each process.")
@click.option(
    "--memory-cap",
    "memory_cap_gib",
    type=float,
    default=None,
    help="Run each arm in its own memory cgroup capped at GIB (page cache included; Linux, root).",
)
@click.option(
    "--read-mbps",
    type=float,
    default=None,
    help="Throttle each arm's reads of the checkpoint's disk to N MB/s (cgroup; Linux, root).",
)
@click.option(
    "--regime",
    "preset",
    type=click.Choice(sorted(PRESETS)),
    default=None,
    help="A named memory cap and read throughput, scaled to the checkpoint (BENCHMARKS.md, 'Regime presets'); "
    "--memory-cap / --read-mbps override its parts.",
)
def run(
    out: Path,
    arms: tuple[str, ...],
    budgets: tuple[float, ...],
    memory_cap_gib: Optional[float],
    read_mbps: Optional[float],
    preset: Optional[str],
    **kwargs,
):
    """Time each arm in a fresh process, arms alternated per round; medians with min–max."""
    try:
        regime = Regime(memory_cap_gib, read_mbps)
        if preset is not None:
            root = kwargs["stock"] or kwargs["edge0"]
            if root is None:
                raise ValueError(f"--regime {preset} scales with the checkpoint: give --stock or --edge0")
            sized = PRESETS[preset].regime(checkpoint_bytes(root))
            regime = Regime(memory_cap_gib or sized.memory_cap_gib, read_mbps or sized.read_mbps)
            click.echo(f"regime {preset}: {regime.label()}", err=True)
        options = BenchOptions(out=out, arms=with_budgets(arms, budgets), regime=regime, **kwargs)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    results = run_bench(options, command=command_line())
    click.echo(markdown_table(results["summary"], regime.read_mbps))
    click.echo(f"\nResults: {out}")
    summary = results["summary"]["arms"].values()
    if any(e["ok"] == 0 and e.get("oom", 0) < e["runs"] for e in summary):  # an OOM kill is a result
        sys.exit(1)


@bench.command("sweep")
@measurement_options
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Results directory: sweep.json, sweep.md, sweep.html and each point's results under points/.",
)
@click.option(
    "--memory-caps",
    default="none",
    show_default=True,
    callback=grid_values("GiB"),
    help="Comma list of memory caps per arm in GiB (page cache included); none (or uncapped) for no cap.",
)
@click.option(
    "--read-mbps",
    default="none",
    show_default=True,
    callback=grid_values("MB/s"),
    help="Comma list of read throughputs per arm in MB/s; none (or uncapped) for no throttle.",
)
@click.option(
    "--cache",
    type=click.Choice(SWEEP_CACHES),
    default="cold",
    show_default=True,
    help="Page-cache state of every run (a cap needs a cold page cache; pressure drops pages every step).",
)
@click.option("--fresh", is_flag=True, help="Measure every point again instead of keeping an earlier sweep's runs.")
def sweep(out: Path, arms: tuple[str, ...], budgets: tuple[float, ...], fresh: bool, **kwargs):
    """Run the arms at every memory cap × read throughput and map where each arm wins:
    OUT/sweep.html, OUT/sweep.md. At a capped point each arm runs in its own cgroup (Linux, root).

    Rerunning into the same OUT with the same options keeps the runs already made.
    """
    try:
        options = SweepOptions(out=out, arms=with_budgets(arms, budgets), resume=not fresh, **kwargs)
        results = run_sweep(options, command=command_line())
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    md, html = write_sweep_report(results, out)
    click.echo(md.read_text())
    click.echo(f"Map: {html}\nSummary: {md}\nResults: {out / 'sweep.json'}")
    failed = failed_arms(results)
    if failed:  # an OOM kill is a result; another failure is not
        click.echo(f"Failed (not OOM): {'; '.join(failed)}", err=True)
        sys.exit(1)


@bench.command("suite")
@click.option("--geometry", required=True, type=click.Choice(sorted(geometries())))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Results directory [default: benchmarks/results/GEOMETRY[-LN]].",
)
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA,
    show_default=True,
    help="Where the synthetic and converted checkpoints are made or reused (a stock and an "
    "edge0 copy: about twice the geometry's size; `edge0 bench clean` removes them).",
)
@click.option("--layers", type=click.IntRange(min=1), help="Keep only N decoder layers.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--decode-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--cache-gib",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Hot-cache budget of the hot, staged and prerouter arms outside the sweep.",
)
@click.option(
    "--budgets", default="0,0.25,0.5,1,2", show_default=True, callback=budget_list, help="The sweep's budgets (GiB)."
)
@click.option(
    "--sweep-arms",
    default="edge0-hot,edge0-prerouter",
    show_default=True,
    callback=suite_arm_list(),
    help=f"Arms of the sweep: {', '.join(BUDGET_ARMS)}, maybe +PAGE_CACHE.",
)
@click.option(
    "--low-k",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="The lower K (heads are written for it); 0 skips the low-K phases.",
)
@click.option(
    "--arms",
    default=",".join(ARMS),
    show_default=True,
    callback=suite_arm_list(),
    help="Arms of the main phase (other phases take the edge0 ones among them); edge0 arms "
    "may add +PAGE_CACHE (e.g. edge0-prerouter+bypass).",
)
@click.option(
    "--low-k-arms",
    default="",
    callback=suite_arm_list(allow_empty=True),
    help="Arms of the low-K phase [default: those of --arms].",
)
@click.option(
    "--cache",
    "caches",
    default="cold,warm",
    show_default=True,
    callback=csv_choice(("cold", "warm")),
    help="Page-cache states of the main and low-K phases.",
)
@click.option("--phases", default=",".join(PHASES), show_default=True, callback=csv_choice(PHASES))
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@TIMEOUT_OPTION
@click.option(
    "--quantize-embeddings",
    is_flag=True,
    help="Synthesize with int4 embeddings and lm_head (where mlx-lm keeps them bf16).",
)
@click.option(
    "--quick", is_flag=True, help="Minutes: few layers, 8-token prompt, 4 decode tokens, one round, two budgets."
)
def suite(out: Optional[Path], quick: bool, **kwargs):
    """Synthesize, convert, write heads for both K, run every phase, write the report.

    Phases: main (every arm, native K, cold + warm), low-k (edge0 arms at --low-k, stock alongside),
    sweep (budgets under memory pressure), low-k-pressure, profile. Rerunning with
    the same options keeps finished runs.
    """
    try:
        options = SuiteOptions(out=out or Path("."), **kwargs)
        if out is None:
            options = replace(options, out=Path("benchmarks/results") / options.name)
        if quick:
            options = quick_options(options)
            if out is None:
                options = replace(options, out=Path("benchmarks/results") / f"{options.name}-quick")
        results = run_suite(options, command=command_line())
    except (ValueError, FileExistsError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    md, html = write_report(results, options.out)
    click.echo(md.read_text())
    click.echo(f"Report: {html}\nSummary: {md}\nResults: {options.out / 'suite.json'}")
    kept = bench_checkpoints(options.data)
    click.echo(
        f"Checkpoints kept for reruns: {human_bytes(sum(c.nbytes for c in kept))} in {options.data} "
        f"({', '.join(c.path.name for c in kept)}); `edge0 bench clean --data {options.data}` "
        "removes them."
    )


@bench.command("clean")
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA,
    show_default=True,
    help="The directory `edge0 bench suite --data` wrote to.",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def clean(data: Path, dry_run: bool):
    """Remove the synthetic checkpoints the bench made under DATA (nothing else)."""
    found = bench_checkpoints(data) if dry_run else remove_checkpoints(data)
    verb = "would remove" if dry_run else "removed"
    for c in found:
        click.echo(f"{verb} {c.path} ({human_bytes(c.nbytes)})")
    click.echo(f"{verb} {human_bytes(sum(c.nbytes for c in found))} in {len(found)} checkpoints under {data}")


@bench.command("report")
@click.argument("results", type=click.Path(exists=True, path_type=Path))
def report(results: Path):
    """Render summary.md and report.html again from RESULTS/suite.json (or, for
    a sweep, sweep.md and sweep.html from RESULTS/sweep.json, each point's arms
    summarized again from the runs in its file under points/); given a
    ``bench run`` results file, print its tables again, summarized from its runs."""
    try:
        if results.is_file():
            runs, read_mbps = load_run(results)
            click.echo(markdown_table(summarize(runs), read_mbps))
            return
        if (results / "sweep.json").is_file() and not (results / "suite.json").is_file():
            md, html = write_sweep_report(refresh_points(load_sweep(results), results), results)
        else:
            md, html = write_report(load_suite(results), results)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"Report: {html}\nSummary: {md}")
