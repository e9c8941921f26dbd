"""``edge0 convert SRC OUT``: an mlx-lm / Hugging Face MoE checkpoint -> edge0 layout.

Guarantees:
- streams: source tensors are loaded lazily and each MoE layer's experts are
  materialised, quantized, written and released before the next layer, so peak
  memory is about one layer plus the resident weights, never the whole model;
- atomic: everything is written into a temporary sibling of OUT that is renamed
  into place at the end; any failure or interrupt removes it, leaving no OUT;
- SRC is only read; OUT may not be SRC or lie inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

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
from ..model_patches import family_for
from ..tensorfile import TensorFileError, TensorWriter, dtype_code, read_header
from .registry import ARCHITECTURES, detect_forms

SMALL_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".jsonl")
SKIP_FILES = {CONFIG_FILE, "model.safetensors.index.json"}


class ConversionError(RuntimeError):
    """The source cannot be converted; the message names the file and problem."""


@dataclass(frozen=True)
class ConvertOptions:
    bits: int = 4
    group_size: int = 64
    force: bool = False
    show_progress: bool = True


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


def _load_source_weights(src: Path) -> dict[str, mx.array]:
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise ConversionError(f"{src}: no model*.safetensors files")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            read_header(f)  # clear error on a truncated / corrupt shard
            weights.update(mx.load(str(f)))
        except TensorFileError as e:
            raise ConversionError(str(e)) from None
    return weights


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(out: Path) -> list[Path]:
    """Remove temp dirs that a killed convert (SIGKILL, power loss) left next
    to ``out``: those whose writer process no longer runs."""
    removed = []
    for kind in ("tmp", "old"):
        for path in out.parent.glob(f".{out.name}.edge0-{kind}-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


@contextmanager
def _atomic_dir(out: Path):
    """Yield a temp dir next to ``out``; rename it to ``out`` on success."""
    if out.parent.exists():
        remove_stale_temp_dirs(out)
    tmp = out.parent / f".{out.name}.edge0-tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    in_main = True
    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        in_main = False
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.edge0-old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _moe_switch_paths(model: nn.Module, stock_block: type) -> dict[int, str]:
    """MoE layer index -> parameter path of its stacked experts (``...switch_mlp``)."""
    wanted = {id(layer.mlp.switch_mlp): i for i, layer in enumerate(model.layers)
              if isinstance(layer.mlp, stock_block)}
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
    raw = _load_source_weights(src_dir)
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
    return _Source(src_dir, config, model, weights, switch_paths)


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
        raise ConversionError(
            f"{out_dir}: conversion failed while writing ({e}); nothing was left behind"
        ) from e
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

    with _atomic_dir(out_dir) as tmp:
        (tmp / EXPERT_DIR).mkdir()
        geometry = None
        expert_bytes = 0
        with _progress(list(source.switch_paths.items()), options.show_progress, "experts") as items:
            for layer, prefix in items:
                stacked = {}
                for proj in PROJECTIONS:
                    in_dims = source.moe_intermediate_size if proj == "down_proj" else source.hidden_size
                    q = _quantized_projection(
                        *_source_projection(source.weights, prefix, proj, source.path),
                        in_dims, options.bits, options.group_size, warn,
                    )
                    mx.eval(q)
                    stacked[proj] = q
                geometry = geometry or _geometry(stacked, options)
                expert_bytes += _write_layer(tmp / expert_file(layer), stacked, geometry, layer, source.path)
                del stacked
        resident, quantization = _resident_weights(source, options)
        resident_bytes = _write_resident(tmp / RESIDENT_FILE, resident, options.show_progress)
        section = Edge0Section(
            source_model_type=source.config["model_type"],
            moe_layers=tuple(source.switch_paths),
            experts=geometry,
            num_experts_per_tok=int(text_config(source.config)["num_experts_per_tok"]),
            alignment=ALIGNMENT,
        )
        _write_config(tmp, source.config, quantization, section)
        (tmp / SHIM_FILE).write_text(SHIM_SOURCE)
        _copy_small_files(source.path, tmp)
    return ConvertReport(
        out=out_dir,
        moe_layers=len(source.switch_paths),
        expert_bytes=expert_bytes,
        resident_bytes=resident_bytes,
        seconds=0.0,
        requantized=bool(requantized),
    )


def _progress(items, show: bool, label: str):
    import click

    return click.progressbar(
        items, label=f"edge0 convert: {label}", file=None if show else open(os.devnull, "w"),
        item_show_func=lambda it: f"layer {it[0]}" if it else "",
    )


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


def _write_layer(path: Path, stacked: dict, geometry: ExpertGeometry, layer: int, src: Path) -> int:
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
    metadata = {"format": "edge0-experts", "layer": str(layer), "bits": str(geometry.bits),
                "group_size": str(geometry.group_size)}
    with TensorWriter(path, entries, metadata, alignment=ALIGNMENT) as writer:
        for e in range(geometry.num_experts):
            for proj in PROJECTIONS:
                for part, arr in zip(("weight", "scales", "biases"), stacked[proj]):
                    writer.write(tensor_name(e, proj, part), arr[e])
            if pad:
                writer.write(f"experts.{e}.pad", zeros)
    return path.stat().st_size


def _resident_weights(source: _Source, options: ConvertOptions):
    """Non-expert weights quantized as mlx-lm would (or as the source already is)."""
    model, config, weights = source.model, source.config, source.weights
    for i in source.switch_paths:
        delattr(model.layers[i].mlp, "switch_mlp")
    if config.get("quantization"):
        quantization = {
            k: v for k, v in config["quantization"].items() if ".switch_mlp" not in k
        }
        return weights, quantization
    model.load_weights(list(weights.items()), strict=True)
    model, qconfig = quantize_model(
        model, dict(config), group_size=options.group_size, bits=options.bits, mode="affine"
    )
    return dict(tree_flatten(model.parameters())), qconfig["quantization"]


def _write_resident(path: Path, weights: dict, show_progress: bool) -> int:
    names = sorted(weights)
    entries = [(n, dtype_code(weights[n].dtype), tuple(weights[n].shape)) for n in names]
    with TensorWriter(path, entries, {"format": "mlx"}) as writer:
        bar = _progress([(n,) for n in names], show_progress, "resident")
        with bar as items:
            for (name,) in items:
                writer.write(name, weights.pop(name))  # release as written
    return path.stat().st_size


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
