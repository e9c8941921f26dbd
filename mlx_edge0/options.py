"""The one options record: every runtime knob, typed and validated once.

Options reach a model either from :func:`mlx_edge0.load` (keyword arguments) or,
when stock ``mlx_lm.generate`` / ``mlx_lm.server`` load a checkpoint, from their
defaults. The CLI is the only place that reads argv.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import mlx.core as mx

RUNTIME_KEY = "edge0_runtime"
COMPUTE_DTYPES = ("auto", "native", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Options:
    """Runtime options of a loaded edge0 model.

    Attributes:
        compute_dtype: "auto" computes in float32 on the CPU (MLX's CPU
            quantized kernels are scalar and 16-bit math is emulated: fp32 is
            faster and more accurate) and in the checkpoint's dtype on a GPU;
            "native" never casts; or an explicit float dtype.
        io_threads: threads that read expert bytes with ``preadv``.
    """

    compute_dtype: str = "auto"
    io_threads: int = 4

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                f"got {self.compute_dtype!r}"
            )
        if not isinstance(self.io_threads, int) or not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be an integer in 1..64, got {self.io_threads!r}")

    def dtype(self) -> Optional[mx.Dtype]:
        """The dtype floating weights are cast to, or None to keep them."""
        name = self.compute_dtype
        if name == "auto":
            return mx.float32 if mx.default_device() == mx.cpu else None
        if name == "native":
            return None
        return getattr(mx, name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "Options":
        d = d or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown edge0 option(s): {', '.join(unknown)}")
        return cls(**d)
