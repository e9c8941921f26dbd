"""Source architectures the converter accepts, with their expert key names.

One entry per mlx-lm model_type. Key names are relative to a MoE layer's
``mlp.`` prefix. The stock model's ``sanitize`` (run on the whole, lazy weight
dict) turns every listed source form into mlx-lm's stacked ``switch_mlp``
names, so the converter itself handles one form only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..families import check_covers

# Key forms, written once.
STACKED = "switch_mlp.{proj}.{weight|scales|biases}"  # mlx-community / mlx-lm
PER_EXPERT = "experts.{e}.{proj}.weight"  # Hugging Face
PER_EXPERT_QUANTIZED = "experts.{e}.{proj}.{weight|scales|biases}"  # older mlx exports
FUSED = "experts.gate_up_proj + experts.down_proj"  # Hugging Face Qwen3.5/3.6-MoE

_PATTERNS = {
    STACKED: re.compile(r"\.mlp\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases)$"),
    PER_EXPERT: re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    PER_EXPERT_QUANTIZED: re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.(scales|biases)$"),
    FUSED: re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$"),
}


@dataclass(frozen=True)
class SourceArchitecture:
    """A convertible model_type and the expert key forms it may come in."""

    model_type: str
    expert_forms: tuple[str, ...]
    description: str


ARCHITECTURES: dict[str, SourceArchitecture] = {
    a.model_type: a
    for a in (
        SourceArchitecture("qwen3_moe", (STACKED, PER_EXPERT), "Qwen3-MoE (30B-A3B, 235B-A22B)"),
        SourceArchitecture("qwen3_next", (STACKED, PER_EXPERT), "Qwen3-Next (80B-A3B)"),
        SourceArchitecture("qwen3_5_moe", (STACKED, FUSED), "Qwen3.5/3.6-MoE (35B-A3B), also text-only configs"),
        SourceArchitecture("bailing_moe", (STACKED, PER_EXPERT, PER_EXPERT_QUANTIZED), "Ling / Ring 2.0 (bailing_moe)"),
        SourceArchitecture("bailing_moe_v3", (STACKED, PER_EXPERT), "Ling 3.0 (bailing_moe_v3 / bailing_hybrid)"),
    )
}
check_covers(ARCHITECTURES, __name__)


def detect_forms(keys) -> list[str]:
    """Which expert key forms appear among raw source tensor names."""
    found = []
    for form, pattern in _PATTERNS.items():
        if any(pattern.search(k) for k in keys):
            found.append(form)
    return found
