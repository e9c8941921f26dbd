"""The expert store: per-layer expert files, validated once, read by byte range.

Contract:
- Every layer file's header is validated at open (offsets inside the file, no
  overlap, each expert's nine tensors adjacent, dtype and shape exactly those
  of the config's expert geometry), so a bad file fails at load, naming itself.
- Reads use ``os.preadv`` from a small thread pool straight into MLX-owned
  buffers allocated on the calling (compute) thread: no mmap page faults, no
  second copy. I/O threads touch only memoryviews and file descriptors, never
  MLX arrays or graphs (graphs are thread-bound in MLX).
- A failed read is raised in the caller as :class:`ExpertReadError` naming the
  file, the byte range and the cause; it never hangs.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from .checkpoint import PARTS, PROJECTIONS, Edge0Section, ExpertGeometry, expert_file, tensor_name
from .expert_math import ExpertWeights, Projection
from .tensorfile import DTYPES, TensorFileError, read_header

IOV_MAX = 1024


class ExpertReadError(OSError):
    """Reading expert bytes failed (I/O error, truncated file)."""


@dataclass(frozen=True)
class ReadRun:
    """One preadv: consecutive experts ``ids`` starting at file ``offset``,
    landing in rows ``first_row ...`` of the destination buffers."""

    first_row: int
    ids: tuple[int, ...]
    offset: int


def plan_reads(
    ids: Sequence[int], offsets: Sequence[int], stride: int, max_run: int
) -> list[ReadRun]:
    """Coalesce experts whose bundles are adjacent on disk into single reads.

    Args:
        ids: expert ids in destination-row order (sorted ascending).
        offsets: file offset of every expert's bundle.
        stride: distance between consecutive bundles (bundle + padding).
        max_run: most experts per read (bounded by IOV_MAX).
    """
    runs: list[ReadRun] = []
    for row, e in enumerate(ids):
        if (
            runs
            and len(runs[-1].ids) < max_run
            and offsets[e] == runs[-1].offset + stride * len(runs[-1].ids)
        ):
            last = runs[-1]
            runs[-1] = ReadRun(last.first_row, last.ids + (e,), last.offset)
        else:
            runs.append(ReadRun(row, (e,), offsets[e]))
    return runs


@dataclass
class StoreCounters:
    """What the store has read since the last reset (cheap; updated per read)."""

    expert_loads: int = 0
    bytes_read: int = 0
    reads: int = 0
    read_wait_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "expert_loads": self.expert_loads,
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "read_wait_ms": round(self.read_wait_s * 1e3, 3),
        }


class LayerFile:
    """One open, validated ``experts/layer_NNN.safetensors``."""

    def __init__(self, path: Path, geometry: ExpertGeometry, alignment: int):
        self.path = path
        self.geometry = geometry
        header = read_header(path)
        parts = geometry.parts()
        self.part_bytes = [DTYPES[d][1] * int(np.prod(s)) for _, _, d, s in parts]
        self.bundle_bytes = sum(self.part_bytes)
        pad = geometry.pad_bytes(alignment)
        self.stride = self.bundle_bytes + pad
        expected = 9 * geometry.num_experts + (geometry.num_experts if pad else 0)
        if len(header.entries) != expected:
            raise TensorFileError(
                f"{path}: holds {len(header.entries)} tensors, expected {expected} "
                f"for {geometry.num_experts} experts"
            )
        offsets = []
        for e in range(geometry.num_experts):
            start = None
            end = None
            for proj, part, dtype, shape in parts:
                name = tensor_name(e, proj, part)
                entry = header.entries.get(name)
                if entry is None:
                    raise TensorFileError(f"{path}: tensor {name!r} is missing")
                if entry.dtype != dtype or entry.shape != tuple(shape):
                    raise TensorFileError(
                        f"{path}: tensor {name!r} is {entry.dtype}{list(entry.shape)}, "
                        f"the config needs {dtype}{list(shape)}"
                    )
                if end is not None and entry.start != end:
                    raise TensorFileError(
                        f"{path}: expert {e}'s tensors are not adjacent at {name!r}"
                    )
                start = entry.start if start is None else start
                end = entry.end
            if start % alignment:
                raise TensorFileError(
                    f"{path}: expert {e} starts at byte {start}, not aligned to {alignment}"
                )
            offsets.append(start)
        self.offsets = offsets
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _preadv_exact(fd: int, views: list[memoryview], offset: int, path: Path) -> int:
    """preadv until every view is full; a short read means a truncated file."""
    total = sum(v.nbytes for v in views)
    done = 0
    pending = views
    while pending:
        try:
            n = os.preadv(fd, pending[:IOV_MAX], offset + done)
        except OSError as e:
            raise ExpertReadError(
                e.errno, f"{path}: read of {total} bytes at offset {offset} failed: {e.strerror}"
            ) from None
        if n == 0:
            raise ExpertReadError(
                f"{path}: short read {done}/{total} bytes at offset {offset} "
                "(the file is truncated or was replaced)"
            )
        done += n
        while pending and n >= pending[0].nbytes:
            n -= pending[0].nbytes
            pending = pending[1:]
        if pending and n:
            pending = [pending[0][n:]] + pending[1:]
    return total


@dataclass
class _Buffers:
    """Destination arrays of one read and the byte views I/O threads fill."""

    arrays: list[mx.array]
    views: list[memoryview] = field(default_factory=list)


class ExpertStore:
    """Reads routed experts of the MoE layers of one checkpoint."""

    def __init__(self, checkpoint_dir: Path | str, section: Edge0Section, io_threads: int = 4):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.geometry = section.experts
        self.layers: dict[int, LayerFile] = {}
        self._pool = None
        try:
            for layer in section.moe_layers:
                path = self.checkpoint_dir / expert_file(layer)
                if not path.exists():
                    raise TensorFileError(
                        f"{path}: expert file for MoE layer {layer} is missing"
                    )
                self.layers[layer] = LayerFile(path, self.geometry, section.alignment)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="edge0-io")
        weakref.finalize(self, _release, self._pool, list(self.layers.values()))
        self._pad = bytearray(max(1, self.geometry.pad_bytes(section.alignment)))
        self._lock = threading.Lock()
        self.counters = StoreCounters()

    @property
    def bundle_bytes(self) -> int:
        return self.geometry.bundle_bytes

    def _allocate(self, n: int) -> _Buffers:
        arrays = []
        for _, _, dtype, shape in self.geometry.parts():
            arrays.append(mx.zeros((n, *shape), dtype=DTYPES[dtype][0]))
        mx.eval(arrays)
        return _Buffers(arrays, [memoryview(a).cast("B") for a in arrays])

    def read(self, layer: int, ids: Sequence[int]) -> ExpertWeights:
        """Read experts ``ids`` (sorted, unique) of ``layer`` into stacked arrays.

        Row i of every returned array holds expert ``ids[i]``. Call on the
        compute thread; blocks until the bytes are in.
        """
        lf = self.layers[layer]
        ids = [int(e) for e in ids]
        if any(not 0 <= e < self.geometry.num_experts for e in ids):
            raise ValueError(f"layer {layer}: expert id out of range in {ids}")
        buffers = self._allocate(len(ids))
        part_bytes = lf.part_bytes
        has_pad = lf.stride != lf.bundle_bytes
        max_run = max(1, IOV_MAX // (len(part_bytes) + 1))
        futures: list[Future] = []
        t0 = time.perf_counter()
        for run in plan_reads(ids, lf.offsets, lf.stride, max_run):
            views = []
            for j in range(len(run.ids)):
                row = run.first_row + j
                for view, nb in zip(buffers.views, part_bytes):
                    views.append(view[row * nb : (row + 1) * nb])
                if has_pad and j < len(run.ids) - 1:
                    views.append(memoryview(self._pad)[: lf.stride - lf.bundle_bytes])
            futures.append(self._pool.submit(_preadv_exact, lf.fd, views, run.offset, lf.path))
        nbytes = 0
        error = None
        for f in futures:
            try:
                nbytes += f.result()
            except BaseException as e:  # raise the first, after all reads ended
                error = error or e
        if error is not None:
            raise error
        with self._lock:
            c = self.counters
            c.expert_loads += len(ids)
            c.bytes_read += nbytes
            c.reads += len(futures)
            c.read_wait_s += time.perf_counter() - t0
        a = buffers.arrays
        g = self.geometry
        return ExpertWeights(
            Projection(*a[0:3]), Projection(*a[3:6]), Projection(*a[6:9]),
            group_size=g.group_size, bits=g.bits,
        )

    def reset_counters(self) -> None:
        with self._lock:
            self.counters = StoreCounters()

    def close(self) -> None:
        """Stop the I/O threads and close the files."""
        _release(self._pool, list(self.layers.values()))


def _release(pool: ThreadPoolExecutor | None, files: list[LayerFile]) -> None:
    if pool is not None:
        pool.shutdown(wait=True)
    for lf in files:
        lf.close()


__all__ = ["ExpertStore", "ExpertReadError", "plan_reads", "ReadRun", "PARTS", "PROJECTIONS"]
