"""The expert store: per-layer expert files, validated once, read by byte range.

Contract:
- Every layer file's header is validated at open (offsets inside the file, no
  overlap, each expert's nine tensors adjacent, dtype and shape exactly those
  of the config's expert geometry, the generation of config.json), so a bad
  file, or one of another conversion, fails at load, naming itself.
- Reads use ``os.preadv`` from a small thread pool straight into MLX-owned
  buffers allocated on the calling (compute) thread: no mmap page faults, no
  second copy. Reads the caller waits on at once (``urgent``: on-demand
  misses) have their own threads, so they never queue behind read-ahead (a
  prerouted step's fills are hundreds of reads issued when the step opens).
  Reads that may turn out unneeded (:meth:`ExpertStore.queue_reads`) run one
  at a time, in order, on a thread of their own, and each can be cancelled
  until it starts.
  I/O threads touch only memoryviews and file descriptors, never MLX arrays
  or graphs (graphs are thread-bound in MLX).
- A failed read is raised in the caller as :class:`ExpertReadError` naming the
  file, the byte range and the cause; it never hangs, and it is counted
  (``read_errors``). An open descriptor keeps reading the file it opened
  even after that file was replaced or deleted, so after a failure every
  layer file whose path now names another file (or none) is reopened and its
  header validated again before the next read, once no read is in flight on
  the old descriptor: a file restored by renaming a copy over it is picked
  up, a missing or broken one fails with its name and problem.
- ``bypass_page_cache`` reads around the OS page cache: ``O_DIRECT`` on Linux
  (the kernel needs block-aligned buffers, offsets and lengths: a read
  whose destinations are all whole pages, as the rows of slot buffers and
  the I/O threads' widening scratch are when the tensors are, lands in
  place; any other read goes through the I/O thread's page-aligned bounce
  buffer and is copied on), ``F_NOCACHE`` on macOS (no alignment needed:
  straight into the rows). For checkpoints that
  do not fit in memory, where filling and reclaiming the page cache costs the
  kernel CPU time the compute thread needs (see docs/design.md).

The reads themselves (``preadv``, ``O_DIRECT``, widening) are
:mod:`mlx_edge0.reads`; this module plans them and owns the files, threads
and batches.
"""

from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .checkpoint import Edge0Section, ExpertGeometry, expert_file, tensor_name
from .expert_math import ExpertWeights
from .integrity import check_generation
from .reads import DIRECT_FLAG, IOV_MAX, ExpertReadError, convertible, open_for_reads, read_run
from .slots import SlotBuffers
from .telemetry import Telemetry
from .tensorfile import DTYPES, MX_TO_CODE, TensorFileError, read_header


@dataclass(frozen=True)
class ReadRun:
    """One preadv: consecutive experts ``ids`` starting at file ``offset``,
    landing in rows ``first_row ...`` of the destination buffers."""

    first_row: int
    ids: tuple[int, ...]
    offset: int


def plan_reads(ids: Sequence[int], offsets: Sequence[int], stride: int, max_run: int) -> list[ReadRun]:
    """Coalesce experts whose bundles are adjacent on disk into single reads.

    Args:
        ids: expert ids in destination-row order (sorted ascending).
        offsets: file offset of every expert's bundle.
        stride: distance between consecutive bundles (bundle + padding).
        max_run: most experts per read (bounded by IOV_MAX).
    """
    runs: list[ReadRun] = []
    for row, e in enumerate(ids):
        if runs and len(runs[-1].ids) < max_run and offsets[e] == runs[-1].offset + stride * len(runs[-1].ids):
            last = runs[-1]
            runs[-1] = ReadRun(last.first_row, last.ids + (e,), last.offset)
        else:
            runs.append(ReadRun(row, (e,), offsets[e]))
    return runs


class LayerFile:
    """One open, validated ``experts/layer_NNN.safetensors``."""

    def __init__(
        self,
        path: Path,
        geometry: ExpertGeometry,
        alignment: int,
        bypass_page_cache: bool = False,
        *,
        generation: Optional[str] = None,
    ):
        self.path = path
        self.bypass_page_cache = bypass_page_cache
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
                f"{path}: holds {len(header.entries)} tensors, expected {expected} for {geometry.num_experts} experts"
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
                    raise TensorFileError(f"{path}: expert {e}'s tensors are not adjacent at {name!r}")
                start = entry.start if start is None else start
                end = entry.end
            if start % alignment:
                raise TensorFileError(f"{path}: expert {e} starts at byte {start}, not aligned to {alignment}")
            offsets.append(start)
        self.offsets = offsets
        check_generation(path, header.metadata, generation)  # after the layout: its errors say more
        self.fd = open_for_reads(path, bypass_page_cache)
        self.direct = bypass_page_cache and DIRECT_FLAG != 0
        opened = os.fstat(self.fd)
        self.identity = (opened.st_dev, opened.st_ino)
        self.in_flight: list[Future] = []  # reads that may still use ``fd``

    def track(self, futures: list[Future]) -> None:
        self.in_flight = [f for f in self.in_flight if not f.done()] + futures

    def replaced(self) -> bool:
        """Whether the path now names another file (or none)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != self.identity

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ReadBatch:
    """Reads in flight for one layer (its *future*): ``wait`` blocks only here."""

    def __init__(
        self, futures: list[Future], loads: int, telemetry: Telemetry, on_error: Optional[Callable[[], None]] = None
    ):
        self.futures = futures
        self.loads = loads
        self.telemetry = telemetry
        self.on_error = on_error
        self._waited = False

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def cancel(self) -> bool:
        """Cancel the reads not started yet; True when none had started, so
        nothing was written (a queued batch is one read: all or nothing)."""
        return all([f.cancel() for f in self.futures])  # a list: try every one

    def settle(self) -> None:
        """Wait until no I/O thread writes into the targets any more, without
        consuming results: for read-ahead that is being discarded (a failure
        there is raised again by whoever reads that data for real)."""
        wait_all(self.futures)

    def wait(self) -> float:
        """Block until every read landed; raise the first failure (after all
        ended). Returns the seconds this call blocked (counted as exposed wait)."""
        if self._waited:
            return 0.0
        t0 = time.perf_counter()
        nbytes = 0
        error = None
        for f in self.futures:
            try:
                nbytes += f.result()
            except BaseException as e:
                error = error or e
        self._waited = True
        waited = time.perf_counter() - t0
        stats = self.telemetry.current
        stats.exposed_wait_s += waited
        if error is not None:
            stats.read_errors += 1
            if self.on_error is not None:
                self.on_error()
            raise error
        stats.expert_loads += self.loads
        stats.bytes_read += nbytes
        stats.reads += len(self.futures)
        return waited


class ExpertStore:
    """Reads routed experts of the MoE layers of one checkpoint."""

    def __init__(
        self,
        checkpoint_dir: Path | str,
        section: Edge0Section,
        io_threads: int = 4,
        telemetry: Optional[Telemetry] = None,
        bypass_page_cache: bool = False,
        layers: Optional[Sequence[int]] = None,
        experts: Optional[Sequence[int]] = None,
    ):
        """
        Args:
            layers: the MoE layers this process runs (default all): only
                their files are opened (a pipeline stage's share).
            experts: the experts of each layer this process may read
                (default all; an expert-parallel rank's share): a read of
                any other is an error.
        """
        self.checkpoint_dir = Path(checkpoint_dir)
        self.geometry = section.experts
        self.alignment = section.alignment
        self.generation = section.generation
        self.telemetry = telemetry or Telemetry()
        self.bypass_page_cache = bypass_page_cache
        self.suspect = False  # a read failed: check every file before the next read
        self.layers: dict[int, LayerFile] = {}
        self.readable = np.ones(self.geometry.num_experts, bool)
        if experts is not None:
            self.readable[:] = False
            self.readable[np.asarray(experts, np.int64)] = True
        self._pools: tuple[ThreadPoolExecutor, ...] = ()
        try:
            for layer in section.moe_layers if layers is None else layers:
                path = self.checkpoint_dir / expert_file(layer)
                if not path.exists():
                    raise TensorFileError(f"{path}: expert file for MoE layer {layer} is missing")
                self.layers[layer] = LayerFile(
                    path, self.geometry, section.alignment, bypass_page_cache, generation=section.generation
                )
        except BaseException:
            self.close()
            raise
        self._pools = (
            ThreadPoolExecutor(io_threads, thread_name_prefix="edge0-io"),
            ThreadPoolExecutor(io_threads, thread_name_prefix="edge0-io-urgent"),
            ThreadPoolExecutor(1, thread_name_prefix="edge0-io-queue"),
        )
        weakref.finalize(self, _release, self._pools, self.layers.values())
        self._pad = bytearray(max(1, self.geometry.pad_bytes(section.alignment)))

    def submit(
        self,
        layer: int,
        ids: Sequence[int],
        rows: Sequence[int],
        target: SlotBuffers,
        drop_pages: bool = False,
        urgent: bool = False,
    ) -> ReadBatch:
        """Start reading expert ``ids[i]`` of ``layer`` into row ``rows[i]`` of ``target``.

        Experts adjacent on disk are coalesced into one preadv whatever their
        rows. ``drop_pages`` evicts the bytes from the OS page cache once they
        are in ``target`` (for one-shot streaming reads). ``urgent`` reads
        (the caller waits for them now) run on threads no read-ahead waits
        on. Every computation recorded as reading ``target`` is evaluated first
        (:meth:`SlotBuffers.rows_for_writing`). Call on the compute thread;
        returns at once.
        """
        return self._submit(layer, ids, rows, target, self._pools[1 if urgent else 0], drop_pages)

    def queue_reads(self, layer: int, ids: Sequence[int], rows: Sequence[int], target: SlotBuffers) -> list[ReadBatch]:
        """Read expert ``ids[i]`` of ``layer`` into row ``rows[i]`` of ``target``
        one at a time, in this order, on a thread of their own: one batch each,
        which :meth:`ReadBatch.cancel` drops until its read starts. For reads
        that may turn out unneeded: at most one is in flight when they do, to
        compete with the reads that are needed. Call on the compute thread."""
        batches: list[ReadBatch] = []
        try:
            for e, row in zip(ids, rows):
                batches.append(self._submit(layer, [e], [row], target, self._pools[2]))
        except BaseException:
            for batch in batches:  # then no read writes into rows the caller takes back
                batch.cancel() or batch.settle()
            raise
        return batches

    def _submit(
        self,
        layer: int,
        ids: Sequence[int],
        rows: Sequence[int],
        target: SlotBuffers,
        pool: ThreadPoolExecutor,
        drop_pages: bool = False,
    ) -> ReadBatch:
        lf = self._layer_file(layer)
        drop_pages = drop_pages and hasattr(os, "posix_fadvise") and not lf.bypass_page_cache
        pairs = sorted(zip((int(e) for e in ids), rows))
        if any(not 0 <= e < self.geometry.num_experts for e, _ in pairs):
            raise ValueError(f"layer {layer}: expert id out of range in {list(ids)}")
        if not all(self.readable[e] for e, _ in pairs):
            raise ValueError(
                f"layer {layer}: experts {[e for e, _ in pairs if not self.readable[e]]} are not this store's"
            )
        if self.telemetry.read_trace is not None and pairs:
            self.telemetry.read_trace.append((layer, [e for e, _ in pairs]))
        src_code, dst_code = self.geometry.scales_dtype, target.scales_code
        part_bytes = lf.part_bytes
        pad = memoryview(self._pad)[: lf.stride - lf.bundle_bytes]
        max_run = max(1, IOV_MAX // (len(part_bytes) + 1))
        views = target.rows_for_writing([row for _, row in pairs])  # settles the rows' readers
        futures = []
        for run in plan_reads([e for e, _ in pairs], lf.offsets, lf.stride, max_run):
            parts = []
            for j in range(len(run.ids)):
                parts.extend(zip(views[run.first_row + j], part_bytes))
                if pad.nbytes and j < len(run.ids) - 1:
                    parts.append((pad, pad.nbytes))
            futures.append(
                pool.submit(
                    read_run,
                    lf.fd,
                    parts,
                    run.offset,
                    lf.path,
                    src_code,
                    dst_code,
                    drop_pages,
                    lf.direct,
                )
            )
        lf.track(futures)
        return ReadBatch(futures, len(pairs), self.telemetry, on_error=self._read_failed)

    def _read_failed(self) -> None:
        self.suspect = True

    def _layer_file(self, layer: int) -> LayerFile:
        """The layer's open file; after a failed read, only once every
        replaced file is reopened and revalidated (see the module docstring)."""
        if self.suspect:
            for other, lf in self.layers.items():
                if lf.replaced():
                    wait_all(lf.in_flight)  # then nothing reads the old descriptor
                    try:
                        fresh = LayerFile(
                            lf.path, self.geometry, self.alignment, self.bypass_page_cache, generation=self.generation
                        )
                    except TensorFileError as e:
                        raise ExpertReadError(f"{e} (reopening it after a failed read)") from None
                    lf.close()
                    self.layers[other] = fresh
            self.suspect = False
        return self.layers[layer]

    def read(self, layer: int, ids: Sequence[int], scales_dtype: Optional[mx.Dtype] = None) -> ExpertWeights:
        """Read experts ``ids`` of ``layer`` into fresh stacked arrays (row i = ids[i])."""
        target = SlotBuffers(self.geometry, len(ids), pool_scales_dtype(self.geometry, scales_dtype))
        self.submit(layer, ids, range(len(ids)), target, urgent=True).wait()
        return target.weights().with_scales_dtype(scales_dtype)

    def close(self) -> None:
        """Stop the I/O threads and close the files."""
        _release(self._pools, self.layers.values())


def pool_scales_dtype(geometry, compute_dtype: Optional[mx.Dtype]) -> mx.Dtype:
    """The dtype slot buffers hold scales in: ``compute_dtype`` when the I/O
    threads can widen to it exactly, else (or with None) the on-disk dtype,
    cast at compute."""
    disk = DTYPES[geometry.scales_dtype][0]
    if compute_dtype is None:
        return disk
    return compute_dtype if convertible(geometry.scales_dtype, MX_TO_CODE[compute_dtype]) else disk


def _release(pools: Iterable[ThreadPoolExecutor], files: Iterable[LayerFile]) -> None:
    for pool in pools:
        pool.shutdown(wait=True)
    for lf in files:
        lf.close()


__all__ = ["ExpertStore", "ExpertReadError", "ReadBatch", "plan_reads", "ReadRun", "pool_scales_dtype"]
