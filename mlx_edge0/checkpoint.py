"""The edge0 checkpoint directory: what is where, and the ``edge0`` config section.

Layout::

    config.json            source config + "model_file" + "quantization" + "edge0"
    edge0_model.py         one-line shim that imports mlx_edge0 (trust_remote_code)
    model.safetensors      resident weights, mlx-lm names and quantization
    experts/layer_NNN.safetensors
                           one file per MoE layer; expert e's nine tensors
                           ``experts.{e}.{gate,up,down}_proj.{weight,scales,biases}``
                           are adjacent, so one expert is ONE contiguous read,
                           and each expert starts on an ``alignment`` boundary
                           (``experts.{e}.pad`` fills the gap when needed)
    tokenizer files

Every expert file is a valid safetensors file (``mx.load`` reads it); the
byte layout is what the expert store relies on and validates.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .tensorfile import nbytes_of

CONFIG_FILE = "config.json"
SHIM_FILE = "edge0_model.py"
SHIM_SOURCE = "from mlx_edge0.plugin import bind; Model, ModelArgs = bind(__file__)  # noqa\n"
RESIDENT_FILE = "model.safetensors"
EXPERT_DIR = "experts"
FORMAT_VERSION = 1
ALIGNMENT = 4096
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")
SCALE_DTYPES = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """An edge0 checkpoint directory is incomplete or inconsistent."""


def expert_file(layer: int) -> str:
    """Path of a MoE layer's expert file, relative to the checkpoint dir."""
    return f"{EXPERT_DIR}/layer_{layer:03d}.safetensors"


def tensor_name(expert: int, projection: str, part: str) -> str:
    return f"experts.{expert}.{projection}.{part}"


@dataclass(frozen=True)
class ExpertGeometry:
    """Shapes of one routed expert, stored int4 affine (or ``bits``) per group."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    bits: int = 4
    group_size: int = 64
    scales_dtype: str = "BF16"

    def __post_init__(self):
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"expert geometry: {name} must be positive")
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"expert geometry: unsupported bits {self.bits}")
        for dim in (self.hidden_size, self.intermediate_size):
            if dim % self.group_size or (dim * self.bits) % 32:
                raise ValueError(
                    f"expert geometry: dimension {dim} is not a multiple of "
                    f"group_size {self.group_size} (and of 32/bits words)"
                )
        if self.scales_dtype not in SCALE_DTYPES:
            raise ValueError(f"expert geometry: scales dtype {self.scales_dtype!r}")

    def projection_dims(self, projection: str) -> tuple[int, int]:
        """(output_dims, input_dims) of a projection."""
        d, i = self.hidden_size, self.intermediate_size
        return (d, i) if projection == "down_proj" else (i, d)

    def part_spec(self, projection: str, part: str) -> tuple[str, tuple[int, int]]:
        """(dtype code, shape) of one stored part of one expert."""
        out_dims, in_dims = self.projection_dims(projection)
        if part == "weight":
            return "U32", (out_dims, in_dims * self.bits // 32)
        return self.scales_dtype, (out_dims, in_dims // self.group_size)

    def parts(self) -> list[tuple[str, str, str, tuple[int, int]]]:
        """(projection, part, dtype, shape) in on-disk order within a bundle."""
        return [(proj, part, *self.part_spec(proj, part)) for proj in PROJECTIONS for part in PARTS]

    @property
    def bundle_bytes(self) -> int:
        """Bytes of one expert's nine tensors (without alignment padding)."""
        return sum(nbytes_of(dtype, shape) for _, _, dtype, shape in self.parts())

    def pad_bytes(self, alignment: int = ALIGNMENT) -> int:
        return (-self.bundle_bytes) % alignment

    def file_entries(self, alignment: int = ALIGNMENT) -> list[tuple[str, str, tuple[int, ...]]]:
        """Planned tensors of a layer file, in write order (see module doc)."""
        pad = self.pad_bytes(alignment)
        entries = []
        for e in range(self.num_experts):
            for proj, part, dtype, shape in self.parts():
                entries.append((tensor_name(e, proj, part), dtype, shape))
            if pad:
                entries.append((f"experts.{e}.pad", "U8", (pad,)))
        return entries


@dataclass(frozen=True)
class Edge0Section:
    """The ``edge0`` section of config.json."""

    source_model_type: str
    moe_layers: tuple[int, ...]
    experts: ExpertGeometry
    num_experts_per_tok: int
    format_version: int = FORMAT_VERSION
    alignment: int = ALIGNMENT
    prerouter: Optional[dict] = None  # validated by mlx_edge0.prerouter_heads.load_heads
    # Set by convert (see mlx_edge0.integrity): the id every file's header
    # carries, and file (relative path) -> SHA-256 of what was written.
    generation: Optional[str] = None
    sha256: Optional[dict[str, str]] = None

    @property
    def consumer_k(self) -> int:
        """The K the prerouted (consumer) layers route with: the heads' K when
        the checkpoint has heads (so swapping the heads file swaps K), else
        the native K."""
        if self.prerouter:
            return int(self.prerouter.get("k", self.num_experts_per_tok))
        return self.num_experts_per_tok

    @property
    def expert_files(self) -> tuple[str, ...]:
        """The expert files' paths relative to the checkpoint, in layer order."""
        return tuple(expert_file(layer) for layer in self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for optional in ("prerouter", "generation", "sha256"):
            if d[optional] is None:
                del d[optional]
        d["moe_layers"] = list(self.moe_layers)
        d["expert_files"] = list(self.expert_files)
        return d

    @classmethod
    def from_config(cls, config: dict, where: Path | str = CONFIG_FILE) -> "Edge0Section":
        """Read and validate the section; errors name ``where``."""
        section = config.get("edge0")
        if not isinstance(section, dict):
            raise CheckpointError(
                f"{where}: no 'edge0' section; this is not an edge0 checkpoint "
                "(convert it with `edge0 convert SRC OUT`)"
            )
        try:
            version = int(section.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise CheckpointError(
                    f"{where}: edge0 format_version {version} is not supported "
                    f"(this mlx-edge0 reads version {FORMAT_VERSION}); re-convert"
                )
            experts = ExpertGeometry(**section["experts"])
            layers = tuple(int(x) for x in section["moe_layers"])
            k = int(section["num_experts_per_tok"])
            alignment = int(section.get("alignment", ALIGNMENT))
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed 'edge0' section ({e})") from None
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise CheckpointError(f"{where}: edge0.moe_layers {list(layers)} is invalid")
        if not 0 < k <= experts.num_experts:
            raise CheckpointError(f"{where}: edge0.num_experts_per_tok {k} is invalid")
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{where}: edge0.alignment {alignment} is not a power of two")
        generation = section.get("generation")
        if generation is not None and (not isinstance(generation, str) or not generation):
            raise CheckpointError(f"{where}: edge0.generation {generation!r} is not a non-empty string")
        sha256 = section.get("sha256")
        if sha256 is not None and not (
            isinstance(sha256, dict)
            and all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in sha256.items())
        ):
            raise CheckpointError(f"{where}: edge0.sha256 must map file names to SHA-256 hex digests")
        outside = [k for k in sha256 or {} if Path(k).is_absolute() or ".." in Path(k).parts]
        if outside:
            raise CheckpointError(f"{where}: edge0.sha256 names files outside the checkpoint: {outside[:3]}")
        return cls(
            source_model_type=str(section["source_model_type"]),
            moe_layers=layers,
            experts=experts,
            num_experts_per_tok=k,
            format_version=version,
            alignment=alignment,
            prerouter=section.get("prerouter"),
            generation=generation,
            sha256=sha256,
        )


def read_config(path: Path | str) -> dict:
    """config.json of a checkpoint dir, with a clear error when unreadable."""
    file = Path(path) / CONFIG_FILE
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: not found") from None
    except OSError as e:  # permissions, a directory, I/O errors
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{file}: not a model config (no 'model_type')")
    return config


def text_config(config: dict) -> dict:
    """The language-model part of a config (Qwen3.5 nests it in text_config)."""
    return config.get("text_config", config)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


__all__ = [
    "ALIGNMENT",
    "CheckpointError",
    "Edge0Section",
    "ExpertGeometry",
    "expert_file",
    "read_config",
    "tensor_name",
]
