"""Model patches: one small module per mlx-lm architecture family.

Each module says where a family's MoE block, router, shared expert(s) and
post-attention norm are, which routing math applies, and declares
``Model(Edge0Model, <stock Model>)``. No model code is copied from mlx-lm.
This registry maps config ``model_type`` (after mlx-lm's own remapping) to
the family.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

from ..checkpoint import CheckpointError
from ..families import FAMILIES, check_covers


@dataclass(frozen=True)
class Family:
    """A supported architecture: the stock mlx-lm module and our patched Model."""

    model_type: str
    stock_module: ModuleType
    model_class: type


# resolved model_type -> (patch module, attribute of its patched Model class)
_REGISTRY = {
    "qwen3_moe": ("qwen3_moe", "Model"),
    "qwen3_next": ("qwen3_next", "Qwen3NextModel"),
    "qwen3_5_moe": ("qwen3_next", "Qwen3_5MoeModel"),
    "bailing_moe": ("bailing", "BailingMoeModel"),
    "bailing_moe_v3": ("bailing", "BailingMoeV3Model"),
}
ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}
check_covers(_REGISTRY, __name__)
SUPPORTED = FAMILIES


def resolve_model_type(config: dict) -> str:
    """The mlx-lm module name a config loads with (mlx-lm's remapping rules)."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for arch in architectures:
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, arch))
        if remapped is not None:
            return remapped
    model_type = MODEL_REMAPPING.get(model_type, model_type)
    return ALIASES.get(model_type, model_type)


def family_for(config: dict, where: Path | str) -> Family:
    """The family of a config, or a clear error naming ``where``."""
    resolved = resolve_model_type(config)
    if resolved not in _REGISTRY:
        raise CheckpointError(
            f"{where}: model_type {config.get('model_type')!r} is not supported by "
            f"mlx-edge0 (supported: {', '.join(SUPPORTED)})"
        )
    module_name, attr = _REGISTRY[resolved]
    patch = importlib.import_module(f"{__name__}.{module_name}")
    model_class = getattr(patch, attr)
    stock = importlib.import_module(f"mlx_lm.models.{resolved}")
    return Family(resolved, stock, model_class)
