"""The ``edge0`` command line: ``convert``, ``generate``, ``info``, ``heads
init``, ``profile``, ``eval`` here; ``serve`` (:mod:`mlx_edge0.serve`), ``bench``
(:mod:`mlx_edge0.bench.commands`) and ``train`` (:mod:`mlx_edge0.train.commands`)
from their own modules.

The command-line modules (these, and :mod:`mlx_edge0.flags` for the flags
``generate`` and ``serve`` share) are the only ones that import click or read
argv, apart from the server child parsing mlx_lm.server's own flags
(:mod:`mlx_edge0.pinned_server`) and the bench child (:mod:`mlx_edge0.bench.measure`);
everything a command does is a plain function call into the library with
typed options.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from .bench.commands import bench
from .flags import model_option, option_flags
from .flags import options_from_flags as _options
from .serve import serve_command
from .train.commands import train

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a checkpoint with none has no tokenizer


def _fail(message: str) -> None:
    raise click.ClickException(message)


def _progress_bar(items: list, label: str, describe):
    """``edge0 convert``'s progress: click's bar over the layers (or tensors) written."""
    return click.progressbar(
        items, label=f"edge0 convert: {label}", item_show_func=lambda it: describe(it) if it is not None else ""
    )


@click.group()
@click.version_option(package_name="mlx-edge0")
def main() -> None:
    """mlx-edge0: run MoE models that do not fit in memory from SSD, inside mlx-lm."""


@main.command()
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--bits", default=4, show_default=True, help="Routed-expert bits.")
@click.option("--group-size", default=64, show_default=True, help="Quantization group size.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def convert(src: str, out: Path, bits: int, group_size: int, force: bool) -> None:
    """Convert SRC (a local mlx-lm / Hugging Face MoE checkpoint dir or an HF repo id)
    into an edge0 checkpoint at OUT."""
    import warnings

    from .checkpoint import human_bytes
    from .conversions import ConversionError, ConvertOptions, convert as run_convert

    # Warnings (e.g. re-quantization) are for the user: their text after the bars, without
    # the Python source line the default display adds.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = run_convert(
                src, out, ConvertOptions(bits=bits, group_size=group_size, force=force, progress_bar=_progress_bar)
            )
        except (ConversionError, ValueError, OSError) as e:
            _fail(str(e))
        finally:
            for w in caught:
                click.echo(f"warning: {w.message}", err=True)
    click.echo(
        f"wrote {report.out}: {report.moe_layers} MoE layers, experts "
        f"{human_bytes(report.expert_bytes)}, resident {human_bytes(report.resident_bytes)}, "
        f"{report.seconds:.1f} s"
    )


@main.command()
@model_option
@click.option("--prompt", "-p", default="def fibonacci(n):", show_default=True)
@click.option("--max-tokens", "-m", default=64, show_default=True)
@click.option(
    "--temp",
    type=float,
    default=None,
    help="Sampling temperature, 0 = greedy.  [default: the checkpoint's generation_config.json, else 0]",
)
@click.option("--top-p", type=float, default=None, help="[default: generation_config.json, else 0 = off]")
@click.option("--top-k", type=int, default=None, help="[default: generation_config.json, else 0 = off]")
@click.option("--min-p", type=float, default=None, help="[default: generation_config.json, else 0 = off]")
@click.option(
    "--repetition-penalty",
    type=float,
    default=None,
    help="Penalty on tokens seen in the last --repetition-context-size tokens.  "
    "[default: generation_config.json, else 1 = off]",
)
@click.option("--repetition-context-size", type=int, default=None, help="[default: generation_config.json, else 20]")
@click.option("--seed", default=0, show_default=True, help="Random seed for sampling (the same seed, the same text).")
@click.option(
    "--chat/--no-chat", default=False, show_default=True, help="Apply the tokenizer's chat template to the prompt."
)
@option_flags
@click.option("--stats", is_flag=True, help="Print telemetry: reads, hits, waits, resident bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print the telemetry as JSON (implies --stats).")
def generate(
    model_path: Optional[Path],
    prompt: str,
    max_tokens: int,
    seed: int,
    chat: bool,
    stats: bool,
    as_json: bool,
    temp: Optional[float],
    top_p: Optional[float],
    top_k: Optional[int],
    min_p: Optional[float],
    repetition_penalty: Optional[float],
    repetition_context_size: Optional[int],
    **option_fields,
) -> None:
    """Generate text with an edge0 checkpoint (stock mlx-lm generation loop).

    Sampling starts from the checkpoint's generation_config.json; the flags override it.
    Under `mlx.launch -n N`, the N processes share the model (--parallel); rank 0 prints."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from . import load
    from .checkpoint import CheckpointError
    from .parallel import settle
    from .sampling import read_sampling
    from .telemetry import format_stats
    from .tensorfile import TensorFileError

    options = _options(**option_fields)
    group = mx.distributed.init()  # one rank of its own unless mlx.launch started this process
    say = click.echo if group.rank() == 0 else (lambda *args, **kwargs: None)
    if max_tokens < 1:
        _fail(f"--max-tokens must be at least 1, got {max_tokens}")
    if not prompt:
        _fail("--prompt is empty: give the model at least one character to continue")
    try:
        if model_path is None:
            from .default_model import ensure_default_model

            model_path = ensure_default_model(log=lambda m: click.echo(m, err=True))
        model, tokenizer = load(model_path, group=group if group.size() > 1 else None, **options.to_dict())
        shipped, source = read_sampling(model_path)
        sampling = shipped.override(
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            repetition_context_size=repetition_context_size,
        )
    except (CheckpointError, TensorFileError, ValueError) as e:
        _fail(str(e))
    except OSError as e:  # e.g. a tokenizer file that cannot be read
        _fail(f"{e.filename or model_path}: cannot be read ({e.strerror or e})")
    model.limit_buffer_cache()  # this process runs this model alone
    origin = f" (from {source.name}; flags override)" if source is not None else ""
    say(f"sampling: {sampling.describe()}, seed {seed}{origin}", err=True)
    mx.random.seed(seed)
    if chat and tokenizer.chat_template is not None:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    model.reset_stats()
    response = None
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=sampling.sampler(),
        logits_processors=sampling.logits_processors(),
    ):
        say(response.text, nl=False)
    say()
    if response is not None:
        say(
            f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.2f} tok/s | "
            f"generation: {response.generation_tokens} tokens, {response.generation_tps:.2f} tok/s | "
            f"peak memory: {response.peak_memory:.3f} GB",
            err=True,
        )
    ranked = {"rank": group.rank(), "ranks": group.size()} if group.size() > 1 else {}
    if as_json:  # every rank: each reads and holds its own share
        click.echo(json.dumps({"edge0_stats": model.stats(), **ranked}, indent=2), err=True)
    elif stats:
        header = f"rank {group.rank()} of {group.size()}:\n" if ranked else ""
        click.echo(header + format_stats(model.stats()), err=True)
    if ranked:  # no rank exits while another still needs it
        settle(group)


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--verify",
    is_flag=True,
    help="Also re-hash every file against the checksums config.json records and check every "
    "float tensor for NaN/inf (reads the whole checkpoint); exit status 1 on any problem.",
)
def info(checkpoint: Path, as_json: bool, verify: bool) -> None:
    """Describe an edge0 checkpoint: layout, sizes, layers, heads and adapters."""
    from .checkpoint import CheckpointError
    from .info import describe, format_description
    from .tensorfile import TensorFileError

    try:
        d = describe(checkpoint)
    except (CheckpointError, TensorFileError) as e:
        _fail(str(e))
    report = _verify(checkpoint) if verify else None
    if report is not None:
        d["verify"] = report.as_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        from .integrity import format_verify

        click.echo(format_description(d) + (f"\n{format_verify(report)}" if report else ""))
    if report is not None and not report.ok:
        raise click.exceptions.Exit(1)


def _verify(checkpoint: Path):
    """``integrity.verify`` with a progress line on a terminal."""
    import sys

    from .integrity import verify

    def progress(done: int, total: int, name: str) -> None:
        click.echo(f"\r\033[Kverifying {done + 1}/{total}: {name}", nl=False, err=True)

    report = verify(checkpoint, progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty():
        click.echo("\r\033[K", nl=False, err=True)
    return report


main.add_command(bench)
main.add_command(train)


@main.group()
def heads() -> None:
    """Prerouter heads of a checkpoint."""


@heads.command("init")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--seed", default=0, show_default=True, help="Seed for fc1's initialisation.")
@click.option(
    "--k", "k", default=0, show_default=True, help="K the consumer layers will route with (0 = the checkpoint's K)."
)
def heads_init(checkpoint: Path, seed: int, k: int) -> None:
    """Write warm-started prerouter heads (each = the next layer's router applied
    to the current hidden) into CHECKPOINT."""
    from . import load_model
    from .checkpoint import CheckpointError
    from .prerouter_heads import PrerouterSpec, init_heads, save_heads
    from .tensorfile import TensorFileError

    try:
        model = load_model(checkpoint, compute_dtype="float32", cache_gib=0, prerouter=False)
    except (CheckpointError, TensorFileError, ValueError) as e:
        _fail(str(e))
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, k or section.num_experts_per_tok)
    try:
        heads = init_heads(model, spec, seed=seed)
    except ValueError as e:
        _fail(str(e))
    path = save_heads(checkpoint, heads, spec)
    click.echo(
        f"wrote {path}: {len(spec.owners)} heads, owners {list(spec.owners)} -> "
        f"consumers {list(spec.consumers)}, K={spec.k}"
    )


@main.command("profile")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--text",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="A UTF-8 text file like what the model will be asked to run; its tokens are counted.",
)
@click.option(
    "--random-tokens",
    type=int,
    default=0,
    help="Count this many seeded random token ids instead (a synthetic checkpoint, which has no text of its own).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of --random-tokens.")
@click.option("--max-tokens", default=4096, show_default=True, help="Count at most this many tokens of --text.")
def profile_command(checkpoint: Path, text: Optional[Path], random_tokens: int, seed: int, max_tokens: int) -> None:
    """Count how often each expert is routed to on a text and write the counts
    into CHECKPOINT (popularity.safetensors): a load seeds its hot cache with
    them, so a short decode keeps the popular experts from its first token."""
    import numpy as np

    from . import load, load_model
    from .checkpoint import CheckpointError, read_config, text_config
    from .popularity import describe_k, measure_profile, save_profile
    from .tensorfile import TensorFileError

    if (text is None) == (random_tokens <= 0):
        _fail("give one of --text FILE or --random-tokens N (N >= 1)")
    if max_tokens < 1:
        _fail(f"--max-tokens must be at least 1, got {max_tokens}")
    if text is not None and not any((checkpoint / name).exists() for name in VOCABULARY_FILES):
        _fail(f"{checkpoint}: no tokenizer to count --text with (a synthetic checkpoint has none: use --random-tokens)")
    options = dict(prerouter=False, lookahead=False, popularity_prior=False)
    try:
        if text is not None:
            model, tokenizer = load(checkpoint, **options)
        else:  # random token ids need no tokenizer (a synthetic checkpoint has none)
            model, tokenizer = load_model(checkpoint, **options), None
    except (CheckpointError, TensorFileError, ValueError) as e:
        _fail(str(e))
    if text is not None:
        try:
            content = text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"{text}: cannot be read as UTF-8 text ({e})")
        tokens = list(tokenizer.encode(content))[:max_tokens]
        if not tokens:
            _fail(f"{text}: no tokens to count (the file is empty)")
        source = f"text {text.name}"
    else:
        vocab = text_config(read_config(checkpoint))["vocab_size"]
        tokens = np.random.default_rng(seed).integers(0, vocab, random_tokens).tolist()
        source = f"random tokens, seed {seed}"
    profile = measure_profile(model, tokens, source)
    path = save_profile(checkpoint, profile)
    click.echo(
        f"wrote {path}: {len(profile.layers)} MoE layers x {profile.counts.shape[1]} experts, "
        f"{profile.tokens} tokens ({source}), {describe_k(profile.layers, profile.k)}"
    )


@main.command("eval")
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--teacher",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="The fp teacher (mlx-lm checkpoint dir, same tokenizer).",
)
@click.option(
    "--sft",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Dir with Phase-2 adapters (e.g. the `train sft --out` dir).",
)
@click.option(
    "--distill",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Dir with Phase-3 adapters (e.g. the `train distill --out` dir).",
)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--windows", default=32, show_default=True, help="Held-out windows scored.")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--max-files", default=0, show_default=True, help="Held-out files read (0 = all).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the result here.")
def eval_command(
    checkpoint: Path,
    teacher: Optional[Path],
    sft: Optional[Path],
    distill: Optional[Path],
    seq_len: int,
    windows: int,
    batch_size: int,
    max_files: int,
    json_path: Optional[Path],
) -> None:
    """Held-out perplexity: fp teacher, int4 exact, warm-start and trained heads,
    each LoRA; head recall vs the free baseline; merge-and-requantize survival."""
    from .checkpoint import CheckpointError
    from .evaluate import EvalOptions, evaluate, format_table, write_result
    from .tensorfile import TensorFileError

    adapters = {name: d for name, d in (("SFT LoRA", sft), ("distill LoRA", distill)) if d is not None}
    try:
        result = evaluate(
            checkpoint,
            teacher,
            adapters,
            EvalOptions(seq_len, windows, batch_size, max_files),
            log=lambda m: click.echo(m, err=True),
        )
    except (CheckpointError, TensorFileError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if json_path is not None:
        write_result(result, json_path)
    click.echo(format_table(result))


main.add_command(serve_command)
