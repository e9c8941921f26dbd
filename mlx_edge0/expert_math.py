"""The one expert function every path uses: down(silu(gate(x)) * up(x)).

It makes exactly the calls mlx-lm's ``SwitchGLU`` makes on quantized experts
(``mx.gather_qmm`` per projection, tokens sorted by expert when there are many),
so a path differs from the resident model only in *where the stacked weights
come from*: with indices remapped into a stacked subset, the products are the
same products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.activations import swiglu

# Same threshold as SwitchGLU: sort (token, expert) rows by expert when many.
SORT_THRESHOLD = 64


@dataclass(frozen=True)
class Projection:
    """One stacked quantized projection: [n, out, in*bits/32] + [n, out, in/gs] x2."""

    weight: mx.array
    scales: mx.array
    biases: mx.array


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked weights of n experts, row i = the i-th expert of a read."""

    gate_proj: Projection
    up_proj: Projection
    down_proj: Projection
    group_size: int
    bits: int

    @property
    def num_experts(self) -> int:
        return self.gate_proj.weight.shape[0]

    def take(self, rows: mx.array) -> "ExpertWeights":
        """The stacked subset ``rows`` (row i = ``rows[i]``): a call casting
        scales then casts only the experts it uses, not a whole buffer."""

        def take(p: Projection) -> Projection:
            return Projection(*(mx.take(a, rows, axis=0) for a in (p.weight, p.scales, p.biases)))

        return ExpertWeights(take(self.gate_proj), take(self.up_proj), take(self.down_proj), self.group_size, self.bits)

    def with_scales_dtype(self, dtype: Optional[mx.Dtype]) -> "ExpertWeights":
        """Cast scales/biases once, so each gather_qmm sees one dtype."""
        if dtype is None:
            return self

        def cast(p: Projection) -> Projection:
            return Projection(p.weight, p.scales.astype(dtype), p.biases.astype(dtype))

        return ExpertWeights(
            cast(self.gate_proj),
            cast(self.up_proj),
            cast(self.down_proj),
            self.group_size,
            self.bits,
        )


def _qmm(x: mx.array, p: Projection, idx: mx.array, sorted_indices: bool, w: ExpertWeights):
    return mx.gather_qmm(
        x,
        p.weight,
        p.scales,
        p.biases,
        rhs_indices=idx,
        transpose=True,
        group_size=w.group_size,
        bits=w.bits,
        mode="affine",
        sorted_indices=sorted_indices,
    )


def expert_glu(x: mx.array, indices: mx.array, weights: ExpertWeights) -> mx.array:
    """Apply the routed experts.

    Args:
        x: activations ``[..., D]``.
        indices: ``[..., K]`` rows of ``weights`` (not global expert ids).
        weights: stacked experts.

    Returns:
        ``[..., K, D]`` expert outputs, before the routing weights.
    """
    x = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, D]
    indices = mx.stop_gradient(indices)
    do_sort = indices.size >= SORT_THRESHOLD
    idx, inv_order = indices, None
    if do_sort:
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        x, idx = x.flatten(0, -3)[order // k], flat[order]
    up = _qmm(x, weights.up_proj, idx, do_sort, weights)
    gate = _qmm(x, weights.gate_proj, idx, do_sort, weights)
    x = _qmm(swiglu(gate, up), weights.down_proj, idx, do_sort, weights)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, indices.shape)
    return x.squeeze(-2)
