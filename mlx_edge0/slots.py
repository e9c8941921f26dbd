"""Slot buffers: stacked expert tensors allocated once, rewritten row by row.

A :class:`SlotBuffers` is nine MLX arrays ``[capacity, ...]`` (gate/up/down x
weight/scales/biases), created and evaluated once on the compute thread. A row
is a *slot*; the expert store fills rows in place with ``preadv`` and resident
rows are copied with a memcpy, so no step re-stacks tensors or keeps a second
copy of a bundle beside the stacked view. Scales and biases are held in the
checkpoint's dtype (cast at each call, for the rows the call uses) or in the
compute dtype (converted once when a row is filled): ``Options.row_scales``.

Every part's rows start on a page boundary (:data:`PAGE`; MLX's own buffers
start a few bytes past one), so uncached ``O_DIRECT`` reads of parts whose
sizes are whole pages land in place instead of through a bounce buffer.

Invariant: a row is only rewritten when no unevaluated graph still reads it.
It is enforced by the only two ways in and out of the rows: every
computation from them goes through :meth:`SlotBuffers.compute`, which records
it, and every write goes through :meth:`SlotBuffers.rows_for_writing` (the
store's reads) or :meth:`SlotBuffers.copy_row`, which evaluate the recorded
computations first: those that read the rows written, where a computation
names its rows, else every one. Named rows let a write land beside a
computation still queued without waiting for it (the hot cache's reads for
the next decode step, while the step before computes its last layers from
other rows); :meth:`SlotBuffers.open_forward` evaluates those recorded two
forwards back, already evaluated in a decode loop, so they are not kept.
Waiting costs nothing where a step is evaluated before the next is built; it
matters when a caller builds several steps without evaluating them (e.g.
teacher-forced scoring one token at a time).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

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
        # computations from the rows not known to be evaluated: (the rows they read, None:
        # any; the forward they were recorded in; the output)
        self._readers: list[tuple[Optional[frozenset[int]], int, mx.array]] = []
        self._forward = 0
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
        recorded computation that may read them is evaluated. Call on the
        compute thread."""
        written = {int(r) for r in rows}
        if written:
            self._settle_readers(lambda read, _: read is None or not read.isdisjoint(written))
        return [self.row_views(row) for row in rows]

    def copy_row(self, src: "SlotBuffers", src_row: int, dst_row: int) -> None:
        """memcpy one resident bundle into a row (same geometry and dtype),
        once the rows' readers are evaluated."""
        for d, s in zip(self.rows_for_writing([dst_row])[0], src.row_views(src_row)):
            d[:] = s

    def compute(
        self,
        x: mx.array,
        indices: mx.array,
        scales_dtype: Optional[mx.Dtype],
        rows: Optional[np.ndarray] = None,
        used: Optional[np.ndarray] = None,
    ) -> mx.array:
        """:func:`expert_glu` of ``x`` with rows ``indices`` (scales cast to
        ``scales_dtype``), recorded as reading the rows until a write that
        may change them: ``rows``, every row ``indices`` can name (None: any
        row, so every write waits for it).

        ``used``: the rows ``indices`` can name, known on the host (default
        ``rows``). Where the rows hold scales in another dtype than
        ``scales_dtype``, only these rows are gathered and cast, not every
        row of the buffer (a hot cache's thousand, at each call); the
        products are the same.

        The output itself is kept (no extra op, so settling an evaluated one
        launches nothing); these buffers are read only at decode and for small
        prompt chunks, so what is kept is small: with ``rows`` named (decode
        calls), for two forwards at most (:meth:`open_forward`)."""
        weights = self.weights()
        used = rows if used is None else used
        if scales_dtype is not None and scales_dtype != self.scales_dtype and used is not None:
            picked = np.unique(np.asarray(used, np.uint32))
            position = np.zeros(self.capacity, np.uint32)
            position[picked] = np.arange(len(picked), dtype=np.uint32)
            weights = weights.take(mx.array(picked))
            indices = mx.take(mx.array(position), indices)
        y = expert_glu(x, indices, weights.with_scales_dtype(scales_dtype))
        read = None if rows is None else frozenset(int(r) for r in np.asarray(rows).ravel())
        self._readers.append((read, self._forward, y))
        return y

    def open_forward(self) -> None:
        """A forward opens: evaluate the computations recorded before the last
        one opened. In a decode loop, whose step n - 1 is evaluated before
        step n + 1 is built, they are evaluated already and this launches
        nothing; it bounds what is kept to two forwards' outputs."""
        last = self._forward
        self._settle_readers(lambda _, forward: forward < last)
        self._forward += 1

    def _settle_readers(self, settles: Callable[[Optional[frozenset[int]], int], bool]) -> None:
        """Evaluate and forget the recorded computations ``settles(rows, forward)`` picks."""
        picked, kept = [], []
        for reader in self._readers:
            (picked if settles(reader[0], reader[1]) else kept).append(reader)
        if picked:
            mx.eval([y for _, _, y in picked])
            self._readers = kept

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
