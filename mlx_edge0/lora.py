"""Unmerged recovery LoRA on the resident projections of an edge0 model.

A target projection computes ``y = W_int4 x + (alpha / r) * B A x`` with
mlx-lm's :class:`~mlx_lm.tuner.lora.LoRALinear`: the int4 base stays as it is
and the low-rank delta runs beside it. It is never merged when serving: the
delta's RMS is below the 4-bit group step, so merging and requantizing would
erase most of it (``edge0 eval`` measures how much survives).

Targets are declared per family (``lora_targets`` on each patched Model in
``model_patches``: attention, linear-attention, shared-expert and dense-MLP
projections, by their name inside a decoder layer). Routers, gates and the
streamed routed experts are never targets.

Files, in the checkpoint dir (or any dir handed to :func:`apply_adapters`):
``adapters.safetensors`` (``{target}.lora_a`` ``[in, r]`` and
``{target}.lora_b`` ``[r, out]``) and ``adapter_config.json`` — mlx-lm's
adapter fields (``fine_tune_type``, ``num_layers``, ``lora_parameters`` with
rank, scale and layer-relative ``keys``) plus an ``edge0`` section: format,
version, alpha, the full target paths, the consumer-layer K the adapters were
trained with, and a source hash (SHA-256 of the target projections' base
tensors in ``model.safetensors``). Reading validates all of it against the
checkpoint's own files and names the file on any mismatch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from .atomic import atomic_path, write_json_atomic
from .checkpoint import CONFIG_FILE, RESIDENT_FILE, CheckpointError, read_config
from .integrity import GENERATION_KEY, check_generation, record_sha256, sha256_file
from .tensorfile import TensorFileError, TensorHeader, read_header, tensors_sha256

ADAPTERS_FILE = "adapters.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FORMAT = "edge0-lora"
ADAPTER_VERSION = 1
RANK = 16
ALPHA = 32.0
KINDS = ("attention", "linear_attention", "shared_expert", "dense_mlp")
LAYER_PATH = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")
BASE_PARTS = ("weight", "scales", "biases", "bias")


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` records (see the module docstring)."""

    targets: tuple[str, ...]
    k: int
    source_hash: str
    rank: int = RANK
    alpha: float = ALPHA

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self, num_layers: int) -> dict:
        keys = sorted({LAYER_PATH.fullmatch(t)[2] for t in self.targets})
        return {
            "fine_tune_type": "lora",
            "num_layers": num_layers,
            "lora_parameters": {"rank": self.rank, "scale": self.scale, "dropout": 0.0, "keys": keys},
            "edge0": {
                "format": ADAPTER_FORMAT,
                "version": ADAPTER_VERSION,
                "alpha": self.alpha,
                "targets": list(self.targets),
                "k": self.k,
                "source_hash": self.source_hash,
            },
        }


@dataclass(frozen=True)
class Adapters:
    """Validated adapter files: the config, each target's (in, out) dims and kind."""

    config: AdapterConfig
    directory: Path
    dims: dict[str, tuple[int, int]]
    kinds: dict[str, str]
    nbytes: int  # of adapters.safetensors' tensors

    def tensors(self) -> dict[str, mx.array]:
        return mx.load(str(self.directory / ADAPTERS_FILE))

    def with_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Resident weights renamed for wrapped targets (``t.weight`` ->
        ``t.linear.weight``) plus the adapter tensors: what a model with
        :func:`attach`-ed targets loads strictly."""
        targets = set(self.config.targets)
        out = {}
        for name, value in weights.items():
            owner, _, part = name.rpartition(".")
            out[f"{owner}.linear.{part}" if owner in targets and part in BASE_PARTS else name] = value
        out.update(self.tensors())
        return out


def declared_targets(model_class: type) -> dict[str, str]:
    """Layer-relative projection name -> kind, as the family declares them."""
    return dict(getattr(model_class, "lora_targets", {}))


def lora_targets(model: nn.Module) -> dict[str, str]:
    """Full module path -> kind of every target projection in ``model``."""
    declared = declared_targets(type(model))
    found = {}
    for path, module in model.named_modules():
        m = LAYER_PATH.fullmatch(path)
        if m and m[2] in declared and isinstance(module, (nn.Linear, nn.QuantizedLinear, LoRALinear)):
            found[path] = declared[m[2]]
    return dict(sorted(found.items(), key=lambda kv: _path_key(kv[0])))


def _path_key(path: str) -> tuple:
    m = LAYER_PATH.fullmatch(path)
    return (int(m[1]), m[2]) if m else (-1, path)


def attach(model: nn.Module, targets: tuple[str, ...], rank: int = RANK, alpha: float = ALPHA) -> None:
    """Wrap each target projection in a ``LoRALinear`` (A random, B zero: the
    model's output is unchanged). Draws from MLX's global RNG: seed first."""
    modules = dict(model.named_modules())
    wrapped = []
    for path in targets:
        base = modules[path]
        if isinstance(base, LoRALinear):
            raise ValueError(f"{path} already has a LoRA adapter")
        wrapped.append((path, LoRALinear.from_base(base, r=rank, scale=alpha / rank)))
    model.update_modules(tree_unflatten(wrapped))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


def detach(model: nn.Module) -> None:
    """Put the base projections back (drops the adapters)."""
    model.update_modules(tree_unflatten([(p, m.linear) for p, m in lora_modules(model).items()]))


def train_only_adapters(model: nn.Module) -> None:
    """Freeze everything but the LoRA A and B matrices."""
    model.freeze()
    for m in lora_modules(model).values():
        m.unfreeze(recurse=False, keys=["lora_a", "lora_b"])


def consumer_k(model: nn.Module) -> int:
    """The K the model's prerouted (consumer) layers route with (the native K without heads)."""
    runtime = model.edge0_runtime
    prerouter = model.edge0_section.prerouter
    consumers = prerouter["consumers"] if prerouter else model.edge0_section.moe_layers
    return runtime.k_of[consumers[0]]


def targets_hash(checkpoint: Path, targets: tuple[str, ...]) -> str:
    """SHA-256 over the targets' base tensors in ``model.safetensors`` (in
    target order; name + bytes): adapters are tied to exactly these weights.
    Stored as the adapter config's ``source_hash``."""
    names = [f"{target}.{part}" for target in targets for part in BASE_PARTS]
    return tensors_sha256(Path(checkpoint) / RESIDENT_FILE, names)


def save_adapters(out_dir: Path, model: nn.Module, checkpoint: Path, k: int) -> Path:
    """Write the model's adapters (every ``LoRALinear``) and their config into
    ``out_dir``, each file atomically; ``checkpoint`` is the edge0 checkpoint
    they belong to (for the source hash and its generation). Saved into the
    checkpoint itself, both files' SHA-256 go into its config.json, so
    ``edge0 info --verify`` covers them as it covers the heads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save")
    first = next(iter(modules.values()))
    rank = first.lora_a.shape[1]
    targets = tuple(sorted(modules, key=_path_key))
    config = AdapterConfig(targets, k, targets_hash(checkpoint, targets), rank, first.scale * rank)
    tensors = {}
    for path in targets:
        tensors[f"{path}.lora_a"] = modules[path].lora_a
        tensors[f"{path}.lora_b"] = modules[path].lora_b
    generation = read_config(checkpoint).get("edge0", {}).get(GENERATION_KEY)
    metadata = {"format": ADAPTER_FORMAT, **({GENERATION_KEY: generation} if generation else {})}
    # both written before either replaces its file (the tensors first)
    with atomic_path(out_dir / ADAPTER_CONFIG_FILE) as tmp_config, atomic_path(out_dir / ADAPTERS_FILE) as tmp:
        mx.save_safetensors(str(tmp), tensors, metadata=metadata)
        tmp_config.write_text(json.dumps(config.to_dict(len(model.layers)), indent=2) + "\n")
    if out_dir.resolve() == Path(checkpoint).resolve():
        checkpoint_config = read_config(checkpoint)
        recorded = [
            record_sha256(checkpoint_config, f, sha256_file(out_dir / f)) for f in (ADAPTERS_FILE, ADAPTER_CONFIG_FILE)
        ]
        if all(recorded):
            write_json_atomic(out_dir / CONFIG_FILE, checkpoint_config, indent=2, sort_keys=True)
    return out_dir / ADAPTERS_FILE


def has_adapters(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / ADAPTERS_FILE).exists() or (directory / ADAPTER_CONFIG_FILE).exists()


def _base_dims(header: TensorHeader, config: dict, target: str) -> Optional[tuple[int, int]]:
    """(in, out) of a target's base projection from the resident header and
    the quantization config (mlx-lm's per-path overrides first)."""
    weight = header.entries.get(f"{target}.weight")
    if weight is None or len(weight.shape) != 2:
        return None
    out_dims, cols = weight.shape
    if f"{target}.scales" not in header.entries:
        return cols, out_dims
    quant = config.get("quantization") or {}
    bits = (quant.get(target) if isinstance(quant.get(target), dict) else quant).get("bits")
    return cols * 32 // bits, out_dims


def read_adapters(checkpoint: Path, directory: Optional[Path] = None, k: int = 0) -> Adapters:
    """Validate the adapter files in ``directory`` (default: the checkpoint)
    against the edge0 checkpoint: format, targets, shapes, source hash, and K
    (``k`` = the consumer-layer K the model routes with; 0 skips that check).

    Raises:
        CheckpointError: naming the adapter file and the problem.
    """
    from .model_patches import family_for

    checkpoint = Path(checkpoint)
    directory = Path(directory) if directory is not None else checkpoint
    config_path, tensors_path = directory / ADAPTER_CONFIG_FILE, directory / ADAPTERS_FILE
    for path, other in ((config_path, tensors_path), (tensors_path, config_path)):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (it comes as a pair with {other.name})")
    try:
        raw = json.loads(config_path.read_text())
        section = raw["edge0"]
        config = AdapterConfig(
            tuple(str(t) for t in section["targets"]),
            int(section["k"]),
            str(section["source_hash"]),
            int(raw["lora_parameters"]["rank"]),
            float(section["alpha"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_path}: not a valid edge0 adapter config ({e!r})") from None

    def fail(path: Path, problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}")

    if section.get("format") != ADAPTER_FORMAT or section.get("version") != ADAPTER_VERSION:
        raise fail(
            config_path,
            f"not an edge0 adapter config of version {ADAPTER_VERSION} "
            f"(format {section.get('format')!r}, version {section.get('version')!r})",
        )
    if config.rank < 1 or not config.alpha > 0 or not config.targets:
        raise fail(
            config_path, f"rank {config.rank} and alpha {config.alpha} must be positive, with at least one target"
        )
    model_config = read_config(checkpoint)
    declared = declared_targets(family_for(model_config, checkpoint / CONFIG_FILE).model_class)
    resident = read_header(checkpoint / RESIDENT_FILE)
    dims, kinds = {}, {}
    for target in config.targets:
        m = LAYER_PATH.fullmatch(target)
        if m is None or m[2] not in declared:
            raise fail(
                config_path,
                f"{target} is not a LoRA target of {model_config['model_type']} (targets: {sorted(declared)})",
            )
        found = _base_dims(resident, model_config, target)
        if found is None:
            raise fail(config_path, f"{target} has no base projection in {checkpoint / RESIDENT_FILE}")
        dims[target], kinds[target] = found, declared[m[2]]
    if config.source_hash != targets_hash(checkpoint, config.targets):
        raise fail(config_path, "adapters were made for another model (target weights differ: source_hash mismatch)")
    if k and config.k != k:
        raise fail(
            config_path,
            f"adapters were trained with K={config.k} on the prerouted layers, "
            f"but the model routes K={k} (train adapters for this K, or turn LoRA off)",
        )
    try:
        header = read_header(tensors_path)
        if directory.resolve() == checkpoint.resolve():  # adapters kept elsewhere outlive a re-convert
            check_generation(
                tensors_path, header.metadata, model_config.get("edge0", {}).get(GENERATION_KEY), required=False
            )
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    want = {}
    for target, (in_dims, out_dims) in dims.items():
        want[f"{target}.lora_a"] = (in_dims, config.rank)
        want[f"{target}.lora_b"] = (config.rank, out_dims)
    if set(header.entries) != set(want):
        missing, extra = sorted(set(want) - set(header.entries)), sorted(set(header.entries) - set(want))
        raise fail(
            tensors_path, f"tensors do not match {ADAPTER_CONFIG_FILE} (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for name, shape in want.items():
        entry = header.entries[name]
        if tuple(entry.shape) != shape or entry.dtype not in ("F32", "F16", "BF16"):
            raise fail(
                tensors_path,
                f"{name} is {entry.dtype} {list(entry.shape)}, expected a float tensor of shape {list(shape)}",
            )
    return Adapters(config, directory, dims, kinds, sum(e.nbytes for e in header.entries.values()))


def apply_adapters(model: nn.Module, directory: Path) -> Adapters:
    """Attach the validated adapters in ``directory`` to a model loaded
    without LoRA (e.g. to compare several adapter sets on one model)."""
    adapters = read_adapters(model.edge0_checkpoint_dir, directory, consumer_k(model))
    attach(model, adapters.config.targets, adapters.config.rank, adapters.config.alpha)
    dtype = model.edge0_runtime.compute_dtype
    weights = [(n, v.astype(dtype) if dtype is not None else v) for n, v in adapters.tensors().items()]
    model.load_weights(weights, strict=False)
    mx.eval(model.parameters())
    return adapters
