"""The converter: source MoE checkpoints -> edge0 checkpoints."""

from .converter import ConversionError, ConvertOptions, ConvertReport, convert, resolve_source
from .registry import ARCHITECTURES, detect_forms

__all__ = [
    "ARCHITECTURES",
    "ConversionError",
    "ConvertOptions",
    "ConvertReport",
    "convert",
    "detect_forms",
    "resolve_source",
]
