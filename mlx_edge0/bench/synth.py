"""Random-weight stock mlx-lm int4 checkpoints with the shapes of public models.

The output is what ``mlx_lm.convert -q --q-bits 4 --q-group-size 64`` writes
for the real model: the same config (with mlx-lm's per-path quantization
overrides from the model's ``quant_predicate``), the same parameter names,
shapes and dtypes, sharded safetensors plus an index. Names, shapes and dtypes
come from building the stock model class and quantizing it lazily, so nothing
is allocated for the model itself; tensor bytes are generated and written one
at a time, so peak memory stays at about one tensor.

Values are random but well behaved: quantized weights are zero-mean with the
spread of mlx-lm's default ``Linear`` init, routers are spread out so tokens
pick different experts, and small parameters (norms, ``A_log``, ``dt_bias``,
conv kernels) keep the stock class's own initial values. The same seed gives
the same bytes, and a tensor's bytes do not depend on how many layers are
written.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import math
import re
import time
import zlib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import (
    get_total_parameters,
    quantize_model,
    save_config,
)

from ..atomic import atomic_directory
from ..checkpoint import text_config
from ..model_patches import resolve_model_type
from ..progress import note
from ..tensorfile import TensorWriter, dtype_code
from .synthetic_router import ROUTINGS, calibrate_routers, patch_tensors

GEOMETRIES_FILE = Path(__file__).with_name("geometries.json")
BITS, GROUP_SIZE = 4, 64
SAVE_DTYPE = "bfloat16"

# How each mlx-lm module's model is published: (config model_type, architecture).
PUBLISHED = {
    "bailing_moe_v3": ("bailing_hybrid", "BailingMoeV3ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

LINEAR_STD_GAIN = 1 / math.sqrt(3)  # std of nn.Linear's uniform(+-1/sqrt(in)) init, x sqrt(in)
ROUTER_STD = 2.0  # router logit std for unit-RMS inputs: tokens disagree on experts
EXPERT_BIAS_STD = 0.1  # comparable to sigmoid score gaps, so the bias changes picks
STOCK_INIT_MAX = 1 << 16  # floats this small keep the stock class's init values
ROUTER_SUFFIXES = ("mlp.gate.weight", "shared_expert_gate.weight")


def geometries() -> dict[str, dict]:
    """Public geometries by name (keys starting with ``_`` are notes)."""
    raw = json.loads(GEOMETRIES_FILE.read_text(encoding="utf-8"))
    return {
        name: {k: v for k, v in geo.items() if not k.startswith("_")}
        for name, geo in raw.items()
        if not name.startswith("_")
    }


@dataclass(frozen=True)
class SynthOptions:
    """What to synthesize.

    Attributes:
        geometry: a name in ``geometries.json``.
        layers: keep only this many decoder layers (per-layer shapes unchanged).
        seed: the same seed writes the same bytes.
        force: replace an existing output directory.
        overrides: text-config fields to change, e.g. to shrink widths for tests.
        quantize_embeddings: also quantize the input embeddings and lm_head
            where the model's ``quant_predicate`` keeps them in bf16 (e.g.
            bailing_moe_v3), as a checkpoint quantized by other tools would be.
        routing: ``random`` (random routers: locality is an accident of the
            init), ``uniform`` or ``calibrated`` (routers set so the
            checkpoint's own routing has that locality; see
            :mod:`~.synthetic_router`).
    """

    geometry: str
    layers: Optional[int] = None
    seed: int = 0
    force: bool = False
    overrides: dict = field(default_factory=dict)
    quantize_embeddings: bool = False
    routing: str = "random"

    def __post_init__(self):
        known = geometries()
        if self.geometry not in known:
            raise ValueError(f"unknown geometry {self.geometry!r}; choose one of {', '.join(known)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be at least 1, got {self.layers}")
        text = text_config(source_config(self))
        interval, n = text.get("full_attention_interval"), text["num_hidden_layers"]
        if interval and n < interval:
            raise ValueError(
                f"{self.geometry} needs --layers >= {interval} (full_attention_interval): "
                "mlx-lm's model looks up the first full-attention layer's cache"
            )


def synthetic_origin(options: SynthOptions) -> dict:
    """What ``config.json`` records about how a checkpoint was synthesized."""
    origin = {
        "geometry": options.geometry,
        "seed": options.seed,
        "layers": text_config(source_config(options))["num_hidden_layers"],
    }
    if options.quantize_embeddings:
        origin["quantized_embeddings"] = True
    if options.routing != "random":
        origin["routing"] = options.routing
    return origin


@dataclass(frozen=True)
class SynthReport:
    path: Path
    shards: int
    tensors: int
    total_bytes: int
    seconds: float
    router_seconds: float = 0.0


def source_config(options: SynthOptions) -> dict:
    """The Hugging Face config.json of the real model, shrunk as the options say."""
    geo = copy.deepcopy(geometries()[options.geometry])
    module = geo.pop("model_type")
    model_type, arch = PUBLISHED[module]
    if module == "bailing_moe_v3":
        args_class = importlib.import_module(f"mlx_lm.models.{module}").ModelArgs
        defaults = {f.name: f.default for f in fields(args_class) if f.default is not MISSING}
        geo = {k: v for k, v in defaults.items() if k != "model_type"} | geo
    config = {"architectures": [arch], "model_type": model_type, **geo}
    config["torch_dtype"] = SAVE_DTYPE
    text = text_config(config)
    if options.layers is not None:
        text["num_hidden_layers"] = options.layers
    text.update(copy.deepcopy(options.overrides))
    return config


def quantized_model(config: dict, seed: int, quantize_embeddings: bool = False) -> tuple[nn.Module, dict]:
    """The stock model, cast and quantized as ``mlx_lm.convert -q`` does, still lazy
    (with ``quantize_embeddings``, the embeddings and lm_head too).

    Returns the model (no parameter evaluated) and the config mlx-lm would save.
    """
    arch = importlib.import_module(f"mlx_lm.models.{resolve_model_type(config)}")
    mx.random.seed(seed)  # stock random inits (e.g. Qwen3.5's A_log) become deterministic
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    keep = getattr(model, "cast_predicate", lambda _: True)
    dtype = getattr(mx, SAVE_DTYPE)

    def cast(path: str, v: mx.array) -> mx.array:
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(cast, model.parameters()))
    stock_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module):
        if quantize_embeddings and (isinstance(module, nn.Embedding) or path.endswith("lm_head")):
            return True
        return stock_predicate(path, module) if stock_predicate else True

    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        model, qconfig = quantize_model(model, config, GROUP_SIZE, BITS, quant_predicate=predicate)
    return model, qconfig


def _quantized_modules(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (bits, group_size) for every quantized module."""
    return {
        path: (m.bits, m.group_size)
        for path, m in model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    }


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def _bf16_bits(x: float) -> int:
    """bfloat16 bit pattern of ``x``, rounded to nearest even."""
    u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def float_noise(rng: np.random.Generator, shape: tuple, std: float, code: str) -> np.ndarray:
    """Zero-mean random floats of about ``std``, built from random bits.

    Sign and 7 mantissa bits are random and the exponent is fixed, so values
    are uniform in +-[2^e, 2^(e+1)) with std 2^e * sqrt(7/3). Two integer ops on
    random words instead of float math keeps this near memory speed.
    """
    e = round(math.log2(std / math.sqrt(7 / 3)))
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= 0x807F
    bits |= np.uint16((e + 127) << 7)
    if code == "BF16":
        return bits
    if code == "F32":
        return bits.astype(np.uint32) << 16
    raise ValueError(f"no random generator for {code} floats")


def tensor_data(
    name: str,
    value: mx.array,
    quantized: dict[str, tuple[int, int]],
    seed: int,
) -> np.ndarray | mx.array:
    """The bytes to store for one parameter (``value`` is its lazy stock array)."""
    parent, _, leaf = name.rpartition(".")
    code = dtype_code(value.dtype)
    shape = tuple(value.shape)
    rng = _rng(seed, name)
    router = name.endswith(ROUTER_SUFFIXES)
    if parent in quantized and leaf in ("weight", "scales", "biases"):
        bits, group_size = quantized[parent]
        if leaf == "weight":
            return rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
        in_dims = shape[-1] * group_size
        levels = 2**bits - 1
        level_std = math.sqrt((levels + 2) * levels / 12)  # std of uniform 0..levels
        std = (ROUTER_STD if router else LINEAR_STD_GAIN) / math.sqrt(in_dims)
        scale = _bf16_bits(std / level_std)
        scale_value = float(np.array([scale << 16], np.uint32).view(np.float32)[0])
        fill = scale if leaf == "scales" else _bf16_bits(-levels / 2 * scale_value)
        if code != "BF16":
            raise ValueError(f"{name}: expected bfloat16 quantization scales, got {code}")
        return np.full(shape, fill, dtype=np.uint16)
    if not mx.issubdtype(value.dtype, mx.floating):
        return value
    if router:
        return float_noise(rng, shape, ROUTER_STD / math.sqrt(shape[-1]), code)
    if name.endswith("expert_bias"):
        return float_noise(rng, shape, EXPERT_BIAS_STD, code)
    if value.size <= STOCK_INIT_MAX:
        return value
    return float_noise(rng, shape, LINEAR_STD_GAIN / math.sqrt(shape[-1]), code)


@dataclass(frozen=True)
class Shard:
    file: str
    label: str
    names: list[str]


def plan_shards(names: list[str]) -> list[Shard]:
    """One shard per decoder layer, plus one before (embeddings) and one after (head).

    ``names`` are in model order, as ``tree_flatten`` yields them.
    """
    groups: list[tuple[str, list[str]]] = []
    for name in names:
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m:
            label = f"layer {m.group(1)}"
        else:
            label = "embeddings" if not any(g[0].startswith("layer") for g in groups) else "head"
        if not groups or groups[-1][0] != label:
            groups.append((label, []))
        groups[-1][1].append(name)
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", label, group) for i, (label, group) in enumerate(groups)]


def _write_shards(
    out: Path,
    model: nn.Module,
    seed: int,
    progress: Callable[[str], None],
) -> tuple[dict, int, int]:
    params = dict(tree_flatten(model.parameters()))
    quantized = _quantized_modules(model)
    shards = plan_shards(list(params))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        start = time.perf_counter()
        entries = [(n, dtype_code(params[n].dtype), tuple(params[n].shape)) for n in shard.names]
        with TensorWriter(out / shard.file, entries, metadata={"format": "mlx"}) as writer:
            for n in shard.names:
                writer.write(n, tensor_data(n, params[n], quantized, seed))
                weight_map[n] = shard.file
            size = writer.data_bytes
        total += size
        seconds = time.perf_counter() - start
        progress(
            f"[synth] {i + 1}/{len(shards)} {shard.label}: {size / 1e6:.1f} MB "
            f"in {seconds:.2f} s ({size / 1e6 / max(seconds, 1e-9):.0f} MB/s)"
        )
    index = {
        "metadata": {"total_size": total, "total_parameters": get_total_parameters(model)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return index, len(shards), len(params)


def synth_checkpoint(
    out: Path | str,
    options: SynthOptions,
    progress: Callable[[str], None] = note,
    show_progress: bool = True,
) -> SynthReport:
    """Write a random-weight int4 checkpoint of ``options.geometry`` to ``out``.

    The directory appears complete or not at all (written under a temporary
    name, then renamed).

    Raises:
        FileExistsError: ``out`` exists and ``options.force`` is False.
    """
    out = Path(out)
    if out.exists() and not options.force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    start = time.perf_counter()
    model, config = quantized_model(source_config(options), options.seed, options.quantize_embeddings)
    config["edge0_synthetic"] = synthetic_origin(options)
    router_seconds = 0.0
    with atomic_directory(out, replace=options.force) as tmp:
        index, n_shards, n_tensors = _write_shards(tmp, model, options.seed, progress)
        if options.routing != "random":
            calibration = _set_routers(tmp, model, options, index["weight_map"], show_progress)
            router_seconds = calibration.seconds
            config["edge0_synthetic"]["router"] = calibration.as_dict()
            progress(
                f"[synth] {options.routing} routers in {router_seconds:.1f} s: held-out coverage90 "
                f"{calibration.mean('coverage90'):.3f}, reuse {calibration.mean('reuse'):.3f}, "
                f"{calibration.mean('distinct'):.1f} distinct experts per layer"
            )
        with open(tmp / "model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=4)
        save_config(config, tmp / "config.json")
    return SynthReport(
        path=out,
        shards=n_shards,
        tensors=n_tensors,
        total_bytes=index["metadata"]["total_size"],
        seconds=time.perf_counter() - start,
        router_seconds=router_seconds,
    )


def _set_routers(root: Path, model: nn.Module, options: SynthOptions, weight_map: dict, show_progress: bool):
    """Load the written weights into ``model`` (float32, as the bench runs),
    calibrate its routers and overwrite them in the shards.

    Loads are lazy, and each decoder layer's weights are loaded lazily again
    once the calibration forward is past it, so about one layer is resident."""
    files = sorted(set(weight_map.values()))
    model.load_weights([item for f in files for item in mx.load(str(root / f)).items()])
    model.set_dtype(mx.float32)
    layer_files = {}
    for name, file in weight_map.items():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m:
            layer_files[int(m.group(1))] = file

    def release(layer: int) -> None:
        loaded = mx.load(str(root / layer_files[layer])).items()
        model.load_weights(
            [(n, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for n, v in loaded], strict=False
        )

    vocab = text_config(source_config(options))["vocab_size"]
    calibration, tensors = calibrate_routers(
        model, options.routing, vocab_size=vocab, seed=options.seed, show_progress=show_progress, release=release
    )
    patch_tensors(root, tensors, weight_map)
    return calibration
