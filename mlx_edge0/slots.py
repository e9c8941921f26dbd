"""Slot buffers: stacked expert tensors allocated once, rewritten row by row.

A :class:`SlotBuffers` is nine MLX arrays ``[capacity, ...]`` (gate/up/down x
weight/scales/biases), created and evaluated once on the compute thread. A row
is a *slot*; the expert store fills rows in place with ``preadv`` and resident
rows are copied with a memcpy, so no step re-stacks tensors or keeps a second
copy of a bundle beside the stacked view. Scales and biases are held in the
compute dtype, converted once when a row is filled, so every ``gather_qmm``
sees one dtype.

Every part's rows start on a page boundary (:data:`PAGE`; MLX's own buffers
start a few bytes past one), so uncached ``O_DIRECT`` reads of parts whose
sizes are whole pages land in place instead of through a bounce buffer.

Invariant: a row is only rewritten when no unevaluated graph still reads it.
It is enforced by the only two ways in and out of the rows: every
computation from them goes through :meth:`SlotBuffers.compute`, which records
it, and every write goes through :meth:`SlotBuffers.rows_for_writing` (the
store's reads) or :meth:`SlotBuffers.copy_row`, which evaluate the recorded
computations first. In a decode loop each step is evaluated before the next
is built, so this costs nothing; it matters when a caller builds several
steps without evaluating them (e.g. teacher-forced scoring one token at a
time).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .checkpoint import ExpertGeometry
from .expert_math import ExpertWeights, Projection, expert_glu
from .tensorfile import DTYPES, MX_TO_CODE

PAGE = 4096  # alignment of each part's data (and of O_DIRECT offsets, lengths, buffers)


def address(view: memoryview) -> int:
    """The address of a buffer's first byte."""
    return np.frombuffer(view, np.uint8).ctypes.data


def page_aligned_zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Evaluated zeros whose data starts on a :data:`PAGE` boundary: a view
    into a buffer one page larger."""
    n = math.prod(shape)
    flat = mx.zeros((n + PAGE // dtype.size,), dtype)
    mx.eval(flat)
    skip = (-address(memoryview(flat).cast("B"))) % PAGE // dtype.size
    out = flat[skip : skip + n].reshape(shape)
    mx.eval(out)
    return out


class SlotBuffers:
    """``capacity`` expert rows of one geometry; see the module docstring."""

    def __init__(self, geometry: ExpertGeometry, capacity: int, scales_dtype: Optional[mx.Dtype] = None):
        if capacity < 1:
            raise ValueError(f"slot buffers need at least one row, got {capacity}")
        self.geometry = geometry
        self.capacity = capacity
        disk_scales = DTYPES[geometry.scales_dtype][0]
        self.scales_dtype = scales_dtype or disk_scales
        self.scales_code = MX_TO_CODE[self.scales_dtype]
        self.arrays: list[mx.array] = []
        for _, part, dtype, shape in geometry.parts():
            dt = DTYPES[dtype][0] if part == "weight" else self.scales_dtype
            self.arrays.append(page_aligned_zeros((capacity, *shape), dt))
        self._views = [memoryview(a).cast("B") for a in self.arrays]
        self._readers: list[mx.array] = []  # computations from the rows not known to be evaluated
        self.row_bytes = [v.nbytes // capacity for v in self._views]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._views)

    @staticmethod
    def row_nbytes(geometry: ExpertGeometry, scales_dtype: mx.Dtype) -> int:
        """Bytes of one row (scales/biases in ``scales_dtype``): what a budget buys."""
        size = scales_dtype.size
        return sum(
            math.prod(shape) * (DTYPES[dtype][1] if part == "weight" else size)
            for _, part, dtype, shape in geometry.parts()
        )

    def row_views(self, row: int) -> list[memoryview]:
        """Byte views of one row's nine parts. Only for reading, or for
        writing through :meth:`rows_for_writing`."""
        return [v[row * n : (row + 1) * n] for v, n in zip(self._views, self.row_bytes)]

    def rows_for_writing(self, rows: Sequence[int]) -> list[list[memoryview]]:
        """Writable byte views of ``rows`` (for I/O threads), once every
        computation recorded as reading these buffers is evaluated. Call on
        the compute thread."""
        self._settle_readers()
        return [self.row_views(row) for row in rows]

    def copy_row(self, src: "SlotBuffers", src_row: int, dst_row: int) -> None:
        """memcpy one resident bundle into a row (same geometry and dtype),
        once the rows' readers are evaluated."""
        for d, s in zip(self.rows_for_writing([dst_row])[0], src.row_views(src_row)):
            d[:] = s

    def compute(self, x: mx.array, indices: mx.array, scales_dtype: Optional[mx.Dtype]) -> mx.array:
        """:func:`expert_glu` of ``x`` with rows ``indices`` (scales cast to
        ``scales_dtype``), recorded as reading the rows until the next write.

        The output itself is kept (no extra op, so settling an evaluated one
        launches nothing); these buffers are read only at decode and for small
        prompt chunks, so what is kept is small, and only until the next
        rewrite."""
        y = expert_glu(x, indices, self.weights().with_scales_dtype(scales_dtype))
        self._readers.append(y)
        return y

    def _settle_readers(self) -> None:
        if self._readers:
            mx.eval(self._readers)
            self._readers.clear()

    def weights(self) -> ExpertWeights:
        a = self.arrays
        g = self.geometry
        return ExpertWeights(
            Projection(*a[0:3]),
            Projection(*a[3:6]),
            Projection(*a[6:9]),
            group_size=g.group_size,
            bits=g.bits,
        )
