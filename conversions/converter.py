"""``edge0 convert SRC OUT``: an mlx-lm / Hugging Face MoE checkpoint -> edge0 layout.

Guarantees:
- streams: source tensors are loaded lazily and each MoE layer's experts are
  materialised, quantized, written and released before the next layer, so peak
  memory is about one layer plus the resident weights, never the whole model;
- atomic (``mlx_edge0.atomic.atomic_directory``): everything is written into a
  temporary sibling of OUT that is renamed into place at the end; any failure
  or interrupt (SIGTERM too) removes it, leaving no OUT;
  with ``--force`` the new OUT takes the old one's place in one atomic
  exchange where the OS has one (Linux, macOS), so a path under OUT names a
  file of the old checkpoint or of the new one, never nothing;
- trusted: a NaN/inf in any source float tensor (expert weights, quantized
  scales and biases, resident weights) is refused, naming layer, expert and
  tensor; the checkpoint records a fresh generation id (in config.json and
  every safetensors header) and the SHA-256 of every file it writes (see
  ``mlx_edge0.integrity``);
- SRC is only read; OUT may not be SRC or lie inside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from ..atomic import atomic_directory
from ..checkpoint import (
    ALIGNMENT,
    CONFIG_FILE,
    EXPERT_DIR,
    PROJECTIONS,
    RESIDENT_FILE,
    SHIM_FILE,
    SHIM_SOURCE,
    CheckpointError,
    Edge0Section,
    ExpertGeometry,
    expert_file,
    read_config,
    tensor_name,
    text_config,
)
from ..integrity import GENERATION_KEY, new_generation, plural, sha256_file
from ..model_patches import family_for
from ..tensorfile import TensorFileError, TensorWriter, dtype_code, read_header
from .registry import ARCHITECTURES, detect_forms

SMALL_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".jsonl")
SKIP_FILES = {CONFIG_FILE, "model.safetensors.index.json"}


class ConversionError(RuntimeError):
    """The source cannot be converted; the message names the file and problem."""


@dataclass(frozen=True)
class ConvertOptions:
    """``show_progress``: report each layer and tensor written, with
    ``progress_bar(items, label, describe)`` (a context manager yielding
    ``items``; ``describe(item)`` names one; the CLI passes click's bar) or,
    when None, a counter line on stderr."""

    bits: int = 4
    group_size: int = 64
    force: bool = False
    show_progress: bool = True
    progress_bar: Optional[Callable[[list, str, Callable[[Any], str]], ContextManager[Iterable]]] = None


@dataclass(frozen=True)
class Written:
    """A file the converter wrote: its size and SHA-256."""

    nbytes: int
    sha256: str


@dataclass(frozen=True)
class ConvertReport:
    out: Path
    moe_layers: int
    expert_bytes: int
    resident_bytes: int
    seconds: float
    requantized: bool


def resolve_source(src: str | Path) -> Path:
    """A local directory, or a Hugging Face repo id fetched with snapshot_download."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{path}: SRC must be a directory")
        return path.resolve()
    if str(src).count("/") != 1 or str(src).startswith((".", "/", "~")):
        raise ConversionError(f"{src}: no such directory (and not a Hugging Face repo id)")
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            str(src),
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
        )
    )


def _check_paths(src: Path, out: Path, force: bool) -> None:
    if out == src or src in out.parents:
        raise ConversionError(f"{out}: OUT must not be SRC or lie inside it ({src})")
    if out in src.parents:
        raise ConversionError(f"{out}: OUT must not contain SRC ({src})")
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory")


def _load_source_weights(src: Path) -> tuple[dict[str, mx.array], dict[str, Path]]:
    """(tensors, tensor name -> the shard that holds it), loaded lazily."""
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise ConversionError(f"{src}: no model*.safetensors files")
    weights: dict[str, mx.array] = {}
    origin: dict[str, Path] = {}
    for f in files:
        try:
            read_header(f)  # clear error on a truncated / corrupt shard
            shard = mx.load(str(f))
        except TensorFileError as e:
            raise ConversionError(str(e)) from None
        weights.update(shard)
        origin.update(dict.fromkeys(shard, f))
    return weights, origin


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while converting, so that the
    temporary OUT is removed as on Ctrl-C (only the main thread can)."""

    def on_term(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _moe_switch_paths(model: nn.Module, stock_block: type) -> dict[int, str]:
    """MoE layer index -> parameter path of its stacked experts (``...switch_mlp``)."""
    wanted = {id(layer.mlp.switch_mlp): i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, stock_block)}
    paths = {}
    for path, module in model.named_modules():
        if id(module) in wanted:
            paths[wanted[id(module)]] = path
    return dict(sorted(paths.items()))


def _source_projection(weights: dict, prefix: str, proj: str, where: Path):
    """Pop a projection's stacked tensors: (weight, scales|None, biases|None)."""
    key = f"{prefix}.{proj}"
    if f"{key}.weight" not in weights:
        raise ConversionError(f"{where}: no expert weights for {key} after sanitize")
    return (
        weights.pop(f"{key}.weight"),
        weights.pop(f"{key}.scales", None),
        weights.pop(f"{key}.biases", None),
    )


def _quantized_projection(w, scales, biases, in_dims: int, bits: int, group_size: int, warn: Callable):
    """(weight, scales, biases) at ``bits``/``group_size``, re-quantizing if needed."""
    if scales is None:
        return mx.quantize(w, group_size, bits)
    if biases is None:
        raise ConversionError("experts use a quantization mode other than affine; not supported")
    src_group = in_dims // scales.shape[-1]
    src_bits = w.shape[-1] * 32 // in_dims
    if (src_group, src_bits) == (group_size, bits):
        return w, scales, biases
    warn(src_bits, src_group)
    dense = mx.dequantize(w, scales, biases, group_size=src_group, bits=src_bits)
    return mx.quantize(dense.astype(scales.dtype), group_size, bits)


@dataclass
class _Source:
    """A source checkpoint opened lazily: sanitized weights, stock model, MoE layers."""

    path: Path
    config: dict
    model: nn.Module
    weights: dict
    switch_paths: dict[int, str]  # MoE layer -> parameter path of its stacked experts
    origin: dict[str, Path]  # source tensor name -> its shard

    def shards_of(self, layer: Optional[int] = None) -> str:
        """The source shard(s) holding a MoE layer's experts (all shards
        when unknown, or for ``layer=None``), for messages."""
        files = sorted(set(self.origin.values()))
        if layer is not None:
            mine = sorted(
                {f for k, f in self.origin.items() if f".layers.{layer}." in k and ("expert" in k or "switch_mlp" in k)}
            )
            files = mine or files
        return ", ".join(str(f) for f in files)

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.config)["hidden_size"])

    @property
    def moe_intermediate_size(self) -> int:
        return int(text_config(self.config)["moe_intermediate_size"])


def _open_source(src_dir: Path) -> _Source:
    try:
        config = read_config(src_dir)
        family = family_for(config, src_dir / CONFIG_FILE)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if "edge0" in config:
        raise ConversionError(f"{src_dir / CONFIG_FILE}: SRC is already an edge0 checkpoint")
    arch = ARCHITECTURES[family.model_type]
    model = family.stock_module.Model(family.stock_module.ModelArgs.from_dict(config))
    raw, origin = _load_source_weights(src_dir)
    forms = detect_forms(raw)
    weights = model.sanitize(raw)
    switch_paths = _moe_switch_paths(model, family.model_class.stock_block)
    if not switch_paths:
        raise ConversionError(f"{src_dir / CONFIG_FILE}: the config has no MoE layers")
    missing = [i for i, p in switch_paths.items() if f"{p}.gate_proj.weight" not in weights]
    if missing:
        raise ConversionError(
            f"{src_dir}: no routed-expert tensors for MoE layer(s) {missing}; "
            f"{arch.model_type} experts must be stored as one of: {'; '.join(arch.expert_forms)} "
            f"(found: {', '.join(forms) or 'none'})"
        )
    return _Source(src_dir, config, model, weights, switch_paths, origin)


def convert(src: str | Path, out: str | Path, options: ConvertOptions = ConvertOptions()) -> ConvertReport:
    """Convert SRC into an edge0 checkpoint at OUT (see module docstring).

    Raises:
        ConversionError: naming the file and the problem; OUT is not created.
    """
    t0 = time.perf_counter()
    src_dir = resolve_source(src)
    out_dir = Path(out).expanduser().resolve()
    _check_paths(src_dir, out_dir, options.force)
    source = _open_source(src_dir)
    try:
        report = _write_checkpoint(source, out_dir, options)
    except OSError as e:
        raise ConversionError(f"{out_dir}: conversion failed while writing ({e}); nothing was left behind") from e
    return replace(report, seconds=time.perf_counter() - t0)


def _write_checkpoint(source: _Source, out_dir: Path, options: ConvertOptions) -> ConvertReport:
    requantized = []

    def warn(src_bits: int, src_group: int) -> None:
        if not requantized:
            warnings.warn(
                f"{source.path}: experts are {src_bits}-bit group {src_group}; re-quantizing to "
                f"{options.bits}-bit group {options.group_size} (quality may change)",
                stacklevel=2,
            )
        requantized.append(True)

    _check_resident_finite(source)
    generation = new_generation()
    written: dict[str, Written] = {}
    with _sigterm_interrupts(), atomic_directory(out_dir, replace=options.force) as tmp:
        (tmp / EXPERT_DIR).mkdir()
        geometry = None
        with _progress(list(source.switch_paths.items()), options, "experts", lambda it: f"layer {it[0]}") as items:
            for layer, prefix in items:
                stacked = {}
                for proj in PROJECTIONS:
                    in_dims = source.moe_intermediate_size if proj == "down_proj" else source.hidden_size
                    parts = _source_projection(source.weights, prefix, proj, source.path)
                    _check_experts_finite(parts, layer, proj, source.shards_of(layer))
                    q = _quantized_projection(*parts, in_dims, options.bits, options.group_size, warn)
                    mx.eval(q)
                    if q[1] is not parts[1]:  # quantized here (scales of a float16 source can overflow)
                        _check_experts_finite(q, layer, proj, f"{source.shards_of(layer)} after quantization")
                    stacked[proj] = q
                geometry = geometry or _geometry(stacked, options)
                written[expert_file(layer)] = _write_layer(
                    tmp / expert_file(layer), stacked, geometry, layer, source.path, generation
                )
                del stacked
        resident, quantization = _resident_weights(source, options)
        written[RESIDENT_FILE] = _write_resident(tmp / RESIDENT_FILE, resident, options, generation)
        (tmp / SHIM_FILE).write_text(SHIM_SOURCE)
        _copy_small_files(source.path, tmp)
        checksums = {name: w.sha256 for name, w in written.items()}
        for f in sorted(tmp.iterdir()):
            if f.is_file() and f.name not in checksums:
                checksums[f.name] = sha256_file(f)
        section = Edge0Section(
            source_model_type=source.config["model_type"],
            moe_layers=tuple(source.switch_paths),
            experts=geometry,
            num_experts_per_tok=int(text_config(source.config)["num_experts_per_tok"]),
            alignment=ALIGNMENT,
            generation=generation,
            sha256=dict(sorted(checksums.items())),
        )
        _write_config(tmp, source.config, quantization, section)
    return ConvertReport(
        out=out_dir,
        moe_layers=len(source.switch_paths),
        expert_bytes=sum(w.nbytes for name, w in written.items() if name != RESIDENT_FILE),
        resident_bytes=written[RESIDENT_FILE].nbytes,
        seconds=0.0,
        requantized=bool(requantized),
    )


def _progress(
    items: list, options: ConvertOptions, label: str, describe: Callable[[Any], str]
) -> ContextManager[Iterable]:
    """``items`` as they are written, shown by ``options.progress_bar`` (or a
    counter line); ``describe(item)`` names the one being written."""
    if not options.show_progress:
        return nullcontext(items)
    return (options.progress_bar or _counter_line)(items, label, describe)


@contextmanager
def _counter_line(items: list, label: str, describe: Callable[[Any], str]) -> Iterator[Iterable]:
    """``edge0 convert: experts 3/48 (layer 3)``, rewritten in place on stderr."""

    def counted() -> Iterator:
        for i, item in enumerate(items, 1):
            print(f"\redge0 convert: {label} {i}/{len(items)} ({describe(item)})", end="", file=sys.stderr, flush=True)
            yield item
        print(file=sys.stderr)

    yield counted()


def _nonfinite_rows(a: mx.array) -> list[int]:
    """NaN/inf count in each ``a[i]`` (all zero for integer tensors)."""
    if not mx.issubdtype(a.dtype, mx.floating):
        return [0] * (a.shape[0] if a.ndim else 1)
    bad = mx.logical_not(mx.isfinite(a)).reshape(a.shape[0] if a.ndim else 1, -1)
    return bad.sum(axis=1).tolist()


def _check_experts_finite(parts, layer: int, proj: str, where: str) -> None:
    """Refuse a NaN/inf in any stacked expert tensor of one projection
    (weight, scales, biases; None parts skipped), naming the first expert."""
    for part, a in zip(("weight", "scales", "biases"), parts):
        if a is None:
            continue
        rows = _nonfinite_rows(a)
        bad = [e for e, n in enumerate(rows) if n]
        if bad:
            e = bad[0]
            more = f" (and {plural(len(bad) - 1, 'more expert')})" if len(bad) > 1 else ""
            raise ConversionError(
                f"layer {layer}, expert {e}, {proj}.{part}: {plural(rows[e], 'non-finite value')} "
                f"(NaN/inf){more} in {where}"
            )


def _check_resident_finite(source: _Source) -> None:
    """Refuse a NaN/inf in any non-expert float tensor, before anything is written."""
    experts = tuple(f"{p}." for p in source.switch_paths.values())
    for name, a in source.weights.items():
        if name.startswith(experts) or not mx.issubdtype(a.dtype, mx.floating):
            continue
        n = mx.logical_not(mx.isfinite(a)).sum().item()
        if n:
            where = source.origin.get(name) or source.shards_of()
            raise ConversionError(f"{name}: {plural(n, 'non-finite value')} (NaN/inf) in {where}")


def _geometry(stacked: dict, options: ConvertOptions) -> ExpertGeometry:
    w, scales, _ = stacked["gate_proj"]
    num_experts, inter, _ = w.shape
    hidden = stacked["down_proj"][0].shape[1]
    return ExpertGeometry(
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=inter,
        bits=options.bits,
        group_size=options.group_size,
        scales_dtype=dtype_code(scales.dtype),
    )


def _write_layer(
    path: Path, stacked: dict, geometry: ExpertGeometry, layer: int, src: Path, generation: str
) -> Written:
    """Write one layer's experts, each bundle contiguous and aligned."""
    pad = geometry.pad_bytes(ALIGNMENT)
    zeros = bytes(pad)
    for proj, (w, s, b) in stacked.items():
        for part, arr in (("weight", w), ("scales", s), ("biases", b)):
            dtype, shape = geometry.part_spec(proj, part)
            if arr.shape != (geometry.num_experts, *shape) or dtype_code(arr.dtype) != dtype:
                raise ConversionError(
                    f"{src}: layer {layer} {proj}.{part} is {arr.dtype}{list(arr.shape)}, "
                    f"inconsistent with the other MoE layers ({dtype}{[geometry.num_experts, *shape]})"
                )
    entries = geometry.file_entries(ALIGNMENT)
    metadata = {
        "format": "edge0-experts",
        "layer": str(layer),
        "bits": str(geometry.bits),
        "group_size": str(geometry.group_size),
        GENERATION_KEY: generation,
    }
    with TensorWriter(path, entries, metadata, alignment=ALIGNMENT) as writer:
        for e in range(geometry.num_experts):
            for proj in PROJECTIONS:
                for part, arr in zip(("weight", "scales", "biases"), stacked[proj]):
                    writer.write(tensor_name(e, proj, part), arr[e])
            if pad:
                writer.write(f"experts.{e}.pad", zeros)
    return Written(path.stat().st_size, writer.sha256)


def _resident_weights(source: _Source, options: ConvertOptions):
    """Non-expert weights quantized as mlx-lm would (or as the source already is)."""
    model, config, weights = source.model, source.config, source.weights
    for i in source.switch_paths:
        delattr(model.layers[i].mlp, "switch_mlp")
    if config.get("quantization"):
        quantization = {k: v for k, v in config["quantization"].items() if ".switch_mlp" not in k}
        return weights, quantization
    model.load_weights(list(weights.items()), strict=True)
    # mlx-lm prints "[INFO] Quantized model with N bits per weight" (of the resident part
    # alone, since the experts are gone) to stdout, between convert's progress bars.
    with contextlib.redirect_stdout(io.StringIO()):
        model, qconfig = quantize_model(
            model, dict(config), group_size=options.group_size, bits=options.bits, mode="affine"
        )
    return dict(tree_flatten(model.parameters())), qconfig["quantization"]


def _write_resident(path: Path, weights: dict, options: ConvertOptions, generation: str) -> Written:
    names = sorted(weights)
    entries = [(n, dtype_code(weights[n].dtype), tuple(weights[n].shape)) for n in names]
    with TensorWriter(path, entries, {"format": "mlx", GENERATION_KEY: generation}) as writer:
        with _progress(names, options, "resident tensors", str) as items:
            for name in items:
                writer.write(name, weights.pop(name))  # release as written
    return Written(path.stat().st_size, writer.sha256)


def _write_config(out: Path, config: dict, quantization: dict, section: Edge0Section) -> None:
    config = dict(config)
    config["quantization"] = quantization
    config["quantization_config"] = quantization
    config["model_file"] = SHIM_FILE
    config["edge0"] = section.to_dict()
    with open(out / CONFIG_FILE, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _copy_small_files(src: Path, out: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in SMALL_FILE_SUFFIXES and f.name not in SKIP_FILES:
            shutil.copy2(f, out / f.name)
